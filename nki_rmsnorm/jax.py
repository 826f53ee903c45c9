"""JAX bindings: ``rms_norm`` and ``fused_add_rms_norm`` as ``jax.custom_vjp`` functions.

Both normalise over the last axis and are differentiable in every array argument; they work
under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.shard_map``, and from several
threads at once. The forward and the backward rule each launch one NKI kernel, through the
path :func:`launch_path` picks:

* ``"nki_call"``: ``jax_neuronx.nki_call`` with the output-parameter kernels, where the
  installed ``jax_neuronx`` has it (Neuron SDK 2.20 - 2.22 on a Neuron backend; on CPU the
  simulated twin that ``simulate.install()`` registers);
* ``"nki.jit"``: on a Neuron backend without ``nki_call`` (SDK >= 2.23), the
  return-convention ``nki.jit`` kernels called with the traced arrays, which the SDK lowers
  to a custom call in the XLA program;
* ``"simulator"``: elsewhere, the kernels run in the NKI simulator through
  :mod:`nki_rmsnorm.ops`, inside a ``jax.experimental.buffer_callback`` that works on NumPy
  views of XLA's own buffers (see :func:`_host_call` for why not ``jax.pure_callback``).

``vmap``: each launch is a ``custom_vmap``; the forward runs all batch elements' rows in one
launch when the weight and bias are shared by them (the usual case), the backward one launch
per element (each needs its own ``dweight``/``dbias`` sums: per-example gradients).

Dialect: the NKI dialect of the kernels (:mod:`nki_rmsnorm.dialect`: the target hardware
and the installed SDK decide; no argument chooses it) is resolved when a function is traced,
on the caller's thread, and is part of the launch's static configuration, which the host
callbacks on XLA's threads launch. It is no part of ``jax.jit``'s cache key: the target and
the SDK do not change within a process (a jitted function keeps the dialect it was traced
with, also when the simulator's test override changes).

Sharding: rows whose split over mesh axes is visible in the traced type (``Explicit`` axes)
stay where they are: the binding runs the launch in a ``shard_map`` over that mesh
(:func:`_on_own_rows`), and JAX reduces the parameters' gradients.
"""

from __future__ import annotations

from nki_rmsnorm._optional import require

require("jax", extra="jax")  # a missing jax is an ImportError naming the extra

import dataclasses
import functools
import importlib
import importlib.util
import logging
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.buffer_callback import buffer_callback
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import PartitionSpec as P

from nki_rmsnorm import _jax_ffi, dialect, kernels, mx, ops, validation

__all__ = [
    "LAUNCH_PATHS",
    "fused_add_rms_norm",
    "launch_path",
    "rms_norm",
    "rms_norm_heads",
    "rms_norm_mx_quant",
    "rms_norm_qk",
    "rms_norm_quant",
]

logger = logging.getLogger(__name__)

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
    #: The kernels' NKI dialect, resolved on the tracing (caller's) thread.
    dialect: str


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


def _check_static(**constants) -> None:
    """``eps`` and ``offset`` are kernel constants, fixed when the function is traced: a
    traced value (``jax.jit(rms_norm)(x, w, 1e-5)`` traces every positional argument) is a
    ``TypeError`` that says how to keep them static."""
    for name, value in constants.items():
        if isinstance(value, jax.core.Tracer):
            raise TypeError(
                f"{name} must be a Python number, got a traced value ({type(value).__name__}): "
                f"it is a constant of the kernel, fixed at trace time. Keep it static: "
                f"jax.jit(rms_norm, static_argnames=('{name}',)), or "
                f"jax.jit(functools.partial(rms_norm, {name}=...)), or close over it"
            )


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
    _check_static(eps=eps, offset=offset)
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
        dialect=dialect.current(),
    )


# ---------------------------------------------------------------------------------------------
# Launch paths
# ---------------------------------------------------------------------------------------------

#: How the kernels are launched, most specific first (see :func:`launch_path`).
LAUNCH_PATHS = ("nki_call", "nki.jit", "simulator")


def _on_neuron() -> bool:
    """A Neuron backend with a real NKI (``nki`` 0.5 - 0.6 or ``neuronxcc.nki``) to compile
    the kernels."""
    return jax.default_backend() == "neuron" and not dialect.simulated()


def _jax_neuronx():
    """The ``jax_neuronx`` module (real, or simulate's twin once registered), or None."""
    module = sys.modules.get("jax_neuronx")
    if module is not None:
        return module
    try:
        found = importlib.util.find_spec("jax_neuronx") is not None
    except (ImportError, ValueError):
        found = False
    return importlib.import_module("jax_neuronx") if found else None


def launch_path(dialect_name: str | None = None) -> str:
    """How :func:`rms_norm` and :func:`fused_add_rms_norm` launch their kernels when traced now.

    * ``"nki_call"``: ``jax_neuronx.nki_call`` with the output-parameter kernels
      (``rmsnorm_fwd_out``, ``rmsnorm_add_fwd_out``, ``rmsnorm_bwd_out``), when a
      ``jax_neuronx`` with ``nki_call`` is importable: the Neuron SDK's on a Neuron backend
      (jax-neuronx up to SDK 2.22; removed in 2.23), or ``simulate.jax_neuronx``'s CPU twin
      after ``simulate.install()``; legacy kernels only (``dialect_name``, default
      :func:`nki_rmsnorm.dialect.current`): ``nki_call`` is gone before the first ``nki``
      0.4 release (SDK 2.30);
    * ``"nki.jit"``: on a Neuron backend without ``nki_call`` (SDK >= 2.23): the
      return-convention ``nki.jit`` kernels called with the traced arrays;
    * ``"simulator"``: on any other backend, the return-convention kernels run in the NKI
      simulator through :mod:`nki_rmsnorm.ops` inside a host callback.

    The path is chosen when a function is traced (a jitted function keeps the path it was
    traced with) and logged at DEBUG level on this module's logger.
    """
    if dialect_name is None:
        dialect_name = dialect.current()
    module = _jax_neuronx() if dialect_name == dialect.LEGACY else None
    on_neuron = _on_neuron()
    if hasattr(module, "nki_call") and (on_neuron or getattr(module, "__simulated__", False)):
        return "nki_call"
    return "nki.jit" if on_neuron else "simulator"


def _structs(*described):
    """``jax.ShapeDtypeStruct`` for each ``(shape, dtype)``."""
    return tuple(jax.ShapeDtypeStruct(tuple(shape), dtype) for shape, dtype in described)


