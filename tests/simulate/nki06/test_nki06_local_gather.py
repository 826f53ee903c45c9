"""nisa.local_gather (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L1838-1889): its
semantics against the reference's own NumPy model (aws-neuron-sdk@8a38e733
general/nki/test/test_nki_isa_local_gather.py), its documented rules and its cost entry."""

from __future__ import annotations

import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.perf import cost

nl, nisa = nki.language, nki.isa


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


def _gather_kernel(per_index, valid, dst_dtype=None):
    @nki.jit
    def gather(src, index):
        src_sb = nl.ndarray(src.shape, dtype=src.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=src_sb, src=src)
        index_sb = nl.ndarray(index.shape, dtype=index.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=index_sb, src=index)
        count = valid or index.size // (index.shape[0] // 16)
        shape = (src.shape[0], count * per_index)
        dst = nl.ndarray(shape, dtype=dst_dtype or src.dtype, buffer=nl.sbuf)
        nisa.local_gather(
            dst=dst,
            src_buffer=src_sb,
            index=index_sb,
            num_elem_per_idx=per_index,
            num_valid_indices=valid,
        )
        out = nl.ndarray(shape, dtype=dst.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=dst)
        return out

    return gather


def _numpy_model(src, index, per_index, valid):
    """The reference's NUMPY_SEMANTICS block: per 16-partition core, the core's indices
    flattened partition first (order='F'), the first ``valid`` of them, each reading
    ``per_index`` contiguous elements of every partition's own row."""
    partitions = src.shape[0]
    blocks = partitions // 16
    valid = valid or index.size // blocks
    grouped = src.reshape(partitions, -1, per_index)
    out = np.empty((partitions, valid, per_index), src.dtype)
    for core in range(blocks):
        rows = slice(core * 16, (core + 1) * 16)
        indices = index[rows].flatten(order="F")[:valid] // per_index
        out[rows] = np.take(grouped[rows], indices, axis=1)
    return out.reshape(partitions, -1)


@pytest.mark.parametrize(
    "partitions, row, columns, per_index, valid, dtype",
    [
        (128, 2048, 4, 4, 64, np.float32),  # the reference's own example: (128, 512, 4) source
        (32, 100, 3, 1, None, np.float32),  # every index of the block valid (the default)
        (16, 64, 8, 8, 100, np.float16),
        (128, 256, 2, 32, 17, np.int32),
    ],
)
def test_local_gather_follows_the_reference_numpy(
    rng, partitions, row, columns, per_index, valid, dtype
):
    src = (rng.standard_normal((partitions, row)) * 100).astype(dtype)
    per_core = rng.integers(0, row // per_index, (16, columns))
    index = (np.tile(per_core, (partitions // 16, 1)) * per_index).astype(np.uint16)
    index[16:] = (rng.integers(0, row // per_index, index[16:].shape) * per_index).astype(np.uint16)
    out = _gather_kernel(per_index, valid)(src, index)
    np.testing.assert_array_equal(out, _numpy_model(src, index, per_index, valid))


@pytest.mark.parametrize(
    "partitions, index_dtype, per_index, valid, dst_dtype, top, match",
    [
        (128, np.int32, 1, None, None, 3, "index must be uint16"),
        (24, np.uint16, 1, None, None, 3, "multiple of 16"),
        (16, np.uint16, 3, None, None, 3, "num_elem_per_idx must be one of"),
        (16, np.uint16, 1, 65, None, 3, r"num_valid_indices must be an int in \[1, 64\]"),
        (16, np.uint16, 1, None, nl.float16, 3, "no data type casting"),
        (16, np.uint16, 4, None, None, 62, "out-of-bound access is undefined"),
    ],
)
def test_local_gather_rules(partitions, index_dtype, per_index, valid, dst_dtype, top, match):
    src = np.zeros((partitions, 64), np.float32)
    index = np.full((partitions, 4), top, index_dtype)
    with pytest.raises((TypeError, ValueError, AssertionError), match=match):
        _gather_kernel(per_index, valid, dst_dtype)(src, index)


def test_local_gather_cost_follows_the_published_estimate():
    """150 + n·C cycles, C = ((28 + 4e)/(4e)) / min(4/size, e) per gathered element."""
    table = cost.CostTable("trn2")
    ops = cost.Operands(("float32", "uint16", "float32"), (False, False), False, 4)
    one, documented = cost.compute_cycles(
        "local_gather", "pool", 256, ops, {"num_elem_per_idx": 1}, table
    )
    assert documented and one == pytest.approx(150 + 256 * 8)
    ops_bf16 = cost.Operands(("bfloat16", "uint16", "bfloat16"), (False, False), False, 2)
    wide, _ = cost.compute_cycles(
        "local_gather", "pool", 256, ops_bf16, {"num_elem_per_idx": 32}, table
    )
    assert wide == pytest.approx(150 + 256 * (156 / 128) / 2)
