"""JAX bindings: ``rms_norm`` and ``fused_add_rms_norm`` as ``jax.custom_vjp`` functions.

Both normalise over the last axis and are differentiable in every array argument; they work
under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.shard_map``. The forward and the
backward rule each launch one NKI kernel:

* on a Neuron backend (``jax.default_backend() == "neuron"`` with the Neuron compiler
  installed) the ``nki.jit`` kernels are called with the traced arrays, which the SDK
  (≥ 2.21) lowers to a custom call in the XLA program;
* elsewhere the kernels run in the NKI simulator through :mod:`nki_rmsnorm.ops`, inside a
  ``jax.pure_callback``.

Batching (``vmap``) of the callbacks: the forward pass is row-wise, so it uses
``vmap_method="expand_dims"`` and runs all batch elements in one launch when the weight and
bias are shared by them (the usual case), one launch per element when they are batched too.
The backward pass reduces ``dweight``/``dbias`` over rows, and under ``vmap`` each batch
element needs its own sums (per-example gradients; ``grad`` of a ``vmap`` sums them
afterwards), so it uses ``vmap_method="sequential"``: one launch per batch element.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from nki_rmsnorm import ops

__all__ = ["fused_add_rms_norm", "rms_norm"]

#: Input dtypes the kernels take (no float64 on the NeuronCore engines).
SUPPORTED_DTYPES = tuple(np.dtype(d) for d in (jnp.float32, jnp.float16, jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one call: the kernel constants and the argument dtypes."""

    eps: float
    offset: float
    casting_mode: str
    x_dtype: np.dtype
    bias_dtype: np.dtype | None
    residual_dtype: np.dtype | None


# ---------------------------------------------------------------------------------------------
# Validation (at trace time, before anything is launched), with the binding's argument names.
# ---------------------------------------------------------------------------------------------


def _check_array(name: str, a, shape, dtypes) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array or None, got {type(a).__name__}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    if np.dtype(a.dtype) not in dtypes:
        allowed = " or ".join(d.name for d in dict.fromkeys(dtypes))
        raise TypeError(f"{name} must be {allowed}, got {np.dtype(a.dtype).name}")


def _config(x, weight, bias, residual, eps, offset, casting_mode) -> _Config:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    x_dtype = np.dtype(x.dtype)
    if x_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"x dtype {x_dtype.name} is not supported by the NKI kernels; "
            "expected float32, float16 or bfloat16"
        )
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (the normalised axis)")
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError("x must have a non-empty last (normalised) axis")
    eps, offset = ops.check_options(eps, offset, weight, casting_mode)
    param_dtypes = (np.dtype(np.float32), x_dtype)
    if weight is not None:
        _check_array("weight", weight, (hidden,), param_dtypes)
    if bias is not None:
        _check_array("bias", bias, (hidden,), param_dtypes)
    if residual is not None:
        # An fp32 residual stream beside low-precision activations is allowed; h has its dtype.
        _check_array("residual", residual, x.shape, (x_dtype, np.dtype(np.float32)))
    return _Config(
        eps=float(eps),
        offset=float(offset),
        casting_mode=casting_mode,
        x_dtype=x_dtype,
        bias_dtype=None if bias is None else np.dtype(bias.dtype),
        residual_dtype=None if residual is None else np.dtype(residual.dtype),
    )


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _on_neuron() -> bool:
    if jax.default_backend() != "neuron":
        return False
    from nki_rmsnorm import nki

    return not nki.SIMULATED


def _varying_axes(a) -> frozenset:
    """The ``shard_map`` mesh axes along which ``a`` varies (empty outside ``shard_map`` or
    with ``check_vma=False``)."""
    aval = jax.typeof(a)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _vary_like(arrays, *like):
    """``arrays`` marked as varying along every mesh axis any of ``like`` varies along.

    Under ``shard_map(check_vma=True)`` the callback outputs carry no such type of their own,
    and a replicated weight combined with row-sharded ``x`` must enter the ``custom_vjp`` as
    varying, so that its gradient (a per-shard partial sum) is ``psum``-ed when transposed.
    """
    axes = frozenset().union(*(_varying_axes(a) for a in like if a is not None))

    def vary(a):
        missing = tuple(sorted(axes - _varying_axes(a), key=str))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return [None if a is None else vary(a) for a in arrays]


#: The simulator keeps one global kernel context, and XLA runs the callbacks of different
#: devices (``shard_map``, ``pmap``) on different threads: launches take turns.
_SIMULATOR_LOCK = threading.Lock()


def _leading(a, batch_ndim):
    return () if a is None else tuple(a.shape[:batch_ndim])


