"""A per-head weight ``(heads, N)`` (QK-norm with a weight per head): x of shape
``(tokens, heads, N)``, the row of head i scaled by ``weight[i]``. The forward kernel of each
dialect (the "packed" regime: k rows per partition a multiple of heads) against the float64
reference applied head by head, outputs poisoned first; heads = 1 bitwise the (N,) weight;
a token's result independent of the number of tokens; NaN / Inf rows kept in their row;
the backward (one backward-kernel launch with the 2-D weight; more in
test_head_weight_bwd.py) against the reference; the fused Q and K call; bad input rejected
before any kernel runs."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from helpers import poison, trace_launch

from nki_rmsnorm import dialect as dialect_module
from nki_rmsnorm import kernels, ops
from nki_rmsnorm import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
FP32 = np.dtype(np.float32)
EPS = 1e-6
#: |y − y64| / max|y64| of the row: two roundings to bf16 at most (llama rounds x̂ first).
Y_TOL = {BF16: 2 * 2.0**-8, FP32: 1e-5}
RSTD_RTOL = 1e-5

pytestmark = pytest.mark.usefixtures("dialect")


def _tokens(rng, tokens, heads, n, dtype=BF16):
    return rng.standard_normal((tokens, heads, n)).astype(dtype)


def _head_weight(rng, heads, n, dtype=BF16, offset=0.0):
    return (1.0 - offset + 0.3 * rng.standard_normal((heads, n))).astype(dtype)


def _reference(x, weight, residual=None, **options):
    """``(y, rstd)`` in float64 / float32: the reference forward of each head's rows with
    that head's (N,) weight."""
    outs = [
        ref.rms_norm_fwd(
            x[:, i],
            weight[i],
            EPS,
            residual=None if residual is None else residual[:, i],
            **options,
        )
        for i in range(x.shape[1])
    ]
    y = np.stack([np.asarray(o[0], np.float64) for o in outs], axis=1)
    rstd = np.stack([o[-1] for o in outs], axis=1)
    return y, rstd


