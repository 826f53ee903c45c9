"""``nki.jit`` kernels (either dialect) called with traced JAX arrays: the call becomes one
operation of the XLA program, run in the simulator inside a ``buffer_callback``.

Part of the core so that both front-ends' ``Kernel.__call__`` use it without importing the
launcher twins above them (``simulate.jax_neuronx``, which uses it too). JAX is imported
only when a traced array is seen: importing the simulator never imports it.
"""

from __future__ import annotations

import sys

import numpy as np


def check_returned(returned, structs) -> list[np.ndarray]:
    """A return-convention kernel's outputs, checked against ``out_shape`` (never reshaped)."""
    returned = list(returned) if isinstance(returned, (tuple, list)) else [returned]
    if len(returned) != len(structs):
        raise ValueError(
            f"out_shape describes {len(structs)} output(s), the kernel returned {len(returned)}"
        )
    for i, (array, struct) in enumerate(zip(returned, structs)):
        expected = (tuple(struct.shape), np.dtype(struct.dtype))
        if (array.shape, array.dtype) != expected:
            raise ValueError(
                f"out_shape[{i}] is {expected[0]} {expected[1].name}, the kernel "
                f"returned {array.shape} {array.dtype.name}"
            )
    return returned


def is_traced(args, kwargs) -> bool:
    """Whether a kernel call has a traced JAX array among its arguments (the call is being
    traced by ``jax.jit``, ``grad``, ``vmap`` ...). Never imports JAX."""
    jax = sys.modules.get("jax")
    if jax is None:
        return False
    return any(isinstance(v, jax.core.Tracer) for v in (*args, *kwargs.values()))


def call_traced(launch, args, kwargs, name: str):
    """An ``nki.jit`` kernel called with traced JAX arrays, as the Neuron SDK handles it: the
    call becomes one operation of the XLA program (a custom call,
    ``nki/guides/framework_custom_op.rst`` lines 180-199) whose outputs the kernel itself
    defines. Here the kernel is launched once at trace time on zero-filled arrays of the
    arguments' shapes and dtypes, standing in for the compiler's trace of the kernel, to
    learn its outputs; the real launch runs when the program does, inside a
    ``buffer_callback`` on NumPy views of XLA's buffers (``simulate.jax_neuronx`` says why
    not ``jax.pure_callback``).
    ``launch(args, kwargs)`` runs the kernel on NumPy arrays and returns its outputs;
    return-convention kernels only (a kernel that returns nothing has no outputs to give)."""
    import jax
    from jax.experimental.buffer_callback import buffer_callback

    def is_array(v):
        return isinstance(v, (jax.core.Tracer, jax.Array, np.ndarray))

    keys = list(kwargs)
    values = [*args, *(kwargs[k] for k in keys)]
    flags = [is_array(v) for v in values]

    def rebuild(arrays):
        arrays = iter(arrays)
        filled = [next(arrays) if flag else v for v, flag in zip(values, flags)]
        return filled[: len(args)], dict(zip(keys, filled[len(args) :]))

    zeros = [np.zeros(v.shape, np.dtype(v.dtype)) for v, flag in zip(values, flags) if flag]
    sample = launch(*rebuild(zeros))
    if sample is None:
        raise TypeError(
            f"kernel {name!r} returned nothing: called with JAX arrays, an nki.jit kernel "
            "must return its outputs"
        )
    single = not isinstance(sample, tuple)
    samples = (sample,) if single else sample
    result_types = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in samples)

    def on_host(_context, outputs, *buffers):
        returned = launch(*rebuild(np.asarray(b) for b in buffers))
        for out, array in zip(outputs, check_returned(returned, result_types)):
            np.asarray(out)[...] = array

    arrays = [v for v, flag in zip(values, flags) if flag]
    results = buffer_callback(on_host, result_types, vmap_method="sequential")(*arrays)
    return results[0] if single else tuple(results)
