"""RMSNorm with OCP Microscaling (MXFP8) output, trn3 only: the NumPy launcher of
:mod:`nki_rmsnorm.kernels.nki06.rmsnorm_mx_quant` (which documents the math and the output
layout) and the decoding of its outputs.

``quant_dtype`` names the packed output type, as ``nki.language`` does: ``float8_e4m3fn_x4``
(MXFP8 E4M3, the default) or ``float8_e5m2_x4`` (MXFP8 E5M2). ``float4_e2m1fn_x4`` (MXFP4)
is an ``nc_matmul_mx`` input only: ``quantize_mx`` writes the fp8 types alone
(aws-neuron-sdk@81ce03ae ``nki/api/nki/isa/__init__.py`` L2767-2768).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from nki_rmsnorm import dialect, kernels
from nki_rmsnorm.ops import _QUANT_TILE_BYTES, _input_rows, _rows, target_nc_version
from nki_rmsnorm.validation import eps_value as _eps
from nki_rmsnorm.validation import parameter as _parameter

__all__ = [
    "MX_BLOCK",
    "MX_QUANT_DTYPES",
    "MX_SCALE_DTYPES",
    "MXQuantizedRMSNorm",
    "mx_dequantize",
    "rms_norm_mx_quant",
]

#: Values per scale: 32 consecutive values of a row (the OCP MX block).
MX_BLOCK = 32
#: Values of a row the kernel transposes at once (N must be a multiple of it).
MX_CHUNK = 512
#: The packed output types and the fp8 type of their four values.
MX_QUANT_DTYPES = {
    "float8_e4m3fn_x4": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2_x4": np.dtype(ml_dtypes.float8_e5m2),
}
#: The scale types: the OCP e8m0 (preferred) or its bytes as uint8 ("uint8 accepted for
#: backward compatibility", isa L2768-2769).
MX_SCALE_DTYPES = {
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "uint8": np.dtype(np.uint8),
}
#: quantize_mx and the x4 types exist on NeuronCore-v4 (trn3) only (isa L2744-2746).
_MX_NC_VERSION = 4


class MXQuantizedRMSNorm(NamedTuple):
    """What :func:`rms_norm_mx_quant` returns, over the M = prod(x.shape[:-1]) rows.

    ``y_q``: (N / 4, M) uint32, the bits of the packed output: element ``[k, m]`` holds
    ``y[m, 4k : 4k + 4]``, the first value in the lowest byte (the ``float8_*_x4`` layout
    ``nc_matmul_mx`` reads; :func:`mx_dequantize` decodes it). ``scales``: (N / 32, M) in
    float8_e8m0fnu (or uint8 bytes), ``[b, m]`` the scale 2^(byte − 127) of
    ``y[m, 32b : 32b + 32]`` (byte 0xFF: NaN). ``h``: x + residual in the residual's dtype,
    x's shape (None without a residual)."""

    y_q: np.ndarray
    scales: np.ndarray
    h: np.ndarray | None


def _name(value: Any, allowed: dict, argname: str) -> str:
    name = value if isinstance(value, str) else str(value).removeprefix("nl.")
    if name not in allowed:
        raise TypeError(f"{argname} must be one of {', '.join(allowed)}, got {value!r}")
    return name


def check_mx_target() -> None:
    """ValueError unless the kernels run in the 0.6 dialect on trn3 (NeuronCore-v4)."""
    if dialect.current() == dialect.LEGACY:
        raise ValueError(
            "MX quantization needs the NKI 0.6 kernel on trn3: the legacy NKI dialect has no "
            "packed x4 or e8m0 dtypes (aws-neuron-sdk@8a38e733 general/nki/api/nki.api.shared.rst)"
        )
    nc_version = target_nc_version()
    if nc_version is not None and nc_version != _MX_NC_VERSION:
        raise ValueError(
            f"MX quantization (nisa.quantize_mx) needs trn3 (NeuronCore-v4); this target is "
            f"NeuronCore-v{nc_version} (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py "
            "L2744-2746): use rms_norm_quant's fp8 formats there"
        )