def _forward_out(x, weight, bias=None, casting_mode="gemma", offset=0.0, target=None):
    """The output-parameter kernel on poisoned y and rstd of the (tokens·heads, N) rows."""
    tokens, heads, n = x.shape
    y = poison((tokens * heads, n), x.dtype)
    rstd = poison((tokens * heads,), FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out")
    trace_launch(
        kernel,
        x.reshape(tokens * heads, n),
        weight,
        bias,
        y,
        rstd,
        EPS,
        offset,
        casting_mode,
        target=target,
    )
    return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


def _assert_close(y, want, dtype):
    y64 = np.asarray(y, np.float64)
    scale = np.max(np.abs(want), axis=-1, keepdims=True)
    assert np.max(np.abs(y64 - want) / scale) <= Y_TOL[dtype]


@pytest.mark.parametrize(
    ("tokens", "heads", "n", "dtype", "casting_mode", "offset", "bias"),
    [
        (300, 8, 128, BF16, "gemma", 0.0, False),  # heads·N = 1024: two PSUM banks
        (64, 16, 128, BF16, "llama", 0.0, False),  # heads·N = 2048: the widest
        (257, 3, 64, BF16, "gemma", 1.0, True),  # heads·N = 192: replicated in one bank
        (90, 2, 256, BF16, "none", 0.0, True),
        (70, 6, 96, FP32, "gemma", 0.0, False),  # N·4 bytes = 384 ≤ 512
        (100, 8, 128, BF16, "gemma", 1.0, True),  # two weight banks and the bias's
        (40, 20, 96, BF16, "llama", 0.0, True),  # 5 heads of 96 a bank: four banks, the most
    ],
)
def test_forward_matches_the_reference_per_head(
    rng, tokens, heads, n, dtype, casting_mode, offset, bias
):
    x = _tokens(rng, tokens, heads, n, dtype)
    w = _head_weight(rng, heads, n, dtype, offset)
    b = rng.normal(0.0, 0.5, n).astype(dtype) if bias else None
    y, rstd = _forward_out(x, w, b, casting_mode, offset)
    want_y, want_rstd = _reference(x, w, offset=offset, bias=b, casting_mode=casting_mode)
    assert not np.isnan(np.asarray(y, np.float32)).any() and not np.isnan(rstd).any()
    _assert_close(y, want_y, dtype)
    np.testing.assert_allclose(rstd, want_rstd, rtol=RSTD_RTOL)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_other_targets_and_two_cores(rng, dialect, target):
    """trn3 (nki06; legacy runs trn2 there) and trn2 under LNC=2 (nki06: the tiles split
    between two cores), gemma with a weight (the Tensor-engine product on NeuronCore-v3+)."""
    x = _tokens(rng, 1100, 8, 128)
    w = _head_weight(rng, 8, 128)
    rows = x.reshape(-1, 128)
    y, rstd = poison(rows.shape, BF16), poison(rows.shape[:1], FP32)
    lnc = 2 if dialect == "nki06" and target == "trn2" else None
    run_on = "trn2" if dialect == "legacy" else target
    trace_launch(
        kernels.kernel("rmsnorm_fwd_out"),
        rows,
        w,
        None,
        y,
        rstd,
        EPS,
        0.0,
        "gemma",
        target=run_on,
        lnc=lnc,
    )
    want_y, want_rstd = _reference(x, w)
    _assert_close(y.reshape(x.shape), want_y, BF16)
    np.testing.assert_allclose(rstd.reshape(x.shape[:-1]), want_rstd, rtol=RSTD_RTOL)


@pytest.mark.parametrize("casting_mode", ["gemma", "llama"])
def test_one_head_is_bitwise_the_vector_weight(rng, casting_mode):
    """heads = 1: the per-head path is the (N,) weight's, bit for bit."""
    x = _tokens(rng, 1000, 1, 128)
    w = _head_weight(rng, 1, 128)
    per_head = ops.rms_norm_fwd(x, w, EPS, casting_mode=casting_mode)
    flat = ops.rms_norm_fwd(x[:, 0], w[0], EPS, casting_mode=casting_mode)
    np.testing.assert_array_equal(per_head[0][:, 0].view(np.uint16), flat[0].view(np.uint16))
    np.testing.assert_array_equal(per_head[1][:, 0].view(np.uint32), flat[1].view(np.uint32))


@pytest.mark.parametrize("casting_mode", ["gemma", "llama"])
def test_a_token_does_not_depend_on_the_number_of_tokens(rng, casting_mode):
    """The first 37 tokens of a 2048-token batch (many rows per partition) give the bits
    they give alone (a few rows per partition)."""
    x = _tokens(rng, 2048, 8, 128)
    w = _head_weight(rng, 8, 128)
    many = ops.rms_norm_fwd(x, w, EPS, casting_mode=casting_mode)
    few = ops.rms_norm_fwd(x[:37], w, EPS, casting_mode=casting_mode)
    np.testing.assert_array_equal(many[0][:37].view(np.uint16), few[0].view(np.uint16))
    np.testing.assert_array_equal(many[1][:37].view(np.uint32), few[1].view(np.uint32))


def test_nan_and_inf_rows_stay_in_their_row(rng):
    """A NaN in one head's row and an Inf in another's leave every other row as it was; the
    NaN row's rstd is NaN, the Inf row's 0 (y NaN where x is Inf, else 0)."""
    x = _tokens(rng, 512, 8, 128)
    w = _head_weight(rng, 8, 128)
    clean_y, clean_rstd = ops.rms_norm_fwd(x, w, EPS)
    x[5, 3, 17] = np.nan
    x[6, 4, 2] = np.inf
    y, rstd = ops.rms_norm_fwd(x, w, EPS)
    others = np.ones(x.shape[:-1], bool)
    others[5, 3] = others[6, 4] = False
    np.testing.assert_array_equal(y[others].view(np.uint16), clean_y[others].view(np.uint16))
    np.testing.assert_array_equal(rstd[others], clean_rstd[others])
    assert np.isnan(rstd[5, 3]) and np.isnan(y[5, 3].astype(np.float32)).all()
    want = ref.rms_norm_fwd(x[6:7, 4], w[4], EPS)
    assert rstd[6, 4] == want[1][0] == 0.0
    nan_y = np.isnan(y[6, 4].astype(np.float32))
    np.testing.assert_array_equal(nan_y, np.isnan(np.asarray(want[0][0], np.float32)))
    assert nan_y.any() and not nan_y.all()


def test_residual_through_the_launcher(rng):
    x = _tokens(rng, 200, 4, 128)
    r = _tokens(rng, 200, 4, 128, FP32)
    w = _head_weight(rng, 4, 128)
    y, h, rstd = ops.rms_norm_fwd(x, w, EPS, residual=r)
    want_y, want_rstd = _reference(x, w, residual=r)
    np.testing.assert_array_equal(h, (x.astype(FP32) + r).astype(FP32))
    _assert_close(y, want_y, BF16)
    np.testing.assert_allclose(rstd, want_rstd, rtol=RSTD_RTOL)


@pytest.mark.parametrize("has_bias", [False, True])
def test_backward_gives_a_per_head_dweight(rng, has_bias):
    """dx and dweight[i] of head i: the reference backward of that head's rows."""
    x = _tokens(rng, 150, 4, 64)
    w = _head_weight(rng, 4, 64)
    dy = _tokens(rng, 150, 4, 64)
    _, rstd = ops.rms_norm_fwd(x, w, EPS)
    dx, dweight, dbias = ops.rms_norm_bwd(dy, x, w, rstd, has_bias=has_bias)
    assert dx.shape == x.shape and dweight.shape == w.shape and dweight.dtype == BF16
    for i in range(4):
        want_dx, want_dw, _ = ref.rms_norm_bwd(dy[:, i], x[:, i], w[i], rstd[:, i])
        np.testing.assert_allclose(
            dx[:, i].astype(np.float64),
            np.asarray(want_dx, np.float64),
            rtol=2.0**-7,
            atol=2.0**-7 * np.max(np.abs(want_dx)),
        )
        np.testing.assert_allclose(
            dweight[i].astype(np.float64),
            np.asarray(want_dw, np.float64),
            rtol=2.0**-7,
            atol=2.0**-7 * np.max(np.abs(want_dw)),
        )
    if has_bias:
        want_db = ref.rms_norm_bwd(dy, x, None, rstd, has_bias=True)[2]
        np.testing.assert_allclose(
            dbias.astype(np.float64),
            np.asarray(want_db, np.float64),
            rtol=2.0**-7,
            atol=2.0**-7 * np.max(np.abs(want_db)),
        )
    else:
        assert dbias is None


def test_fused_q_and_k_with_per_head_weights(rng):
    """``rms_norm_qk`` with (heads, N) weights: bitwise the separate forwards."""
    q, k = _tokens(rng, 96, 8, 128), _tokens(rng, 96, 2, 128)
    wq, wk = _head_weight(rng, 8, 128), _head_weight(rng, 2, 128)
    y_q, y_k, rstd_q, rstd_k = ops.rms_norm_qk_fwd(q, k, wq, wk, EPS)
    for x, w, y, rstd in ((q, wq, y_q, rstd_q), (k, wk, y_k, rstd_k)):
        alone = ops.rms_norm_fwd(x, w, EPS)
        np.testing.assert_array_equal(y.view(np.uint16), alone[0].view(np.uint16))
        np.testing.assert_array_equal(rstd.view(np.uint32), alone[1].view(np.uint32))
        _assert_close(y, _reference(x, w)[0], BF16)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "w_dtype", "error", "message"),
    [
        ((4, 8, 128), (4, 128), BF16, ValueError, "weight must have shape (N,) = (128,), or "),
        ((32, 128), (32, 128), BF16, ValueError, "per-head weight"),
        ((4, 8, 512), (8, 512), BF16, ValueError, "N * 2 bytes <= 512"),
        ((4, 32, 128), (32, 128), BF16, ValueError, "heads <= 4 * (512 // N) = 16"),
        ((4, 8, 128), (8, 128), np.float16, TypeError, "weight must be float32 or x's dtype"),
    ],
)
def test_bad_per_head_weight_is_rejected_before_a_launch(
    monkeypatch, x_shape, w_shape, w_dtype, error, message
):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "kernel", no_launch)
    x = np.ones(x_shape, BF16)
    w = np.ones(w_shape, w_dtype)
    pattern = re.escape(message)
    with pytest.raises(error, match=pattern):
        ops.rms_norm_fwd(x, w)
    if error is ValueError and len(x_shape) == 3 and w_shape[0] != x_shape[1]:
        with pytest.raises(ValueError, match="weight must have shape"):
            ops.rms_norm_bwd(x, x, w, np.ones(x_shape[:-1], FP32))


