"""The argument rules every front end shares (NumPy launchers, torch, JAX, Hugging Face).

Every check raises before any kernel runs: ``TypeError`` for a wrong type or dtype,
``ValueError`` for a wrong shape or value, the message naming the argument and what was
expected. Scalars (``eps``, ``offset``) are any real number a Python ``float`` can hold
(Python and NumPy ints and floats, ``fractions.Fraction``); bools, strings, ``None``, arrays
and numbers beyond the float range are refused by name rather than by whatever ``float()``
would raise.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from nki_rmsnorm.plan.backward import MAX_HIDDEN
from nki_rmsnorm.plan.forward import (
    PACKED_MAX_HEAD_BANKS,
    PACKED_MAX_ROW_BYTES,
    PSUM_COLS,
    max_heads,
    packed_takes_heads,
)
from nki_rmsnorm.reference import CASTING_MODES

__all__ = [
    "KERNEL_DTYPES",
    "as_array",
    "bias_gradient_dtypes",
    "check_backward_hidden",
    "check_backward_outputs",
    "check_casting_mode",
    "check_forward_outputs",
    "check_options",
    "check_statistics_range",
    "eps_value",
    "kernel_array",
    "kernel_dtype",
    "numpy_dtype",
    "offset_value",
    "parameter",
    "real",
]

#: The floating-point dtypes the kernels take and return.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
FLOAT32 = np.dtype(np.float32)
DTYPE_NAMES = "float32, bfloat16 or float16"


def as_array(value: Any, name: str) -> np.ndarray:
    """``value`` itself, which must be a NumPy array."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(value).__name__}")
    return value


def kernel_array(value: Any, name: str) -> np.ndarray:
    """A NumPy array in one of the kernels' floating-point dtypes."""
    array = as_array(value, name)
    if array.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must have dtype {DTYPE_NAMES}, got {array.dtype}")
    return array


def parameter(
    value: Any, name: str, n: int, x_dtype: np.dtype, x_name: str = "x"
) -> np.ndarray | None:
    """``weight`` / ``bias``: None, or an ``(N,)`` array in float32 or the dtype of the
    input it scales (``x_name``)."""
    if value is None:
        return None
    array = as_array(value, name)
    if array.shape != (n,):
        raise ValueError(f"{name} must have shape (N,) = ({n},), got {array.shape}")
    if array.dtype not in (FLOAT32, x_dtype):
        raise TypeError(
            f"{name} must be float32 or {x_name}'s dtype ({x_dtype}), got {array.dtype}"
        )
    return np.ascontiguousarray(array)


def weight_parameter(
    value: Any,
    name: str,
    x_shape: tuple,
    x_dtype: np.dtype,
    h_dtype: np.dtype | None = None,
    x_name: str = "x",
) -> np.ndarray | None:
    """``weight``: None, an ``(N,)`` array (:func:`parameter`), or a per-head ``(heads, N)``
    array equal to ``x_shape[-2:]`` (x is ``(..., heads, head_dim)``; row r of the flattened
    ``(tokens·heads, N)`` rows is scaled by ``weight[r mod heads]``), in float32 or x's
    dtype. A per-head weight runs in the kernels' "packed" regime only: N·bytes of h (the
    residual's dtype, else x's; ``h_dtype``) ≤ 512 and heads ≤ 4·(512 // N) (16 heads of
    128)."""
    if value is None:
        return None
    n = x_shape[-1]
    if np.ndim(value) != 2:
        return parameter(value, name, n, x_dtype, x_name)
    array = as_array(value, name)
    if len(x_shape) < 2 or array.shape != tuple(x_shape[-2:]):
        raise ValueError(
            f"{name} must have shape (N,) = ({n},), or (heads, N) = {x_name}.shape[-2:] for a "
            f"per-head weight ({x_name} of shape (..., heads, N)), got {array.shape} with "
            f"{x_name} of shape {tuple(x_shape)}"
        )
    if array.dtype not in (FLOAT32, x_dtype):
        raise TypeError(
            f"{name} must be float32 or {x_name}'s dtype ({x_dtype}), got {array.dtype}"
        )
    check_head_weight(name, array.shape, np.dtype(x_dtype if h_dtype is None else h_dtype).itemsize)
    return np.ascontiguousarray(array)


def check_head_weight(name: str, shape: tuple, h_bytes: int) -> None:
    """A per-head weight of ``shape`` (heads, N) fits the kernels' "packed" regime (rows of h
    in a dtype of ``h_bytes`` bytes), else a ``ValueError`` naming ``name``."""
    heads, n = shape
    if not packed_takes_heads(h_bytes, n, heads):
        raise ValueError(
            f"{name} of shape (heads, N) = {tuple(shape)} (a per-head weight) needs "
            f"N * {h_bytes} bytes <= {PACKED_MAX_ROW_BYTES} and heads <= "
            f"{PACKED_MAX_HEAD_BANKS} * ({PSUM_COLS} // N) = {max_heads(n)} (the kernels' "
            "short-row regime); pass an (N,) weight or split the heads"
        )


