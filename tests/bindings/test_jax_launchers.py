"""The JAX launch paths and the JAX regression tests that need no subprocess.

* ``simulate.jax_neuronx.nki_call``, the CPU twin of ``jax_neuronx.nki_call`` (SDK 2.20 -
  2.22), under ``jit`` / ``vmap``, with its ``out_shape`` checks;
* the Neuron RMSNorm tutorial's own JAX launch code
  (``general/nki/examples/rmsnorm/rmsnorm_jax.py``@72825d50, lines 25-33 and 42) run against
  the tutorial kernel and against ours;
* the binding's two CPU paths (``"simulator"`` and ``"nki_call"`` through the twin) giving
  the same bits, the path visible through ``launch_path()`` and a DEBUG log line;
* an fp32 bias's gradient in fp32 (a regression test), ``jax.export``'s error.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from dialect_launches import record_launches  # noqa: E402

import simulate  # noqa: E402
from nki_rmsnorm import (  # noqa: E402
    dialect,  # noqa: E402
    kernels,
    reference,
)
from nki_rmsnorm import jax as nki_jax  # noqa: E402
from simulate import jax_neuronx as twin  # noqa: E402


@pytest.fixture
def no_jax_neuronx(monkeypatch):
    """The binding as on a machine without jax_neuronx (the simulator path)."""
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)


@pytest.fixture
def simulated_jax_neuronx(monkeypatch):
    """``simulate.install()`` done: ``import jax_neuronx`` gives the CPU twin."""
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)
    simulate.install()
    assert sys.modules["jax_neuronx"] is twin
    yield twin
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)


@pytest.fixture
def tutorial_kernel():
    """The tutorial's output-parameter kernel, imported as written (``neuronxcc.nki``)."""
    simulate.install()
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1]))
    try:
        return importlib.import_module("tutorial_rmsnorm_kernel").rmsnorm_kernel
    finally:
        sys.path.pop(0)


def _randn(shape, dtype=jnp.float32, seed=0, scale=1.0, shift=0.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32), dtype)


def test_install_registers_the_twin_only_without_a_real_jax_neuronx(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)
    assert twin.install() is True and sys.modules["jax_neuronx"] is twin
    real = type(sys)("jax_neuronx")  # a real package already imported: never shadowed
    monkeypatch.setitem(sys.modules, "jax_neuronx", real)
    assert twin.install() is False and sys.modules["jax_neuronx"] is real
    monkeypatch.delitem(sys.modules, "jax_neuronx")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "jax_neuronx" else None
    )
    assert twin.install() is False and "jax_neuronx" not in sys.modules


def test_the_tutorials_jax_launch_code_runs_on_the_twin(simulated_jax_neuronx, tutorial_kernel):
    """The tutorial's calls verbatim (SDK 2.20 rmsnorm_jax.py, lines 10, 25-33, 42), against
    the tutorial kernel and against ours (through a kernel with the tutorial's signature)."""
    from jax_neuronx import nki_call

    def our_kernel(a_tensor, g_tensor, out_tensor):
        import neuronxcc.nki.language as nl

        rstd = nl.ndarray((a_tensor.shape[0],), dtype=nl.float32, buffer=nl.shared_hbm)
        # nki_call (SDK 2.20 - 2.22) compiles legacy kernels only
        kernels.kernel("rmsnorm_fwd_out", "legacy")(
            a_tensor, g_tensor, None, out_tensor, rstd, eps=0.0, offset=0.0, casting_mode="gemma"
        )

    for nki_rmsnorm_kernel in (tutorial_kernel, our_kernel):
        a_key, g_key = jax.random.split(jax.random.PRNGKey(42))
        a_tensor = jax.random.uniform(a_key, (250, 512))
        g_tensor = jax.random.uniform(g_key, (512,))

        output_nki = nki_call(
            nki_rmsnorm_kernel,
            a_tensor,
            g_tensor,
            out_shape=jax.ShapeDtypeStruct(a_tensor.shape, dtype=a_tensor.dtype),
        )

        output_ref = reference.rms_norm(np.asarray(a_tensor), np.asarray(g_tensor), 0.0)
        assert output_nki.shape == (250, 512) and output_nki.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(output_nki), output_ref, rtol=2e-6, atol=2e-6)
        # The tutorial's own check:
        output_jax = (
            a_tensor
            * jnp.reciprocal(jnp.sqrt(jnp.square(a_tensor).mean(axis=1, keepdims=True)))
            * g_tensor
        )
        assert jnp.allclose(output_jax, output_nki, atol=1e-5, rtol=1e-3)


