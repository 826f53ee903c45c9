"""``simulate``: a NumPy CPU simulator of the legacy NKI API (``neuronxcc.nki``).

Use it as ``import simulate as nki``, ``import simulate.language as nl``,
``import simulate.isa as nisa``, or call :func:`install` so that unmodified kernels that
``import neuronxcc.nki`` run on it when the Neuron compiler is not installed.
"""

from __future__ import annotations

import importlib.util
import sys

from . import compiler, isa, language, sdk, typing
from .approx import approx_bound, set_approx, use_approx
from .errors import CapacityError, NKIError
from .profiler import Profile, profile
from .runtime import (
    Kernel,
    baremetal,
    benchmark,
    jit,
    last_trace,
    simulate_kernel,
    trace_kernel,
)
from .sdk import RELEASES as SDK_RELEASES
from .sdk import sdk as use_sdk
from .sdk import sdk_version, set_sdk
from .targets import TARGETS, get_target
from .trace import Instruction, Trace

tensor = language.Tensor

__all__ = [
    "CapacityError", "Instruction", "Kernel", "NKIError", "Profile", "SDK_RELEASES",
    "TARGETS", "Trace", "approx_bound", "baremetal", "benchmark", "compiler", "get_target",
    "install", "isa", "jit", "language", "last_trace", "profile", "real_nki_available",
    "sdk_version", "set_approx", "set_sdk", "simulate_kernel", "trace_kernel", "typing",
    "use_approx", "use_sdk",
]

_ALIASES = {
    "neuronxcc.nki": sys.modules[__name__],
    "neuronxcc.nki.language": language,
    "neuronxcc.nki.isa": isa,
    "neuronxcc.nki.typing": typing,
    "neuronxcc.nki.compiler": compiler,
}


sdk.gate_module(sys.modules[__name__], "nki")


def real_nki_available() -> bool:
    """True when the real Neuron compiler (``neuronxcc.nki``) is importable."""
    if "neuronxcc" in sys.modules and getattr(sys.modules["neuronxcc"], "__simulated__", False):
        return False
    try:
        return importlib.util.find_spec("neuronxcc.nki") is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Make ``import neuronxcc.nki`` (and ``.language``, ``.isa``, ``.typing``,
    ``.compiler``) resolve to this simulator. Returns True when the aliases were installed,
    False (doing nothing) when the real Neuron compiler is present."""
    if real_nki_available():
        return False
    import types

    package = sys.modules.get("neuronxcc")
    if package is None or not getattr(package, "__simulated__", False):
        package = types.ModuleType("neuronxcc")
        package.__path__ = []
        package.__simulated__ = True
        sys.modules["neuronxcc"] = package
    package.nki = sys.modules[__name__]
    for name, module in _ALIASES.items():
        sys.modules[name] = module
    return True