def _forward_outputs(cfg: _Config, x):
    """Shapes and dtypes of ``(y, [h], rstd)`` for 2-D ``x``."""
    described = [(x.shape, x.dtype)]
    if cfg.residual_dtype is not None:
        described.append((x.shape, cfg.residual_dtype))
    described.append((x.shape[:1], jnp.float32))
    structs = _structs(*described)
    validation.check_forward_outputs(
        x.dtype, structs[0].dtype, structs[-1].dtype, cfg.residual_dtype,
        structs[1].dtype if cfg.residual_dtype is not None else None,
    )  # fmt: skip
    return structs


def _backward_outputs(cfg: _Config, x_or_h, weight):
    """Shapes and dtypes of ``(dx, [dweight], [dbias])``."""
    described = [(x_or_h.shape, x_or_h.dtype)]
    if weight is not None:
        described.append((weight.shape, weight.dtype))
    if cfg.bias_dtype is not None:
        described.append((x_or_h.shape[1:], cfg.bias_dtype))
    structs = _structs(*described)
    validation.check_backward_outputs(
        x_or_h.dtype, None if weight is None else weight.dtype, structs[0].dtype,
        None if weight is None else structs[1].dtype, cfg.bias_dtype,
    )  # fmt: skip
    return structs


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


#: The simulator's run context is per thread (``simulate.core.runtime``), so launches from
#: XLA's callback threads (one per device under ``shard_map``) and from user threads need no
#: lock. The host functions below only touch NumPy views of XLA's own buffers.


def _simulate_forward(cfg: _Config, outputs, x, weight, bias, residual) -> None:
    """Host side of the ``"simulator"`` path: writes ``(y, [h], rstd)`` into ``outputs``.
    Runs on an XLA thread: the dialect comes from ``cfg``, not this thread's context."""
    with dialect.use_dialect(cfg.dialect):
        results = ops.rms_norm_fwd(
            x,
            weight,
            cfg.eps,
            offset=cfg.offset,
            bias=bias,
            residual=residual,
            casting_mode=cfg.casting_mode,
        )
    for out, result in zip(outputs, results):
        out[...] = result


def _simulate_backward(cfg: _Config, outputs, dy, x_or_h, weight, rstd, dh) -> None:
    """Host side of the ``"simulator"`` path: writes ``(dx, [dweight], [dbias])``, in
    ``cfg``'s dialect."""
    with dialect.use_dialect(cfg.dialect):
        dx, dweight, dbias = ops.rms_norm_bwd(
            dy,
            x_or_h,
            weight,
            rstd,
            offset=cfg.offset,
            has_bias=cfg.bias_dtype is not None,
            bias_dtype=cfg.bias_dtype,
            dh_out=dh,
            casting_mode=cfg.casting_mode,
        )
    results = [dx, dweight, dbias]
    for out, result in zip(outputs, [r for r in results if r is not None]):
        out[...] = result


def _host_call(host_function, result_types, *args):
    """Run ``host_function(outputs, *args)`` on NumPy views of XLA's buffers.

    ``jax.experimental.buffer_callback`` hands the callback XLA's own input and output
    buffers. ``jax.pure_callback`` instead ``device_put``s every argument to CPU device 0
    and hands over ``jax.Array``s; reading one (``np.asarray``) waits for that transfer,
    which runs on the XLA CPU client's worker threads — the same threads that are running
    the callbacks. With several devices (``shard_map``) or threads launching at once, every
    worker can be parked in a callback waiting for a transfer that no free worker runs: the
    deadlock (tests/bindings/dist_jax_threads.py reproduces it).
    """

    def on_host(_context, outputs, *buffers):
        host_function(
            [np.asarray(o) for o in outputs],
            *(None if b is None else np.asarray(b) for b in buffers),
        )

    return tuple(buffer_callback(on_host, result_types)(*args))


def _nki_call(kernel, args, result_types, **constants):
    """``jax_neuronx.nki_call`` of an output-parameter kernel with constants bound."""
    return tuple(
        _jax_neuronx().nki_call(
            functools.partial(kernel, **constants), *args, out_shape=result_types
        )
    )


def _launch_forward(cfg: _Config, x, weight, bias, residual):
    """``(y, rstd)`` or ``(y, h, rstd)`` for 2-D ``x``, through :func:`launch_path`."""
    path = launch_path(cfg.dialect)
    logger.debug("rms_norm forward %s launched through %s, %s kernels", x.shape, path, cfg.dialect)
    result_types = _forward_outputs(cfg, x)
    constants = dict(eps=cfg.eps, offset=cfg.offset, casting_mode=cfg.casting_mode)
    if path == "nki_call":
        if residual is None:
            return _nki_call(
                kernels.kernel("rmsnorm_fwd_out", cfg.dialect),
                (x, weight, bias),
                result_types,
                **constants,
            )
        return _nki_call(
            kernels.kernel("rmsnorm_add_fwd_out", cfg.dialect),
            (x, residual, weight, bias),
            result_types,
            **constants,
        )
    if path == "nki.jit":
        # Return convention, called with the traced arrays as nki/guides/framework_custom_op.rst
        # (lines 150-165) calls a 0.6 kernel under jax.jit (legacy kernels: SDK >= 2.21).
        options = (cfg.eps, cfg.offset, cfg.casting_mode, None)
        if residual is None:
            return tuple(kernels.kernel("rmsnorm_fwd", cfg.dialect)(x, weight, bias, *options))
        return tuple(
            kernels.kernel("rmsnorm_add_fwd", cfg.dialect)(x, residual, weight, bias, *options)
        )
    arrays = (x, weight, bias, residual)
    if _partitioned_by_xla(x):
        present = tuple(a is not None for a in arrays)
        return _partitioned_forward(cfg, present, *(a for a in arrays if a is not None))
    return _host_call(_host_forward(cfg), result_types, *arrays)


