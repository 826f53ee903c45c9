"""The per-head weight ``(heads, head_dim)`` through the torch custom operator
(``nki_rmsnorm.torch.rms_norm_heads``) and JAX (``nki_rmsnorm.jax.rms_norm_heads``): the
NumPy launcher's bytes, gradients against float64 references per head, fake (meta) shapes,
``torch.library.opcheck``, and bad input rejected before a launch."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, kernels, ops
from nki_rmsnorm import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
EPS = 1e-6


@pytest.fixture(autouse=True)
def _trn2_nki06(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with dialect.use_dialect("nki06"):
        yield


def _arrays(rng, tokens=24, heads=8, n=128, dtype=np.float32):
    x = rng.standard_normal((tokens, heads, n)).astype(dtype)
    w = (1 + 0.3 * rng.standard_normal((heads, n))).astype(dtype)
    dy = rng.standard_normal((tokens, heads, n)).astype(dtype)
    return x, w, dy


def _reference_grads(x, w, dy, offset):
    """dx, dweight per head from the float64 reference backward of each head's rows."""
    dx = np.empty(x.shape)
    dw = np.empty(w.shape)
    for i in range(x.shape[1]):
        rstd = ref.rms_norm_fwd(x[:, i], w[i], EPS, offset=offset)[1]
        got = ref.rms_norm_bwd(dy[:, i], x[:, i], w[i], rstd, offset=offset)
        dx[:, i], dw[i] = got[0], got[1]
    return dx, dw


def _count_backward_launches(monkeypatch):
    """The weights each backward-kernel launch gets, appended to the returned list."""
    weights = []
    launch = kernels.rmsnorm_bwd

    def counted(*args):
        weights.append(args[2])
        return launch(*args)

    monkeypatch.setattr(kernels, "rmsnorm_bwd", counted)
    return weights


# --- torch ------------------------------------------------------------------------------------


def test_torch_same_bytes_as_the_numpy_launcher(rng):
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nki_torch

    x, w, _ = _arrays(rng, dtype=np.float32)
    xt, wt = torch.from_numpy(x).bfloat16(), torch.from_numpy(w).bfloat16()
    y = nki_torch.rms_norm_heads(xt.reshape(4, 6, 8, 128), wt, EPS)
    want = ops.rms_norm_fwd(nki_torch._to_numpy(xt), nki_torch._to_numpy(wt), EPS)[0]
    assert y.shape == (4, 6, 8, 128) and y.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        nki_torch._to_numpy(y.reshape(24, 8, 128)).view(np.uint16), want.view(np.uint16)
    )


def test_torch_gradients_against_the_reference(rng, monkeypatch):
    """dx and dweight against the float64 reference per head, from one launch of the
    backward kernel with the (heads, head_dim) weight."""
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nki_torch

    x, w, dy = _arrays(rng, heads=4, n=64)
    xt, wt = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    y = nki_torch.rms_norm_heads(xt, wt, EPS, offset=0.5)
    launched = _count_backward_launches(monkeypatch)
    y.backward(torch.from_numpy(dy))
    assert [a.shape for a in launched] == [w.shape]
    want_dx, want_dw = _reference_grads(x, w, dy, 0.5)
    np.testing.assert_allclose(xt.grad.numpy(), want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(wt.grad.numpy(), want_dw, rtol=1e-4, atol=1e-4)


def test_torch_fake_shapes_and_opcheck(rng):
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nki_torch

    x, w, dy = _arrays(rng, tokens=4, heads=4, n=64)
    meta_x = torch.empty((2, 4, 4, 64), device="meta", dtype=torch.bfloat16)
    meta_w = torch.empty((4, 64), device="meta", dtype=torch.bfloat16)
    y = nki_torch.rms_norm_heads(meta_x, meta_w, EPS, out_dtype=torch.float32)
    assert (y.shape, y.dtype, y.device.type) == ((2, 4, 4, 64), torch.float32, "meta")
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_heads_fwd,
        (xt, wt.requires_grad_(), EPS, 0.0, "gemma", None),
    )
    rstd = ops.rms_norm_fwd(x, w, EPS)[1]
    torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_heads_bwd,
        (torch.from_numpy(dy), xt, wt.detach(), torch.from_numpy(rstd), 0.0, "gemma"),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "w_dtype", "error", "message"),
    [
        ((4, 8, 128), (4, 128), "bfloat16", ValueError, "weight must have shape (heads, head_dim)"),
        ((128,), (1, 128), "bfloat16", ValueError, "weight must have shape (heads, head_dim)"),
        ((4, 32, 128), (32, 128), "bfloat16", ValueError, "heads <= 4 * (512 // N) = 16"),
        ((4, 2, 512), (2, 512), "bfloat16", ValueError, "N * 2 bytes <= 512"),
        ((4, 8, 128), (8, 128), "float16", TypeError, "weight must be float32 or bfloat16"),
    ],
)
def test_torch_bad_input_is_rejected_before_a_launch(
    monkeypatch, x_shape, w_shape, w_dtype, error, message
):
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nki_torch

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "rms_norm_fwd", no_launch)
    x = torch.ones(x_shape, dtype=torch.bfloat16)
    w = torch.ones(w_shape, dtype=getattr(torch, w_dtype))
    pattern = re.escape(message)
    with pytest.raises(error, match=pattern):
        nki_torch.rms_norm_heads(x, w, EPS)


# --- JAX --------------------------------------------------------------------------------------


