"""A ``@nki.jit`` kernel called from inside a kernel runs as part of its caller, as AWS's
``moe_cte`` entry does with its jitted blockwise sub-kernels (aws-neuron/nki-library@d2ad3a5
core/moe/moe_cte/moe_cte.py L252, L351); a launch bracket on the inner call stays an error."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06.errors import NkiRuntimeError

nl, nisa = nki.language, nki.isa


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


@nki.jit(mode="trace")
def _double_into(dst, src):
    tile = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src)
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=dst, src=tile)


@nki.jit
def _outer(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    _double_into(out, x)
    return out


@nki.jit
def _outer_with_bracket(x):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    _double_into[2](out, x)
    return out


def test_a_jitted_sub_kernel_runs_inside_its_caller(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    np.testing.assert_array_equal(_outer(x), 2 * x)


def test_a_sub_kernel_launch_bracket_is_rejected(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    with pytest.raises(NkiRuntimeError, match="without a launch bracket"):
        _outer_with_bracket[2](x)
