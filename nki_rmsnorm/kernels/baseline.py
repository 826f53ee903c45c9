"""Deliberately simple, tutorial-style RMSNorm kernels: the benchmark's baseline.

They follow the Neuron RMSNorm tutorial: high-level ``nl`` calls, one 128-row tile at a
time, the weight broadcast across partitions inside the loop, every intermediate in the
input dtype except what ``nl`` promotes. They are correct (eps inside the root) but make no
attempt at fusing passes, balancing engines or batching DMAs — that is what the real
kernels in this package are measured against.
"""

from __future__ import annotations

import math

from nki_rmsnorm.nki import nki, nl


@nki.jit
def tutorial_rmsnorm_fwd(x, weight, eps):
    """``y = x / sqrt(mean(x²) + eps) · weight`` for ``x`` (M, N) and ``weight`` (N,).

    Per 128-row tile: load (DMA) → square (ACT) → sum (DVE) → scale and add eps (DVE) →
    rsqrt (ACT) → multiply by rstd (DVE) → broadcast weight (DVE) → multiply (DVE) → store.
    """
    M, N = x.shape
    P = nl.tile_size.pmax
    y = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(N)[None, :]
    w_row = nl.load(weight.reshape((1, N))[nl.arange(1)[:, None], i_f])
    for t in nl.affine_range(math.ceil(M / P)):
        rows = t * P + i_p
        x_tile = nl.load(x[rows, i_f], mask=rows < M)
        mean_sq = nl.sum(nl.square(x_tile), axis=[1]) / N
        rstd = nl.rsqrt(mean_sq + eps)
        y_tile = nl.multiply(x_tile, rstd)
        w_tile = w_row.broadcast_to((P, N))
        y_tile[...] = nl.multiply(y_tile, w_tile, mask=rows < M)
        nl.store(y[rows, i_f], value=y_tile, mask=rows < M)
    return y


@nki.jit
def tutorial_add(a, b):
    """``h = a + b`` for two (M, N) tensors, one 128-row tile at a time (the unfused first
    half of a residual add + RMSNorm)."""
    M, N = a.shape
    P = nl.tile_size.pmax
    h = nl.ndarray((M, N), dtype=a.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(N)[None, :]
    for t in nl.affine_range(math.ceil(M / P)):
        rows = t * P + i_p
        a_tile = nl.load(a[rows, i_f], mask=rows < M)
        b_tile = nl.load(b[rows, i_f], mask=rows < M)
        nl.store(h[rows, i_f], value=nl.add(a_tile, b_tile), mask=rows < M)
    return h


@nki.jit
def tutorial_rmsnorm_bwd(dy, x, weight, rstd):
    """The RMSNorm gradient the straightforward way, one 128-row tile at a time.

    ``x̂ = x·rstd``, ``g = dy·w``, ``dx = rstd·(g − x̂·mean(g·x̂))`` and the per-tile partial
    ``Σ_rows dy·x̂`` added into an fp32 (1, N) accumulator with a ones-vector matmul
    (TensorE) per 512-column chunk. Inputs: dy, x (M, N), weight (N,), rstd (M,) fp32.
    """
    M, N = x.shape
    P = nl.tile_size.pmax
    F = nl.tile_size.psum_fmax
    dx = nl.ndarray((M, N), dtype=x.dtype, buffer=nl.shared_hbm)
    dweight = nl.ndarray((N,), dtype=weight.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(N)[None, :]
    i_one = nl.arange(1)[:, None]
    w_row = nl.load(weight.reshape((1, N))[i_one, i_f])
    ones = nl.ones((P, 1), dtype=nl.float32)
    dw_acc = nl.zeros((1, N), dtype=nl.float32)
    for t in nl.sequential_range(math.ceil(M / P)):
        rows = t * P + i_p
        x_tile = nl.load(x[rows, i_f], mask=rows < M)
        dy_tile = nl.load(dy[rows, i_f], mask=rows < M)
        r_tile = nl.load(rstd[rows], mask=rows < M)
        x_hat = nl.multiply(x_tile, r_tile, dtype=nl.float32)
        g = nl.multiply(dy_tile, w_row.broadcast_to((P, N)), dtype=nl.float32)
        c = nl.mean(nl.multiply(g, x_hat), axis=[1])
        dx_tile = nl.multiply(nl.subtract(g, nl.multiply(x_hat, c)), r_tile, mask=rows < M)
        nl.store(dx[rows, i_f], value=dx_tile, mask=rows < M)
        dw_part = nl.zeros((P, N), dtype=nl.float32)  # rows past M must add nothing
        dw_part[...] = nl.multiply(dy_tile, x_hat, dtype=nl.float32, mask=rows < M)
        for c0 in nl.static_range(0, N, F):
            width = min(F, N - c0)
            part = nl.matmul(ones, dw_part[:, c0:c0 + width], transpose_x=True)
            dw_acc[:, c0:c0 + width] = nl.add(dw_acc[:, c0:c0 + width], part)
    nl.store(dweight.reshape((1, N))[i_one, i_f], value=dw_acc)
    return dx, dweight
