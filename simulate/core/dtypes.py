"""NKI data types, NKI type promotion and the rounding applied when a value is written.

Every tile is stored in its declared dtype (``ml_dtypes`` for bfloat16 and fp8); arithmetic
runs in float32 and the result is rounded to nearest even on write, as the Vector and
Scalar engines do. ``tfloat32`` is stored as float32 with the mantissa rounded to 10 bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .errors import NKITypeError

float32 = np.dtype(np.float32)
float16 = np.dtype(np.float16)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
# The stubs make tfloat32 an opaque 4-byte type; we tag float32 so it can be told apart.
tfloat32 = np.dtype(np.float32, metadata={"nki": "tfloat32"})
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)  # IEEE-style FP8_EXP4 (max 240), not e4m3fn
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
# OCP FP8 types: only the NKI 0.6 docs list them (nki/api/nki.api.shared.rst@81ce03ae, L37
# and L39); the legacy dtype table (general/nki/api/nki.api.shared.rst@8a38e733) has neither,
# so :func:`as_dtype` (the legacy front-end's) rejects them; :data:`DIALECT_DTYPES` says who
# has what. They round through float32 (:func:`cast`) and promote by :func:`promote`.
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)
float8_e8m0fnu = np.dtype(ml_dtypes.float8_e8m0fnu)
OCP_FP8 = (float8_e4m3fn, float8_e8m0fnu)
# The packed MX types of the 0.6 docs ("4x packed elements, custom data type for
# nki.isa.nc_matmul_mx and nki.isa.quantize_mx on NeuronCore-v4",
# nki/api/nki.api.shared.rst@81ce03ae L49-53 and L268): one element holds four 8-bit
# (float8_e4m3fn / float8_e5m2, "32-bit data types", nki/api/nki/isa/__init__.py L2771-2772) or
# four 4-bit (float4_e2m1fn, 16 bits) values, the first in the lowest bits (AWS's unpacking,
# aws-neuron/nki-library@d2ad3a5 src/nkilib_src/nkilib/core/utils/mx_torch_common.py L69-131).
# Stored as their bits: an unsigned integer tagged with the NKI name (as tfloat32 is) so the
# simulator never computes on them; :data:`PACKED_ELEMENT` gives the unpacked type.
float8_e4m3fn_x4 = np.dtype(np.uint32, metadata={"nki": "float8_e4m3fn_x4"})
float8_e5m2_x4 = np.dtype(np.uint32, metadata={"nki": "float8_e5m2_x4"})
float4_e2m1fn_x4 = np.dtype(np.uint16, metadata={"nki": "float4_e2m1fn_x4"})
PACKED = (float8_e4m3fn_x4, float8_e5m2_x4, float4_e2m1fn_x4)
PACKED_ELEMENT = {
    "float8_e4m3fn_x4": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2_x4": np.dtype(ml_dtypes.float8_e5m2),
    "float4_e2m1fn_x4": np.dtype(ml_dtypes.float4_e2m1fn),
}
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
bool_ = np.dtype(np.bool_)

SUPPORTED = (
    float32,
    float16,
    bfloat16,
    tfloat32,
    float8_e4m3,
    float8_e5m2,
    int8,
    int16,
    int32,
    uint8,
    uint16,
    uint32,
    bool_,
)
# The dtypes each dialect's docs list (the legacy table, general/nki/api/nki.api.shared.rst
# @8a38e733, has neither the OCP nor the packed types)
DIALECT_DTYPES = {"legacy": SUPPORTED, "nki06": SUPPORTED + OCP_FP8 + PACKED}
# (exponent bits, mantissa bits): a float type holds another when it has at least as many of
# both; NKI widens to the smallest of these that holds both when neither holds the other
_FLOAT_FORMAT = {
    "float8_e4m3": (4, 3),
    "float8_e5m2": (5, 2),
    "bfloat16": (8, 7),
    "float16": (5, 10),
    "tfloat32": (8, 10),
    "float32": (8, 23),
}
_WIDENED_FLOATS = ("bfloat16", "float32")
_BY_NAME = {}
_CANONICAL = {}


def is_tf32(dtype) -> bool:
    """True for the simulator's tfloat32 tag."""
    md = getattr(dtype, "metadata", None)
    return bool(md) and md.get("nki") == "tfloat32"


def packed_name(dtype) -> str | None:
    """The NKI name of a packed MX dtype (``float8_e4m3fn_x4`` ...), else None."""
    md = getattr(dtype, "metadata", None)
    name = md.get("nki") if md else None
    return name if name in PACKED_ELEMENT else None


