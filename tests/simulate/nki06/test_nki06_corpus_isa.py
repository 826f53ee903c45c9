"""The NKI 0.6 instructions AWS's nki-library needs beyond the rest of the ISA:
``nc_stream_shuffle``, ``max8``, ``nc_find_index8``, ``nc_match_replace8`` and
``nonzero_with_count`` against NumPy written from the ISA reference
(aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py), with their rules and cost entries."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import poison

import simulate.nki06 as nki
from simulate.nki06 import context
from simulate.perf import cost

nl, nisa = nki.language, nki.isa


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


def _on_neuroncore_v2(monkeypatch):
    """A trn1 target with the front-end's own NeuronCore-v2 gate lifted (where it has one),
    so that the instruction's v3+ rule is the one that answers."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    monkeypatch.setattr(context, "REJECT_NEURONCORE_V2", False, raising=False)


def _load(x, dtype=None):
    tile = nl.ndarray(x.shape, dtype=dtype or x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x)
    return tile


def _store(tile):
    out = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


# --- nc_stream_shuffle (L2052-2081) -----------------------------------------------------------
def test_stream_shuffle_permutes_each_quadrant_and_255_keeps_dst(rng):
    mask = [int(v) for v in rng.permutation(32)]
    mask[3] = mask[17] = 255

    @nki.jit
    def shuffle(x, keep):
        src, dst = _load(x), _load(keep)
        nisa.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=mask)
        return _store(dst)

    x = rng.standard_normal((128, 6)).astype(np.float32)
    keep = rng.standard_normal((128, 6)).astype(np.float32)
    expected = keep.copy()
    for p in range(128):
        if mask[p % 32] != 255:
            expected[p] = x[(p // 32) * 32 + mask[p % 32]]
    np.testing.assert_array_equal(shuffle(x, keep), expected)


def test_stream_shuffle_broadcasts_one_partition_to_a_quadrant(rng):
    """AWS's stream_shuffle_broadcast: a one-partition src, an all-zero mask."""

    @nki.jit
    def broadcast(x):
        src = _load(x)
        dst = nl.ndarray((32, 5), dtype=x.dtype, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=dst, src=src[0:1, :], shuffle_mask=[0] * 32)
        return _store(dst)

    x = rng.standard_normal((4, 5)).astype(np.float32)
    np.testing.assert_array_equal(broadcast(x), np.broadcast_to(x[0], (32, 5)))


@pytest.mark.parametrize(
    "src_slice, dst_slice, mask, match",
    [
        ((0, 32), (16, 48), [0] * 32, "starts at partition 16"),  # 64 active: 0 or 64
        ((0, 32), (0, 32), [33] + [0] * 31, "32 partition numbers"),
        ((0, 32), (0, 32), [0] * 31, "32 partition numbers"),
        ((0, 4), (0, 32), [5] + [0] * 31, "reads partition 5 of src"),
    ],
)
def test_stream_shuffle_rules(src_slice, dst_slice, mask, match):
    @nki.jit
    def shuffle(x):
        tile = _load(x)
        dst = nl.ndarray((128, 4), dtype=x.dtype, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(
            dst=dst[dst_slice[0] : dst_slice[1], :],
            src=tile[src_slice[0] : src_slice[1], :],
            shuffle_mask=mask,
        )

    with pytest.raises(AssertionError, match=match):
        shuffle(np.zeros((128, 4), np.float32))


def test_stream_shuffle_needs_equal_dtypes():
    @nki.jit
    def shuffle(x):
        src = _load(x)
        dst = nl.ndarray((32, 4), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.nc_stream_shuffle(dst=dst, src=src, shuffle_mask=list(range(32)))

    with pytest.raises(TypeError, match="must equal src dtype"):
        shuffle(np.zeros((32, 4), np.float32))


# --- max8, nc_find_index8, nc_match_replace8 (L2415-2432, L3169-3219) -------------------------
@nki.jit
def _top8(x, replace_with):
    data = _load(x)
    top = nl.ndarray((x.shape[0], 8), dtype=nl.float32, buffer=nl.sbuf)
    nisa.max8(dst=top, src=data)
    found = nl.ndarray((x.shape[0], 8), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=found, data=data, vals=top)
    replaced = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    index = nl.ndarray((x.shape[0], 8), dtype=nl.uint16, buffer=nl.sbuf)
    nisa.nc_match_replace8(dst=replaced, data=data, vals=top, imm=replace_with, dst_idx=index)
    return _store(top), _store(found), _store(replaced), _store(index)


def test_top8_of_distinct_values(rng):
    x = rng.standard_normal((16, 50)).astype(np.float32)
    top, found, replaced, index = _top8(x, -1e30)
    order = np.argsort(-x, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(top, np.take_along_axis(x, order, axis=1))
    np.testing.assert_array_equal(found, order)
    np.testing.assert_array_equal(index, order)
    expected = x.copy()
    np.put_along_axis(expected, order, np.float32(-1e30), axis=1)
    np.testing.assert_array_equal(replaced, expected)


def test_top8_duplicates_follow_the_documented_tie_breaks():
    """The ISA reference's own example (L3203-3211): match_replace8 pairs duplicate values
    with descending slots, find_index8 with ascending ones (release notes L75-77)."""
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], np.float32)

    @nki.jit
    def both(x, v):
        d, vals = _load(x), _load(v)
        found = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=found, data=d, vals=vals)
        replaced = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        index = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=replaced, data=d, vals=vals, imm=0.0, dst_idx=index)
        return _store(found), _store(index), _store(replaced)

    vals = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], np.float32)
    found, index, replaced = both(data, vals)
    np.testing.assert_array_equal(index, [[2, 10, 9, 8, 7, 6, 5, 4]])
    np.testing.assert_array_equal(found, [[2, 4, 5, 6, 7, 8, 9, 10]])
    np.testing.assert_array_equal(replaced, [[1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0]])


