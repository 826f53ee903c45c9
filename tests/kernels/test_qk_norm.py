"""The query and key norms in one launch (``rmsnorm_qk_fwd`` through ``ops.rms_norm_qk``):
against the float64 reference, bit for bit the two separate forwards, one launch, and bad
input rejected before any kernel runs. Both dialects (the ``dialect`` fixture)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import kernels, ops
from nki_rmsnorm import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
FP32 = np.dtype(np.float32)
EPS = 1e-6

pytestmark = pytest.mark.usefixtures("dialect")


def _heads(rng, tokens, heads, head_dim, dtype=BF16):
    return rng.standard_normal((tokens, heads, head_dim)).astype(dtype)


def _weight(rng, n, dtype=BF16):
    return (1 + 0.3 * rng.standard_normal(n)).astype(dtype)


@pytest.mark.parametrize(
    ("q_heads", "k_heads", "head_dim", "casting_mode", "offset"),
    [(16, 4, 128, "gemma", 0.0), (8, 8, 64, "llama", 0.0), (6, 2, 256, "gemma", 1.0)],
)
def test_matches_the_reference_and_the_separate_forwards(
    rng, q_heads, k_heads, head_dim, casting_mode, offset
):
    """Grouped-query shapes (fewer key heads): each output is the float64 reference's within
    the forward's tolerance and bitwise the separate ``rms_norm_fwd`` of that tensor."""
    q, k = _heads(rng, 96, q_heads, head_dim), _heads(rng, 96, k_heads, head_dim)
    wq, wk = _weight(rng, head_dim), _weight(rng, head_dim)
    y_q, y_k, rstd_q, rstd_k = ops.rms_norm_qk_fwd(
        q, k, wq, wk, EPS, offset=offset, casting_mode=casting_mode
    )
    for x, w, y, rstd in ((q, wq, y_q, rstd_q), (k, wk, y_k, rstd_k)):
        want_y, want_rstd = ref.rms_norm_fwd(x, w, EPS, offset=offset, casting_mode=casting_mode)
        assert y.shape == x.shape and y.dtype == BF16 and rstd.shape == x.shape[:-1]
        y64, want64 = np.asarray(y, np.float64), np.asarray(want_y, np.float64)
        scale = np.max(np.abs(want64), axis=-1, keepdims=True)
        assert np.max(np.abs(y64 - want64) / scale) <= 2 * 2.0**-8
        np.testing.assert_allclose(rstd, want_rstd, rtol=2.0**-20)
        alone = ops.rms_norm_fwd(x, w, EPS, offset=offset, casting_mode=casting_mode)
        np.testing.assert_array_equal(y.view(np.uint16), alone[0].view(np.uint16))
        np.testing.assert_array_equal(rstd.view(np.uint32), alone[1].view(np.uint32))


def test_one_launch_for_both(rng, monkeypatch):
    """``rms_norm_qk`` launches ``rmsnorm_qk_fwd`` once, and nothing else."""
    launched = []
    real = kernels.kernel

    def counting(name, *args, **kwargs):
        launched.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(kernels, "kernel", counting)
    q, k = _heads(rng, 32, 4, 128), _heads(rng, 32, 2, 128)
    y_q, y_k = ops.rms_norm_qk(q, k, _weight(rng, 128), None, EPS)
    assert launched == ["rmsnorm_qk_fwd"]
    assert y_q.shape == q.shape and y_k.shape == k.shape


def test_float32_output_and_no_weights(rng):
    q, k = _heads(rng, 40, 2, 64, FP32), _heads(rng, 40, 1, 64, FP32)
    y_q, y_k = ops.rms_norm_qk(q, k, out_dtype=np.float32)
    for x, y in ((q, y_q), (k, y_k)):
        want = ref.rms_norm_fwd(x, None, EPS)[0]
        assert y.dtype == FP32
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(q_weight=np.ones(64, BF16)), ValueError, "q_weight must have shape (N,) = (128,)"),
        (dict(k_weight=np.ones((2, 128), BF16)), ValueError, "k_weight must have shape (N,)"),
        (dict(k_weight=np.ones(128, np.float16)), TypeError, "k_weight must be float32 or k's"),
        (dict(q=np.ones((4, 128), np.int32)), TypeError, "q must have dtype"),
        (dict(k=np.ones((4, 0), BF16)), ValueError, "k must have a non-empty last"),
        (dict(q_weight=None, offset=1.0), ValueError, "needs q_weight and k_weight"),
        (
            dict(k=np.ones((4, 128), np.float16), k_weight=np.ones(128, np.float16)),
            TypeError,
            "pass out_dtype",
        ),
        (dict(eps=-1.0), ValueError, "eps"),
    ],
)
def test_bad_input_is_rejected_before_a_launch(rng, monkeypatch, change, error, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "kernel", no_launch)
    args = dict(
        q=np.ones((4, 128), BF16),
        k=np.ones((4, 128), BF16),
        q_weight=np.ones(128, BF16),
        k_weight=np.ones(128, BF16),
    )
    args.update(change)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        ops.rms_norm_qk(**args)
