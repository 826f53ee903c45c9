"""Bad input to the NumPy launchers is rejected before any kernel runs.

Every case replaces the kernels (every entry point, in every dialect) with a function that
fails the test when called, then checks the exception type and that the message names the
offending argument. The last tests check the launchers' other promises: empty inputs,
leading dimensions and non-contiguous arrays, launched end to end in both NKI dialects.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import kernels, ops, reference, validation

BF16 = np.dtype(ml_dtypes.bfloat16)
M, N = 4, 8


def _refuse(*args, **kwargs):
    pytest.fail("a kernel was launched for invalid input")


@pytest.fixture
def no_launch(monkeypatch):
    """Resolving any entry point (``kernels.rmsnorm_fwd`` etc. go through ``kernel``) fails."""
    monkeypatch.setattr(kernels, "kernel", _refuse)


def _x(rng, shape=(M, N), dtype=np.float32):
    return (rng.standard_normal(shape) + 0.5).astype(dtype)


FORWARD_CASES = {
    # id: (kwargs overriding a valid call, expected error, word the message must contain)
    "x_list": (dict(x=[[1.0, 2.0]]), TypeError, "x"),
    "x_int": (dict(x=np.ones((M, N), np.int32)), TypeError, "x"),
    "x_complex": (dict(x=np.ones((M, N), np.complex64)), TypeError, "x"),
    "x_float64": (dict(x=np.ones((M, N), np.float64)), TypeError, "x"),
    "x_bool": (dict(x=np.ones((M, N), bool)), TypeError, "x"),
    "x_0d": (dict(x=np.ones((), np.float32)), ValueError, "x"),
    "x_n0": (dict(x=np.ones((M, 0), np.float32), weight=None), ValueError, "x"),
    "weight_shape": (dict(weight=np.ones(N + 1, np.float32)), ValueError, "weight"),
    "weight_2d": (dict(weight=np.ones((1, N), np.float32)), ValueError, "weight"),
    "weight_dtype": (dict(weight=np.ones(N, np.float16)), TypeError, "weight"),
    "weight_float64": (dict(weight=np.ones(N, np.float64)), TypeError, "weight"),
    "weight_list": (dict(weight=[1.0] * N), TypeError, "weight"),
    "bias_shape": (dict(bias=np.ones(N - 1, np.float32)), ValueError, "bias"),
    "bias_dtype": (dict(bias=np.ones(N, np.int32)), TypeError, "bias"),
    "residual_shape": (dict(residual=np.ones((M, N + 1), np.float32)), ValueError, "residual"),
    "residual_dtype": (dict(residual=np.ones((M, N), np.float16)), TypeError, "residual"),
    "residual_list": (dict(residual=[[0.0] * N] * M), TypeError, "residual"),
    "eps_negative": (dict(eps=-1e-6), ValueError, "eps"),
    "eps_nan": (dict(eps=float("nan")), ValueError, "eps"),
    "eps_inf": (dict(eps=float("inf")), ValueError, "eps"),
    "eps_string": (dict(eps="1e-6"), TypeError, "eps"),
    "eps_array": (dict(eps=np.ones(2)), TypeError, "eps"),
    "offset_nan": (dict(offset=float("nan")), ValueError, "offset"),
    "offset_without_weight": (dict(weight=None, offset=1.0), ValueError, "offset"),
    # Scalars beyond what float() takes quietly (a regression test): each names its argument.
    "eps_huge_int": (dict(eps=10**400), ValueError, "eps"),
    "eps_huge_fraction": (dict(eps=Fraction(10**400, 3)), ValueError, "eps"),
    "eps_none": (dict(eps=None), TypeError, "eps"),
    "eps_bool": (dict(eps=True), TypeError, "eps"),
    "eps_numpy_bool": (dict(eps=np.bool_(True)), TypeError, "eps"),
    "eps_numpy_nan": (dict(eps=np.float32("nan")), ValueError, "eps"),
    "eps_longdouble_inf": (dict(eps=np.longdouble("1e4000")), ValueError, "eps"),
    "eps_0d_array": (dict(eps=np.array(1e-6)), TypeError, "eps"),
    "offset_string": (dict(offset="abc"), TypeError, "offset"),
    "offset_none": (dict(offset=None), TypeError, "offset"),
    "offset_bool": (dict(offset=False), TypeError, "offset"),
    "offset_huge_int": (dict(offset=-(10**400)), ValueError, "offset"),
    "offset_numpy_inf": (dict(offset=np.float16("inf")), ValueError, "offset"),
    "offset_complex": (dict(offset=1 + 0j), TypeError, "offset"),
    "casting_mode": (dict(casting_mode="bf16"), ValueError, "casting_mode"),
    "casting_mode_none": (dict(casting_mode=None), ValueError, "casting_mode"),
    "out_dtype_int": (dict(out_dtype=np.int32), TypeError, "out_dtype"),
    "out_dtype_float64": (dict(out_dtype=np.float64), TypeError, "out_dtype"),
    "out_dtype_garbage": (dict(out_dtype="not-a-dtype"), TypeError, "out_dtype"),
}


@pytest.mark.parametrize("fn", [ops.rms_norm, ops.rms_norm_fwd])
@pytest.mark.parametrize("case", FORWARD_CASES, ids=list(FORWARD_CASES))
def test_forward_rejects_bad_input_before_launch(no_launch, rng, fn, case):
    overrides, error, word = FORWARD_CASES[case]
    kwargs = dict(x=_x(rng), weight=np.ones(N, np.float32), eps=1e-6)
    kwargs.update(overrides)
    with pytest.raises(error, match=word):
        fn(**kwargs)


def _bwd_kwargs(rng):
    x = _x(rng)
    return dict(dy=_x(rng), x_or_h=x, weight=np.ones(N, np.float32), rstd=np.ones(M, np.float32))


BACKWARD_CASES = {
    "dy_shape": (dict(dy=np.ones((M, N + 1), np.float32)), ValueError, "dy"),
    "dy_dtype": (dict(dy=np.ones((M, N), np.float64)), TypeError, "dy"),
    "dy_list": (dict(dy=[[0.0] * N] * M), TypeError, "dy"),
    "x_int": (dict(x_or_h=np.ones((M, N), np.int16)), TypeError, "x_or_h"),
    "x_0d": (dict(x_or_h=np.ones((), np.float32)), ValueError, "x_or_h"),
    "x_n0": (
        dict(x_or_h=np.ones((M, 0), np.float32), dy=np.ones((M, 0), np.float32), weight=None),
        ValueError,
        "x_or_h",
    ),
    "x_n_too_large": (
        dict(
            x_or_h=np.ones((1, 131_073), np.float32),
            dy=np.ones((1, 131_073), np.float32),
            weight=None,
            rstd=np.ones(1, np.float32),
        ),
        ValueError,
        "x_or_h",
    ),
    "weight_shape": (dict(weight=np.ones(N + 2, np.float32)), ValueError, "weight"),
    "weight_dtype": (dict(weight=np.ones(N, np.int32)), TypeError, "weight"),
    "rstd_shape": (dict(rstd=np.ones(M + 1, np.float32)), ValueError, "rstd"),
    "rstd_2d": (dict(rstd=np.ones((M, 1), np.float32)), ValueError, "rstd"),
    "rstd_dtype": (dict(rstd=np.ones(M, np.float16)), TypeError, "rstd"),
    "rstd_list": (dict(rstd=[1.0] * M), TypeError, "rstd"),
    "dh_out_shape": (dict(dh_out=np.ones((M + 1, N), np.float32)), ValueError, "dh_out"),
    "dh_out_dtype": (dict(dh_out=np.ones((M, N), np.complex64)), TypeError, "dh_out"),
    "offset_without_weight": (dict(weight=None, offset=1.0), ValueError, "offset"),
    "offset_inf": (dict(offset=float("-inf")), ValueError, "offset"),
    "offset_huge_int": (dict(offset=10**400), ValueError, "offset"),
    "offset_string": (dict(offset="1"), TypeError, "offset"),
    "offset_none": (dict(offset=None), TypeError, "offset"),
    "has_bias": (dict(has_bias="yes"), TypeError, "has_bias"),
    "casting_mode": (dict(casting_mode="fp8"), ValueError, "casting_mode"),
}


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=list(BACKWARD_CASES))
def test_backward_rejects_bad_input_before_launch(no_launch, rng, case):
    overrides, error, word = BACKWARD_CASES[case]
    kwargs = _bwd_kwargs(rng)
    kwargs.update(overrides)
    with pytest.raises(error, match=word):
        ops.rms_norm_bwd(**kwargs)


def test_a_valid_call_does_launch(monkeypatch, rng):
    """The refusing fixture would catch a valid call too: the launch path is really there."""
    calls = []

    def record(*args):
        calls.append(args)
        m = args[0].shape[0]
        return np.zeros(args[0].shape, args[0].dtype), np.zeros(m, np.float32)

    names = []
    monkeypatch.setattr(kernels, "kernel", lambda name: names.append(name) or record)
    ops.rms_norm(_x(rng, (2, 3, N)), np.ones(N, np.float32))
    assert names == ["rmsnorm_fwd"]
    assert len(calls) == 1 and calls[0][0].shape == (6, N)


@pytest.mark.parametrize("residual", [False, True])
def test_empty_leading_dims_return_empty_outputs_without_launch(no_launch, rng, residual):
    x = np.empty((0, 3, N), BF16)
    r = np.empty((0, 3, N), np.float32) if residual else None
    outputs = ops.rms_norm_fwd(x, np.ones(N, BF16), residual=r, out_dtype=np.float16)
    assert [o.shape for o in outputs] == [x.shape] * (2 if residual else 1) + [(0, 3)]
    assert [o.dtype for o in outputs] == (
        [np.dtype(np.float16)]
        + ([np.dtype(np.float32)] if residual else [])
        + [np.dtype(np.float32)]
    )


def test_empty_leading_dims_backward_gives_zero_parameter_grads(no_launch):
    x = np.empty((2, 0, N), np.float16)
    dx, dweight, dbias = ops.rms_norm_bwd(
        x, x, np.ones(N, np.float16), np.empty((2, 0), np.float32), has_bias=True
    )
    assert dx.shape == x.shape and dx.dtype == x.dtype
    assert dweight.dtype == np.float16 and dbias.dtype == np.float16
    np.testing.assert_array_equal(dweight, 0)
    np.testing.assert_array_equal(dbias, 0)


def test_leading_dims_and_non_contiguous_input(rng, kernel_dialect):
    """A transposed (non-contiguous) 3-D input: flattened, run, and reshaped back."""
    base = _x(rng, (N, 5, 3))
    x = base.transpose(1, 2, 0)  # (5, 3, N), not contiguous
    assert not x.flags.c_contiguous
    w = rng.standard_normal(N).astype(np.float32)
    y, rstd = ops.rms_norm_fwd(x, w, 1e-5)
    y_ref, rstd_ref = reference.rms_norm_fwd(x, w, 1e-5)
    assert y.shape == x.shape and rstd.shape == (5, 3)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-5)


def test_fused_add_and_backward_keep_leading_dims(rng, kernel_dialect):
    """The fused add (fp32 residual beside bf16 x) and the backward through the launchers:
    the caller's shape back, every output against the float64 reference."""
    x = _x(rng, (2, 3, 40), BF16)
    residual = _x(rng, (2, 3, 40))
    w = (1 + 0.1 * rng.standard_normal(40)).astype(BF16)
    y, h, rstd = ops.rms_norm_fwd(x, w, residual=residual)
    y_ref, h_ref, rstd_ref = reference.rms_norm_fwd(x, w, 1e-6, residual=residual)
    assert (y.shape, h.shape, rstd.shape) == (x.shape, x.shape, (2, 3))
    assert (y.dtype, h.dtype) == (BF16, np.dtype(np.float32))
    np.testing.assert_array_equal(h, h_ref)
    assert reference.ulp_distance(y.astype(np.float64), y_ref.astype(np.float64), BF16).max() <= 1
    np.testing.assert_allclose(rstd, rstd_ref, rtol=1e-5)
    dy = _x(rng, (2, 3, 40), BF16)
    dx, dweight, dbias = ops.rms_norm_bwd(dy, x, w, rstd_ref.astype(np.float32), has_bias=True)
    dx_ref, dweight_ref, dbias_ref = reference.rms_norm_bwd(dy, x, w, rstd_ref, has_bias=True)
    assert (dx.shape, dweight.dtype, dbias.dtype) == (x.shape, BF16, BF16)
    scale = np.abs(dx_ref.astype(np.float64)).max(axis=-1, keepdims=True)
    assert (np.abs(dx.astype(np.float64) - dx_ref) <= 8 * 2.0**-8 * scale).all()
    for got, want in ((dweight, dweight_ref), (dbias, dbias_ref)):
        np.testing.assert_allclose(
            got.astype(np.float64),
            want.astype(np.float64),
            rtol=2.0**-7,
            atol=2.0**-7 * np.abs(want).max(),
        )


def test_one_dimensional_input_gives_scalar_rstd(rng, kernel_dialect):
    x = _x(rng, (N,))
    y, rstd = ops.rms_norm_fwd(x)
    assert y.shape == (N,) and rstd.shape == ()
    np.testing.assert_allclose(y, reference.rms_norm(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.float32(0.25), 0.25),
        (np.int64(2), 2.0),
        (Fraction(1, 4), 0.25),
        (10**300, 1e300),
        (np.float16(1e-3), float(np.float16(1e-3))),
    ],
)
def test_numeric_scalars_of_any_kind_are_accepted(value, expected):
    """NumPy scalars, Fractions and big (but representable) ints are real numbers: accepted
    and converted exactly as float() does."""
    assert validation.check_options(value, value, np.ones(1), "gemma") == (expected, expected)


def test_ops_keeps_the_shared_validation_names():
    """The bindings call ``ops.check_options``; it is the one in the shared module."""
    assert ops.check_options is validation.check_options
    assert ops.KERNEL_DTYPES is validation.KERNEL_DTYPES
