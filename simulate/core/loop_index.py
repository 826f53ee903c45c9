"""Symbolic loop variables: the variable of a kernel-level Python ``range`` loop.

"Inside a NKI kernel, any use of Python ``range(...)`` will be replaced with
``sequential_range(...)`` by Neuron compiler"
(``general/nki/api/nki/language/__init__.py@8a38e733``, L1416-L1417; also
``general/nki/programming_model.rst@8a38e733``, L447-L448), so its variable is a symbolic
loop index, not a Python int: it may appear in affine index arithmetic (``i * 128 + 5``,
slices, ``nl.ds``, comparisons in masks), but Python cannot use it as an int (list index,
``min()``, dict key, ``if``, another ``range``). Only the kernel function's own statements
are rewritten: ``range`` loops in helper functions it calls are unrolled by Python (the
behaviour AWS's own kernels rely on, nki-samples ``rmsnorm_quant.py`` "NKI-917"), and
``nl.static_range`` variables are Python ints.

The simulator still runs every iteration concretely: a :class:`LoopIndex` carries the
iteration's value, which only the simulator's own indexing code reads (:func:`concrete`).
"""

from __future__ import annotations

import dis
import sys

from .errors import NKIControlFlowError, NKITypeError, NKIValueError

_CITATION = "general/nki/api/nki/language/__init__.py@8a38e733, L1416-L1417"


def _misuse(expr: str, use: str, error=NKITypeError):
    return error(
        f"`{expr}` is the symbolic index of a kernel-level `range` loop: inside a NKI kernel "
        f"any use of Python range(...) is replaced with sequential_range(...) ({_CITATION}), "
        f"so it cannot be used as a Python int ({use}); use nl.static_range for a "
        "compile-time integer, or keep it in index arithmetic",
        "sequential_range_index",
    )


class LoopIndex:
    """An affine expression of a symbolic loop variable, with its value this iteration."""

    __slots__ = ("value", "expr")

    def __init__(self, value: int, expr: str):
        self.value = int(value)
        self.expr = expr

    # --- affine arithmetic --------------------------------------------------------------
    def _combine(self, other, sign, text):
        if isinstance(other, LoopIndex):
            return LoopIndex(self.value + sign * other.value, f"({self.expr} {text} {other.expr})")
        if isinstance(other, int) and not isinstance(other, bool):
            return LoopIndex(self.value + sign * other, f"({self.expr} {text} {other})")
        return NotImplemented

    def __add__(self, other):
        return self._combine(other, 1, "+")

    __radd__ = __add__

    def __sub__(self, other):
        return self._combine(other, -1, "-")

    def __rsub__(self, other):
        result = self._combine(other, -1, "-")
        if result is NotImplemented:
            return result
        return LoopIndex(-result.value, f"({other} - {self.expr})")

    def __mul__(self, other):
        if isinstance(other, LoopIndex):
            raise NKIValueError(
                f"`{self.expr} * {other.expr}`: the product of two loop indices is not affine",
                "err_unsupported_expression_in_mask",
            )
        if isinstance(other, int) and not isinstance(other, bool):
            return LoopIndex(self.value * other, f"{self.expr} * {other}")
        return NotImplemented

    __rmul__ = __mul__

    def __neg__(self):
        return LoopIndex(-self.value, f"-{self.expr}")

    def __pos__(self):
        return self

    def _not_affine(self, other=None):
        raise NKIValueError(
            f"`{self.expr}` with '%', '//' or '/': not an affine expression of the loop index "
            "(general/nki/api/nki.errors.rst@8a38e733, L834-L838)",
            "err_unsupported_expression_in_mask",
        )

    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = _not_affine
    __pow__ = __rpow__ = _not_affine

    # --- comparisons build mask predicates --------------------------------------------------
    def _compare(self, other, op, text):
        if isinstance(other, LoopIndex):
            other_value, other_text = other.value, other.expr
        elif isinstance(other, int) and not isinstance(other, bool):
            other_value, other_text = other, str(other)
        else:
            return NotImplemented
        return LoopCondition(op(self.value, other_value), f"{self.expr} {text} {other_text}")

    def __lt__(self, other):
        return self._compare(other, int.__lt__, "<")

    def __le__(self, other):
        return self._compare(other, int.__le__, "<=")

    def __gt__(self, other):
        return self._compare(other, int.__gt__, ">")

    def __ge__(self, other):
        return self._compare(other, int.__ge__, ">=")

    def __eq__(self, other):  # type: ignore[override]
        return self._compare(other, int.__eq__, "==")

    def __ne__(self, other):  # type: ignore[override]
        return self._compare(other, int.__ne__, "!=")

    # --- what Python cannot do with a symbolic index --------------------------------------
    def __index__(self):
        raise _misuse(self.expr, "list index, range bound, min()/max() or int()")

    __int__ = __index__

    def __float__(self):
        raise _misuse(self.expr, "float()")

    def __hash__(self):
        raise _misuse(self.expr, "dict key or set member")

    def __bool__(self):
        raise _misuse(self.expr, "truth value / `if`", NKIControlFlowError)

    def __repr__(self):
        return self.expr

    __str__ = __repr__

    def __format__(self, spec):
        return format(self.expr, spec)


class LoopCondition:
    """A comparison of loop indices: usable as a ``mask=`` (a compile-time predicate), not as
    a Python bool."""

    __slots__ = ("value", "expr")

    def __init__(self, value: bool, expr: str):
        self.value = bool(value)
        self.expr = expr

    def __and__(self, other):
        if isinstance(other, LoopCondition):
            return LoopCondition(self.value and other.value, f"({self.expr}) & ({other.expr})")
        return NotImplemented

    def __bool__(self):
        """``if i < 2:`` on a kernel-level ``range`` variable is legal: the errors manual
        writes it so in its own corrected example (``general/nki/api/nki.errors.rst@8a38e733``
        L431-L443, err_local_variable_used_out_of_scope). Only a branch of the kernel's code
        may test the comparison; Python using it otherwise (``min()``, ``sorted``) is the
        int use :class:`LoopIndex` rejects."""
        if _tested_by_a_branch(sys._getframe(1)):
            return self.value
        raise NKIControlFlowError(
            f"`{self.expr}` compares the symbolic index of a kernel-level `range` loop "
            f"(replaced with sequential_range, {_CITATION}): only an `if` may test it; "
            "Python cannot compute with it (min(), max(), sorting); pass it as mask= or use "
            "nl.static_range",
            "sequential_range_index",
        )

    def __repr__(self):
        return self.expr


_BRANCH_OPCODES = frozenset(
    op for op in dis.opmap if op.startswith(("POP_JUMP", "JUMP_IF", "TO_BOOL"))
)


def _tested_by_a_branch(frame) -> bool:
    """True when ``frame`` is at a conditional jump (an ``if``, a conditional expression,
    ``and``/``or``): the truth value was asked by the kernel's own branch, not by a builtin
    it called."""
    code = frame.f_code.co_code
    return dis.opname[code[frame.f_lasti]] in _BRANCH_OPCODES


def concrete(value):
    """The iteration's value of a loop index (other values unchanged): for the simulator's
    own indexing code only."""
    if isinstance(value, LoopIndex):
        return value.value
    if isinstance(value, slice) and any(
        isinstance(v, LoopIndex) for v in (value.start, value.stop, value.step)
    ):
        return slice(concrete(value.start), concrete(value.stop), concrete(value.step))
    return value
