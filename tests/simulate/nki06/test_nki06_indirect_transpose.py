"""nisa.dma_transpose from a ``.ap(vector_offset=...)`` source, the reference's "DMA Indirect
Transpose" (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L889-938): the rows the
indices name, gathered, then transposed; and its constraints."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate.nki06 as nki

nl, nisa = nki.language, nki.isa
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


@nki.jit
def _gather_transpose(src_hbm, idx_hbm):
    """The reference's 1-D indices example (L920-938), with ``nl.load`` written as a copy."""
    rows, columns = idx_hbm.shape[0], src_hbm.shape[1]
    idx_sb = nl.ndarray(idx_hbm.shape, dtype=idx_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=idx_hbm)
    dst_sb = nl.ndarray((columns, rows), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst_sb, value=0)
    src_ap = src_hbm.ap(pattern=[[columns, rows], [1, columns]], vector_offset=idx_sb)
    nisa.dma_transpose(dst=dst_sb, src=src_ap, axes=(1, 0))
    output = nl.ndarray((columns, rows), dtype=src_hbm.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=output, src=dst_sb)
    return output


def test_indirect_transpose_gathers_then_transposes(rng):
    src = rng.standard_normal((300, 64)).astype(BF16)
    index = rng.integers(0, 300, (128, 1)).astype(np.uint32)
    np.testing.assert_array_equal(_gather_transpose(src, index), src[index[:, 0]].T)


@pytest.mark.parametrize(
    "rows, columns, index_dtype, src_dtype, match",
    [
        (128, 64, np.int32, BF16, "indices must be uint32"),
        (128, 64, np.uint32, np.float32, "2-byte dtype"),
        (24, 64, np.uint32, BF16, "must divide by 16"),
    ],
)
def test_indirect_transpose_rules(rows, columns, index_dtype, src_dtype, match):
    src = np.zeros((300, columns), src_dtype)
    index = np.zeros((rows, 1), index_dtype)
    with pytest.raises((TypeError, AssertionError), match=match):
        _gather_transpose(src, index)


def test_indirect_transpose_row_outside_errors(rng):
    src = rng.standard_normal((100, 32)).astype(BF16)
    index = np.full((16, 1), 100, np.uint32)
    with pytest.raises(AssertionError, match="reaches outside"):
        _gather_transpose(src, index)


@nki.jit
def _gather_transpose_2d(src_hbm, idx_hbm):
    """The reference's 2-D indices example (L940-972): [128, N] indices, 128·N rows."""
    rows, columns = 128 * idx_hbm.shape[1], src_hbm.shape[1]
    idx_sb = nl.ndarray(idx_hbm.shape, dtype=idx_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=idx_hbm)
    dst_sb = nl.ndarray((columns, rows), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst_sb, value=0)
    src_ap = src_hbm.ap(pattern=[[columns, rows], [1, columns]], vector_offset=idx_sb)
    nisa.dma_transpose(dst=dst_sb, src=src_ap, axes=(1, 0))
    output = nl.ndarray((columns, rows), dtype=src_hbm.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=output, src=dst_sb)
    return output


@nki.jit
def _gather_transpose_4d(src_hbm, idx_hbm):
    """The reference's 4-D example with 2-D indices (L974-1005)."""
    _, d1, d2, d3 = src_hbm.shape
    rows = 128 * idx_hbm.shape[1]
    idx_sb = nl.ndarray(idx_hbm.shape, dtype=idx_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx_sb, src=idx_hbm)
    dst_sb = nl.ndarray((d3, d1, d2, rows), dtype=src_hbm.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst_sb, value=0)
    src_ap = src_hbm.ap(
        pattern=[[d1 * d2 * d3, rows], [d2 * d3, d1], [d3, d2], [1, d3]],
        vector_offset=idx_sb,
        indirect_dim=0,
    )
    nisa.dma_transpose(dst=dst_sb, src=src_ap, axes=(3, 1, 2, 0))
    output = nl.ndarray((d3, d1, d2, rows), dtype=src_hbm.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=output, src=dst_sb)
    return output


@pytest.mark.parametrize("columns", [2, 3])
def test_indirect_transpose_with_2d_indices_reads_them_column_by_column(rng, columns):
    """``flat_indices = indices.T.flatten()[:src.shape[0]]`` (L907-908)."""
    src = rng.standard_normal((500, 64)).astype(BF16)
    index = rng.integers(0, 500, (128, columns)).astype(np.uint32)
    expected = src[index.T.reshape(-1)].T
    np.testing.assert_array_equal(_gather_transpose_2d(src, index), expected)


def test_indirect_transpose_4d_with_2d_indices(rng):
    src = rng.standard_normal((300, 1, 4, 8)).astype(BF16)  # d1 = 1 (rule: d1 or d2 is 1)
    index = rng.integers(0, 300, (128, 2)).astype(np.uint32)
    expected = np.transpose(src[index.T.reshape(-1)], (3, 1, 2, 0))
    np.testing.assert_array_equal(_gather_transpose_4d(src, index), expected)


def test_2d_indices_need_128_partitions_and_dma_transpose(rng):
    src = rng.standard_normal((500, 64)).astype(BF16)
    with pytest.raises((AssertionError, ValueError), match="P = 128"):
        _gather_transpose_2d(src, np.zeros((64, 2), np.uint32))

    @nki.jit
    def gather_copy(src_hbm, idx_hbm):
        idx_sb = nl.ndarray(idx_hbm.shape, dtype=idx_hbm.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx_sb, src=idx_hbm)
        dst = nl.ndarray((256, 64), dtype=src_hbm.dtype, buffer=nl.shared_hbm)
        src_ap = src_hbm.ap(pattern=[[64, 256], [1, 64]], vector_offset=idx_sb)
        nisa.dma_copy(dst=dst, src=src_ap)
        return dst

    with pytest.raises(AssertionError, match="a \\[128, N\\] index is dma_transpose's"):
        gather_copy(src, np.zeros((128, 2), np.uint32))