def real(value: Any, name: str) -> float:
    """``value`` as a Python float: a real number (not a bool) within the float range."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:  # an int or Fraction beyond ±1.8e308
        raise ValueError(
            f"{name} must be finite and within the float range, got a "
            f"{type(value).__name__} too large for a float"
        ) from None


def eps_value(eps: Any) -> float:
    """``eps`` as a float: finite and ≥ 0."""
    value = real(eps, "eps")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"eps must be finite and >= 0, got {value}")
    return value


def offset_value(offset: Any, weight: object | None) -> float:
    """``offset`` as a float: finite, and non-zero only with a weight (it shifts the weight)."""
    value = real(offset, "offset")
    if not math.isfinite(value):
        raise ValueError(f"offset must be finite, got {value}")
    if value and weight is None:
        raise ValueError(
            f"offset={value} needs a weight: it shifts the weight "
            "(y = x̂·(weight + offset)); pass weight=np.zeros(N) for a constant "
            "scale"
        )
    return value


def check_casting_mode(casting_mode: Any) -> None:
    """``casting_mode`` is one of "gemma", "llama", "none"."""
    if not isinstance(casting_mode, str) or casting_mode not in CASTING_MODES:
        raise ValueError(f"casting_mode must be one of {CASTING_MODES}, got {casting_mode!r}")


def check_options(
    eps: Any, offset: Any, weight: object | None, casting_mode: Any
) -> tuple[float, float]:
    """Validate the scalar options every binding shares; returns ``(eps, offset)`` as floats.

    ``eps`` must be a finite real ≥ 0, ``offset`` a finite real that needs a ``weight``,
    ``casting_mode`` one of "gemma", "llama", "none".
    """
    check_casting_mode(casting_mode)
    return eps_value(eps), offset_value(offset, weight)


def kernel_dtype(value: DTypeLike, name: str) -> np.dtype:
    """``value`` as one of the kernels' dtypes."""
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be a dtype ({DTYPE_NAMES}), got {value!r}") from exc
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be {DTYPE_NAMES}, got {dtype}")
    return dtype


def numpy_dtype(value: Any) -> np.dtype | None:
    """``value`` (a NumPy, JAX, torch or NKI dtype, or a dtype name) as a NumPy dtype, None
    when it names none."""
    if value is None:
        return None
    if isinstance(value, str):
        value = value.removeprefix("torch.")
        value = ml_dtypes.bfloat16 if value == "bfloat16" else value
    elif type(value).__module__ == "torch":  # torch.float32 -> "float32", without torch
        return numpy_dtype(str(value))
    value = getattr(value, "numpy", value)  # an NKI 0.6 dtype carries its NumPy dtype
    try:
        return np.dtype(value)
    except (TypeError, ValueError):
        return None


def _expect_dtype(name: str, dtype: Any, allowed: tuple, meaning: str) -> None:
    if numpy_dtype(dtype) not in allowed:
        names = " or ".join(d.name for d in dict.fromkeys(allowed))
        raise TypeError(f"{name} must be {names} ({meaning}), got {dtype}")


def check_forward_outputs(
    x_dtype: Any, y_dtype: Any, rstd_dtype: Any, residual_dtype: Any = None, h_dtype: Any = None
) -> None:
    """The output-parameter forward's preallocated outputs (``rmsnorm_fwd_out``,
    ``rmsnorm_add_fwd_out``): ``y`` in a kernel dtype (its dtype is the output dtype),
    ``rstd`` float32, ``h`` in the residual's dtype; a ``TypeError`` naming the output
    otherwise. Dtypes may be NumPy, torch, JAX or NKI dtypes."""
    del x_dtype  # y may have any kernel dtype, whatever x's
    _expect_dtype("y", y_dtype, KERNEL_DTYPES, "the output dtype")
    _expect_dtype("rstd", rstd_dtype, (FLOAT32,), "the forward's saved statistics")
    if residual_dtype is not None or h_dtype is not None:
        _expect_dtype("h", h_dtype, (numpy_dtype(residual_dtype),), "the residual's dtype")


def bias_gradient_dtypes(x_dtype: Any) -> tuple[np.dtype, ...]:
    """The dtypes ``dbias`` (a bias's) may have beside ``x_or_h`` of ``x_dtype``: float32 or
    x's dtype, any kernel dtype when x_or_h is an fp32 h (an fp32 residual stream)."""
    x_dtype = numpy_dtype(x_dtype)
    return KERNEL_DTYPES if x_dtype == FLOAT32 else (FLOAT32, x_dtype)


