"""A record of the kernel launches the simulator runs, for the binding tests: which front-end
(``legacy``: ``simulate``'s ``neuronxcc.nki`` surface; ``nki06``: ``simulate.nki06``) ran
which kernel function, on which thread. The bindings launch from XLA callback threads and
autograd threads, so the record is what shows that the dialect chosen around a call really
reached its kernels there."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading

import simulate.core.runtime as legacy_runtime
import simulate.nki06.runtime as nki06_runtime
import simulate.torch_neuronx as torch_neuronx_twin


@dataclasses.dataclass(frozen=True)
class Launch:
    dialect: str
    kernel: str
    thread: int


def record_launches(monkeypatch) -> list[Launch]:
    """Start recording every simulated kernel launch (until ``monkeypatch`` is undone); the
    returned list fills as kernels run, from any thread."""
    launches: list[Launch] = []

    def recorded(module, attribute, dialect_name):
        original = getattr(module, attribute)

        def launch(func, *args, **kwargs):
            kernel = func
            while isinstance(kernel, functools.partial):  # nki_call binds the constants
                kernel = kernel.func
            name = getattr(kernel, "__name__", repr(kernel))
            launches.append(Launch(dialect_name, name, threading.get_ident()))
            return original(func, *args, **kwargs)

        monkeypatch.setattr(module, attribute, launch)

    recorded(legacy_runtime, "run", "legacy")
    recorded(torch_neuronx_twin, "run", "legacy")  # imported by name there
    recorded(nki06_runtime, "launch", "nki06")
    return launches


def other_dialect() -> str:
    """The dialect that is not the process's default: choosing it must visibly change the
    kernels that run (the default is about to change from legacy to nki06)."""
    from nki_rmsnorm import dialect

    return dialect.NKI06 if dialect.current() == dialect.LEGACY else dialect.LEGACY


@contextlib.contextmanager
def simulated_dialect(name: str):
    """``use_dialect(name)`` for a test that traces JAX functions: the dialect is no part of
    ``jax.jit``'s cache key (it follows the target and the SDK, fixed in a process), so the
    traces made under the other dialect are dropped on entry and on exit."""
    from nki_rmsnorm import dialect

    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
    try:
        with dialect.use_dialect(name) as chosen:
            yield chosen
    finally:
        if jax is not None:
            jax.clear_caches()
