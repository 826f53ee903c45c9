"""The two front-ends share the core: the same transfer or instruction gives the same trace
record (the cost model's input) and the same values in both dialects."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import BF16, trace_launch

import simulate
import simulate.isa as lisa
import simulate.language as lnl
import simulate.nki06 as nki06
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl

FIELDS = (
    "engine",
    "partitions",
    "free_size",
    "in_dtypes",
    "out_dtype",
    "dma_bytes",
    "dma_direction",
    "dma_row_bytes",
)


def _dma_records(trace):
    return [tuple(getattr(i, f) for f in FIELDS) for i in trace.instructions if i.engine == "dma"]


# (HBM shape, the HBM view both kernels move: rows, column slice)
VIEWS = [
    ((256, 640), (slice(0, 128), slice(None))),  # whole rows
    ((128, 640), (slice(0, 128), slice(128, 384))),  # a column block: 1 KiB rows of 2.5 KiB
    ((300, 96), (slice(256, 300), slice(None))),  # a ragged last row tile
]


@pytest.mark.parametrize("shape, view", VIEWS)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_loads_and_stores_record_the_same_dma_fields(rng, shape, view, dtype):
    x = rng.standard_normal(shape).astype(dtype)
    rows, cols = view
    n_rows = len(range(*rows.indices(shape[0])))
    n_cols = len(range(*cols.indices(shape[1])))

    @simulate.jit
    def legacy_kernel(x):
        out = lnl.ndarray((n_rows, n_cols), x.dtype, buffer=lnl.shared_hbm)
        tile = lnl.load(x[rows, cols])
        lnl.store(out, tile)
        return out

    @nki06.jit
    def nki06_kernel(x):
        out = nl.ndarray((n_rows, n_cols), x.dtype, buffer=nl.shared_hbm)
        tile = nl.ndarray((n_rows, n_cols), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[rows, cols])
        nisa.dma_copy(dst=out, src=tile)
        return out

    legacy_out, legacy_trace = trace_launch(legacy_kernel, x, target="trn2")
    nki06_out, nki06_trace = trace_launch(nki06_kernel, x, target="trn2")
    np.testing.assert_array_equal(
        np.asarray(legacy_out).view(np.uint8), np.asarray(x[rows, cols]).view(np.uint8)
    )
    np.testing.assert_array_equal(
        np.asarray(nki06_out).view(np.uint8), np.asarray(legacy_out).view(np.uint8)
    )
    legacy_dma, nki06_dma = _dma_records(legacy_trace), _dma_records(nki06_trace)
    assert len(legacy_dma) == 2
    assert nki06_dma == legacy_dma
    load = legacy_dma[0]
    assert load[FIELDS.index("free_size")] == n_cols * x.itemsize  # bytes per partition
    assert load[FIELDS.index("dma_row_bytes")] == n_cols * x.itemsize


def test_activation_and_reduce_records_and_values_agree(rng):
    x = rng.standard_normal((128, 512)).astype(np.float32)
    bias = rng.standard_normal((128, 1)).astype(np.float32)

    @simulate.jit
    def legacy_kernel(x, bias):
        out = lnl.ndarray((128, 512), lnl.bfloat16, buffer=lnl.shared_hbm)
        sums = lnl.ndarray((128, 1), lnl.float32, buffer=lnl.shared_hbm)
        acc = lnl.ndarray((128, 1), lnl.float32)
        y = lisa.activation_reduce(
            lnl.exp,
            lnl.load(x),
            bias=lnl.load(bias),
            scale=0.5,
            reduce_op=np.add,
            reduce_res=acc,
            dtype=lnl.bfloat16,
        )
        lnl.store(out, y)
        lnl.store(sums, acc)
        return out, sums

    @nki06.jit
    def nki06_kernel(x, bias):
        out = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.shared_hbm)
        sums = nl.ndarray((128, 1), nl.float32, buffer=nl.shared_hbm)
        xt = nl.load(x)
        bt = nl.load(bias)
        y = nl.ndarray((128, 512), nl.bfloat16, buffer=nl.sbuf)
        acc = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation_reduce(
            dst=y, op=nl.exp, data=xt, bias=bt, scale=0.5, reduce_op=nl.add, reduce_res=acc
        )
        nl.store(out, y)
        nl.store(sums, acc)
        return out, sums

    (l_out, l_sums), l_trace = trace_launch(legacy_kernel, x, bias, target="trn2")
    (n_out, n_sums), n_trace = trace_launch(nki06_kernel, x, bias, target="trn2")
    np.testing.assert_array_equal(n_out.view(np.uint16), l_out.view(np.uint16))
    np.testing.assert_array_equal(n_sums.view(np.uint32), l_sums.view(np.uint32))
    expected = np.exp(x.astype(np.float64) * 0.5 + bias)
    np.testing.assert_allclose(l_sums[:, 0], expected.sum(axis=1), rtol=1e-5)

    def act(trace):
        (inst,) = [i for i in trace.instructions if i.engine == "act"]
        return (
            inst.opcode,
            inst.partitions,
            inst.free_size,
            inst.in_dtypes,
            inst.out_dtype,
            inst.details["op"],
        )

    assert (
        act(n_trace)
        == act(l_trace)
        == ("activation_reduce", 128, 512, ("float32", "float32"), "bfloat16", "exp")
    )


def test_an_hbm_to_hbm_copy_records_the_same_fields(rng):
    x = rng.standard_normal((256, 96)).astype(np.float32)

    @simulate.jit
    def legacy_kernel(x):
        out = lnl.ndarray(x.shape, x.dtype, buffer=lnl.shared_hbm)
        lisa.dma_copy(dst=out, src=x)
        return out

    @nki06.jit
    def nki06_kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out

    legacy_out, legacy_trace = trace_launch(legacy_kernel, x, target="trn2")
    nki06_out, nki06_trace = trace_launch(nki06_kernel, x, target="trn2")
    np.testing.assert_array_equal(nki06_out, x)
    np.testing.assert_array_equal(legacy_out, x)
    # the rows spread over the DMA queues in both: 256 "partitions" of 384 bytes
    assert (
        _dma_records(nki06_trace)
        == _dma_records(legacy_trace)
        == [("dma", 256, 384, ("float32",), "float32", 98304, "hbm->hbm", 384)]
    )