def pack_x4(values: np.ndarray, packed: str) -> np.ndarray:
    """Pack the last axis of ``values`` (already in the element type, a multiple of 4 long)
    into ``packed`` elements: four values per element, the first in the lowest bits. The
    result has the tagged dtype, so a kernel takes it as ``nl.<packed>``."""
    element = PACKED_ELEMENT[packed]
    bits = np.ascontiguousarray(np.asarray(values).astype(element)).view(np.uint8)
    if packed == "float4_e2m1fn_x4":
        nibbles = (bits & 0xF).astype(np.uint16).reshape(*bits.shape[:-1], -1, 4)
        packed_bits = nibbles[..., 0] | nibbles[..., 1] << 4 | nibbles[..., 2] << 8
        return (packed_bits | nibbles[..., 3] << 12).view(float4_e2m1fn_x4)
    return bits.view(float8_e4m3fn_x4 if packed == "float8_e4m3fn_x4" else float8_e5m2_x4)


def unpack_x4(bits: np.ndarray, packed: str) -> np.ndarray:
    """The values of ``packed`` elements as the element type, the last axis 4x longer."""
    element = PACKED_ELEMENT[packed]
    bits = np.ascontiguousarray(bits)
    if packed == "float4_e2m1fn_x4":
        raw = bits.view(np.uint16)
        nibbles = np.stack([(raw >> s) & 0xF for s in (0, 4, 8, 12)], axis=-1).astype(np.uint8)
        return nibbles.reshape(*raw.shape[:-1], -1).view(element)
    return bits.view(np.uint32).view(np.uint8).view(element)


def name(dtype) -> str:
    """The NKI name of a dtype (``bfloat16``, ``tfloat32``, ``float8_e4m3`` ...)."""
    dtype = as_dtype(dtype)
    if is_tf32(dtype):
        return "tfloat32"
    return dtype.name


def as_dtype(dtype, argname: str = "dtype") -> np.dtype:
    """Normalise an NKI or NumPy dtype spelling; reject dtypes the hardware lacks."""
    if isinstance(dtype, np.dtype):
        if dtype.metadata is not None and is_tf32(dtype):
            return tfloat32
        if dtype.metadata is not None and packed_name(dtype):
            raise NKITypeError(
                f"{argname}={packed_name(dtype)} is a packed MX type of the nki 0.6 front-end "
                "only; it is not supported here (view its bits as an unsigned integer)",
                "err_unsupported_dtype",
            )
        found = _CANONICAL.get(dtype)
        if found is not None:
            return found
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise NKITypeError(f"{argname}={dtype!r} is not a dtype", "err_unsupported_dtype") from exc
    found = _CANONICAL.get(dt)
    if found is None:
        raise NKITypeError(
            f"{argname}={dt} is not supported by NeuronCores; expected one of "
            + ", ".join(name(d) for d in SUPPORTED),
            "err_unsupported_dtype",
        )
    return found


for _d in SUPPORTED:
    if not is_tf32(_d):
        _CANONICAL[_d] = _d
    _BY_NAME["tfloat32" if is_tf32(_d) else _d.name] = _d
_FLOATS = frozenset((float32, float16, bfloat16, float8_e4m3, float8_e5m2))


def is_float(dtype) -> bool:
    return as_dtype(dtype) in _FLOATS


def is_int(dtype) -> bool:
    return as_dtype(dtype).kind in "iub"


def _holds(outer: str, inner: str) -> bool:
    (e1, m1), (e2, m2) = _FLOAT_FORMAT[outer], _FLOAT_FORMAT[inner]
    return e1 >= e2 and m1 >= m2


def _promote_float(a: np.dtype, b: np.dtype) -> np.dtype:
    na, nb = name(a), name(b)
    if _holds(na, nb):
        return a
    if _holds(nb, na):
        return b
    for wide in _WIDENED_FLOATS:  # fp16+bf16 -> fp32, fp8_e4m3+fp8_e5m2 -> bf16
        if _holds(wide, na) and _holds(wide, nb):
            return _BY_NAME[wide]
    return float32


def _promote_int(a: np.dtype, b: np.dtype) -> np.dtype:
    a = uint8 if a == bool_ else a
    b = uint8 if b == bool_ else b
    if a.kind == b.kind:
        return a if a.itemsize >= b.itemsize else b
    signed, unsigned = (a, b) if a.kind == "i" else (b, a)
    if signed.itemsize > unsigned.itemsize:
        return signed
    bits = 2 * unsigned.itemsize
    if bits > 4:
        return float32  # no 64-bit integers on the hardware: int32 + uint32 -> fp32
    return np.dtype(f"int{8 * bits}")


def is_ocp_fp8(dtype) -> bool:
    return isinstance(dtype, np.dtype) and any(dtype == d for d in OCP_FP8)


def promote(a, b) -> np.dtype:
    """NKI type promotion of two dtypes (SHARED "NKI Type Promotion"; not NumPy's rules).
    An OCP FP8 type (0.6 only; the 0.6 docs dropped the promotion page) with another type
    gives the other when it is a float wider than a byte, else bfloat16 (spec decision)."""
    if is_ocp_fp8(a) or is_ocp_fp8(b):
        other = b if is_ocp_fp8(a) else a
        return other if other.kind in "fV" and other.itemsize > 1 else bfloat16
    a, b = as_dtype(a), as_dtype(b)
    if a is b:
        return a
    fa, fb = is_float(a) or is_tf32(a), is_float(b) or is_tf32(b)
    if fa and fb:
        return _promote_float(a, b)
    if fa:
        return a
    if fb:
        return b
    return _promote_int(a, b)


