"""Engine semantics that still live inside the legacy front-end's instruction functions,
reached by calling them with mapped arguments (to move into the core; see the package
docstring).

The legacy functions need the legacy run context (a process-wide global) and legacy tiles,
so each call runs under a lock in a throwaway legacy context on SBUF stand-in copies of the
0.6 operands (shaped ``(partitions, elements per partition)``), asks for a float32 result and
returns its values with the legacy trace record, whose engine/opcode/details the 0.6 record
reuses.
"""

from __future__ import annotations

import threading

import numpy as np

from simulate import instructions as legacy_instructions
from simulate import runtime as legacy_runtime

from . import dtypes as dt
from .errors import NkiRuntimeError
from .tensor import NkiTensor

_LOCK = threading.Lock()


def _stand_in(t: NkiTensor):
    values = t.values()
    if t.dtype not in dt._CORE_KNOWN or not dt.precise_fp():
        values = values.astype(np.float32)
    values = np.ascontiguousarray(values)
    return legacy_instructions.allocate(values.shape, values.dtype, "sbuf", fill=values)


def call(fn, target, **arguments):
    """``fn(**arguments)`` with every :class:`NkiTensor` replaced by a legacy stand-in tile.
    Returns (result values, the legacy trace record)."""
    with _LOCK:
        if legacy_runtime._context is not None:
            raise NkiRuntimeError(
                "a legacy (neuronxcc.nki) kernel is running in this process; "
                "the nki 0.6 front-end cannot run beside it"
            )
        ctx = legacy_runtime.Context(target)
        legacy_runtime._context = ctx
        try:
            mapped = {
                k: _stand_in(v) if isinstance(v, NkiTensor) else v for k, v in arguments.items()
            }
            result = fn(**mapped)
            return np.array(result.data, copy=True), ctx.trace.instructions[-1]
        finally:
            legacy_runtime._context = None
