"""Which NKI dialect the kernels run in: ``legacy`` (``neuronxcc.nki``, Neuron SDK 2.21 – 2.29)
or ``nki06`` (``nki`` 0.4 – 0.6, SDK 2.30 – 2.32).

The kernels exist once per dialect (:mod:`nki_rmsnorm.kernels.legacy`,
:mod:`nki_rmsnorm.kernels.nki06`, identical file and function names). :func:`current` picks
one, in this order:

1. a real ``nki`` package whose version the 0.6 kernels support (:data:`NKI_VERSIONS`) →
   ``nki06``: from SDK 2.30 (NKI 0.4) any ``neuronxcc.nki`` inside a kernel is a compile error
   (nki/migration/index.rst, NKI 0.4 entry; ``../shared/nki06_api_spec.md`` version table);
2. else the real Neuron compiler's ``neuronxcc.nki`` → ``legacy``;
3. else neither is installed and the kernels run on the simulator (:mod:`simulate`), in the
   dialect a setting chooses: :func:`use_dialect` (a context manager, per thread / task),
   else :func:`set_dialect`, else the ``NKI_RMSNORM_DIALECT`` environment variable
   (``legacy`` or ``nki06``), else :data:`DEFAULT` (``nki06``).

:func:`use_dialect` is a context variable: the thread (or asyncio task) that enters it sees
it, a thread started inside does not. :mod:`nki_rmsnorm.ops` resolves the kernel on the
caller's thread; the bindings carry the caller's dialect to the threads they launch on.

A module that says ``__simulated__`` (the simulator's front-ends) is never taken for a real
``nki`` or ``neuronxcc``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
import sys
from collections.abc import Iterator

LEGACY = "legacy"
NKI06 = "nki06"
DIALECTS = (LEGACY, NKI06)
ENV_VAR = "NKI_RMSNORM_DIALECT"
#: The simulator's dialect when nothing chooses one: the current NKI's (issue 10: "else
#: simulate with the dialect chosen by a setting (default 0.6)"). Every entry point and
#: regime exists in both dialects; choose ``legacy`` with :func:`use_dialect`,
#: :func:`set_dialect` or ``NKI_RMSNORM_DIALECT=legacy``.
DEFAULT = NKI06
#: Real ``nki`` releases (major, minor) the 0.6 kernels are written for, oldest and newest:
#: 0.4 is the first release where ``neuronxcc.nki`` in a kernel is an error (SDK 2.30), 0.6
#: the current one (SDK 2.32).
NKI_VERSIONS = ((0, 4), (0, 6))

_chosen: str | None = None  # set_dialect()
#: Framework caches keyed on the dialect (:func:`register_cache_key`).
_cache_keys: list = []
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "nki_rmsnorm_dialect", default=None
)


def _check(name: str, source: str) -> str:
    if name not in DIALECTS:
        raise ValueError(f"{source} must be one of {DIALECTS}, got {name!r}")
    return name


def _real_module(name: str):
    """The spec (or loaded module) of a real, non-simulated ``name``; None when absent."""
    for key in (name.partition(".")[0], name):
        if getattr(sys.modules.get(key), "__simulated__", False):
            return None
    if name in sys.modules:
        return sys.modules[name]
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _version(value: str) -> tuple[int, int] | None:
    try:
        major, minor = value.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def real_nki_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the installed real ``nki`` package; None when there is none (or
    only the simulator's front-end) or its version cannot be read."""
    if _real_module("nki") is None:
        return None
    module = sys.modules.get("nki")
    value = getattr(module, "__version__", None) if module is not None else None
    if value is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            value = version("nki")
        except PackageNotFoundError:
            return None
    return _version(str(value))


def hardware_dialect() -> str | None:
    """The dialect the installed Neuron SDK compiles, or None when only the simulator runs."""
    version = real_nki_version()
    if version is not None and NKI_VERSIONS[0] <= version <= NKI_VERSIONS[1]:
        return NKI06
    if _real_module("neuronxcc.nki") is not None:
        return LEGACY
    return None


def simulated() -> bool:
    """True when the kernels run on :mod:`simulate` (no real NKI installed)."""
    return hardware_dialect() is None


def current() -> str:
    """The dialect the kernels resolve to now (see the module docstring for the order)."""
    real = hardware_dialect()
    if real is not None:
        return real
    scoped = _scoped.get()
    if scoped is not None:
        return scoped
    if _chosen is not None:
        return _chosen
    return _check(os.environ.get(ENV_VAR, DEFAULT), ENV_VAR)


def set_dialect(name: str | None) -> None:
    """Choose the simulator's dialect for the whole process (None: back to the environment
    variable / default). Ignored while a real NKI is installed: the SDK decides then."""
    global _chosen
    _chosen = None if name is None else _check(name, "dialect")
    for key in _cache_keys:
        key.set_global(_chosen)


@contextlib.contextmanager
def use_dialect(name: str) -> Iterator[str]:
    """Run the simulator's kernels in dialect ``name`` inside the ``with`` block (this thread
    or task only); yields the dialect in effect."""
    token = _scoped.set(_check(name, "dialect"))
    try:
        with contextlib.ExitStack() as keys:
            for key in _cache_keys:
                keys.enter_context(key(name))
            yield current()
    finally:
        _scoped.reset(token)


def register_cache_key(key) -> None:
    """Make a framework's trace cache follow the dialect: ``key`` is a
    ``jax.make_user_context()`` (or anything with its interface: ``key(value)`` a context
    manager, ``key.set_global(value)``); :func:`use_dialect` enters ``key(name)`` and
    :func:`set_dialect` calls ``key.set_global(name)``, so a function traced with one
    dialect's kernels is traced again for another (the JAX binding registers one)."""
    if key not in _cache_keys:
        _cache_keys.append(key)
        key.set_global(_chosen)
