"""JAX bindings (``nki_rmsnorm.jax``) on the CPU backend, where the kernels are simulated.

Values are compared with the float64 NumPy reference; gradients with ``jax.vjp`` of the same
formula written in ``jax.numpy`` and evaluated in float32 on upcast inputs (its own error is
far below the tolerances, which are a few ulps of the dtype under test).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from dialect_launches import record_launches  # noqa: E402

import simulate  # noqa: E402
from nki_rmsnorm import (  # noqa: E402
    dialect,  # noqa: E402
    ops,
    reference,
)
from nki_rmsnorm import jax as nki_jax  # noqa: E402


@pytest.fixture(autouse=True)
def _simulator_path(monkeypatch):
    """These tests exercise the simulator path: no ``jax_neuronx`` twin left registered by a
    test that called ``simulate.install()`` (test_jax_launchers.py covers that path)."""
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)


TOL = {
    jnp.float32: (2e-5, 2e-5),
    jnp.float16: (2e-3, 2e-3),
    jnp.bfloat16: (1.6e-2, 1.6e-2),
}


def _randn(*shape, dtype=jnp.float32, seed=0, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32), dtype)


def _jnp_rms_norm(x, weight=None, eps=1e-6, offset=0.0, bias=None, residual=None):
    """The formula in float32 jax.numpy on upcast inputs: ``(y, h)``."""
    f32 = [None if a is None else a.astype(jnp.float32) for a in (x, weight, bias, residual)]
    x, weight, bias, residual = f32
    h = x if residual is None else x + residual
    y = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * (weight + offset)
    if bias is not None:
        y = y + bias
    return y, h


def _close(actual, expected, dtype, scale=1.0, what=""):
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(
        np.asarray(actual, np.float64),
        np.asarray(expected, np.float64),
        rtol=rtol,
        atol=atol * scale,
        err_msg=what,
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_forward_and_gradients_under_jit(dtype):
    x = _randn(2, 3, 48, dtype=dtype, seed=1)
    w = _randn(48, dtype=dtype, seed=2, scale=0.5, shift=1.0)
    dy = _randn(2, 3, 48, dtype=dtype, seed=3)

    @jax.jit
    def forward_and_grads(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: nki_jax.rms_norm(x, w, 1e-5), x, w)
        return (y, *vjp(dy))

    y, dx, dw = forward_and_grads(x, w, dy)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype

    y_ref = reference.rms_norm(np.asarray(x), np.asarray(w), 1e-5)
    _close(y, y_ref, dtype, what="y")
    _, ref_vjp = jax.vjp(lambda x, w: _jnp_rms_norm(x, w, 1e-5)[0], x, w)
    dx_ref, dw_ref = ref_vjp(dy.astype(jnp.float32))
    _close(dx, dx_ref, dtype, scale=2, what="dx")
    _close(dw, dw_ref, dtype, scale=4, what="dweight")


def test_grad_of_a_loss_with_offset_bias_and_no_weight():
    x = _randn(5, 40, seed=4)
    w = _randn(40, seed=5, scale=0.1)
    b = _randn(40, seed=6, scale=0.1)

    def loss(fn, x, w, b):
        return jnp.sum(jnp.sin(fn(x, w, b)))

    ours = jax.jit(
        jax.grad(
            lambda x, w, b: loss(
                lambda *a: nki_jax.rms_norm(a[0], a[1], offset=1.0, bias=a[2]), x, w, b
            ),
            argnums=(0, 1, 2),
        )
    )(x, w, b)
    expected = jax.grad(
        lambda x, w, b: loss(lambda *a: _jnp_rms_norm(a[0], a[1], 1e-6, 1.0, a[2])[0], x, w, b),
        argnums=(0, 1, 2),
    )(x, w, b)
    for got, want, what in zip(ours, expected, ("dx", "dweight", "dbias")):
        _close(got, want, jnp.float32, scale=4, what=what)

    y = nki_jax.rms_norm(x)  # no weight
    _close(y, reference.rms_norm(np.asarray(x)), jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(nki_jax.rms_norm(x) * b))(x)
    dx_ref = jax.grad(lambda x: jnp.sum(_jnp_rms_norm(x)[0] * b))(x)
    _close(dx, dx_ref, jnp.float32, what="dx without weight")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_add(dtype):
    x = _randn(4, 32, dtype=dtype, seed=7)
    r = _randn(4, 32, dtype=dtype, seed=8)
    w = _randn(32, dtype=dtype, seed=9, scale=0.5, shift=1.0)
    dy, dh = _randn(4, 32, dtype=dtype, seed=10), _randn(4, 32, dtype=dtype, seed=11)

    (y, h), vjp = jax.vjp(lambda x, r, w: nki_jax.fused_add_rms_norm(x, r, w), x, r, w)
    dx, dr, dw = vjp((dy, dh))

    h_rounded = (x.astype(jnp.float32) + r.astype(jnp.float32)).astype(dtype)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_rounded))
    _close(y, reference.rms_norm(np.asarray(h_rounded), np.asarray(w)), dtype, what="y")

    # Reference gradient: normalise the rounded h, with h's gradient passed straight through.
    def ref(x, r, w):
        h = x.astype(jnp.float32) + r.astype(jnp.float32)
        h = h + jax.lax.stop_gradient(h_rounded.astype(jnp.float32) - h)
        return _jnp_rms_norm(h, w)[0], h

    _, ref_vjp = jax.vjp(ref, x, r, w)
    dx_ref, dr_ref, dw_ref = ref_vjp((dy.astype(jnp.float32), dh.astype(jnp.float32)))
    _close(dx, dx_ref, dtype, scale=2, what="dx")
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dr))
    _close(dw, dw_ref, dtype, scale=4, what="dweight")


def test_llama_casting_matches_hf_llama_bit_for_bit():
    x = _randn(16, 64, dtype=jnp.bfloat16, seed=12, scale=3.0)
    w = _randn(64, dtype=jnp.bfloat16, seed=13, scale=0.3, shift=1.0)
    xf = x.astype(jnp.float32)
    hf = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype) * w
    ours = jax.jit(lambda x, w: nki_jax.rms_norm(x, w, casting_mode="llama"))(x, w)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(ours).view(np.int16), np.asarray(hf).view(np.int16))


def test_vmap_forward_with_shared_and_batched_weights(monkeypatch):
    x = _randn(3, 5, 32, seed=14)
    w = _randn(32, seed=15)
    ws = _randn(3, 32, seed=16)

    launches = []
    real_fwd = ops.rms_norm_fwd

    def counting_fwd(*args, **kwargs):
        launches.append(args[0].shape)
        return real_fwd(*args, **kwargs)

    monkeypatch.setattr(ops, "rms_norm_fwd", counting_fwd)

    shared = jax.vmap(nki_jax.rms_norm, in_axes=(0, None))(x, w)
    assert len(launches) == 1, "a shared weight runs every batch element in one launch"
    _close(shared, reference.rms_norm(np.asarray(x), np.asarray(w)), jnp.float32)

    batched = jax.jit(jax.vmap(nki_jax.rms_norm))(x, ws)
    for i in range(3):
        _close(batched[i], reference.rms_norm(np.asarray(x[i]), np.asarray(ws[i])), jnp.float32)

    # Nested vmap: x batched on both levels, the weight on the outer one only.
    xx = _randn(2, 3, 4, 32, seed=17)
    nested = jax.vmap(jax.vmap(nki_jax.rms_norm, in_axes=(0, None)), in_axes=(0, 0))(xx, ws[:2])
    for i in range(2):
        _close(nested[i], reference.rms_norm(np.asarray(xx[i]), np.asarray(ws[i])), jnp.float32)


def test_vmap_of_grad_gives_per_example_weight_gradients():
    x = _randn(3, 6, 32, seed=18)
    w = _randn(32, seed=19, scale=0.5, shift=1.0)
    r = _randn(3, 6, 32, seed=20)

    def loss(w, x, r):
        y, h = nki_jax.fused_add_rms_norm(x, r, w)
        return jnp.sum(y * y) + jnp.sum(jnp.cos(h))

    def ref_loss(w, x, r):
        y, h = _jnp_rms_norm(x, w, residual=r)
        return jnp.sum(y * y) + jnp.sum(jnp.cos(h))

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(w, x, r)
    assert per_example.shape == (3, 32)
    for i in range(3):
        _close(per_example[i], jax.grad(ref_loss)(w, x[i], r[i]), jnp.float32, scale=20)
    # grad of a vmapped loss sums the per-example weight gradients.
    total = jax.grad(lambda w: jnp.sum(jax.vmap(loss, in_axes=(None, 0, 0))(w, x, r)))(w)
    np.testing.assert_allclose(total, per_example.sum(0), rtol=1e-5, atol=1e-4)


def test_empty_rows():
    x = jnp.zeros((0, 16))
    w = _randn(16, seed=21)
    y = nki_jax.rms_norm(x, w)
    assert y.shape == (0, 16)
    dw = jax.grad(lambda w: jnp.sum(nki_jax.rms_norm(x, w)))(w)
    np.testing.assert_array_equal(dw, np.zeros(16, np.float32))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w: nki_jax.rms_norm(x, w[:8]), ValueError, r"weight must have shape \(16,\)"),
        (lambda x, w: nki_jax.rms_norm(np.ones((4, 16)), None), TypeError, "x dtype float64"),
        (lambda x, w: nki_jax.rms_norm(x.astype(jnp.int32), None), TypeError, "x dtype int32"),
        (
            lambda x, w: nki_jax.rms_norm(x.astype(jnp.bfloat16), w.astype(jnp.float16)),
            TypeError,
            "weight must be float32 or bfloat16",
        ),
        (lambda x, w: nki_jax.rms_norm(x, w, bias=w[None]), ValueError, "bias must have shape"),
        (lambda x, w: nki_jax.rms_norm(x, [1.0] * 16), TypeError, "weight must be an array"),
        (lambda x, w: nki_jax.rms_norm(x, w, -1.0), ValueError, "eps"),
        (lambda x, w: nki_jax.rms_norm(x, w, offset=float("inf")), ValueError, "offset"),
        (lambda x, w: nki_jax.rms_norm(x, w, casting_mode="fp8"), ValueError, "casting_mode"),
        (lambda x, w: nki_jax.rms_norm(x, None, offset=1.0), ValueError, "needs a weight"),
        (lambda x, w: nki_jax.rms_norm(x[0, 0], w), ValueError, "at least one dimension"),
        (lambda x, w: nki_jax.fused_add_rms_norm(x, x[:1], w), ValueError, "residual must have"),
        (
            lambda x, w: nki_jax.fused_add_rms_norm(x, x.astype(jnp.float16), w),
            TypeError,
            "residual must be float32",
        ),
        (lambda x, w: nki_jax.fused_add_rms_norm(x, None, w), TypeError, "residual"),
    ],
)
def test_bad_input_is_rejected_at_trace_time(monkeypatch, call, error, match):
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(ops, "rms_norm_fwd", launched)
    x, w = _randn(4, 16, seed=22), _randn(16, seed=23)
    with pytest.raises(error, match=match):
        call(x, w)
    with pytest.raises(error, match=match):
        jax.jit(call)(x, w)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dialect_name", ["legacy", "nki06"])
def test_device_branch_calling_convention(monkeypatch, dialect_name, jit):
    """The Neuron branch calls the nki.jit kernels of the chosen dialect directly with JAX
    arrays, traced or not (nki/guides/framework_custom_op.rst, lines 150-165 and 286-308:
    the kernel called inside ``jax.jit`` and a ``custom_vjp``). The simulator's ``nki.jit``
    kernels stand in for the Neuron compiler's (a traced call becomes one operation of the
    program, ``simulate.jax_neuronx.call_traced``): the branch's argument order and output
    unpacking must give the callback path's results bit for bit."""
    simulate.install()  # ``import nki`` / ``neuronxcc.nki``: the simulator's front-ends
    monkeypatch.delitem(sys.modules, "jax_neuronx")  # no nki_call: the SDK >= 2.23 branch
    x, r = _randn(4, 32, seed=26, dtype=jnp.bfloat16), _randn(4, 32, seed=27, dtype=jnp.bfloat16)
    w, b = _randn(32, seed=28), _randn(32, seed=29)

    def loss(x, r, w, b):
        y, h = nki_jax.fused_add_rms_norm(x, r, w, offset=0.5, bias=b)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(h.astype(jnp.float32)))

    def run():
        forward = functools.partial(nki_jax.fused_add_rms_norm, offset=0.5, bias=b)
        grads = jax.grad(loss, argnums=(0, 1, 2, 3))
        if jit:
            forward, grads = jax.jit(forward), jax.jit(grads)
        return forward(x, r, w), grads(x, r, w, b)

    with dialect.use_dialect(dialect_name):
        simulated = run()
        monkeypatch.setattr(nki_jax, "_on_neuron", lambda: True)
        assert nki_jax.launch_path() == "nki.jit"
        launches = record_launches(monkeypatch)
        device_branch = run()
    assert {launch.dialect for launch in launches} == {dialect_name}
    assert {launch.kernel for launch in launches} == {"rmsnorm_add_fwd", "rmsnorm_bwd"}
    for got, want in zip(jax.tree.leaves(device_branch), jax.tree.leaves(simulated)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.neuron
@pytest.mark.skipif(
    importlib.util.find_spec("jax_neuronx") is None
    and importlib.util.find_spec("libneuronxla") is None,
    reason="needs the Neuron JAX plugin",
)
def test_on_neuron_backend_matches_the_simulated_reference():
    if jax.default_backend() != "neuron":
        pytest.skip("the default JAX backend is not a NeuronDevice")
    x = _randn(4, 300, 512, dtype=jnp.bfloat16, seed=24)
    w = _randn(512, dtype=jnp.bfloat16, seed=25)
    y, dw = jax.jit(jax.value_and_grad(lambda w: jnp.sum(nki_jax.rms_norm(x, w) ** 2)))(w)
    y_ref, dw_ref = jax.value_and_grad(
        lambda w: jnp.sum(_jnp_rms_norm(x, w)[0].astype(jnp.bfloat16) ** 2)
    )(w)
    np.testing.assert_allclose(np.float32(y), np.float32(y_ref), rtol=2e-2)
    np.testing.assert_allclose(np.float32(dw), np.float32(dw_ref), rtol=5e-2, atol=5e-1)


@pytest.mark.neuron
@pytest.mark.skipif(
    importlib.util.find_spec("jax_neuronx") is None, reason="needs the Neuron SDK's jax_neuronx"
)
def test_on_neuron_the_launch_path_follows_the_installed_jax_neuronx():
    """SDK 2.20 - 2.22: jax_neuronx.nki_call with the output-parameter kernels; from 2.23 (no
    nki_call): the nki.jit kernels called directly. Either way the results match jax.numpy."""
    if jax.default_backend() != "neuron":
        pytest.skip("the default JAX backend is not a NeuronDevice")
    import jax_neuronx

    expected = "nki_call" if hasattr(jax_neuronx, "nki_call") else "nki.jit"
    assert nki_jax.launch_path() == expected
    x = _randn(256, 1024, dtype=jnp.bfloat16, seed=30)
    w = _randn(1024, dtype=jnp.bfloat16, seed=31, scale=0.2, shift=1.0)
    b = _randn(1024, seed=32)
    dx, dw, db = jax.jit(
        jax.grad(
            lambda x, w, b: jnp.sum(nki_jax.rms_norm(x, w, bias=b).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2),
        )
    )(x, w, b)
    dx_ref, dw_ref, db_ref = jax.grad(
        lambda x, w, b: jnp.sum(
            _jnp_rms_norm(x, w, bias=b)[0].astype(jnp.bfloat16).astype(jnp.float32) ** 2
        ),
        argnums=(0, 1, 2),
    )(x, w, b)
    assert db.dtype == jnp.float32
    _close(dx, dx_ref, jnp.bfloat16, scale=4, what="dx")
    _close(dw, dw_ref, jnp.bfloat16, scale=64, what="dweight")
    _close(db, db_ref, jnp.bfloat16, scale=64, what="dbias")


def test_example_rmsnorm_jax(monkeypatch, capsys):
    example = Path(__file__).parents[2] / "examples" / "rmsnorm_jax.py"
    monkeypatch.setattr(
        sys, "argv", ["rmsnorm_jax.py", "--rows", "16", "--hidden", "64", "--iters", "1"]
    )
    runpy.run_path(str(example), run_name="not_main")["main"]()
    out = capsys.readouterr().out
    assert "max |dweight - reference|" in out and "forward+backward" in out
    # The tutorial's nki_call launch ran (simulated) and agrees with jax.numpy in bfloat16.
    assert "nki_call(rmsnorm_fwd_out, x, w, out_shape=...)" in out, out
    jnp_errors = re.findall(r"max \|y - jnp\|\s*=\s*([0-9.e+-]+)", out)
    assert len(jnp_errors) == 2 and all(float(e) <= 0.0625 for e in jnp_errors), out
