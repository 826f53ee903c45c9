"""Tests of the float64 reference (nki_rmsnorm.reference) against straightforward formulas.

The expected values are written out directly from the math in docs/design.md. The only building
block shared with the module is ``round_to``, which is checked on its own first against the
definition of correct rounding.
"""

import warnings
import zlib

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


@pytest.fixture
def rng(request):
    """A generator seeded from the test id: reproducible, and different for every test."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _ulp(v, dtype):
    """Spacing of ``dtype`` at the float64 values ``v`` (the ulp of the binade of each)."""
    fi = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    _, e = np.frexp(np.abs(v))  # |v| = m·2**e with 0.5 <= m < 1, so the binade is 2**(e-1)
    return np.ldexp(1.0, np.maximum(e - 1, fi.minexp) - fi.nmant)


def _data(rng, shape, dtype, scale=1.0):
    """Normal data with a per-row scale and a non-zero mean, rounded to ``dtype``."""
    rows = scale * np.exp(rng.uniform(-2, 2, size=shape[:-1] + (1,)))
    x = rows * (rng.standard_normal(shape) + 0.3)
    return x.astype(dtype)


def _weight(rng, hidden, dtype):
    return (1.0 + 0.2 * rng.standard_normal(hidden)).astype(dtype)


def _rstd(h64, eps):
    """rstd in float64 straight from the definition (Python-level mean over the last axis)."""
    return 1.0 / np.sqrt((h64**2).sum(-1, keepdims=True) / h64.shape[-1] + eps)


# ---------------------------------------------------------------------------------------------
# round_to and ulp_distance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_round_to_is_correctly_rounded(rng, dtype):
    fi = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    # Magnitudes across the normal range and into the subnormals, both signs.
    mags = np.exp2(rng.uniform(fi.minexp - fi.nmant + 1, fi.maxexp - 1, size=20000))
    x = mags * rng.choice([-1.0, 1.0], size=mags.size)
    r = ref.round_to(x, dtype)
    assert r.dtype == np.float64
    assert np.array_equal(r.astype(dtype).astype(np.float64), r)  # representable
    assert np.all(np.abs(r - x) <= 0.5 * _ulp(r, dtype))  # nearest
    # Not just truncation: some values round up in magnitude.
    assert np.any(np.abs(r) > np.abs(x))


def test_round_to_bf16_single_rounding_and_ties():
    # float64 → float32 → bfloat16 would round 1 + 2**-8 + 2**-40 to 1 (a double rounding).
    x = np.array([1 + 2**-8 + 2**-40, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-40), 1e-300])
    r = ref.round_to(x, BF16)
    assert list(r[:4]) == [1 + 2**-7, 1.0, 1 + 2**-6, -(1 + 2**-7)]  # ties go to even
    assert r[4] == 0.0
    assert np.isposinf(ref.round_to(np.array([1e300]), BF16)).all()
    assert np.isnan(ref.round_to(np.array([np.nan]), BF16)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ulp_distance_on_the_bit_line(rng, dtype):
    uint = np.dtype(f"u{dtype.itemsize}")
    bits = rng.integers(1, 0x7000, size=100).astype(uint)  # positive finite patterns
    a = bits.view(dtype)
    b = (bits + 1).view(dtype)  # the next representable value up
    assert np.all(ref.ulp_distance(a, b, dtype) == 1)
    assert np.all(ref.ulp_distance(b, a, dtype) == 1)
    assert np.all(ref.ulp_distance(-a.astype(np.float64), -b.astype(np.float64), dtype) == 1)
    assert np.all(ref.ulp_distance(a, a, dtype) == 0)
    # Through zero: +0 and -0 coincide; the two smallest subnormals are two steps apart.
    tiny = np.array([1], dtype=uint).view(dtype).astype(np.float64)[0]
    assert ref.ulp_distance(0.0, -0.0, dtype) == 0
    assert ref.ulp_distance(tiny, -tiny, dtype) == 2
    one_bits = int(np.array([1.0], dtype=dtype).view(uint)[0])
    assert ref.ulp_distance(1.0, -1.0, dtype) == 2 * one_bits
    assert ref.ulp_distance(np.nan, np.nan, dtype) == 0
    assert ref.ulp_distance(np.nan, 1.0, dtype) == np.iinfo(np.int64).max


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES + [np.dtype(np.float64)], ids=DTYPE_IDS + ["fp64"])
@pytest.mark.parametrize("w_dtype", ["fp32", "input"])
def test_forward_gemma(rng, dtype, w_dtype):
    x = _data(rng, (3, 5, 96), dtype)
    w = _weight(rng, 96, np.float32 if w_dtype == "fp32" else dtype)
    bias = (0.1 * rng.standard_normal(96)).astype(np.float32)
    eps, offset = 1e-5, 0.5

    y, rstd = ref.rms_norm_fwd(x, w, eps, offset=offset, bias=bias)

    x64 = x.astype(np.float64)
    r = _rstd(x64, eps)
    expected = x64 * r * (w.astype(np.float64) + offset) + bias.astype(np.float64)
    assert y.dtype == dtype and y.shape == x.shape
    assert rstd.dtype == np.float32 and rstd.shape == x.shape[:-1]
    np.testing.assert_array_equal(y.astype(np.float64), ref.round_to(expected, dtype))
    np.testing.assert_array_equal(rstd, r[..., 0].astype(np.float32))
    # rms_norm is the same computation without rstd.
    np.testing.assert_array_equal(ref.rms_norm(x, w, eps, offset=offset, bias=bias), y)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_llama(rng, dtype):
    x = _data(rng, (4, 128), dtype)
    w = _weight(rng, 128, np.float32)
    offset = 1.0
    y = ref.rms_norm(x, w, offset=offset, casting_mode="llama")

    x64 = x.astype(np.float64)
    xhat = ref.round_to(x64 * _rstd(x64, 1e-6), dtype)  # the HF Llama cast to the input dtype
    expected = ref.round_to(xhat * (w.astype(np.float64) + offset), dtype)
    np.testing.assert_array_equal(y.astype(np.float64), expected)
    # Without a weight the intermediate cast is invisible: llama == gemma.
    np.testing.assert_array_equal(
        ref.rms_norm(x, casting_mode="llama"), ref.rms_norm(x, casting_mode="gemma")
    )
    if dtype != np.float32:  # the early cast must be visible in narrow dtypes
        assert not np.array_equal(y, ref.rms_norm(x, w, offset=offset, casting_mode="gemma"))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_none(rng, dtype):
    x = _data(rng, (2, 3, 64), dtype)
    w = _weight(rng, 64, np.float32)
    bias = (0.1 * rng.standard_normal(64)).astype(np.float32)
    offset = 0.25
    y = ref.rms_norm(x, w, offset=offset, bias=bias, casting_mode="none")

    def rnd(v):
        return ref.round_to(v, dtype)

    x64 = x.astype(np.float64)
    xhat = rnd(x64 * _rstd(x64, 1e-6))
    prod = rnd(xhat * rnd(w.astype(np.float64) + offset))
    expected = rnd(prod + rnd(bias.astype(np.float64)))
    np.testing.assert_array_equal(y.astype(np.float64), expected)
    assert y.dtype == dtype


def test_forward_out_dtype(rng):
    x = _data(rng, (8, 48), BF16)
    w = _weight(rng, 48, np.float32)
    y = ref.rms_norm(x, w, out_dtype=np.float32)
    x64 = x.astype(np.float64)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, (x64 * _rstd(x64, 1e-6) * w).astype(np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("r_dtype", ["same", "fp32"])
def test_forward_residual(rng, dtype, r_dtype):
    res_dtype = dtype if r_dtype == "same" else np.dtype(np.float32)
    x = _data(rng, (6, 80), dtype)
    res = _data(rng, (6, 80), res_dtype, scale=3.0)
    w = _weight(rng, 80, dtype)

    y, h, rstd = ref.rms_norm_fwd(x, w, 1e-6, residual=res)

    # h: an fp32 add, stored in the residual's dtype.
    h_exp = (x.astype(np.float32) + res.astype(np.float32)).astype(np.float64)
    h_exp = ref.round_to(h_exp, res_dtype)
    assert h.dtype == res_dtype
    np.testing.assert_array_equal(h.astype(np.float64), h_exp)
    # y normalises the rounded h that was written out.
    r = _rstd(h_exp, 1e-6)
    np.testing.assert_array_equal(
        y.astype(np.float64), ref.round_to(h_exp * r * w.astype(np.float64), dtype)
    )
    np.testing.assert_array_equal(rstd, r[..., 0].astype(np.float32))
    y2, h2 = ref.rms_norm(x, w, 1e-6, residual=res)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(h2, h)


def test_forward_rank1_and_no_weight(rng):
    x = _data(rng, (40,), np.float32)
    y, rstd = ref.rms_norm_fwd(x)
    x64 = x.astype(np.float64)
    assert rstd.shape == ()
    np.testing.assert_array_equal(y, (x64 * _rstd(x64, 1e-6)).astype(np.float32))
    # offset only shifts a weight; with no weight it changes nothing.
    np.testing.assert_array_equal(ref.rms_norm(x, offset=1.0), y)


def test_forward_rejects_unknown_casting_mode(rng):
    x = _data(rng, (2, 8), np.float32)
    with pytest.raises(ValueError, match="casting_mode"):
        ref.rms_norm(x, casting_mode="fp32")
    with pytest.raises(ValueError, match="casting_mode"):
        ref.rms_norm_bwd(x, x, None, np.ones(2, np.float32), casting_mode="Gemma")


def test_zero_row(rng):
    x = _data(rng, (4, 32), np.float32)
    x[2] = 0.0
    w = _weight(rng, 32, np.float32)
    bias = (0.1 * rng.standard_normal(32)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the documented inf/NaN must not warn
        y0, rstd0 = ref.rms_norm_fwd(x, w, 0.0)
        y1, rstd1 = ref.rms_norm_fwd(x, w, 1e-6, bias=bias)
    # eps = 0: rstd = 1/sqrt(0) = inf and y = 0·inf = NaN, in that row only.
    assert np.isposinf(rstd0[2]) and np.all(np.isnan(y0[2]))
    assert np.all(np.isfinite(np.delete(y0, 2, axis=0)))
    assert np.all(np.isfinite(np.delete(rstd0, 2)))
    # eps > 0: rstd = 1/sqrt(eps) and the row is just the bias.
    np.testing.assert_allclose(rstd1[2], 1e3, rtol=1e-6)
    np.testing.assert_array_equal(y1[2], bias)


def test_fp16_large_values(rng):
    # |x| near the fp16 maximum (65504): x² overflows fp16, the reference must not.
    x = rng.uniform(55000, 65000, size=(3, 64)) * rng.choice([-1, 1], size=(3, 64))
    x = x.astype(np.float16)
    with np.errstate(over="ignore"):
        assert np.all(np.isinf(x * x))  # the naive fp16 computation would break
    w = _weight(rng, 64, np.float16)
    y, rstd = ref.rms_norm_fwd(x, w)
    x64 = x.astype(np.float64)
    r = _rstd(x64, 1e-6)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(rstd))
    np.testing.assert_array_equal(y.astype(np.float64), ref.round_to(x64 * r * w, np.float16))
    np.testing.assert_array_equal(rstd, r[..., 0].astype(np.float32))


@pytest.mark.parametrize("mode", ref.CASTING_MODES)
def test_nan_stays_in_its_row(rng, mode):
    x = _data(rng, (5, 24), BF16)
    w = _weight(rng, 24, np.float32)
    x_nan = x.copy()
    x_nan[1, 7] = np.nan
    y, rstd = ref.rms_norm_fwd(x_nan, w, casting_mode=mode)
    y_clean, rstd_clean = ref.rms_norm_fwd(x, w, casting_mode=mode)
    assert np.isnan(rstd[1]) and np.all(np.isnan(y[1].astype(np.float32)))
    others = [0, 2, 3, 4]
    np.testing.assert_array_equal(y[others], y_clean[others])
    np.testing.assert_array_equal(rstd[others], rstd_clean[others])
    # Backward: dx of the other rows is untouched; dweight sums over rows and sees the NaN.
    dy = _data(rng, (5, 24), BF16)
    dx, dw, _ = ref.rms_norm_bwd(dy, x_nan, w, rstd, casting_mode=mode)
    dx_clean, _, _ = ref.rms_norm_bwd(dy, x, w, rstd_clean, casting_mode=mode)
    assert np.all(np.isnan(dx[1].astype(np.float32)))
    np.testing.assert_array_equal(dx[others], dx_clean[others])
    assert np.all(np.isnan(dw))


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def _central_diff(f, a, step=1e-6):
    """d f / d a by central differences, f scalar-valued, a float64 (perturbed in place)."""
    grad = np.empty_like(a)
    for i in np.ndindex(a.shape):
        keep = a[i]
        a[i] = keep + step
        up = f()
        a[i] = keep - step
        down = f()
        a[i] = keep
        grad[i] = (up - down) / (2 * step)
    return grad


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_backward_matches_finite_differences(rng, with_residual):
    shape, hidden = (2, 3, 8), 8
    x = _data(rng, shape, np.float64)
    res = _data(rng, shape, np.float64) if with_residual else None
    w = _weight(rng, hidden, np.float64)
    bias = 0.1 * rng.standard_normal(hidden)
    dy = rng.standard_normal(shape)
    dh = rng.standard_normal(shape) if with_residual else None
    eps, offset = 1e-3, 0.5

    def loss():
        out = ref.rms_norm(x, w, eps, offset=offset, bias=bias, residual=res)
        if with_residual:
            y, h = out
            return np.sum(dy * y) + np.sum(dh * h)
        return np.sum(dy * out)

    if with_residual:
        _, h, rstd = ref.rms_norm_fwd(x, w, eps, offset=offset, bias=bias, residual=res)
    else:
        h = x
        _, rstd = ref.rms_norm_fwd(x, w, eps, offset=offset, bias=bias)
    dx, dw, db = ref.rms_norm_bwd(dy, h, w, rstd, offset=offset, has_bias=True, dh_out=dh)

    assert dx.dtype == np.float64 and dw.dtype == np.float64 and db.dtype == np.float64
    # rstd is saved as float32, which bounds the agreement at about 1e-7 relative.
    np.testing.assert_allclose(dx, _central_diff(loss, x), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(dw, _central_diff(loss, w), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(db, _central_diff(loss, bias), rtol=2e-6, atol=1e-7)
    if with_residual:  # h = x + residual: the residual gets the same gradient
        np.testing.assert_allclose(dx, _central_diff(loss, res), rtol=2e-6, atol=1e-7)


def test_backward_without_weight(rng):
    x = _data(rng, (4, 16), np.float64)
    dy = rng.standard_normal((4, 16))
    _, rstd = ref.rms_norm_fwd(x, eps=1e-3)
    dx, dw, db = ref.rms_norm_bwd(dy, x, None, rstd)
    assert dw is None and db is None
    np.testing.assert_allclose(
        dx, _central_diff(lambda: np.sum(dy * ref.rms_norm(x, eps=1e-3)), x), rtol=2e-6, atol=1e-7
    )
    _, _, db = ref.rms_norm_bwd(dy, x, None, rstd, has_bias=True)
    assert db.dtype == np.float32
    np.testing.assert_allclose(db, dy.sum(0), rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", ref.CASTING_MODES)
def test_backward_formula_and_dtypes(rng, dtype, mode):
    x = _data(rng, (3, 4, 32), dtype)
    w = _weight(rng, 32, np.float32)
    dy = _data(rng, (3, 4, 32), dtype)
    dh = _data(rng, (3, 4, 32), dtype)
    offset = 1.0
    _, rstd = ref.rms_norm_fwd(x, w, offset=offset, casting_mode=mode)
    dx, dw, db = ref.rms_norm_bwd(
        dy, x, w, rstd, offset=offset, has_bias=True, dh_out=dh, casting_mode=mode
    )

    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    r = rstd.astype(np.float64)[..., None]
    xhat = x64 * r
    g = dy64 * (w.astype(np.float64) + offset)
    c = (g * xhat).sum(-1, keepdims=True) / 32
    dx_exp = r * (g - xhat * c) + dh.astype(np.float64)
    # llama/none multiplied the weight by x̂ rounded to the input dtype.
    xhat_w = xhat if mode == "gemma" else ref.round_to(xhat, dtype)
    dw_exp = np.einsum("abh,abh->h", dy64, xhat_w)
    assert dx.dtype == dtype and dw.dtype == np.float32 and db.dtype == np.float32
    np.testing.assert_array_equal(dx.astype(np.float64), ref.round_to(dx_exp, dtype))
    np.testing.assert_allclose(dw, dw_exp.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(db, dy64.sum((0, 1)).astype(np.float32), rtol=1e-6)
    if mode != "gemma" and dtype != np.float32:  # the rounded x̂ is visible in dweight
        gemma_dw = ref.rms_norm_bwd(dy, x, w, rstd, offset=offset)[1]
        assert not np.array_equal(dw, gemma_dw)
