"""PyTorch bindings (``nki_rmsnorm.torch``) on the CPU, where the kernels run in the simulator.

Forward values and gradients are compared with PyTorch's own RMSNorm evaluated in float64
(autograd through ``torch.nn.functional.rms_norm`` or the same formula written out for the
options PyTorch lacks), with tolerances of a few units in the last place of the dtype.
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from nki_rmsnorm import kernels, ops  # noqa: E402
from nki_rmsnorm import torch as nki_torch  # noqa: E402

# (rtol, atol) for values of order one, by dtype: a few ulps of the output dtype.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _ref(x, normalized_shape, weight=None, eps=1e-6, offset=0.0, bias=None, residual=None):
    """Float64 RMSNorm in PyTorch: ``(y, h)``, differentiable in every tensor."""
    h = x if residual is None else x + residual
    dims = tuple(range(-len(normalized_shape), 0))
    y = h * torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight + offset)
    if bias is not None:
        y = y + bias
    return y, h


def _f64_leaf(t):
    return None if t is None else t.detach().double().requires_grad_()


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_()


def _assert_close(actual, expected, dtype, scale=1.0, what=""):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=atol * scale, msg=what or None
    )


# ---------------------------------------------------------------------------------------------
# Forward and backward against float64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_torch_rms_norm_forward_and_backward(dtype):
    x = _randn(2, 3, 48, dtype=dtype, seed=1)
    w = _randn(48, dtype=dtype, seed=2) * 0.5 + 1
    dy = _randn(2, 3, 48, dtype=dtype, seed=3)
    eps = 1e-5

    xs, ws = _leaf(x), _leaf(w)
    y = nki_torch.rms_norm(xs, (48,), ws, eps)
    y.backward(dy)

    x64, w64 = _f64_leaf(x), _f64_leaf(w)
    y64 = F.rms_norm(x64, (48,), w64, eps)
    y64.backward(dy.double())

    assert y.dtype == dtype and y.shape == x.shape
    _assert_close(y, y64, dtype, what="y")
    assert xs.grad.dtype == dtype and ws.grad.dtype == dtype
    _assert_close(xs.grad, x64.grad, dtype, scale=2, what="dx")
    # dweight sums 6 rows: its magnitude (and ulp) grows with the row count.
    _assert_close(ws.grad, w64.grad, dtype, scale=4, what="dweight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_dim_normalized_shape_without_weight(dtype):
    """normalized_shape=(4, 16) normalises 64 values per row; elementwise_affine=False."""
    x = _randn(3, 4, 16, dtype=dtype, seed=4)
    dy = _randn(3, 4, 16, dtype=dtype, seed=5)
    xs = _leaf(x)
    y = nki_torch.rms_norm(xs, (4, 16), None, 1e-6)
    y.backward(dy)

    x64 = _f64_leaf(x)
    y64 = F.rms_norm(x64, (4, 16), None, 1e-6)
    y64.backward(dy.double())
    _assert_close(y, y64, dtype, what="y")
    _assert_close(xs.grad, x64.grad, dtype, scale=2, what="dx")


def test_multi_dim_weight_gradient_keeps_its_shape():
    x = _randn(5, 2, 24, seed=6)
    w = _randn(2, 24, seed=7)
    ws = _leaf(w)
    nki_torch.rms_norm(x, (2, 24), ws).sum().backward()
    w64 = _f64_leaf(w)
    F.rms_norm(x.double(), (2, 24), w64, torch.finfo(torch.float32).eps).sum().backward()
    assert ws.grad.shape == (2, 24)
    _assert_close(ws.grad, w64.grad, torch.float32, scale=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_and_bias(dtype):
    """Gemma-style ``(1 + w)`` and a bias: forward and all three gradients."""
    x = _randn(6, 40, dtype=dtype, seed=8)
    w = _randn(40, dtype=torch.float32, seed=9) * 0.1
    b = _randn(40, dtype=torch.float32, seed=10) * 0.1
    dy = _randn(6, 40, dtype=dtype, seed=11)

    xs, ws, bs = _leaf(x), _leaf(w), _leaf(b)
    y = nki_torch.rms_norm(xs, 40, ws, 1e-6, offset=1.0, bias=bs)
    y.backward(dy)

    x64, w64, b64 = _f64_leaf(x), _f64_leaf(w), _f64_leaf(b)
    y64, _ = _ref(x64, (40,), w64, 1e-6, 1.0, b64)
    y64.backward(dy.double())
    _assert_close(y, y64, dtype, what="y")
    _assert_close(xs.grad, x64.grad, dtype, scale=2, what="dx")
    # dweight and dbias are fp32 (the weight's dtype), summed over 6 rows of dtype inputs.
    torch.testing.assert_close(ws.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bs.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_forward_and_backward(dtype):
    """(y, h) = fused_add_rms_norm(x, r, w): gradients reach x, r and w through y and h."""
    x = _randn(2, 5, 32, dtype=dtype, seed=12)
    r = _randn(2, 5, 32, dtype=dtype, seed=13)
    w = _randn(32, dtype=dtype, seed=14) * 0.5 + 1
    dy = _randn(2, 5, 32, dtype=dtype, seed=15)
    dh = _randn(2, 5, 32, dtype=dtype, seed=16)

    xs, rs, ws = _leaf(x), _leaf(r), _leaf(w)
    y, h = nki_torch.fused_add_rms_norm(xs, rs, ws, 1e-6)
    torch.autograd.backward((y, h), (dy, dh))

    # The kernel rounds h to the dtype before normalising it; so does the reference.
    x64, r64, w64 = _f64_leaf(x), _f64_leaf(r), _f64_leaf(w)
    h_rounded = (x.float() + r.float()).to(dtype).double()
    h_ref = x64 + r64 + (h_rounded - (x64 + r64)).detach()
    y64, _ = _ref(h_ref, (32,), w64, 1e-6)
    torch.autograd.backward((y64, h_ref), (dy.double(), dh.double()))

    assert torch.equal(h, h_rounded.to(dtype)), "h must be x + r rounded once"
    _assert_close(y, y64, dtype, what="y")
    _assert_close(xs.grad, x64.grad, dtype, scale=2, what="dx")
    _assert_close(rs.grad, r64.grad, dtype, scale=2, what="dresidual")
    _assert_close(ws.grad, w64.grad, dtype, scale=4, what="dweight")


def test_fused_add_with_an_fp32_residual_stream():
    """bf16 activations, fp32 residual: h (and its gradient) stay fp32, y is bf16."""
    x = _randn(3, 4, 32, dtype=torch.bfloat16, seed=41)
    r = _randn(3, 4, 32, seed=42)
    w = _randn(32, dtype=torch.bfloat16, seed=43)
    xs, rs, ws = _leaf(x), _leaf(r), _leaf(w)
    y, h = nki_torch.fused_add_rms_norm(xs, rs, ws, 1e-6)
    (y.float().square().sum() + h.sum()).backward()
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert (xs.grad.dtype, rs.grad.dtype, ws.grad.dtype) == (x.dtype, r.dtype, w.dtype)
    torch.testing.assert_close(h, x.float() + r)

    x64, r64, w64 = _f64_leaf(x), _f64_leaf(r), _f64_leaf(w)
    h64 = x64 + r64 + (h.double() - (x64 + r64)).detach()
    y64, _ = _ref(h64, (32,), w64, 1e-6)
    (y64.square().sum() + h64.sum()).backward()
    _assert_close(y, y64, torch.bfloat16, what="y")
    torch.testing.assert_close(rs.grad.double(), r64.grad, rtol=1e-2, atol=2e-2)
    _assert_close(xs.grad, x64.grad, torch.bfloat16, scale=2, what="dx")


def test_fused_add_gradient_through_h_only():
    """A loss that only reads h: dy is None inside the Function, dx = dh exactly."""
    x, r, w = _randn(4, 16, seed=17), _randn(4, 16, seed=18), _randn(16, seed=19)
    xs, rs, ws = _leaf(x), _leaf(r), _leaf(w)
    _, h = nki_torch.fused_add_rms_norm(xs, rs, ws)
    dh = _randn(4, 16, seed=20)
    h.backward(dh)
    assert torch.equal(xs.grad, dh) and torch.equal(rs.grad, dh)
    assert torch.equal(ws.grad, torch.zeros(16))


def test_gradcheck_fp32_through_the_kernels():
    """torch.autograd.gradcheck of the kernel path in float32 (the kernels take no float64):
    central differences with a step of 1e-3 against the backward kernel, every input of the
    fused add with offset and bias."""
    x = _randn(3, 8, seed=21).requires_grad_()
    r = _randn(3, 8, seed=22).requires_grad_()
    w = (_randn(8, seed=23) * 0.2).requires_grad_()
    b = (_randn(8, seed=24) * 0.2).requires_grad_()

    def fn(x, r, w, b):
        return nki_torch.fused_add_rms_norm(x, r, w, 1e-6, offset=1.0, bias=b)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*double precision.*")
        assert torch.autograd.gradcheck(fn, (x, r, w, b), eps=1e-3, atol=5e-3, rtol=5e-3)


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The check above can fail: a backward whose dx is 1 % too large is rejected."""
    real_bwd = ops.rms_norm_bwd

    def wrong_bwd(dy, x, weight, rstd, **kw):
        dx, dw, db = real_bwd(dy, x, weight, rstd, **kw)
        return (dx * 1.01).astype(dx.dtype), dw, db

    monkeypatch.setattr(ops, "rms_norm_bwd", wrong_bwd)
    x = _randn(2, 8, seed=25).requires_grad_()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*double precision.*")
        ok = torch.autograd.gradcheck(
            lambda x: nki_torch.rms_norm(x, 8),
            (x,),
            eps=1e-3,
            atol=5e-3,
            rtol=5e-3,
            raise_exception=False,
        )
    assert not ok


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_casting_matches_hf_llama_bit_for_bit(dtype):
    """casting_mode="llama" is HF LlamaRMSNorm: normalise in fp32, cast, then times weight."""
    eps = 1e-6
    x = _randn(4, 8, 64, dtype=dtype, seed=26, scale=3.0)
    w = (_randn(64, seed=27) * 0.3 + 1).to(dtype)
    xf = x.float()
    hf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype) * w
    ours = nki_torch.rms_norm(x, 64, w, eps, casting_mode="llama")
    assert ours.dtype == dtype
    assert torch.equal(ours.view(torch.int16), hf.view(torch.int16))
    # The default (gemma) mode rounds once, so it is not the same function.
    gemma = nki_torch.rms_norm(x, 64, w, eps)
    assert not torch.equal(gemma, hf)