def test_nki_call_under_jit_and_vmap_with_several_outputs(simulated_jax_neuronx):
    from jax_neuronx import nki_call

    x = _randn((3, 40, 96), jnp.bfloat16, seed=1)
    w = _randn((96,), jnp.bfloat16, seed=2, scale=0.2, shift=1.0)
    kernel = functools.partial(  # nki_call (SDK 2.20 - 2.22) compiles legacy kernels only
        kernels.kernel("rmsnorm_fwd_out", "legacy"), eps=1e-6, offset=0.0, casting_mode="gemma"
    )

    def launch(x, w):
        return nki_call(
            kernel,
            x,
            w,
            None,
            out_shape=(
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct(x.shape[:1], jnp.float32),
            ),
        )

    y, rstd = jax.jit(jax.vmap(launch, in_axes=(0, None)))(x, w)
    assert y.shape == x.shape and rstd.shape == (3, 40) and y.dtype == jnp.bfloat16
    x64 = np.asarray(x, np.float64)
    np.testing.assert_allclose(
        np.asarray(y, np.float64),
        reference.rms_norm(x64, np.asarray(w, np.float64)),
        rtol=1.6e-2,
        atol=1.6e-2,
    )
    np.testing.assert_allclose(np.asarray(rstd), 1 / np.sqrt(np.mean(x64**2, -1) + 1e-6), rtol=1e-5)


def test_nki_call_out_shape_that_disagrees_with_the_kernel_is_an_error(
    simulated_jax_neuronx, tutorial_kernel
):
    from jax_neuronx import nki_call

    a, g = _randn((8, 32), seed=3), _randn((32,), seed=4)
    struct = jax.ShapeDtypeStruct(a.shape, a.dtype)
    with pytest.raises(
        ValueError,
        match=r"out_shape describes 2 output\(s\), but the kernel "
        r"takes 1 output parameter",
    ):
        nki_call(tutorial_kernel, a, g, out_shape=(struct, struct))
    with pytest.raises(TypeError, match="out_shape must be a jax.ShapeDtypeStruct"):
        nki_call(tutorial_kernel, a, g, out_shape=(8, 32))
    # A wrong output shape reaches the kernel, which rejects it; the error names out_shape.
    with pytest.raises(
        Exception,
        match=r"failed with the outputs out_shape describes "
        r"\(\(8, 16\) float32\)",
    ):
        jax.block_until_ready(
            nki_call(tutorial_kernel, a, g, out_shape=jax.ShapeDtypeStruct((8, 16), a.dtype))
        )

    def returns_its_output(a_tensor):
        import neuronxcc.nki.language as nl

        out = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a_tensor))
        return out

    np.testing.assert_array_equal(nki_call(returns_its_output, a, out_shape=struct), np.asarray(a))
    with pytest.raises(
        Exception,
        match=r"out_shape\[0\] is \(8, 32\) float16, the kernel "
        r"returned \(8, 32\) float32",
    ):
        jax.block_until_ready(
            nki_call(returns_its_output, a, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.float16))
        )


