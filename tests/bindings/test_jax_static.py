"""``eps`` and ``offset`` are kernel constants: traced under ``jax.jit`` they are a
``TypeError`` that says how to keep them static, and the ways it names work."""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from nki_rmsnorm import jax as nki_jax  # noqa: E402
from nki_rmsnorm import reference  # noqa: E402


@pytest.mark.parametrize(
    ("function", "call", "name"),
    [
        ("rms_norm", lambda f, x, w: jax.jit(f)(x, w, 1e-5), "eps"),
        ("rms_norm", lambda f, x, w: jax.jit(lambda x, o: f(x, w, offset=o))(x, 0.5), "offset"),
        ("fused_add_rms_norm", lambda f, x, w: jax.jit(f)(x, x, w, 1e-5), "eps"),
    ],
)
def test_a_traced_constant_says_to_keep_it_static(function, call, name):
    x, w = jnp.ones((2, 8), jnp.float32), jnp.ones(8, jnp.float32)
    with pytest.raises(TypeError, match=rf"{name} must be a Python number, got a traced") as e:
        call(getattr(nki_jax, function), x, w)
    assert f"static_argnames=('{name}',)" in str(e.value) and "functools.partial" in str(e.value)


def test_the_named_remedies_work():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    want = reference.rms_norm(x, w, 1e-5)
    by_name = jax.jit(nki_jax.rms_norm, static_argnames=("eps",))(x, w, 1e-5)
    by_partial = jax.jit(functools.partial(nki_jax.rms_norm, eps=1e-5))(x, w)
    for got in (by_name, by_partial):
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=1e-6)
