"""``nki_rmsnorm.flax.RMSNorm`` and ``nki_rmsnorm.equinox.RMSNorm`` against their anchors,
``flax.nnx.RMSNorm`` and ``equinox.nn.RMSNorm``: same parameters, outputs and gradients
(with respect to the input and every parameter) within a few ulps of the dtype under test,
outputs in the same dtype. Random inputs and parameters (never the ones/zeros defaults)."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

#: (rtol, atol) per output dtype: both sides compute in float32 and round once, in a different
#: operation order, so they may differ by one ulp of the output dtype.
TOL = {
    jnp.float32: (2e-5, 2e-5),
    jnp.float16: (2e-3, 2e-3),
    jnp.bfloat16: (1.6e-2, 1.6e-2),
}


@pytest.fixture(autouse=True)
def _simulator_path(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)


def _randn(shape, dtype, seed, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32), dtype)


def _close(actual, expected, what, computed_in=None):
    """``computed_in``: the dtype the layer rounded to, when coarser than ``actual``'s (a
    float32 input's gradient through a bfloat16 layer has bfloat16 precision)."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    rtol, atol = TOL[jnp.dtype(computed_in or actual.dtype).type]
    scale = max(1.0, float(jnp.max(jnp.abs(expected.astype(jnp.float32)))))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64),
        np.asarray(expected, np.float64),
        rtol=rtol,
        atol=atol * scale,
        err_msg=what,
    )


# ---------------------------------------------------------------------------------------------
# flax.nnx
# ---------------------------------------------------------------------------------------------

nnx = pytest.importorskip("flax.nnx")


def _flax_pair(features, seed, **options):
    from nki_rmsnorm.flax import RMSNorm

    def scale_init(key, shape, dtype):
        return _randn(shape, dtype, seed, scale=0.3, shift=1.0)

    ours = RMSNorm(features, scale_init=scale_init, rngs=nnx.Rngs(0), **options)
    anchor = nnx.RMSNorm(features, scale_init=scale_init, rngs=nnx.Rngs(0), **options)
    return ours, anchor


