"""``output_layout="transposed"`` (y as nki-library's rmsnorm_tkg writes it, (128, M, N / 128)
with ``y_t[p, m, k] = y[m, p · (N / 128) + k]``) through the PyTorch and JAX bindings: the
NumPy launcher's bytes and the float64 reference, gradients equal to the row layout's on the
rearranged gradient, the fake (meta) shapes and ``torch.library.opcheck``, and bad input
(N % 128 != 0, the legacy dialect, an unknown layout) rejected before a launch."""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import dialect, ops
from nki_rmsnorm import reference as ref

torch = pytest.importorskip("torch")

from dialect_launches import record_launches  # noqa: E402

from nki_rmsnorm import torch as nki_torch  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
P = 128
EPS = 1e-6
#: |y - y64| <= ATOL + RTOL·|y64|: one rounding to the output dtype after fp32 math.
TOLERANCE = {np.dtype(np.float32): (1e-5, 1e-5), BF16: (1e-2, 1e-2)}


@pytest.fixture(autouse=True)
def _trn2_nki06(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    with dialect.use_dialect("nki06"):
        yield


def _rows_of(y_t):
    """The (M, N) array whose transposed layout ``y_t`` is (NumPy)."""
    parts, rows, per_partition = y_t.shape
    return y_t.transpose(1, 0, 2).reshape(rows, parts * per_partition)


def _arrays(rng, shape, dtype):
    n = shape[-1]
    x = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    residual = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    weight = (1 + 0.3 * rng.standard_normal(n)).astype(np.float32).astype(dtype)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32).astype(dtype)
    return x, residual, weight, bias


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8)


def _assert_near_reference(y_t, x, weight, bias, residual, dtype):
    want = ref.rms_norm_fwd(x, weight, EPS, bias=bias, residual=residual)[0]
    got = _rows_of(np.asarray(y_t)).astype(np.float64)
    rtol, atol = TOLERANCE[np.dtype(dtype)]
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=rtol, atol=atol)


# --- PyTorch -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_same_bytes_as_the_numpy_launcher(rng, dtype, residual):
    """Under ``torch.inference_mode`` (the serving path): the NumPy launcher's bytes, the
    row layout's bytes rearranged, and the float64 reference."""
    x, r, w, b = _arrays(rng, (2, 3, 1024), dtype)
    if not residual:
        r = None
    tx, tr, tw, tb = (None if a is None else nki_torch._from_numpy(a) for a in (x, r, w, b))
    with torch.inference_mode():
        if residual:
            y_t, h = nki_torch.fused_add_rms_norm(
                tx, tr, tw, EPS, bias=tb, output_layout="transposed"
            )
            y_rows, h_rows = nki_torch.fused_add_rms_norm(tx, tr, tw, EPS, bias=tb)
        else:
            y_t = nki_torch.rms_norm(tx, 1024, tw, EPS, bias=tb, output_layout="transposed")
            y_rows = nki_torch.rms_norm(tx, 1024, tw, EPS, bias=tb)
    want = ops.rms_norm(x, w, EPS, bias=b, residual=r, output_layout="transposed")
    want_y = want[0] if residual else want
    got = nki_torch._to_numpy(y_t)
    assert got.shape == (P, 6, 8) and got.dtype == dtype
    np.testing.assert_array_equal(_bits(got), _bits(want_y))
    rows = nki_torch._to_numpy(y_rows).reshape(6, P, 8).transpose(1, 0, 2)
    np.testing.assert_array_equal(_bits(got), _bits(rows))
    if residual:
        assert tuple(h.shape) == x.shape
        np.testing.assert_array_equal(_bits(nki_torch._to_numpy(h)), _bits(want[1]))
        np.testing.assert_array_equal(
            _bits(nki_torch._to_numpy(h)), _bits(nki_torch._to_numpy(h_rows))
        )
    _assert_near_reference(got, x, w, b, r, dtype)