def test_find_index8_marks_a_missing_value_all_ones():
    @nki.jit
    def find(x, v):
        found = nl.ndarray((1, 8), dtype=nl.uint16, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=found, data=_load(x), vals=_load(v))
        return _store(found)

    x = np.arange(10, dtype=np.float32)[None]
    v = np.array([[9, 0, 42, 1, 2, 3, 4, 5]], np.float32)
    np.testing.assert_array_equal(find(x, v), [[9, 0, 0xFFFF, 1, 2, 3, 4, 5]])


@pytest.mark.parametrize(
    "free, dst_dtype, match", [(7, "uint32", "8 to 16384"), (16, "int32", "uint16 or uint32")]
)
def test_top8_rules(free, dst_dtype, match):
    index_dtype = getattr(nl, dst_dtype)  # resolved on the host: getattr is not NKI

    @nki.jit
    def find(x):
        data = _load(x)
        found = nl.ndarray((4, 8), dtype=index_dtype, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=found, data=data, vals=data[:, 0:8] if free >= 8 else data)

    with pytest.raises((AssertionError, TypeError), match=match):
        find(np.zeros((4, free), np.float32))


# --- nonzero_with_count (L3221-3300) ------------------------------------------------------------
@nki.jit
def _nonzero(x, out_init, index_offset, padding_val):
    dst = _load(out_init)
    nisa.nonzero_with_count(
        dst=dst, src=_load(x), index_offset=index_offset, padding_val=padding_val
    )
    return _store(dst)


def test_nonzero_with_count_the_documented_example():
    x = np.zeros((1, 8), np.int32)
    x[0] = [0, 1, 1, 0, 0, 1, 0, 0]
    out = _nonzero(x, poison((1, 9), np.int32), 16, -1)
    np.testing.assert_array_equal(out, [[17, 18, 21, -1, -1, -1, -1, -1, 3]])