def test_bf16_is_passed_bit_for_bit_to_the_numpy_layer():
    """The binding adds nothing to the NumPy launcher: same bits in, same bits out."""
    x = _randn(5, 32, dtype=torch.bfloat16, seed=28, scale=7.0)
    w = _randn(32, dtype=torch.bfloat16, seed=29)
    x_np = x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    w_np = w.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    y_np = ops.rms_norm(x_np, w_np, 1e-6)
    y = nki_torch.rms_norm(x, 32, w, 1e-6)
    assert y.dtype == torch.bfloat16
    np.testing.assert_array_equal(y.view(torch.int16).numpy(), y_np.view(np.int16))


def test_default_eps_is_pytorchs():
    """eps=None is torch.finfo(float32).eps for bf16 too (PyTorch's opmath rule); a bf16
    epsilon (7.8e-3) would visibly change rows of small magnitude."""
    x = _randn(3, 32, dtype=torch.bfloat16, seed=30, scale=1e-2)
    expected = F.rms_norm(x, (32,))
    torch.testing.assert_close(nki_torch.rms_norm(x, (32,)), expected, rtol=1.6e-2, atol=0)


def test_non_contiguous_input_and_empty_rows():
    x = _randn(24, 6, seed=31).t()  # (6, 24), strides (1, 6)
    assert not x.is_contiguous()
    torch.testing.assert_close(nki_torch.rms_norm(x, 24), F.rms_norm(x, (24,)))

    empty = torch.zeros(0, 3, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = nki_torch.rms_norm(empty, 16, w)
    assert y.shape == (0, 3, 16)
    y.sum().backward()
    assert empty.grad.shape == (0, 3, 16) and torch.equal(w.grad, torch.zeros(16))


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------


def test_module_is_a_drop_in_for_torch_rmsnorm():
    theirs = torch.nn.RMSNorm((2, 16), eps=1e-5)
    with torch.no_grad():
        theirs.weight.copy_(_randn(2, 16, seed=32))
    ours = nki_torch.RMSNorm((2, 16), eps=1e-5)
    ours.load_state_dict(theirs.state_dict())
    x = _randn(3, 2, 16, seed=33)
    torch.testing.assert_close(ours(x), theirs(x))
    assert list(ours.state_dict()) == ["weight"]
    assert repr(ours) == (
        "RMSNorm((2, 16), eps=1e-05, elementwise_affine=True, offset=0.0, bias=False, "
        "casting_mode='gemma')"
    )


def test_module_parameters_and_init():
    assert torch.equal(nki_torch.RMSNorm(8).weight, torch.ones(8))
    gemma = nki_torch.RMSNorm(8, offset=1.0, bias=True, dtype=torch.bfloat16)
    assert gemma.weight.dtype == torch.bfloat16
    assert torch.equal(gemma.weight, torch.zeros(8, dtype=torch.bfloat16))
    assert torch.equal(gemma.bias, torch.zeros(8, dtype=torch.bfloat16))
    with torch.no_grad():
        gemma.weight.fill_(3.0)
    gemma.reset_parameters()
    assert torch.equal(gemma.weight, torch.zeros(8, dtype=torch.bfloat16))

    plain = nki_torch.RMSNorm(8, elementwise_affine=False)
    assert plain.weight is None and list(plain.parameters()) == []
    x = _randn(2, 8, seed=34)
    torch.testing.assert_close(plain(x), F.rms_norm(x, (8,)))

    # A fresh Gemma module (zeros + offset 1) scales by exactly one, like a fresh plain one.
    xb = x.to(torch.bfloat16)
    fresh = nki_torch.RMSNorm(8, dtype=torch.bfloat16)
    torch.testing.assert_close(gemma(xb), fresh(xb), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Bad input is rejected by the binding, with PyTorch's argument names
# ---------------------------------------------------------------------------------------------


_rms, _fused = nki_torch.rms_norm, nki_torch.fused_add_rms_norm


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w: _rms(x, (16,), w), ValueError, r"normalized_shape=\[16\]"),
        (lambda x, w: _rms(x, (2, 8), None), ValueError, "normalized_shape"),
        (lambda x, w: _rms(x, "8", None), TypeError, "normalized_shape"),
        (lambda x, w: _rms(x, (0,), None), ValueError, "normalized_shape"),
        (lambda x, w: _rms(x, 8, w[:4]), ValueError, r"weight must have shape \(8,\)"),
        (lambda x, w: _rms(x.double(), 8, w.double()), TypeError, "input dtype float64"),
        (lambda x, w: _rms(x.int(), 8, None), TypeError, "input dtype int32"),
        (lambda x, w: _rms(x.bfloat16(), 8, w.half()), TypeError, "weight must be float32 or bf"),
        (lambda x, w: _rms(x, 8, w, bias=w.double()), TypeError, "bias must be float32"),
        (lambda x, w: _rms(x, 8, w.to("meta")), ValueError, "weight is on meta"),
        (lambda x, w: _rms(x, 8, w.numpy()), TypeError, "weight must be a torch.Tensor"),
        (lambda x, w: _rms(x.numpy(), 8, w), TypeError, "input must be a torch.Tensor"),
        (lambda x, w: _rms(x, 8, w, -1.0), ValueError, "eps"),
        (lambda x, w: _rms(x, 8, w, casting_mode="fp8"), ValueError, "casting_mode"),
        (lambda x, w: _rms(x, 8, w, offset=float("nan")), ValueError, "offset"),
        (lambda x, w: _rms(x, 8, None, offset=1.0), ValueError, "offset=1.0 needs a weight"),
        (lambda x, w: _rms(x, 8, w, eps=True), TypeError, "eps must be a real number"),
        (lambda x, w: _rms(x, 8, w, out_dtype=torch.float64), TypeError, "out_dtype"),
        (lambda x, w: _rms(x, 8, w, out_dtype="bf16"), TypeError, "out_dtype"),
        (lambda x, w: _fused(x, x[:, :4], w), ValueError, "residual must have shape"),
        (lambda x, w: _fused(x, x.half(), w), TypeError, "residual must be float32"),
        (lambda x, w: _fused(x, None, w), TypeError, "residual"),
        (lambda x, w: _fused(x, x, w[None]), ValueError, r"weight must have shape \(8,\)"),
    ],
)
def test_bad_input_is_rejected_before_launch(no_launch, call, error, match):
    x = _randn(3, 8, seed=35)
    w = _randn(8, seed=36)
    with pytest.raises(error, match=match):
        call(x, w)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="casting_mode"):
        nki_torch.RMSNorm(8, casting_mode="bf16")
    with pytest.raises(ValueError, match="elementwise_affine"):
        nki_torch.RMSNorm(8, elementwise_affine=False, bias=True)
    with pytest.raises(ValueError, match="elementwise_affine"):
        nki_torch.RMSNorm(8, elementwise_affine=False, offset=1.0)
    with pytest.raises(ValueError, match=r"normalized_shape=\[8\]"):
        nki_torch.RMSNorm(8)(torch.zeros(2, 9))


