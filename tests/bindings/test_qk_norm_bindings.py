"""The fused query and key norms through the torch custom operator: the NumPy launcher's
bytes, gradients against the separate operator's, the fake (meta) implementation's shapes,
``torch.library.opcheck``, and bad input rejected before a launch."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, ops

torch = pytest.importorskip("torch")

from nki_rmsnorm import torch as nki_torch  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn2_nki06(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with dialect.use_dialect("nki06"):
        yield


def _tensors(rng, q_heads=8, k_heads=2, head_dim=128, tokens=24, dtype=torch.bfloat16):
    q = torch.from_numpy(rng.standard_normal((tokens, q_heads, head_dim)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((tokens, k_heads, head_dim)).astype(np.float32))
    wq = torch.from_numpy((1 + 0.3 * rng.standard_normal(head_dim)).astype(np.float32))
    wk = torch.from_numpy((1 + 0.3 * rng.standard_normal(head_dim)).astype(np.float32))
    return q.to(dtype), k.to(dtype), wq.to(dtype), wk.to(dtype)


def test_same_bytes_as_the_numpy_launcher(rng):
    q, k, wq, wk = _tensors(rng)
    y_q, y_k = nki_torch.rms_norm_qk(q, k, wq, wk, 1e-6)
    want_q, want_k = ops.rms_norm_qk(*(nki_torch._to_numpy(t) for t in (q, k, wq, wk)), 1e-6)
    assert y_q.shape == q.shape and y_k.shape == k.shape and y_q.dtype == torch.bfloat16
    np.testing.assert_array_equal(nki_torch._to_numpy(y_q).view(np.uint16), want_q.view(np.uint16))
    np.testing.assert_array_equal(nki_torch._to_numpy(y_k).view(np.uint16), want_k.view(np.uint16))


def test_gradients_are_the_separate_forwards(rng):
    """dq, dk and the weights' gradients equal those of two ``rms_norm`` calls (the same
    backward operator on the same saved rstd)."""
    q, k, wq, wk = _tensors(rng, dtype=torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    y_q, y_k = nki_torch.rms_norm_qk(*leaves, 1e-6, offset=1.0)
    dy_q, dy_k = torch.randn_like(y_q), torch.randn_like(y_k)
    torch.autograd.backward((y_q, y_k), (dy_q, dy_k))
    apart = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    sep_q = nki_torch.rms_norm(apart[0], 128, apart[2], 1e-6, offset=1.0)
    sep_k = nki_torch.rms_norm(apart[1], 128, apart[3], 1e-6, offset=1.0)
    torch.autograd.backward((sep_q, sep_k), (dy_q, dy_k))
    torch.testing.assert_close(y_q, sep_q, rtol=0, atol=0)
    for fused, alone in zip(leaves, apart):
        torch.testing.assert_close(fused.grad, alone.grad, rtol=1e-6, atol=1e-6)


def test_fake_shapes_and_opcheck(rng):
    q, k, wq, wk = _tensors(rng, tokens=4)
    with torch.device("meta"):
        meta = [torch.empty_like(t, device="meta") for t in (q, k, wq, wk)]
    y_q, y_k = nki_torch.rms_norm_qk(*meta, 1e-6, out_dtype=torch.float32)
    assert (y_q.shape, y_q.dtype, y_k.shape) == (q.shape, torch.float32, k.shape)
    torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_qk_fwd,
        (q.reshape(-1, 128), k.reshape(-1, 128), wq, wk, 1e-6, 0.0, "gemma", None),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(q_weight=torch.ones(64, dtype=torch.bfloat16)), ValueError, "q_weight must have"),
        (dict(k_weight=torch.ones(128, dtype=torch.float16)), TypeError, "k_weight must be"),
        (dict(k=torch.ones((4, 0), dtype=torch.bfloat16)), ValueError, "k must have a non-empty"),
        (dict(k_weight=None, offset=1.0), ValueError, "needs q_weight and k_weight"),
        (dict(q="q"), TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input_is_rejected_before_a_launch(monkeypatch, change, error, message):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "rms_norm_qk_fwd", no_launch)
    args = dict(
        q=torch.ones((4, 128), dtype=torch.bfloat16),
        k=torch.ones((4, 128), dtype=torch.bfloat16),
        q_weight=torch.ones(128, dtype=torch.bfloat16),
        k_weight=torch.ones(128, dtype=torch.bfloat16),
    )
    args.update(change)
    with pytest.raises(error, match=message):
        nki_torch.rms_norm_qk(**args)


# --- JAX -----------------------------------------------------------------------------------


def test_jax_same_bytes_and_gradients(rng):
    """Under ``jax.jit``: the NumPy launcher's bytes; the gradients of a scalar loss in q,
    k and both weights equal those of two separate ``nki_rmsnorm.jax.rms_norm`` calls."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from nki_rmsnorm import jax as nki_jax

    q = rng.standard_normal((16, 4, 64)).astype(np.float32)
    k = rng.standard_normal((16, 2, 64)).astype(np.float32)
    wq = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
    wk = (1 + 0.3 * rng.standard_normal(64)).astype(np.float32)
    y_q, y_k = jax.jit(lambda *a: nki_jax.rms_norm_qk(*a, 1e-6))(q, k, wq, wk)
    want_q, want_k = ops.rms_norm_qk(q, k, wq, wk, 1e-6)
    np.testing.assert_array_equal(np.asarray(y_q), want_q)
    np.testing.assert_array_equal(np.asarray(y_k), want_k)

    def fused_loss(q, k, wq, wk):
        a, b = nki_jax.rms_norm_qk(q, k, wq, wk, 1e-6)
        return jnp.sum(a * jnp.cos(a)) + jnp.sum(b * b)

    def separate_loss(q, k, wq, wk):
        a, b = nki_jax.rms_norm(q, wq, 1e-6), nki_jax.rms_norm(k, wk, 1e-6)
        return jnp.sum(a * jnp.cos(a)) + jnp.sum(b * b)

    fused = jax.grad(fused_loss, argnums=(0, 1, 2, 3))(q, k, wq, wk)
    separate = jax.grad(separate_loss, argnums=(0, 1, 2, 3))(q, k, wq, wk)
    for got, want in zip(fused, separate):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_jax_bad_input_before_a_launch(monkeypatch):
    pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    monkeypatch.setattr(nki_jax, "_host_call", lambda *a, **k: pytest.fail("launched"))
    q, k = np.ones((4, 128), np.float32), np.ones((4, 128), np.float32)
    with pytest.raises(ValueError, match="k_weight must have shape"):
        nki_jax.rms_norm_qk(q, k, None, np.ones(64, np.float32))
    with pytest.raises(TypeError, match="q_weight must be float32 or q's dtype"):
        nki_jax.rms_norm_qk(q.astype(np.float16), k.astype(np.float16), np.ones(128, BF16))
