"""``simulate.nki06``: the ``nki`` 0.6 front-end (Neuron SDK 2.32) of the simulator.

It binds the 0.6 signatures (``import nki``, ``nki.language``, ``nki.isa``, ``nki.typing``,
``nki.jit``, ``nki.simulate``, ``kernel[lnc]``) onto the simulator's core: dtypes and
rounding (:mod:`simulate.dtypes`), storage and SBUF/PSUM capacity accounting
(:mod:`simulate.memory`), target limits (:mod:`simulate.targets`), operator math
(:mod:`simulate.functions`), what each engine computes (:mod:`simulate.core.semantics`), the
engine, operator, dtype and memory rules both dialects share, parametrized by dialect
(:mod:`simulate.core.rules`), and the instruction trace the cost model reads
(:mod:`simulate.trace`). Sources: aws-neuron/aws-neuron-sdk ``nki/`` at ``81ce03ae``.

Use it as ``import simulate.nki06 as nki`` or call :func:`install` so that ``import nki``
resolves to it when the real ``nki`` package is absent.
"""

from __future__ import annotations

import importlib.util
import sys

from . import collectives, constants, dtypes, isa, language, typing
from .collectives import launch_ranks
from .errors import NkiValidationError
from .runtime import Kernel, jit, last_trace, simulate
from .tensor import NkiTensor

isa.constants = constants  # ``from nki.isa import constants`` (see :mod:`.constants`)
#: ``nki.dtype``: the type of an NKI dtype, as AWS's kernels annotate dtype parameters
#: (aws-neuron/nki-library@d2ad3a5 ``src/nkilib_src/nkilib/experimental/loss/cross_entropy.py``
#: L33; aws-neuron-sdk@81ce03ae ``nki/library/api/find-nonzero-indices.rst`` L46)
dtype = dtypes.NkiDtype
cpu_simulate = simulate  # NKILIB's harness name (test/utils/simulation_setup.py)
__simulated__ = True  # tells a shim that ``import nki`` found this front-end, not the SDK
__version__ = "0.6.0"  # the NKI release (Neuron SDK 2.32) whose API this front-end mirrors

__all__ = [
    "Kernel",
    "NkiTensor",
    "collectives",
    "NkiValidationError",
    "install",
    "isa",
    "jit",
    "language",
    "last_trace",
    "launch_ranks",
    "real_nki_available",
    "simulate",
    "typing",
]


def _removed(name):
    def removed(*args, **kwargs):
        raise NotImplementedError(
            f"nki.{name} was removed in NKI 0.2: use nki.simulate(kernel)"
            "(...) or call the @nki.jit kernel"
        )

    removed.__name__ = name
    return removed


baremetal = _removed("baremetal")
benchmark = _removed("benchmark")
profile = _removed("profile")
simulate_kernel = _removed("simulate_kernel")

_ALIASES = {
    "nki": sys.modules[__name__],
    "nki.language": language,
    "nki.isa": isa,
    "nki.isa.constants": constants,
    "nki.typing": typing,
    "nki.collectives": collectives,
}


def real_nki_available() -> bool:
    """True when a real ``nki`` package (not this front-end) is importable."""
    loaded = sys.modules.get("nki")
    if loaded is not None:
        return not getattr(loaded, "__simulated__", False)
    try:
        return importlib.util.find_spec("nki") is not None
    except (ImportError, ValueError):
        return False


def install() -> bool:
    """Make ``import nki`` (and ``nki.language``, ``nki.isa``, ``nki.typing``) resolve to this
    front-end. Returns False, doing nothing, when the real ``nki`` is importable."""
    if real_nki_available():
        return False
    sys.modules.update(_ALIASES)
    return True
