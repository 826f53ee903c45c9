"""Legacy ``neuronxcc.nki.isa`` instructions AWS's doc examples use: the top-8 family
(max8, nc_find_index8, nc_match_replace8), ``nc_stream_shuffle``, ``range_select``,
``sequence_bounds``, ``tensor_copy_predicated`` and ``select_reduce``, against NumPy
(legacy ISA reference, aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py)."""

from __future__ import annotations

import numpy as np
import pytest
from test_sim_isa import outputs_of

import simulate.isa as nisa
import simulate.language as nl


def test_max8_and_find_index8(rng):
    x = rng.standard_normal((32, 100)).astype(np.float32)

    def kernel(a):
        tile = nl.load(a)
        top = nisa.max8(src=tile)
        return top, nisa.nc_find_index8(data=tile, vals=top)

    top, index = outputs_of(kernel, x)
    order = np.argsort(-x, axis=1, kind="stable")[:, :8]
    np.testing.assert_array_equal(top, np.take_along_axis(x, order, axis=1))
    assert index.dtype == np.uint32
    np.testing.assert_array_equal(index, order)


def test_find_index8_uint16_and_missing_values():
    x = np.arange(16, dtype=np.float32)[None].repeat(4, axis=0)
    v = np.array([[3, 99, 0, 1, 2, 4, 5, 6]] * 4, np.float32)

    def kernel(a, b):
        return nisa.nc_find_index8(data=nl.load(a), vals=nl.load(b), dtype=nl.uint16)

    np.testing.assert_array_equal(outputs_of(kernel, x, v), [[3, 0xFFFF, 0, 1, 2, 4, 5, 6]] * 4)


def test_max8_needs_8_elements_per_partition():
    def kernel(a):
        return nisa.max8(src=nl.load(a))

    with pytest.raises(ValueError, match="8 to 16384"):
        outputs_of(kernel, np.zeros((4, 7), np.float32))


def test_match_replace8_replaces_and_indexes(rng):
    x = rng.standard_normal((16, 40)).astype(np.float32)

    def kernel(a):
        tile = nl.load(a)
        top = nisa.max8(src=tile)
        idx = nl.ndarray((16, 8), dtype=nl.uint32, buffer=nl.sbuf)
        replaced = nisa.nc_match_replace8(data=tile, vals=top, imm=-100.0, dst_idx=idx)
        return replaced, idx

    replaced, index = outputs_of(kernel, x)
    order = np.argsort(-x, axis=1, kind="stable")[:, :8]
    expected = x.copy()
    np.put_along_axis(expected, order, np.float32(-100.0), axis=1)
    np.testing.assert_array_equal(replaced, expected)
    np.testing.assert_array_equal(index, order)


def test_stream_shuffle_rotates_each_quadrant(rng):
    x = rng.standard_normal((64, 12)).astype(np.float32)
    order = [(i - 1) % 32 for i in range(32)]

    def kernel(a):
        src = nl.load(a)
        dst = nl.ndarray((64, 12), dtype=nl.float32)
        nisa.nc_stream_shuffle(src=src, dst=dst, shuffle_mask=order)
        return dst

    expected = np.concatenate([x[[q * 32 + k for k in order]] for q in range(2)])
    np.testing.assert_array_equal(outputs_of(kernel, x), expected)


def test_stream_shuffle_rejects_a_bad_mask():
    def kernel(a):
        src = nl.load(a)
        nisa.nc_stream_shuffle(src=src, dst=src, shuffle_mask=[40] * 32)
        return src

    with pytest.raises(ValueError, match="shuffle_mask"):
        outputs_of(kernel, np.zeros((32, 4), np.float32))


def test_range_select_window_and_chained_max(rng):
    x = rng.standard_normal((8, 32)).astype(np.float32)
    low = np.full((8, 1), 4, np.float32)
    high = rng.integers(5, 40, (8, 1)).astype(np.float32)

    def kernel(a, b0, b1):
        tile, lo, hi = nl.load(a), nl.load(b0), nl.load(b1)
        row_max = nl.ndarray((8, 1), dtype=nl.float32, buffer=nl.sbuf)
        first = nisa.range_select(
            on_true_tile=tile,
            comp_op0=np.greater_equal,
            comp_op1=np.less,
            bound0=lo,
            bound1=hi,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
            reduce_op=np.max,
            range_start=0,
        )
        nisa.range_select(
            on_true_tile=tile,
            comp_op0=np.greater_equal,
            comp_op1=np.less,
            bound0=lo,
            bound1=hi,
            reduce_cmd=nisa.reduce_cmd.reduce,
            reduce_res=row_max,
            reduce_op=np.max,
            range_start=3,
        )
        return first, row_max

    first, row_max = outputs_of(kernel, x, low, high, target="trn2")
    index = np.arange(32)[None, :]
    fmin = np.finfo(np.float32).min
    keep0 = (index >= low) & (index < high)
    keep3 = (index + 3 >= low) & (index + 3 < high)
    np.testing.assert_array_equal(first, np.where(keep0, x, fmin))
    expected = np.maximum(np.where(keep0, x, fmin).max(1), np.where(keep3, x, fmin).max(1))
    np.testing.assert_array_equal(row_max[:, 0], expected)


