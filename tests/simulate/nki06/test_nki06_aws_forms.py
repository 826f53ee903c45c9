"""Forms AWS's nki-library uses where the NKI 0.6 docs are silent or say otherwise: the
simulator accepts what AWS's known-compiling code does and still rejects what neither allows
(docs/aws_code_vs_docs.md lists each case with both citations)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import poison

import simulate.nki06 as nki

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
    region = getattr(nl, buffer)  # resolved on the host: getattr is not NKI

    @nki.jit
    def copy_out(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=region)
        tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        nisa.dma_copy(dst=out, src=tile)
        return out

    with pytest.raises(ValueError, match="must be allocated with buffer=nl.shared_hbm"):
        copy_out(rng.standard_normal((8, 16)).astype(np.float32))


def test_an_instruction_writes_through_a_stride_0_destination(rng):
    """AWS's qkv_cte.py L3046-3056: ``activation_reduce`` into ``.ap([[1, S], [0, H]])`` of a
    (128, 1) tile, for its reduce_res only; the aliased place keeps the last element."""

    @nki.jit
    def sum_of_squares(x):
        tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        scratch = nl.ndarray((128, 1), dtype=x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=scratch, value=0.0)
        sums = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(
            dst=scratch.ap(pattern=[[1, x.shape[0]], [0, x.shape[1]]]),
            op=nl.square,
            data=tile,
            reduce_op=nl.add,
            reduce_res=sums,
        )
        out_sums = nl.ndarray(sums.shape, dtype=sums.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_sums, src=sums)
        out_scratch = nl.ndarray(scratch.shape, dtype=scratch.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out_scratch, src=scratch)
        return out_sums, out_scratch

    x = rng.standard_normal((16, 48)).astype(np.float32)
    sums, scratch = sum_of_squares(x)
    np.testing.assert_allclose(sums[:, 0], (x.astype(np.float64) ** 2).sum(axis=1), rtol=1e-5)
    np.testing.assert_allclose(scratch[:16, 0], x[:, -1] ** 2, rtol=1e-6)
    np.testing.assert_array_equal(scratch[16:], 0)


@pytest.mark.parametrize("value, accepted", [(0.0, True), (2.0, False)])
def test_memset_of_an_integer_tile_takes_float_zero_only(value, accepted):
    """AWS's cross_partition_copy clears uint32 temporaries with ``value=0.0``
    (core/utils/cross_partition_copy.py L188-191); any other float into an integer tile is
    still the 0.3 error (nki/migration/index.rst L497-512)."""

    @nki.jit
    def clear(x):
        tile = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=tile, value=value)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tile)
        return out

    x = np.full((4, 8), 7, np.uint32)
    if accepted:
        np.testing.assert_array_equal(clear(x), np.zeros_like(x))
    else:
        with pytest.raises(TypeError, match="value 2.0 is a float but dst is uint32"):
            clear(x)
