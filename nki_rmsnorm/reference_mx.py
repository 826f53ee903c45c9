"""Float64 reference of the MX-quantized RMSNorm
(:mod:`nki_rmsnorm.kernels.nki06.rmsnorm_mx_quant` documents the math).

Everything is float64 and each rounding the kernel documents is one round-to-nearest-even
(:func:`nki_rmsnorm.reference.round_to`): y1 = h · rstd and y = y1 · w to bfloat16 (float16
for float16 x), then the MX quantization of ``nisa.quantize_mx`` as its ISA reference states
it (aws-neuron-sdk@81ce03ae ``nki/api/nki/isa/__init__.py`` L2790-2812): per block of 32
values X = 2^(⌊log2 max|y|⌋ − (E_max − 1)), 2⁻¹²⁷ for an all-zero block and never below it,
y_q = RNE(y / X); a block with an Inf or a NaN gets the NaN scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from nki_rmsnorm.reference import _residual_add, round_to

__all__ = ["MX_EMAX", "rms_norm_mx_quant"]

#: E_max of the element types (isa L2798-2799).
MX_EMAX = {"float8_e4m3fn_x4": 8, "float8_e5m2_x4": 15}
_ELEMENT = {
    "float8_e4m3fn_x4": ml_dtypes.float8_e4m3fn,
    "float8_e5m2_x4": ml_dtypes.float8_e5m2,
}
_RSQRT_MIN = 2.0**-87
_BLOCK = 32
_SCALE_MIN_EXPONENT = -127


def _mx_blocks(y, quant_dtype):
    """(scale exponents (M, N / 32) int, NaN-scale mask, y_q (M, N) in the element type)."""
    m, n = y.shape
    blocks = np.abs(y).reshape(m, n // _BLOCK, _BLOCK)
    with np.errstate(invalid="ignore"):
        amax = blocks.max(axis=2)
    special = ~np.isfinite(amax)
    safe = np.where(special | (amax == 0), 1.0, amax)
    _, frexp_exponent = np.frexp(safe)  # safe = f · 2^e with f in [0.5, 1)
    exponent = frexp_exponent - 1 - (MX_EMAX[quant_dtype] - 1)
    exponent = np.where(amax == 0, _SCALE_MIN_EXPONENT, np.maximum(exponent, _SCALE_MIN_EXPONENT))
    scaled = y / np.repeat(np.ldexp(1.0, exponent), _BLOCK, axis=1)
    scaled = np.where(np.repeat(special, _BLOCK, axis=1), np.nan, scaled)
    return exponent, special, scaled.astype(_ELEMENT[quant_dtype])


def rms_norm_mx_quant(x, weight=None, eps=1e-6, *, residual=None, quant_dtype="float8_e4m3fn_x4"):
    """Reference of :func:`nki_rmsnorm.mx.rms_norm_mx_quant` over x (..., N). Returns a dict:
    ``y`` (float64 values of the bf16/fp16 y the kernel quantizes, x's shape), ``y_q`` ((M, N)
    in the fp8 element type, row-major: the unpacked, untransposed kernel output),
    ``scale_bytes`` ((M, N / 32) uint8 e8m0 bytes), ``dequantized`` (float64 (M, N)) and ``h``
    (None without a residual)."""
    x = np.asarray(x)
    n = x.shape[-1]
    h = x if residual is None else _residual_add(x, residual)
    h64 = h.astype(np.float64).reshape(-1, n)
    y_dtype = np.float16 if x.dtype == np.float16 else ml_dtypes.bfloat16
    mean_sq = np.mean(h64 * h64, axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(np.maximum(mean_sq + eps, _RSQRT_MIN))
    with np.errstate(invalid="ignore"):  # Inf · 0 (an Inf row's rstd is 0) is NaN
        y = round_to(h64 * rstd, y_dtype)
    if weight is not None:
        y = round_to(y * np.asarray(weight).astype(np.float64), y_dtype)
    exponent, special, y_q = _mx_blocks(y, quant_dtype)
    scale_bytes = np.where(special, 0xFF, exponent + 127).astype(np.uint8)
    factor = np.where(special, np.nan, np.ldexp(1.0, exponent))
    with np.errstate(invalid="ignore"):  # NaN blocks stay NaN
        dequantized = y_q.astype(np.float64) * np.repeat(factor, _BLOCK, axis=1)
    return {
        "y": y.reshape(x.shape),
        "y_q": y_q,
        "scale_bytes": scale_bytes,
        "dequantized": dequantized,
        "h": None if residual is None else h,
    }
