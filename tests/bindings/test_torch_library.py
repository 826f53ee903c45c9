"""The ``torch.library`` custom operators behind ``nki_rmsnorm.torch``: ``opcheck``,
``torch.compile`` without graph breaks, ``torch.export``, ``FakeTensorMode``, ``"meta"``
tensors and the ``torch.func`` transforms. Values are compared with float64 references."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from torch._dynamo.utils import counters  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from nki_rmsnorm import ops  # noqa: E402
from nki_rmsnorm import torch as nki_torch  # noqa: E402

OPS = torch.ops.nki_rmsnorm


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.fixture
def launches(monkeypatch):
    """Counts the simulator launches of the forward and backward kernels."""
    counts = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = ops.rms_norm_fwd, ops.rms_norm_bwd

    def fwd(*args, **kwargs):
        counts["fwd"] += 1
        return real_fwd(*args, **kwargs)

    def bwd(*args, **kwargs):
        counts["bwd"] += 1
        return real_bwd(*args, **kwargs)

    monkeypatch.setattr(ops, "rms_norm_fwd", fwd)
    monkeypatch.setattr(ops, "rms_norm_bwd", bwd)
    return counts


# ---------------------------------------------------------------------------------------------
# opcheck: schema, autograd registration, fake tensors, AOT dispatch, on every operator
# ---------------------------------------------------------------------------------------------


def _fwd_cases():
    x = _randn(5, 16, seed=1)
    w, b = _randn(16, seed=2), _randn(16, seed=3)
    xb = x.bfloat16()
    return [
        (x, w, b, 1e-6, 0.5, "gemma", None),
        (x, None, None, 1e-5, 0.0, "none", "bfloat16"),
        (xb, w.bfloat16(), b, 1e-6, 0.0, "llama", "float32"),
    ]


def _add_fwd_cases():
    x, r = _randn(5, 16, seed=4), _randn(5, 16, seed=5)
    w = _randn(16, seed=6)
    return [
        (x, r, w, None, 1e-6, 1.0, "gemma", None),
        (x.bfloat16(), r, None, w.bfloat16(), 1e-6, 0.0, "llama", None),  # fp32 residual
    ]


def _bwd_cases():
    x, dy = _randn(6, 16, seed=7), _randn(6, 16, seed=8)
    w = _randn(16, seed=9)
    _, rstd = OPS.rms_norm_fwd(x, w, None, 1e-6, 0.0, "gemma", None)
    xb = x.bfloat16()
    _, rstd_b = OPS.rms_norm_fwd(xb, w.bfloat16(), None, 1e-6, 0.0, "gemma", None)
    return [
        (dy, x, w, rstd, 0.0, True, None, "gemma"),
        (dy, x, None, rstd, 0.0, False, None, "none"),
        (dy.bfloat16(), xb, w.bfloat16(), rstd_b, 0.0, True, "float32", "gemma"),
    ]


def _add_bwd_cases():
    x, r, dy, dh = (_randn(6, 16, seed=s) for s in (10, 11, 12, 13))
    w = _randn(16, seed=14)
    _, h, rstd = OPS.rms_norm_add_fwd(x, r, w, None, 1e-6, 0.0, "gemma", None)
    xb = x.bfloat16()
    _, hf, rstd_f = OPS.rms_norm_add_fwd(xb, r, None, None, 1e-6, 0.0, "gemma", None)
    return [
        (dy, h, w, rstd, dh, "float32", 0.0, True, None, "gemma"),
        (dy.bfloat16(), hf, None, rstd_f, None, "bfloat16", 0.0, False, None, "gemma"),
    ]


def _with_grad(args, first_n):
    return tuple(
        a.detach().clone().requires_grad_() if i < first_n and isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    )


@pytest.mark.parametrize(
    "op, cases, differentiable",
    [
        (OPS.rms_norm_fwd.default, _fwd_cases, 3),
        (OPS.rms_norm_add_fwd.default, _add_fwd_cases, 4),
        (OPS.rms_norm_bwd.default, _bwd_cases, 0),
        (OPS.rms_norm_add_bwd.default, _add_bwd_cases, 0),
    ],
    ids=["rms_norm_fwd", "rms_norm_add_fwd", "rms_norm_bwd", "rms_norm_add_bwd"],
)
def test_opcheck_passes_on_every_operator(op, cases, differentiable):
    for args in cases():
        result = torch.library.opcheck(op, _with_grad(args, differentiable))
        assert set(result.values()) == {"SUCCESS"}, result


def test_opcheck_detects_a_fake_implementation_that_lies(monkeypatch):
    """The check above can fail: a fake rstd of the wrong dtype is reported."""
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef("nki_rmsnorm::rms_norm_fwd")
    real_fake = opdef._abstract_fn

    def wrong_fake(*args):
        y, rstd = real_fake(*args)
        return y, rstd.to(torch.float16)

    monkeypatch.setattr(opdef, "_abstract_fn", wrong_fake)
    with pytest.raises(Exception, match="dtype|float16"):
        torch.library.opcheck(
            OPS.rms_norm_fwd.default, _fwd_cases()[0], test_utils=("test_faketensor",)
        )


# ---------------------------------------------------------------------------------------------
# torch.compile and torch.export
# ---------------------------------------------------------------------------------------------


class LinearNorm(torch.nn.Module):
    def __init__(self, hidden=32, **norm_options):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm = nki_torch.RMSNorm(hidden, eps=1e-6, **norm_options)

    def forward(self, x):
        return self.norm(self.proj(x))


def _model(seed=0, **norm_options):
    torch.manual_seed(seed)
    model = LinearNorm(**norm_options)
    with torch.no_grad():
        model.norm.weight.copy_(_randn(32, seed=seed + 1) * 0.2)
        if model.norm.bias is not None:
            model.norm.bias.copy_(_randn(32, seed=seed + 2) * 0.1)
    return model


def test_compile_fullgraph_has_no_graph_breaks_and_runs_both_kernels(launches):
    model = _model(offset=1.0, bias=True)
    x = _randn(3, 7, 32, seed=20)
    dy = _randn(3, 7, 32, seed=21)

    eager_x = x.clone().requires_grad_()
    model(eager_x).backward(dy)
    eager = [eager_x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    launches.update(fwd=0, bwd=0)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled_x = x.clone().requires_grad_()
    y = compiled(compiled_x)
    y.backward(dy)

    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert launches == {"fwd": 1, "bwd": 1}  # the kernels, not a traced-through formula
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    for got, want in zip([compiled_x.grad] + [p.grad for p in model.parameters()], eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dynamo_explain_reports_one_graph_for_the_fused_add():
    def block(x, r, w):
        y, h = nki_torch.fused_add_rms_norm(x, r, w, 1e-6)
        return y * 2, h

    args = (_randn(4, 32, seed=22), _randn(4, 32, seed=23), _randn(32, seed=24))
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0


def test_export_contains_the_custom_op_and_runs():
    model = _model(seed=3)
    x = _randn(2, 5, 32, seed=25)
    exported = torch.export.export(model, (x,))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert OPS.rms_norm_fwd.default in targets
    torch.testing.assert_close(exported.module()(x), model(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Fake and meta tensors: shapes and dtypes, no launch
# ---------------------------------------------------------------------------------------------


def test_fake_tensor_mode_gives_shapes_and_dtypes_without_launching(no_launch):
    with FakeTensorMode():
        x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
        r = torch.randn(2, 3, 32)
        w = torch.randn(32, requires_grad=True)
        y = nki_torch.rms_norm(x, 32, w, out_dtype=torch.float32)
        y2, h = nki_torch.fused_add_rms_norm(x, r, None)
        y.sum().backward()
        assert (y.shape, y.dtype) == ((2, 3, 32), torch.float32)
        assert (y2.dtype, h.dtype, h.shape) == (torch.bfloat16, torch.float32, (2, 3, 32))
        assert (w.grad.shape, w.grad.dtype) == ((32,), torch.float32)


@pytest.mark.parametrize("residual", [False, True])
def test_meta_tensors_are_shape_only(no_launch, residual):
    x = torch.empty(4, 6, 64, device="meta", dtype=torch.float16, requires_grad=True)
    w = torch.empty(64, device="meta", dtype=torch.float16, requires_grad=True)
    b = torch.empty(64, device="meta", dtype=torch.float32, requires_grad=True)
    if residual:
        r = torch.empty(4, 6, 64, device="meta", dtype=torch.float32, requires_grad=True)
        y, h = nki_torch.fused_add_rms_norm(x, r, w, bias=b)
        (y.float().sum() + h.sum()).backward()
        assert (h.device.type, h.dtype) == ("meta", torch.float32)
        assert (r.grad.dtype, r.grad.shape) == (torch.float32, r.shape)
    else:
        y = nki_torch.rms_norm(x, 64, w, bias=b)
        y.sum().backward()
    assert (y.device.type, y.shape, y.dtype) == ("meta", (4, 6, 64), torch.float16)
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (x.dtype, w.dtype, b.dtype)
    module = nki_torch.RMSNorm(64, device="meta")
    assert module(torch.empty(3, 64, device="meta")).device.type == "meta"


# ---------------------------------------------------------------------------------------------
# torch.func
# ---------------------------------------------------------------------------------------------


def test_func_grad_matches_float64():
    x, w = _randn(5, 24, seed=30), _randn(24, seed=31)

    def loss(x, w):
        return nki_torch.rms_norm(x, 24, w, 1e-6).square().sum()

    dx, dw = torch.func.grad(loss, argnums=(0, 1))(x, w)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    F.rms_norm(x64, (24,), w64, 1e-6).square().sum().backward()
    torch.testing.assert_close(dx.double(), x64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=1e-4, atol=1e-4)


def test_vmap_folds_the_batch_into_one_launch(launches):
    x, w = _randn(3, 5, 16, seed=32), _randn(16, seed=33)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no slow per-example fallback
        y = torch.func.vmap(lambda x: nki_torch.rms_norm(x, 16, w, 1e-6))(x)
    assert launches["fwd"] == 1
    torch.testing.assert_close(y, nki_torch.rms_norm(x, 16, w, 1e-6), rtol=0, atol=0)


def test_vmap_with_batched_weight_and_fused_add():
    x, r = _randn(5, 3, 16, seed=34), _randn(5, 3, 16, seed=35)
    w = _randn(3, 16, seed=36)
    y, h = torch.func.vmap(
        lambda x, r, w: nki_torch.fused_add_rms_norm(x, r, w, 1e-6), in_dims=(1, 1, 0)
    )(x, r, w)
    for i in range(3):
        yi, hi = nki_torch.fused_add_rms_norm(x[:, i], r[:, i], w[i], 1e-6)
        torch.testing.assert_close(y[i], yi, rtol=0, atol=0)
        torch.testing.assert_close(h[i], hi, rtol=0, atol=0)


def test_per_example_gradients_with_vmap_of_grad():
    x, w = _randn(4, 2, 16, seed=37), _randn(16, seed=38)

    def loss(w, x):
        return nki_torch.rms_norm(x, 16, w, 1e-6).pow(3).sum()

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, x)
    for i in range(4):
        w64 = w.double().requires_grad_()
        F.rms_norm(x[i].double(), (16,), w64, 1e-6).pow(3).sum().backward()
        torch.testing.assert_close(per_example[i].double(), w64.grad, rtol=1e-4, atol=1e-4)