def _flax_forward_and_grads(model, x, dy):
    def loss(model, x):
        y = model(x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(model, x)
    return y, dx, None if model.scale is None else grads.scale[...]


@pytest.mark.parametrize(
    "x_dtype, param_dtype, dtype",
    [
        (jnp.float32, jnp.float32, None),
        (jnp.bfloat16, jnp.bfloat16, None),
        (jnp.bfloat16, jnp.float32, None),  # flax promotes: float32 output
        (jnp.float16, jnp.float16, None),
        (jnp.float32, jnp.float32, jnp.bfloat16),  # dtype= forces the computation dtype
    ],
)
def test_flax_rmsnorm_matches_flax(x_dtype, param_dtype, dtype):
    ours, anchor = _flax_pair(96, seed=1, param_dtype=param_dtype, dtype=dtype)
    np.testing.assert_array_equal(np.asarray(ours.scale[...]), np.asarray(anchor.scale[...]))
    x = _randn((3, 7, 96), x_dtype, seed=2, scale=2.0)
    dy = _randn((3, 7, 96), x_dtype, seed=3)
    got = jax.jit(_flax_forward_and_grads)(ours, x, dy)
    want = _flax_forward_and_grads(anchor, x, dy)
    for g, w, what in zip(got, want, ("y", "dx", "dscale")):
        _close(g, w, what, computed_in=dtype)


def test_flax_rmsnorm_over_two_trailing_axes_and_without_scale():
    ours, anchor = _flax_pair(32, seed=4, reduction_axes=(-2, -1))
    x = _randn((5, 4, 32), jnp.float32, seed=5)
    dy = _randn((5, 4, 32), jnp.float32, seed=6)
    for g, w, what in zip(
        _flax_forward_and_grads(ours, x, dy),
        _flax_forward_and_grads(anchor, x, dy),
        ("y", "dx", "dscale"),
    ):
        _close(g, w, what)

    ours, anchor = _flax_pair(32, seed=7, use_scale=False, epsilon=1e-3)
    assert ours.scale is None
    got, want = _flax_forward_and_grads(ours, x, dy), _flax_forward_and_grads(anchor, x, dy)
    _close(got[0], want[0], "y")
    _close(got[1], want[1], "dx")


@pytest.mark.parametrize(
    "options, call, match",
    [
        ({}, lambda m, x: m(x, mask=x > 0), "mask is not supported"),
        ({"axis_name": "batch"}, lambda m, x: m(x), "axis_name"),
        ({"reduction_axes": 0}, lambda m, x: m(x), "reduction_axes must name the last axes"),
        (
            {"reduction_axes": (-2, -1), "feature_axes": (-2, -1)},
            lambda m, x: m(x),
            "feature_axes must be -1",
        ),
    ],
)
def test_flax_rmsnorm_rejects_what_the_kernels_cannot_do(options, call, match):
    ours, _ = _flax_pair(32, seed=8, **options)
    with pytest.raises(ValueError, match=match):
        call(ours, _randn((4, 32), jnp.float32, seed=9))


# ---------------------------------------------------------------------------------------------
# equinox
# ---------------------------------------------------------------------------------------------

eqx = pytest.importorskip("equinox")


def _equinox_pair(shape, seed, **options):
    from nki_rmsnorm.equinox import RMSNorm

    ours, anchor = RMSNorm(shape, **options), eqx.nn.RMSNorm(shape, **options)
    # Random parameters in place of the ones / zeros defaults, the same in both.
    for name, shift in (("weight", 1.0), ("bias", 0.0)):
        if getattr(ours, name) is not None:
            value = _randn(getattr(ours, name).shape, getattr(ours, name).dtype, seed, 0.3, shift)
            seed += 1
            ours = eqx.tree_at(lambda m, n=name: getattr(m, n), ours, value)
            anchor = eqx.tree_at(lambda m, n=name: getattr(m, n), anchor, value)
    return ours, anchor


def _equinox_forward_and_grads(model, x, dy):
    @eqx.filter_value_and_grad(has_aux=True)
    def loss(model_and_x):
        model, x = model_and_x
        y = jax.vmap(model)(x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), (grads, dx) = loss((model, x))
    return y, dx, grads.weight, grads.bias


@pytest.mark.parametrize(
    "x_dtype, param_dtype",
    [
        (jnp.float32, jnp.float32),
        (jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.float32),
        (jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_equinox_rmsnorm_matches_equinox(x_dtype, param_dtype):
    ours, anchor = _equinox_pair(80, seed=10, dtype=param_dtype)
    x = _randn((6, 80), x_dtype, seed=12, scale=2.0)
    dy = _randn((6, 80), x_dtype, seed=13)
    got = eqx.filter_jit(_equinox_forward_and_grads)(ours, x, dy)
    want = _equinox_forward_and_grads(anchor, x, dy)
    for g, w, what in zip(got, want, ("y", "dx", "dweight", "dbias")):
        _close(g, w, what)


@pytest.mark.parametrize(
    "options",
    [
        {"use_weight": False},
        {"use_bias": False},
        {"use_weight": False, "use_bias": False},
        {"eps": 1e-2},
    ],
)
def test_equinox_rmsnorm_options_and_multi_axis_shape(options):
    ours, anchor = _equinox_pair((4, 24), seed=14, **options)
    assert (ours.weight is None) == (anchor.weight is None)
    x = _randn((3, 4, 24), jnp.float32, seed=16)
    dy = _randn((3, 4, 24), jnp.float32, seed=17)
    got = _equinox_forward_and_grads(ours, x, dy)
    want = _equinox_forward_and_grads(anchor, x, dy)
    for g, w, what in zip(got, want, ("y", "dx", "dweight", "dbias")):
        assert (g is None) == (w is None), what
        if g is not None:
            _close(g, w, what)
    state = object()
    y, same_state = ours(x[0], state)
    assert same_state is state and y.shape == (4, 24)
    with pytest.raises(ValueError, match=r"x must have the module's shape \(4, 24\)"):
        ours(x)


# ---------------------------------------------------------------------------------------------
# Missing frameworks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module, framework", [("flax", "flax"), ("equinox", "equinox")])
def test_import_without_the_framework_names_the_extra(monkeypatch, module, framework):
    for name in [n for n in sys.modules if n == framework or n.startswith(f"{framework}.")]:
        monkeypatch.setitem(sys.modules, name, None)  # makes `import flax.nnx` fail
    monkeypatch.delitem(sys.modules, f"nki_rmsnorm.{module}", raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'nki-rmsnorm\[{framework}\]'"):
        importlib.import_module(f"nki_rmsnorm.{module}")


# ---------------------------------------------------------------------------------------------
# Both NKI dialects
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect_name", ["legacy", "nki06"])
def test_modules_match_their_anchors_in_each_dialect(monkeypatch, dialect_name):
    """Both modules, jitted forward and gradients inside ``use_dialect``: every kernel that
    runs is that dialect's, and the results match the anchors."""
    from dialect_launches import record_launches, simulated_dialect

    launches = record_launches(monkeypatch)
    x = _randn((5, 64), jnp.bfloat16, seed=30, scale=2.0)
    dy = _randn((5, 64), jnp.bfloat16, seed=31)
    flax_ours, flax_anchor = _flax_pair(64, seed=32, param_dtype=jnp.bfloat16)
    eqx_ours, eqx_anchor = _equinox_pair(64, seed=33, dtype=jnp.bfloat16)
    with simulated_dialect(dialect_name):
        flax_got = jax.jit(_flax_forward_and_grads)(flax_ours, x, dy)
        eqx_got = eqx.filter_jit(_equinox_forward_and_grads)(eqx_ours, x, dy)
    assert {launch.dialect for launch in launches} == {dialect_name}
    assert {launch.kernel for launch in launches} == {"rmsnorm_fwd", "rmsnorm_bwd"}
    for got, want, names in (
        (flax_got, _flax_forward_and_grads(flax_anchor, x, dy), ("y", "dx", "dscale")),
        (eqx_got, _equinox_forward_and_grads(eqx_anchor, x, dy), ("y", "dx", "dw", "db")),
    ):
        for g, w, what in zip(got, want, names):
            _close(g, w, what)
