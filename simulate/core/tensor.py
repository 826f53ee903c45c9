"""Tensors, views and indexed accesses.

A :class:`Tensor` is a NumPy array (a view of its :class:`~simulate.memory.Storage`) in the
declared dtype, plus where it lives. Basic indexing (ints, slices, ``nl.ds``) gives another
``Tensor`` sharing memory; indexing with index expressions gives an :class:`Access`, which
instructions read (gather) or write (scatter) under a mask. Both know the region of their
storage they cover, which feeds the instruction trace and the ``affine_range`` checker.

Accesses whose index expressions are arithmetic progressions along distinct axes (the
``t[i * 128 + i_p, i_f]`` idiom) are turned into NumPy slices, and a mask whose true points
form a box (``i * 128 + i_p < n``) narrows those slices, so whole tiles move as array views
and nothing loops over elements.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .errors import (
    NKIAssertionError,
    NKIIndexError,
    NKISyntaxError,
    NKITypeError,
    NKIValueError,
)
from .indexing import IndexExpr, Predicate, align_mask, mask_box
from .loop_index import concrete
from .targets import PMAX
from .trace import Region


class par_dim(int):  # noqa: N801 - the NKI name
    """``nl.par_dim(n)``: marks the partition axis inside a shape."""


def _check_partitions(n: int, what: str) -> None:
    if n > PMAX:
        raise NKISyntaxError(
            f"Size of partition dimension {n} exceeds architecture limitation of {PMAX} ({what})",
            "err_num_partition_exceed_arch_limit",
        )


def _slice_bounds(sl: slice, dim: int, axis: int, name: str) -> tuple[int, int, int]:
    step = 1 if sl.step is None else int(sl.step)
    if step <= 0:
        raise NKIIndexError(
            f"slice step must be positive on axis {axis} of {name}", "err_unsupported_slice_step"
        )
    start = 0 if sl.start is None else int(sl.start)
    stop = dim if sl.stop is None else int(sl.stop)
    if start < 0 or stop > dim or start > stop:
        raise NKIIndexError(
            f"Out-of-bound access for tensor `{name}` on dimension {axis}: index range "
            f"[{start}, {stop - 1}] exceed dimension size of {dim}",
            "err_tensor_access_out_of_bound",
        )
    return start, stop, step


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _region(storage, root: np.ndarray, lo: int, hi: int) -> Region:
    """Region of the bytes from offset ``lo`` (first element) to ``hi`` (last element) of
    ``root``, the storage's backing array. On chip: per-partition offsets and partitions."""
    isz = root.itemsize
    if storage.memory == "hbm":
        return Region("hbm", storage.id, lo, hi + isz)
    shape = root.shape
    pa = storage.par_axis
    corners = []
    for offset in (lo // isz, hi // isz):
        coords = []
        for n in reversed(shape):
            offset, c = divmod(offset, n)
            coords.append(c)
        corners.append(coords[::-1])
    (c_lo, c_hi) = corners
    free_lo = free_hi = 0
    for axis, n in enumerate(shape):
        if axis != pa:
            free_lo, free_hi = free_lo * n + c_lo[axis], free_hi * n + c_hi[axis]
    if free_hi < free_lo:  # not a box (a reshaped view): the whole partition
        free_lo, free_hi = 0, root.size // max(1, shape[pa]) - 1
    start = storage.address
    return Region(
        storage.memory,
        storage.id,
        start + free_lo * isz,
        start + (free_hi + 1) * isz,
        (int(c_lo[pa]), int(c_hi[pa]) + 1),
    )


# The module whose functions implement the Python operators on tiles (``elementwise_binary``,
# ``negative``, ``abs``, ``invert``, ``accumulate``, ``assign``, ``broadcast_to``, ``copy``,
# ``expand_dims``). They live in a front-end today and the core must not import one, so the
# front-end registers itself when it is imported.
_operators = None


class _OperatorFunctions:
    """A front-end module's functions read from its namespace directly, past the SDK-release
    gate on its attributes (``core.sdk.gate_module``): the tile methods are ``nki.tensor``
    API, not ``nl`` names. ``tile.broadcast_to`` is documented from 2.20 on
    (``general/nki/api/nki/__init__.py@72825d50``, L317; ``@752349fd``, L425) while
    ``nl.broadcast_to`` first appears in 2.22."""

    def __init__(self, module):
        self._namespace = vars(module)

    def __getattr__(self, name):
        try:
            return self._namespace[name]
        except KeyError:
            raise AttributeError(name) from None


def register_operators(module) -> None:
    """Make ``module``'s functions the implementation of the tile operators."""
    global _operators
    _operators = _OperatorFunctions(module)


class TileOperators:
    """Python operators on tiles: Vector-engine instructions, no partition broadcast."""

    __array_priority__ = 1000  # keep NumPy scalars from swallowing tile arithmetic

    def _binary(self, other, op, reverse=False):
        if op == "add":
            offset = dynamic_offset_sum(self, other)
            if offset is not None:
                return offset
        a, b = (other, self) if reverse else (self, other)
        return _operators.elementwise_binary(op, a, b, operator=True)

    def __add__(self, o):
        return self._binary(o, "add")

    def __radd__(self, o):
        return self._binary(o, "add", True)

    def __sub__(self, o):
        return self._binary(o, "subtract")

    def __rsub__(self, o):
        return self._binary(o, "subtract", True)

    def __mul__(self, o):
        return self._binary(o, "multiply")

    def __rmul__(self, o):
        return self._binary(o, "multiply", True)

    def __truediv__(self, o):
        return self._binary(o, "divide")

    def __rtruediv__(self, o):
        return self._binary(o, "divide", True)

    def __pow__(self, o):
        return self._binary(o, "power")

    def __rpow__(self, o):
        return self._binary(o, "power", True)

    def __mod__(self, o):
        return self._binary(o, "mod")

    def __and__(self, o):
        return self._binary(o, "bitwise_and")

    __rand__ = __and__

    def __or__(self, o):
        return self._binary(o, "bitwise_or")

    __ror__ = __or__

    def __xor__(self, o):
        return self._binary(o, "bitwise_xor")

    __rxor__ = __xor__

    def __lshift__(self, o):
        return self._binary(o, "left_shift")

    def __rshift__(self, o):
        return self._binary(o, "right_shift")

    def __lt__(self, o):
        return self._binary(o, "less")

    def __le__(self, o):
        return self._binary(o, "less_equal")

    def __gt__(self, o):
        return self._binary(o, "greater")

    def __ge__(self, o):
        return self._binary(o, "greater_equal")

    def __eq__(self, o):  # type: ignore[override]
        return self._binary(o, "equal")

    def __ne__(self, o):  # type: ignore[override]
        return self._binary(o, "not_equal")

    __hash__ = object.__hash__

    def __neg__(self):
        return _operators.negative(self)

    def __abs__(self):
        return _operators.abs(self)

    def __invert__(self):
        return _operators.invert(self)

    def _inplace(self, other, op):
        _operators.accumulate(self, other, op)
        self.updated_in_place = True
        return self

    def __iadd__(self, o):
        return self._inplace(o, "add")

    def __isub__(self, o):
        return self._inplace(o, "subtract")

    def __imul__(self, o):
        return self._inplace(o, "multiply")

    def __itruediv__(self, o):
        return self._inplace(o, "divide")

    def __bool__(self):
        if int(np.prod(self.shape)) == 1:
            raise NKITypeError(
                "control flow cannot depend on tile values (the kernel is compiled before the "
                "data exists)",
                "err_dynamic_control_flow_not_supported",
            )
        raise NKIValueError(
            "the truth value of a multi-element tile is ambiguous: use '&', '|', '~' for "
            "elementwise logic and 'is None' checks for optional tensors",
            "err_ambiguous_tensor_truth_value",
        )

    def broadcast_to(self, shape):
        return _operators.broadcast_to(self, shape=shape)

    def astype(self, dtype):
        return _operators.copy(self, dtype=dtype)


class Tensor(TileOperators):
    """A tensor in HBM, SBUF or PSUM (``nl.ndarray`` and friends return these)."""

    def __init__(
        self, data: np.ndarray, dtype, storage, *, layout=None, par_axis: int = 0, loops=()
    ):
        self.data = data
        self.dtype = dtype
        self.storage = storage
        # layout: (base shape, start per base axis, step per base axis, view axis of each
        # base axis or None where an integer index fixed it): the box a view covers
        if layout is None:
            layout = (data.shape, (0,) * data.ndim, (1,) * data.ndim, tuple(range(data.ndim)))
        self.layout = layout
        self.par_axis = par_axis
        self.loops = loops  # the loop frames active when it was allocated
        self.fresh = None  # (instruction, mask, fp32 values) while it is an op's new result
        self.updated_in_place = False

    # --- NumPy-like attributes -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def size(self) -> int:
        return self.data.size

    @property
    def itemsize(self) -> int:
        return self.data.dtype.itemsize

    @property
    def buffer(self) -> str:
        return self.storage.memory

    @property
    def name(self) -> str:
        return self.storage.name

    @property
    def on_chip(self) -> bool:
        return self.storage.memory != "hbm"

    @property
    def tensor(self) -> Tensor:
        return self

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return (
            f"Tensor({self.name or 'tile'}, shape={self.shape}, dtype={dt.name(self.dtype)}, "
            f"buffer={self.buffer})"
        )

    # --- regions --------------------------------------------------------------------------
    def region(self, mask=None) -> Region:
        """The bytes of the storage this view covers (bounding box; per partition on chip)."""
        storage = self.storage
        data = self.data
        if mask is not None:
            box = mask_box(align_mask(mask, data.shape), data.shape)
            if box is not None:
                data = data[box]
        if data.size == 0:
            return Region(storage.memory, storage.id, 0, 0)
        root = storage.array
        lo = _address(data) - _address(root)
        hi = lo + sum((n - 1) * s for n, s in zip(data.shape, data.strides) if s > 0)
        return _region(storage, root, lo, hi)

    # --- indexing -------------------------------------------------------------------------
    def __getitem__(self, key):
        if isinstance(key, Predicate):
            return Access(self, None, operand_mask=key)
        key = key if isinstance(key, tuple) else (key,)
        key = tuple(concrete(k) for k in key)  # symbolic loop indices address their value
        if any(isinstance(k, (IndexExpr, Tensor, Access)) for k in key):
            return Access(self, key)
        return self._basic_view(key)

    def _basic_view(self, key) -> Tensor:
        if any(k is None for k in key):
            raise NKIIndexError(
                "np.newaxis is not supported when indexing tensors", "err_unsupported_indexing"
            )
        if key.count(Ellipsis) > 1:
            raise NKIIndexError("at most one '...' in an index", "err_unsupported_indexing")
        if (
            self.on_chip
            and self.ndim == 2
            and 1 in self.shape
            and len(key) == 1
            and (key[0] is not Ellipsis)
        ):
            raise NKIIndexError(
                f'`{self.name or "tile"}` of shape {self.shape} indexed with one index: "Users '
                "must index their [N, 1] or [1, M] shaped 2D buffers with both indices ... "
                "accessing in 1D my_sbuf[0:N] won't work\" (general/nki/nki_known_issues.rst"
                "@8a38e733 L28-29)",
                "err_insufficient_indices",
            )
        if Ellipsis in key:
            at = key.index(Ellipsis)
            fill = (slice(None),) * (self.ndim - len(key) + 1)
            key = key[:at] + fill + key[at + 1 :]
        if len(key) > self.ndim:
            raise NKIIndexError(
                f"too many indices for tensor `{self.name}` of rank {self.ndim}",
                "err_tensor_access_out_of_bound",
            )
        key = key + (slice(None),) * (self.ndim - len(key))
        np_key = []
        base_shape, starts, steps, vmap = self.layout
        starts, steps, vmap = list(starts), list(steps), list(vmap)
        base_of_view = {v: b for b, v in enumerate(vmap) if v is not None}
        dropped_before_par = 0
        kept = 0
        for axis, (k, dim) in enumerate(zip(key, self.shape, strict=True)):
            b = base_of_view.get(axis)
            if isinstance(k, slice):
                start, stop, step = _slice_bounds(k, dim, axis, self.name)
                if self.on_chip and axis == self.par_axis:
                    from .rules import check_partition_step

                    check_partition_step(
                        step, f"`{self.name or 'tile'}`[{k.start}:{k.stop}:{k.step}]"
                    )
                np_key.append(slice(start, stop, step))
                if b is not None:
                    starts[b] += start * steps[b]
                    steps[b] *= step
                    vmap[b] = kept
                kept += 1
            elif isinstance(k, (int, np.integer)):
                k = int(k)
                if not 0 <= k < dim:
                    raise NKIIndexError(
                        f"Out-of-bound access for tensor `{self.name}` on dimension {axis}: "
                        f"index {k} exceed dimension size of {dim}",
                        "err_tensor_access_out_of_bound",
                    )
                np_key.append(k)
                if b is not None:
                    starts[b] += k * steps[b]
                    vmap[b] = None
                if axis < self.par_axis:
                    dropped_before_par += 1
            else:
                raise NKIIndexError(
                    f"unsupported index {k!r} on axis {axis} of `{self.name}`",
                    "err_unsupported_indexing",
                )
        # the trailing Ellipsis keeps a view when every index is an integer (a 0-d element
        # written through, as ``y[0, 5] = 1024`` on an iota tile, general/nki/api/
        # nki.errors.rst@8a38e733 L171-L175)
        data = self.data[(*np_key, Ellipsis)]
        par_axis = max(0, self.par_axis - dropped_before_par)
        if (
            self.on_chip
            and data.ndim == 1
            and self.par_axis < self.ndim
            and isinstance(key[self.par_axis], slice)
        ):
            # an integer on the only free axis: docs treat the result as (P, 1)
            data = data[:, None]
        layout = (base_shape, tuple(starts), tuple(steps), tuple(vmap))
        return Tensor(
            data, self.dtype, self.storage, layout=layout, par_axis=par_axis, loops=self.loops
        )

    def box(self, lo=None, hi=None):
        """Per base axis (first, last, step) of the elements this view covers; ``lo``/``hi``
        narrow it to view-index bounds (for accesses). Keyed by the base layout."""
        base_shape, starts, steps, vmap = self.layout
        out = []
        for b, v in enumerate(vmap):
            if v is None or v >= self.ndim:
                out.append((starts[b], starts[b], 1))
                continue
            first = 0 if lo is None else lo[v]
            last = self.shape[v] - 1 if hi is None else hi[v]
            out.append((starts[b] + first * steps[b], starts[b] + last * steps[b], steps[b]))
        return (base_shape, tuple(out))

    def __setitem__(self, key, value):
        _operators.assign(self[key], value)

    # --- views ----------------------------------------------------------------------------
    def reshape(self, shape) -> Tensor:
        """A view with another shape (HBM: free; on-chip: the partition dim must not change)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if not self.data.flags.c_contiguous:
            raise NKIValueError(
                f"cannot reshape a strided view of `{self.name}`", "err_reshape_non_contiguous"
            )
        if int(np.prod(shape)) != self.data.size:
            raise NKIValueError(
                f"cannot reshape `{self.name}` of shape {self.shape} to {shape}",
                "err_reshape_size_mismatch",
            )
        if self.on_chip and shape[0] != self.shape[0]:
            raise NKIValueError(
                "reshaping an on-chip tile cannot change its partition dim", "err_reshape_partition"
            )
        return Tensor(self.data.reshape(shape), self.dtype, self.storage, loops=self.loops)

    def view(self, dtype) -> Tensor:
        """Reinterpret the bits as another dtype of the same size."""
        dtype = dt.as_dtype(dtype)
        if dtype.itemsize != self.itemsize:
            raise NKIValueError("view() needs a dtype of the same size", "err_view_dtype_size")
        return Tensor(
            self.data.view(dtype),
            dtype,
            self.storage,
            layout=self.layout,
            par_axis=self.par_axis,
            loops=self.loops,
        )

    def expand_dims(self, axis) -> Tensor:
        return _operators.expand_dims(self, axis)

    def assert_shape(self, shape):
        if tuple(shape) != self.shape:
            raise NKIValueError(
                f"tensor `{self.name}` has shape {self.shape}, expected {shape}",
                "err_annotation_shape_mismatch",
            )
        return self


def _progression(values: np.ndarray, rank: int):
    """``("const", v)`` or ``("range", axis, start, step)`` when ``values`` (broadcastable to a
    rank-``rank`` shape) is constant or an increasing arithmetic progression along one
    axis; None otherwise."""
    a = values.reshape((1,) * (rank - values.ndim) + values.shape)
    varying = [d for d, n in enumerate(a.shape) if n > 1]
    flat = a.reshape(-1)
    if not varying:
        return ("const", int(flat[0])) if flat.size else None
    if len(varying) != 1:
        return None
    step = int(flat[1] - flat[0])
    if step <= 0 or (flat.size > 2 and not (np.diff(flat) == step).all()):
        return None
    return ("range", varying[0], int(flat[0]), step)


def _affine_steps(values: np.ndarray, rank: int) -> list[int] | None:
    """Per axis of a rank-``rank`` access, the step of ``values`` (broadcastable to it) when
    ``values`` is ``start + sum(step_d * i_d)`` (any order of axes, any sign of steps); None
    otherwise."""
    a = values.reshape((1,) * (rank - values.ndim) + values.shape).astype(np.int64)
    if a.size == 0:
        return [0] * rank
    origin = a[(0,) * rank]
    steps = [0] * rank
    expected = np.full((1,) * rank, origin, np.int64)
    for d, n in enumerate(a.shape):
        if n > 1:
            steps[d] = int(a[tuple(1 if k == d else 0 for k in range(rank))] - origin)
            expected = expected + steps[d] * np.arange(n).reshape(
                tuple(n if k == d else 1 for k in range(rank))
            )
    return steps if np.array_equal(np.broadcast_to(expected, a.shape), a) else None


class DynamicOffset:
    """A run-time offset into a free axis of an SBUF/PSUM tile: the value of a one-element
    integer tile in SBUF, plus an optional index expression (``t[ix, off[0, i] + iy]``).
    Only ``nisa.tensor_copy_dynamic_src`` / ``_dst`` address a tile through one: "The dynamic
    offset must be a scalar value resided in SBUF" (aws-neuron-sdk@8a38e733
    general/nki/api/nki/isa/__init__.py L1428, L1461); any other use is
    err_copy_dynamic_indirect_indices_not_natively_supported (nki.errors.rst L256-281)."""

    def __init__(self, tile, expr: IndexExpr | None = None):
        if not tile.on_chip or not dt.is_int(tile.dtype):
            raise NKITypeError(
                "a dynamic offset must be an integer tile in SBUF", "err_indirect_index_type"
            )
        self.tile = tile
        self.expr = expr

    @property
    def shape(self):
        return () if self.expr is None else self.expr.shape

    @property
    def scalar(self) -> bool:
        return int(np.prod(self.tile.shape)) == 1

    def values(self) -> np.ndarray:
        """The offsets, read from the tile when the access is used."""
        values = self.tile.read()[0] if isinstance(self.tile, Access) else self.tile.data
        values = np.asarray(values).astype(np.int64)
        values = values.reshape(()) if values.size == 1 else values
        return values if self.expr is None else self.expr.values + values

    def __add__(self, other):
        if isinstance(other, (IndexExpr, int, np.integer)):
            return DynamicOffset(self.tile, other if self.expr is None else self.expr + other)
        return NotImplemented

    __radd__ = __add__


def dynamic_offset_sum(tile, other):
    """``tile + index_expression``: a run-time offset (see :class:`DynamicOffset`) when the
    tile is an integer SBUF tile; None otherwise."""
    if isinstance(other, IndexExpr) and tile.on_chip and dt.is_int(tile.dtype):
        return DynamicOffset(tile, other)
    return None


class Access(TileOperators):
    """A tensor indexed with index expressions (advanced indexing), optionally operand-masked.

    ``indices`` holds one entry per axis of the tensor: an integer array broadcastable to the
    access shape, or, on the first axis of an HBM tensor, an SBUF integer tile whose values
    are read when the access is used (indirect indexing).
    """

    def __init__(self, tensor: Tensor, key, operand_mask: Predicate | None = None):
        self.tensor = tensor
        self.operand_mask = operand_mask
        self.fresh = None
        self.updated_in_place = False
        self.indirect = None
        self.dynamic = None
        self._plan = None
        self.from_mgrid = key is not None and any(getattr(k, "from_mgrid", False) for k in key)
        if key is None:  # tile[mask]: the whole tile, restricted by the mask
            self.indices = None
            self.shape = tensor.shape
            return
        if any(isinstance(k, (slice, type(Ellipsis))) for k in key):
            raise NKIIndexError(
                "basic (slices) and advanced (arange/mgrid) indexing cannot be mixed in one "
                "subscript: index every axis with index expressions or integers",
                "err_unsupported_mixing_basic_advanced_tensor_indexing",
            )
        if len(key) != tensor.ndim:
            raise NKIIndexError(
                f"tensor `{tensor.name}` of rank {tensor.ndim} indexed with {len(key)} index "
                "expressions; index every axis",
                "err_tensor_access_out_of_bound",
            )
        arrays = []
        for axis, k in enumerate(key):
            if isinstance(k, IndexExpr):
                if k.is_1d:
                    raise NKIIndexError(
                        "a 1-D arange cannot index a tensor: use nl.arange(n)[:, None] for the "
                        "partition axis or nl.arange(n)[None, :] for a free axis",
                        "err_1d_arange_not_supported",
                    )
                arrays.append(k.values)
            elif isinstance(k, DynamicOffset) or (
                isinstance(k, (Tensor, Access)) and tensor.on_chip and axis != tensor.par_axis
            ):
                offset = k if isinstance(k, DynamicOffset) else DynamicOffset(k)
                if not tensor.on_chip:
                    raise NKIIndexError(
                        "a run-time offset plus an index expression addresses an SBUF/PSUM "
                        "tile (nisa.tensor_copy_dynamic_src/dst); HBM takes indirect indices "
                        "on its first axis",
                        "err_indirect_indices_free_dim",
                    )
                self.dynamic = (axis, offset)
                arrays.append(np.zeros(offset.shape, np.int64))
            elif isinstance(k, (Tensor, Access)):
                self._check_indirect(axis, k)
                self.indirect = (axis, k)
                arrays.append(np.zeros((k.shape[0],) + (1,) * (len(k.shape) - 1), np.int64))
            elif isinstance(k, (int, np.integer)):
                arrays.append(np.asarray(int(k)))
            else:
                raise NKIIndexError(
                    f"unsupported index {k!r} on axis {axis}", "err_unsupported_indexing"
                )
        self.indices = arrays
        self.shape = tuple(np.broadcast_shapes(*(a.shape for a in arrays)))
        if tensor.on_chip and isinstance(key[tensor.par_axis], IndexExpr):
            step = _progression(arrays[tensor.par_axis], len(self.shape))
            if step is not None and step[0] == "range":
                from .rules import check_partition_step

                check_partition_step(step[3], f"partition index of `{tensor.name or 'tile'}`")

    def _check_indirect(self, axis: int, index_tile) -> None:
        if self.tensor.on_chip:
            raise NKIIndexError(
                "indirect (runtime) indices address HBM tensors only (nl.load / nl.store / "
                "nisa.dma_copy); on chip use nisa.tensor_copy_dynamic_src",
                "err_copy_dynamic_indirect_indices_not_natively_supported",
            )
        if axis != 0:
            raise NKIIndexError(
                "indirect indices are only supported on the first (partition) dimension",
                "err_indirect_indices_free_dim",
            )
        if not index_tile.on_chip or not dt.is_int(index_tile.dtype):
            raise NKITypeError(
                "an indirect index must be an integer tile in SBUF", "err_indirect_index_type"
            )

    @property
    def dtype(self):
        return self.tensor.dtype

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return int(np.prod(self.shape))

    @property
    def storage(self):
        return self.tensor.storage

    @property
    def name(self):
        return self.tensor.name

    @property
    def on_chip(self):
        return self.tensor.on_chip

    @property
    def itemsize(self):
        return self.tensor.itemsize

    def __repr__(self):
        return f"Access({self.tensor!r}, shape={self.shape})"

    def __getitem__(self, key):
        if isinstance(key, Predicate) and self.operand_mask is None:
            access = Access.__new__(Access)
            access.__dict__.update(self.__dict__)
            access.operand_mask = key
            return access
        raise NKIIndexError(
            "an indexed access can only be restricted further by a mask", "err_unsupported_indexing"
        )

    def __setitem__(self, key, value):
        _operators.assign(self[key], value)

    # --- concrete index arrays ------------------------------------------------------------
    def _arrays(self) -> list[np.ndarray]:
        arrays = list(self.indices)
        if self.dynamic is not None:
            axis, offset = self.dynamic
            arrays[axis] = offset.values()
        if self.indirect is not None:
            axis, tile = self.indirect
            values = tile.read()[0] if isinstance(tile, Access) else tile.data
            values = np.asarray(values).astype(np.int64)
            if values.ndim > 1:
                values = values.reshape(values.shape[0], *([1] * (len(self.shape) - 1)))
            arrays[axis] = values
        return arrays

    def plan(self):
        """Per tensor axis a constant or a progression along one access axis, when every
        index is one and the progressions run along distinct, increasing access axes (so
        the access is a strided NumPy view); None otherwise."""
        if self._plan is None:
            self._plan = False
            if self.indices is not None and self.indirect is None and self.dynamic is None:
                rank = len(self.shape)
                steps = [_progression(a, rank) for a in self.indices]
                order = [s[1] for s in steps if s is not None and s[0] == "range"]
                if all(s is not None for s in steps) and order == sorted(set(order)):
                    self._plan = steps
        return self._plan or None

    def _view(self, plan, box=None) -> np.ndarray:
        """The NumPy view of the addressed elements (restricted to ``box``), bounds-checked."""
        key = []
        for axis, (step, dim) in enumerate(zip(plan, self.tensor.shape)):
            if step[0] == "const":
                lo = hi = step[1]
                key.append(slice(lo, lo + 1))  # a slice keeps a view even if all are const
            else:
                _, d, start, stride = step
                first, count = 0, self.shape[d]
                if box is not None and box[d].start is not None:
                    first, count = box[d].start, box[d].stop - box[d].start
                lo = start + first * stride
                hi = lo + (count - 1) * stride
                key.append(slice(lo, hi + 1, stride))
            if lo < 0 or hi >= dim:
                self._out_of_bound(axis, min(lo, hi), max(lo, hi), dim)
        shape = (
            self.shape
            if box is None
            else tuple(len(range(*b.indices(n))) for b, n in zip(box, self.shape))
        )
        return self.tensor.data[tuple(key)].reshape(shape)

    def _out_of_bound(self, axis, lo, hi, dim):
        if any(d is not None and axis == d[0] for d in (self.indirect, self.dynamic)):
            bad = hi if hi >= dim else lo
            raise NKIIndexError(
                f"index {bad} is out of bounds for axis {axis} with size {dim}",
                "err_dynamic_index_out_of_bound",
            )
        raise NKIIndexError(
            f"Out-of-bound access for tensor `{self.name}` on dimension {axis}: index range "
            f"[{lo}, {hi}] exceed dimension size of {dim} (mask the out-of-range points with "
            "mask=)",
            "err_tensor_access_out_of_bound",
        )

    def _points(self, mask):
        """Index arrays of every addressed point (where ``mask`` holds), bounds-checked."""
        points = []
        full = None if mask is None else np.broadcast_to(mask, self.shape)
        for a in self._arrays():
            a = np.broadcast_to(a, self.shape)
            points.append(a if full is None else a[full])
        for axis, (sel, dim) in enumerate(zip(points, self.tensor.shape)):
            if sel.size:
                lo, hi = int(sel.min()), int(sel.max())
                if lo < 0 or hi >= dim:
                    if self.indirect is not None and axis == self.indirect[0]:
                        self._dynamic_out_of_bound(points, ((sel < 0) | (sel >= dim)).reshape(-1))
                    self._out_of_bound(axis, lo, hi, dim)
        return tuple(points)

    def _dynamic_out_of_bound(self, points, bad):
        """A run-time index outside the tensor: a plain IndexError naming the first such
        point as a flat element index of the tensor, the message and type AWS's own examples
        assert (aws-neuron-sdk@8a38e733 general/nki/test/test_nki_isa_dma_copy.py L306-310,
        L357-361: ``type(exc) == IndexError``, "index 66048 is out of bounds for axis 0
        with size 65536")."""
        first = int(np.flatnonzero(bad)[0])
        shape = self.tensor.shape
        flat = 0
        for axis, sel in enumerate(points):
            flat = flat * shape[axis] + int(sel.reshape(-1)[first])
        raise IndexError(
            f"index {flat} is out of bounds for axis 0 with size {int(np.prod(shape))}"
        )

    def combined_mask(self, mask):
        """AND the instruction mask with the operand mask: a compact boolean array
        broadcastable to the access shape, or None when every point is addressed."""
        if self.operand_mask is not None:
            om = align_mask(self.operand_mask.values, self.shape)
            mask = om if mask is None else (align_mask(mask, self.shape) & om)
        if mask is not None:
            mask = align_mask(mask, self.shape)
            if mask.all():
                return None
        return mask

    def read(self, mask=None) -> tuple[np.ndarray, np.ndarray | None]:
        """Gather the addressed elements. Returns (values, mask); masked-off points are
        never read (they hold the uninitialised value)."""
        mask = self.combined_mask(mask)
        if self.indices is None:
            return self.tensor.data, mask
        plan = self.plan()
        if mask is None:
            if plan:
                return self._view(plan), None
            return self.tensor.data[self._points(None)].reshape(self.shape), None
        out = dt.full(self.shape, dt.uninitialised(self.dtype), self.tensor.data.dtype)
        box = mask_box(mask, self.shape)
        if plan and box is not None:
            out[box] = self._view(plan, box)
        else:
            out[np.broadcast_to(mask, self.shape)] = self.tensor.data[self._points(mask)]
        return out, mask

    def write(self, values: np.ndarray, mask=None) -> None:
        """Scatter ``values`` (in the tensor's dtype, broadcastable to the access shape) to
        the addressed elements where the mask holds."""
        mask = self.combined_mask(mask)
        target = self.tensor.data
        values = np.broadcast_to(values, self.shape)
        if self.indices is None:
            if mask is None:
                target[...] = values
            else:
                full = np.broadcast_to(mask, self.shape)
                target[full] = values[full]
            return
        plan = self.plan()
        box = None if mask is None else mask_box(mask, self.shape)
        if plan and (mask is None or box is not None):
            # the view only gains or loses size-1 axes, so it always aliases the tensor
            self._view(plan, box)[...] = values if box is None else values[box]
            return
        if mask is None:
            target[self._points(None)] = values
        else:
            target[self._points(mask)] = values[np.broadcast_to(mask, self.shape)]

    def count(self, mask=None) -> int:
        """How many points the access addresses under ``mask``."""
        mask = self.combined_mask(mask)
        if mask is None:
            return self.size
        return int(np.broadcast_to(mask, self.shape).sum())

    def _bounds(self, mask=None):
        """Per tensor axis (lowest, highest) index addressed under ``mask``."""
        mask = self.combined_mask(mask)
        plan = self.plan()
        box = None if mask is None else mask_box(mask, self.shape)
        if plan and (mask is None or box is not None):
            out = []
            for step in plan:
                if step[0] == "const":
                    out.append((step[1], step[1]))
                    continue
                _, d, start, stride = step
                first, last = 0, self.shape[d] - 1
                if box is not None and box[d].start is not None:
                    first, last = box[d].start, box[d].stop - 1
                out.append((start + first * stride, start + last * stride))
            return out
        out = []
        for a in self._points(mask):
            out.append((int(a.min()), int(a.max())) if a.size else (0, 0))
        return out

    def box(self, mask=None):
        """Per base axis (first, last, step) of the addressed elements (see Tensor.box);
        None for indirect accesses, whose elements are only known at run time."""
        if self.indirect is not None or self.dynamic is not None:
            return None
        if self.indices is None:
            return self.tensor.box()
        bounds = self._bounds(mask)
        return self.tensor.box([b[0] for b in bounds], [b[1] for b in bounds])

    def region(self, mask=None) -> Region:
        """Bounding byte range of the addressed elements."""
        tensor = self.tensor
        if self.indices is None:
            return tensor.region()
        bounds = self._bounds(mask)
        data = tensor.data
        root = tensor.storage.array
        base = _address(data) - _address(root)
        lo = base + sum(b[0] * s for b, s in zip(bounds, data.strides))
        hi = base + sum(b[1] * s for b, s in zip(bounds, data.strides))
        return _region(tensor.storage, root, lo, hi)

    def row_bytes(self, mask=None) -> int:
        """Contiguous bytes per partition row of the addressed elements (one DMA descriptor):
        the innermost free access axes whose elements follow each other in the tensor's
        memory, in the order the access streams them. A DMA transfer gathers contiguous
        source buffers and scatters them into contiguous destination buffers ("Data within a
        DMA buffer must be continuous in the memory address map", aws-neuron-sdk@8a38e733
        general/nki/arch/trainium_inferentia2_arch.rst L616-617), so a buffer must be a run
        on both sides, and the on-chip side is contiguous in access order along a partition
        (L653-655). The run is found from the index expressions' per-axis steps whether or
        not the access is a strided NumPy view (``plan``): ``x[i_r, i_p, i_k]`` into a
        ``[p, r, k]`` tile runs over ``k``; a transposing ``x[i_f, i_p]`` runs one element.
        Indices that are not affine in the access axes (and run-time indices) give one
        element."""
        if self.indirect is not None or self.dynamic is not None:
            return self.itemsize
        strides = self._access_byte_strides()
        if strides is None:
            return self.itemsize
        mask = self.combined_mask(mask)
        box = None if mask is None else mask_box(mask, self.shape)
        counts = list(self.shape)
        if box is not None:
            counts = [
                b.stop - b.start if b.start is not None else n for b, n in zip(box, self.shape)
            ]
        return run_bytes(counts, strides, self.itemsize)

    def _access_byte_strides(self) -> list[int] | None:
        """Per access axis, the byte step in the tensor's memory between neighbouring
        addressed elements; None when an index is not affine in the access axes."""
        data = self.tensor.data
        if self.indices is None:
            return list(data.strides)
        rank = len(self.shape)
        strides = [0] * rank
        for values, byte_stride in zip(self.indices, data.strides):
            steps = _affine_steps(values, rank)
            if steps is None:
                return None
            for d, step in enumerate(steps):
                strides[d] += step * byte_stride
        return strides


def contiguous_row_bytes(array: np.ndarray) -> int:
    """Contiguous bytes per partition row of a view (one DMA descriptor)."""
    return run_bytes(array.shape, array.strides, array.itemsize)


def run_bytes(shape, byte_strides, itemsize: int) -> int:
    """Contiguous bytes per row of a view of ``shape`` with ``byte_strides``: the innermost
    axes whose elements follow each other in memory. The first axis pairs with the on-chip
    partitions, so a run never spans it. Both front-ends record a DMA's ``dma_row_bytes``
    (one descriptor) with it."""
    run = itemsize
    for n, stride in zip(reversed(tuple(shape)[1:]), reversed(tuple(byte_strides)[1:])):
        if n == 1:
            continue
        if stride != run:
            break
        run *= n
    return run


def check_tile_shape(shape, what: str) -> None:
    if len(shape) < 2:
        raise NKIAssertionError(
            f"Insufficient rank! {what} must have a partition and a free axis",
            "err_insufficient_rank",
        )
    _check_partitions(int(shape[0]), what)
