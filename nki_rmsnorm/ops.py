"""NumPy launchers of the RMSNorm kernels: validate, flatten, launch, reshape back.

Each function checks every argument before any kernel runs (``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong shape or value, the message naming the argument
and what was expected), flattens the leading dimensions into rows, launches the ``nki.jit``
kernel through :mod:`nki_rmsnorm.nki` (the simulator here, the Neuron compiler on a
NeuronDevice) and gives the outputs the caller's shape back. Inputs with no rows return
empty outputs without launching anything; non-contiguous arrays are copied to contiguous
ones first.

Decisions beyond the contract in ``docs/design.md``:

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
import numbers
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

from nki_rmsnorm import dialect, kernels
from nki_rmsnorm.plan.backward import MAX_HEAD_HIDDEN, MAX_HEADS
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
from nki_rmsnorm.validation import real as _real
from nki_rmsnorm.validation import weight_parameter as _weight_parameter

__all__ = [
    "KERNEL_DTYPES",
    "QuantizedRMSNorm",
    "check_options",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_qk",
    "rms_norm_qk_fwd",
    "rms_norm_quant",
]


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    bias: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    casting_mode: str = "gemma",
    out_dtype: DTypeLike | None = None,
    output_layout: str = "rows",
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """RMSNorm over the last axis: ``y``, or ``(y, h)`` when ``residual`` is given.

    ``h = x + residual``, ``y = h / sqrt(mean(h²) + eps) · (weight + offset) + bias``; see
    :func:`rms_norm_fwd` for the arguments.
    """
    outputs = rms_norm_fwd(
        x,
        weight,
        eps,
        offset=offset,
        bias=bias,
        residual=residual,
        casting_mode=casting_mode,
        out_dtype=out_dtype,
        output_layout=output_layout,
    )
    return outputs[0] if residual is None else outputs[:2]


def rms_norm_fwd(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    bias: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    casting_mode: str = "gemma",
    out_dtype: DTypeLike | None = None,
    output_layout: str = "rows",
) -> tuple[np.ndarray, ...]:
    """RMSNorm forward that also returns the fp32 ``rstd`` the backward pass needs.

    Args:
        x: array of rank ≥ 1 in float32, bfloat16 or float16; normalised over its last axis.
        weight: ``(N,)`` scale in float32 or x's dtype, or None for no scale; or a per-head
            ``(heads, N)`` weight equal to ``x.shape[-2:]`` (x of shape ``(..., heads, N)``,
            QK-norm with a weight per head as Liger and Quack offer): the row of head i is
            scaled by ``weight[i]``. Per-head weights need N·bytes(h) ≤ 512 and heads ≤
            4·(512 // N) (the kernels' short-row "packed" regime), else a ``ValueError``.
        eps: finite and ≥ 0, added to the mean square inside the root.
        offset: added to ``weight`` (Gemma's ``1 + w``); needs a weight.
        bias: ``(N,)`` in float32 or x's dtype, added last, or None.
        residual: array shaped like ``x`` (x's dtype or float32), added to ``x`` first.
        casting_mode: "gemma", "llama" or "none" (see :mod:`nki_rmsnorm.reference`).
        out_dtype: dtype of ``y`` (float32, bfloat16 or float16); default x's dtype.
        output_layout: "rows" (default: y shaped like x) or "transposed": y in the layout of
            nki-library's decode kernel ``rmsnorm_tkg`` (its docstring's single-core
            pseudocode), shape ``(128, M, N // 128)`` with M the rows of x (its leading
            dimensions flattened) and ``y_t[p, m, k] = y[m, p · (N // 128) + k]``: the
            128-partition operand the next matmul of a decode step contracts over. The
            same bits as "rows", written by the kernel's output DMA in one pass. Needs N
            divisible by 128, the NKI 0.6 kernels (trn2/trn3) and an ``(N,)`` weight (or
            none); ``h`` keeps x's shape.

    Returns:
        ``(y, rstd)``, or ``(y, h, rstd)`` with a residual; ``rstd`` is float32 of shape
        ``x.shape[:-1]`` and ``h`` has the residual's dtype.
    """
    x, residual = _input_rows(x, residual)
    n = x.shape[-1]
    weight = _weight_parameter(
        weight, "weight", x.shape, x.dtype, None if residual is None else residual.dtype
    )
    bias = _parameter(bias, "bias", n, x.dtype)
    eps = _eps(eps)
    offset = _offset(offset, weight)
    _casting_mode(casting_mode)
    out_dtype = x.dtype if out_dtype is None else _dtype(out_dtype, "out_dtype")
    transposed = check_output_layout(output_layout, x, weight)

    h = (
        x
        if residual is None
        else (x.astype(_FLOAT32) + residual.astype(_FLOAT32)).astype(residual.dtype)
    )
    check_statistics_range(h, eps)

    lead = x.shape[:-1]
    rows = math.prod(lead)
    if rows == 0:
        y_shape = (_PARTITIONS, 0, n // _PARTITIONS) if transposed else x.shape
        outputs = [np.empty(y_shape, out_dtype)]
        if residual is not None:
            outputs.append(np.empty(x.shape, residual.dtype))
        return (*outputs, np.empty(lead, np.float32))

    # the kernel takes an nki.language dtype, not a NumPy one (nki/api/nki.api.shared.rst
    # L11-L12 in NKI 0.6)
    y_dtype = kernels.nki_dtype(np.dtype(out_dtype).name, dialect.current())
    if transposed:
        if residual is None:
            y_t, rstd = kernels.rmsnorm_fwd_transposed(
                _rows(x, rows, n), weight, bias, eps, offset, casting_mode, y_dtype
            )
            return y_t, rstd.reshape(lead)
        y_t, h, rstd = kernels.rmsnorm_add_fwd_transposed(
            _rows(x, rows, n),
            _rows(residual, rows, n),
            weight,
            bias,
            eps,
            offset,
            casting_mode,
            y_dtype,
        )
        return y_t, h.reshape(x.shape), rstd.reshape(lead)
    if residual is None:
        outputs = kernels.rmsnorm_fwd(
            _rows(x, rows, n), weight, bias, eps, offset, casting_mode, y_dtype
        )
    else:
        outputs = kernels.rmsnorm_add_fwd(
            _rows(x, rows, n),
            _rows(residual, rows, n),
            weight,
            bias,
            eps,
            offset,
            casting_mode,
            y_dtype,
        )
    *tiles, rstd = outputs
    return (*(t.reshape(x.shape) for t in tiles), rstd.reshape(lead))


#: Partitions of a NeuronCore: the leading axis of the transposed y.
_PARTITIONS = 128
OUTPUT_LAYOUTS = ("rows", "transposed")


def check_output_layout(output_layout, x, weight, *, check_dialect: bool = True) -> bool:
    """Whether ``output_layout`` asks for rmsnorm_tkg's transposed y; its requirements
    checked before any launch. ``x`` and ``weight`` need only ``shape`` (and ``ndim``), so
    the PyTorch and JAX bindings check their tensors with it too; ``check_dialect=False``
    leaves the dialect to the launch (torch's functions: ``torch.compile`` traces them, and
    the target's dialect is resolved by the operator at each call, not in the graph)."""
    if not isinstance(output_layout, str) or output_layout not in OUTPUT_LAYOUTS:
        raise ValueError(f"output_layout must be one of {OUTPUT_LAYOUTS}, got {output_layout!r}")
    if output_layout == "rows":
        return False
    n = x.shape[-1]
    if n % _PARTITIONS:
        raise ValueError(
            f"output_layout='transposed' needs x's last dimension N divisible "
            f"by {_PARTITIONS} (y_t is ({_PARTITIONS}, M, N // {_PARTITIONS})), "
            f"got x of shape {x.shape}"
        )
    if weight is not None and weight.ndim != 1:
        raise ValueError(
            f"output_layout='transposed' takes an (N,) weight, got a per-head "
            f"weight of shape {weight.shape}"
        )
    if check_dialect and dialect.current() == dialect.LEGACY:
        raise ValueError(
            "output_layout='transposed' needs the NKI 0.6 kernels (trn2/trn3 on "
            "SDK 2.31+): it writes y through an .ap() access pattern, which the "
            "legacy NKI dialect does not have"
        )
    return True


def rms_norm_qk(
    q: np.ndarray,
    k: np.ndarray,
    q_weight: np.ndarray | None = None,
    k_weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "gemma",
    out_dtype: DTypeLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The query and key norms of an attention in one launch: ``(y_q, y_k)``; see
    :func:`rms_norm_qk_fwd`."""
    return rms_norm_qk_fwd(
        q, k, q_weight, k_weight, eps, offset=offset, casting_mode=casting_mode, out_dtype=out_dtype
    )[:2]


def rms_norm_qk_fwd(
    q: np.ndarray,
    k: np.ndarray,
    q_weight: np.ndarray | None = None,
    k_weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "gemma",
    out_dtype: DTypeLike | None = None,
) -> tuple[np.ndarray, ...]:
    """RMSNorm of the queries and of the keys (QK-norm, as Qwen3 and Gemma 3 apply it per
    head, Megatron's fused call) in one kernel launch, with the ``rstd`` of each.

    Args:
        q: queries, rank ≥ 1 (e.g. ``(tokens, heads, head_dim)``), float32, bfloat16 or
            float16; normalised over its last axis.
        k: keys, likewise (its own shape and dtype: grouped-query attention has fewer key
            heads).
        q_weight, k_weight: ``(q.shape[-1],)`` / ``(k.shape[-1],)`` scales in float32 or
            their tensor's dtype, or None; or per-head ``q.shape[-2:]`` / ``k.shape[-2:]``
            weights (as :func:`rms_norm_fwd`'s ``weight``).
        eps, offset, casting_mode, out_dtype: as :func:`rms_norm_fwd`, for both (a non-zero
            ``offset`` needs both weights).

    Returns:
        ``(y_q, y_k, rstd_q, rstd_k)``: each as :func:`rms_norm_fwd` returns for that tensor
        alone, bit for bit.
    """
    q = _named_rows(q, "q")
    k = _named_rows(k, "k")
    q_weight = _weight_parameter(q_weight, "q_weight", q.shape, q.dtype, x_name="q")
    k_weight = _weight_parameter(k_weight, "k_weight", k.shape, k.dtype, x_name="k")
    eps = _eps(eps)
    offset = _real(offset, "offset")
    if offset and (q_weight is None or k_weight is None):
        raise ValueError(
            f"offset={offset} shifts the weights (weight + offset): it needs "
            "q_weight and k_weight, got None"
        )
    offset = _offset(offset, q_weight if q_weight is not None else k_weight)
    _casting_mode(casting_mode)
    out_q = q.dtype if out_dtype is None else _dtype(out_dtype, "out_dtype")
    out_k = k.dtype if out_dtype is None else out_q
    check_statistics_range(q, eps)
    check_statistics_range(k, eps)
    rows_q, rows_k = math.prod(q.shape[:-1]), math.prod(k.shape[:-1])
    if rows_q == 0 or rows_k == 0:  # one launch or none: an empty tensor has no kernel rows
        fwd = (
            rms_norm_fwd(
                t,
                w,
                eps,
                offset=offset if w is not None else 0.0,
                casting_mode=casting_mode,
                out_dtype=out,
            )
            for t, w, out in ((q, q_weight, out_q), (k, k_weight, out_k))
        )
        (y_q, rstd_q), (y_k, rstd_k) = fwd
        return y_q, y_k, rstd_q, rstd_k
    if out_dtype is None and q.dtype != k.dtype:
        raise TypeError(
            f"q and k have different dtypes ({q.dtype}, {k.dtype}): pass out_dtype "
            "(the one launch writes both in it)"
        )
    y_dtype = kernels.nki_dtype(np.dtype(out_q).name, dialect.current())
    y_q, y_k, rstd_q, rstd_k = kernels.rmsnorm_qk_fwd(
        _rows(q, rows_q, q.shape[-1]),
        _rows(k, rows_k, k.shape[-1]),
        q_weight,
        k_weight,
        eps,
        offset,
        casting_mode,
        y_dtype,
    )
    return (
        y_q.reshape(q.shape),
        y_k.reshape(k.shape),
        rstd_q.reshape(q.shape[:-1]),
        rstd_k.reshape(k.shape[:-1]),
    )


def _named_rows(value: Any, name: str) -> np.ndarray:
    """``value`` as a kernel array with a non-empty last (normalised) dimension."""
    array = _kernel_array(value, name)
    if array.ndim == 0:
        raise ValueError(
            f"{name} must have at least one dimension (the normalised one), got a 0-d array"
        )
    if array.shape[-1] == 0:
        raise ValueError(
            f"{name} must have a non-empty last (normalised) dimension, got shape {array.shape}"
        )
    return array


def rms_norm_bwd(
    dy: np.ndarray,
    x_or_h: np.ndarray,
    weight: np.ndarray | None,
    rstd: np.ndarray,
    *,
    offset: float = 0.0,
    has_bias: bool = False,
    bias_dtype=None,
    dh_out: np.ndarray | None = None,
    casting_mode: str = "gemma",
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """RMSNorm backward from the forward's saved ``rstd``.

    Args:
        dy: gradient of ``y``, shaped like ``x_or_h`` (float32, bfloat16 or float16).
        x_or_h: the normalised input: ``x``, or ``h`` when the forward added a residual.
        weight: the forward's ``(N,)`` weight, its per-head ``(heads, N)`` weight
            (``x_or_h.shape[-2:]``; ``dweight`` is then per head), or None.
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
        raise ValueError(
            f"x_or_h has hidden size N={n}; the backward kernel supports "
            f"N <= {MAX_HIDDEN_BWD} (its dweight/dbias accumulators live in PSUM)"
        )
    dy = _kernel_array(dy, "dy")
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x_or_h's shape {x.shape}, got {dy.shape}")
    if weight is not None:
        weight = _kernel_array(weight, "weight")
        per_head = weight.ndim == 2 and x.ndim >= 2 and weight.shape == x.shape[-2:]
        if weight.shape != (n,) and not per_head:
            raise ValueError(
                f"weight must have shape (N,) = ({n},), or x_or_h.shape[-2:] = "
                f"{x.shape[-2:]} for a per-head weight, got {weight.shape}"
            )
    rstd = _array(rstd, "rstd")
    if rstd.dtype != _FLOAT32:
        raise TypeError(f"rstd must be float32 (as rms_norm_fwd returns it), got {rstd.dtype}")
    if rstd.shape != x.shape[:-1]:
        raise ValueError(
            f"rstd must have shape x_or_h.shape[:-1] = {x.shape[:-1]}, got {rstd.shape}"
        )
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
            raise TypeError(
                f"bias_dtype must be float32 or x_or_h's dtype ({x.dtype}), got {bias_dtype}"
            )
        if not has_bias:
            raise ValueError("bias_dtype is given but has_bias is False: there is no dbias")
    bias_dtype = param_dtype if bias_dtype is None else bias_dtype
    _casting_mode(casting_mode)

    lead = x.shape[:-1]
    rows = math.prod(lead)
    if rows == 0:  # gradients of a sum over no rows
        return (
            np.empty(x.shape, x.dtype),
            None if weight is None else np.zeros(weight.shape, param_dtype),
            np.zeros(n, bias_dtype) if has_bias else None,
        )
    if weight is not None and weight.ndim == 2:
        return _per_head_bwd(
            dy, x, weight, rstd, offset, has_bias, bias_dtype, dh_out, casting_mode
        )

    grads = list(
        kernels.rmsnorm_bwd(
            _rows(dy, rows, n),
            _rows(x, rows, n),
            weight,
            np.ascontiguousarray(rstd.reshape(rows)),
            None if dh_out is None else _rows(dh_out, rows, n),
            offset,
            has_bias,
            casting_mode,
            kernels.nki_dtype(bias_dtype.name, dialect.current()),
        )
    )
    dx = grads.pop(0).reshape(x.shape)
    dweight = grads.pop(0) if weight is not None else None
    dbias = grads.pop(0) if has_bias else None
    return dx, dweight, dbias


def _per_head_bwd(dy, x, weight, rstd, offset, has_bias, bias_dtype, dh_out, casting_mode):
    """The backward of a per-head weight (heads, N) in one launch of the backward kernel,
    which takes the 2-D weight as it is (row r of the flattened rows scaled by
    ``weight[r mod heads]``, ``dweight`` per head); with a bias one more launch over all rows
    without a weight gives ``dbias`` (its dx is discarded: dbias = Σ dy does not depend on
    the weight)."""
    heads, n = weight.shape
    if heads > MAX_HEADS or n > MAX_HEAD_HIDDEN:
        raise ValueError(
            f"weight has shape {weight.shape}; the backward kernel takes per-head "
            f"weights (heads, N) with heads <= {MAX_HEADS} and N <= "
            f"{MAX_HEAD_HIDDEN}"
        )
    total = math.prod(x.shape[:-1])
    rows = np.ascontiguousarray(rstd.reshape(total))
    dx, dweight = kernels.rmsnorm_bwd(
        _rows(dy, total, n),
        _rows(x, total, n),
        np.ascontiguousarray(weight),
        rows,
        None if dh_out is None else _rows(dh_out, total, n),
        offset,
        False,
        casting_mode,
        kernels.nki_dtype(weight.dtype.name, dialect.current()),
    )
    dbias = None
    if has_bias:
        dbias = kernels.rmsnorm_bwd(
            _rows(dy, total, n),
            _rows(x, total, n),
            None,
            rows,
            None,
            0.0,
            True,
            casting_mode,
            kernels.nki_dtype(bias_dtype.name, dialect.current()),
        )[1]
    return dx.reshape(x.shape), dweight, dbias


def _input_rows(x, residual):
    """``(x, residual)`` as kernel arrays, checked: x has a non-empty last (normalised)
    dimension; a residual has x's shape and x's dtype or float32."""
    x = _kernel_array(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the normalised one), got a 0-d array")
    if x.shape[-1] == 0:
        raise ValueError(
            f"x must have a non-empty last (normalised) dimension, got shape {x.shape}"
        )
    if residual is not None:
        residual = _kernel_array(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
        if residual.dtype not in (x.dtype, _FLOAT32):
            raise TypeError(
                f"residual must have x's dtype ({x.dtype}) or float32, got {residual.dtype}"
            )
    return x, residual


def _rows(array: np.ndarray, rows: int, n: int) -> np.ndarray:
    """``array`` as a contiguous (rows, N) matrix."""
    return np.ascontiguousarray(array.reshape(rows, n))


# ---------------------------------------------------------------------------------------------
# Quantized forward
# ---------------------------------------------------------------------------------------------

#: The fp8 output dtypes and their largest finite values (the kernel's ``fp8_max``).
QUANT_DTYPES = {
    "float8_e4m3": 240.0,
    "float8_e4m3fn": 448.0,
    "float8_e5m2": 57344.0,
}
#: The OCP e4m3 exists only on NeuronCore-v4 (trn3); nki-library's dtype helper maps it to
#: the IEEE-style e4m3 on older generations (nki-library@d2ad3a5
#: ``src/nkilib_src/nkilib/core/utils/kernel_helpers.py`` L489-491).
_OCP_ONLY_NC_VERSION = 4
SCALE_MODES = ("row", "block", "static")
#: Bytes per partition the quantized kernel may keep for one row tile and the weight row (the
#: smallest usable SBUF of its targets, trn2's, rounded down).
_QUANT_TILE_BYTES = 192 * 1024


class QuantizedRMSNorm(NamedTuple):
    """What :func:`rms_norm_quant` returns; absent outputs are None.

    ``y_q``: x's shape in the fp8 dtype, or with ``packed=True`` the last axis N + 4 long, the
    float32 dequant scale's little-endian bytes at ``[..., N:N + 4]``. ``scales``: float32,
    ``x.shape[:-1]`` (row), ``x.shape[:-1] + (N // block,)`` (block), None (static, packed).
    ``y``: the normalized output in x's dtype (``return_y``); ``h``: ``x + residual`` in the
    residual's dtype; ``amax``: float32 ``x.shape[:-1]``, max |y| per row (``return_amax``).
    ``y_q_t`` (``return_transposed``): y quantized and transposed, (N, M) over the M =
    prod(x.shape[:-1]) rows, for the weight-gradient GEMM; ``scales_t``: float32
    (N, ⌈M / 128⌉), one per column of y and 128-row tile (None for static: the static scale).
    """

    y_q: np.ndarray
    scales: np.ndarray | None
    y: np.ndarray | None
    h: np.ndarray | None
    amax: np.ndarray | None
    y_q_t: np.ndarray | None = None
    scales_t: np.ndarray | None = None


def target_nc_version() -> int | None:
    """The NeuronCore generation the 0.6 kernels will run on: the simulator's target
    (``NEURON_PLATFORM_TARGET_OVERRIDE``); None on a real device (the kernel asserts)."""
    from nki_rmsnorm.kernels.nki06._nki import SIMULATED

    if not SIMULATED:  # pragma: no cover - needs the Neuron SDK 2.31+
        return None
    from simulate.nki06.context import target_from_env

    return target_from_env().nc_version


def quant_dtype_name(quant_dtype: Any, nc_version: int | None) -> str:
    """The name of an fp8 output dtype the target has; None picks the target's e4m3
    (``float8_e4m3fn`` on trn3, ``float8_e4m3`` before)."""
    if quant_dtype is None:
        return "float8_e4m3fn" if nc_version == _OCP_ONLY_NC_VERSION else "float8_e4m3"
    name = quant_dtype if isinstance(quant_dtype, str) else None
    if name is None:
        try:
            name = np.dtype(quant_dtype).name
        except TypeError:
            name = str(quant_dtype).removeprefix("torch.").removeprefix("nl.")
    if name not in QUANT_DTYPES:
        mx_hint = (
            "; MX formats (float8_e4m3fn_x4, float8_e5m2_x4) are nki_rmsnorm.mx.rms_norm_mx_quant's"
            if name.endswith("_x4")
            else ""
        )
        raise TypeError(
            f"quant_dtype must be one of {', '.join(QUANT_DTYPES)}, got {quant_dtype!r}{mx_hint}"
        )
    if name == "float8_e4m3fn" and nc_version is not None and nc_version != _OCP_ONLY_NC_VERSION:
        raise ValueError(
            "quant_dtype=float8_e4m3fn (OCP) needs trn3 (NeuronCore-v4); this "
            f"target is NeuronCore-v{nc_version}: use float8_e4m3 (max 240)"
        )
    return name


def _positive(value: Any, name: str) -> float:
    number = _real(value, name)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {number}")
    return number


def _static_scale(value: Any) -> np.ndarray:
    """The static dequant scale as a (1, 1) float32 array: a Python float, or a float32
    array of one element (shape (), (1,) or (1, 1)); finite and > 0."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        array = np.array(value, np.float32)
    else:
        array = _array(value, "static_scale")
        if array.dtype != _FLOAT32:
            raise TypeError(f"static_scale must be float32, got {array.dtype}")
        if array.shape not in ((), (1,), (1, 1)):
            raise ValueError(
                f"static_scale must hold one value (shape (), (1,) or (1, 1)), "
                f"got shape {array.shape}"
            )
    scale = float(array.reshape(()))
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"static_scale must be finite and > 0, got {scale}")
    return np.full((1, 1), scale, np.float32)


def rms_norm_quant(
    x: np.ndarray,
    weight: np.ndarray | None = None,
    eps: float = 1e-6,
    *,
    residual: np.ndarray | None = None,
    quant_dtype: Any = None,
    scale_mode: str = "row",
    block: int = 128,
    static_scale: Any = None,
    lower_bound: float | None = None,
    scale_floor: float = 1e-6,
    return_y: bool = False,
    return_amax: bool = False,
    packed: bool = False,
    return_transposed: bool = False,
) -> QuantizedRMSNorm:
    """RMSNorm over the last axis, quantized to fp8 in the same pass.

    ``y = h / sqrt(mean(h²) + eps) · weight`` with ``h = x (+ residual)``; ``y_q`` is y
    divided by its dequant scale, rounded to nearest even in ``quant_dtype``. The math,
    rounding and edge cases are documented in
    :mod:`nki_rmsnorm.kernels.nki06.rmsnorm_quant` (and mirrored in float64 by
    :func:`nki_rmsnorm.reference.rms_norm_quant`).

    Args:
        x: float32, bfloat16 or float16 array of rank ≥ 1.
        weight: ``(N,)`` in float32 or x's dtype, or None.
        eps: finite, ≥ 0.
        residual: x's shape, x's dtype or float32; ``h`` is returned in its dtype.
        quant_dtype: "float8_e4m3" (max 240), "float8_e4m3fn" (max 448, trn3 only) or
            "float8_e5m2" (or the ml_dtypes / NumPy dtype); None: the target's e4m3.
        scale_mode: "row" (one scale per row), "block" (one per ``block`` columns of a row)
            or "static" (the caller's ``static_scale``, y clipped to ±fp8_max).
        block: columns per scale in "block" mode; must divide N.
        static_scale: the dequant scale for "static": a float or a one-element float32
            array, finite and > 0.
        lower_bound: None, or finite > 0: y is clipped to ±lower_bound and the scale's amax
            capped at it (nki-library ``rmsnorm_quant_kernel``'s ``lower_bound``); row and
            block modes only.
        scale_floor: finite > 0, the least dequant scale (an all-zero row gets it).
        return_y, return_amax: also return y (x's dtype) and the per-row max |y| (float32).
        packed: nki-library's layout, row scales only: y_q with N + 4 columns.
        return_transposed: also return y_qᵀ (N, M) with its own scales, per column of y and
            128-row tile (TransformerEngine's ``fp8_t`` with column-wise 1 × 128 block
            scales), or the static scale; the kernel module documents the choice.

    Returns:
        :class:`QuantizedRMSNorm`.
    """
    x, residual = _input_rows(x, residual)
    n = x.shape[-1]
    weight = _parameter(weight, "weight", n, x.dtype)
    eps = _eps(eps)
    name = quant_dtype_name(quant_dtype, target_nc_version())
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if isinstance(block, (bool, np.bool_)) or not isinstance(block, numbers.Integral):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    block = int(block)
    if scale_mode == "block" and (block < 1 or n % block):
        raise ValueError(f"block={block} must be >= 1 and divide N={n} (x's last dimension)")
    if scale_mode == "static":
        if static_scale is None:
            raise ValueError("scale_mode='static' needs static_scale (the dequant scale)")
        input_scale = _static_scale(static_scale)
    else:
        if static_scale is not None:
            raise ValueError(
                f"static_scale is only used with scale_mode='static', got scale_mode={scale_mode!r}"
            )
        input_scale = None
    if lower_bound is not None:
        lower_bound = _positive(lower_bound, "lower_bound")
        if scale_mode == "static":
            raise ValueError(
                "lower_bound applies to computed (row / block) scales; with "
                "scale_mode='static' y is clipped to ±fp8_max"
            )
    scale_floor = _positive(scale_floor, "scale_floor")
    for flag, flag_name in (
        (return_y, "return_y"),
        (return_amax, "return_amax"),
        (packed, "packed"),
        (return_transposed, "return_transposed"),
    ):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__}")
    if packed and scale_mode != "row":
        raise ValueError(
            f"packed=True stores one scale per row: it needs scale_mode='row', got {scale_mode!r}"
        )
    chosen = dialect.current()
    if chosen == dialect.LEGACY:
        # what the legacy twin lacks (nki_rmsnorm.kernels.legacy.rmsnorm_quant says why)
        for flag, flag_name in ((packed, "packed"), (return_transposed, "return_transposed")):
            if flag:
                raise ValueError(
                    f"{flag_name}=True needs the NKI 0.6 kernel (trn2/trn3 on "
                    "SDK 2.31+); the legacy NKI dialect has no .ap access patterns"
                )
        if name == "float8_e4m3fn":
            raise ValueError(
                "quant_dtype=float8_e4m3fn is not a legacy NKI dtype: use "
                "float8_e4m3 (max 240) or float8_e5m2"
            )
    h_bytes = (residual if residual is not None else x).dtype.itemsize
    tile_bytes = n * (
        h_bytes
        + (x.dtype.itemsize if residual is not None else 0)
        + (4 + weight.dtype.itemsize if weight is not None else 0)
        + 1
        + (x.dtype.itemsize if return_y else 0)
        + (5 if return_transposed else 0)
    )
    if tile_bytes > _QUANT_TILE_BYTES:
        raise ValueError(
            f"x's last dimension N={n} is too long for the quantized kernel with "
            f"these options: a row tile needs {tile_bytes} bytes per partition, "
            f"at most {_QUANT_TILE_BYTES} fit"
        )

    lead = x.shape[:-1]
    rows = math.prod(lead)
    fp8 = np.dtype(getattr(ml_dtypes, name))
    blocks = n // block if scale_mode == "block" else 0
    if rows == 0:
        return QuantizedRMSNorm(
            np.empty(lead + (n + 4 if packed else n,), fp8),
            None
            if scale_mode == "static" or packed
            else np.empty(lead + ((blocks,) if blocks else ()), np.float32),
            np.empty(x.shape, x.dtype) if return_y else None,
            None if residual is None else np.empty(x.shape, residual.dtype),
            np.empty(lead, np.float32) if return_amax else None,
            np.empty((n, 0), fp8) if return_transposed else None,
            np.empty((n, 0), np.float32) if return_transposed and scale_mode != "static" else None,
        )

    outputs = list(
        kernels.rmsnorm_quant(
            _rows(x, rows, n),
            None if residual is None else _rows(residual, rows, n),
            weight,
            input_scale,
            eps,
            kernels.nki_dtype(name, chosen),
            scale_mode,
            block,
            lower_bound,
            scale_floor,
            bool(return_y),
            bool(return_amax),
            bool(packed),
            bool(return_transposed),
        )
    )
    y_q = outputs.pop(0)
    scales = None
    if packed:
        y_q = y_q.reshape(lead + (n + 4,))
    else:
        y_q = y_q.reshape(x.shape)
        if scale_mode != "static":
            scales = outputs.pop(0).reshape(lead + ((blocks,) if blocks else ()))
    y = outputs.pop(0).reshape(x.shape) if return_y else None
    h = outputs.pop(0).reshape(x.shape) if residual is not None else None
    amax = outputs.pop(0).reshape(lead) if return_amax else None
    y_q_t = outputs.pop(0) if return_transposed else None
    scales_t = outputs.pop(0) if return_transposed and scale_mode != "static" else None
    return QuantizedRMSNorm(y_q, scales, y, h, amax, y_q_t, scales_t)
