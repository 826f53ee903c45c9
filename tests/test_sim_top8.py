"""Legacy ``neuronxcc.nki.isa.max8`` and ``nc_find_index8`` against NumPy (legacy ISA
reference, aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py L655-765)."""

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
