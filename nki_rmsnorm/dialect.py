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
import logging
import os
import sys
import warnings
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


# --- no silent fallback ------------------------------------------------------------------------
#: Set to anything but ``""``/``"0"``: a launch that would run on the simulator raises instead.
REQUIRE_DEVICE_ENV = "NKI_RMSNORM_REQUIRE_DEVICE"
#: Modules whose presence means a framework model is running (the INFO note is for them).
FRAMEWORK_BINDINGS = ("nki_rmsnorm.torch", "nki_rmsnorm.jax", "nki_rmsnorm.hf")
#: Messages already given in this process (each is given once).
_announced: set[str] = set()
#: :func:`_installation` per search path and loaded ``nki`` / ``neuronxcc`` modules: the
#: lookups take a few hundred µs, too much to repeat before every launch.
_installations: dict[tuple, tuple[str | None, bool]] = {}


def _legacy_sdk_release() -> tuple[int, int] | None:
    """The Neuron SDK release of the installed real ``neuronx-cc`` (SDK 2.x ships compiler
    2.(x - 5), see :data:`nki_rmsnorm.nki._COMPILER_TO_SDK_MINOR`); None without one."""
    if _real_module("neuronxcc.nki") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version

    from nki_rmsnorm.nki import _COMPILER_TO_SDK_MINOR

    try:
        major, minor = _version(version("neuronx-cc")) or (None, None)
    except PackageNotFoundError:
        return None
    return None if major is None else (major, minor + _COMPILER_TO_SDK_MINOR)


def unsupported_sdk() -> str | None:
    """A sentence naming an installed real NKI the kernels do not support (an ``nki`` outside
    :data:`NKI_VERSIONS` that decides nothing, or a legacy SDK outside 2.21 - 2.29) and what
    runs instead; None when the installation is supported or there is no real NKI at all."""
    from nki_rmsnorm.nki import NEWEST_SDK, OLDEST_SDK

    real = hardware_dialect()
    if real is None:
        runs = "the kernels will run on the CPU simulator instead (slow; no NeuronDevice is used)"
    else:
        runs = "the legacy neuronxcc.nki kernels will run instead"
    nki_version = real_nki_version()
    too_new = nki_version is not None and nki_version > NKI_VERSIONS[1]
    unused = nki_version is not None and nki_version < NKI_VERSIONS[0] and real is None
    if too_new or unused:
        lo, hi = NKI_VERSIONS
        return (
            f"nki {nki_version[0]}.{nki_version[1]} is installed, but the nki_rmsnorm kernels "
            f"support nki {lo[0]}.{lo[1]} - {hi[0]}.{hi[1]}: {runs}"
        )
    release = _legacy_sdk_release()
    if real == LEGACY and release is not None and not OLDEST_SDK <= release <= NEWEST_SDK:
        return (
            f"Neuron SDK {release[0]}.{release[1]} (neuronx-cc) is installed, but the legacy "
            f"nki_rmsnorm kernels support SDK {OLDEST_SDK[0]}.{OLDEST_SDK[1]} - "
            f"{NEWEST_SDK[0]}.{NEWEST_SDK[1]}: launching them raises RuntimeError"
        )
    return None


def _installation() -> tuple[str | None, bool]:
    """``(unsupported_sdk(), simulated())``, memoised on what decides them."""
    key = (tuple(sys.path), id(sys.modules.get("nki")), id(sys.modules.get("neuronxcc")))
    if key not in _installations:
        _installations[key] = (unsupported_sdk(), simulated())
    return _installations[key]


def check_launch() -> None:
    """Say what runs, before a kernel is resolved for a launch (called by
    :func:`nki_rmsnorm.kernels.kernel`): a ``RuntimeWarning``, once per message, when a real
    but unsupported NKI is installed (:func:`unsupported_sdk`); when the kernels are
    simulated, a ``RuntimeError`` if ``NKI_RMSNORM_REQUIRE_DEVICE`` is set, else one INFO
    log line if a framework binding is loaded (a model running on the CPU simulator is
    orders of magnitude slower than on a NeuronDevice)."""
    problem, simulated_here = _installation()
    if problem is not None and problem not in _announced:
        _announced.add(problem)
        warnings.warn(problem, RuntimeWarning, stacklevel=3)
    if not simulated_here:
        return
    if os.environ.get(REQUIRE_DEVICE_ENV, "") not in ("", "0"):
        raise RuntimeError(
            f"{REQUIRE_DEVICE_ENV} is set, but the kernels would run on the CPU simulator: "
            + (problem or "no Neuron SDK (nki 0.4 - 0.6 or neuronxcc.nki) is installed")
        )
    loaded = [m for m in FRAMEWORK_BINDINGS if m in sys.modules]
    if loaded and "simulated" not in _announced:
        _announced.add("simulated")
        logging.getLogger(__name__).info(
            "nki_rmsnorm kernels run on the CPU simulator (no Neuron SDK found; %s loaded); "
            "set %s=1 to make this an error",
            ", ".join(loaded),
            REQUIRE_DEVICE_ENV,
        )