def test_nki_call_grid_runs_every_program_and_outputs_start_poisoned(simulated_jax_neuronx):
    """``grid=(2,)`` runs two programs, each on its own 128-row block; without the grid only
    the first block is written and the rest keeps the twin's NaN poison."""
    from jax_neuronx import nki_call

    def add_one_per_block(a_tensor, out_tensor):
        import neuronxcc.nki.language as nl

        block = nl.program_id(0)
        i_row, i_col = nl.arange(128)[:, None], nl.arange(a_tensor.shape[1])[None, :]
        tile = nl.load(a_tensor[block * 128 + i_row, i_col])
        nl.store(out_tensor[block * 128 + i_row, i_col], value=nl.add(tile, 1.0))

    a = _randn((256, 64), seed=14)
    struct = jax.ShapeDtypeStruct(a.shape, a.dtype)
    out = jax.jit(lambda a: nki_call(add_one_per_block, a, out_shape=struct, grid=(2,)))(a)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a) + np.float32(1))
    first_block_only = np.asarray(nki_call(add_one_per_block, a, out_shape=struct))
    np.testing.assert_array_equal(first_block_only[:128], np.asarray(a[:128]) + np.float32(1))
    assert np.isnan(first_block_only[128:]).all()


def _training_step(x, residual, w, b):
    def loss(x, residual, w, b):
        y, h = nki_jax.fused_add_rms_norm(x, residual, w, offset=0.5, bias=b)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(h.astype(jnp.float32)))

    def loss_without_weight(x, b):
        return jnp.sum(nki_jax.rms_norm(x, None, bias=b).astype(jnp.float32) ** 3)

    return (
        nki_jax.fused_add_rms_norm(x, residual, w, offset=0.5, bias=b),
        jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, residual, w, b),
        jax.jit(jax.grad(loss_without_weight, argnums=(0, 1)))(x, b),
    )


