"""The MX-quantized forward (``mx.rms_norm_mx_quant``, nki06 kernel ``rmsnorm_mx_quant``,
trn3) against the float64 reference (``reference_mx.rms_norm_mx_quant``): the packed values,
the e8m0 scales and their layout, the format edges (block maxima at a power of two, zero
rows, subnormal blocks, Inf/NaN rows), the residual form, LNC=2, and bad input rejected
before any launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, kernels, mx, reference_mx

BF16 = np.dtype(ml_dtypes.bfloat16)
TARGET_ENV = "NEURON_PLATFORM_TARGET_OVERRIDE"
FORMATS = ("float8_e4m3fn_x4", "float8_e5m2_x4")
#: The fp8 step at the top binade of a block relative to the block's scale X: values
#: reach [2^(E_max-1), 2^E_max) X, where e4m3fn steps by 2^(E_max-1-3) X, e5m2 by 2^(E_max-1-2) X.
TOP_STEP = {"float8_e4m3fn_x4": 2.0**4, "float8_e5m2_x4": 2.0**12}


@pytest.fixture(autouse=True)
def _nki06_on_trn3(monkeypatch):
    monkeypatch.setenv(TARGET_ENV, "trn3")
    with dialect.use_dialect("nki06"):
        yield


@pytest.fixture
def no_mx_launch(monkeypatch):
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "rmsnorm_mx_quant", launched, raising=False)


def _inputs(rng, shape, dtype=BF16, weight_dtype=BF16, residual=False):
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape[:-1] + (1,)))).astype(dtype)
    weight = None
    if weight_dtype is not None:
        weight = (1.0 + 0.25 * rng.standard_normal(shape[-1])).astype(weight_dtype)
    res = rng.standard_normal(shape).astype(dtype) if residual else None
    return x, weight, res


def assert_mx_matches(got, want, quant_dtype, min_exact=0.999):
    """Scales and fp8 values equal the reference's, but for the rare value whose bf16 y sits
    on a rounding boundary the kernel's float32 rstd lands on the other side of (then one
    bf16 ulp of y, at most one fp8 step after quantizing)."""
    values = mx.mx_unpack(got.y_q, quant_dtype)
    scale_bytes = np.ascontiguousarray(got.scales).view(np.uint8).T
    same_values = values.view(np.uint8) == want["y_q"].view(np.uint8)
    same_scales = scale_bytes == want["scale_bytes"]
    assert same_values.mean() >= min_exact and same_scales.mean() >= min_exact
    deq = mx.mx_dequantize(got.y_q, got.scales, quant_dtype)
    finite = np.isfinite(want["dequantized"])
    step = np.repeat(np.ldexp(TOP_STEP[quant_dtype], want["scale_bytes"].astype(int) - 127), 32, 1)
    assert np.all(np.abs(deq - want["dequantized"])[finite] <= step[finite])
    np.testing.assert_array_equal(np.isnan(deq), np.isnan(want["dequantized"]))


@pytest.mark.parametrize("quant_dtype", FORMATS)
@pytest.mark.parametrize("weight_dtype", [BF16, np.float32, None])
@pytest.mark.parametrize("scale_dtype", ["float8_e8m0fnu", "uint8"])
def test_matches_rmsnorm_then_documented_mx_quantization(
    rng, quant_dtype, weight_dtype, scale_dtype
):
    x, weight, _ = _inputs(rng, (3, 67, 1024), weight_dtype=weight_dtype)
    got = mx.rms_norm_mx_quant(x, weight, 1e-5, quant_dtype=quant_dtype, scale_dtype=scale_dtype)
    want = reference_mx.rms_norm_mx_quant(x, weight, 1e-5, quant_dtype=quant_dtype)
    assert got.y_q.shape == (256, 201) and got.y_q.dtype == np.uint32
    assert got.scales.shape == (32, 201) and got.scales.dtype == mx.MX_SCALE_DTYPES[scale_dtype]
    assert got.h is None
    assert_mx_matches(got, want, quant_dtype)
    # the documented scale: each block's largest |y_q| lies in [2^(E_max-1), 2^E_max]
    emax = reference_mx.MX_EMAX[quant_dtype]
    block_max = (
        np.abs(mx.mx_unpack(got.y_q, quant_dtype).astype(np.float64)).reshape(201, 32, 32).max(2)
    )
    assert np.all((block_max >= 2.0 ** (emax - 1)) & (block_max <= 2.0**emax))


@pytest.mark.parametrize("quant_dtype", FORMATS)
def test_residual_form_returns_h(rng, quant_dtype):
    x, weight, res = _inputs(rng, (130, 512), residual=True)
    got = mx.rms_norm_mx_quant(x, weight, residual=res, quant_dtype=quant_dtype)
    want = reference_mx.rms_norm_mx_quant(x, weight, residual=res, quant_dtype=quant_dtype)
    np.testing.assert_array_equal(got.h.view(np.uint16), want["h"].view(np.uint16))
    assert_mx_matches(got, want, quant_dtype)


def test_float16_and_float32_inputs(rng):
    for dtype in (np.float16, np.float32):
        x, weight, _ = _inputs(rng, (40, 1536), dtype=dtype, weight_dtype=dtype)
        got = mx.rms_norm_mx_quant(x, weight)
        assert_mx_matches(got, reference_mx.rms_norm_mx_quant(x, weight), "float8_e4m3fn_x4")


@pytest.mark.parametrize("quant_dtype", FORMATS)
def test_format_edges(rng, quant_dtype):
    """A zero row (scale 2^-127, the e8m0 minimum), a row of one spike (every other block
    subnormal-small or zero), a row of ones (y exactly 1 with eps = 0: every block's maximum
    is an exact power of two, quantized to 2^(E_max-1)), a NaN row (its rstd is NaN: every
    block gets the NaN scale) and an Inf row (rstd 0: the Inf's block is NaN, Inf · 0, the
    others all-zero blocks)."""
    n = 512
    x = rng.standard_normal((8, n))
    x[0] = 0.0
    x[1] = 0.0
    x[1, 7] = 1e4
    x[1, 40] = 1e-30  # a block of tiny values: its scale floors at 2^-127 or near it
    x[2, :] = 1.0
    x[4, 3] = np.nan
    x[5, 9] = np.inf
    x = x.astype(BF16)
    got = mx.rms_norm_mx_quant(x, None, 0.0, quant_dtype=quant_dtype)
    want = reference_mx.rms_norm_mx_quant(x, None, 0.0, quant_dtype=quant_dtype)
    scale_bytes = got.scales.view(np.uint8).T
    assert (scale_bytes[0] == 0).all()  # 2^-127 for all-zero blocks
    assert not mx.mx_unpack(got.y_q, quant_dtype)[0].astype(np.float32).any()
    assert (scale_bytes[4] == 0xFF).all() and np.isnan(
        mx.mx_dequantize(got.y_q, got.scales)[4]
    ).all()
    assert scale_bytes[5, 0] == 0xFF and (scale_bytes[5, 1:] == 0).all()
    assert_mx_matches(got, want, quant_dtype, min_exact=1.0)
    ones = mx.mx_unpack(got.y_q, quant_dtype)[2].astype(np.float64)
    np.testing.assert_array_equal(ones, 2.0 ** (reference_mx.MX_EMAX[quant_dtype] - 1))
    assert (scale_bytes[2] == 127 - (reference_mx.MX_EMAX[quant_dtype] - 1)).all()


def test_lnc2_matches_lnc1(rng):
    import simulate.nki06 as nki06

    x, weight, res = _inputs(rng, (300, 1024), residual=True)
    one = mx.rms_norm_mx_quant(x, weight, residual=res)
    entry = kernels.kernel("rmsnorm_mx_quant")
    two = entry[2](
        x, res, weight, 1e-6, nki06.language.float8_e4m3fn_x4, nki06.language.float8_e8m0fnu
    )
    np.testing.assert_array_equal(np.asarray(two[0]).view(np.uint32), one.y_q)
    np.testing.assert_array_equal(np.asarray(two[1]).view(np.uint8), one.scales.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(two[2]).view(np.uint16), one.h.view(np.uint16))


def test_empty_rows():
    got = mx.rms_norm_mx_quant(np.zeros((0, 512), BF16), None)
    assert got.y_q.shape == (128, 0) and got.scales.shape == (16, 0)


@pytest.mark.parametrize(
    "target,kernel_dialect",
    [("trn2", "nki06"), ("trn2", "legacy"), ("trn1", "legacy"), ("inf2", "legacy")],
)
def test_targets_without_mx_are_rejected_before_launch(
    monkeypatch, no_mx_launch, target, kernel_dialect
):
    monkeypatch.setenv(TARGET_ENV, target)
    x = np.ones((4, 512), BF16)
    with dialect.use_dialect(kernel_dialect), pytest.raises(ValueError, match="on trn3|needs trn3"):
        mx.rms_norm_mx_quant(x)


def test_legacy_dialect_is_rejected_before_launch(monkeypatch, no_mx_launch):
    monkeypatch.setenv(TARGET_ENV, "trn2")
    with dialect.use_dialect("legacy"), pytest.raises(ValueError, match="legacy NKI dialect"):
        mx.rms_norm_mx_quant(np.ones((4, 512), BF16))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"quant_dtype": "float8_e4m3fn"}, TypeError, "quant_dtype must be one of"),
        ({"quant_dtype": "float4_e2m1fn_x4"}, TypeError, "quant_dtype must be one of"),
        ({"scale_dtype": "float32"}, TypeError, "scale_dtype must be one of"),
        ({"eps": -1.0}, ValueError, "eps"),
    ],
)
def test_bad_options_rejected_before_launch(no_mx_launch, kwargs, error, message):
    with pytest.raises(error, match=message):
        mx.rms_norm_mx_quant(np.ones((4, 512), BF16), **kwargs)


def test_bad_shapes_rejected_before_launch(no_mx_launch):
    with pytest.raises(ValueError, match="multiple of 512"):
        mx.rms_norm_mx_quant(np.ones((4, 480), BF16))
    with pytest.raises(ValueError, match="weight"):
        mx.rms_norm_mx_quant(np.ones((4, 512), BF16), np.ones(256, BF16))
    with pytest.raises(ValueError, match="residual must have x's shape"):
        mx.rms_norm_mx_quant(np.ones((4, 512), BF16), residual=np.ones((4, 1024), BF16))
    with pytest.raises(ValueError, match="too long"):
        mx.rms_norm_mx_quant(np.ones((1, 65536), BF16))


def test_rms_norm_quant_points_mx_formats_to_the_mx_launcher(no_mx_launch):
    from nki_rmsnorm import ops

    with pytest.raises(TypeError, match="rms_norm_mx_quant"):
        ops.rms_norm_quant(np.ones((4, 512), BF16), quant_dtype="float8_e4m3fn_x4")


@pytest.mark.parametrize("lnc", [1, 2])
def test_rows_are_batch_invariant(rng, lnc):
    """A row's values and scales do not depend on how many rows come with it: the last
    tile of each core (whose y1 and copies partly run on the Scalar engine) and the other
    tiles give the same bits, at LNC=1 and LNC=2."""
    import simulate.nki06 as nki06

    x, weight, _ = _inputs(rng, (300, 1024))
    entry = kernels.kernel("rmsnorm_mx_quant")
    args = (weight, 1e-6, nki06.language.float8_e4m3fn_x4, nki06.language.float8_e8m0fnu)

    def run(rows):
        out = entry[lnc](x[:rows], None, *args)
        return np.asarray(out[0]).view(np.uint32), np.asarray(out[1]).view(np.uint8)

    full_q, full_s = run(300)
    for rows in (1, 5, 128, 129, 256):
        part_q, part_s = run(rows)
        np.testing.assert_array_equal(part_q, full_q[:, :rows])
        np.testing.assert_array_equal(part_s, full_s[:, :rows])
