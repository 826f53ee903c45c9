"""The legacy twin of the quantized forward (``kernels/legacy/rmsnorm_quant.py``) against the
float64 reference, on NeuronCore-v2 (trn1) and v3 (trn2), and what it refuses before a
launch. The simulator fills the kernel's HBM outputs with NaN, so finite outputs are ones
the kernel wrote."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from test_quant import BF16, SCALE_RTOL, TARGET_ENV, _inputs, assert_fp8_matches

from nki_rmsnorm import dialect, kernels, ops, reference
from nki_rmsnorm.reference import FP8_MAX


@pytest.fixture(autouse=True)
def _legacy():
    with dialect.use_dialect("legacy"):
        yield


@pytest.fixture(params=["trn1", "trn2"])
def target(request, monkeypatch):
    monkeypatch.setenv(TARGET_ENV, request.param)
    return request.param


def test_the_legacy_kernel_runs(target):
    assert kernels.kernel("rmsnorm_quant").__module__.endswith("legacy.rmsnorm_quant")


@pytest.mark.parametrize("quant_dtype", ["float8_e4m3", "float8_e5m2"])
@pytest.mark.parametrize("weight_dtype", [BF16, np.float32, None])
def test_row_scales(rng, target, quant_dtype, weight_dtype):
    x, weight, _ = _inputs(rng, (3, 67, 640), weight_dtype=weight_dtype)
    got = ops.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype, return_amax=True)
    want = reference.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    assert got.y_q.dtype == np.dtype(getattr(ml_dtypes, quant_dtype))
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, quant_dtype)
    row_max = np.max(np.abs(got.y_q.astype(np.float64)), axis=-1)
    np.testing.assert_array_equal(row_max, FP8_MAX[quant_dtype])


@pytest.mark.parametrize("block", [128, 32])
def test_block_scales_lower_bound_residual_and_y(rng, target, block):
    x, weight, residual = _inputs(rng, (130, 512), residual=True)
    scale = np.repeat(rng.uniform(0.01, 4, 512 // block), block)
    x = (x.astype(np.float32) * scale).astype(BF16)
    kwargs = dict(scale_mode="block", block=block, lower_bound=3.0)
    got = ops.rms_norm_quant(
        x, weight, residual=residual, return_y=True, return_amax=True, **kwargs
    )
    want = reference.rms_norm_quant(x, weight, residual=residual, **kwargs)
    assert got.scales.shape == (130, 512 // block)
    assert np.mean(np.abs(want["y"]) > 3.0) > 0.01  # the bound bites
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3")
    np.testing.assert_array_equal(got.h, want["h"])
    assert np.all(reference.ulp_distance(got.y, want["y"], BF16) <= 1)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)


def test_static_scale_saturates_and_subnormals(rng, target):
    x, weight, _ = _inputs(rng, (129, 384))
    for scale in (0.004, 200.0):  # |y| above 0.96 saturates; q in e4m3's subnormals
        got = ops.rms_norm_quant(x, weight, scale_mode="static", static_scale=scale)
        want = reference.rms_norm_quant(x, weight, scale_mode="static", static_scale=scale)
        assert got.scales is None
        assert_fp8_matches(got.y_q, want, "float8_e4m3")
        assert np.isfinite(got.y_q.astype(np.float64)).all()
    values = np.abs(got.y_q.astype(np.float64))
    subnormal = (values > 0) & (values < 2.0**-6)
    assert subnormal.mean() > 0.5 and np.all(np.mod(values[subnormal], 2.0**-9) == 0)


def test_edge_rows(rng, target):
    """Zero rows get the floor and y_q = 0; NaN or ±Inf rows a non-finite scale; huge and
    subnormal bf16 rows quantize like any row."""
    x, weight, _ = _inputs(rng, (8, 256))
    x = x.astype(np.float32)
    x[1] = 0.0
    x[2, 7] = np.nan
    x[3, 9] = np.inf
    x[4, 11] = -np.inf
    x[5] = np.where(rng.random(256) < 0.5, 2.0**50, -(2.0**50))
    x[6] = float(ml_dtypes.finfo(BF16).smallest_subnormal) * rng.integers(-3, 4, 256)
    x = x.astype(BF16)
    got = ops.rms_norm_quant(x, weight)
    want = reference.rms_norm_quant(x, weight)
    assert got.scales[1] == np.float32(1e-6)
    np.testing.assert_array_equal(got.y_q[1].astype(np.float32), 0.0)
    assert not np.isfinite(got.scales[2:5]).any()
    finite = [0, 5, 6, 7]
    np.testing.assert_allclose(got.scales[finite], want["scales"][finite], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3", rows=finite)


def test_same_results_as_nki06_on_trn2(rng, monkeypatch):
    """Both dialects on trn2: the same scales within float32 roundings, the same fp8 values
    but where q sits within Q_RTOL of a rounding midpoint."""
    monkeypatch.setenv(TARGET_ENV, "trn2")
    x, weight, _ = _inputs(rng, (200, 768))
    legacy = ops.rms_norm_quant(x, weight)
    with dialect.use_dialect("nki06"):
        new = ops.rms_norm_quant(x, weight)
    np.testing.assert_allclose(legacy.scales, new.scales, rtol=2 * SCALE_RTOL)
    assert np.mean(legacy.y_q.view(np.uint8) == new.y_q.view(np.uint8)) > 0.999


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(packed=True), "packed=True needs the NKI 0.6 kernel"),
        (dict(return_transposed=True), "return_transposed=True needs the NKI 0.6 kernel"),
        (dict(quant_dtype="float8_e4m3fn"), "quant_dtype"),
    ],
)
def test_refused_before_launch(monkeypatch, target, kwargs, words):
    from nki_rmsnorm.kernels.legacy import rmsnorm_quant as module

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(module, "rmsnorm_quant", launched)
    with pytest.raises(ValueError, match=words):
        ops.rms_norm_quant(np.zeros((4, 256), BF16), None, **kwargs)


def test_torch_binding_runs_the_legacy_kernel(rng, target):
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nt
    from nki_rmsnorm.torch import _from_numpy

    x, weight, residual = _inputs(rng, (2, 40, 256), residual=True)
    kwargs = dict(scale_mode="block", block=64, return_y=True, return_amax=True)
    want = ops.rms_norm_quant(x, weight, residual=residual, **kwargs)
    got = nt.rms_norm_quant(
        _from_numpy(x), _from_numpy(weight), residual=_from_numpy(residual), **kwargs
    )
    np.testing.assert_array_equal(
        got.y_q.contiguous().view(torch.uint8).numpy(), want.y_q.view(np.uint8)
    )
    for name in ("scales", "amax"):
        np.testing.assert_array_equal(getattr(got, name).numpy(), getattr(want, name))
    with pytest.raises(ValueError, match="return_transposed"):
        nt.rms_norm_quant(_from_numpy(x), None, return_transposed=True)
