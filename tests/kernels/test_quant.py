"""The quantized forward (``ops.rms_norm_quant``, nki06 kernel ``rmsnorm_quant``) against the
float64 reference (``reference.rms_norm_quant``): fp8 values, scales, saturation, the
dtype edges, every option, LNC=2, and bad input rejected before any launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, ops, reference
from nki_rmsnorm.reference import FP8_MAX

BF16 = np.dtype(ml_dtypes.bfloat16)
TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
#: Relative error of the kernel's float32 q = p · (rstd / scale) against the float64 one:
#: a few float32 roundings (p, rstd after Newton, 1/fp8_max, the reciprocal, two products).
Q_RTOL = 1e-6
SCALE_RTOL = 2e-6


@pytest.fixture(autouse=True)
def _nki06():
    with dialect.use_dialect("nki06"):
        yield


@pytest.fixture
def trn2(monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "trn2")


@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "trn3")


def _inputs(rng, shape, dtype=BF16, weight_dtype=BF16, residual=False):
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    weight = None
    if weight_dtype is not None:
        weight = (1.0 + 0.25 * rng.standard_normal(shape[-1])).astype(weight_dtype)
    res = rng.standard_normal(shape).astype(dtype) if residual else None
    return x, weight, res


def assert_fp8_matches(got, want, quant_dtype, rows=None):
    """Every fp8 value is the RNE of the float64 q, except where q lies within Q_RTOL of a
    rounding midpoint, where either neighbour is accepted; and nearly all are exact."""
    fp8 = np.dtype(getattr(ml_dtypes, quant_dtype))
    q = want["q"] if rows is None else want["q"][rows]
    got = np.asarray(got if rows is None else got[rows]).astype(np.float64)
    exact = want["y_q"] if rows is None else want["y_q"][rows]
    low = reference.round_to(q * (1 - Q_RTOL), fp8)
    high = reference.round_to(q * (1 + Q_RTOL), fp8)
    ok = (got == low) | (got == high)
    assert ok.all(), f"{np.count_nonzero(~ok)} fp8 values off: got {got[~ok][:5]}, q {q[~ok][:5]}"
    assert np.mean(got == exact.astype(np.float64)) > 0.99


@pytest.mark.parametrize(
    "target,quant_dtype",
    [("trn2", "float8_e4m3"), ("trn3", "float8_e4m3fn"), ("trn2", "float8_e5m2")],
)
@pytest.mark.parametrize("weight_dtype", [BF16, np.float32, None])
def test_row_scales(rng, monkeypatch, target, quant_dtype, weight_dtype):
    monkeypatch.setenv(TARGET_ENV, target)
    x, weight, _ = _inputs(rng, (3, 67, 640), weight_dtype=weight_dtype)
    got = ops.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    want = reference.rms_norm_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    assert got.y_q.dtype == np.dtype(getattr(ml_dtypes, quant_dtype))
    assert got.y_q.shape == x.shape and got.scales.shape == x.shape[:-1]
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, quant_dtype)
    # each row's largest |y| lands on the largest finite fp8 value, never beyond
    row_max = np.max(np.abs(got.y_q.astype(np.float64)), axis=-1)
    np.testing.assert_array_equal(row_max, FP8_MAX[quant_dtype])


def test_default_dtype_follows_target(rng, monkeypatch):
    x, weight, _ = _inputs(rng, (4, 256))
    monkeypatch.setenv(TARGET_ENV, "trn2")
    assert ops.rms_norm_quant(x, weight).y_q.dtype == np.dtype(ml_dtypes.float8_e4m3)
    monkeypatch.setenv(TARGET_ENV, "trn3")
    assert ops.rms_norm_quant(x, weight).y_q.dtype == np.dtype(ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize("block", [128, 32])
def test_block_scales(rng, trn2, block):
    x, weight, _ = _inputs(rng, (130, 1024))
    # spread the blocks' magnitudes so that per-block scales differ from the row's
    x = (x.astype(np.float32) * np.repeat(rng.uniform(0.01, 4, 1024 // block), block)).astype(BF16)
    got = ops.rms_norm_quant(x, weight, scale_mode="block", block=block)
    want = reference.rms_norm_quant(x, weight, scale_mode="block", block=block)
    assert got.scales.shape == (130, 1024 // block)
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3")
    block_max = np.max(np.abs(got.y_q.astype(np.float64)).reshape(130, -1, block), axis=-1)
    np.testing.assert_array_equal(block_max, 240.0)


def test_static_scale_saturates(rng, trn2):
    x, weight, _ = _inputs(rng, (129, 384))
    scale = np.array([0.004], np.float32)  # |y| above 0.96 saturates
    got = ops.rms_norm_quant(x, weight, scale_mode="static", static_scale=scale)
    want = reference.rms_norm_quant(x, weight, scale_mode="static", static_scale=scale)
    assert got.scales is None
    assert_fp8_matches(got.y_q, want, "float8_e4m3")
    values = got.y_q.astype(np.float64)
    saturated = np.abs(want["y"]) / 0.004 > 240
    assert saturated.mean() > 0.1
    np.testing.assert_array_equal(values[saturated], 240.0 * np.sign(want["y"][saturated]))


def test_static_scale_subnormals(rng, trn2):
    """A large static scale puts q in e4m3's subnormal range (below 2⁻⁶, steps of 2⁻⁹)."""
    x, weight, _ = _inputs(rng, (64, 256))
    got = ops.rms_norm_quant(x, weight, scale_mode="static", static_scale=200.0)
    want = reference.rms_norm_quant(x, weight, scale_mode="static", static_scale=200.0)
    assert_fp8_matches(got.y_q, want, "float8_e4m3")
    values = np.abs(got.y_q.astype(np.float64))
    subnormal = (values > 0) & (values < 2.0**-6)
    assert subnormal.mean() > 0.5
    assert np.all(np.mod(values[subnormal], 2.0**-9) == 0)


