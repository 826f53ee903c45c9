"""nki 0.6 front-end: NkiTensor views (indexing, view methods, ``.ap()``), dtypes, fresh
memory, ``NKI_PRECISE_FP`` and the ``nl.*`` convenience functions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)


def run(kernel, *args):
    return nki.simulate(kernel)(*args)


def shapes_of(kernel, *args):
    """Run ``kernel`` (which returns a tuple of shapes) and give the shapes back."""
    found = []

    def wrapper(x, extra=None):  # fixed parameters: *args is not NKI
        if extra is None:
            found.extend(kernel(x))
        else:
            found.extend(kernel(x, extra))

    run(wrapper, *args)
    return found


def test_indexing_rules_on_chip_and_hbm():
    def kernel(x):
        t = nl.ndarray((64, 64, 64), nl.float32)
        return (
            x[1].shape,
            t[0, 0, 10].shape,
            t[:, 0].shape,
            t[:, 0, 10].shape,
            t[0, ..., :].shape,
            t[:, 0:32:2, nl.ds(8, 4)].shape,
        )

    assert shapes_of(kernel, np.zeros((2, 2, 2), np.float32)) == [
        (2, 2),
        (1, 1),
        (64, 64),
        (64, 1),
        (1, 64, 64),
        (64, 16, 4),
    ]


def test_shape_compares_equal_to_lists():
    def kernel(x):
        return (x.shape == [4, 6], x.shape == (4, 6), x[0:2].shape == [2, 6])

    assert shapes_of(kernel, np.zeros((4, 6), np.float32)) == [True, True, True]


@pytest.mark.parametrize("key", [(slice(0, 5),), (slice(2, 2),), (4,), (slice(None, None, -1),)])
def test_out_of_range_or_empty_index_raises(key):
    def kernel(x):
        return (x[key].shape,)

    with pytest.raises(IndexError):
        shapes_of(kernel, np.zeros((4, 6), np.float32))


def test_writes_through_views_share_storage(rng):
    x = rng.standard_normal((8, 12)).astype(np.float32)

    def kernel(x):
        t = nl.ndarray((8, 12), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        sub = t[2:6, 3:9:2]
        nisa.memset(dst=sub, value=-1.0)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    expected = x.copy()
    expected[2:6, 3:9:2] = -1
    np.testing.assert_array_equal(run(kernel, x), expected)


def test_ap_pooling_view_matches_numpy_strides(rng):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)

    def kernel(x):
        t = nl.ndarray(x.shape, nl.float32)
        nisa.dma_copy(dst=t, src=x)
        view = t.ap([[48, 4], [16, 3], [2, 4], [8, 2], [1, 2]])
        o = nl.ndarray((4, 3, 4, 2, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=view)
        return o

    expected = x.reshape(4, 3, 2, 4, 2).transpose(0, 1, 3, 2, 4)
    np.testing.assert_array_equal(run(kernel, x), expected)


def test_ap_partition_stride_must_equal_the_free_size():
    def kernel(x, stride):
        t = nl.ndarray((4, 8), nl.float32)
        return (t.ap([[stride, 4], [1, 8]]).shape,)

    assert shapes_of(kernel, np.zeros(1, np.float32), 8) == [(4, 8)]
    with pytest.raises(AssertionError, match="partition stride 4 of an on-chip access pattern"):
        shapes_of(kernel, np.zeros(1, np.float32), 4)


def test_ap_partition_stride_of_the_dense_free_extent_steps_one_partition(rng):
    """AWS's mlp_cte writes a [128, 2, I] block into a [128, 8, I] tile with the partition
    stride 2·I (mlp_cte_projection.py L1117-1124) and reads it back at the start of each
    partition: a partition stride equal to the pattern's dense free extent is one partition."""
    x = rng.standard_normal((4, 6)).astype(np.float32)

    def kernel(x, stride):
        t = nl.ndarray((4, 16), nl.float32)
        nisa.memset(dst=t, value=0.0)
        nisa.dma_copy(dst=t.ap([[stride, 4], [3, 2], [1, 3]]), src=x)
        o = nl.ndarray((4, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    expected = np.zeros((4, 16), np.float32)
    expected[:, :6] = x
    np.testing.assert_array_equal(run(kernel, x, 6), expected)
    np.testing.assert_array_equal(run(kernel, x, 16), expected)
    with pytest.raises(AssertionError, match="dense free extent 6"):
        run(kernel, x, 8)


def test_ap_offset_and_dtype_reinterpretation():
    x = np.arange(16, dtype=np.float32).reshape(2, 8)

    def kernel(x):
        t = nl.ndarray((2, 8), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        tail = t.ap([[8, 2], [2, 3]], offset=1)  # elements 1, 3, 5 of each partition
        bytes_ = t.ap([[32, 2], [1, 4]], dtype=nl.uint8)  # the 4 bytes of element 0
        o1 = nl.ndarray((2, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o1, src=tail)
        o2 = nl.ndarray((2, 4), nl.uint8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o2, src=bytes_)
        return o1, o2

    tail, raw = run(kernel, x)
    np.testing.assert_array_equal(tail, x[:, 1:7:2])
    np.testing.assert_array_equal(raw, x[:, 0:1].copy().view(np.uint8))


def test_reshape_and_permute_give_a_transposed_hbm_store(rng):
    x = rng.standard_normal((16, 4)).astype(np.float32)

    def kernel(x):
        t = nl.ndarray((16, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray((64,), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o.reshape((4, 16)).permute((1, 0)), src=t)
        return o

    np.testing.assert_array_equal(run(kernel, x), x.T.reshape(-1))


def test_reshape_rules():
    def kernel(x, shape):
        t = nl.ndarray((8, 2, 6), nl.float32)
        return (t.reshape(shape).shape,)

    assert shapes_of(kernel, np.zeros(1, np.float32), (8, 12)) == [(8, 12)]
    with pytest.raises(AssertionError, match="96 elements"):
        shapes_of(kernel, np.zeros(1, np.float32), (8, 13))
    with pytest.raises(AssertionError, match="partition dimension"):
        shapes_of(kernel, np.zeros(1, np.float32), (16, 6))


def test_view_methods():
    def kernel(x):
        t = nl.ndarray((8, 6, 4), nl.float32)
        return (
            t.permute((0, 2, 1)).shape,
            t[:, :, 0:1].broadcast(2, 5).shape,
            t.expand_dim(1).shape,
            t.expand_dim(1).squeeze_dim(1).shape,
            t.reshape_dim(1, (2, -1)).shape,
            t.flatten_dims(1, 2).shape,
            t.slice(1, 2, 6, 2).shape,
            t.select(2, 3).shape,
            t.view(nl.uint8).shape,
            t[:, :, 0:2].is_contiguous(),
            t.is_contiguous(),
            t.get_pattern(),
        )

    assert shapes_of(kernel, np.zeros(1, np.float32)) == [
        (8, 4, 6),
        (8, 6, 5),
        (8, 1, 6, 4),
        (8, 6, 4),
        (8, 2, 3, 4),
        (8, 24),
        (8, 2, 4),
        (8, 6),
        (8, 6, 16),
        False,
        True,
        [[24, 8], [4, 6], [1, 4]],
    ]


@pytest.mark.parametrize("method", ["permute", "broadcast", "expand_dim", "flatten_dims"])
def test_view_methods_keep_the_partition_dim(method):
    def kernel(x):
        t = nl.ndarray((1, 8), nl.float32)
        if method == "permute":
            view = t.permute((1, 0))
        elif method == "broadcast":
            view = t.broadcast(0, 4)
        elif method == "expand_dim":
            view = t.expand_dim(0)
        else:
            view = t.flatten_dims(0, 1)
        return (view.shape,)

    with pytest.raises(AssertionError, match="partition|start_dim must be > 0"):
        shapes_of(kernel, np.zeros(1, np.float32))


def test_tensors_have_no_arithmetic_operators():
    def kernel(x):
        t = nl.ndarray((4, 4), nl.float32)
        return (t + t,)

    with pytest.raises(TypeError, match="no arithmetic operators"):
        shapes_of(kernel, np.zeros(1, np.float32))


def test_string_buffer_names_are_rejected():
    def kernel(x):
        return (nl.ndarray((4, 4), nl.float32, buffer="sbuf").shape,)

    with pytest.raises(TypeError, match="buffer names as strings"):
        shapes_of(kernel, np.zeros(1, np.float32))


def test_fresh_memory_holds_nan_and_four():
    def kernel(x):
        f = nl.ndarray((4, 4), nl.float32)
        i = nl.ndarray((4, 4), nl.int32)
        of = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        oi = nl.ndarray((4, 4), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=of, src=f)
        nisa.dma_copy(dst=oi, src=i)
        return of, oi

    f, i = run(kernel, np.zeros(1, np.float32))
    assert np.isnan(f).all() and (i == 4).all()


def test_dtypes_compare_with_names_and_numpy():
    assert (
        nl.bfloat16 == "bfloat16"
        and nl.bfloat16 == BF16
        and str(nl.float8_e4m3fn) == ("float8_e4m3fn")
    )
    assert nl.float8_e4m3fn != nl.float8_e4m3 and nl.float32 != np.float16
    assert {nl.float32: 1}["float32"] == 1


def test_float8_e4m3fn_rounds_like_ml_dtypes(rng):
    x = rng.uniform(-500, 500, (16, 16)).astype(np.float32)

    def kernel(x):
        t = nl.ndarray(x.shape, nl.float8_e4m3fn)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=t)
        return o

    expected = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(run(kernel, x), expected)


@pytest.mark.parametrize("precise", ["1", "0"])
def test_precise_fp_switch(monkeypatch, precise):
    monkeypatch.setenv("NKI_PRECISE_FP", precise)
    x = np.full((2, 2), 1 + 2**-12, np.float32)  # not a bfloat16 value

    def kernel(x):
        t = nl.ndarray(x.shape, nl.bfloat16)
        nisa.dma_copy(dst=t, src=x)
        back = nl.ndarray(x.shape, nl.float32)
        nisa.tensor_copy(dst=back, src=t)
        o = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o, src=back)
        return o

    result = run(kernel, x)
    np.testing.assert_array_equal(result, 1.0 if precise == "1" else x)


# --- nl convenience functions ---
def test_nl_binary_unary_and_reductions(rng):
    a, b = (
        rng.standard_normal((32, 20)).astype(np.float32),
        rng.standard_normal((32, 20)).astype(np.float32),
    )

    def kernel(a, b):
        ta, tb = nl.load(a), nl.load(b)
        prod = nl.multiply(ta, tb)
        shifted = nl.add(prod, 2.0)
        e = nl.exp(nl.multiply(ta, 0.25))
        s = nl.sum(prod, axis=1)
        m = nl.mean(ta, axis=[1], keepdims=True)
        outs = []
        for t in (shifted, e, s, m):
            o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
            nl.store(o, value=t)
            outs.append(o)
        return tuple(outs)

    shifted, e, s, m = run(kernel, a, b)
    np.testing.assert_allclose(shifted, a * b + 2, rtol=1e-6)
    np.testing.assert_allclose(e, np.exp(a * 0.25), rtol=2e-6)
    np.testing.assert_allclose(s[:, 0], (a * b).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m[:, 0], a.mean(1), rtol=1e-5, atol=1e-6)


def test_nl_binary_ops_do_not_broadcast_mismatched_tiles(rng):
    def kernel(a):
        t = nl.load(a)
        return (nl.add(t, t[0:8, 0:2]).shape,)

    with pytest.raises(AssertionError, match="do not broadcast"):
        shapes_of(kernel, rng.standard_normal((8, 4)).astype(np.float32))


def test_nl_broadcast_to_expands_the_partition_dim(rng):
    row = rng.standard_normal((1, 12)).astype(np.float32)

    def kernel(row):
        t = nl.broadcast_to(nl.load(row), (16, 12))
        o = nl.ndarray((16, 12), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, value=t)
        return o

    np.testing.assert_array_equal(run(kernel, row), np.repeat(row, 16, axis=0))


def test_nl_matmul_transpose_x_and_transpose(rng):
    x, y = (
        rng.standard_normal((64, 32)).astype(np.float32),
        rng.standard_normal((64, 48)).astype(np.float32),
    )

    def kernel(x, y):
        r = nl.matmul(nl.load(x), nl.load(y), transpose_x=True)
        t = nl.transpose(nl.load(x))
        o1 = nl.ndarray(r.shape, nl.float32, buffer=nl.shared_hbm)
        o2 = nl.ndarray(t.shape, nl.float32, buffer=nl.shared_hbm)
        nl.store(o1, value=nl.copy(r))
        nl.store(o2, value=nl.copy(t))
        return o1, o2

    r, t = run(kernel, x, y)
    np.testing.assert_allclose(r, x.astype(np.float64).T @ y, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(t, x.T)


def test_nl_creation_and_shared_constant():
    const = np.arange(6, dtype=np.float32).reshape(2, 3)

    def kernel(x):
        z = nl.zeros((2, 3), nl.float32)
        f = nl.full((2, 3), 2.5, nl.float32)
        c = nl.load(nl.shared_constant(const))
        s = nl.add(nl.add(z, f), c)
        o = nl.ndarray((2, 3), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, value=s)
        return o

    np.testing.assert_array_equal(run(kernel, np.zeros(1, np.float32)), const + 2.5)


def test_tile_size_constants_follow_the_target(monkeypatch):
    assert nl.tile_size.pmax == 128 and nl.tile_size.psum_bank_fmax == 512
    assert nl.tile_size.sbuf_fmax_bytes == 212984
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    assert nl.tile_size.sbuf_fmax_bytes == 245752
    with pytest.warns(DeprecationWarning):
        assert nl.tile_size.psum_fmax == 512


def test_item_assignment_copies_with_a_cast_or_fills(rng):
    x = rng.standard_normal((8, 6)).astype(np.float32)

    def kernel(x):
        t = nl.ndarray((8, 6), nl.bfloat16)
        t[:, :] = x  # HBM -> SBUF: a DMA with a cast
        t[0:2, 0:3] = 5  # a fill
        o = nl.ndarray((8, 6), nl.float32, buffer=nl.shared_hbm)
        o[...] = t
        return o

    expected = x.astype(BF16).astype(np.float32)
    expected[0:2, 0:3] = 5
    np.testing.assert_array_equal(run(kernel, x), expected)
    assert [i.opcode for i in nki.last_trace()] == ["dma_copy", "memset", "dma_copy"]


def test_nl_where_var_all_and_load_transpose2d(rng):
    x = rng.standard_normal((16, 12)).astype(np.float32)
    cond = (rng.random((16, 12)) < 0.5).astype(np.float32)

    def kernel(x, cond):
        t = nl.load(x)
        results = (
            nl.where(nl.load(cond), t, 0.0),
            nl.var(t, axis=1),
            nl.all(nl.load(cond), axis=1),
            nl.load_transpose2d(x),
        )
        outs = []
        for r in results:
            o = nl.ndarray(r.shape, r.dtype, buffer=nl.shared_hbm)
            nl.store(o, value=r)
            outs.append(o)
        return tuple(outs)

    chosen, variance, every, transposed = run(kernel, x, cond)
    np.testing.assert_array_equal(chosen, np.where(cond != 0, x, 0))
    np.testing.assert_allclose(variance[:, 0], x.astype(np.float64).var(1), rtol=1e-5)
    np.testing.assert_array_equal(every[:, 0], cond.all(1))
    np.testing.assert_array_equal(transposed, x.T)


def test_base_tensor_is_the_whole_tensor_a_view_was_cut_from():
    """Not in the API reference; AWS's MX MoE reads ``weight.base_tensor.dtype`` of a kernel
    argument (core/moe/moe_tkg/gate_up_projection_mx.py L354)."""

    def kernel(x):
        t = nl.ndarray((4, 8), nl.bfloat16)
        return (x[1:2, 0:3].base_tensor.shape, t[0:2, 2:4].base_tensor.shape)

    assert shapes_of(kernel, np.zeros((3, 5), np.float32)) == [(3, 5), (4, 8)]
