"""RMSNorm through the NKI kernels from PyTorch, checked against ``torch.nn.RMSNorm``.

On a Trn1/Trn2 instance with ``torch_xla`` and ``torch_neuronx`` installed the tensors live
on the XLA NeuronCore device and the kernels are compiled into the graph; anywhere else
they stay on the CPU and the kernels run in the NKI simulator (slow, but bit-faithful to
the kernel code). Prints the largest error of the output and of the gradients against
``torch.nn.RMSNorm`` evaluated in float64, and the time per call.

    python examples/rmsnorm_torch.py [--rows 256] [--hidden 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from nki_rmsnorm.torch import RMSNorm


def pick_device():
    try:
        import torch_neuronx  # noqa: F401
        import torch_xla.core.xla_model as xm
    except ImportError:
        return torch.device("cpu"), "CPU (kernels simulated)", lambda: None
    return xm.xla_device(), "XLA NeuronCore", xm.mark_step


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

    torch.manual_seed(0)
    shape = (args.batch, args.rows, args.hidden)
    x = torch.randn(shape).to(dtype)
    dy = torch.randn(shape).to(dtype)
    weight = (1 + 0.1 * torch.randn(args.hidden)).to(dtype)

    ours = RMSNorm(args.hidden, eps=1e-6, dtype=dtype).to(device)
    theirs = torch.nn.RMSNorm(args.hidden, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight.double())

    x_dev = x.clone().to(device).requires_grad_()
    y = ours(x_dev)
    y.backward(dy.to(device))
    sync()

    x64 = x.double().requires_grad_()  # float64: the reference, not a dtype under test
    y64 = theirs(x64)
    y64.backward(dy.double())

    eps_dtype = torch.finfo(dtype).eps

    def max_err(a, b):
        """Largest error, and that error relative to max |reference| in units of the dtype's
        epsilon (≈ 1 for a correctly rounded result at the largest value)."""
        err = (a.detach().cpu().double() - b.detach()).abs().max().item()
        scale = b.detach().abs().max().item() or 1.0
        return f"{err:.3e}  ({err / scale / eps_dtype:.2f} eps of max |ref|)"

    print(f"device: {where}; x {tuple(shape)} {args.dtype}")
    print(f"max |y - torch.nn.RMSNorm|        = {max_err(y, y64)}")
    print(f"max |dx - torch.nn.RMSNorm|       = {max_err(x_dev.grad, x64.grad)}")
    print(f"max |dweight - torch.nn.RMSNorm|  = {max_err(ours.weight.grad, theirs.weight.grad)}"
          f"  (sum over {args.batch * args.rows} rows)")

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
    print(f"time per call: forward {fwd_ms:.1f} ms, forward+backward {fwd_bwd_ms:.1f} ms "
          f"({args.iters} iterations; {where})")


if __name__ == "__main__":
    main()
