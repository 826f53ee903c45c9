"""Float64 NumPy reference implementations of RMSNorm (forward and backward).

These are the ground truth the kernels, launchers and framework bindings are tested against.
They follow the contract in ``docs/design.md``; everything is computed in float64 and rounded only
where the chosen ``casting_mode`` says a real implementation rounds.

Forward, normalising over the last axis (any number of leading dimensions)::

    h    = x + residual                             (if a residual is given)
    rstd = 1 / sqrt(mean(h², axis=-1) + eps)
    y    = h · rstd · (weight + offset) + bias

Conventions fixed here:

* The residual sum is computed in fp32 (float64 if either operand is float64), as a kernel
  adds, and rounded once to the residual's dtype, because ``h`` is written out in that
  dtype. The normalisation then uses the *rounded* ``h``, as a kernel that stores ``h`` and
  normalises that same value does, so ``y`` is consistent with the ``h`` handed back.
* ``rstd`` is computed in float64 from ``h``; ``y`` uses that float64 value, while the
  ``rstd`` returned for the backward pass is rounded to float32.
* ``weight=None`` means no scale at all (``y = h·rstd + bias``): ``offset`` shifts a given
  weight and is ignored without one.
* ``eps=0`` with an all-zero row gives ``rstd = inf`` and ``y = 0·inf = NaN`` for that row,
  as the hardware would. A NaN in a row makes only that row (and its ``rstd``) NaN in the
  forward pass; the backward ``dweight``/``dbias`` sum over rows and so pick the NaN up.
* Rounding is round-to-nearest-even, applied in one step from float64 (see :func:`round_to`).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "CASTING_MODES",
    "rms_norm",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "rms_norm_quant",
    "round_to",
    "ulp_distance",
]

#: "gemma": fp32 throughout, one rounding at the end (HF GemmaRMSNorm).
#: "llama": h·rstd rounded to the input dtype, then multiplied by the weight (HF LlamaRMSNorm).
#: "none": every operation in the input dtype.
CASTING_MODES = ("gemma", "llama", "none")


# ---------------------------------------------------------------------------------------------
# Rounding helpers
# ---------------------------------------------------------------------------------------------


#: Elements per block of :func:`_f32_round_to_odd`: the temporaries of a block stay in the CPU
#: cache, where whole-array temporaries of a large tensor (hundreds of MB each) make the
#: rounding memory-bound (measured: 8x slower on a 4096x8192 float64 array).
_ROUNDING_BLOCK = 1 << 14


def _f32_round_to_odd(x64: np.ndarray) -> np.ndarray:
    """Round float64 to float32 with round-to-odd (truncate, then set the last bit if inexact).

    Round-to-odd to a format with at least two more significand bits than the target makes
    the second rounding (float32 → target, to nearest even) equal to a single correct
    rounding of the float64 value. Elementwise, so computed block by block.
    """
    x64 = np.asarray(x64, np.float64)
    out = np.empty(x64.shape, np.float32)
    flat_in, flat_out = x64.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.size, _ROUNDING_BLOCK):
        block = slice(start, start + _ROUNDING_BLOCK)
        flat_out[block] = _f32_round_to_odd_block(flat_in[block])
    return out


def _f32_round_to_odd_block(x64: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond the float32 range: inf, stepped back below
        r = x64.astype(np.float32)  # to nearest even; only the inexact cases get fixed up
    r64 = r.astype(np.float64)
    finite = np.isfinite(x64)
    inexact = finite & (r64 != x64)
    # Where nearest-even rounded away from zero (including overflow to inf), step back
    # towards zero to get the truncated value.
    away = inexact & (np.abs(r64) > np.abs(x64))
    r = np.where(away, np.nextafter(r, np.float32(0)), r)
    bits = r.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32)


def _cast(x64, dtype) -> np.ndarray:
    """Round a float64 array to ``dtype`` once, to nearest even; return it in ``dtype``.

    NumPy rounds float64 → float32/float16 correctly, but ml_dtypes converts float64 →
    bfloat16 through float32, a double rounding that is wrong in rare near-tie cases
    (1 + 2⁻⁸ + 2⁻⁴⁰ becomes 1 instead of 1 + 2⁻⁷). Narrow types therefore go through a
    round-to-odd float32 intermediate, which makes the two steps one correct rounding.
    """
    dtype = np.dtype(dtype)
    x64 = np.asarray(x64, dtype=np.float64)
    if dtype.itemsize < 4:
        return _f32_round_to_odd(x64).astype(dtype)
    return x64.astype(dtype)


def round_to(x, dtype) -> np.ndarray:
    """``x`` rounded (once, to nearest even) to ``dtype`` and returned as float64."""
    return _cast(x, dtype).astype(np.float64)


def ulp_distance(a, b, dtype) -> np.ndarray:
    """Units in the last place of ``dtype`` between ``a`` and ``b`` (elementwise, int64).

    Both are rounded to ``dtype`` first (see :func:`round_to`). Bit patterns are mapped to an
    ordered integer line: the magnitude bits count up from ±0 on either side, so +0 and -0
    are 0 apart, adjacent values 1 apart, the smallest positive and negative subnormals 2
    apart, and the largest finite value 1 from infinity. Two NaNs are 0 apart; a NaN and a
    number are ``int64.max`` apart (float64 distances beyond that saturate too).
    """
    dtype = np.dtype(dtype)
    uint = np.dtype(f"u{dtype.itemsize}")
    a_c, b_c = _cast(a, dtype), _cast(b, dtype)
    a_bits = a_c.view(uint).astype(np.uint64)
    b_bits = b_c.view(uint).astype(np.uint64)
    sign = np.uint64(1 << (8 * dtype.itemsize - 1))
    a_mag, b_mag = a_bits & ~sign, b_bits & ~sign
    same_side = (a_bits & sign) == (b_bits & sign)
    # Same sign: difference of magnitudes. Opposite signs: the path goes through zero.
    diff = np.maximum(a_mag, b_mag) - np.minimum(a_mag, b_mag)
    dist = np.where(same_side, diff, a_mag + b_mag)
    imax = np.iinfo(np.int64).max
    dist = np.minimum(dist, np.uint64(imax)).astype(np.int64)
    a_nan = np.isnan(a_c.astype(np.float64))
    b_nan = np.isnan(b_c.astype(np.float64))
    return np.where(a_nan & b_nan, 0, np.where(a_nan | b_nan, imax, dist))


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------


def _f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def _check_mode(casting_mode: str) -> None:
    if casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")


def _residual_add(x: np.ndarray, residual) -> np.ndarray:
    """``h = x + residual`` added in fp32 (float64 for float64 operands), rounded to the
    residual's dtype once, as a kernel that adds in fp32 and stores ``h`` does."""
    residual = np.asarray(residual)
    acc = np.float64 if max(x.dtype.itemsize, residual.dtype.itemsize) >= 8 else np.float32
    return _cast(x.astype(acc) + residual.astype(acc), residual.dtype)