def test_kernel_rejects_a_per_head_weight_outside_the_packed_regime(rng):
    """Called directly (no launcher), the kernel refuses a per-head weight of rows too long
    for the "packed" regime rather than computing something else."""
    x = _tokens(rng, 4, 2, 512).reshape(8, 512)
    w = _head_weight(rng, 2, 512)
    y, rstd = poison((8, 512), BF16), poison((8,), FP32)
    with pytest.raises(Exception, match="per-head weight"):
        trace_launch(kernels.kernel("rmsnorm_fwd_out"), x, w, None, y, rstd, EPS, 0.0, "gemma")
    assert dialect_module.current() in ("legacy", "nki06")


def test_fused_q_and_k_reject_a_per_head_weight_of_other_heads(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "kernel", no_launch)
    q, k = np.ones((4, 8, 128), BF16), np.ones((4, 2, 128), BF16)
    with pytest.raises(ValueError, match=re.escape("k_weight must have shape (N,) = (128,), or")):
        ops.rms_norm_qk(q, k, np.ones((8, 128), BF16), np.ones((8, 128), BF16))


def test_no_tokens_gives_empty_outputs_and_zero_gradients(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "kernel", no_launch)
    x = np.ones((0, 4, 64), BF16)
    w = np.ones((4, 64), BF16)
    y, rstd = ops.rms_norm_fwd(x, w)
    assert y.shape == x.shape and rstd.shape == (0, 4)
    dx, dweight, _ = ops.rms_norm_bwd(x, x, w, rstd)
    assert dx.shape == x.shape
    np.testing.assert_array_equal(dweight, np.zeros((4, 64), BF16))
