"""How fast the NKI simulator runs an efficient RMSNorm kernel, relative to plain NumPy.

Times (best of 3) a NumPy float32 RMSNorm of a rows × cols array against the simulator
running an RMSNorm kernel written with ``nki.isa`` on the same array in bfloat16, and prints
the ratio (the simulator's target: at most 5× NumPy on 4096 × 4096). The kernel per 128-row
tile: ``activation_reduce`` (square, fp32 row sums) → ``activation`` (rsqrt with scale 1/N
and an eps bias) → ``tensor_scalar`` (× rstd) → ``tensor_tensor`` (× the weight, broadcast
across partitions once, outside the loop).

    python scripts/sim_speed.py [--rows 4096] [--cols 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import time

import ml_dtypes
import numpy as np

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl

EPS = 1e-6


@nki.jit
def rmsnorm_fwd(x, weight, eps):
    """``y = x / sqrt(mean(x², axis=1) + eps) · weight`` for x (N, H) and weight (H,)."""
    n_rows, hidden = x.shape
    P = nl.tile_size.pmax
    y = nl.ndarray((n_rows, hidden), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(hidden)[None, :]
    w_row = nl.load(weight.reshape((1, hidden))[nl.arange(1)[:, None], i_f])
    w_tile = nl.broadcast_to(w_row, shape=(P, hidden))
    eps_col = nl.full((P, 1), eps, dtype=nl.float32)
    for t in nl.affine_range(math.ceil(n_rows / P)):
        rows = t * P + i_p
        valid = rows < n_rows
        x_tile = nl.load(x[rows, i_f], mask=valid)
        sum_sq = nl.ndarray((P, 1), dtype=nl.float32)
        nisa.activation_reduce(
            op=nl.square, data=x_tile, reduce_op=nl.add, reduce_res=sum_sq, mask=valid
        )
        rstd = nisa.activation(
            op=nl.rsqrt, data=sum_sq, scale=1.0 / hidden, bias=eps_col, mask=valid
        )
        normed = nisa.tensor_scalar(x_tile, np.multiply, rstd, mask=valid)
        y_tile = nisa.tensor_tensor(normed, w_tile, np.multiply, mask=valid)
        nl.store(y[rows, i_f], value=y_tile, mask=valid)
    return y


def numpy_rmsnorm(x, w, eps=EPS):
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps) * w


def best_of(repeat, fn):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((args.rows, args.cols), dtype=np.float32)
    w32 = rng.uniform(0.5, 1.5, args.cols).astype(np.float32)
    x16, w16 = x32.astype(ml_dtypes.bfloat16), w32.astype(ml_dtypes.bfloat16)

    numpy_s = best_of(args.repeat, lambda: numpy_rmsnorm(x32, w32))
    sim_s = best_of(args.repeat, lambda: rmsnorm_fwd(x16, w16, EPS))

    y = rmsnorm_fwd(x16, w16, EPS).astype(np.float64)
    ref = numpy_rmsnorm(x16.astype(np.float64), w16.astype(np.float64))
    rel_err = np.abs(y - ref).max() / np.abs(ref).max()
    print(
        f"{args.rows} x {args.cols}: NumPy fp32 {numpy_s * 1e3:.1f} ms, "
        f"simulated bf16 kernel {sim_s * 1e3:.1f} ms "
        f"({len(rmsnorm_fwd.last_trace)} instructions), ratio {sim_s / numpy_s:.2f} "
        f"(target <= 5); max error {rel_err:.1e} of max |y|"
    )


if __name__ == "__main__":
    main()
