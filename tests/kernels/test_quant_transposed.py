"""The quantized forward's transposed output (``return_transposed``): y_qᵀ (N, M) with one
scale per column of y and 128-row tile, or the static scale, against the float64 reference
(``reference.rms_norm_quant``'s ``q_t`` / ``scales_t``). The simulator fills the kernel's HBM
outputs with NaN, so a finite output is one the kernel wrote everywhere."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_quant import (
    BF16,
    SCALE_RTOL,
    TARGET_ENV,
    _inputs,
    assert_fp8_matches,
)

from nki_rmsnorm import dialect, ops, reference
from nki_rmsnorm.reference import FP8_MAX


@pytest.fixture(autouse=True)
def _nki06():
    with dialect.use_dialect("nki06"):
        yield


def _transposed_view(want):
    """The reference's transposed results under the names assert_fp8_matches reads."""
    return {"q": want["q_t"], "y_q": want["y_q_t"]}


@pytest.mark.parametrize(
    "target,quant_dtype",
    [("trn2", "float8_e4m3"), ("trn3", "float8_e4m3fn"), ("trn2", "float8_e5m2")],
)
def test_column_tile_scales(rng, monkeypatch, target, quant_dtype):
    """M = 201 rows (a full tile and a ragged one), N = 640 (a PSUM bank of four chunks and
    one more): every column's largest |y| in a tile lands on fp8_max."""
    monkeypatch.setenv(TARGET_ENV, target)
    x, weight, _ = _inputs(rng, (3, 67, 640))
    got = ops.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype, return_transposed=True)
    want = reference.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    assert got.y_q_t.shape == (640, 201) and got.scales_t.shape == (640, 2)
    assert got.y_q_t.dtype == np.dtype(getattr(ml_dtypes, quant_dtype))
    assert np.isfinite(got.y_q_t.astype(np.float64)).all()
    np.testing.assert_allclose(got.scales_t, want["scales_t"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q_t, _transposed_view(want), quant_dtype)
    values = np.abs(got.y_q_t.astype(np.float64))
    tile_max = np.stack([values[:, :128].max(axis=1), values[:, 128:].max(axis=1)], axis=1)
    np.testing.assert_array_equal(tile_max, FP8_MAX[quant_dtype])
    # the row-wise outputs are those of a call without the transposed one
    plain = ops.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    np.testing.assert_array_equal(got.y_q.view(np.uint8), plain.y_q.view(np.uint8))
    np.testing.assert_array_equal(got.scales, plain.scales)


def test_ragged_columns_block_mode_lower_bound_and_residual(rng, monkeypatch):
    """N = 300 (two full chunks and a 44-column one), block scales for y_q, lower_bound and
    a residual with y: the transposed scales are capped at lower_bound / fp8_max."""
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x, weight, residual = _inputs(rng, (260, 300), weight_dtype=np.float32, residual=True)
    kwargs = dict(scale_mode="block", block=100, lower_bound=1.5)
    got = ops.rms_norm_quant(
        x, weight, residual=residual, return_y=True, return_transposed=True, **kwargs
    )
    want = reference.rms_norm_quant(x, weight, residual=residual, **kwargs)
    assert got.y_q_t.shape == (300, 260) and got.scales_t.shape == (300, 3)
    assert np.mean(np.abs(want["y"]) > 1.5) > 0.05  # the bound bites
    np.testing.assert_allclose(got.scales_t, want["scales_t"], rtol=SCALE_RTOL)
    assert np.all(got.scales_t <= np.float32(1.5 / 240) * (1 + SCALE_RTOL))
    assert_fp8_matches(got.y_q_t, _transposed_view(want), "float8_e4m3")
    np.testing.assert_array_equal(got.h, want["h"])
    assert np.all(reference.ulp_distance(got.y, want["y"], BF16) <= 1)


@pytest.mark.parametrize("target,quant_dtype", [("trn2", "float8_e4m3"), ("trn3", "float8_e4m3fn")])
def test_static_scale_is_the_transpose(rng, monkeypatch, target, quant_dtype):
    """One tensor scale: y_qᵀ is y_q transposed, bit for bit, saturating at ±fp8_max."""
    monkeypatch.setenv(TARGET_ENV, target)
    x, weight, _ = _inputs(rng, (2, 70, 384))
    kwargs = dict(quant_dtype=quant_dtype, scale_mode="static", static_scale=0.004)
    got = ops.rms_norm_quant(x, weight, return_transposed=True, **kwargs)
    want = reference.rms_norm_quant(x, weight, **kwargs)
    assert got.scales_t is None and got.y_q_t.shape == (384, 140)
    np.testing.assert_array_equal(
        got.y_q_t.view(np.uint8), got.y_q.reshape(140, 384).T.view(np.uint8)
    )
    assert_fp8_matches(got.y_q_t, _transposed_view(want), quant_dtype)
    assert np.max(np.abs(got.y_q_t.astype(np.float64))) == FP8_MAX[quant_dtype]


def test_edge_rows(rng, monkeypatch):
    """A tile of zero rows gets the floor and zeros; huge (2⁵⁰) and subnormal bf16 rows in
    the next tile quantize like any; a NaN makes its tile's scales non-finite (the row's
    rstd reaches every column), an Inf only its column's (its row's rstd is 0, y NaN there
    and 0 elsewhere); the other tiles are untouched."""
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x, weight, _ = _inputs(rng, (384 + 5, 256))
    x = x.astype(np.float32)
    x[:128] = 0.0
    x[130] = np.where(rng.random(256) < 0.5, 2.0**50, -(2.0**50))
    x[131] = float(ml_dtypes.finfo(BF16).smallest_subnormal) * rng.integers(-3, 4, 256)
    x[300, 7] = np.nan
    x[384 + 2, 9] = np.inf
    x = x.astype(BF16)
    got = ops.rms_norm_quant(x, weight, return_transposed=True)
    want = reference.rms_norm_quant(x, weight)
    np.testing.assert_array_equal(got.scales_t[:, 0], np.float32(1e-6))
    np.testing.assert_array_equal(got.y_q_t[:, :128].astype(np.float32), 0.0)
    assert not np.isfinite(got.scales_t[:, 2]).any()
    assert not np.isfinite(got.scales_t[9, 3])
    others = np.arange(256) != 9
    np.testing.assert_allclose(
        got.scales_t[others, 3], want["scales_t"][others, 3], rtol=SCALE_RTOL
    )
    np.testing.assert_allclose(got.scales_t[:, 1], want["scales_t"][:, 1], rtol=SCALE_RTOL)
    tile = (slice(None), slice(128, 256))
    assert_fp8_matches(got.y_q_t, _transposed_view(want), "float8_e4m3", rows=tile)


def test_lnc2_is_bitwise_lnc1(rng):
    from helpers import trace_launch

    from nki_rmsnorm.kernels.nki06._nki import nl
    from nki_rmsnorm.kernels.nki06.rmsnorm_quant import rmsnorm_quant

    x, weight, _ = _inputs(rng, (300, 512))
    args = (
        x,
        None,
        weight,
        None,
        1e-6,
        nl.float8_e4m3,
        "row",
        128,
        None,
        1e-6,
        False,
        False,
        False,
        True,
    )
    one, _ = trace_launch(rmsnorm_quant, *args, target="trn2", lnc=1)
    two, trace = trace_launch(rmsnorm_quant, *args, target="trn2", lnc=2)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert trace.lnc == 2


@pytest.mark.parametrize("n", [128, 100])
def test_without_weight_and_empty(rng, monkeypatch, n):
    """N of one full chunk, and of only a ragged one."""
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x, _, _ = _inputs(rng, (129, n), weight_dtype=None)
    got = ops.rms_norm_quant(x, None, return_transposed=True)
    want = reference.rms_norm_quant(x, None)
    assert np.isfinite(got.y_q_t.astype(np.float64)).all()
    np.testing.assert_allclose(got.scales_t, want["scales_t"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q_t, _transposed_view(want), "float8_e4m3")
    empty = ops.rms_norm_quant(np.empty((0, 64), BF16), None, return_transposed=True)
    assert empty.y_q_t.shape == (64, 0) and empty.scales_t.shape == (64, 0)


def test_bad_flag(monkeypatch):
    from nki_rmsnorm.kernels.nki06 import rmsnorm_quant as module

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(module, "rmsnorm_quant", launched)
    monkeypatch.setenv(TARGET_ENV, "trn2")
    with pytest.raises(TypeError, match="return_transposed"):
        ops.rms_norm_quant(np.zeros((4, 256), BF16), None, return_transposed=1)
    # the float32 y and y_qᵀ of a tile no longer fit beside the rest (without them they do)
    with pytest.raises(ValueError, match="N=16384"):
        ops.rms_norm_quant(np.zeros((4, 16384), BF16), np.ones(16384, BF16), return_transposed=True)
