"""An unmodified ``neuronxcc.nki`` kernel (tutorial-style RMSNorm, output-parameter
convention) runs on the simulator through ``simulate.install()`` and matches NumPy."""

from __future__ import annotations

import importlib
import math
import sys

import numpy as np
import pytest
from helpers import BF16, poison

import simulate


@pytest.fixture(scope="module")
def tutorial():
    """The kernel module, imported after the ``neuronxcc`` aliases are installed."""
    assert simulate.install() is True  # the real Neuron compiler is not installed here
    return importlib.import_module("tutorial_rmsnorm_kernel")


def _reference(a, g):
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    return a64 / np.sqrt(np.mean(a64 * a64, axis=1, keepdims=True)) * g64


def test_install_aliases_the_neuronxcc_modules(tutorial):
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl
    import neuronxcc.nki.typing as nt

    assert nki is simulate
    assert nl is simulate.language and nisa is simulate.isa and nt is simulate.typing
    assert sys.modules["neuronxcc.nki.language"] is simulate.language
    assert tutorial.nl is simulate.language
    assert simulate.install() is True  # idempotent


@pytest.mark.parametrize("rows", [1, 127, 129, 300])
@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-6), (BF16, 3e-2)], ids=["fp32", "bf16"])
def test_tutorial_rmsnorm_matches_numpy(tutorial, rng, rows, dtype, rtol):
    import neuronxcc.nki as nki

    hidden = 96
    a = (rng.standard_normal((rows, hidden)) + 0.5).astype(np.float32).astype(dtype)
    g = rng.uniform(0.5, 1.5, hidden).astype(np.float32).astype(dtype)
    out = poison((rows, hidden), dtype)

    result = nki.baremetal(tutorial.rmsnorm_kernel)(a, g, out)

    assert result is None  # output-parameter convention: written in place
    expected = _reference(a, g)
    got = out.astype(np.float64)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=rtol * 1e-2)


def test_tutorial_trace_counts_the_bytes_it_moves(tutorial, rng):
    rows, hidden = 300, 64
    a = rng.standard_normal((rows, hidden)).astype(np.float32)
    g = rng.standard_normal(hidden).astype(np.float32)
    out = poison((rows, hidden))

    _, trace = simulate.trace_kernel(tutorial.rmsnorm_kernel, a, g, out)

    loads = [i for i in trace if i.opcode == "load"]
    stores = [i for i in trace if i.opcode == "store"]
    assert len(loads) == 1 + math.ceil(rows / 128) and len(stores) == math.ceil(rows / 128)
    read, written = trace.hbm_bytes()
    assert read == a.nbytes + g.nbytes  # the masked-off rows of the last tile are not moved
    assert written == out.nbytes
    assert [i.partitions for i in stores] == [128, 128, 44]
    assert {i.engine for i in trace} == {"dma", "act", "dve"}
    np.testing.assert_allclose(out, _reference(a, g), rtol=2e-6)