def test_nonzero_with_count_reads_and_writes_every_16th_partition_only(rng):
    x = (rng.random((128, 20)) < 0.3).astype(np.float32) * rng.standard_normal((128, 20))
    x = x.astype(np.float32)
    init = poison((128, 21), np.int32)
    out = _nonzero(x, init, 0, -7)
    for p in range(128):
        if p % 16:
            np.testing.assert_array_equal(out[p], init[p])
            continue
        hits = np.flatnonzero(x[p])
        row = np.full(21, -7)
        row[: hits.size], row[-1] = hits, hits.size
        np.testing.assert_array_equal(out[p], row)


def test_nonzero_with_count_rules(monkeypatch):
    with pytest.raises(TypeError, match="dst must be int32"):
        _nonzero(np.ones((1, 8), np.int32), np.zeros((1, 9), np.float32), 0, -1)
    with pytest.raises(AssertionError, match="one more element"):
        _nonzero(np.ones((1, 8), np.int32), np.zeros((1, 8), np.int32), 0, -1)
    _on_neuroncore_v2(monkeypatch)
    with pytest.raises((AssertionError, ValueError), match="NeuronCore-v3"):
        _nonzero(np.ones((1, 8), np.int32), np.zeros((1, 9), np.int32), 0, -1)


# --- cost entries ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opcode, engine",
    [
        ("nc_stream_shuffle", "dve"),
        ("max8", "dve"),
        ("nc_find_index8", "dve"),
        ("nc_match_replace8", "dve"),
        ("nonzero_with_count", "pool"),
    ],
)
def test_the_new_instructions_have_a_cost_entry(opcode, engine):
    table = cost.CostTable("trn2")
    ops = cost.Operands(("float32", "float32"), (False,), False, 4)
    short, covered = cost.compute_cycles(opcode, engine, 8, ops, {}, table)
    long, _ = cost.compute_cycles(opcode, engine, 4096, ops, {}, table)
    assert covered
    assert long > short  # one pass over the elements: longer rows take longer


# --- affine_select (L1764-1835) ---------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern, multiplier, offset, cmp_op",
    [
        ([[-1, 64]], 1, 0, "greater_equal"),  # causal mask: keep column <= row
        ([[1, 4], [-2, 16]], 3, -5, "not_equal"),
        ([[-1, 64]], 0, 10, None),  # default nl.equal: only column 10 is kept
    ],
)
def test_affine_select(rng, pattern, multiplier, offset, cmp_op):
    x = rng.standard_normal((32, 64)).astype(np.float32)
    compare = None if cmp_op is None else getattr(nl, cmp_op)

    @nki.jit
    def select(data):
        tile = _load(data)
        dst = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.sbuf)
        if compare is None:  # the default cmp_op (nl.equal)
            nisa.affine_select(
                dst=dst,
                pattern=pattern,
                channel_multiplier=multiplier,
                on_true_tile=tile,
                on_false_value=-9999.0,
                offset=offset,
            )
        else:
            nisa.affine_select(
                dst=dst,
                pattern=pattern,
                channel_multiplier=multiplier,
                on_true_tile=tile,
                on_false_value=-9999.0,
                offset=offset,
                cmp_op=compare,
            )
        return _store(dst)

    grids = np.meshgrid(*[np.arange(n) * s for s, n in pattern], indexing="ij")
    affine = offset + np.arange(32)[:, None] * multiplier + sum(grids).reshape(1, -1)
    keep = {None: np.equal, "greater_equal": np.greater_equal, "not_equal": np.not_equal}[cmp_op](
        affine, 0
    )
    np.testing.assert_array_equal(select(x), np.where(keep, x, np.float32(-9999.0)))


