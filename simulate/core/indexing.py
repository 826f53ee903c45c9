"""Index expressions, masks and loop iterators: ``nl.arange``, ``nl.mgrid``, ``nl.ds``,
``mask=`` predicates and ``affine_range`` / ``sequential_range`` / ``static_range``.

Loops run concretely, so loop variables are plain ints; an :class:`IndexExpr` holds the
integer values of an affine expression of aranges as a small broadcastable NumPy array
(``(128, 1)`` for a partition arange, ``(1, F)`` for a free one). Comparisons of index
expressions give a :class:`Predicate`, a broadcastable boolean array.
"""

from __future__ import annotations

import numpy as np

from .errors import (
    NKIControlFlowError,
    NKIIndexError,
    NKIRuntimeError,
    NKITypeError,
    NKIValueError,
)
from .loop_index import LoopCondition, LoopIndex


def _values(operand):
    if isinstance(operand, IndexExpr):
        return operand.values
    if isinstance(operand, (int, np.integer)):
        return int(operand)
    if isinstance(operand, LoopIndex):
        return operand.value
    raise NKIValueError(
        f"index expressions are affine: {type(operand).__name__} operands are not supported",
        "err_unsupported_expression_in_mask",
    )


def _grid(a, b) -> bool:
    return a.from_mgrid or getattr(b, "from_mgrid", False)


class IndexExpr:
    """An affine expression of aranges (and loop variables / program ids) with integer values."""

    __slots__ = ("values", "is_1d", "from_mgrid")

    def __init__(self, values: np.ndarray, is_1d: bool = False, from_mgrid: bool = False):
        self.values = values
        self.is_1d = is_1d  # a bare arange: must get a second axis before it indexes
        # built from nl.mgrid, which indirect load/store indexing does not take (known issues)
        self.from_mgrid = from_mgrid

    @property
    def shape(self):
        return self.values.shape

    def __getitem__(self, key):
        return IndexExpr(self.values[key], from_mgrid=self.from_mgrid)

    def __add__(self, other):
        if getattr(other, "on_chip", False):  # `iy + tile[0, i]`: a run-time offset
            return NotImplemented
        return IndexExpr(self.values + _values(other), self.is_1d, _grid(self, other))

    __radd__ = __add__

    def __sub__(self, other):
        return IndexExpr(self.values - _values(other), self.is_1d, _grid(self, other))

    def __rsub__(self, other):
        return IndexExpr(_values(other) - self.values, self.is_1d, _grid(self, other))

    def __mul__(self, other):
        if isinstance(other, IndexExpr):
            raise NKIValueError(
                "the product of two index expressions is not affine",
                "err_unsupported_expression_in_mask",
            )
        return IndexExpr(self.values * _values(other), self.is_1d, self.from_mgrid)

    __rmul__ = __mul__

    def __neg__(self):
        return IndexExpr(-self.values, self.is_1d, self.from_mgrid)

    def _not_affine(self, *_):
        raise NKIValueError(
            "'%' and '//' of index expressions are not affine",
            "err_unsupported_expression_in_mask",
        )

    __mod__ = __rmod__ = __floordiv__ = __rfloordiv__ = __truediv__ = _not_affine

    def _compare(self, other, fn):
        values = fn(self.values, _values(other))
        # the tile axes this comparison restricts (a box mask restricts one per comparison)
        axes = frozenset(a for a, n in enumerate(np.shape(values)) if n > 1)
        return Predicate(values, (axes,))

    def __lt__(self, other):
        return self._compare(other, np.less)

    def __le__(self, other):
        return self._compare(other, np.less_equal)

    def __gt__(self, other):
        return self._compare(other, np.greater)

    def __ge__(self, other):
        return self._compare(other, np.greater_equal)

    def __eq__(self, other):
        return self._compare(other, np.equal)

    def __ne__(self, other):
        return self._compare(other, np.not_equal)

    __hash__ = None

    def __bool__(self):
        raise NKITypeError(
            "Python control flow cannot depend on an index expression",
            "err_control_flow_condition_depending_on_arange",
        )

    def __iter__(self):
        raise NKIRuntimeError(
            "Only support multi-dimensional subscript to arange! "
            "(an arange is an index, not a loop iterator: use nl.affine_range)",
            "err_iterate_arange",
        )

    def __setitem__(self, key, value):
        raise NKITypeError("index expressions are immutable", "err_cannot_assign_to_index")

    def __repr__(self):
        return f"IndexExpr(shape={self.values.shape})"


