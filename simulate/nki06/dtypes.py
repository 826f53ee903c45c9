"""NKI 0.6 dtypes: one object per dtype that is the NKI name (the stubs type dtypes as
``str``, ``nki/api/nki/language/__init__.py@81ce03ae``) and also compares equal to the
NumPy / ml_dtypes dtype the simulator stores it as.

Rounding on write and promotion are the core's (:func:`simulate.core.dtypes.cast`: round to
nearest even, float->int saturating, tfloat32 10-bit mantissa, the OCP FP8 types
``float8_e4m3fn`` / ``float8_e8m0fnu`` through float32), and so is the list of dtypes the
0.6 docs name (:data:`simulate.core.dtypes.DIALECT_DTYPES`).

``NKI_PRECISE_FP=0`` (aws-neuron-sdk ``nki/guides/nki_simulator.rst``, "Precise
Floating-Point Mode") stores every low-precision float tensor as float32, so nothing rounds.
"""

from __future__ import annotations

import os

import numpy as np

from simulate.core import dtypes as core

from . import release
from .context import language_check_enabled
from .errors import NkiTypeError


class NkiDtype(str):
    """An NKI dtype: ``str(d)`` is its NKI name, ``d.numpy`` the NumPy dtype it stores as."""

    numpy: np.dtype

    def __new__(cls, name: str, numpy_dtype):
        obj = super().__new__(cls, name)
        obj.numpy = np.dtype(numpy_dtype) if not isinstance(numpy_dtype, np.dtype) else numpy_dtype
        return obj

    def __eq__(self, other):
        if isinstance(other, str):
            return str.__eq__(self, other)
        try:
            return as_dtype(other) is self
        except (TypeError, NkiTypeError):
            return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = str.__hash__

    def __repr__(self):
        return f"nl.{str.__str__(self)}"

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize


float32 = NkiDtype("float32", core.float32)
float16 = NkiDtype("float16", core.float16)
bfloat16 = NkiDtype("bfloat16", core.bfloat16)
tfloat32 = NkiDtype("tfloat32", core.tfloat32)
float8_e4m3 = NkiDtype("float8_e4m3", core.float8_e4m3)
float8_e4m3fn = NkiDtype("float8_e4m3fn", core.float8_e4m3fn)
float8_e5m2 = NkiDtype("float8_e5m2", core.float8_e5m2)
float8_e8m0fnu = NkiDtype("float8_e8m0fnu", core.float8_e8m0fnu)
float8_e4m3fn_x4 = NkiDtype("float8_e4m3fn_x4", core.float8_e4m3fn_x4)
float8_e5m2_x4 = NkiDtype("float8_e5m2_x4", core.float8_e5m2_x4)
float4_e2m1fn_x4 = NkiDtype("float4_e2m1fn_x4", core.float4_e2m1fn_x4)
int8 = NkiDtype("int8", core.int8)
int16 = NkiDtype("int16", core.int16)
int32 = NkiDtype("int32", core.int32)
uint8 = NkiDtype("uint8", core.uint8)
uint16 = NkiDtype("uint16", core.uint16)
uint32 = NkiDtype("uint32", core.uint32)
bool_ = NkiDtype("bool_", core.bool_)

ALL = (
    float32,
    float16,
    bfloat16,
    tfloat32,
    float8_e4m3,
    float8_e4m3fn,
    float8_e5m2,
    float8_e8m0fnu,
    float8_e4m3fn_x4,
    float8_e5m2_x4,
    float4_e2m1fn_x4,
    int8,
    int16,
    int32,
    uint8,
    uint16,
    uint32,
    bool_,
)
#: the packed MX types (core.PACKED): bits only, never computed on
PACKED = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
_BY_NAME = {str.__str__(d): d for d in ALL}
_BY_NAME["bool"] = bool_
# the packed types store as tagged unsigned integers, found by their tag (as_dtype)
_BY_NUMPY = {d.numpy: d for d in ALL if d is not tfloat32 and d not in PACKED}
assert {d.numpy for d in ALL} == set(core.DIALECT_DTYPES["nki06"])  # one list, in the core
_LOW_PRECISION = frozenset(
    (float16, bfloat16, tfloat32, float8_e4m3, float8_e4m3fn, float8_e5m2, float8_e8m0fnu)
)