def _forward(x, weight, eps, offset, bias, residual, casting_mode, out_dtype):
    _check_mode(casting_mode)
    x = np.asarray(x)
    in_dtype = x.dtype
    out_dtype = in_dtype if out_dtype is None else np.dtype(out_dtype)

    h = None if residual is None else _residual_add(x, residual)
    h64 = _f64(x if h is None else h)

    # divide: eps=0 on a zero row (rstd=inf); invalid: 0·inf in that row. Both are documented
    # outcomes, not accidents, so they should not warn.
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        rstd64 = 1.0 / np.sqrt(np.mean(h64 * h64, axis=-1, keepdims=True) + float(eps))
        xhat = h64 * rstd64
        scale = None if weight is None else _f64(weight) + float(offset)
        b = None if bias is None else _f64(bias)

        if casting_mode == "gemma":
            y64 = xhat if scale is None else xhat * scale
            if b is not None:
                y64 = y64 + b
        elif casting_mode == "llama":
            # Only the normalised value is rounded (to the input dtype); the weight multiply
            # and the bias add are exact here, rounded once at the end.
            y64 = round_to(xhat, in_dtype)
            if scale is not None:
                y64 = y64 * scale
            if b is not None:
                y64 = y64 + b
        else:  # "none": every operand and every result rounded to the input dtype
            y64 = round_to(xhat, in_dtype)
            if scale is not None:
                y64 = round_to(y64 * round_to(scale, in_dtype), in_dtype)
            if b is not None:
                y64 = round_to(y64 + round_to(b, in_dtype), in_dtype)

    y = _cast(y64, out_dtype)
    rstd = rstd64[..., 0].astype(np.float32)
    return y, h, rstd


