"""Indexing in the simulator: aranges, mgrid, slices, ``nl.ds``, affine expressions, masks,
indirect (runtime) indices, block dimensions, loop iterators, and the regions the trace
records."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import poison, random_array

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate.errors import NKIError


def run(kernel, *args, **kwargs):
    return nki.simulate_kernel(kernel, *args, **kwargs)


def test_arange_tiles_cover_the_tensor(rng):
    x = random_array(rng, (300, 40), np.float32)

    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(x.shape[1])[None, :]
        for i in nl.affine_range((x.shape[0] + 127) // 128):
            rows = i * 128 + i_p
            tile = nl.load(x[rows, i_f], mask=rows < x.shape[0])
            nl.store(out[rows, i_f], value=tile, mask=rows < x.shape[0])
        return out

    np.testing.assert_array_equal(run(kernel, x), x)


def test_mgrid_unpacked_and_by_attribute(rng):
    x = random_array(rng, (64, 3, 32), np.float32)

    def kernel(x):
        out = nl.ndarray((64, 32), x.dtype, buffer=nl.shared_hbm)
        out2 = nl.ndarray((64, 32), x.dtype, buffer=nl.shared_hbm)
        i_p, i_f = nl.mgrid[0:64, 0:32]
        nl.store(out[i_p, i_f], value=nl.load(x[i_p, 1, i_f]))
        grid = nl.mgrid[0:64, 0:32]
        nl.store(out2[grid.p, grid.x], value=nl.load(x[grid.p, 2, grid.x]))
        return out, out2

    out, out2 = run(kernel, x)
    np.testing.assert_array_equal(out, x[:, 1])
    np.testing.assert_array_equal(out2, x[:, 2])


def test_slices_ds_and_integer_indices(rng):
    x = random_array(rng, (128, 96), np.float32)

    def kernel(x):
        a = nl.ndarray((64, 64), x.dtype, buffer=nl.shared_hbm)
        b = nl.ndarray((32, 96), x.dtype, buffer=nl.shared_hbm)
        c = nl.ndarray((128, 1), x.dtype, buffer=nl.shared_hbm)
        nl.store(a, value=nl.load(x[0:64, 32:96]))
        nl.store(b[...], value=nl.load(x[nl.ds(64, 32), :]))
        tile = nl.load(x)
        column = tile[:, 5]  # an integer on the free axis: a (P, 1) tile
        assert column.shape == (128, 1)
        nl.store(c, value=nl.copy(column))
        return a, b, c

    a, b, c = run(kernel, x)
    np.testing.assert_array_equal(a, x[0:64, 32:96])
    np.testing.assert_array_equal(b, x[64:96])
    np.testing.assert_array_equal(c, x[:, 5:6])


def test_strided_transposed_and_3d_affine_accesses(rng):
    x = random_array(rng, (64, 256), np.float32)

    def kernel(x):
        strided = nl.ndarray((64, 100), x.dtype, buffer=nl.shared_hbm)
        transposed = nl.ndarray((100, 64), x.dtype, buffer=nl.shared_hbm)
        blocks = nl.ndarray((64, 4, 32), x.dtype, buffer=nl.shared_hbm)
        i_p = nl.arange(64)[:, None]
        i_f = nl.arange(100)[None, :]
        nl.store(strided, value=nl.load(x[i_p, 2 * i_f + 3]))
        j_p = nl.arange(100)[:, None]
        j_f = nl.arange(64)[None, :]
        nl.store(transposed, value=nl.load(x[j_f, j_p]))  # partition axis along x's columns
        k_p, k_b, k_f = nl.mgrid[0:64, 0:4, 0:32]
        nl.store(blocks, value=nl.load(x[k_p, 64 * k_b + k_f]))
        return strided, transposed, blocks

    strided, transposed, blocks = run(kernel, x)
    np.testing.assert_array_equal(strided, x[:, 3:203:2])
    np.testing.assert_array_equal(transposed, x[:, :100].T)
    np.testing.assert_array_equal(blocks, x.reshape(64, 4, 64)[:, :, :32])


@pytest.mark.parametrize("case", range(12))
def test_masked_affine_accesses_match_numpy(rng, case):
    """Random affine loads and stores with random box and non-box masks: the masked-in
    points move, the others are neither read (no bounds error) nor written."""
    n_rows, n_cols = 150, 130
    x = random_array(rng, (n_rows, n_cols), np.float32)
    triangular = case % 3 == 0
    keep = np.zeros((1, 1), bool)
    while not keep.any():  # draw until the mask selects something
        P, F = int(rng.integers(1, 129)), int(rng.integers(1, 64))
        a, c = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        b, d = int(rng.integers(-20, 40)), int(rng.integers(-20, 40))
        r_lim, c_lim = int(rng.integers(1, n_rows)), int(rng.integers(1, n_cols))
        rows = a * np.arange(P)[:, None] + b
        cols = c * np.arange(F)[None, :] + d
        keep = (rows >= 0) & (rows < r_lim) & (cols >= 0) & (cols < c_lim)
        if triangular:
            keep &= np.arange(P)[:, None] >= np.arange(F)[None, :]

    def kernel(x, out):
        i_p = nl.arange(P)[:, None]
        i_f = nl.arange(F)[None, :]
        r, q = a * i_p + b, c * i_f + d
        mask = (r >= 0) & (r < r_lim) & (q >= 0) & (q < c_lim)
        if triangular:
            mask = mask & (i_p >= i_f)
        tile = nl.load(x[r, q], mask=mask)
        nl.store(out[r, q], value=tile, mask=mask)

    out = poison(x.shape)
    if triangular:  # each comparison of a mask restricts one axis: a staircase is rejected
        with pytest.raises(NKIError, match="err_unsupported_expression_in_mask"):
            run(kernel, x, out)
        return
    run(kernel, x, out)
    expected = poison(x.shape)
    expected[rows.repeat(F, 1)[keep], cols.repeat(P, 0)[keep]] = x[
        rows.repeat(F, 1)[keep], cols.repeat(P, 0)[keep]
    ]
    np.testing.assert_array_equal(out, expected)


def test_masked_off_points_are_uninitialised_in_a_new_tile_and_kept_in_an_assigned_one(rng):
    x = random_array(rng, (128, 16), np.float32)

    def kernel(x):
        fresh = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        kept = nl.ndarray((128, 16), nl.float32, buffer=nl.shared_hbm)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(16)[None, :]
        tile = nl.load(x)
        nl.store(fresh, value=nl.exp(tile, mask=(i_p < 100) & (i_f < 8)))
        target = nl.zeros((128, 16), nl.float32)
        target[...] = nl.exp(tile, mask=(i_p < 100) & (i_f < 8))
        nl.store(kept, value=target)
        return fresh, kept

    fresh, kept = run(kernel, x)
    inside = np.zeros((128, 16), bool)
    inside[:100, :8] = True
    expected = np.exp(x)
    np.testing.assert_allclose(fresh[inside], expected[inside], rtol=1e-6)
    assert np.isnan(fresh[~inside]).all()
    np.testing.assert_allclose(kept[inside], expected[inside], rtol=1e-6)
    assert (kept[~inside] == 0).all()


def test_loop_variable_masks_skip_whole_instructions(rng):
    x = random_array(rng, (4, 8), np.float32)

    def kernel(x, out):
        for i in nl.sequential_range(4):
            nl.store(out[i : i + 1, :], value=nl.load(x[i : i + 1, :]), mask=i < 2)

    out = poison(x.shape)
    _, trace = nki.trace_kernel(kernel, x, out)
    np.testing.assert_array_equal(out[:2], x[:2])
    assert np.isnan(out[2:]).all()
    assert sum(i.opcode == "store" for i in trace) == 2


def test_iterators_yield_python_ints_and_are_recorded_in_the_trace():
    seen = {}

    def kernel(out):
        seen["affine"] = list(nl.affine_range(2, 10, 3))
        seen["sequential"] = list(nl.sequential_range(3))
        seen["static"] = list(nl.static_range(1, 3))
        for i in nl.affine_range(2):
            for j in nl.sequential_range(3):
                nl.store(out[i : i + 1, j : j + 1], value=nl.full((1, 1), 10 * i + j, nl.float32))

    out = poison((2, 3))
    _, trace = nki.trace_kernel(kernel, out)
    np.testing.assert_array_equal(out, [[0, 1, 2], [10, 11, 12]])
    assert seen == {"affine": [2, 5, 8], "sequential": [0, 1, 2], "static": [1, 2]}
    assert all(type(v) is int for vs in seen.values() for v in vs)
    stores = [i for i in trace if i.opcode == "store"]
    assert [(kind, it) for _, kind, it in stores[4].loops] == [
        ("affine_range", 1),
        ("sequential_range", 1),
    ]


def test_block_dimensions_before_the_partition_axis(rng):
    x = random_array(rng, (4, 128, 32), np.float32)

    def kernel(x):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        buf = nl.ndarray((4, nl.par_dim(128), 32), nl.float32)
        i_p = nl.arange(128)[:, None]
        i_f = nl.arange(32)[None, :]
        for b in nl.affine_range(4):
            buf[b] = nl.load(x[b])
            buf[b, i_p, i_f] = nl.multiply(buf[b], 2.0)
        for b in nl.affine_range(4):
            nl.store(out[b], value=buf[b])
        return out

    np.testing.assert_array_equal(run(kernel, x), 2 * x)


def test_indirect_gather_and_scatter(rng):
    data = random_array(rng, (50, 24), np.float32)
    idx = rng.permutation(50)[:32].astype(np.int32)

    def kernel(data, idx):
        gathered = nl.ndarray((32, 24), data.dtype, buffer=nl.shared_hbm)
        scattered = nl.ndarray((50, 24), data.dtype, buffer=nl.shared_hbm)
        nl.store(scattered, value=0.0)
        i_p = nl.arange(32)[:, None]
        i_f = nl.arange(24)[None, :]
        idx_tile = nl.load(idx[i_p])
        assert idx_tile.shape == (32, 1)
        rows = nl.load(data[idx_tile, i_f])
        nl.store(gathered, value=rows)
        again = nl.load(data[idx_tile[i_p, 0], i_f])  # an indexed index tile
        nl.store(scattered[idx_tile, i_f], value=nl.multiply(again, 3.0))
        return gathered, scattered

    gathered, scattered = run(kernel, data, idx)
    np.testing.assert_array_equal(gathered, data[idx])
    expected = np.zeros_like(data)
    expected[idx] = 3 * data[idx]
    np.testing.assert_array_equal(scattered, expected)


def test_regions_in_the_trace():
    def kernel(out):
        tile = nl.zeros((128, 64), nl.float32)
        blocks = nl.zeros((2, nl.par_dim(64), 16), nl.bfloat16)
        part = nl.exp(tile[32:64, 16:48])
        nl.exp(blocks[1, 8:24, 4:12])
        nl.store(out[3:5, 2:10], value=nl.copy(part[0:2, 0:8]))

    out = poison((8, 16))
    _, trace = nki.trace_kernel(kernel, out)
    exps = [i for i in trace if i.opcode == "activation"]
    tile_read, block_read = exps[0].reads[0], exps[1].reads[0]
    memsets = [i for i in trace if i.opcode == "memset"]
    tile_addr = memsets[0].writes[0].start
    blocks_addr = memsets[1].writes[0].start
    assert tile_read.partitions == (32, 64)
    assert (tile_read.start - tile_addr, tile_read.stop - tile_addr) == (16 * 4, 48 * 4)
    assert block_read.partitions == (8, 24)  # (block 1, partitions 8..23, elements 4..11)
    assert (block_read.start - blocks_addr, block_read.stop - blocks_addr) == (
        (16 + 4) * 2,
        (16 + 12) * 2,
    )
    store = [i for i in trace if i.opcode == "store"][0]
    dst = store.writes[0]
    assert dst.memory == "hbm" and (dst.start, dst.stop) == ((3 * 16 + 2) * 4, (4 * 16 + 10) * 4)
    assert store.dma_bytes == 2 * 8 * 4 and store.dma_row_bytes == 8 * 4


def test_index_errors():
    def one_d(x):
        nl.load(x[nl.arange(4), 0])

    def mixed(x):
        nl.load(x[nl.arange(4)[:, None], :])

    def iterate(x):
        for _ in nl.arange(4):
            pass

    def out_of_bound(x):
        nl.load(x[nl.arange(8)[:, None], nl.arange(4)[None, :]])

    def slice_out_of_bound(x):
        nl.load(x[0:4, 0:9])

    def assign_index(x):
        i = nl.arange(4)[None, :]
        i[0, 1] = 3

    x = np.zeros((4, 8), np.float32)
    cases = [
        (one_d, IndexError, "err_1d_arange_not_supported"),
        (mixed, IndexError, "err_unsupported_mixing_basic_advanced_tensor_indexing"),
        (iterate, RuntimeError, "Only support multi-dimensional subscript to arange"),
        (out_of_bound, IndexError, "err_tensor_access_out_of_bound"),
        (slice_out_of_bound, IndexError, "err_tensor_access_out_of_bound"),
        (assign_index, TypeError, "err_cannot_assign_to_index"),
    ]
    for kernel, exc, key in cases:
        with pytest.raises(exc, match=key):
            run(kernel, x)


def test_mask_expression_errors():
    def with_and(x):
        i = nl.arange(4)[:, None]
        nl.load(x[i, nl.arange(8)[None, :]], mask=(i < 2) and (i > 0))

    def with_if(x):
        i = nl.arange(4)[:, None]
        if i < 3:
            pass

    def with_modulo(x):
        i = nl.arange(4)[:, None]
        nl.load(x[i, nl.arange(8)[None, :]], mask=i % 2 < 1)

    def with_product(x):
        i = nl.arange(4)[:, None]
        nl.load(x[i * nl.arange(8)[None, :], 0])

    def dynamic_oob(x):
        idx = nl.load(nl.shared_constant(np.array([[0], [9]], np.int32)))
        nl.load(x[idx, nl.arange(8)[None, :]])

    x = np.zeros((4, 8), np.float32)
    for kernel, exc, key in [
        (with_and, ValueError, "err_control_flow_condition_depending_on_arange"),
        (with_if, TypeError, "err_control_flow_condition_depending_on_arange"),
        (with_modulo, ValueError, "err_unsupported_expression_in_mask"),
        (with_product, ValueError, "err_unsupported_expression_in_mask"),
        (dynamic_oob, IndexError, "index 72 is out of bounds for axis 0 with size 32"),
    ]:
        with pytest.raises(exc, match=key):
            run(kernel, x)


def test_iota_materialises_index_expressions():
    def kernel(out, out2, out3):
        i_p = nl.arange(64)[:, None]
        i_f = nl.arange(16)[None, :]
        nl.store(out, value=nisa.iota(2 * i_p + 16 * i_f - 3, dtype=nl.int32))
        nl.store(out2, value=nisa.iota(i_p, dtype=nl.float32))
        for k in nl.sequential_range(1):
            nl.store(out3, value=nisa.iota(k + 7, dtype=nl.uint32).broadcast_to((4, 2)))

    out, out2, out3 = poison((64, 16), np.int32), poison((64, 1)), poison((4, 2), np.uint32)
    run(kernel, out, out2, out3)
    np.testing.assert_array_equal(out, 2 * np.arange(64)[:, None] + 16 * np.arange(16) - 3)
    np.testing.assert_array_equal(out2[:, 0], np.arange(64))
    np.testing.assert_array_equal(out3, 7)