def as_dtype(dtype, argname: str = "dtype") -> NkiDtype:
    """The :class:`NkiDtype` of an NKI, NumPy, ml_dtypes, torch or JAX dtype (or its name)."""
    if isinstance(dtype, NkiDtype):
        return dtype
    if isinstance(dtype, str):
        found = _BY_NAME.get(dtype)
        if found is not None:
            return found
    if isinstance(dtype, np.dtype) and core.is_tf32(dtype):
        return tfloat32
    if isinstance(dtype, np.dtype) and core.packed_name(dtype):
        return _BY_NAME[core.packed_name(dtype)]
    text = str(dtype)
    if text.startswith("torch."):  # torch dtypes spell the NumPy names
        found = _BY_NAME.get({"torch.bool": "bool_"}.get(text, text[6:]))
        if found is not None:
            return found
    try:
        found = _BY_NUMPY.get(np.dtype(dtype))
    except TypeError:
        found = None
    if found is None:
        raise NkiTypeError(
            f"{argname}={dtype!r} is not an NKI dtype; expected one of " + ", ".join(map(str, ALL))
        )
    return found


def kernel_dtype(dtype, argname: str = "dtype") -> NkiDtype:
    """A ``dtype`` argument of an ``nl``/tensor API called from kernel code: "Almost all of the
    NKI APIs accept a data type field, `dtype`, which must be a `nki.language` data type"
    (aws-neuron-sdk@81ce03ae ``nki/api/nki.api.shared.rst`` L11–12). An ``nl`` dtype, or its
    name (the 0.6 stubs type dtypes as ``str``); a NumPy, ml_dtypes or torch dtype is an
    error (unless ``NKI_SIM_LANGUAGE_CHECK=0``)."""
    if dtype is float8_e8m0fnu:
        release.require("nl.float8_e8m0fnu", from_kernel_only=False)
    if isinstance(dtype, NkiDtype):
        return dtype
    if type(dtype) is not str and language_check_enabled():
        raise NkiTypeError(
            f"{argname}={dtype!r} is not an nki.language dtype (use nl.float32, nl.bfloat16, "
            '...): the dtype field "must be a `nki.language` data type" '
            "(aws-neuron-sdk@81ce03ae nki/api/nki.api.shared.rst L11-12)"
        )
    return as_dtype(dtype, argname)


def precise_fp() -> bool:
    """``NKI_PRECISE_FP`` (default 1 since NKI 0.4, RN 0.4): store low precision for real."""
    return os.environ.get("NKI_PRECISE_FP", "1").strip() not in ("0", "false", "False")


def storage_dtype(dtype: NkiDtype) -> np.dtype:
    """What a tensor of ``dtype`` is stored as in this run (float32 without precise FP)."""
    if dtype in _LOW_PRECISION and not precise_fp():
        return core.float32
    return core.tfloat32 if dtype is tfloat32 else dtype.numpy


def cast(values, dtype: NkiDtype, stored_as: np.dtype | None = None) -> np.ndarray:
    """``values`` rounded into ``dtype`` as the engines write it, in the storage type. A
    packed MX type takes bits only (integers of its width: a copy, a DMA, ``memset``, the
    simulator's fill); only ``quantize_mx`` makes such bits from values."""
    if dtype in PACKED:
        return _packed_bits(values, dtype)
    stored_as = storage_dtype(dtype) if stored_as is None else stored_as
    if stored_as == core.float32 and not core.is_tf32(stored_as):
        return core.cast(values, core.float32)
    return core.cast(values, stored_as)


def _packed_bits(values, dtype: NkiDtype) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind not in "iu" or (values.ndim and values.dtype.itemsize != dtype.itemsize):
        raise NkiTypeError(
            f"{dtype} holds four packed values per element: only their bits can be written "
            f"(a same-dtype copy or DMA, or nisa.quantize_mx), got {values.dtype} values "
            "(aws-neuron-sdk@81ce03ae nki/api/nki.api.shared.rst L49-53, L268)"
        )
    mask = (1 << (8 * dtype.itemsize)) - 1
    return (values.astype(np.int64) & mask).astype(dtype.numpy)


def is_float(dtype) -> bool:
    return as_dtype(dtype) not in (int8, int16, int32, uint8, uint16, uint32, bool_)


def is_int(dtype) -> bool:
    return not is_float(dtype)


def promote(a, b) -> NkiDtype:
    """Result dtype of an ``nl.*`` binary op: the legacy NKI promotion table (spec decision,
    0.6 dropped the promotion page); OCP fp8 types promote like ``float8_e4m3``."""
    a, b = as_dtype(a), as_dtype(b)
    if a is b:
        return a
    return _BY_NUMPY.get(
        core.promote(
            a.numpy if a is not tfloat32 else core.tfloat32,
            b.numpy if b is not tfloat32 else core.tfloat32,
        ),
        float32,
    )


def uninitialised(dtype: NkiDtype):
    """Fresh memory: NaN for floats, 4 for integers (SIM "How It Works"); all bits set in a
    packed MX type (four NaNs of the fp8 types; -6.0 four times in float4_e2m1fn, which has
    no NaN)."""
    if as_dtype(dtype) in PACKED:
        return (1 << (8 * dtype.itemsize)) - 1
    return np.nan if is_float(dtype) else 4