def test_torch_out_dtype_and_no_rows():
    x = torch.ones((0, 256), dtype=torch.bfloat16)
    y_t = nki_torch.rms_norm(x, 256, output_layout="transposed", out_dtype=torch.float32)
    assert tuple(y_t.shape) == (P, 0, 2) and y_t.dtype == torch.float32


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_gradients_are_the_row_layouts(rng, residual):
    """The backward of the transposed form is the row layout's on the gradient rearranged
    back to rows: the same gradients, bit for bit."""
    x, r, w, b = _arrays(rng, (4, 512), np.float32)
    dy = rng.standard_normal((4, 512)).astype(np.float32)
    dy_t = torch.from_numpy(dy.reshape(4, P, 4).transpose(1, 0, 2).copy())
    dh = torch.from_numpy(rng.standard_normal((4, 512)).astype(np.float32))

    def grads(layout):
        leaves = [torch.from_numpy(a.copy()).requires_grad_() for a in (x, r, w, b)]
        tx, tr, tw, tb = leaves
        if residual:
            y, h = nki_torch.fused_add_rms_norm(tx, tr, tw, EPS, bias=tb, output_layout=layout)
            outputs, cotangents = (y, h), (dy_t if layout == "transposed" else dy_rows, dh)
        else:
            y = nki_torch.rms_norm(tx, 512, tw, EPS, bias=tb, output_layout=layout)
            outputs, cotangents = (y,), (dy_t if layout == "transposed" else dy_rows,)
        torch.autograd.backward(outputs, cotangents)
        return [leaf.grad for leaf in (leaves if residual else (tx, tw, tb))]

    dy_rows = torch.from_numpy(dy)
    for got, want in zip(grads("transposed"), grads("rows")):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_xla_launch_runs_the_nki_jit_kernel(rng, monkeypatch, residual):
    """CPU tensors routed through the "xla" launcher (a ``torch_neuronx`` without
    ``nki_jit``, as on every SDK with NKI 0.6): the return-convention transposed kernel is
    called with the tensors, the simulator path's bytes; TorchNeuron has no such form yet."""
    x, r, w, _ = (nki_torch._from_numpy(a) for a in _arrays(rng, (5, 512), BF16))
    if residual:
        want = nki_torch.fused_add_rms_norm(x, r, w, EPS, output_layout="transposed")
    else:
        want = (nki_torch.rms_norm(x, 512, w, EPS, output_layout="transposed"),)
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    monkeypatch.setitem(nki_torch.LAUNCHERS, "cpu", nki_torch.LAUNCHERS["xla"])
    launches = record_launches(monkeypatch)
    if residual:
        got = nki_torch.fused_add_rms_norm(x, r, w, EPS, output_layout="transposed")
    else:
        got = (nki_torch.rms_norm(x, 512, w, EPS, output_layout="transposed"),)
    assert nki_torch.last_launch_path == "nki.jit"
    name = "rmsnorm_add_fwd_transposed" if residual else "rmsnorm_fwd_transposed"
    assert [(launch.dialect, launch.kernel) for launch in launches] == [("nki06", name)]
    for g, want_tensor in zip(got, want, strict=True):
        assert g.dtype == want_tensor.dtype and torch.equal(g, want_tensor)
    monkeypatch.setitem(nki_torch.LAUNCHERS, "cpu", nki_torch.LAUNCHERS["neuron"])
    with pytest.raises(NotImplementedError, match="TorchNeuron"):
        nki_torch.rms_norm(x, 512, w, EPS, output_layout="transposed")


def test_torch_compile_fullgraph(rng):
    """``torch.compile(fullgraph=True)``: no graph break, the eager bytes, and the backward."""
    torch._dynamo.reset()
    x, _, w, _ = (torch.from_numpy(a) for a in _arrays(rng, (3, 256), np.float32))

    def forward(x, w):
        return nki_torch.rms_norm(x, 256, w, EPS, output_layout="transposed")

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    xs = x.clone().requires_grad_()
    y_t = compiled(xs, w)
    torch.testing.assert_close(y_t, forward(x, w), rtol=0, atol=0)
    y_t.square().sum().backward()
    xe = x.clone().requires_grad_()
    forward(xe, w).square().sum().backward()
    torch.testing.assert_close(xs.grad, xe.grad, rtol=0, atol=0)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_fake_shapes_and_opcheck(rng, residual):
    x, r, w, b = (nki_torch._from_numpy(a) for a in _arrays(rng, (4, 256), BF16))
    meta = [t.to("meta") for t in (x, r, w)]
    if residual:
        y_t, h = nki_torch.fused_add_rms_norm(
            *meta, EPS, out_dtype=torch.float32, output_layout="transposed"
        )
        assert (tuple(h.shape), h.dtype) == ((4, 256), torch.bfloat16)
    else:
        y_t = nki_torch.rms_norm(
            meta[0], 256, meta[2], EPS, out_dtype=torch.float32, output_layout="transposed"
        )
    assert (tuple(y_t.shape), y_t.dtype, y_t.device.type) == ((P, 4, 2), torch.float32, "meta")
    if residual:
        op, args = torch.ops.nki_rmsnorm.rms_norm_add_fwd_transposed, (x, r, w, b)
    else:
        op, args = torch.ops.nki_rmsnorm.rms_norm_fwd_transposed, (x, w, b)
    torch.library.opcheck(
        op,
        (*args, EPS, 0.0, "gemma", "float32"),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )


@pytest.mark.parametrize(
    ("n", "layout", "legacy", "message"),
    [
        (1000, "transposed", False, "N divisible by 128"),
        (256, "columns", False, "output_layout must be one of"),
        (256, None, False, "output_layout must be one of"),
        (256, "transposed", True, "needs the NKI 0.6 kernels"),
    ],
)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_torch_bad_input_before_a_launch(no_launch, n, layout, legacy, message, residual):
    x = torch.ones((4, n), dtype=torch.bfloat16)
    w = torch.ones(n, dtype=torch.bfloat16)
    with dialect.use_dialect("legacy" if legacy else "nki06"):
        with pytest.raises(ValueError, match=message):
            if residual:
                nki_torch.fused_add_rms_norm(x, x.clone(), w, output_layout=layout)
            else:
                nki_torch.rms_norm(x, n, w, output_layout=layout)


@pytest.mark.parametrize(
    ("n", "legacy", "message"),
    [(1000, False, "N divisible by 128"), (256, True, "needs the NKI 0.6 kernels")],
)
def test_torch_operator_rejects_before_a_launch(no_launch, n, legacy, message):
    """The custom operator checks on its own (``torch.ops`` callers, compiled graphs)."""
    x = torch.ones((4, n), dtype=torch.bfloat16)
    with dialect.use_dialect("legacy" if legacy else "nki06"):
        with pytest.raises(ValueError, match=message):
            torch.ops.nki_rmsnorm.rms_norm_fwd_transposed(x, None, None, EPS, 0.0, "gemma", None)
        with pytest.raises(ValueError, match=message):
            torch.ops.nki_rmsnorm.rms_norm_add_fwd_transposed(
                x, x, None, None, EPS, 0.0, "gemma", None
            )


# --- JAX -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float32)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_jax_same_bytes_under_jit(rng, dtype, residual):
    jax = pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    x, r, w, b = _arrays(rng, (2, 3, 1024), dtype)
    if residual:
        run = jax.jit(
            lambda x, r, w, b: nki_jax.fused_add_rms_norm(
                x, r, w, EPS, bias=b, output_layout="transposed"
            )
        )
        y_t, h = run(x, r, w, b)
        assert jax.eval_shape(run, x, r, w, b)[0].shape == (P, 6, 8)
    else:
        run = jax.jit(
            lambda x, w, b: nki_jax.rms_norm(x, w, EPS, bias=b, output_layout="transposed")
        )
        y_t = run(x, w, b)
        struct = jax.eval_shape(run, x, w, b)
        assert (struct.shape, np.dtype(struct.dtype)) == ((P, 6, 8), dtype)
        r = None
    want = ops.rms_norm(x, w, EPS, bias=b, residual=r, output_layout="transposed")
    want_y = want[0] if residual else want
    assert np.asarray(y_t).shape == (P, 6, 8)
    np.testing.assert_array_equal(_bits(y_t), _bits(want_y))
    if residual:
        assert h.shape == x.shape
        np.testing.assert_array_equal(_bits(h), _bits(want[1]))
    _assert_near_reference(y_t, x, w, b, r, dtype)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_jax_gradients_are_the_row_layouts(rng, residual):
    """``jax.grad`` through the transposed form equals it through the rows form with the
    loss's weights rearranged the same way."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from nki_rmsnorm import jax as nki_jax

    x, r, w, b = _arrays(rng, (4, 512), np.float32)
    c = rng.standard_normal((4, 512)).astype(np.float32)
    c_t = c.reshape(4, P, 4).transpose(1, 0, 2)

    def loss(layout, x, r, w, b):
        if residual:
            y, h = nki_jax.fused_add_rms_norm(x, r, w, EPS, bias=b, output_layout=layout)
            extra = jnp.sum(h * h)
        else:
            y, extra = nki_jax.rms_norm(x, w, EPS, bias=b, output_layout=layout), 0.0
        return jnp.sum(y * (c_t if layout == "transposed" else c)) + extra

    argnums = (0, 1, 2, 3)
    got = jax.jit(jax.grad(lambda *a: loss("transposed", *a), argnums=argnums))(x, r, w, b)
    want = jax.grad(lambda *a: loss("rows", *a), argnums=argnums)(x, r, w, b)
    for g, h in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize(
    ("n", "layout", "legacy", "message"),
    [
        (1000, "transposed", False, "N divisible by 128"),
        (256, "columns", False, "output_layout must be one of"),
        (256, "transposed", True, "needs the NKI 0.6 kernels"),
    ],
)
def test_jax_bad_input_before_a_launch(monkeypatch, n, layout, legacy, message):
    pytest.importorskip("jax")
    from nki_rmsnorm import jax as nki_jax

    monkeypatch.setattr(nki_jax, "_host_call", lambda *a, **k: pytest.fail("launched"))
    x, w = np.ones((4, n), np.float32), np.ones(n, np.float32)
    with dialect.use_dialect("legacy" if legacy else "nki06"):
        with pytest.raises(ValueError, match=message):
            nki_jax.rms_norm(x, w, output_layout=layout)
        with pytest.raises(ValueError, match=message):
            nki_jax.fused_add_rms_norm(x, x, w, output_layout=layout)