def rms_norm_fwd(
    x,
    weight=None,
    eps=1e-6,
    *,
    offset=0.0,
    bias=None,
    residual=None,
    casting_mode="gemma",
    out_dtype=None,
):
    """RMSNorm forward pass that also returns what the backward pass needs.

    ``y = h·rstd·(weight + offset) + bias`` with ``h = x (+ residual)`` and
    ``rstd = 1/sqrt(mean(h², axis=-1) + eps)``, normalising over the last axis.

    Args:
        x: input, any rank ≥ 1 (float32, float16, bfloat16 or float64).
        weight: scale of shape ``(H,)`` (float32 or the input dtype), or None for no scale.
        eps: added to the mean square.
        offset: added to the weight (Gemma's ``1 + w``); ignored when ``weight`` is None.
        bias: added after scaling, shape ``(H,)``, or None.
        residual: added to ``x`` first; ``h`` is returned, rounded to the residual's dtype,
            and the normalisation uses that rounded ``h``.
        casting_mode: "gemma" (float64 throughout, one rounding at the end), "llama"
            (``h·rstd`` rounded to the input dtype, then multiplied by ``weight + offset`` and
            biased exactly, rounded at the end) or "none" (every operand and intermediate
            rounded to the input dtype).
        out_dtype: dtype of ``y``; defaults to ``x.dtype``.

    Returns:
        ``(y, rstd)``, or ``(y, h, rstd)`` when ``residual`` is given. ``rstd`` is float32 of
        shape ``x.shape[:-1]``.
    """
    y, h, rstd = _forward(x, weight, eps, offset, bias, residual, casting_mode, out_dtype)
    return (y, rstd) if h is None else (y, h, rstd)


def rms_norm(
    x,
    weight=None,
    eps=1e-6,
    *,
    offset=0.0,
    bias=None,
    residual=None,
    casting_mode="gemma",
    out_dtype=None,
):
    """RMSNorm forward pass: ``y``, or ``(y, h)`` when ``residual`` is given.

    Same arguments and semantics as :func:`rms_norm_fwd`, without ``rstd``.
    """
    y, h, _ = _forward(x, weight, eps, offset, bias, residual, casting_mode, out_dtype)
    return y if h is None else (y, h)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------


def rms_norm_bwd(
    dy,
    x_or_h,
    weight,
    rstd,
    *,
    offset=0.0,
    has_bias=False,
    dh_out=None,
    casting_mode="gemma",
):
    """RMSNorm backward pass from the saved ``rstd``.

    With ``x̂ = h·rstd`` (``rstd`` as saved, float32, upcast) and ``g = dy·(weight + offset)``
    (``g = dy`` without a weight), per row of length ``H``::

        dx      = rstd · (g − x̂ · mean(g·x̂)) + dh_out
        dweight = Σ_rows dy · x̂
        dbias   = Σ_rows dy

    where ``Σ_rows`` sums over all leading dimensions. ``dh_out`` is the gradient flowing into
    the residual output ``h``; ``dx`` is then the gradient of both ``x`` and ``residual``.

    In "llama" and "none" modes the forward pass multiplied the weight by ``x̂`` *rounded to
    the input dtype*, so ``dweight = Σ_rows dy · round(x̂)``: the exact derivative of that
    forward. The rounding itself is treated as the identity for ``dx`` (straight-through),
    so ``dx`` is the same in every mode.

    Args:
        dy: gradient of ``y``, shape of ``x``.
        x_or_h: the normalised input: ``x``, or ``h`` when a residual was added.
        weight: the forward's weight, or None.
        rstd: the forward's ``rstd`` (shape ``x.shape[:-1]``).
        offset: the forward's weight offset.
        has_bias: whether the forward added a bias (then ``dbias`` is returned).
        dh_out: gradient of the ``h`` output, or None.
        casting_mode: the forward's casting mode.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` in ``x_or_h``'s dtype; ``dweight`` in the weight's
        dtype, None without a weight; ``dbias`` in the weight's dtype (float32 without a
        weight), None unless ``has_bias``. All computed in float64 and rounded once.
    """
    _check_mode(casting_mode)
    x_or_h = np.asarray(x_or_h)
    in_dtype = x_or_h.dtype
    hidden = x_or_h.shape[-1]
    dy64 = _f64(dy)

    with np.errstate(invalid="ignore", over="ignore"):
        xhat = _f64(x_or_h) * _f64(rstd)[..., None]
        g = dy64 if weight is None else dy64 * (_f64(weight) + float(offset))
        dx64 = _f64(rstd)[..., None] * (g - xhat * np.mean(g * xhat, axis=-1, keepdims=True))
        if dh_out is not None:
            dx64 = dx64 + _f64(dh_out)

        dweight = dbias = None
        param_dtype = np.float32 if weight is None else np.asarray(weight).dtype
        if weight is not None:
            xhat_w = xhat if casting_mode == "gemma" else round_to(xhat, in_dtype)
            dweight = _cast((dy64 * xhat_w).reshape(-1, hidden).sum(axis=0), param_dtype)
        if has_bias:
            dbias = _cast(dy64.reshape(-1, hidden).sum(axis=0), param_dtype)

    return _cast(dx64, in_dtype), dweight, dbias


