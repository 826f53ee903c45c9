"""``simulate``: a NumPy CPU simulator of the legacy NKI API (``neuronxcc.nki``).

Use it as ``import simulate as nki``, ``import simulate.language as nl``,
``import simulate.isa as nisa``, or call :func:`install` so that unmodified kernels that
``import neuronxcc.nki`` run on it when the Neuron compiler is not installed.

The entry points (``jit``, ``baremetal``, ``benchmark``, ``simulate_kernel``,
``trace_kernel``, ``profile``, ``last_trace``) also take ``nki`` 0.6 kernels
(:mod:`simulate.nki06`), which run on their own front-end; a plain function written against
0.6, or a 0.6 kernel handed to the legacy launcher twins, is a one-line error naming the way
to launch it.
"""

from __future__ import annotations

import importlib.util
import sys

from . import torch_neuronx as _torch_neuronx
from .core import (
    approx,
    dtypes,
    errors,
    functions,
    indexing,
    instructions,
    loop_index,
    memory,
    rules,
    runtime,
    scoping,
    sdk,
    targets,
    trace,
)
from .core.approx import approx_bound, set_approx, use_approx
from .core.errors import CapacityError, NKIError
from .core.runtime import (
    Kernel,
    baremetal,
    benchmark,
    jit,
    last_trace,
    simulate_kernel,
    trace_kernel,
)
from .core.sdk import RELEASES as SDK_RELEASES
from .core.sdk import sdk as use_sdk
from .core.sdk import sdk_version, set_sdk
from .core.targets import TARGETS, get_target
from .core.trace import Instruction, Trace
from .legacy import compiler, isa, language, typing
from .perf import cost, profiler
from .perf.profiler import Profile, profile

runtime.register_benchmark_reporter(profiler.benchmark_result_from_trace)

# The modules' paths before the core / perf / legacy layout (``simulate.language``,
# ``simulate.cost``, ...) name the same module objects, so old imports and ``sys.modules``
# aliases keep working.
for _module in (
    approx,
    compiler,
    cost,
    dtypes,
    errors,
    functions,
    indexing,
    instructions,
    isa,
    language,
    loop_index,
    memory,
    profiler,
    rules,
    runtime,
    scoping,
    sdk,
    targets,
    trace,
    typing,
):
    sys.modules[f"{__name__}.{_module.__name__.rpartition('.')[2]}"] = _module
sys.modules[f"{__name__}.tensor"] = sys.modules[f"{__name__}.core.tensor"]
del _module

tensor = language.Tensor  # ``nki.tensor``: the class (the module is ``simulate.core.tensor``)
# ``nki.trace``: the decorator (the module stays importable as ``simulate.trace``)
trace = runtime.trace

__all__ = [
    "CapacityError",
    "Instruction",
    "Kernel",
    "NKIError",
    "Profile",
    "SDK_RELEASES",
    "TARGETS",
    "Trace",
    "approx_bound",
    "baremetal",
    "benchmark",
    "compiler",
    "get_target",
    "install",
    "isa",
    "jit",
    "language",
    "last_trace",
    "profile",
    "real_nki_available",
    "sdk_version",
    "set_approx",
    "set_sdk",
    "simulate_kernel",
    "trace_kernel",
    "typing",
    "use_approx",
    "use_sdk",
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
    ``.compiler``) resolve to this simulator, and ``from torch_neuronx import nki_jit`` to its
    CPU twin when ``torch_neuronx`` is not installed. Returns True when the aliases were
    installed, False (doing nothing) when the real Neuron compiler is present. Also makes
    ``import nki`` resolve to the ``nki`` 0.6 front-end when the real ``nki`` is absent."""
    from .nki06 import install as install_nki06  # the 0.6 front-end loads only when asked

    install_nki06()
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
    _torch_neuronx.install()
    importlib.import_module(f"{__name__}.jax_neuronx").install()  # jax_neuronx.nki_call
    return True