def test_affine_select_rules():
    @nki.jit
    def select(data, count):
        tile = _load(data)
        dst = nl.ndarray(data.shape, dtype=data.dtype, buffer=nl.sbuf)
        nisa.affine_select(
            dst=dst,
            pattern=[[1, count]],
            channel_multiplier=0,
            on_true_tile=tile,
            on_false_value=0.0,
            cmp_op=nl.add,
        )

    x = np.zeros((4, 8), np.float32)
    with pytest.raises(AssertionError, match="pattern covers 7"):
        select(x, 7)
    with pytest.raises(AssertionError, match="must be a comparison"):
        select(x, 8)


# --- nc_n_gather ----------------------------------------------------------------------------------
def test_n_gather_takes_flattened_free_elements_per_partition(rng):
    x = rng.standard_normal((16, 4, 25)).astype(np.float32)
    index = rng.integers(0, 100, (16, 600)).astype(np.uint32)

    @nki.jit
    def gather(data, idx):
        dst = nl.ndarray(idx.shape, dtype=data.dtype, buffer=nl.sbuf)
        nisa.nc_n_gather(dst=dst, data=_load(data), indices=_load(idx))
        return _store(dst)

    expected = np.take_along_axis(x.reshape(16, 100), index.astype(np.int64), axis=1)
    np.testing.assert_array_equal(gather(x, index), expected)


@pytest.mark.parametrize(
    "index_dtype, top, match", [(np.int32, 10, "must be uint32"), (np.uint32, 10, r"\[0, 10\)")]
)
def test_n_gather_rules(index_dtype, top, match):
    @nki.jit
    def gather(data, idx):
        dst = nl.ndarray(idx.shape, dtype=data.dtype, buffer=nl.sbuf)
        nisa.nc_n_gather(dst=dst, data=_load(data), indices=_load(idx))

    index = np.full((2, 3), top, index_dtype)
    with pytest.raises((AssertionError, TypeError), match=match):
        gather(np.zeros((2, 10), np.float32), index)


def test_n_gather_cost_counts_its_512_element_groups():
    table = cost.CostTable("trn2")
    ops = cost.Operands(("float32", "uint32", "float32"), (False, False), False, 4)
    one, _ = cost.compute_cycles("nc_n_gather", "pool", 512, ops, {}, table)
    two, _ = cost.compute_cycles("nc_n_gather", "pool", 513, ops, {}, table)
    assert two - one == pytest.approx(table.pool_start_cycles + 1)