def test_range_select_needs_neuroncore_v3():
    def kernel(a):
        tile = nl.load(a)
        return nisa.range_select(
            on_true_tile=tile,
            comp_op0=np.less,
            comp_op1=np.less,
            bound0=tile[:, 0:1],
            bound1=tile[:, 0:1],
        )

    with pytest.raises(ValueError, match="NeuronCore-v3"):
        outputs_of(kernel, np.zeros((4, 8), np.float32), target="trn1")


def test_sequence_bounds_the_documented_example():
    """The example of the legacy test file (general/nki/test/test_nki_isa_sequence_bounds.py
    L23-L30): ids [0, 1, 1, 2, 2, 2, 0, 3, 3]."""
    ids = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], np.int32)

    def kernel(a):
        return nisa.sequence_bounds(segment_ids=nl.load(a))

    expected = [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]]
    np.testing.assert_array_equal(outputs_of(kernel, ids), expected)


def test_sequence_bounds_needs_one_partition():
    def kernel(a):
        return nisa.sequence_bounds(segment_ids=nl.load(a))

    with pytest.raises(ValueError, match="one partition"):
        outputs_of(kernel, np.ones((2, 8), np.int32))


@pytest.mark.parametrize("reverse, scalar", [(False, False), (True, False), (False, True)])
def test_tensor_copy_predicated(rng, reverse, scalar):
    src = rng.standard_normal((16, 24)).astype(np.float32)
    dst = rng.standard_normal((16, 24)).astype(np.float32)
    predicate = (rng.random((16, 24)) < 0.5).astype(np.uint8)

    def kernel(s, d, p):
        target = nl.load(d)
        nisa.tensor_copy_predicated(
            src=2.5 if scalar else nl.load(s),
            dst=target,
            predicate=nl.load(p),
            reverse_pred=reverse,
        )
        return target

    keep = (predicate != 0) != reverse
    expected = np.where(keep, np.float32(2.5) if scalar else src, dst)
    np.testing.assert_array_equal(outputs_of(kernel, src, dst, predicate), expected)


def test_tensor_copy_predicated_needs_an_unsigned_predicate():
    def kernel(s):
        tile = nl.load(s)
        nisa.tensor_copy_predicated(src=tile, dst=tile, predicate=tile)
        return tile

    with pytest.raises(TypeError, match="uint8, uint16 or uint32"):
        outputs_of(kernel, np.zeros((4, 8), np.float32))


def test_select_reduce_selects_and_accumulates_row_maxima(rng):
    x = rng.standard_normal((8, 16)).astype(np.float32)
    predicate = (rng.random((8, 16)) < 0.5).astype(np.uint8)
    fallback = rng.standard_normal((8, 1)).astype(np.float32)

    def kernel(a, p, f):
        on_true, pred, on_false = nl.load(a), nl.load(p), nl.load(f)
        dst = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
        row_max = nl.ndarray((8, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(
            dst=dst,
            predicate=pred,
            on_true=on_true,
            on_false=-50.0,
            reduce_cmd=nisa.reduce_cmd.reset_reduce,
        )
        nisa.select_reduce(
            dst=dst,
            predicate=pred,
            on_true=on_true,
            on_false=on_false,
            reverse_pred=True,
            reduce_cmd=nisa.reduce_cmd.reduce,
            reduce_res=row_max,
            reduce_op=np.max,
        )
        return dst, row_max

    selected, row_max = outputs_of(kernel, x, predicate, fallback)
    first = np.where(predicate != 0, x, np.float32(-50.0))
    second = np.where(predicate == 0, x, fallback)
    np.testing.assert_array_equal(selected, second)
    np.testing.assert_array_equal(row_max[:, 0], np.maximum(first.max(1), second.max(1)))
