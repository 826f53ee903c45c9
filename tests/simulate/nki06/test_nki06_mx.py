"""The OCP Microscaling (MX) support of the 0.6 front-end: the packed ``_x4`` dtypes
(aws-neuron-sdk@81ce03ae nki/api/nki.api.shared.rst L49-53, L268)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import simulate.nki06 as nki
from simulate.core import dtypes as core_dtypes
from simulate.nki06 import dtypes as nki_dtypes
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06.errors import NkiTypeError

PACKED_FP8 = ("float8_e4m3fn_x4", "float8_e5m2_x4")
PACKED = (*PACKED_FP8, "float4_e2m1fn_x4")
ELEMENT = {
    "float8_e4m3fn_x4": ml_dtypes.float8_e4m3fn,
    "float8_e5m2_x4": ml_dtypes.float8_e5m2,
    "float4_e2m1fn_x4": ml_dtypes.float4_e2m1fn,
}


@pytest.fixture
def target(monkeypatch):
    def use(name):
        monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", name)

    monkeypatch.delenv("NKI_PRECISE_FP", raising=False)
    return use


@pytest.mark.parametrize("name", PACKED)
def test_packed_dtypes_hold_four_values_first_in_the_lowest_bits(rng, name):
    element = np.dtype(ELEMENT[name])
    values = rng.uniform(-6, 6, (16, 32)).astype(element)
    packed = core_dtypes.pack_x4(values, name)
    assert packed.shape == (16, 8)
    assert packed.dtype.itemsize == (2 if name == "float4_e2m1fn_x4" else 4)
    bits = values.view(np.uint8).astype(np.uint32)
    width = 4 if name == "float4_e2m1fn_x4" else 8
    want = sum((bits[:, k::4] & ((1 << width) - 1)) << (width * k) for k in range(4))
    np.testing.assert_array_equal(packed.astype(np.uint32), want)
    back = core_dtypes.unpack_x4(packed, name)
    np.testing.assert_array_equal(back.view(np.uint8), values.view(np.uint8))
    assert getattr(nl, name) == name and str(getattr(nl, name)) == name
    assert getattr(nl, name).itemsize == packed.dtype.itemsize
    plain = np.dtype(np.uint16 if name == "float4_e2m1fn_x4" else np.uint32)
    assert getattr(nl, name) != plain and nki_dtypes.as_dtype(packed.dtype) is getattr(nl, name)


@pytest.mark.parametrize("name", PACKED)
def test_packed_dtypes_move_as_bits_and_are_not_computed_on(rng, target, name):
    target("trn3")
    dtype = getattr(nl, name)
    bits = rng.integers(0, 1 << (8 * dtype.itemsize), (32, 16)).astype(dtype.numpy)

    @nki.jit
    def copy(x):
        tile = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        again = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=again, src=tile)
        out = nl.ndarray(x.shape, dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=again)
        return out

    out = copy(bits)
    assert nl.float32 != out.dtype and getattr(nl, name) == out.dtype
    np.testing.assert_array_equal(out.view(bits.dtype.str), bits.view(bits.dtype.str))

    @nki.jit
    def convert(x):
        tile = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        return tile

    with pytest.raises(NkiTypeError, match="moves as its bits only"):
        convert(bits)

    @nki.jit
    def arithmetic(x):
        tile = nl.ndarray(x.shape, dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=out, data=tile, op0=nl.multiply, operand0=2.0)
        return out

    with pytest.raises(NkiTypeError, match="four packed values per element"):
        arithmetic(bits)