@pytest.mark.parametrize("scale_mode", ["row", "block"])
def test_lower_bound_clips(rng, trn2, scale_mode):
    x, weight, _ = _inputs(rng, (40, 512))
    kwargs = dict(scale_mode=scale_mode, lower_bound=1.5)
    got = ops.rms_norm_quant(x, weight, return_amax=True, **kwargs)
    want = reference.rms_norm_quant(x, weight, **kwargs)
    assert np.mean(np.abs(want["y"]) > 1.5) > 0.05  # the bound bites
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    np.testing.assert_allclose(got.scales, 1.5 / 240, rtol=SCALE_RTOL)  # every row reaches it
    assert_fp8_matches(got.y_q, want, "float8_e4m3")
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)  # amax is not capped


def test_residual_y_and_amax(rng, trn2):
    x, weight, residual = _inputs(rng, (2, 100, 768), residual=True)
    residual = residual.astype(np.float32)
    got = ops.rms_norm_quant(x, weight, residual=residual, return_y=True, return_amax=True)
    want = reference.rms_norm_quant(x, weight, residual=residual)
    assert got.h.dtype == np.float32 and got.y.dtype == BF16
    np.testing.assert_array_equal(got.h, want["h"])
    assert np.all(reference.ulp_distance(got.y, want["y"], BF16) <= 1)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3")


