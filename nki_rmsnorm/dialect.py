"""Which NKI dialect the kernels run in: ``legacy`` (``neuronxcc.nki``, Neuron SDK 2.21 – 2.29)
or ``nki06`` (``nki`` 0.4 – 0.6, SDK 2.30 – 2.32). The dialect follows the hardware and the
SDK; it is not a user's choice.

* Trn1 and Inf2 (NeuronCore-v2) run the legacy kernels, always: NKI 0.x supports Trn2 and
  Trn3 only (aws-neuron-sdk@81ce03ae ``nki/nki_faq.rst`` L23–27), and from SDK 2.29 on
  Trn1/Inf2 users "should pin to release 2.28" of the NKI-based libraries, "as NKI 0.3.0
  kernels are not supported on Trn1/Inf2" (``release-notes/components/nxd-inference.rst``
  L61).
* Trn2 and Trn3 run the ``nki06`` kernels on SDK ≥ 2.30 (a real ``nki`` 0.4 – 0.6,
  :data:`NKI_VERSIONS`; from 2.30 any ``neuronxcc.nki`` in a kernel is a compile error,
  ``nki/migration/index.rst``, NKI 0.4 entry) and the legacy ones on SDK ≤ 2.29.

The hardware is the target ``NEURON_PLATFORM_TARGET_OVERRIDE`` names (:func:`target`; the
variable that sets the NKI compile target, ``nki/get-started/quickstart-implement-run-kernel.rst``
L242–244, and the simulator's, ``nki/guides/nki_simulator.rst`` L103). :func:`current` is:

1. with a real NKI installed (:func:`hardware_dialect`): ``legacy`` on trn1/inf2 (a
   ``RuntimeError`` when the SDK has only ``nki`` 0.x, which cannot compile for them), else
   the installed SDK's dialect;
2. in the simulator (no real NKI): ``legacy`` on a trn1/inf2 target; on trn2/trn3 or with
   no target named, the simulator override (:func:`use_dialect`, else :func:`set_dialect`,
   else the ``NKI_RMSNORM_DIALECT`` environment variable), else :data:`DEFAULT` (``nki06``).
   The override picks which SDK generation the simulator stands for (``nki06``: 2.30 – 2.32;
   ``legacy``: the emulated release, ``NKI_SIM_SDK``, 2.21 – 2.29); asking for ``nki06`` on a
   trn1/inf2 target is a ``ValueError`` naming both. With no target named each dialect's
   kernels run on its simulator's default target (``simulate.core.targets``: trn3 for
   ``nki06``, trn1 for ``legacy``).

The override is a simulator-only test hook: it is ignored while a real NKI is installed and
is no argument of any binding. :func:`use_dialect` is a context variable (per thread or
asyncio task; a thread started inside does not see it); :func:`set_dialect` and the
environment variable are process-wide. A launch resolves the dialect on the thread that runs
it; the JAX binding resolves it when a function is traced (a jitted function keeps it).

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
#: The environment variable that names the hardware target (the module docstring).
TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
#: NeuronCore-v2 hardware: the legacy dialect only (NKI 0.x supports Trn2/Trn3 only,
#: aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27).
LEGACY_ONLY_TARGETS = ("trn1", "inf2")
#: Hardware that runs the nki06 kernels on SDK >= 2.30 and the legacy ones before.
NKI06_TARGETS = ("trn2", "trn3")
#: The generation names the 0.6 simulator also accepts for the target
#: (``simulate.nki06.context``).
_TARGET_ALIASES = {"gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}
#: The simulator's dialect on trn2/trn3 (or no target) when no override chooses one: the
#: current NKI's (0.6), whose simulator defaults to trn3 (nki/guides/nki_simulator.rst
#: L117-118).
DEFAULT = NKI06
#: Real ``nki`` releases (major, minor) the 0.6 kernels are written for, oldest and newest:
#: 0.4 is the first release where ``neuronxcc.nki`` in a kernel is an error (SDK 2.30), 0.6
#: the current one (SDK 2.32).
NKI_VERSIONS = ((0, 4), (0, 6))

_chosen: str | None = None  # set_dialect()
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


def target() -> str | None:
    """The hardware target ``NEURON_PLATFORM_TARGET_OVERRIDE`` names (``trn1``, ``inf2``,
    ``trn2``, ``trn3``; ``gen2`` – ``gen4`` as the 0.6 simulator spells them), None when it is
    unset. A ``ValueError`` names the variable when it holds anything else."""
    name = os.environ.get(TARGET_ENV_VAR, "").strip().lower()
    if not name:
        return None
    name = _TARGET_ALIASES.get(name, name)
    if name not in LEGACY_ONLY_TARGETS + NKI06_TARGETS:
        raise ValueError(
            f"{TARGET_ENV_VAR} must name one of {LEGACY_ONLY_TARGETS + NKI06_TARGETS} (or "
            f"{', '.join(_TARGET_ALIASES)}), got {os.environ[TARGET_ENV_VAR]!r}"
        )
    return name


def _override() -> tuple[str | None, str]:
    """The simulator override in effect and where it comes from (None: no override)."""
    scoped = _scoped.get()
    if scoped is not None:
        return scoped, "use_dialect"
    if _chosen is not None:
        return _chosen, "set_dialect"
    value = os.environ.get(ENV_VAR)
    if value is None:
        return None, ENV_VAR
    return _check(value, ENV_VAR), ENV_VAR


def for_target(target_name: str | None) -> str:
    """The dialect the kernels run in on ``target_name`` (a target name, or None for no target
    named), by the rules of the module docstring."""
    if target_name is not None:
        target_name = _TARGET_ALIASES.get(target_name, target_name)
    legacy_only = target_name in LEGACY_ONLY_TARGETS
    real = hardware_dialect()
    if real is not None:
        if legacy_only and _real_module("neuronxcc.nki") is None:
            raise RuntimeError(
                f"the target is {target_name}, which runs the legacy neuronxcc.nki kernels "
                "(Neuron SDK 2.21 - 2.29), but the installed SDK has only nki "
                f"{'.'.join(map(str, real_nki_version() or ()))}, which supports Trn2 and "
                "Trn3 only (nki/nki_faq.rst); install an SDK up to 2.29 on Trn1/Inf2"
            )
        return LEGACY if legacy_only else real
    chosen, source = _override()
    if legacy_only:
        if chosen == NKI06:
            raise ValueError(
                f"{source} asks for the nki06 kernels, but the target is {target_name} "
                f"({TARGET_ENV_VAR}): Trn1 and Inf2 run the legacy kernels only (NKI 0.x "
                "supports Trn2 and Trn3, nki/nki_faq.rst); simulate trn2 or trn3 for nki06"
            )
        return LEGACY
    return chosen or DEFAULT


def current() -> str:
    """The dialect the kernels resolve to now, on the target :func:`target` names (see the
    module docstring for the rules)."""
    return for_target(target())


def set_dialect(name: str | None) -> None:
    """Simulator-only test hook: choose the simulator's dialect for the whole process (None:
    back to ``NKI_RMSNORM_DIALECT`` / the default). Ignored while a real NKI is installed (the
    SDK and the hardware decide then); ``nki06`` on a trn1/inf2 target is refused when the
    dialect is resolved."""
    global _chosen
    _chosen = None if name is None else _check(name, "dialect")


@contextlib.contextmanager
def use_dialect(name: str) -> Iterator[str]:
    """Simulator-only hook: run the simulator's kernels in dialect ``name`` inside the
    ``with`` block (this thread or task only); yields the dialect in effect, so ``nki06``
    on a trn1/inf2 target is a ``ValueError`` here. Tests choose a dialect with it, and the
    JAX binding carries the dialect it resolved at trace time into XLA's callback threads."""
    token = _scoped.set(_check(name, "dialect"))
    try:
        yield current()
    finally:
        _scoped.reset(token)


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