# ---------------------------------------------------------------------------------------------
# Quantized forward
# ---------------------------------------------------------------------------------------------

#: Largest finite value of each fp8 output dtype.
FP8_MAX = {"float8_e4m3": 240.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: The least ``mean(h²) + eps`` the quantized kernel takes the rsqrt of (an all-zero row
#: with eps = 0 keeps a finite rstd).
_RSQRT_MIN = 2.0**-87


def rms_norm_quant(
    x,
    weight=None,
    eps=1e-6,
    *,
    residual=None,
    quant_dtype="float8_e4m3",
    scale_mode="row",
    block=128,
    static_scale=None,
    lower_bound=None,
    scale_floor=1e-6,
    tile_rows=128,
) -> dict:
    """Float64 reference of the quantized forward
    (:mod:`nki_rmsnorm.kernels.nki06.rmsnorm_quant` documents the math).

    ``1 / fp8_max`` is taken in float32, as the kernel multiplies by it; everything else is
    float64, and ``y_q`` is one round-to-nearest-even of ``q``. Returns a dict: ``q`` (the
    float64 value before the fp8 rounding), ``y_q`` (in the fp8 dtype), ``scales`` (float64:
    per row ``lead``, per block ``lead + (N // block,)``, None for static), ``y``, ``h``
    (None without a residual), ``amax`` (max |y| per row), and the transposed output over
    the M = prod(lead) rows: ``q_t`` / ``y_q_t`` (N, M) and ``scales_t`` (N, ⌈M / tile_rows⌉,
    one per column of y and ``tile_rows``-row tile; None for static).
    """
    x = np.asarray(x)
    h = x if residual is None else _residual_add(x, residual)
    h64 = _f64(h)
    mean_sq = np.mean(h64 * h64, axis=-1, keepdims=True) + eps
    rstd = 1.0 / np.sqrt(np.maximum(mean_sq, _RSQRT_MIN))
    p = h64 if weight is None else h64 * _f64(weight)
    y = p * rstd
    fp8 = np.dtype(getattr(ml_dtypes, quant_dtype))
    fp8_max = FP8_MAX[quant_dtype]
    inverse_max = float(np.float32(1.0) / np.float32(fp8_max))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        amax = np.max(np.abs(y), axis=-1)
        if scale_mode == "static":
            scales = None
            q = np.clip(y / float(np.asarray(static_scale).reshape(())), -fp8_max, fp8_max)
        else:
            groups = y if scale_mode == "row" else y.reshape(y.shape[:-1] + (-1, block))
            group_max = np.max(np.abs(groups), axis=-1, keepdims=True)
            capped = group_max if lower_bound is None else np.minimum(group_max, lower_bound)
            scale = np.maximum(capped * inverse_max, scale_floor)
            clipped = groups if lower_bound is None else np.clip(groups, -lower_bound, lower_bound)
            q = (clipped / scale).reshape(y.shape)
            scales = scale[..., 0]
        q_t, scales_t = _quant_transposed(
            y.reshape(-1, y.shape[-1]).T,
            scale_mode,
            static_scale,
            lower_bound,
            scale_floor,
            fp8_max,
            inverse_max,
            tile_rows,
        )
    return {
        "q": q,
        "y_q": _cast(q, fp8),
        "scales": scales,
        "y": y,
        "h": None if residual is None else h,
        "amax": amax,
        "q_t": q_t,
        "y_q_t": _cast(q_t, fp8),
        "scales_t": scales_t,
    }


def _quant_transposed(
    y_t, scale_mode, static_scale, lower_bound, scale_floor, fp8_max, inverse_max, tile_rows
):
    """q of yᵀ (N, M) with one scale per row of yᵀ and ``tile_rows`` columns (the static
    scale if any); float64 but ``inverse_max``."""
    if scale_mode == "static":
        return np.clip(y_t / float(np.asarray(static_scale).reshape(())), -fp8_max, fp8_max), None
    n, m = y_t.shape
    tiles = -(-m // tile_rows)
    padded = np.zeros((n, tiles * tile_rows))  # |y| >= 0: the zero padding never wins a max
    padded[:, :m] = np.abs(y_t)
    group_max = np.max(padded.reshape(n, tiles, tile_rows), axis=-1)
    capped = group_max if lower_bound is None else np.minimum(group_max, lower_bound)
    scales = np.maximum(capped * inverse_max, scale_floor)
    clipped = y_t if lower_bound is None else np.clip(y_t, -lower_bound, lower_bound)
    return clipped / np.repeat(scales, tile_rows, axis=1)[:, :m], scales
