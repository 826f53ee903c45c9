"""Regression tests for the PyTorch defects found in review (each failed before its fix), and
gradient accumulation into every input that receives a gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from nki_rmsnorm import ops  # noqa: E402
from nki_rmsnorm import torch as nki_torch  # noqa: E402


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


# ---------------------------------------------------------------------------------------------
# Defect 1: x.grad and residual.grad were one tensor, so accumulation gave 3g instead of 2g
# ---------------------------------------------------------------------------------------------


def test_fused_add_gives_input_and_residual_separate_gradients():
    x = _randn(4, 8, seed=1).requires_grad_()
    r = _randn(4, 8, seed=2).requires_grad_()
    scale = torch.arange(8.0)
    (nki_torch.fused_add_rms_norm(x, r, None)[0] * scale).sum().backward()
    once = x.grad.clone()
    assert x.grad.data_ptr() != r.grad.data_ptr()
    (nki_torch.fused_add_rms_norm(x, r, None)[0] * scale).sum().backward()
    torch.testing.assert_close(x.grad, 2 * once, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(r.grad, 2 * once, rtol=1e-6, atol=1e-6)


def _two_steps_equal_twice_one(make_inputs, fn):
    """Backward twice into fresh leaves: every .grad is twice the one-step gradient."""
    leaves = make_inputs()
    fn(*leaves).backward()
    once = [t.grad.clone() for t in leaves]
    fn(*leaves).backward()
    for t, g in zip(leaves, once):
        assert t.grad is not None and t.grad.dtype == t.dtype
        torch.testing.assert_close(t.grad, 2 * g, rtol=1e-6, atol=1e-6)
    pointers = [t.grad.data_ptr() for t in leaves]
    assert len(set(pointers)) == len(pointers)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_into_input_residual_weight_and_bias(residual_dtype):
    dtype = torch.bfloat16

    def make_inputs():
        return [
            _randn(3, 16, dtype=dtype, seed=3).requires_grad_(),
            _randn(3, 16, dtype=residual_dtype, seed=4).requires_grad_(),
            (_randn(16, seed=5) * 0.1).requires_grad_(),
            (_randn(16, seed=6) * 0.1).requires_grad_(),
        ]

    weights = _randn(3, 16, seed=7)

    def loss(x, r, w, b):
        y, h = nki_torch.fused_add_rms_norm(x, r, w, 1e-6, offset=1.0, bias=b)
        return (y.float() * weights).sum() + (h.float() * weights).sum()

    _two_steps_equal_twice_one(make_inputs, loss)


def test_gradient_accumulation_through_rms_norm():
    def make_inputs():
        return [
            _randn(5, 12, seed=8).requires_grad_(),
            _randn(12, seed=9).requires_grad_(),
            _randn(12, seed=10).requires_grad_(),
        ]

    weights = _randn(5, 12, seed=11)
    _two_steps_equal_twice_one(
        make_inputs, lambda x, w, b: (nki_torch.rms_norm(x, 12, w, bias=b) * weights).sum()
    )


# ---------------------------------------------------------------------------------------------
# Defect 2: double backward was silently 95 % off
# ---------------------------------------------------------------------------------------------


def _second_order(norm, x, w):
    x = x.clone().requires_grad_()
    y = norm(x, w)
    (g,) = torch.autograd.grad((y**3).sum() + (x**3).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return g, gg


@pytest.mark.parametrize("with_weight", [True, False])
def test_double_backward_matches_torch(with_weight):
    x = _randn(4, 8, seed=12)
    w = _randn(8, seed=13) if with_weight else None
    ours = _second_order(lambda x, w: nki_torch.rms_norm(x, (8,), w, 1e-6), x, w)
    ref = _second_order(
        lambda x, w: F.rms_norm(x, (8,), w, 1e-6), x.double(), None if w is None else w.double()
    )
    for got, want in zip(ours, ref):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * scale)


def test_double_backward_of_the_fused_add_into_weight_and_residual():
    x, r, w = _randn(3, 8, seed=14), _randn(3, 8, seed=15), _randn(8, seed=16)

    def second_order(norm, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (x, r, w)]
        y, h = norm(*leaves)
        grads = torch.autograd.grad((y**3).sum() + (h**2).sum(), leaves, create_graph=True)
        return torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)

    def reference(x, r, w):
        h = x + r
        return F.rms_norm(h, (8,), w, 1e-6), h

    ours = second_order(lambda x, r, w: nki_torch.fused_add_rms_norm(x, r, w, 1e-6), torch.float32)
    ref = second_order(reference, torch.float64)
    for got, want in zip(ours, ref):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * scale)


# ---------------------------------------------------------------------------------------------
# Defect 3: an fp32 bias's gradient was rounded to the bf16 weight's dtype
# ---------------------------------------------------------------------------------------------


def test_fp32_bias_gradient_keeps_fp32_accuracy_beside_a_bf16_weight():
    x = _randn(512, 64, dtype=torch.bfloat16, seed=17)
    w = _randn(64, dtype=torch.bfloat16, seed=18).requires_grad_()
    b = torch.zeros(64, requires_grad=True)
    gy = _randn(512, 64, dtype=torch.bfloat16, seed=19)
    nki_torch.rms_norm(x, 64, w, 1e-6, bias=b).backward(gy)
    assert b.grad.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    exact = gy.double().sum(0)
    # fp32 sums of 512 terms: far below the 2^-9 relative step of bf16 (the old result).
    torch.testing.assert_close(b.grad.double(), exact, rtol=1e-6, atol=1e-5)
    assert not torch.equal(b.grad, exact.to(torch.bfloat16).float())


# ---------------------------------------------------------------------------------------------
# Defect 6: a fused add without rows returned h in x's dtype
# ---------------------------------------------------------------------------------------------


def test_zero_row_fused_add_returns_h_in_the_residual_dtype():
    y, h = nki_torch.fused_add_rms_norm(
        torch.zeros(0, 8, dtype=torch.bfloat16), torch.zeros(0, 8), None
    )
    one_y, one_h = nki_torch.fused_add_rms_norm(
        torch.ones(1, 8, dtype=torch.bfloat16), torch.ones(1, 8), None
    )
    assert (y.dtype, h.dtype) == (one_y.dtype, one_h.dtype) == (torch.bfloat16, torch.float32)
    assert y.shape == h.shape == (0, 8)


def test_zero_row_backward_gives_zero_parameter_gradients_in_their_dtypes():
    x = torch.zeros(0, 8, dtype=torch.bfloat16, requires_grad=True)
    r = torch.zeros(0, 8, requires_grad=True)
    w = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    b = torch.ones(8, requires_grad=True)
    y, h = nki_torch.fused_add_rms_norm(x, r, w, bias=b)
    (y.float().sum() + h.sum()).backward()
    assert torch.equal(w.grad, torch.zeros(8, dtype=torch.bfloat16))
    assert torch.equal(b.grad, torch.zeros(8)) and r.grad.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# Defect 8: unclear errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset, error", [("abc", TypeError), (None, TypeError), (float("inf"), ValueError)]
)
def test_module_offset_errors_name_offset(offset, error):
    with pytest.raises(error, match="offset"):
        nki_torch.RMSNorm(8, offset=offset)


def test_module_eps_is_checked_at_construction():
    with pytest.raises(ValueError, match="eps"):
        nki_torch.RMSNorm(8, eps=-1.0)


def test_hidden_size_above_the_backward_limit_is_rejected_when_gradients_are_enabled(no_launch):
    n = ops.MAX_HIDDEN_BWD + 8
    module = nki_torch.RMSNorm(n)
    x = torch.ones(1, n)
    with pytest.raises(ValueError, match=rf"N <= {ops.MAX_HIDDEN_BWD} \(MAX_HIDDEN_BWD\)"):
        module(x)  # the weight requires grad
    with pytest.raises(ValueError, match="MAX_HIDDEN_BWD"):
        nki_torch.rms_norm(x.requires_grad_(), n)
    # Without gradients the forward alone is fine: it reaches the launch.
    with torch.no_grad(), pytest.raises(AssertionError, match="a kernel was launched"):
        module(x)
    with pytest.raises(AssertionError, match="a kernel was launched"):
        nki_torch.rms_norm(torch.ones(1, n), n)  # nothing requires grad
