"""Forms AWS's nki-library uses where the NKI 0.6 docs are silent or say otherwise: the
simulator accepts what AWS's known-compiling code does and still rejects what neither allows
(docs/aws_code_vs_docs.md lists each case with both citations)."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from tests.conftest import poison

nl, nisa = nki.language, nki.isa


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


@nki.jit
def _double_into(x, out):
    """Writes 2·x into its argument ``out`` and returns that argument, as AWS's rope_hf
    returns ``q_out, k_out``."""
    tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    nisa.tensor_scalar(dst=tile, data=tile, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=out, src=tile)
    return out


@pytest.mark.parametrize("lnc", [1, 2])
def test_a_written_argument_can_be_returned(rng, lnc):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    out = poison(x.shape)
    result = (_double_into[lnc] if lnc == 2 else _double_into)(x, out)
    np.testing.assert_array_equal(result, 2 * x)
    np.testing.assert_array_equal(out, 2 * x)


@pytest.mark.parametrize("buffer", ["private_hbm", "hbm"])
def test_an_allocated_non_shared_hbm_result_is_still_rejected(rng, buffer):
    @nki.jit
    def copy_out(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=getattr(nl, buffer))
        tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        nisa.dma_copy(dst=out, src=tile)
        return out

    with pytest.raises(ValueError, match="must be allocated with buffer=nl.shared_hbm"):
        copy_out(rng.standard_normal((8, 16)).astype(np.float32))