@pytest.mark.parametrize("n", [1024, 200, 4224])
def test_y_output_keeps_y_q(rng, trn2, n):
    """y_q, the scales and amax are the same bytes with and without the y output (with a
    16-bit weight and N a multiple of 128 the plain kernel forms h · w on the Tensor
    engine and the y kernel on the Vector engine; both share Σh² alike), and both match
    the reference; N = 200 takes the Vector engine either way; N = 4224 (33 blocks of 128)
    loads in two column chunks that must end on a block."""
    x, weight, _ = _inputs(rng, (260, n))
    plain = ops.rms_norm_quant(x, weight, return_amax=True)
    with_y = ops.rms_norm_quant(x, weight, return_y=True, return_amax=True)
    np.testing.assert_array_equal(plain.y_q.view(np.uint8), with_y.y_q.view(np.uint8))
    np.testing.assert_array_equal(plain.scales, with_y.scales)
    np.testing.assert_array_equal(plain.amax, with_y.amax)
    want = reference.rms_norm_quant(x, weight)
    np.testing.assert_allclose(plain.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(plain.y_q, want, "float8_e4m3")
    assert np.all(reference.ulp_distance(with_y.y, want["y"], BF16) <= 1)


def test_packed_layout(rng, trn2):
    x, weight, _ = _inputs(rng, (131, 512))
    got = ops.rms_norm_quant(x, weight, packed=True)
    plain = ops.rms_norm_quant(x, weight)
    assert got.y_q.shape == (131, 516) and got.scales is None
    np.testing.assert_array_equal(got.y_q[:, :512].view(np.uint8), plain.y_q.view(np.uint8))
    scales = np.ascontiguousarray(got.y_q[:, 512:]).view(np.uint8).view("<f4")[:, 0]
    np.testing.assert_array_equal(scales, plain.scales)


def test_edge_rows(rng, trn2):
    """Zero rows get the floor and y_q = 0; a row with NaN or ±Inf gets a non-finite scale;
    huge (2⁵⁰: Σh² stays within float32) and subnormal bf16 rows quantize like any row;
    other rows are untouched."""
    x, weight, _ = _inputs(rng, (8, 256))
    x = x.astype(np.float32)
    x[1] = 0.0
    x[2, 7] = np.nan
    x[3, 9] = np.inf
    x[4, 11] = -np.inf
    big = 2.0**50
    x[5] = np.where(rng.random(256) < 0.5, big, -big)
    x[6] = float(ml_dtypes.finfo(BF16).smallest_subnormal) * rng.integers(-3, 4, 256)
    x = x.astype(BF16)
    got = ops.rms_norm_quant(x, weight, scale_floor=1e-6)
    want = reference.rms_norm_quant(x, weight, scale_floor=1e-6)
    assert got.scales[1] == np.float32(1e-6)
    np.testing.assert_array_equal(got.y_q[1].astype(np.float32), 0.0)
    assert not np.isfinite(got.scales[2:5]).any()
    finite = [0, 5, 6, 7]
    np.testing.assert_allclose(got.scales[finite], want["scales"][finite], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3", rows=finite)


def test_lnc2_is_bitwise_lnc1(rng):
    from helpers import trace_launch

    from nki_rmsnorm.kernels.nki06._nki import nl
    from nki_rmsnorm.kernels.nki06.rmsnorm_quant import rmsnorm_quant

    x, weight, _ = _inputs(rng, (300, 512))
    flags = (True, True, False, False)  # emit_y, emit_amax, packed, emit_transposed
    args = (x, None, weight, None, 1e-6, nl.float8_e4m3, "row", 128, None, 1e-6, *flags)
    one, _ = trace_launch(rmsnorm_quant, *args, target="trn2", lnc=1)
    two, trace = trace_launch(rmsnorm_quant, *args, target="trn2", lnc=2)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert trace.lnc == 2


def test_empty_rows(trn2):
    got = ops.rms_norm_quant(np.empty((0, 64), BF16), None, scale_mode="block", block=32)
    assert got.y_q.shape == (0, 64) and got.scales.shape == (0, 2)


# --- bad input: rejected before any launch ---------------------------------------------------
@pytest.fixture
def no_quant_launch(monkeypatch):
    from nki_rmsnorm.kernels.nki06 import rmsnorm_quant as module

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(module, "rmsnorm_quant", launched)


X = np.zeros((4, 256), BF16)


@pytest.mark.parametrize(
    "kwargs,error,words",
    [
        (dict(quant_dtype="float8_e4m3fn"), ValueError, "quant_dtype"),
        (dict(quant_dtype="int8"), TypeError, "quant_dtype"),
        (dict(quant_dtype=np.float16), TypeError, "quant_dtype"),
        (dict(scale_mode="tensor"), ValueError, "scale_mode"),
        (dict(scale_mode="block", block=100), ValueError, "block=100"),
        (dict(scale_mode="block", block=0), ValueError, "block=0"),
        (dict(scale_mode="block", block=2.0), TypeError, "block"),
        (dict(scale_mode="static"), ValueError, "static_scale"),
        (
            dict(scale_mode="static", static_scale=np.ones((2,), np.float32)),
            ValueError,
            "static_scale",
        ),
        (
            dict(scale_mode="static", static_scale=np.ones((1,), np.float64)),
            TypeError,
            "static_scale",
        ),
        (
            dict(scale_mode="static", static_scale=np.array([np.nan], np.float32)),
            ValueError,
            "static_scale",
        ),
        (dict(scale_mode="static", static_scale=float("inf")), ValueError, "static_scale"),
        (dict(scale_mode="static", static_scale=-1.0), ValueError, "static_scale"),
        (dict(static_scale=1.0), ValueError, "static_scale"),
        (dict(lower_bound=0.0), ValueError, "lower_bound"),
        (dict(lower_bound=float("nan")), ValueError, "lower_bound"),
        (dict(scale_mode="static", static_scale=1.0, lower_bound=1.0), ValueError, "lower_bound"),
        (dict(scale_floor=0.0), ValueError, "scale_floor"),
        (dict(packed=True, scale_mode="block"), ValueError, "packed"),
        (dict(return_y=1), TypeError, "return_y"),
        (dict(eps=-1.0), ValueError, "eps"),
        (dict(weight=np.ones(128, BF16)), ValueError, "weight"),
        (dict(residual=np.zeros((4, 256), np.float16)), TypeError, "residual"),
    ],
)
def test_bad_input(trn2, no_quant_launch, kwargs, error, words):
    kwargs = dict(kwargs)
    weight = kwargs.pop("weight", None)
    with pytest.raises(error, match=words):
        ops.rms_norm_quant(X, weight, **kwargs)


def test_too_long_rows(trn2, no_quant_launch):
    x = np.zeros((1, 40000), BF16)
    with pytest.raises(ValueError, match="N=40000"):
        ops.rms_norm_quant(x, np.ones(40000, np.float32))


def test_trn3_ocp_static_saturates_at_448_with_residual_and_y(rng, trn3):
    x, weight, residual = _inputs(rng, (70, 640), residual=True)
    kwargs = dict(quant_dtype="float8_e4m3fn", scale_mode="static", static_scale=0.002)
    got = ops.rms_norm_quant(
        x, weight, residual=residual, return_y=True, return_amax=True, **kwargs
    )
    want = reference.rms_norm_quant(x, weight, residual=residual, **kwargs)
    assert_fp8_matches(got.y_q, want, "float8_e4m3fn")
    values = got.y_q.astype(np.float64)
    assert np.max(np.abs(values)) == 448.0 and np.isfinite(values).all()
    np.testing.assert_array_equal(got.h, want["h"])
    assert np.all(reference.ulp_distance(got.y, want["y"], BF16) <= 1)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)


def test_block_amax_is_the_rows(rng, trn2):
    x, weight, _ = _inputs(rng, (20, 512))
    got = ops.rms_norm_quant(x, weight, scale_mode="block", block=64, return_amax=True)
    want = reference.rms_norm_quant(x, weight, scale_mode="block", block=64)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)
    np.testing.assert_allclose(got.amax, np.max(got.scales, axis=-1) * 240, rtol=SCALE_RTOL)