# ---------------------------------------------------------------------------------------------
# NeuronDevice
# ---------------------------------------------------------------------------------------------


def _neuron_xla_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch_xla", "torch_neuronx"))


@pytest.mark.neuron
@pytest.mark.skipif(not _neuron_xla_available(), reason="needs torch_xla and torch_neuronx")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_neuron_device_matches_the_simulator(dtype):
    """On an XLA NeuronCore the kernels run through nki.jit; results match the CPU path."""
    import torch_xla.core.xla_model as xm

    device = xm.xla_device()
    x = _randn(4, 300, 512, dtype=dtype, seed=37)
    r = _randn(4, 300, 512, dtype=dtype, seed=38)
    w = _randn(512, dtype=dtype, seed=39)
    dy = _randn(4, 300, 512, dtype=dtype, seed=40)

    def run(device):
        xs, rs, ws = (t.to(device).requires_grad_() for t in (x, r, w))
        y, h = nki_torch.fused_add_rms_norm(xs, rs, ws, 1e-6, offset=0.5)
        y.backward(dy.to(device))
        return [t.cpu() for t in (y, h, xs.grad, ws.grad)]

    for got, want in zip(run(device), run("cpu")):
        torch.testing.assert_close(got, want, rtol=TOL[dtype][0] * 4, atol=TOL[dtype][1] * 4)


