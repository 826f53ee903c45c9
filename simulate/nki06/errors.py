"""The exceptions the ``nki`` 0.6 front-end raises.

NKI 0.6 has no error codes (the legacy error guide was removed, RN 0.1); the official
simulator raises ordinary Python exceptions at the offending call, e.g. ``AssertionError:
tensor_tensor data1 partition dimension 256 exceeds maximum 128``
(aws-neuron-sdk ``nki/guides/nki_simulator.rst@81ce03ae``, line 269), and
``nisa.NkiValidationError`` is the documented type for hardware-constraint violations
(``nki/api/nki/isa/__init__.py@81ce03ae``, line 168). Every error here is an
``NkiValidationError`` that is also an ``AssertionError`` (the documented simulator
behaviour), also the natural builtin where there is one, and also the legacy
:class:`simulate.core.errors.NKIError` so code written against the legacy front-end catches both.
"""

from __future__ import annotations

from simulate.core.errors import NKIError


class NkiValidationError(NKIError, AssertionError):
    """``nisa.NkiValidationError``: a hardware constraint is violated."""

    key = "nki06"

    def __init__(self, message: str):
        # no "[err_...]" prefix: 0.6 messages carry no error codes
        Exception.__init__(self, message)


class NkiTypeError(NkiValidationError, TypeError):
    """An argument of the wrong kind (enum, buffer, memory, dtype)."""


class NkiValueError(NkiValidationError, ValueError):
    """A value outside what the API accepts (launch degree, returned buffer, shapes)."""


class NkiIndexError(NkiValidationError, IndexError):
    """An index or slice outside a tensor."""


class NkiRuntimeError(NkiValidationError, RuntimeError):
    """An API used where it cannot run (outside a kernel, a jit kernel inside a kernel)."""


class NkiDeadlockError(NkiRuntimeError):
    """The programs of an LNC launch wait for each other (divergent control flow)."""


def enforce(check, *args, **kwargs) -> None:
    """Run one of the core's rules (:mod:`simulate.core.rules`) for this front-end: its
    error becomes this front-end's exception of the same kind, with the same message and no
    error key."""
    try:
        check(*args, **kwargs)
    except NkiValidationError:
        raise
    except NKIError as exc:
        kind = (
            NkiTypeError
            if isinstance(exc, TypeError)
            else NkiValueError
            if isinstance(exc, ValueError)
            else NkiValidationError
        )
        raise kind(getattr(exc, "message", str(exc))) from None
