"""RMSNorm through the NKI kernels from PyTorch, two ways, checked against PyTorch's RMSNorm.

1. The Neuron RMSNorm tutorial's launch: ``nki_jit(kernel)(x, w, ..., out, ...)`` with a
   preallocated output (``torch_neuronx.nki_jit``, Neuron SDK 2.20 – 2.23; on later SDKs,
   which dropped it, the ``nki.jit`` kernel is called directly and returns its output).
2. The high-level API: ``nki_rmsnorm.torch.RMSNorm``, a drop-in for ``torch.nn.RMSNorm``
   (forward and backward are ``torch.library`` custom ops), also under ``torch.compile``.

On a Trn1/Trn2 instance with ``torch_xla`` and ``torch_neuronx`` the tensors live on the XLA
NeuronCore device and the kernels are compiled into the graph; anywhere else they stay on
the CPU, ``simulate.install()`` provides a simulated ``torch_neuronx.nki_jit`` and the kernels
run in the NKI simulator (slow, but bit-faithful to the kernel code). The script prints the
largest errors against ``torch.nn.functional.rms_norm`` in float64 and the time per call.

    python examples/rmsnorm_torch.py [--rows 256] [--hidden 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nki_rmsnorm import kernels
from nki_rmsnorm.torch import RMSNorm


def pick_device():
    """``(device, description, sync)``: the XLA NeuronCore when the SDK is installed, else
    the CPU with the simulated ``torch_neuronx`` registered."""
    try:
        import torch_neuronx  # noqa: F401
        import torch_xla.core.xla_model as xm
    except ImportError:
        import simulate

        simulate.install()  # `from torch_neuronx import nki_jit` → the CPU twin
        return torch.device("cpu"), "CPU (kernels simulated)", lambda: None
    return xm.xla_device(), "XLA NeuronCore", xm.mark_step


def tutorial_launch(x, weight, eps, device):
    """The tutorial's pattern: allocate the outputs, launch through ``nki_jit``. Returns
    ``(y, how)``."""
    import torch_neuronx

    x, weight = x.to(device), weight.to(device)
    nki_jit = getattr(torch_neuronx, "nki_jit", None)
    if nki_jit is None:  # SDK ≥ 2.24: call the nki.jit kernel directly
        y, _ = kernels.rmsnorm_fwd(x, weight, None, eps, 0.0, "gemma", None)
        return y, "nki.jit kernel called directly"
    y = torch.empty_like(x)
    rstd = torch.empty(x.shape[0], dtype=torch.float32, device=device)
    # nki_jit exists in the legacy SDKs only (2.20 - 2.23): the legacy kernels
    nki_jit(kernels.kernel("rmsnorm_fwd_out", "legacy"))(
        x, weight, None, y, rstd, eps=eps, offset=0.0, casting_mode="gemma"
    )
    return y, "torch_neuronx.nki_jit(rmsnorm_fwd_out)(x, w, None, y, rstd, ...)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rows", type=int, default=256, help="sequence length")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device, where, sync = pick_device()
    eps = 1e-6

    torch.manual_seed(0)
    shape = (args.batch, args.rows, args.hidden)
    x = torch.randn(shape).to(dtype)
    dy = torch.randn(shape).to(dtype)
    weight = (1 + 0.1 * torch.randn(args.hidden)).to(dtype)

    # float64 references: PyTorch's own RMSNorm, forward and backward
    x64 = x.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    y64 = F.rms_norm(x64, (args.hidden,), w64, eps)
    y64.backward(dy.double())

    eps_dtype = torch.finfo(dtype).eps

    def max_err(a, b):
        """Largest error, and that error relative to max |reference| in units of the dtype's
        epsilon (≈ 1 for a correctly rounded result at the largest value)."""
        err = (a.detach().cpu().double() - b.detach()).abs().max().item()
        scale = b.detach().abs().max().item() or 1.0
        return f"{err:.3e}  ({err / scale / eps_dtype:.2f} eps of max |ref|)"

    print(f"device: {where}; x {tuple(shape)} {args.dtype}")

    # 1. The tutorial's launch, on (rows, hidden)
    y_tutorial, how = tutorial_launch(x.reshape(-1, args.hidden), weight, eps, device)
    sync()
    print(f"[tutorial launch] {how}")
    print(f"max |y - F.rms_norm|              = {max_err(y_tutorial.reshape(shape), y64)}")

    # 2. The high-level API: the module, forward and backward
    ours = RMSNorm(args.hidden, eps=eps, dtype=dtype).to(device)
    with torch.no_grad():
        ours.weight.copy_(weight.to(device))
    x_dev = x.clone().to(device).requires_grad_()
    y = ours(x_dev)
    y.backward(dy.to(device))
    sync()
    print("[nki_rmsnorm.torch.RMSNorm]")
    print(f"max |y - F.rms_norm|              = {max_err(y, y64)}")
    print(f"max |dx - F.rms_norm|             = {max_err(x_dev.grad, x64.grad)}")
    print(
        f"max |dweight - F.rms_norm|        = {max_err(ours.weight.grad, w64.grad)}"
        f"  (sum over {args.batch * args.rows} rows)"
    )

    # ... and compiled: one graph, the kernels as custom ops (the CPU uses the eager
    # AOTAutograd backend; TorchNeuron has backend="neuron")
    if device.type == "cpu":
        compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
        y_compiled = compiled(x)
        print(
            f"torch.compile(fullgraph=True)     = bitwise equal to eager: "
            f"{torch.equal(y_compiled, ours(x))}"
        )

    def timed(fn):
        start = time.perf_counter()
        for _ in range(args.iters):
            fn()
        sync()
        return (time.perf_counter() - start) / args.iters * 1e3

    x_req = x.clone().to(device).requires_grad_()
    dy_dev = dy.to(device)
    fwd_ms = timed(lambda: ours(x_req))
    fwd_bwd_ms = timed(lambda: ours(x_req).backward(dy_dev))
    print(
        f"time per call: forward {fwd_ms:.1f} ms, forward+backward {fwd_bwd_ms:.1f} ms "
        f"({args.iters} iterations; {where})"
    )


if __name__ == "__main__":
    main()