# ---------------------------------------------------------------------------------------------
# Examples (small sizes, so that they cannot rot unnoticed)
# ---------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).parents[2] / "examples"


def _run_example(name, *argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", [name, *argv])
    return runpy.run_path(str(EXAMPLES / name), run_name="not_main")["main"]()


@pytest.mark.skipif(
    not hasattr(kernels, "rmsnorm_fwd_out"), reason="needs the output-parameter kernels"
)
def test_example_rmsnorm_torch(monkeypatch, capsys):
    for name in ("torch_neuronx", "torch_neuronx.xla_impl", "torch_neuronx.xla_impl.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # the example installs its own
    _run_example(
        "rmsnorm_torch.py",
        "--rows",
        "16",
        "--hidden",
        "64",
        "--iters",
        "1",
        monkeypatch=monkeypatch,
    )
    out = capsys.readouterr().out
    assert "[tutorial launch] torch_neuronx.nki_jit(rmsnorm_fwd_out)" in out
    errors = [
        float(line.split("=")[1].split("(")[1].split()[0])
        for line in out.splitlines()
        if line.startswith("max |")
    ]
    assert len(errors) == 4 and all(e < 4 for e in errors), out  # in eps of max |ref|
    assert "bitwise equal to eager: True" in out and "forward+backward" in out


def test_example_train_tiny_llama_loss_curves_agree(monkeypatch, capsys):
    status = _run_example("train_tiny_llama.py", "--steps", "3", monkeypatch=monkeypatch)
    assert status == 0, capsys.readouterr().out
