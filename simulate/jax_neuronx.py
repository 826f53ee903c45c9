"""A simulated ``jax_neuronx``: ``nki_call`` on the CPU, for machines without the Neuron SDK.

``nki_call(kernel, *args, out_shape=..., grid=())`` has the signature of the JAX launcher that
Neuron SDK 2.20 - 2.22 shipped (``jax_neuronx.nki_call``; end of support announced in
``general/announcements/neuron2.x/announce-eos-jax-neuronx-nki-call.rst``@8a38e733, line 10,
removed in jax-neuronx 0.5.3.1.0, ``release-notes/jax-neuronx/index.rst``@8a38e733, line 39):
the kernel is in the output-parameter convention and receives ``*args`` followed by one
preallocated output per ``out_shape`` entry, which it writes in place
(``general/nki/examples/rmsnorm/rmsnorm_jax.py``@72825d50, lines 29-33). A kernel that
returns its outputs instead has them checked against ``out_shape``. ``out_shape`` that
disagrees with the kernel (output count, or the returned shapes and dtypes) is an error
naming ``out_shape``; nothing is reshaped. Compile-time constants
are bound beforehand with ``functools.partial``; non-array arguments (numbers, strings, None)
are passed to the kernel unchanged.

Here the kernel runs in the simulator inside a ``jax.experimental.buffer_callback``, so the
call works under ``jit``, ``vmap`` (one launch per batch element) and inside ``shard_map``
(one launch per device, on that device's shard); gradients come from the caller's
``custom_vjp``, as with the real launcher. The callback reads XLA's own input buffers and
writes XLA's output buffers in place: it never converts a ``jax.Array`` argument, which is what
makes ``jax.pure_callback`` deadlock when several devices or threads run callbacks at once
(``np.asarray`` of an argument waits for a transfer that XLA's busy worker threads never run).

:func:`install` registers this module as ``jax_neuronx`` when the real package is absent.
JAX is imported lazily: importing :mod:`simulate` never imports it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import sys

import numpy as np

from .core import runtime
from .core.jax_calls import check_returned

__all__ = ["install", "nki_call"]

#: Marks this module as the simulated stand-in (a real ``jax_neuronx`` has no such attribute).
__simulated__ = True


def _out_structs(out_shape):
    """``(structs, single)``: the output descriptions as a tuple, and whether one was given."""
    single = hasattr(out_shape, "shape") and hasattr(out_shape, "dtype")
    structs = (out_shape,) if single else out_shape
    if (
        not isinstance(structs, (tuple, list))
        or not structs
        or not all(hasattr(s, "shape") and hasattr(s, "dtype") for s in structs)
    ):
        raise TypeError(
            "out_shape must be a jax.ShapeDtypeStruct or a non-empty tuple of them, "
            f"got {out_shape!r}"
        )
    return tuple(structs), single


def _returns_outputs(func) -> bool:
    """Whether the kernel uses the return convention (``return y``) rather than writing
    output parameters, judged from its bytecode."""
    base = func.func if isinstance(func, functools.partial) else func
    return bool(runtime.returns_value(base))


def _kernel_function(kernel):
    """The plain Python function behind ``kernel`` (an ``nki.jit`` kernel, a plain function or
    a ``functools.partial`` of either), the kernel's own grid (``kernel[g0, g1]``) and its
    ``platform_target`` (None: the simulator's default)."""
    if isinstance(kernel, functools.partial):
        inner, grid, target = _kernel_function(kernel.func)
        return functools.partial(inner, *kernel.args, **kernel.keywords), grid, target
    runtime.check_legacy_kernel(kernel, "jax_neuronx.nki_call")
    func, grid, target = runtime._unwrap(kernel)
    return func, tuple(grid or ()), target


def _check_output_count(func, n_args: int, n_outputs: int) -> None:
    """The kernel must take exactly the inputs and then one parameter per ``out_shape`` entry
    (parameters bound by ``functools.partial`` keywords or with defaults excluded)."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return
    if len(positional) != n_args + n_outputs:
        raise ValueError(
            f"out_shape describes {n_outputs} output(s), but the kernel takes "
            f"{len(positional) - n_args} output parameter(s) after its {n_args} input(s) "
            f"(parameters: {', '.join(p.name for p in positional)})"
        )


def _poison(array: np.ndarray) -> None:
    """Fill an output buffer with a value no correct kernel leaves behind (XLA's buffers are
    uninitialised; a kernel that skips elements must not pass by luck)."""
    if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
        array[...] = np.nan
    elif array.dtype.kind in "iu":
        array[...] = np.iinfo(array.dtype).max


def nki_call(kernel, *args, out_shape, grid=()):
    """Launch an output-parameter NKI ``kernel`` on ``args`` in the simulator.

    Args:
        kernel: ``nki.jit`` kernel or plain function (optionally a ``functools.partial``
            binding constants) taking ``*args`` and then one output per ``out_shape`` entry.
        args: JAX (or NumPy) arrays; non-array values are passed to the kernel as they are.
        out_shape: a ``jax.ShapeDtypeStruct`` or a tuple of them, the outputs' shapes and
            dtypes, in the kernel's parameter order.
        grid: SPMD launch grid (``()``: one instance).

    Returns:
        One ``jax.Array`` for a single ``out_shape``, else a tuple in ``out_shape``'s order.
    """
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    structs, single = _out_structs(out_shape)
    func, kernel_grid, target = _kernel_function(kernel)
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    grid = grid or kernel_grid
    returns = _returns_outputs(func)
    _check_output_count(func, len(args), 0 if returns else len(structs))
    is_array = [hasattr(a, "shape") and hasattr(a, "dtype") for a in args]
    arrays = [jax.numpy.asarray(a) for a, flag in zip(args, is_array) if flag]
    result_types = tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in structs)

    def on_host(_context, outputs, *buffers):
        views = iter(np.asarray(b) for b in buffers)
        kernel_args = [next(views) if flag else a for a, flag in zip(args, is_array)]
        outputs = [np.asarray(o) for o in outputs]
        for out in outputs:
            _poison(out)
        try:
            if returns:
                returned, _, _ = runtime.run(func, kernel_args, {}, grid=grid, target=target)
                for out, array in zip(outputs, check_returned(returned, structs)):
                    out[...] = array
            else:
                runtime.run(
                    func,
                    (*kernel_args, *outputs),
                    {},
                    grid=grid,
                    target=target,
                    expected_outputs=len(outputs),
                )
        except Exception as error:
            described = ", ".join(f"{tuple(s.shape)} {np.dtype(s.dtype).name}" for s in structs)
            name = getattr(getattr(func, "func", func), "__name__", "kernel")
            raise ValueError(
                f"nki_call: kernel {name!r} failed with "
                f"the outputs out_shape describes ({described}): "
                f"{type(error).__name__}: {error}"
            ) from error

    results = buffer_callback(on_host, result_types, vmap_method="sequential")(*arrays)
    return results[0] if single else tuple(results)


def install() -> bool:
    """Register this module as ``jax_neuronx`` unless the real package is importable (never
    shadows it). Returns True when the simulated module was registered."""
    existing = sys.modules.get("jax_neuronx")
    if existing is not None:
        return existing is sys.modules[__name__]
    try:
        if importlib.util.find_spec("jax_neuronx") is not None:
            return False
    except (ImportError, ValueError):
        pass
    sys.modules["jax_neuronx"] = sys.modules[__name__]
    return True