def _launch_backward(cfg: _Config, dy, x_or_h, weight, rstd, dh):
    """``(dx, [dweight], [dbias])`` for 2-D ``dy``, through :func:`launch_path`."""
    path = launch_path(cfg.dialect)
    logger.debug(
        "rms_norm backward %s launched through %s, %s kernels", dy.shape, path, cfg.dialect
    )
    has_bias = cfg.bias_dtype is not None
    result_types = _backward_outputs(cfg, x_or_h, weight)
    if path == "nki_call":
        # nki_call passes the outputs positionally after the inputs, so an absent dweight
        # cannot be skipped while dbias is wanted: with a bias and no weight, a weight of
        # ones (exact: y = x̂·1 + b) stands in and its gradient is dropped.
        kernel_weight, dropped = weight, ()
        if weight is None and has_bias:
            kernel_weight = jnp.ones(x_or_h.shape[1:], x_or_h.dtype)
            result_types = (
                result_types[0],
                *_structs((x_or_h.shape[1:], x_or_h.dtype)),
                result_types[1],
            )
            dropped = (1,)
        absent = {} if kernel_weight is not None else {"dweight": None}
        if not has_bias:
            absent["dbias"] = None
        grads = _nki_call(
            kernels.kernel("rmsnorm_bwd_out", cfg.dialect),
            (dy, x_or_h, kernel_weight, rstd, dh),
            result_types,
            offset=cfg.offset,
            casting_mode=cfg.casting_mode,
            **absent,
        )
        return tuple(g for i, g in enumerate(grads) if i not in dropped)
    if path == "nki.jit":
        return tuple(
            kernels.kernel("rmsnorm_bwd", cfg.dialect)(
                dy,
                x_or_h,
                weight,
                rstd,
                dh,
                cfg.offset,
                has_bias,
                cfg.casting_mode,
                kernels.nki_dtype(
                    None if cfg.bias_dtype is None else cfg.bias_dtype.name, cfg.dialect
                ),
            )
        )
    arrays = (dy, x_or_h, weight, rstd, dh)
    if _partitioned_by_xla(x_or_h):
        present = tuple(a is not None for a in arrays)
        return _partitioned_backward(cfg, present, *(a for a in arrays if a is not None))
    return _host_call(_host_backward(cfg), result_types, *arrays)


# ---------------------------------------------------------------------------------------------
# GSPMD: rows sharded over Auto mesh axes stay sharded (custom_partitioning)
# ---------------------------------------------------------------------------------------------


@functools.cache
def _host_forward(cfg: _Config):
    """The forward's host function for ``cfg``, one object per configuration (the FFI
    target's registry holds it by identity)."""
    return functools.partial(_simulate_forward, cfg)


@functools.cache
def _host_backward(cfg: _Config):
    return functools.partial(_simulate_backward, cfg)


def _partitioned_by_xla(x) -> bool:
    """Whether XLA's SPMD partitioner places this launch: several devices, and not inside
    ``shard_map`` (there every array is already one device's block, and the launch is that
    device's own)."""
    if jax.device_count() < 2 or _varying_axes(x):
        return False
    return not getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())


def _row_axes(mesh, sharding, rows: int) -> tuple:
    """The mesh axes a partitioned launch splits its rows over: the row axes of the input's
    sharding (so the rows stay where they are), or every mesh axis when the input's rows are
    not split (each device then runs its own block instead of all devices the same rows);
    none when the rows do not divide evenly (XLA would pad the blocks with rows the kernel
    must not see)."""
    spec = tuple(getattr(sharding, "spec", ())) + (None,)
    entry = spec[0]
    axes = tuple(entry) if isinstance(entry, tuple) else (() if entry is None else (entry,))
    axes = axes or tuple(mesh.axis_names)
    count = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    return axes if count > 1 and rows % count == 0 else ()


def _named(mesh, *spec):
    return jax.sharding.NamedSharding(mesh, P(*spec))


def _rows_spec(axes):
    return (axes if len(axes) > 1 else axes[0]) if axes else None


def _forward_layout(present, mesh, arg_shapes):
    """``(argument shardings, result shardings)`` of a partitioned forward: the rows of ``x``
    and ``residual`` (and of ``y``, ``h``, ``rstd``) split over :func:`_row_axes`, the
    hidden axis whole, the parameters replicated."""
    x = arg_shapes[0]
    rows = _rows_spec(_row_axes(mesh, x.sharding, x.shape[0]))
    kinds = [kind for kind, flag in zip(("rows", "param", "param", "rows"), present) if flag]
    arguments = tuple(
        _named(mesh, rows, None) if kind == "rows" else _named(mesh, None) for kind in kinds
    )
    results = [_named(mesh, rows, None)]
    if present[3]:
        results.append(_named(mesh, rows, None))
    results.append(_named(mesh, rows))
    return arguments, tuple(results)


def _backward_layout(present, mesh, arg_shapes):
    """As :func:`_forward_layout` for ``(dy, x_or_h, [weight], rstd, [dh])`` →
    ``(dx, [dweight], [dbias])``; also the row axes, over which each device's partial
    ``dweight``/``dbias`` are summed."""
    x = arg_shapes[1]
    axes = _row_axes(mesh, x.sharding, x.shape[0])
    rows = _rows_spec(axes)
    kinds = ("rows", "rows", "param", "rstd", "rows")
    specs = {"rows": (rows, None), "param": (None,), "rstd": (rows,)}
    arguments = tuple(_named(mesh, *specs[kind]) for kind, flag in zip(kinds, present) if flag)
    return arguments, axes


def _ffi_forward(cfg: _Config, present, *arrays):
    """One device's forward launch (also the whole launch, unpartitioned)."""
    args = _unpack(arrays, present)
    return _jax_ffi.host_call(_host_forward(cfg), _forward_outputs(cfg, args[0]), *args)


def _ffi_backward_local(cfg: _Config, present, *arrays):
    args = _unpack(arrays, present)
    return _jax_ffi.host_call(_host_backward(cfg), _backward_outputs(cfg, args[1], args[2]), *args)


def _partition_forward(cfg, present, mesh, arg_shapes, result_shape):
    arguments, results = _forward_layout(present, mesh, arg_shapes)
    return mesh, functools.partial(_ffi_forward, cfg, present), results, arguments


def _infer_forward(cfg, present, mesh, arg_shapes, result_shape):
    return _forward_layout(present, mesh, arg_shapes)[1]


def _forward_rule(cfg, present, mesh, operand_types, result_types):
    operands = [f for f, flag in zip(("m n", "n", "n", "m n"), present) if flag]
    results = ["m n", "m n", "m"] if present[3] else ["m n", "m"]
    return f"{', '.join(operands)} -> {', '.join(results)}", {"need_replication_factors": ("n",)}