class Predicate:
    """A mask: comparisons of affine expressions combined with ``&``. ``comparisons`` holds,
    per comparison, the set of tile axes it restricts."""

    __slots__ = ("values", "comparisons")

    def __init__(self, values: np.ndarray, comparisons=()):
        self.values = np.asarray(values, dtype=bool)
        self.comparisons = tuple(comparisons)

    def __and__(self, other):
        if isinstance(other, LoopCondition):
            other = other.value
        if isinstance(other, (bool, np.bool_)):
            return Predicate(self.values & bool(other), self.comparisons + ((),))
        if not isinstance(other, Predicate):
            raise NKIValueError(
                "masks combine only with '&' of comparisons", "err_unsupported_expression_in_mask"
            )
        return Predicate(self.values & other.values, self.comparisons + other.comparisons)

    __rand__ = __and__

    def __bool__(self):
        raise NKIControlFlowError(
            "a comparison of index expressions is a mask, not a Python bool: it cannot drive "
            "'if'/'while', and predicates combine with '&', not 'and' "
            '(err_ambiguous_tensor_truth_value; "We do not support using and for masks", '
            "general/nki/nki_known_issues.rst@8a38e733 L38)",
            "err_control_flow_condition_depending_on_arange",
        )

    def __or__(self, other):
        raise NKIValueError(
            "masks combine only with '&' (a conjunction of comparisons)",
            "err_unsupported_expression_in_mask",
        )

    __ror__ = __or__

    def __invert__(self):
        raise NKIValueError(
            "masks cannot be negated: flip the comparison instead",
            "err_unsupported_expression_in_mask",
        )

    def __repr__(self):
        return f"Predicate(shape={self.values.shape}, true={int(self.values.sum())})"


def arange(*args) -> IndexExpr:
    """``nl.arange([start,] stop)``: a 1-D index range; give it a second axis before use
    (``[:, None]`` for the partition axis, ``[None, :]`` for a free axis)."""
    return IndexExpr(np.arange(*args, dtype=np.int64), is_1d=True)


class _MGridResult(tuple):
    """The result of ``nl.mgrid[...]``: unpackable, and with ``.p .x .y .z`` accessors."""

    @property
    def p(self):
        return self[0]

    @property
    def x(self):
        return self[1]

    @property
    def y(self):
        return self[2]

    @property
    def z(self):
        return self[3]


class _MGrid:
    """``nl.mgrid[0:a, 0:b, ...]``: open grids (broadcast like NumPy ``mgrid``)."""

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        ndim = len(key)
        axes = []
        for axis, sl in enumerate(key):
            if not isinstance(sl, slice) or (
                sl.step not in (None, 1) and isinstance(sl.step, complex)
            ):
                raise NKIIndexError("mgrid takes slices such as 0:128", "err_invalid_mgrid")
            values = np.arange(sl.start or 0, sl.stop, sl.step or 1, dtype=np.int64)
            shape = [1] * ndim
            shape[axis] = values.size
            axes.append(IndexExpr(values.reshape(shape), from_mgrid=True))
        return _MGridResult(axes)


mgrid = _MGrid()


def ds(start, size) -> slice:
    """``nl.ds(start, size)``: the slice ``start:start+size``."""
    return slice(start, start + size)


def mask_values(mask):
    """Normalise a ``mask=`` argument: None (every point), False (no point: skip the
    instruction; a predicate of loop variables only is a Python bool under concrete
    execution) or a compact boolean array."""
    if mask is None:
        return None
    if isinstance(mask, LoopCondition):
        mask = mask.value
    if isinstance(mask, (bool, np.bool_)):
        return None if mask else False
    if isinstance(mask, Predicate):
        from .rules import check_mask_comparison_axes

        check_mask_comparison_axes(mask.comparisons)
        values = mask.values
        if values.all():
            return None
        if not values.any():
            return False
        return values
    raise NKIValueError(
        f"mask must be a predicate of index expressions, got {type(mask).__name__}",
        "err_unsupported_expression_in_mask",
    )


def compact(mask: np.ndarray) -> np.ndarray:
    """The smallest array that broadcasts back to ``mask`` (broadcast axes become size 1)."""
    if mask.ndim and 0 in mask.strides:
        mask = mask[tuple(slice(0, 1) if s == 0 else slice(None) for s in mask.strides)]
    return mask


def align_mask(mask, shape) -> np.ndarray:
    """A mask made broadcastable to ``shape`` with partition-aligned rules: a lower-rank mask
    is padded with size-1 axes on the right (axis 0 stays the partition axis), surplus
    size-1 axes are dropped. Returns a compact boolean array."""
    mask = compact(np.asarray(mask, dtype=bool))
    rank = len(shape)
    if mask.ndim < rank:
        mask = mask.reshape(mask.shape + (1,) * (rank - mask.ndim))
    elif mask.ndim > rank:
        kept = [n for n in mask.shape if n != 1]
        if len(kept) > rank:
            raise NKIValueError(
                f"mask of shape {mask.shape} does not fit the instruction's shape {tuple(shape)}",
                "err_mask_shape",
            )
        mask = mask.reshape((1,) * (rank - len(kept)) + tuple(kept))
    for n, size in zip(mask.shape, shape):
        if n != 1 and n != size:
            raise NKIValueError(
                f"mask of shape {mask.shape} does not fit the instruction's shape {tuple(shape)}",
                "err_mask_shape",
            )
    return mask


def mask_box(mask: np.ndarray, shape):
    """Slices selecting exactly the true points of an aligned compact ``mask`` when they form
    a box (the usual ``i * 128 + i_p < n`` mask); None otherwise. Axes the mask does not
    restrict get ``slice(None)``."""
    box = []
    for axis, n in enumerate(mask.shape):
        if n == 1:
            box.append(slice(None))
            continue
        others = tuple(a for a in range(mask.ndim) if a != axis)
        hits = np.flatnonzero(mask.any(axis=others) if others else mask)
        if hits.size == 0:
            return None
        box.append(slice(int(hits[0]), int(hits[-1]) + 1))
    if not mask[tuple(box)].all():
        return None
    return tuple(box)