def check_backward_outputs(
    x_dtype: Any,
    weight_dtype: Any,
    dx_dtype: Any,
    dweight_dtype: Any = None,
    dbias_dtype: Any = None,
) -> None:
    """The output-parameter backward's preallocated outputs (``rmsnorm_bwd_out``): ``dx`` in
    x_or_h's dtype, ``dweight`` in float32 or the weight's dtype, ``dbias`` in float32 or
    x_or_h's dtype (:func:`bias_gradient_dtypes`); each is summed in fp32 and rounded once
    to its dtype. ``TypeError`` naming the output otherwise."""
    _expect_dtype("dx", dx_dtype, (numpy_dtype(x_dtype),), "x_or_h's dtype")
    if dweight_dtype is not None:
        weight = FLOAT32 if weight_dtype is None else numpy_dtype(weight_dtype)
        _expect_dtype("dweight", dweight_dtype, (FLOAT32, weight), "float32 or the weight's")
    if dbias_dtype is not None:
        _expect_dtype("dbias", dbias_dtype, bias_gradient_dtypes(x_dtype), "float32 or x_or_h's")


def check_backward_hidden(n: int, name: str = "x") -> None:
    """``ValueError`` when the backward kernel cannot take hidden size ``n`` (its
    dweight / dbias accumulators live in PSUM: ``plan.backward.MAX_HIDDEN``)."""
    if n > MAX_HIDDEN:
        raise ValueError(
            f"{name} has hidden size N={n}, above the backward kernel's limit "
            f"N <= {MAX_HIDDEN} (its dweight/dbias accumulators live in PSUM); differentiate "
            "a smaller hidden size or run the forward only"
        )


#: The kernels sum h² in fp32 (``plan.forward.FP32_MAX`` ≈ 2¹²⁸): a finite row whose Σh²
#: reaches this bound (half the fp32 range, room for the fp32 accumulation's rounding) cannot
#: be normalised exactly.
SUM_OF_SQUARES_LIMIT = 2.0**127
#: Below this mean square (+ eps) the rounding of subnormal fp32 squares (2⁻¹⁵⁰ each) reaches
#: fp32's own precision (2⁻²⁵ relative): the result cannot be exact.
MEAN_SQUARE_FLOOR = 2.0**-125


def check_statistics_range(h: np.ndarray, eps: float, name: str = "x") -> None:
    """``ValueError`` naming the limit when a finite row of ``h`` (the normalised input, rows
    on the last axis) is outside what the kernels' fp32 sum of squares holds exactly: Σh² ≥
    :data:`SUM_OF_SQUARES_LIMIT` (bfloat16/float32 elements around 1.3·10¹⁹/√N and beyond),
    or 0 < mean(h²) + eps < :data:`MEAN_SQUARE_FLOOR` (eps ≈ 0 and every element around
    10⁻¹⁹ or smaller). Rows with an infinite or NaN element follow IEEE arithmetic and pass;
    float16 never reaches either bound. A host-side check: the data is on the host."""
    if h.size == 0 or h.dtype == np.float16:
        return
    rows = np.asarray(h, np.float32).reshape(-1, h.shape[-1])
    finite = np.isfinite(rows).all(axis=1)
    peak = np.max(np.abs(np.where(np.isfinite(rows), rows, 0)), axis=1).astype(np.float64)
    n = rows.shape[1]
    # Σh² ≤ N·peak² and mean(h²) ≥ peak²/N: only rows near a bound need the float64 sum.
    near = finite & (
        (n * peak**2 >= SUM_OF_SQUARES_LIMIT) | (peak**2 / n + eps < MEAN_SQUARE_FLOOR)
    )
    if not near.any():
        return
    sums = np.einsum("ij,ij->i", rows[near].astype(np.float64), rows[near].astype(np.float64))
    index = np.flatnonzero(near)
    high = sums >= SUM_OF_SQUARES_LIMIT
    if high.any():
        row = index[np.argmax(high)]
        raise ValueError(
            f"{name} row {row} has a sum of squares of {sums[high][0]:.3g}, beyond the fp32 "
            f"accumulator the kernels sum h² in (limit 2**127 = {SUM_OF_SQUARES_LIMIT:.3g}); "
            "scale the input down by a power of two"
        )
    mean = sums / n + eps
    low = (mean > 0) & (mean < MEAN_SQUARE_FLOOR)
    if low.any():
        row = index[np.argmax(low)]
        raise ValueError(
            f"{name} row {row} has a mean square + eps of {mean[low][0]:.3g}, below "
            f"2**-125 = {MEAN_SQUARE_FLOOR:.3g}, where the kernels' fp32 squares are "
            "subnormal and inexact; use eps >= 2**-125 or scale the input up by a power of two"
        )