# --- the simulator's fp8 rounding, which the tests above rely on -----------------------------
@pytest.mark.parametrize("name", ["float8_e4m3", "float8_e4m3fn", "float8_e5m2"])
def test_simulator_rounds_fp8_to_nearest_even(name, trn3):
    """Writing float32 values to an fp8 tile rounds once to nearest even, ties included, down
    to the subnormals (the values stay in range: the kernel clips before converting); a
    strided fp8 view reads back the same bytes."""
    from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl

    fp8 = np.dtype(getattr(ml_dtypes, name))
    finite = np.arange(256, dtype=np.uint8).view(fp8).astype(np.float64)
    finite = np.unique(finite[np.isfinite(finite) & (np.abs(finite) <= FP8_MAX[name])])
    ties = (finite[1:] + finite[:-1]) / 2  # every midpoint between neighbours
    nudged = np.concatenate([ties * (1 + 2.0**-20), ties * (1 - 2.0**-20)])
    values = np.concatenate([finite, ties, nudged]).astype(np.float32)
    width = 64
    values = np.resize(values, (-(-values.size // width) * width,)).reshape(-1, width)
    values = values[: (values.shape[0] // 2) * 2]

    @nki.jit
    def convert(src, dtype):
        rows, cols = src.shape
        out = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.shared_hbm)
        every_other = nl.ndarray((rows, cols // 2), dtype=dtype, buffer=nl.shared_hbm)
        tile = nl.ndarray((rows, cols), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=src)
        q = nl.ndarray((rows, cols), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=q, src=tile)
        nisa.dma_copy(dst=out, src=q)
        nisa.dma_copy(dst=every_other, src=q[:, 0:cols:2])
        return out, every_other

    got, strided = convert(values, getattr(nl, name))
    want = reference.round_to(values.astype(np.float64), fp8)
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), want)
    np.testing.assert_array_equal(
        np.asarray(strided).view(np.uint8), np.asarray(got)[:, ::2].view(np.uint8)
    )


@pytest.mark.parametrize("rows", [1, 128, 257, 600])
def test_tile_counts_of_the_pipeline(rng, trn2, rows):
    """One tile, one full tile, three with a ragged one, five: every row quantized."""
    x, weight, _ = _inputs(rng, (rows, 256))
    got = ops.rms_norm_quant(x, weight, return_amax=True)
    want = reference.rms_norm_quant(x, weight)
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    np.testing.assert_allclose(got.amax, want["amax"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3")


@pytest.mark.parametrize("block", [128, 32])
def test_block_scales_trn3(rng, trn3, block):
    """NeuronCore-v4's block maxima (abs_max pairs, then a max) and its OCP e4m3."""
    x, weight, _ = _inputs(rng, (130, 512))
    kwargs = dict(quant_dtype="float8_e4m3fn", scale_mode="block", block=block)
    got = ops.rms_norm_quant(x, weight, **kwargs)
    want = reference.rms_norm_quant(x, weight, **kwargs)
    np.testing.assert_allclose(got.scales, want["scales"], rtol=SCALE_RTOL)
    assert_fp8_matches(got.y_q, want, "float8_e4m3fn")


def test_simulator_costs_reductions_by_what_they_read():
    """tensor_reduce and bn_stats stream their input: the trace's free size is the input's
    (N elements per partition), not the few elements they write."""
    from helpers import trace_launch

    from nki_rmsnorm.kernels.nki06._nki import nisa, nki, nl

    @nki.jit
    def reduce(src):
        out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        stats = nl.ndarray((128, 6), dtype=nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((128, 8, 512), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=src)
        small = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=small, op=nl.maximum, data=tile, axis=2)
        moments = nl.ndarray((128, 6), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_stats(dst=moments, data=tile[:, 0, :])
        nisa.dma_copy(dst=out, src=small)
        nisa.dma_copy(dst=stats, src=moments)
        return out, stats

    data = np.random.default_rng(0).standard_normal((128, 8, 512)).astype(np.float32)
    (out, _), trace = trace_launch(reduce, data, target="trn2")
    np.testing.assert_array_equal(out, data.max(axis=2))
    sizes = {i.opcode: i.free_size for i in trace.instructions if i.engine == "dve"}
    assert sizes == {"tensor_reduce": 4096, "bn_stats": 512}
