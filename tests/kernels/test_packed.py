"""The "packed" regime (QK-norm heads: short rows, several per partition) with weights that
hold ±Inf, NaN and −0: on NeuronCore-v3+ the gemma product rstd ⊗ w is formed on the Tensor
engine, the weight as it is against the high rstd piece and its finite part against the
others (three bf16 pieces for a bf16 weight, one fp32 piece otherwise), so each non-finite
weight must stay in its own column, with IEEE's value and sign, in every row tile of the
Tensor engine (rows j mod 4) and for per-head weights in every head; the finite columns
match the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BF16, poison, trace_launch

import simulate
from nki_rmsnorm import kernels
from nki_rmsnorm.plan.forward import choose_layout, make_plan

FP32 = np.dtype(np.float32)
EPS = 1e-6


def _layout(target, M, N, dtype, offset):
    spec = simulate.get_target(target)
    plan = make_plan(
        dtype, dtype, None, None, offset, "gemma", None, FP32, BF16, tensor_engine=True
    )
    return plan, choose_layout(plan, M, N, spec.sbuf_bytes_per_partition)


def _forward(x, w, offset, target):
    """y and rstd of the output-parameter kernel (nki06) on poisoned outputs."""
    y = poison(x.shape, x.dtype)
    rstd = poison(x.shape[:1], FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out", "nki06")
    trace_launch(kernel, x, w, None, y, rstd, EPS, offset, "gemma", target=target)
    return y, rstd


def _want(x, w, offset):
    """The float64 reference y = x·rstd·(w + offset) per row (``w`` (N,) or (heads, N),
    row r of head r mod heads)."""
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1) + EPS)
    w64 = w.astype(np.float64) + offset
    heads = 1 if w.ndim == 1 else w.shape[0]
    rows = np.tile(w64.reshape(heads, -1), (x.shape[0] // heads, 1))
    with np.errstate(all="ignore"):
        return x64 * rstd[:, None] * rows, rstd


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize(
    ("M", "N", "heads", "dtype", "offset", "pieces"),
    [
        (4096, 128, 1, BF16, 0.0, 3),  # 8 rows a partition: all four row tiles
        (6000, 64, 1, BF16, 0.0, 3),
        (1200, 128, 1, FP32, 0.0, 1),  # fp32 rows of 512 B, the widest packed
        (2048, 128, 8, BF16, 0.0, 3),  # per-head weight, two PSUM banks of heads
        (1000, 128, 4, BF16, 1.0, 1),  # offset: one fp32 piece
        (3000, 96, 1, FP32, 0.0, 1),
    ],
)
def test_non_finite_weights_stay_in_their_column(rng, target, M, N, heads, dtype, offset, pieces):
    plan, layout = _layout(target, M, N, dtype, offset)
    assert layout.regime == "packed" and plan.product_engine == "tensor"
    assert plan.rstd_pieces == pieces
    shape = (N,) if heads == 1 else (heads, N)
    w = rng.normal(1.0, 0.2, shape).astype(dtype)
    flat = w.reshape(-1)
    flat[3], flat[N // 2], flat[-5] = np.inf, -np.inf, np.nan
    flat[N + 7 if heads > 1 else 7] = -0.0
    x = rng.standard_normal((M, N)).astype(dtype)
    x[x == 0] = 1  # x·Inf is NaN at x = 0: keep one expected pattern per column
    y, rstd = _forward(x, w, offset, target)
    want, want_rstd = _want(x, w, offset)
    y64 = y.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y64), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y64), np.isinf(want))
    infinite = np.isinf(want)
    assert infinite.any()
    np.testing.assert_array_equal(np.sign(y64[infinite]), np.sign(want[infinite]))
    finite = np.isfinite(want)
    rtol = 2e-5 if dtype == FP32 else 1e-2
    np.testing.assert_allclose(y64[finite], want[finite], rtol=rtol, atol=4 * 2.0**-24)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_zero_and_infinite_rstd_against_non_finite_weights(rng, target):
    """rstd = +Inf (a zero row, eps = 0) and rstd = 0 (an infinite element) meet ±Inf and NaN
    weights: y is NaN where IEEE's x·rstd·w is, in those rows only."""
    M, N = 2048, 128
    w = rng.normal(1.0, 0.2, N).astype(BF16)
    w[3], w[40] = np.inf, -np.inf
    x = rng.standard_normal((M, N)).astype(BF16)
    x[x == 0] = 1
    x[5] = 0.0
    x[9, 17] = np.inf
    y = poison(x.shape, BF16)
    rstd = poison((M,), FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out", "nki06")
    trace_launch(kernel, x, w, None, y, rstd, 0.0, 0.0, "gemma", target=target)
    y64 = y.astype(np.float64)
    assert rstd[5] == np.inf and rstd[9] == 0.0
    assert np.isnan(y64[5]).all()  # 0 · Inf
    nan9 = np.isnan(y64[9])
    assert nan9[17] and nan9[3] and nan9[40] and not nan9[0]  # Inf·0, 0·Inf; 0 elsewhere
    others = np.ones(M, bool)
    others[[5, 9]] = False
    x64 = x[others].astype(np.float64)
    want = x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True)) * w.astype(np.float64)
    np.testing.assert_array_equal(np.isinf(y64[others]), np.isinf(want))
    assert not np.isnan(y64[others]).any()