def _forward_host(cfg: _Config, x, weight, bias, residual):
    """Simulated forward on host arrays with ``batch_ndim`` leading vmap dims (expand_dims).

    ``x``/``residual`` are ``(*batch, M, N)``, ``weight``/``bias`` ``(*batch, N)``, where
    every batch dim is either the full vmap size or 1 (that argument is not batched).
    """
    as_np = [None if a is None else np.asarray(a) for a in (x, weight, bias, residual)]
    x, weight, bias, residual = as_np
    batch_ndim = x.ndim - 2
    batch = np.broadcast_shapes(*(_leading(a, batch_ndim) for a in as_np))
    x = np.broadcast_to(x, batch + x.shape[batch_ndim:])
    if residual is not None:
        residual = np.broadcast_to(residual, x.shape)

    def launch(x, weight, bias, residual):
        with _SIMULATOR_LOCK:
            return ops.rms_norm_fwd(
                x, weight, cfg.eps, offset=cfg.offset, bias=bias, residual=residual,
                casting_mode=cfg.casting_mode,
            )

    if all(a is None or a.size == a.shape[-1] for a in (weight, bias)):
        # Weight and bias are the same for every batch element: one launch over all rows.
        shared = [None if a is None else a.reshape(a.shape[-1]) for a in (weight, bias)]
        return launch(x, *shared, residual)
    per_element = []
    for index in np.ndindex(*batch):
        def pick(a, index=index):
            return None if a is None else a[tuple(min(i, n - 1) for i, n in zip(index, a.shape))]

        per_element.append(launch(x[index], pick(weight), pick(bias), pick(residual)))
    return tuple(np.stack(parts).reshape(batch + parts[0].shape) for parts in zip(*per_element))


def _backward_host(cfg: _Config, dy, x_or_h, weight, rstd, dh):
    with _SIMULATOR_LOCK:
        dx, dweight, dbias = ops.rms_norm_bwd(
            np.asarray(dy), np.asarray(x_or_h), None if weight is None else np.asarray(weight),
            np.asarray(rstd), offset=cfg.offset, has_bias=cfg.bias_dtype is not None,
            dh_out=None if dh is None else np.asarray(dh), casting_mode=cfg.casting_mode,
        )
    grads = [dx]
    if weight is not None:
        grads.append(dweight.astype(np.asarray(weight).dtype, copy=False))
    if cfg.bias_dtype is not None:
        grads.append(dbias.astype(cfg.bias_dtype, copy=False))
    return tuple(grads)


def _neuron_kernels():
    from nki_rmsnorm import kernels

    return kernels.rmsnorm_fwd, kernels.rmsnorm_bwd


def _launch_forward(cfg: _Config, x, weight, bias, residual):
    """``(y, rstd)`` or ``(y, h, rstd)`` for 2-D ``x``."""
    if _on_neuron():
        # The nki.jit kernels take JAX arrays directly (return convention, SDK >= 2.21;
        # jax_neuronx.nki_call, 2.20 - 2.22, only takes output-parameter kernels).
        fwd_kernel, _ = _neuron_kernels()
        options = (cfg.eps, cfg.offset, cfg.casting_mode, None)
        if residual is None:
            outputs = fwd_kernel(x, weight, bias, *options)
        else:
            from nki_rmsnorm import kernels

            outputs = kernels.rmsnorm_add_fwd(x, residual, weight, bias, *options)
    else:
        result = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
        if residual is not None:
            result.append(jax.ShapeDtypeStruct(x.shape, residual.dtype))
        result.append(jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32))
        outputs = jax.pure_callback(
            functools.partial(_forward_host, cfg), tuple(result), x, weight, bias, residual,
            vmap_method="expand_dims",
        )
    return tuple(_vary_like(outputs, x, weight, bias, residual))


def _launch_backward(cfg: _Config, dy, x_or_h, weight, rstd, dh):
    """``(dx, dweight, dbias)`` (None for absent ones) for 2-D ``dy``."""
    has_bias = cfg.bias_dtype is not None
    if _on_neuron():
        _, bwd_kernel = _neuron_kernels()
        grads = bwd_kernel(dy, x_or_h, weight, rstd, dh, cfg.offset, has_bias, cfg.casting_mode)
    else:
        result = [jax.ShapeDtypeStruct(x_or_h.shape, x_or_h.dtype)]
        if weight is not None:
            result.append(jax.ShapeDtypeStruct(weight.shape, weight.dtype))
        if has_bias:
            result.append(jax.ShapeDtypeStruct(x_or_h.shape[-1:], cfg.bias_dtype))
        grads = jax.pure_callback(
            functools.partial(_backward_host, cfg), tuple(result), dy, x_or_h, weight, rstd,
            dh, vmap_method="sequential",
        )
    grads = _vary_like(grads, dy, x_or_h, weight, rstd, dh)
    dx = grads.pop(0)
    dweight = grads.pop(0) if weight is not None else None
    dbias = grads.pop(0).astype(cfg.bias_dtype) if has_bias else None
    return dx, dweight, dbias