# --- dma_copy through .ap(vector_offset=...): gather, scatter, oob_mode --------------------------
@nki.jit
def _indirect_gather(data, indices, skip):
    """The ISA reference's gather example (dma_copy, "Indirect gather example"), with an
    initial ``dst`` so that skipped rows show."""
    p, f = indices.shape[0], data.shape[1]
    idx = nl.ndarray((p, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=indices)
    dst = nl.ndarray((p, f), dtype=data.dtype, buffer=nl.sbuf)
    nisa.memset(dst=dst, value=-1.0)
    nisa.dma_copy(
        dst=dst,
        src=data.ap(pattern=[[f, p], [1, f]], vector_offset=idx, indirect_dim=0),
        oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error,
    )
    return _store(dst)


def test_indirect_gather_reads_the_indexed_rows(rng):
    data = rng.standard_normal((40, 12)).astype(np.float32)
    index = rng.integers(0, 40, (16, 1)).astype(np.uint32)
    np.testing.assert_array_equal(_indirect_gather(data, index, False), data[index[:, 0]])


def test_indirect_gather_out_of_bounds_errors_or_skips(rng):
    data = rng.standard_normal((10, 4)).astype(np.float32)
    index = np.array([[3], [10], [0], [99]], np.uint32)
    with pytest.raises(AssertionError, match=r"row 1 \(storage element 40\) reaches outside"):
        _indirect_gather(data, index, False)
    expected = np.full((4, 4), -1.0, np.float32)
    expected[0], expected[2] = data[3], data[0]
    np.testing.assert_array_equal(_indirect_gather(data, index, True), expected)


def test_indirect_scatter_writes_the_indexed_rows(rng):
    """The ISA reference's scatter example (``vector_offset`` on ``dst``)."""

    @nki.jit
    def scatter(src_data, indices, output):
        p, f = src_data.shape
        src = _load(src_data)
        idx = nl.ndarray((p, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=indices)
        nisa.dma_copy(
            dst=output.ap(pattern=[[f, p], [1, f]], vector_offset=idx, indirect_dim=0),
            src=src,
        )
        return output

    src = rng.standard_normal((6, 8)).astype(np.float32)
    index = rng.permutation(20)[:6].astype(np.uint32)[:, None]
    out = rng.standard_normal((20, 8)).astype(np.float32)
    expected = out.copy()
    expected[index[:, 0]] = src
    np.testing.assert_array_equal(scatter(src, index, out), expected)


def _rmw_kernel(mode, pattern_rows, copies=1, unique=True):
    """dma_compute's documented read-modify-write (isa L2672-2692): ``gather`` adds the
    indexed HBM rows into an SBUF tile, ``scatter`` adds an SBUF tile into the indexed HBM
    rows; ``copies`` sources of the indexed side (2 documented)."""

    @nki.jit
    def kernel(table, tile, indices):
        width = table.shape[1]
        sb = _load(tile)
        idx = nl.ndarray((pattern_rows, 1), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=idx, src=indices)
        indexed = table.ap(pattern=[[width, pattern_rows], [1, width]], vector_offset=idx)
        if mode == "gather":
            srcs = [indexed] * copies + [sb]
            nisa.dma_compute(dst=sb, srcs=srcs, reduce_op=nl.add, unique_indices=unique)
            out = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=sb)
            return out
        srcs = [indexed, sb] + [sb] * (copies - 1)
        nisa.dma_compute(dst=indexed, srcs=srcs, reduce_op=nl.add, unique_indices=unique)
        return table

    return kernel


def test_dma_compute_gather_and_scatter_read_modify_write(rng):
    table = rng.standard_normal((20, 8)).astype(np.float32)
    tile = rng.standard_normal((6, 8)).astype(np.float32)
    index = rng.permutation(20)[:6].astype(np.uint32)[:, None]
    gathered = _rmw_kernel("gather", 6)(table, tile, index)
    np.testing.assert_allclose(gathered, tile + table[index[:, 0]], rtol=1e-6)
    expected = table.copy()
    expected[index[:, 0]] += tile
    scattered = _rmw_kernel("scatter", 6)(table.copy(), tile, index)
    np.testing.assert_allclose(scattered, expected, rtol=1e-6)


def test_dma_compute_read_modify_write_rules(rng):
    """Exactly two sources, unique_indices=True (isa L2687-2690); a scatter naming a row twice
    is rejected (inferred: the docs promise unique indices, not an order)."""
    table = rng.standard_normal((20, 8)).astype(np.float32)
    tile = rng.standard_normal((6, 8)).astype(np.float32)
    index = rng.permutation(20)[:6].astype(np.uint32)[:, None]
    with pytest.raises(AssertionError, match="exactly 2 sources"):
        _rmw_kernel("gather", 6, copies=2)(table, tile, index)
    with pytest.raises(AssertionError, match="unique_indices=True"):
        _rmw_kernel("gather", 6, unique=False)(table, tile, index)
    twice = index.copy()
    twice[1] = twice[0]
    with pytest.raises(AssertionError, match="names an HBM element twice"):
        _rmw_kernel("scatter", 6)(table.copy(), tile, twice)
    # a gather may read one row twice
    np.testing.assert_allclose(
        _rmw_kernel("gather", 6)(table, tile, twice), tile + table[twice[:, 0]], rtol=1e-6
    )


def test_indirect_index_scales_by_the_indirect_dim_stride(rng):
    """AWS's KV-cache update (attention_block_tkg.py L1311-1315): a flat cache, the pattern's
    first stride 1 and each row's index already the element offset."""

    @nki.jit
    def update(cache, rows, offsets):
        tile = _load(rows)
        idx = _load(offsets)
        nisa.dma_copy(
            dst=cache.reshape((cache.size,)).ap(
                pattern=[[1, 3], [1, 5]], offset=0, vector_offset=idx, indirect_dim=0
            ),
            src=tile,
        )
        return cache

    cache = rng.standard_normal((4, 10)).astype(np.float32)
    rows = rng.standard_normal((3, 5)).astype(np.float32)
    offsets = np.array([[2], [17], [33]], np.uint32)
    expected = cache.reshape(-1).copy()
    for r, o in enumerate(offsets[:, 0]):
        expected[o : o + 5] = rows[r]
    np.testing.assert_array_equal(update(cache, rows, offsets).reshape(-1), expected)


def test_vector_offset_rules(rng):
    @nki.jit
    def bad(data, which):
        idx = nl.ndarray(
            (4, 1), dtype=nl.float32 if which == "dtype" else nl.uint32, buffer=nl.sbuf
        )
        nisa.memset(dst=idx, value=0.0 if which == "dtype" else 0)
        view = data if which != "sbuf" else _load(data)
        view.ap(pattern=[[4, 4], [1, 4]], vector_offset=idx, indirect_dim=0)

    data = np.zeros((4, 4), np.float32)
    with pytest.raises(TypeError, match="must be integers"):
        bad(data, "dtype")
    with pytest.raises(ValueError, match="must be in HBM"):
        bad(data, "sbuf")


def test_scalar_offset_rows_past_the_end_error_or_skip(rng):
    """A dynamic start (``scalar_offset``) whose rows partly leave the tensor: raised under
    oob_mode.error, those rows skipped under oob_mode.skip (AWS's indexed_flatten.py
    L185-195)."""

    @nki.jit
    def place(rows, start, out, skip):
        tile = _load(rows)
        where = _load(start)
        nisa.dma_copy(
            dst=out.ap(pattern=[[4, 3], [1, 4]], offset=0, scalar_offset=where, indirect_dim=0),
            src=tile,
            oob_mode=nisa.oob_mode.skip if skip else nisa.oob_mode.error,
        )
        return out

    rows = rng.standard_normal((3, 4)).astype(np.float32)
    out = rng.standard_normal((5, 4)).astype(np.float32)
    start = np.array([[3]], np.int32)
    with pytest.raises(AssertionError, match="reaches outside"):
        place(rows, start, out.copy(), False)
    expected = out.copy()
    expected[3:5] = rows[:2]
    np.testing.assert_array_equal(place(rows, start, out.copy(), True), expected)
    np.testing.assert_array_equal(
        place(rows, np.array([[1]], np.int32), out.copy(), True)[1:4], rows
    )


# --- range_select, tensor_partition_reduce -----------------------------------------------------
F32_MIN = float(np.finfo(np.float32).min)


@nki.jit
def _range_select(x, low, high, start, chain):
    tile, b0, b1 = _load(x), _load(low), _load(high)
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    row_max = nl.ndarray((x.shape[0], 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.range_select(
        dst=dst,
        on_true_tile=tile,
        comp_op0=nl.greater_equal,
        comp_op1=nl.less,
        bound0=b0,
        bound1=b1,
        reduce_op=nl.maximum,
        range_start=start,
        reduce_res=None if chain else row_max,
        on_false_value=F32_MIN,
    )
    if chain:  # a second call folds into the accumulators of the first
        nisa.range_select(
            dst=dst,
            on_true_tile=tile,
            comp_op0=nl.greater_equal,
            comp_op1=nl.less,
            bound0=b0,
            bound1=b1,
            reduce_op=nl.maximum,
            range_start=start + 1,
            reduce_cmd=nisa.reduce_cmd.reduce,
            reduce_res=row_max,
            on_false_value=F32_MIN,
        )
    return _store(dst), _store(row_max)


def _range_reference(x, low, high, start):
    index = start + np.arange(x.shape[1])[None, :]
    keep = (index >= low) & (index < high)
    selected = np.where(keep, x, F32_MIN)
    return selected, selected.max(axis=1, keepdims=True)


def test_range_select_keeps_the_window_and_reduces_its_max(rng):
    x = rng.standard_normal((16, 40)).astype(np.float32)
    low = rng.integers(0, 50, (16, 1)).astype(np.float32)
    high = low + rng.integers(0, 20, (16, 1)).astype(np.float32)
    selected, row_max = _range_select(x, low, high, 10, False)
    expected, expected_max = _range_reference(x, low, high, 10)
    np.testing.assert_array_equal(selected, expected)
    np.testing.assert_array_equal(row_max, expected_max)


def test_range_select_reduce_cmd_reduce_accumulates(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    low = np.zeros((8, 1), np.float32)
    high = np.full((8, 1), 8, np.float32)
    _, row_max = _range_select(x, low, high, 0, True)
    first = _range_reference(x, low, high, 0)[1]
    second = _range_reference(x, low, high, 1)[1]
    np.testing.assert_array_equal(row_max, np.maximum(first, second))


def test_range_select_rules(monkeypatch):
    x = np.zeros((4, 8), np.float32)
    bound = np.zeros((4, 1), np.float32)

    @nki.jit
    def select(data, bounds, value, op):
        tile, b = _load(data), _load(bounds)
        nisa.range_select(
            dst=tile,
            on_true_tile=tile,
            comp_op0=op,
            comp_op1=nl.less,
            bound0=b,
            bound1=b,
            on_false_value=value,
        )

    with pytest.raises(AssertionError, match="must be FP32_MIN"):
        select(x, bound, 0.0, nl.equal)
    with pytest.raises(AssertionError, match="comp_op0 must be one of"):
        select(x, bound, F32_MIN, nl.not_equal)
    _on_neuroncore_v2(monkeypatch)
    with pytest.raises((AssertionError, ValueError), match="NeuronCore-v3"):
        select(x, bound, F32_MIN, nl.equal)


@pytest.mark.parametrize(
    "op, dtype",
    [
        ("add", np.float32),
        ("maximum", np.float32),
        ("bitwise_or", np.int32),
        ("bitwise_and", np.int32),
    ],
)
def test_tensor_partition_reduce(rng, op, dtype):
    x = (
        rng.integers(0, 1 << 20, (24, 10)) if dtype == np.int32 else rng.standard_normal((24, 10))
    ).astype(dtype)
    reducer = getattr(nl, op)  # resolved on the host: getattr is not NKI

    @nki.jit
    def reduce_partitions(data):
        dst = nl.ndarray((1, 10), dtype=data.dtype, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=dst, op=reducer, data=_load(data))
        return _store(dst)

    expected = getattr(np, op).reduce(
        x.astype(np.float64) if dtype != np.int32 else x, axis=0, keepdims=True
    )
    np.testing.assert_allclose(reduce_partitions(x), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "opcode, cycles",
    [
        ("max8", lambda n, min_ii: n),  # legacy ISA reference L671
        ("nc_find_index8", lambda n, min_ii: n),  # L746
        ("nc_stream_shuffle", lambda n, min_ii: max(min_ii, n)),  # L991
        ("range_select", lambda n, min_ii: max(min_ii, n)),  # L1133
        ("nc_match_replace8", lambda n, min_ii: max(min_ii, n)),  # L793
    ],
)
def test_vector_costs_follow_the_documented_estimates(opcode, cycles):
    table = cost.CostTable("trn2")
    ops = cost.Operands(("float32", "float32"), (False,), False, 4)
    for n in (8, 40, 1000):
        assert cost.compute_cycles(opcode, "dve", n, ops, {}, table) == (
            cycles(n, table.min_ii_cycles),
            True,
        )
