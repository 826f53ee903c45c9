"""NumPy launchers of the RMSNorm kernels: validate, flatten, launch, reshape back.

Each function checks every argument before any kernel runs (``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong shape or value, the message naming the argument
and what was expected), flattens the leading dimensions into rows, launches the ``nki.jit``
kernel through :mod:`nki_rmsnorm.nki` (the simulator here, the Neuron compiler on a
NeuronDevice) and gives the outputs the caller's shape back. Inputs with no rows return
empty outputs without launching anything; non-contiguous arrays are copied to contiguous
ones first.

Decisions beyond ``design.md``:

* ``offset`` shifts the weight (``weight + offset``), so a non-zero ``offset`` without a
  ``weight`` is a ``ValueError`` rather than silently ignored; pass ``weight=np.zeros(N)``
  for a constant scale.
* ``eps = 0`` is allowed: an all-zero row then has ``rstd = inf`` and ``y = 0 · inf = NaN``,
  as on the hardware (``reference.py`` documents the same). An infinite element gives its
  row rstd = 0 (y NaN there, 0 elsewhere); a finite row whose Σh² or mean square the
  kernels' fp32 sum of squares cannot hold exactly is a ``ValueError`` naming the limit
  (:func:`nki_rmsnorm.validation.check_statistics_range`).
* ``weight`` and ``bias`` are float32 or x's dtype; a ``residual`` is x's dtype or float32
  (an fp32 residual stream beside bf16 activations), and ``h`` comes back in its dtype.
* In the backward pass ``dy`` and ``dh_out`` may be in any kernel dtype (``y`` may have had
  an ``out_dtype``); ``rstd`` must be the float32 array the forward returned.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from nki_rmsnorm import kernels
from nki_rmsnorm.plan.backward import MAX_HIDDEN as MAX_HIDDEN_BWD

# The argument rules live in one module shared by every front end; the launchers below use
# them under their historical private names.
from nki_rmsnorm.validation import FLOAT32 as _FLOAT32
from nki_rmsnorm.validation import KERNEL_DTYPES, check_options, check_statistics_range
from nki_rmsnorm.validation import as_array as _array
from nki_rmsnorm.validation import check_casting_mode as _casting_mode
from nki_rmsnorm.validation import eps_value as _eps
from nki_rmsnorm.validation import kernel_array as _kernel_array
from nki_rmsnorm.validation import kernel_dtype as _dtype
from nki_rmsnorm.validation import offset_value as _offset
from nki_rmsnorm.validation import parameter as _parameter

__all__ = ["KERNEL_DTYPES", "check_options", "rms_norm", "rms_norm_bwd", "rms_norm_fwd"]


def rms_norm(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6, *,
             offset: float = 0.0, bias: np.ndarray | None = None,
             residual: np.ndarray | None = None, casting_mode: str = "gemma",
             out_dtype: DTypeLike | None = None) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """RMSNorm over the last axis: ``y``, or ``(y, h)`` when ``residual`` is given.

    ``h = x + residual``, ``y = h / sqrt(mean(h²) + eps) · (weight + offset) + bias``; see
    :func:`rms_norm_fwd` for the arguments.
    """
    outputs = rms_norm_fwd(x, weight, eps, offset=offset, bias=bias, residual=residual,
                           casting_mode=casting_mode, out_dtype=out_dtype)
    return outputs[0] if residual is None else outputs[:2]


def rms_norm_fwd(x: np.ndarray, weight: np.ndarray | None = None, eps: float = 1e-6, *,
                 offset: float = 0.0, bias: np.ndarray | None = None,
                 residual: np.ndarray | None = None, casting_mode: str = "gemma",
                 out_dtype: DTypeLike | None = None) -> tuple[np.ndarray, ...]:
    """RMSNorm forward that also returns the fp32 ``rstd`` the backward pass needs.

    Args:
        x: array of rank ≥ 1 in float32, bfloat16 or float16; normalised over its last axis.
        weight: ``(N,)`` scale in float32 or x's dtype, or None for no scale.
        eps: finite and ≥ 0, added to the mean square inside the root.
        offset: added to ``weight`` (Gemma's ``1 + w``); needs a weight.
        bias: ``(N,)`` in float32 or x's dtype, added last, or None.
        residual: array shaped like ``x`` (x's dtype or float32), added to ``x`` first.
        casting_mode: "gemma", "llama" or "none" (see :mod:`nki_rmsnorm.reference`).
        out_dtype: dtype of ``y`` (float32, bfloat16 or float16); default x's dtype.

    Returns:
        ``(y, rstd)``, or ``(y, h, rstd)`` with a residual; ``rstd`` is float32 of shape
        ``x.shape[:-1]`` and ``h`` has the residual's dtype.
    """
    x = _kernel_array(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the normalised one), got a 0-d "
                         "array")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"x must have a non-empty last (normalised) dimension, got shape "
                         f"{x.shape}")
    weight = _parameter(weight, "weight", n, x.dtype)
    bias = _parameter(bias, "bias", n, x.dtype)
    if residual is not None:
        residual = _kernel_array(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
        if residual.dtype not in (x.dtype, _FLOAT32):
            raise TypeError(f"residual must have x's dtype ({x.dtype}) or float32, got "
                            f"{residual.dtype}")
    eps = _eps(eps)
    offset = _offset(offset, weight)
    _casting_mode(casting_mode)
    out_dtype = x.dtype if out_dtype is None else _dtype(out_dtype, "out_dtype")

    h = x if residual is None else (x.astype(_FLOAT32) + residual.astype(_FLOAT32)).astype(
        residual.dtype)
    check_statistics_range(h, eps)

    lead = x.shape[:-1]
    rows = math.prod(lead)
    if rows == 0:
        outputs = [np.empty(x.shape, out_dtype)]
        if residual is not None:
            outputs.append(np.empty(x.shape, residual.dtype))
        return (*outputs, np.empty(lead, np.float32))

    if residual is None:
        outputs = kernels.rmsnorm_fwd(_rows(x, rows, n), weight, bias, eps, offset,
                                      casting_mode, out_dtype)
    else:
        outputs = kernels.rmsnorm_add_fwd(_rows(x, rows, n), _rows(residual, rows, n), weight,
                                          bias, eps, offset, casting_mode, out_dtype)
    *tiles, rstd = outputs
    return (*(t.reshape(x.shape) for t in tiles), rstd.reshape(lead))


def rms_norm_bwd(dy: np.ndarray, x_or_h: np.ndarray, weight: np.ndarray | None,
                 rstd: np.ndarray, *, offset: float = 0.0, has_bias: bool = False,
                 bias_dtype=None,
                 dh_out: np.ndarray | None = None, casting_mode: str = "gemma",
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """RMSNorm backward from the forward's saved ``rstd``.

    Args:
        dy: gradient of ``y``, shaped like ``x_or_h`` (float32, bfloat16 or float16).
        x_or_h: the normalised input: ``x``, or ``h`` when the forward added a residual.
        weight: the forward's ``(N,)`` weight, or None.
        rstd: the forward's float32 ``rstd``, shape ``x_or_h.shape[:-1]``.
        offset: the forward's weight offset (needs a weight).
        has_bias: whether the forward added a bias (then ``dbias`` is returned).
        bias_dtype: the bias's dtype, ``dbias``'s dtype (float32 or x_or_h's dtype; any
            kernel dtype when x_or_h is an fp32 h); None:
            the weight's dtype (float32 without a weight). ``dbias`` is summed in fp32 and
            rounded once, so an fp32 bias beside a bf16 weight gets an fp32 gradient.
        dh_out: gradient flowing into the ``h`` output, shaped like ``x_or_h``, or None;
            it is added into ``dx``.
        casting_mode: the forward's casting mode.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` in x_or_h's dtype and shape; ``dweight`` ``(N,)`` in
        the weight's dtype, None without a weight; ``dbias`` ``(N,)`` in ``bias_dtype``, None
        unless ``has_bias``.
    """
    x = _kernel_array(x_or_h, "x_or_h")
    if x.ndim == 0:
        raise ValueError("x_or_h must have at least one dimension, got a 0-d array")
    n = x.shape[-1]
    if n == 0:
        raise ValueError(f"x_or_h must have a non-empty last dimension, got shape {x.shape}")
    if n > MAX_HIDDEN_BWD:
        raise ValueError(f"x_or_h has hidden size N={n}; the backward kernel supports "
                         f"N <= {MAX_HIDDEN_BWD} (its dweight/dbias accumulators live in PSUM)")
    dy = _kernel_array(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x_or_h's shape {x.shape}, got {dy.shape}")
    if weight is not None:
        weight = _kernel_array(weight, "weight")
        if weight.shape != (n,):
            raise ValueError(f"weight must have shape (N,) = ({n},), got {weight.shape}")
    rstd = _array(rstd, "rstd")
    if rstd.dtype != _FLOAT32:
        raise TypeError(f"rstd must be float32 (as rms_norm_fwd returns it), got {rstd.dtype}")
    if rstd.shape != x.shape[:-1]:
        raise ValueError(f"rstd must have shape x_or_h.shape[:-1] = {x.shape[:-1]}, got "
                         f"{rstd.shape}")
    if dh_out is not None:
        dh_out = _kernel_array(dh_out, "dh_out")
        if dh_out.shape != x.shape:
            raise ValueError(f"dh_out must have x_or_h's shape {x.shape}, got {dh_out.shape}")
    offset = _offset(offset, weight)
    if not isinstance(has_bias, (bool, np.bool_)):
        raise TypeError(f"has_bias must be a bool, got {type(has_bias).__name__}")
    has_bias = bool(has_bias)
    param_dtype = _FLOAT32 if weight is None else weight.dtype
    if bias_dtype is not None:
        bias_dtype = _dtype(bias_dtype, "bias_dtype")
        # An fp32 x_or_h may be the h of an fp32 residual stream beside a bias in x's
        # narrower dtype, which the forward accepts; otherwise the forward's rule holds.
        if x.dtype != _FLOAT32 and bias_dtype not in (_FLOAT32, x.dtype):
            raise TypeError(f"bias_dtype must be float32 or x_or_h's dtype ({x.dtype}), got "
                            f"{bias_dtype}")
        if not has_bias:
            raise ValueError("bias_dtype is given but has_bias is False: there is no dbias")
    bias_dtype = param_dtype if bias_dtype is None else bias_dtype
    _casting_mode(casting_mode)

    lead = x.shape[:-1]
    rows = math.prod(lead)
    if rows == 0:  # gradients of a sum over no rows
        return (np.empty(x.shape, x.dtype),
                None if weight is None else np.zeros(n, param_dtype),
                np.zeros(n, bias_dtype) if has_bias else None)

    grads = list(kernels.rmsnorm_bwd(
        _rows(dy, rows, n), _rows(x, rows, n), weight, np.ascontiguousarray(rstd.reshape(rows)),
        None if dh_out is None else _rows(dh_out, rows, n), offset, has_bias, casting_mode,
        bias_dtype))
    dx = grads.pop(0).reshape(x.shape)
    dweight = grads.pop(0) if weight is not None else None
    dbias = grads.pop(0) if has_bias else None
    return dx, dweight, dbias


def _rows(array: np.ndarray, rows: int, n: int) -> np.ndarray:
    """``array`` as a contiguous (rows, N) matrix."""
    return np.ascontiguousarray(array.reshape(rows, n))