def is_number(value) -> bool:
    """A scalar operand: a Python bool/int/float or a NumPy scalar (``np.float32(1.0)``,
    ``np.bool_(True)``; NumPy's bool is not an ``np.number``)."""
    return isinstance(value, (bool, int, float, np.number, np.bool_))


def weak_scalar_dtype(value) -> np.dtype:
    """Dtype of a scalar operand in promotion. Weakly typed scalars take the widest type the
    hardware has: bool->uint8, int->int32, float->fp32; 64-bit NumPy scalars (what NumPy
    arithmetic on Python numbers yields, e.g. ``1 / np.sqrt(n)``) count as weak too. Other
    NumPy scalars (``np.float16(2)``) keep their type."""
    if isinstance(value, (bool, np.bool_)):
        return uint8
    if isinstance(value, np.generic) and value.dtype.itemsize < 8:
        return as_dtype(value.dtype, "scalar")
    if isinstance(value, (int, np.integer)):
        return int32
    if isinstance(value, (float, np.floating)):
        return float32
    raise NKITypeError(f"{value!r} is not a number", "err_unsupported_dtype")


def _round_tf32(values: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    keep = np.uint32(0xFFFFE000)
    rounded = (bits + (np.uint32(0x0FFF) + ((bits >> 13) & np.uint32(1)))) & keep
    finite = np.isfinite(values)
    return np.where(finite, rounded.view(np.float32), values).astype(np.float32)


def cast(values, dtype) -> np.ndarray:
    """Round ``values`` into ``dtype`` as the engines do on write.

    Floats: round to nearest even (ml_dtypes / NumPy casts); tfloat32: 10-bit mantissa.
    Integers: round to nearest even and saturate to the type's range (hardware has no
    wrap-around on float->int conversion). Bool: non-zero is True. OCP FP8: through float32
    (ml_dtypes; out of range gives NaN: the types have no infinity).
    """
    if is_ocp_fp8(dtype):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.asarray(values).astype(np.float32).astype(dtype)
    dtype = as_dtype(dtype)
    values = np.asarray(values)
    if values.dtype == dtype and not is_tf32(dtype):
        return values
    if is_tf32(dtype):
        return _round_tf32(values.astype(np.float32))
    if dtype == bool_:
        return values != 0
    if dtype.kind in "iu":
        if values.dtype.kind in "iub":
            info = np.iinfo(dtype)
            return np.clip(values.astype(np.int64), info.min, info.max).astype(dtype)
        info = np.iinfo(dtype)
        v = np.rint(values.astype(np.float64))
        v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(v, info.min, info.max).astype(dtype)
    if (values.dtype.kind in "iubV" and dtype.itemsize < 4) or values.dtype.kind == "V":
        # through float32, which holds every integer up to 2**24 and every bf16 / fp8 value
        # exactly, so this adds no second rounding
        values = values.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow gives inf, as on the engines
        return values.astype(dtype)


def fill(data: np.ndarray, value) -> None:
    """``data[...] = value`` (cast to ``data``'s dtype), through an integer view of the bits
    for 1- and 2-byte types (NumPy's generic fill of ml_dtypes arrays is slow, and an
    uninitialised output can be large)."""
    bits = np.asarray(value).astype(data.dtype)
    if data.dtype.kind == "V" or data.dtype.itemsize < 4:
        unsigned = np.dtype(f"u{data.dtype.itemsize}")
        data.view(unsigned).fill(bits.view(unsigned))
    else:
        data.fill(bits)


def full(shape, value, dtype) -> np.ndarray:
    """``np.full`` that is fast for ml_dtypes types."""
    data = np.empty(shape, dtype=dtype)
    fill(data, value)
    return data


def compute(values) -> np.ndarray:
    """The float32 view an engine computes on (integers stay integers for bit ops)."""
    values = np.asarray(values)
    if values.dtype == np.float32:
        return values
    return values.astype(np.float32)


def uninitialised(dtype) -> float | int:
    """Value an uninitialised buffer holds in the simulator: NaN for floats, 4 for integers."""
    return np.nan if is_float(dtype) else 4


class _FloatLimits:
    def __init__(self, min_bits: int, dtype):
        self.dtype = dtype
        self.min = float(
            np.array([min_bits], np.uint32 if dtype == float32 else np.uint16).view(
                np.float32 if dtype == float32 else ml_dtypes.bfloat16
            )[0]
        )


fp32 = _FloatLimits(0xFF7FFFFF, float32)
bfp16 = _FloatLimits(0xFF80, bfloat16)