def rms_norm_mx_quant(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual: np.ndarray | None = None,
    quant_dtype: Any = "float8_e4m3fn_x4",
    scale_dtype: Any = "float8_e8m0fnu",
) -> MXQuantizedRMSNorm:
    """RMSNorm over the last axis, MXFP8-quantized in the same pass (trn3).

    Args:
        x: float32, bfloat16 or float16 array of rank ≥ 1; its last dimension N a multiple
            of 512 (the kernel puts 512 values of a row on 128 partitions × 4 lanes).
        weight: ``(N,)`` in float32 or x's dtype, or None.
        eps: finite, ≥ 0.
        residual: x's shape, x's dtype or float32; ``h`` is returned in its dtype.
        quant_dtype: "float8_e4m3fn_x4" or "float8_e5m2_x4" (or the ``nl`` dtype).
        scale_dtype: "float8_e8m0fnu" or "uint8".

    Returns:
        :class:`MXQuantizedRMSNorm`.
    """
    x, residual = _input_rows(x, residual)
    n = x.shape[-1]
    weight = _parameter(weight, "weight", n, x.dtype)
    eps = _eps(eps)
    quant_name = _name(quant_dtype, MX_QUANT_DTYPES, "quant_dtype")
    scale_name = _name(scale_dtype, MX_SCALE_DTYPES, "scale_dtype")
    check_mx_target()
    if n % MX_CHUNK:
        raise ValueError(
            f"x's last dimension N={n} must be a multiple of {MX_CHUNK} for MX quantization "
            f"(blocks of {MX_BLOCK} values; the kernel transposes {MX_CHUNK} values of a row "
            "onto 128 partitions x 4 lanes)"
        )
    h_bytes = (residual if residual is not None else x).dtype.itemsize
    # x (and the residual and h), the discarded squares, y1, per partition of a row tile
    tile_bytes = n * (x.dtype.itemsize + (2 * h_bytes if residual is not None else 0) + 2 + 2)
    if tile_bytes > _QUANT_TILE_BYTES:
        raise ValueError(
            f"x's last dimension N={n} is too long for the MX kernel: a row tile needs "
            f"{tile_bytes} bytes per partition, at most {_QUANT_TILE_BYTES} fit"
        )
    lead = x.shape[:-1]
    rows = math.prod(lead)
    scale_type = MX_SCALE_DTYPES[scale_name]
    if rows == 0:
        return MXQuantizedRMSNorm(
            np.empty((n // 4, 0), np.uint32),
            np.empty((n // MX_BLOCK, 0), scale_type),
            None if residual is None else np.empty(x.shape, residual.dtype),
        )
    chosen = dialect.current()
    outputs = list(
        kernels.rmsnorm_mx_quant(
            _rows(x, rows, n),
            None if residual is None else _rows(residual, rows, n),
            weight,
            eps,
            kernels.nki_dtype(quant_name, chosen),
            kernels.nki_dtype(scale_name, chosen),
        )
    )
    y_q = np.ascontiguousarray(outputs[0]).view(np.uint32)
    scales = np.ascontiguousarray(outputs[1]).view(scale_type)
    h = outputs[2].reshape(x.shape) if residual is not None else None
    return MXQuantizedRMSNorm(y_q, scales, h)


def mx_unpack(y_q: np.ndarray, quant_dtype: Any = "float8_e4m3fn_x4") -> np.ndarray:
    """The (M, N) fp8 values of :func:`rms_norm_mx_quant`'s packed ``y_q`` (N / 4, M)."""
    element = MX_QUANT_DTYPES[_name(quant_dtype, MX_QUANT_DTYPES, "quant_dtype")]
    packed = np.ascontiguousarray(y_q).view(np.uint32)
    k, m = packed.shape
    values = packed.view(np.uint8).reshape(k, m, 4).transpose(1, 0, 2).reshape(m, 4 * k)
    return np.ascontiguousarray(values).view(element)


def mx_dequantize(
    y_q: np.ndarray, scales: np.ndarray, quant_dtype: Any = "float8_e4m3fn_x4"
) -> np.ndarray:
    """float64 (M, N) values of MX output: each fp8 value times its block's 2^(byte − 127)
    (byte 0xFF, the e8m0 NaN, gives NaN)."""
    values = mx_unpack(y_q, quant_dtype).astype(np.float64)
    scale_bytes = np.ascontiguousarray(scales).view(np.uint8).T.astype(np.int64)
    factor = np.where(scale_bytes == 0xFF, np.nan, np.ldexp(1.0, scale_bytes - 127))
    return values * np.repeat(factor, MX_BLOCK, axis=1)