def _partition_backward(cfg, present, mesh, arg_shapes, result_shape):
    arguments, axes = _backward_layout(present, mesh, arg_shapes)
    rows = _rows_spec(axes)
    n_sums = len(result_shape) - 1

    def lower(*arrays):
        dx, *sums = _ffi_backward_local(cfg, present, *arrays)
        # Each device summed its own rows; the parameters' gradients are the sum over all.
        return (dx, *(jax.lax.psum(s, axes) if axes else s for s in sums))

    results = (_named(mesh, rows, None), *(_named(mesh, None) for _ in range(n_sums)))
    return mesh, lower, results, arguments


def _infer_backward(cfg, present, mesh, arg_shapes, result_shape):
    rows = _rows_spec(_backward_layout(present, mesh, arg_shapes)[1])
    return (_named(mesh, rows, None), *(_named(mesh, None) for _ in result_shape[1:]))


def _backward_rule(cfg, present, mesh, operand_types, result_types):
    operands = [f for f, flag in zip(("m n", "m n", "n", "m", "m n"), present) if flag]
    results = ["m n"] + ["n"] * (len(result_types) - 1)
    return f"{', '.join(operands)} -> {', '.join(results)}", {"need_replication_factors": ("n",)}


_partitioned_forward = custom_partitioning(_ffi_forward, static_argnums=(0, 1))
_partitioned_forward.def_partition(
    _partition_forward,
    infer_sharding_from_operands=_infer_forward,
    sharding_rule=_forward_rule,
)
_partitioned_backward = custom_partitioning(_ffi_backward_local, static_argnums=(0, 1))
_partitioned_backward.def_partition(
    _partition_backward,
    infer_sharding_from_operands=_infer_backward,
    sharding_rule=_backward_rule,
)


# ---------------------------------------------------------------------------------------------
# Batching (vmap) of a launch
# ---------------------------------------------------------------------------------------------


def _unpack(arrays, present):
    """Put None back where ``present`` says an optional argument was absent."""
    arrays = iter(arrays)
    return [next(arrays) if flag else None for flag in present]


@functools.cache
def _forward_op(cfg: _Config, present: tuple[bool, ...]):
    """The forward launch on ``(x, [weight], [bias], [residual])``, batched under ``vmap``:
    with the weight and bias shared by the batch (the usual case) all batch elements' rows
    go to one launch, else one launch per batch element."""
    op = custom_vmap(lambda *arrays: tuple(_launch_forward(cfg, *_unpack(arrays, present))))
    parameter_slots = {sum(present[:i]) for i in (1, 2) if present[i]}

    @op.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        if any(in_batched[i] for i in parameter_slots) or not in_batched[0]:
            return _sequential(op, axis_size, in_batched, arrays)
        rows = arrays[0].shape[:2]
        flat = [
            a if i in parameter_slots else a.reshape(-1, a.shape[-1])
            for i, a in enumerate(
                _broadcast_batched(axis_size, in_batched, arrays, skip=parameter_slots)
            )
        ]
        outputs = op(*flat)
        return tuple(o.reshape(rows + o.shape[1:]) for o in outputs), (True,) * len(outputs)

    return op


@functools.cache
def _backward_op(cfg: _Config, present: tuple[bool, ...]):
    """The backward launch on ``(dy, x_or_h, [weight], rstd, [dh])``; under ``vmap`` one
    launch per batch element, since each element needs its own ``dweight``/``dbias`` sums
    (per-example gradients; ``grad`` of a ``vmap`` sums them afterwards)."""
    op = custom_vmap(lambda *arrays: tuple(_launch_backward(cfg, *_unpack(arrays, present))))

    @op.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        return _sequential(op, axis_size, in_batched, arrays)

    return op


def _broadcast_batched(axis_size, in_batched, arrays, skip=()):
    """Every array except those in ``skip`` with a leading batch axis of ``axis_size``."""
    return [
        a if i in skip or batched else jnp.broadcast_to(a, (axis_size, *a.shape))
        for i, (a, batched) in enumerate(zip(arrays, in_batched))
    ]


def _sequential(op, axis_size, in_batched, arrays):
    """``vmap`` rule: one launch per batch element, results stacked."""
    per_element = [
        op(*(a[i] if batched else a for a, batched in zip(arrays, in_batched)))
        for i in range(axis_size)
    ]
    outputs = tuple(jnp.stack(parts) for parts in zip(*per_element))
    return outputs, (True,) * len(outputs)


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
    arrays = (x, weight, bias, residual)
    if launch_path(cfg.dialect) == "nki.jit":
        # The SDK's nki.jit call is its own custom call: it takes the arrays as they are.
        launched = _launch_forward(cfg, *arrays)
    else:
        present = tuple(a is not None for a in arrays)
        launched = _forward_op(cfg, present)(*(a for a in arrays if a is not None))
    *outputs, rstd = _vary_like(launched, *arrays)
    return tuple(outputs), rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm_2d(cfg: _Config, x, weight, bias, residual):
    return _forward(cfg, x, weight, bias, residual)[0]


def _rms_norm_2d_fwd(cfg: _Config, x, weight, bias, residual):
    # Differentiating: reject at trace time what the backward kernel cannot take, before the
    # forward is launched (the limit follows from the shape alone).
    validation.check_backward_hidden(x.shape[-1])
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
        arrays = (dy, x_or_h, weight, rstd, dh)
        if launch_path(cfg.dialect) == "nki.jit":
            grads = _launch_backward(cfg, *arrays)
        else:
            present = tuple(a is not None for a in arrays)
            grads = _backward_op(cfg, present)(*(a for a in arrays if a is not None))
        dx, *sums = _vary_like(grads, *arrays)
        dweight = sums.pop(0) if weight is not None else None
        dbias = sums.pop(0) if cfg.bias_dtype is not None else None
    dresidual = None if cfg.residual_dtype is None else dx.astype(cfg.residual_dtype)
    return dx.astype(cfg.x_dtype), dweight, dbias, dresidual


_rms_norm_2d.defvjp(_rms_norm_2d_fwd, _rms_norm_2d_bwd)


# ---------------------------------------------------------------------------------------------
# The forward with y in rmsnorm_tkg's transposed layout (ops.rms_norm_fwd's output_layout)
# ---------------------------------------------------------------------------------------------

#: Partitions of a NeuronCore: the leading axis of y in the transposed layout.
_PARTITIONS = 128


