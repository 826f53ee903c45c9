"""Every public ``simulate`` entry point takes kernels of both dialects: an ``nki`` 0.6
kernel is dispatched to its own front-end (as ``simulate.profile`` does), and a launcher that
only takes legacy kernels (the ``nki_jit`` / ``nki_call`` twins) or a plain function written
against 0.6 gets one line naming the way to launch it, never an error from deep inside the
legacy runtime."""

from __future__ import annotations

import numpy as np
import pytest

import simulate
import simulate.nki06 as nki06
import simulate.nki06.isa as nisa06
import simulate.nki06.language as nl06
from simulate import NKIError
from simulate import language as nl


def _scale_rows(a):
    """``2·a`` through SBUF, in NKI 0.6 (return convention)."""
    out = nl06.ndarray(a.shape, dtype=a.dtype, buffer=nl06.shared_hbm)
    tile = nl06.ndarray(a.shape, dtype=a.dtype, buffer=nl06.sbuf)
    nisa06.dma_copy(dst=tile, src=a)
    doubled = nl06.ndarray(a.shape, dtype=a.dtype, buffer=nl06.sbuf)
    nisa06.tensor_scalar(dst=doubled, data=tile, op0=nl06.multiply, operand0=2.0)
    nisa06.dma_copy(dst=out, src=doubled)
    return out


scale_rows_06 = nki06.jit(_scale_rows)


@simulate.jit
def scale_rows_legacy(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.multiply(nl.load(a), 2.0))
    return out


@pytest.fixture
def x(rng):
    return rng.standard_normal((16, 64)).astype(np.float32)


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")


def test_trace_kernel_runs_a_06_kernel_on_its_front_end(x):
    outputs, trace = simulate.trace_kernel(scale_rows_06, x)
    np.testing.assert_array_equal(outputs, 2 * x)
    assert trace.target == "trn2"
    assert trace is nki06.last_trace() is simulate.last_trace()
    _, on_trn3 = simulate.trace_kernel(scale_rows_06, x, target="trn3")
    assert on_trn3.target == "trn3"
    outputs, lnc2 = simulate.trace_kernel(scale_rows_06[2], x)
    np.testing.assert_array_equal(outputs, 2 * x)
    assert lnc2.lnc == 2


def test_the_same_trace_as_profile(x):
    _, trace = simulate.trace_kernel(scale_rows_06, x)
    _, prof = simulate.profile(scale_rows_06, x)
    assert simulate.Profile.from_trace(trace).latency_us == prof.latency_us


def test_simulate_kernel_jit_baremetal_and_benchmark_take_a_06_kernel(x):
    np.testing.assert_array_equal(simulate.simulate_kernel(scale_rows_06, x), 2 * x)
    for wrapped in (simulate.jit(scale_rows_06), simulate.baremetal(scale_rows_06)):
        np.testing.assert_array_equal(wrapped(x), 2 * x)
        assert wrapped.last_trace.target == "trn2"
    benchmarked = simulate.benchmark(scale_rows_06)
    benchmarked(x)
    latency = benchmarked.benchmark_result.nc_latency.get_latency_percentile(50)
    assert latency == simulate.profile(scale_rows_06, x)[1].latency_us > 0


def test_last_trace_follows_the_latest_run_of_either_dialect(x):
    _, legacy_trace = simulate.trace_kernel(scale_rows_legacy, x)
    assert simulate.last_trace() is legacy_trace
    scale_rows_06(x)
    assert simulate.last_trace() is nki06.last_trace() is not legacy_trace


def test_a_grid_on_a_06_kernel_names_the_lnc_bracket(x):
    with pytest.raises(NKIError, match=r"takes no SPMD grid.*kernel\[2\]"):
        simulate.trace_kernel(scale_rows_06, x, grid=(2,))


def test_a_plain_06_function_names_the_06_jit(x):
    with pytest.raises(
        TypeError,
        match=r"'_scale_rows' is written against nki 0\.6.*"
        r"simulate\.nki06\.jit",
    ):
        simulate.simulate_kernel(_scale_rows, x)
    with pytest.raises(TypeError, match="written against nki 0.6"):
        simulate.trace_kernel(_scale_rows, x)


def test_the_legacy_launcher_twins_name_the_06_convention(x):
    from simulate import jax_neuronx, torch_neuronx

    jax = pytest.importorskip("jax")
    with pytest.raises(
        TypeError,
        match=r"torch_neuronx\.nki_jit takes legacy.*call it "
        "directly",
    ):
        torch_neuronx.nki_jit(scale_rows_06)
    with pytest.raises(
        TypeError,
        match=r"jax_neuronx\.nki_call takes legacy.*call it "
        "directly",
    ):
        jax_neuronx.nki_call(scale_rows_06, x, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))


def test_legacy_kernels_still_run_everywhere(x):
    np.testing.assert_array_equal(simulate.simulate_kernel(scale_rows_legacy, x), 2 * x)
    outputs, trace = simulate.trace_kernel(scale_rows_legacy, x, target="trn2")
    np.testing.assert_array_equal(outputs, 2 * x)
    assert trace.target == "trn2"
