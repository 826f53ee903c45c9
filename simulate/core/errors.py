"""Errors the simulator raises where the NKI compiler or runtime would reject a kernel.

Every error derives from :class:`NKIError` and from the builtin exception the real
toolchain raises (or the one the spec suggests), and its message carries the key of the
official error manual (``err_...``) so a user can look it up there.
"""

from __future__ import annotations


class NKIError(Exception):
    """Base class of every error raised by the simulator for a kernel the hardware rejects."""

    key = "err_nki"

    def __init__(self, message: str, key: str | None = None):
        self.key = key or self.key
        self.message = message  # without the key: another front-end re-raises it in its words
        super().__init__(f"[{self.key}] {message}")


class NKISyntaxError(NKIError, SyntaxError):
    """Tile shapes the architecture cannot hold (e.g. more than 128 partitions)."""


class NKIValueError(NKIError, ValueError):
    """Shape, limit or convention violations."""


class NKITypeError(NKIError, TypeError):
    """Operand in the wrong memory, wrong operand types, control flow on index values."""


class NKIIndexError(NKIError, IndexError):
    """Out-of-bound or malformed tensor indexing."""


class NKIRuntimeError(NKIError, RuntimeError):
    """API used outside a kernel, nested gridded kernels, iterating an arange."""


class NKIControlFlowError(NKIError, TypeError, ValueError):
    """Python control flow on an index expression or mask (``if i_p < n:``, ``and``)."""


class NKIAssertionError(NKIError, AssertionError):
    """Rank-1 SBUF/PSUM tensors ("Insufficient rank!")."""


class CapacityError(NKIValueError):
    """SBUF or PSUM over capacity for the target."""

    key = "err_capacity_exceeded"


class SpillWarning(UserWarning):
    """The tiles a kernel keeps live at once need more SBUF or PSUM than the target has, so
    the compiler "inserts the necessary spills or refills" (aws-neuron-sdk@8a38e733
    general/nki/programming_model.rst L172-L175): the kernel runs, with extra DMA traffic
    between on-chip memory and HBM. Not an error: the errors manual has no over-capacity
    code for auto-allocated tiles (general/nki/api/nki.errors.rst)."""
