"""Overhead of the PyTorch custom-op dispatch over calling ``nki_rmsnorm.ops`` directly.

Times the simulated kernels on the CPU (CPU time of this process, which other processes on a
shared machine do not inflate as they do wall-clock time; median of ``--repeats`` runs, the
two ways interleaved): the forward, and forward +
backward, once through ``nki_rmsnorm.ops`` on NumPy arrays and once through
``nki_rmsnorm.torch.rms_norm`` (custom ops, autograd) on the same data as torch tensors.

    python scripts/bench_torch_overhead.py [--rows 2048] [--hidden 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ml_dtypes
import numpy as np
import torch

from nki_rmsnorm import ops
from nki_rmsnorm import torch as nki_torch


def _seconds(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.hidden, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(args.hidden, generator=g)).bfloat16()
    dy = torch.randn(args.rows, args.hidden, generator=g).bfloat16()

    def as_numpy(t):
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)

    x_np, w_np, dy_np = as_numpy(x), as_numpy(w), as_numpy(dy)

    def numpy_fwd():
        return ops.rms_norm_fwd(x_np, w_np, 1e-6)

    def numpy_fwd_bwd():
        _, rstd = ops.rms_norm_fwd(x_np, w_np, 1e-6)
        return ops.rms_norm_bwd(dy_np, x_np, w_np, rstd)

    def torch_fwd():
        with torch.no_grad():
            return nki_torch.rms_norm(x, args.hidden, w, 1e-6)

    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()

    def torch_fwd_bwd():
        x_leaf.grad = w_leaf.grad = None
        nki_torch.rms_norm(x_leaf, args.hidden, w_leaf, 1e-6).backward(dy)

    for name, direct, dispatched in (
        ("forward", numpy_fwd, torch_fwd),
        ("forward+backward", numpy_fwd_bwd, torch_fwd_bwd),
    ):
        direct(), dispatched()  # warm-up: plans, caches, first custom-op dispatch
        times = {"ops": [], "torch": []}
        for _ in range(args.repeats):
            times["ops"].append(_seconds(direct))
            times["torch"].append(_seconds(dispatched))
        t_ops, t_torch = (statistics.median(times[k]) for k in ("ops", "torch"))
        print(
            f"{name:17s} {args.rows}x{args.hidden} bf16: nki_rmsnorm.ops {t_ops * 1e3:8.1f} ms, "
            f"nki_rmsnorm.torch {t_torch * 1e3:8.1f} ms, overhead "
            f"{(t_torch / t_ops - 1) * 100:+.1f} % (median of {args.repeats})"
        )
    np.testing.assert_array_equal(  # the same kernels: the same bits
        torch_fwd().view(torch.int16).numpy(), numpy_fwd()[0].view(np.int16)
    )


if __name__ == "__main__":
    main()
