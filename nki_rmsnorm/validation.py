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

from nki_rmsnorm.reference import CASTING_MODES

__all__ = [
    "KERNEL_DTYPES",
    "as_array",
    "check_casting_mode",
    "check_options",
    "eps_value",
    "kernel_array",
    "kernel_dtype",
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


def parameter(value: Any, name: str, n: int, x_dtype: np.dtype) -> np.ndarray | None:
    """``weight`` / ``bias``: None, or an ``(N,)`` array in float32 or x's dtype."""
    if value is None:
        return None
    array = as_array(value, name)
    if array.shape != (n,):
        raise ValueError(f"{name} must have shape (N,) = ({n},), got {array.shape}")
    if array.dtype not in (FLOAT32, x_dtype):
        raise TypeError(f"{name} must be float32 or x's dtype ({x_dtype}), got {array.dtype}")
    return np.ascontiguousarray(array)


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