def test_simulator_and_nki_call_paths_give_the_same_bits(monkeypatch, caplog):
    # nki_call launches the legacy kernels only (see launch_path).
    monkeypatch.setattr(dialect, "_chosen", "legacy")
    x, r = _randn((6, 72), jnp.bfloat16, seed=5), _randn((6, 72), jnp.float32, seed=6)
    w, b = _randn((72,), jnp.bfloat16, seed=7), _randn((72,), jnp.float32, seed=8)
    caplog.set_level(logging.DEBUG, logger="nki_rmsnorm.jax")

    monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)
    assert nki_jax.launch_path() == "simulator"
    simulated = _training_step(x, r, w, b)
    assert "forward (6, 72) launched through simulator" in caplog.text
    assert "backward (6, 72) launched through simulator" in caplog.text

    caplog.clear()
    simulate.install()
    calls = []
    real_nki_call = twin.nki_call

    def counting_nki_call(kernel, *args, **kwargs):
        calls.append(kernel.func.__name__)
        return real_nki_call(kernel, *args, **kwargs)

    monkeypatch.setattr(twin, "nki_call", counting_nki_call)
    assert nki_jax.launch_path() == "nki_call"
    through_nki_call = _training_step(x, r, w, b)
    monkeypatch.delitem(sys.modules, "jax_neuronx")
    assert "forward (6, 72) launched through nki_call" in caplog.text
    assert "backward (6, 72) launched through nki_call" in caplog.text
    assert {"rmsnorm_add_fwd_out", "rmsnorm_fwd_out", "rmsnorm_bwd_out"} <= set(calls)
    for got, want in zip(jax.tree.leaves(through_nki_call), jax.tree.leaves(simulated)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_fp32_bias_gradient_keeps_fp32_accuracy(no_jax_neuronx):
    """Regression: dbias of an fp32 bias beside a bf16 weight is the fp32 column sum
    of dy, not that sum rounded to bfloat16 (0.5 bf16 ulp off)."""
    x = _randn((512, 64), jnp.bfloat16, seed=9)
    w = _randn((64,), jnp.bfloat16, seed=10, scale=0.3, shift=1.0)
    b = jnp.zeros(64, jnp.float32)
    gy = _randn((512, 64), jnp.bfloat16, seed=11)
    _, vjp = jax.vjp(lambda w, b: nki_jax.rms_norm(x, w, bias=b), w, b)
    dw, db = jax.jit(vjp)(gy)
    assert dw.dtype == jnp.bfloat16 and db.dtype == jnp.float32
    exact = np.asarray(gy, np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(db, np.float64), exact, rtol=1e-6, atol=1e-5)
    rounded = exact.astype(np.float32).astype(jnp.bfloat16).astype(np.float64)
    assert np.any(rounded != np.asarray(db, np.float64)), "the sums were rounded to bf16"


def test_export_names_the_host_callback(no_jax_neuronx):
    x, w = _randn((4, 16), seed=12), _randn((16,), seed=13)
    with pytest.raises(NotImplementedError, match="host_callbacks"):
        jax.export.export(jax.jit(nki_jax.rms_norm))(x, w)


# ---------------------------------------------------------------------------------------------
# Both NKI dialects through the binding
# ---------------------------------------------------------------------------------------------

#: Launch path → the entry points the training step's forwards and backwards launch.
PATH_KERNELS = {
    "simulator": {"rmsnorm_add_fwd", "rmsnorm_fwd", "rmsnorm_bwd"},
    "nki_call": {"rmsnorm_add_fwd_out", "rmsnorm_fwd_out", "rmsnorm_bwd_out"},
}


@pytest.mark.parametrize("dialect_name", ["legacy", "nki06"])
def test_each_launch_path_runs_the_chosen_dialects_kernels(monkeypatch, dialect_name):
    """The training step (jitted grads of both entry points) inside ``use_dialect``: every
    kernel that runs, on whichever thread XLA runs the callback, is that dialect's, through
    the simulator path and with the ``jax_neuronx`` twin installed (``nki_call`` takes the
    legacy kernels only: it was removed before the first ``nki`` 0.4 release, so the 0.6
    kernels stay on the simulator path); both paths give the same bits."""
    x, r = _randn((6, 72), jnp.bfloat16, seed=15), _randn((6, 72), jnp.float32, seed=16)
    w, b = _randn((72,), jnp.bfloat16, seed=17), _randn((72,), jnp.float32, seed=18)
    results = {}
    with dialect.use_dialect(dialect_name):
        for twin_installed in (False, True):
            monkeypatch.delitem(sys.modules, "jax_neuronx", raising=False)
            if twin_installed:
                simulate.install()
            path = nki_jax.launch_path()
            launches = record_launches(monkeypatch)
            results[twin_installed] = _training_step(x, r, w, b)
            assert {launch.dialect for launch in launches} == {dialect_name}, path
            assert {launch.kernel for launch in launches} == PATH_KERNELS[path]
        monkeypatch.delitem(sys.modules, "jax_neuronx")
    assert path == ("nki_call" if dialect_name == "legacy" else "simulator")
    for got, want in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_jitted_function_runs_the_dialect_of_the_target_it_was_traced_for(
    no_jax_neuronx, monkeypatch
):
    """The dialect is resolved when a function is traced, from the target (trn1: legacy;
    trn2: nki06), and is no part of jit's cache key: the simulator's override does not
    retrace a jitted function, a fresh trace follows it. Both dialects agree."""
    x, w = _randn((40, 96), seed=19), _randn((96,), seed=20)

    def loss(x, w):
        return jnp.sum(nki_jax.rms_norm(x, w) ** 2)

    launches = record_launches(monkeypatch)
    results = {}
    for target, name in (("trn1", "legacy"), ("trn2", "nki06")):
        monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
        launches.clear()
        results[name] = jax.jit(jax.value_and_grad(loss, (0, 1)))(x, w)
        assert [(launch.dialect, launch.kernel) for launch in launches] == [
            (name, "rmsnorm_fwd"),
            (name, "rmsnorm_bwd"),
        ]
    step = jax.jit(jax.value_and_grad(loss, (0, 1)))
    step(x, w)  # traced for trn2: nki06
    launches.clear()
    with dialect.use_dialect("legacy"):
        step(x, w)
    assert {launch.dialect for launch in launches} == {"nki06"}
    for got, want in zip(jax.tree.leaves(results["nki06"]), jax.tree.leaves(results["legacy"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