def test_jax_same_bytes_as_the_numpy_launcher_under_jit(rng):
    jax = pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    x, w, _ = _arrays(rng, tokens=12, heads=8, n=128)
    x, w = x.astype(BF16), w.astype(BF16)
    y = jax.jit(lambda a, b: nki_jax.rms_norm_heads(a, b, EPS))(x.reshape(3, 4, 8, 128), w)
    want = ops.rms_norm_fwd(x, w, EPS)[0]
    assert y.shape == (3, 4, 8, 128) and np.dtype(y.dtype) == BF16
    np.testing.assert_array_equal(
        np.asarray(y).reshape(12, 8, 128).view(np.uint16), want.view(np.uint16)
    )


def test_jax_gradients_against_the_reference(rng, monkeypatch):
    """dx and dweight against the float64 reference per head, from one launch of the
    backward kernel with the (heads, head_dim) weight."""
    jax = pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    x, w, dy = _arrays(rng, heads=4, n=64)

    def loss(a, b):
        return (nki_jax.rms_norm_heads(a, b, EPS, offset=0.5) * dy).sum()

    launched = _count_backward_launches(monkeypatch)
    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    assert [a.shape for a in launched] == [w.shape]
    want_dx, want_dw = _reference_grads(x, w, dy, 0.5)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "message"),
    [
        ((4, 8, 128), (4, 128), "weight must have shape (heads, head_dim)"),
        ((4, 32, 128), (32, 128), "heads <= 4 * (512 // N) = 16"),
    ],
)
def test_jax_bad_input_is_rejected_when_traced(monkeypatch, x_shape, w_shape, message):
    pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(nki_jax, "_host_call", no_launch)
    pattern = re.escape(message)
    with pytest.raises(ValueError, match=pattern):
        nki_jax.rms_norm_heads(np.ones(x_shape, BF16), np.ones(w_shape, BF16), EPS)


def test_jax_fused_q_and_k_with_per_head_weights(rng):
    """``rms_norm_qk`` with (heads, head_dim) weights: the NumPy launcher's bytes, and the
    weights' gradients per head (the reference backward of each head's rows)."""
    jax = pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    q, wq, dq = _arrays(rng, tokens=10, heads=4, n=64)
    k, wk, dk = _arrays(rng, tokens=10, heads=2, n=64)
    y_q, y_k = jax.jit(lambda *a: nki_jax.rms_norm_qk(*a, EPS))(q, k, wq, wk)
    want_q, want_k = ops.rms_norm_qk(q, k, wq, wk, EPS)
    np.testing.assert_array_equal(np.asarray(y_q), want_q)
    np.testing.assert_array_equal(np.asarray(y_k), want_k)

    def loss(a, b, wa, wb):
        ya, yb = nki_jax.rms_norm_qk(a, b, wa, wb, EPS)
        return (ya * dq).sum() + (yb * dk).sum()

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, wq, wk)
    for x, w, dy, dx, dw in (
        (q, wq, dq, grads[0], grads[2]),
        (k, wk, dk, grads[1], grads[3]),
    ):
        want_dx, want_dw = _reference_grads(x, w, dy, 0.0)
        np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-4)


def test_jax_fused_q_and_k_reject_a_weight_of_other_heads():
    pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    q, k = np.ones((4, 16, 128), BF16), np.ones((4, 2, 128), BF16)
    with pytest.raises(ValueError, match=re.escape("q_weight must have shape (N,) = (128,)")):
        nki_jax.rms_norm_qk(q, k, np.ones((8, 128), BF16), None, EPS)


def test_torch_fused_q_and_k_with_per_head_weights(rng):
    """``rms_norm_qk`` with (heads, head_dim) weights: the NumPy launcher's bytes, the
    weights' gradients per head, fake shapes and ``opcheck`` of the operator."""
    torch = pytest.importorskip("torch")
    from nki_rmsnorm import torch as nki_torch

    q, wq, dq = _arrays(rng, tokens=10, heads=4, n=64)
    k, wk, dk = _arrays(rng, tokens=10, heads=2, n=64)
    leaves = [torch.from_numpy(a).requires_grad_() for a in (q, k, wq, wk)]
    y_q, y_k = nki_torch.rms_norm_qk(*leaves, EPS)
    want_q, want_k = ops.rms_norm_qk(q, k, wq, wk, EPS)
    np.testing.assert_array_equal(y_q.detach().numpy(), want_q)
    np.testing.assert_array_equal(y_k.detach().numpy(), want_k)
    torch.autograd.backward((y_q, y_k), (torch.from_numpy(dq), torch.from_numpy(dk)))
    for x, w, dy, x_leaf, w_leaf in ((q, wq, dq, leaves[0], leaves[2]), (k, wk, dk, *leaves[1::2])):
        want_dx, want_dw = _reference_grads(x, w, dy, 0.0)
        np.testing.assert_allclose(x_leaf.grad.numpy(), want_dx, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(w_leaf.grad.numpy(), want_dw, rtol=1e-4, atol=1e-4)
    meta = [torch.empty(a.shape, device="meta", dtype=torch.bfloat16) for a in (q, k, wq, wk)]
    m_q, m_k = nki_torch.rms_norm_qk(*meta, EPS)
    assert (m_q.shape, m_k.shape) == (q.shape, k.shape)
    torch.library.opcheck(
        torch.ops.nki_rmsnorm.rms_norm_qk_fwd,
        (*(torch.from_numpy(a) for a in (q, k, wq, wk)), EPS, 0.0, "gemma", None),
        test_utils=("test_schema", "test_faketensor"),
    )