# ---------------------------------------------------------------------------------------------
# custom_vjp over 2-D (rows, hidden) arrays
# ---------------------------------------------------------------------------------------------


def _forward(cfg: _Config, x, weight, bias, residual):
    """``(outputs, rstd)``: outputs ``(y,)`` or ``(y, h)``."""
    if x.shape[0] == 0:
        outputs = (jnp.zeros(x.shape, x.dtype),)
        if residual is not None:
            outputs += (jnp.zeros(x.shape, residual.dtype),)
        return outputs, jnp.zeros(x.shape[:-1], jnp.float32)
    *outputs, rstd = _launch_forward(cfg, x, weight, bias, residual)
    return tuple(outputs), rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm_2d(cfg: _Config, x, weight, bias, residual):
    return _forward(cfg, x, weight, bias, residual)[0]


def _rms_norm_2d_fwd(cfg: _Config, x, weight, bias, residual):
    outputs, rstd = _forward(cfg, x, weight, bias, residual)
    x_or_h = x if residual is None else outputs[1]
    return outputs, (x_or_h, weight, rstd)


def _rms_norm_2d_bwd(cfg: _Config, saved, cotangents):
    x_or_h, weight, rstd = saved
    dy = cotangents[0]
    dh = cotangents[1] if cfg.residual_dtype is not None else None
    if x_or_h.shape[0] == 0:
        dx = jnp.zeros(x_or_h.shape, x_or_h.dtype)
        dweight = None if weight is None else jnp.zeros(weight.shape, weight.dtype)
        dbias = None
        if cfg.bias_dtype is not None:
            dbias = jnp.zeros(x_or_h.shape[-1:], cfg.bias_dtype)
    else:
        dx, dweight, dbias = _launch_backward(cfg, dy, x_or_h, weight, rstd, dh)
    dresidual = None if cfg.residual_dtype is None else dx.astype(cfg.residual_dtype)
    return dx.astype(cfg.x_dtype), dweight, dbias, dresidual


_rms_norm_2d.defvjp(_rms_norm_2d_fwd, _rms_norm_2d_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def rms_norm(x, weight=None, eps=1e-6, *, offset=0.0, bias=None, casting_mode="gemma"):
    """RMSNorm over the last axis: ``y = x · rsqrt(mean(x²) + eps) · (weight + offset) + bias``.

    Args:
        x: ``(..., H)``, float32, float16 or bfloat16.
        weight: ``(H,)``, float32 or ``x``'s dtype, or None (no scale).
        eps: added to the mean square.
        offset: added to the weight in fp32 (Gemma's ``1 + w``).
        bias: ``(H,)``, float32 or ``x``'s dtype, added after scaling, or None.
        casting_mode: "gemma" (fp32 math, one rounding), "llama" (``x·rstd`` rounded to
            ``x``'s dtype before the weight multiply, as HF LlamaRMSNorm) or "none".

    Returns:
        ``y`` of ``x``'s shape and dtype; differentiable in ``x``, ``weight`` and ``bias``.
    """
    cfg = _config(x, weight, bias, None, eps, offset, casting_mode)
    hidden = x.shape[-1]
    weight, bias = _vary_like((weight, bias), x)
    (y,) = _rms_norm_2d(cfg, jnp.reshape(x, (-1, hidden)), weight, bias, None)
    return jnp.reshape(y, x.shape)


def fused_add_rms_norm(
    x, residual, weight, eps=1e-6, *, offset=0.0, bias=None, casting_mode="gemma"
):
    """``h = x + residual`` and ``y = rms_norm(h)`` over the last axis, in one kernel.

    Arguments as :func:`rms_norm`; ``residual`` has ``x``'s shape and its dtype or float32
    (an fp32 residual stream).

    Returns:
        ``(y, h)`` of ``x``'s shape, ``y`` in ``x``'s dtype and ``h`` in the residual's;
        differentiable in ``x``, ``residual``, ``weight`` and ``bias`` through both outputs.
    """
    if residual is None:
        raise TypeError("residual must be an array, got None; use rms_norm without one")
    cfg = _config(x, weight, bias, residual, eps, offset, casting_mode)
    hidden = x.shape[-1]
    x, residual, weight, bias = _vary_like((x, residual, weight, bias), x, residual)
    y, h = _rms_norm_2d(
        cfg, jnp.reshape(x, (-1, hidden)), weight, bias, jnp.reshape(residual, (-1, hidden))
    )
    return jnp.reshape(y, x.shape), jnp.reshape(h, x.shape)