def _transposed_outputs(cfg: _Config, x):
    """Shapes and dtypes of ``(y_t, [h], rstd)`` for 2-D ``x``: y_t ``(128, M, N // 128)``."""
    rows, n = x.shape
    described = [((_PARTITIONS, rows, n // _PARTITIONS), x.dtype)]
    if cfg.residual_dtype is not None:
        described.append((x.shape, cfg.residual_dtype))
    described.append(((rows,), jnp.float32))
    return _structs(*described)


def _simulate_forward_transposed(cfg: _Config, outputs, x, weight, bias, residual) -> None:
    """Host side of the ``"simulator"`` path of the transposed forward, in ``cfg``'s
    dialect."""
    with dialect.use_dialect(cfg.dialect):
        results = ops.rms_norm_fwd(
            x,
            weight,
            cfg.eps,
            offset=cfg.offset,
            bias=bias,
            residual=residual,
            casting_mode=cfg.casting_mode,
            output_layout="transposed",
        )
    for out, result in zip(outputs, results):
        out[...] = result


def _forward_transposed(cfg: _Config, x, weight, bias, residual):
    """``(outputs, rstd)``: outputs ``(y_t,)`` or ``(y_t, h)``. Launched through
    ``nki.jit`` on a Neuron backend, else simulated in a host callback (the ``nki_call``
    path runs legacy kernels only, which have no transposed form)."""
    types = _transposed_outputs(cfg, x)
    if x.shape[0] == 0:
        *outputs, rstd = (jnp.zeros(t.shape, t.dtype) for t in types)
        return tuple(outputs), rstd
    if launch_path(cfg.dialect) == "nki.jit":
        options = (cfg.eps, cfg.offset, cfg.casting_mode, None)
        if residual is None:
            kernel = kernels.kernel("rmsnorm_fwd_transposed", cfg.dialect)
            launched = kernel(x, weight, bias, *options)
        else:
            kernel = kernels.kernel("rmsnorm_add_fwd_transposed", cfg.dialect)
            launched = kernel(x, residual, weight, bias, *options)
    else:
        host = functools.partial(_simulate_forward_transposed, cfg)
        launched = _host_call(host, types, x, weight, bias, residual)
    *outputs, rstd = launched
    return tuple(outputs), rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rms_norm_2d_transposed(cfg: _Config, x, weight, bias, residual):
    return _forward_transposed(cfg, x, weight, bias, residual)[0]


def _rms_norm_2d_transposed_fwd(cfg: _Config, x, weight, bias, residual):
    validation.check_backward_hidden(x.shape[-1])
    outputs, rstd = _forward_transposed(cfg, x, weight, bias, residual)
    x_or_h = x if residual is None else outputs[1]
    return outputs, (x_or_h, weight, rstd)


def _rms_norm_2d_transposed_bwd(cfg: _Config, saved, cotangents):
    """The row-layout backward on the gradient of y_t rearranged back to ``(M, N)`` rows:
    the transposed forward computes the same y, only stored elsewhere."""
    parts, rows, per_partition = cotangents[0].shape
    dy = jnp.reshape(jnp.transpose(cotangents[0], (1, 0, 2)), (rows, parts * per_partition))
    return _rms_norm_2d_bwd(cfg, saved, (dy, *cotangents[1:]))


_rms_norm_2d_transposed.defvjp(_rms_norm_2d_transposed_fwd, _rms_norm_2d_transposed_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def _row_sharding(x):
    """``(mesh, spec)`` when ``x``'s leading (row) axes are split over mesh axes whose
    sharding is part of the traced type (``Explicit`` axes, the default of
    ``jax.make_mesh``): ``spec`` keeps that split and replicates the hidden axis. None when
    the rows are not split that way (one device, replicated, ``Auto`` axes, or already
    inside ``shard_map``)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        return None
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == jax.sharding.AxisType.Explicit
    }
    leading = (tuple(sharding.spec) + (None,) * x.ndim)[: x.ndim - 1]
    used = {
        name
        for entry in leading
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    }
    if not used or not used <= explicit:
        return None
    return mesh, P(*leading, None)


def _on_own_rows(function, row_arrays, parameters):
    """``function(*row_arrays, *parameters)``, run by every device on its own rows when the
    rows are sharded (:func:`_row_sharding`): a ``shard_map`` over the mesh with the rows
    split as they are and the parameters replicated, so nothing is gathered; JAX ``psum``s
    the parameters' gradients over the row shards when it transposes the replication."""
    layout = _row_sharding(row_arrays[0])
    if layout is None:
        return function(*row_arrays, *parameters)
    mesh, spec = layout
    present = tuple(p is not None for p in parameters)

    def local(*arrays):
        return function(*arrays[: len(row_arrays)], *_unpack(arrays[len(row_arrays) :], present))

    def placed(a, a_spec):
        current = getattr(jax.typeof(a), "sharding", None)
        if current is not None and tuple(current.spec) == tuple(a_spec):
            return a
        return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, a_spec))

    arrays = [placed(a, spec) for a in row_arrays]
    arrays += [placed(p, P(*(None,) * p.ndim)) for p in parameters if p is not None]
    in_specs = (spec,) * len(row_arrays) + (P(),) * sum(present)
    out_specs = spec if len(row_arrays) == 1 else (spec,) * len(row_arrays)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*arrays)


def _eager_on_devices(x) -> bool:
    """A concrete array spread over several devices, outside any trace. Eagerly, JAX runs a
    ``custom_partitioning`` op on gathered inputs; under ``jax.jit`` XLA's partitioner sees
    the array's sharding (Auto axes included), so such a call is jitted."""
    return (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and len(x.sharding.device_set) > 1
    )


@functools.cache
def _jitted(rows_function, cfg: _Config, n_row_arrays: int):
    """``rows_function`` for ``cfg`` (rows arrays, then weight and bias) under ``jax.jit``."""

    def call(*arrays):
        rows, parameters = arrays[:n_row_arrays], arrays[n_row_arrays:]
        return _on_own_rows(functools.partial(rows_function, cfg), rows, parameters)

    return jax.jit(call)


def _rms_norm_rows(cfg: _Config, x, weight, bias):
    hidden = x.shape[-1]
    weight, bias = _vary_like((weight, bias), x)
    (y,) = _rms_norm_2d(cfg, jnp.reshape(x, (-1, hidden)), weight, bias, None)
    return jnp.reshape(y, x.shape)


def _fused_add_rms_norm_rows(cfg: _Config, x, residual, weight, bias):
    hidden = x.shape[-1]
    x, residual, weight, bias = _vary_like((x, residual, weight, bias), x, residual)
    y, h = _rms_norm_2d(
        cfg, jnp.reshape(x, (-1, hidden)), weight, bias, jnp.reshape(residual, (-1, hidden))
    )
    return jnp.reshape(y, x.shape), jnp.reshape(h, x.shape)


def rms_norm(
    x,
    weight=None,
    eps=1e-6,
    *,
    offset=0.0,
    bias=None,
    casting_mode="gemma",
    output_layout="rows",
):
    """RMSNorm over the last axis: ``y = x · rsqrt(mean(x²) + eps) · (weight + offset) + bias``.

    Args:
        x: ``(..., H)``, float32, float16 or bfloat16.
        weight: ``(H,)``, float32 or ``x``'s dtype, or None (no scale).
        eps: added to the mean square.
        offset: added to the weight in fp32 (Gemma's ``1 + w``).
        bias: ``(H,)``, float32 or ``x``'s dtype, added after scaling, or None.
        casting_mode: "gemma" (fp32 math, one rounding), "llama" (``x·rstd`` rounded to
            ``x``'s dtype before the weight multiply, as HF LlamaRMSNorm) or "none".
        output_layout: "rows" (default) or "transposed": y in the layout of nki-library's
            decode kernel ``rmsnorm_tkg``, ``(128, M, H // 128)`` with M the leading axes
            flattened and ``y_t[p, m, k] = y[m, p · (H // 128) + k]``
            (:func:`nki_rmsnorm.ops.rms_norm_fwd`), the same bits as "rows". Needs H
            divisible by 128 and the NKI 0.6 kernels (trn2/trn3). Differentiable (the
            backward is the row-layout one on the gradient rearranged back to rows); the
            rows are not kept sharded as "rows" keeps them (y_t has no row axis first).

    Returns:
        ``y`` of ``x``'s shape and dtype (``(128, M, H // 128)`` when transposed);
        differentiable in ``x``, ``weight`` and ``bias``.
    """
    cfg = _config(x, weight, bias, None, eps, offset, casting_mode)
    if ops.check_output_layout(output_layout, x, weight):
        weight, bias = _vary_like((weight, bias), x)
        rows = jnp.reshape(x, (-1, x.shape[-1]))
        return _rms_norm_2d_transposed(cfg, rows, weight, bias, None)[0]
    if _eager_on_devices(x):
        return _jitted(_rms_norm_rows, cfg, 1)(x, weight, bias)
    return _on_own_rows(functools.partial(_rms_norm_rows, cfg), (x,), (weight, bias))


def fused_add_rms_norm(
    x,
    residual,
    weight,
    eps=1e-6,
    *,
    offset=0.0,
    bias=None,
    casting_mode="gemma",
    output_layout="rows",
):
    """``h = x + residual`` and ``y = rms_norm(h)`` over the last axis, in one kernel.

    Arguments as :func:`rms_norm`; ``residual`` has ``x``'s shape and its dtype or float32
    (an fp32 residual stream); ``output_layout="transposed"`` gives ``y`` in rmsnorm_tkg's
    ``(128, M, H // 128)`` layout as in :func:`rms_norm`, ``h`` keeping ``x``'s shape.

    Returns:
        ``(y, h)`` of ``x``'s shape, ``y`` in ``x``'s dtype and ``h`` in the residual's;
        differentiable in ``x``, ``residual``, ``weight`` and ``bias`` through both outputs.
    """
    if residual is None:
        raise TypeError("residual must be an array, got None; use rms_norm without one")
    cfg = _config(x, weight, bias, residual, eps, offset, casting_mode)
    if ops.check_output_layout(output_layout, x, weight):
        x, residual, weight, bias = _vary_like((x, residual, weight, bias), x, residual)
        hidden = x.shape[-1]
        x_rows, residual_rows = (jnp.reshape(a, (-1, hidden)) for a in (x, residual))
        y_t, h = _rms_norm_2d_transposed(cfg, x_rows, weight, bias, residual_rows)
        return y_t, jnp.reshape(h, x.shape)
    if _eager_on_devices(x):
        return _jitted(_fused_add_rms_norm_rows, cfg, 2)(x, residual, weight, bias)
    return _on_own_rows(
        functools.partial(_fused_add_rms_norm_rows, cfg), (x, residual), (weight, bias)
    )


# ---------------------------------------------------------------------------------------------
# Quantized forward (inference: no gradient)
# ---------------------------------------------------------------------------------------------


def rms_norm_quant(
    x,
    weight=None,
    eps: float = 1e-6,
    *,
    residual=None,
    quant_dtype=None,
    scale_mode: str = "row",
    block: int = 128,
    static_scale=None,
    lower_bound: float | None = None,
    scale_floor: float = 1e-6,
    return_y: bool = False,
    return_amax: bool = False,
    packed: bool = False,
    return_transposed: bool = False,
) -> ops.QuantizedRMSNorm:
    """RMSNorm over the last axis, quantized to fp8 in one pass: the arguments and outputs of
    :func:`nki_rmsnorm.ops.rms_norm_quant`, as JAX arrays (fp8 outputs in ``jnp.float8_*``).

    Works under ``jax.jit`` (the launch is a host callback running the simulated kernel, as
    the ``"simulator"`` path of :func:`rms_norm`); not differentiable. ``static_scale`` is a
    Python float or a concrete one-element float32 array (checked when traced). Every
    argument is checked when the function is traced, before anything runs: the launcher's
    own checks run on zero-row stand-ins of the arrays' shapes and dtypes.
    """
    lead, n = tuple(x.shape[:-1]), x.shape[-1]

    def stand_in(a, name):
        if a is None:
            return None
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
        shape = (0,) + tuple(a.shape[1:]) if name != "weight" else tuple(a.shape)
        return np.empty(shape, np.dtype(a.dtype))

    if static_scale is not None and not isinstance(static_scale, (int, float, np.ndarray)):
        raise TypeError(
            "static_scale must be a Python float or a NumPy float32 array (a "
            f"static value), got {type(static_scale).__name__}"
        )
    options = dict(
        quant_dtype=quant_dtype,
        scale_mode=scale_mode,
        block=block,
        static_scale=static_scale,
        lower_bound=lower_bound,
        scale_floor=scale_floor,
        return_y=return_y,
        return_amax=return_amax,
        packed=packed,
        return_transposed=return_transposed,
    )
    x2 = x.reshape((-1, n)) if x.ndim != 1 else x.reshape((1, n))
    r2 = None if residual is None else residual.reshape(x2.shape)
    empty = ops.rms_norm_quant(
        stand_in(x2, "x"),
        stand_in(weight, "weight"),
        eps,
        residual=stand_in(r2, "residual"),
        **options,
    )
    rows = x2.shape[0]
    # rows lead every output but the transposed ones: y_q_t (N, M), scales_t (N, ⌈M / 128⌉)
    full_shapes = [None if a is None else (rows,) + a.shape[1:] for a in empty]
    full_shapes[5:] = [
        None if a is None else (n, c) for a, c in zip(empty[5:], (rows, -(-rows // 128)))
    ]
    present = [a for a in empty if a is not None]
    result_types = [
        jax.ShapeDtypeStruct(shape, a.dtype)
        for a, shape in zip(empty, full_shapes)
        if a is not None
    ]
    dialect_name = dialect.current()

    def host(outputs, x_host, weight_host, residual_host):
        with dialect.use_dialect(dialect_name):
            result = ops.rms_norm_quant(x_host, weight_host, eps, residual=residual_host, **options)
        for out, value in zip(outputs, [a for a in result if a is not None]):
            out[...] = value.reshape(out.shape)

    values = list(_host_call(host, result_types, x2, weight, r2))
    shaped = []
    transposed = [a is not None for a in empty[5:]].count(True)
    for i, (value, part) in enumerate(zip(values, present)):
        if i >= len(present) - transposed:
            shaped.append(value)
        else:
            shaped.append(value.reshape(lead + part.shape[1:]) if x.ndim != 1 else value[0])
    filled = iter(shaped)
    return ops.QuantizedRMSNorm(*(None if a is None else next(filled) for a in empty))


def rms_norm_mx_quant(
    x,
    weight=None,
    eps: float = 1e-6,
    *,
    residual=None,
    quant_dtype="float8_e4m3fn_x4",
    scale_dtype="float8_e8m0fnu",
) -> mx.MXQuantizedRMSNorm:
    """RMSNorm over the last axis, MXFP8-quantized in one pass on trn3: the arguments and
    outputs of :func:`nki_rmsnorm.mx.rms_norm_mx_quant`, as JAX arrays (``y_q`` uint32 bits
    (N / 4, M), ``scales`` (N / 32, M) in ``jnp.float8_e8m0fnu`` or uint8, ``h`` x's shape).

    Works under ``jax.jit`` (a host callback running the simulated kernel); not
    differentiable. Every argument is checked when the function is traced, on zero-row
    stand-ins of the arrays, before anything runs."""
    for a, name in ((x, "x"), (weight, "weight"), (residual, "residual")):
        if a is not None and (not hasattr(a, "shape") or not hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    n = x.shape[-1] if x.ndim else 0
    x2 = x.reshape((-1, n)) if x.ndim != 1 else x.reshape((1, n))
    r2 = None if residual is None else residual.reshape(x2.shape)
    rows = x2.shape[0]

    def stand_in(a):
        return None if a is None else np.empty((0,) + tuple(a.shape[1:]), np.dtype(a.dtype))

    weight_stand_in = None if weight is None else np.empty(weight.shape, np.dtype(weight.dtype))
    options = dict(quant_dtype=quant_dtype, scale_dtype=scale_dtype)
    empty = mx.rms_norm_mx_quant(
        stand_in(x2), weight_stand_in, eps, residual=stand_in(r2), **options
    )
    result_types = [
        jax.ShapeDtypeStruct((empty.y_q.shape[0], rows), empty.y_q.dtype),
        jax.ShapeDtypeStruct((empty.scales.shape[0], rows), empty.scales.dtype),
    ]
    if residual is not None:
        result_types.append(jax.ShapeDtypeStruct(x2.shape, np.dtype(residual.dtype)))
    dialect_name = dialect.current()

    def host(outputs, x_host, weight_host, residual_host):
        with dialect.use_dialect(dialect_name):
            result = mx.rms_norm_mx_quant(
                x_host, weight_host, eps, residual=residual_host, **options
            )
        for out, value in zip(outputs, [a for a in result if a is not None]):
            out[...] = value.reshape(out.shape)

    values = list(_host_call(host, result_types, x2, weight, r2))
    h = values[2].reshape(x.shape) if residual is not None else None
    return mx.MXQuantizedRMSNorm(values[0], values[1], h)


def _per_head(x, weight) -> bool:
    """Whether ``weight`` is a per-head ``(heads, head_dim)`` weight of ``x``."""
    return (
        weight is not None
        and weight.ndim == 2
        and x.ndim >= 2
        and (tuple(x.shape[-2:]) == tuple(weight.shape))
    )


def rms_norm_qk(
    q,
    k,
    q_weight=None,
    k_weight=None,
    eps: float = 1e-6,
    *,
    offset: float = 0.0,
    casting_mode: str = "gemma",
    out_dtype=None,
):
    """The query and key norms of an attention in one kernel launch: ``(y_q, y_k)``, the
    arguments and outputs of :func:`nki_rmsnorm.ops.rms_norm_qk` as JAX arrays (per-head
    ``(heads, head_dim)`` weights included), bit for bit
    what :func:`rms_norm` gives each alone. Works under ``jax.jit`` (the launch is a host
    callback running the simulated kernel, as the ``"simulator"`` path of :func:`rms_norm`)
    and is differentiable in q, k and the weights (a ``jax.custom_vjp``: the backward
    kernel per tensor, from the saved rstd). Every argument is checked when traced, before
    anything runs (the launcher's own checks, on zero-row stand-ins)."""
    for name, a in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        if a is not None and (not hasattr(a, "shape") or not hasattr(a, "dtype")):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    out = None if out_dtype is None else np.dtype(out_dtype)

    def stand_in(a, rows=True):
        if a is None:
            return None
        shape = ((0,) + tuple(a.shape[1:])) if rows and a.ndim > 1 else tuple(a.shape)
        return np.empty(shape, np.dtype(a.dtype))

    for a, name in ((q, "q"), (k, "k")):
        if a.ndim == 0 or a.shape[-1] == 0:
            raise ValueError(
                f"{name} must have a non-empty last (normalised) dimension, got shape "
                f"{tuple(a.shape)}"
            )
    # a per-head weight equal to a.shape[-2:] keeps the heads axis, (tokens, heads,
    # head_dim); any other weight meets the launcher's shape check on (rows, head_dim)
    q2, k2 = (
        a.reshape((-1,) + (tuple(w.shape) if _per_head(a, w) else tuple(a.shape[-1:])))
        for a, w in ((q, q_weight), (k, k_weight))
    )
    ops.rms_norm_qk_fwd(
        stand_in(q2),
        stand_in(k2),
        stand_in(q_weight, False),
        stand_in(k_weight, False),
        eps,
        offset=offset,
        casting_mode=casting_mode,
        out_dtype=out,
    )
    eps = validation.eps_value(eps)
    dialect_name = dialect.current()
    y_types = (
        jax.ShapeDtypeStruct(q2.shape, out or np.dtype(q.dtype)),
        jax.ShapeDtypeStruct(k2.shape, out or np.dtype(k.dtype)),
        jax.ShapeDtypeStruct(q2.shape[:-1], np.float32),
        jax.ShapeDtypeStruct(k2.shape[:-1], np.float32),
    )

    def forward_host(outputs, q_host, k_host, wq_host, wk_host):
        with dialect.use_dialect(dialect_name):
            result = ops.rms_norm_qk_fwd(
                q_host,
                k_host,
                wq_host,
                wk_host,
                eps,
                offset=offset,
                casting_mode=casting_mode,
                out_dtype=out,
            )
        for o, value in zip(outputs, result):
            o[...] = value

    def backward_host(outputs, dy, x, weight, rstd):
        with dialect.use_dialect(dialect_name):
            dx, dweight, _ = ops.rms_norm_bwd(
                dy,
                x,
                weight,
                rstd,
                offset=offset if weight is not None else 0.0,
                casting_mode=casting_mode,
            )
        outputs[0][...] = dx
        if weight is not None:
            outputs[1][...] = dweight

    @jax.custom_vjp
    def fused(q_rows, k_rows, wq, wk):
        return _host_call(forward_host, y_types, q_rows, k_rows, wq, wk)[:2]

    def fused_fwd(q_rows, k_rows, wq, wk):
        y_q, y_k, rstd_q, rstd_k = _host_call(forward_host, y_types, q_rows, k_rows, wq, wk)
        return (y_q, y_k), (q_rows, k_rows, wq, wk, rstd_q, rstd_k)

    def fused_bwd(saved, cotangents):
        q_rows, k_rows, wq, wk, rstd_q, rstd_k = saved
        grads = []
        for x, w, rstd, dy in (
            (q_rows, wq, rstd_q, cotangents[0]),
            (k_rows, wk, rstd_k, cotangents[1]),
        ):
            types = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
            if w is not None:
                types.append(jax.ShapeDtypeStruct(w.shape, w.dtype))
            result = _host_call(backward_host, types, dy.astype(x.dtype), x, w, rstd)
            grads.append((result[0], None if w is None else result[1]))
        (dq, dwq), (dk, dwk) = grads
        return dq, dk, dwq, dwk

    fused.defvjp(fused_fwd, fused_bwd)
    y_q, y_k = fused(q2, k2, q_weight, k_weight)
    return y_q.reshape(q.shape), y_k.reshape(k.shape)


def rms_norm_heads(x, weight, eps: float = 1e-6, *, offset: float = 0.0, casting_mode="gemma"):
    """RMSNorm over the last axis of ``x`` ``(..., heads, head_dim)`` with a per-head
    ``weight`` ``(heads, head_dim)`` (QK-norm with a weight per head): the row of head i is
    scaled by ``weight[i] + offset``, as :func:`nki_rmsnorm.ops.rms_norm_fwd` with a 2-D
    weight (the same bits). Works under ``jax.jit`` (a host callback running the simulated
    kernel) and is differentiable in x and the weight (a ``jax.custom_vjp``: the backward
    kernel in one launch with the 2-D weight, from the saved rstd; the weight's gradient is
    per head).
    head_dim · bytes ≤ 512 and heads ≤ 4 · (512 // head_dim), else a ``ValueError`` naming
    ``weight``; every argument is checked when traced, before anything runs."""
    for name, a in (("x", x), ("weight", weight)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if x.ndim < 2 or weight.ndim != 2 or tuple(x.shape[-2:]) != tuple(weight.shape):
        raise ValueError(
            "weight must have shape (heads, head_dim) = x.shape[-2:], got weight "
            f"{tuple(weight.shape)} for x {tuple(x.shape)}"
        )
    rows = x.reshape((-1,) + tuple(weight.shape))
    ops.rms_norm_fwd(
        np.empty((0,) + tuple(weight.shape), np.dtype(x.dtype)),
        np.empty(weight.shape, np.dtype(weight.dtype)),
        eps,
        offset=offset,
        casting_mode=casting_mode,
    )
    eps = validation.eps_value(eps)
    dialect_name = dialect.current()
    types = (
        jax.ShapeDtypeStruct(rows.shape, np.dtype(x.dtype)),
        jax.ShapeDtypeStruct(rows.shape[:2], np.float32),
    )

    def forward_host(outputs, x_host, w_host):
        with dialect.use_dialect(dialect_name):
            result = ops.rms_norm_fwd(x_host, w_host, eps, offset=offset, casting_mode=casting_mode)
        for o, value in zip(outputs, result):
            o[...] = value

    def backward_host(outputs, dy, x_host, w_host, rstd):
        with dialect.use_dialect(dialect_name):
            dx, dweight, _ = ops.rms_norm_bwd(
                dy, x_host, w_host, rstd, offset=offset, casting_mode=casting_mode
            )
        outputs[0][...] = dx
        outputs[1][...] = dweight

    @jax.custom_vjp
    def per_head(x_rows, w):
        return _host_call(forward_host, types, x_rows, w)[0]

    def per_head_fwd(x_rows, w):
        y, rstd = _host_call(forward_host, types, x_rows, w)
        return y, (x_rows, w, rstd)

    def per_head_bwd(saved, dy):
        x_rows, w, rstd = saved
        grad_types = (
            jax.ShapeDtypeStruct(x_rows.shape, x_rows.dtype),
            jax.ShapeDtypeStruct(w.shape, w.dtype),
        )
        return tuple(
            _host_call(backward_host, grad_types, dy.astype(x_rows.dtype), x_rows, w, rstd)
        )

    per_head.defvjp(per_head_fwd, per_head_bwd)
    return per_head(rows, weight).reshape(x.shape)
