"""Tensors, views and indexed accesses.

A :class:`Tensor` is a NumPy array (a view of its :class:`~simulate.memory.Storage`) in the
declared dtype, plus where it lives. Basic indexing (ints, slices, ``nl.ds``) gives another
``Tensor`` sharing memory; indexing with index expressions gives an :class:`Access`, which
instructions read (gather) or write (scatter) under a mask. Both know the region of their
storage they cover, which feeds the instruction trace and the ``affine_range`` checker.
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
from .indexing import IndexExpr, Predicate
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
        raise NKIIndexError(f"slice step must be positive on axis {axis} of {name}",
                            "err_unsupported_slice_step")
    start = 0 if sl.start is None else int(sl.start)
    stop = dim if sl.stop is None else int(sl.stop)
    if start < 0 or stop > dim or start > stop:
        raise NKIIndexError(
            f"Out-of-bound access for tensor `{name}` on dimension {axis}: index range "
            f"[{start}, {stop - 1}] exceed dimension size of {dim}",
            "err_tensor_access_out_of_bound",
        )
    return start, stop, step


class Tensor:
    """A tensor in HBM, SBUF or PSUM (``nl.ndarray`` and friends return these)."""

    __array_priority__ = 1000  # keep NumPy scalars from swallowing tile arithmetic

    def __init__(self, data: np.ndarray, dtype, storage, *, layout=None, par_axis: int = 0,
                 loops=()):
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
        self.fresh = None  # (instruction, mask) while it is the just-produced result of an op

    # --- NumPy-like attributes -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

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

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return (f"Tensor({self.name or 'tile'}, shape={self.shape}, dtype={dt.name(self.dtype)}, "
                f"buffer={self.buffer})")

    def __bool__(self):
        raise NKIValueError(
            "the truth value of a tile is ambiguous: control flow cannot depend on tile values",
            "err_ambiguous_tensor_truth_value",
        )

    # --- regions --------------------------------------------------------------------------
    def region(self) -> Region:
        """The byte range of the storage this view covers (bounding box per partition)."""
        storage = self.storage
        if self.data.size == 0:
            return Region(storage.memory, storage.id, 0, 0)
        base = self.data
        while base.base is not None and isinstance(base.base, np.ndarray):
            base = base.base
        lo_ptr = self.data.__array_interface__["data"][0]
        base_ptr = base.__array_interface__["data"][0]
        offset = lo_ptr - base_ptr
        span = sum((n - 1) * s for n, s in zip(self.data.shape, self.data.strides, strict=True)
                   if s > 0) + self.data.itemsize
        if storage.memory == "hbm":
            return Region("hbm", storage.id, offset, offset + span)
        # on chip: the partition axis of `data` is par_axis; bytes per partition are the rest
        pstride = self.data.strides[self.par_axis] or 1
        base_pstride = base.strides[0] if base.ndim else 1
        first_p = offset // base_pstride if base_pstride else 0
        within = offset - first_p * base_pstride
        free_span = span - (self.data.shape[self.par_axis] - 1) * pstride
        start = storage.address + within
        nparts = self.data.shape[self.par_axis]
        return Region(storage.memory, storage.id, start, start + free_span,
                      (first_p, first_p + nparts))

    # --- indexing -------------------------------------------------------------------------
    def __getitem__(self, key):
        if isinstance(key, Predicate):
            return Access(self, None, operand_mask=key)
        key = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, (IndexExpr, Tensor)) for k in key):
            return Access(self, key)
        return self._basic_view(key)

    def _basic_view(self, key) -> Tensor:
        if any(k is None for k in key):
            raise NKIIndexError("np.newaxis is not supported when indexing tensors",
                                "err_unsupported_indexing")
        if key.count(Ellipsis) > 1:
            raise NKIIndexError("at most one '...' in an index", "err_unsupported_indexing")
        if Ellipsis in key:
            at = key.index(Ellipsis)
            fill = (slice(None),) * (self.ndim - len(key) + 1)
            key = key[:at] + fill + key[at + 1:]
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
        par_axis = self.par_axis
        dropped_before_par = 0
        kept = 0
        for axis, (k, dim) in enumerate(zip(key, self.shape, strict=True)):
            b = base_of_view.get(axis)
            if isinstance(k, slice):
                start, stop, step = _slice_bounds(k, dim, axis, self.name)
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
        data = self.data[tuple(np_key)]
        par_axis = max(0, par_axis - dropped_before_par)
        if self.on_chip and data.ndim == 1 and self.par_axis < self.ndim and isinstance(
                key[self.par_axis], slice):
            # an integer on the only free axis: docs treat the result as (P, 1)
            data = data[:, None]
        layout = (base_shape, tuple(starts), tuple(steps), tuple(vmap))
        return Tensor(data, self.dtype, self.storage, layout=layout, par_axis=par_axis,
                      loops=self.loops)

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
        from . import language  # late: language builds on tensors

        language.assign(self[key], value)

    # --- HBM views ------------------------------------------------------------------------
    def reshape(self, shape) -> Tensor:
        """A view with another shape (HBM: free; on-chip: the partition dim must not change)."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if not self.data.flags.c_contiguous:
            raise NKIValueError(f"cannot reshape a strided view of `{self.name}`",
                                "err_reshape_non_contiguous")
        if int(np.prod(shape)) != self.data.size:
            raise NKIValueError(f"cannot reshape `{self.name}` of shape {self.shape} to {shape}",
                                "err_reshape_size_mismatch")
        if self.on_chip and shape[0] != self.shape[0]:
            raise NKIValueError("reshaping an on-chip tile cannot change its partition dim",
                                "err_reshape_partition")
        return Tensor(self.data.reshape(shape), self.dtype, self.storage, loops=self.loops)

    def view(self, dtype) -> Tensor:
        """Reinterpret the bits as another dtype of the same size."""
        dtype = dt.as_dtype(dtype)
        if dtype.itemsize != self.itemsize:
            raise NKIValueError("view() needs a dtype of the same size", "err_view_dtype_size")
        return Tensor(self.data.view(dtype), dtype, self.storage, layout=self.layout,
                      par_axis=self.par_axis, loops=self.loops)

    def astype(self, dtype) -> Tensor:
        from . import language

        return language.copy(self, dtype=dtype)

    def broadcast_to(self, shape) -> Tensor:
        from . import language

        return language.broadcast_to(self, shape=shape)

    def expand_dims(self, axis) -> Tensor:
        from . import language

        return language.expand_dims(self, axis)

    def assert_shape(self, shape):
        if tuple(shape) != self.shape:
            raise NKIValueError(f"tensor `{self.name}` has shape {self.shape}, expected {shape}",
                                "err_annotation_shape_mismatch")
        return self

    # --- operators (Vector-engine instructions; no partition broadcast) --------------------
    def _binary(self, other, op, reverse=False):
        from . import language

        a, b = (other, self) if reverse else (self, other)
        return language.elementwise_binary(op, a, b, operator=True)

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

    def __and__(self, o):
        return self._binary(o, "bitwise_and")

    def __or__(self, o):
        return self._binary(o, "bitwise_or")

    def __xor__(self, o):
        return self._binary(o, "bitwise_xor")

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
        from . import language

        return language.negative(self)

    def __invert__(self):
        from . import language

        return language.invert(self)

    def _inplace(self, other, op):
        from . import language

        language.accumulate(self, other, op)
        return self

    def __iadd__(self, o):
        return self._inplace(o, "add")

    def __isub__(self, o):
        return self._inplace(o, "subtract")

    def __imul__(self, o):
        return self._inplace(o, "multiply")

    def __itruediv__(self, o):
        return self._inplace(o, "divide")


class Access:
    """A tensor indexed with index expressions (advanced indexing), optionally operand-masked.

    ``indices`` holds one entry per axis of the tensor: an integer array broadcastable to the
    access shape, or an SBUF integer tile (indirect indexing, first axis only).
    """

    def __init__(self, tensor: Tensor, key, operand_mask: Predicate | None = None):
        self.tensor = tensor
        self.operand_mask = operand_mask
        if key is None:  # tile[mask]: the whole tile, restricted by the mask
            self.indices = None
            self.indirect = None
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
                "expressions; index every axis", "err_tensor_access_out_of_bound")
        self.indirect = None
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
            elif isinstance(k, Tensor):
                self._check_indirect(axis, k)
                self.indirect = (axis, k)
                arrays.append(np.zeros((k.shape[0],) + (1,) * (k.ndim - 1), np.int64))
            elif isinstance(k, (int, np.integer)):
                arrays.append(np.asarray(int(k)))
            else:
                raise NKIIndexError(f"unsupported index {k!r} on axis {axis}",
                                    "err_unsupported_indexing")
        self.indices = arrays
        self.shape = np.broadcast_shapes(*(a.shape for a in arrays))

    def _check_indirect(self, axis: int, index_tile: Tensor) -> None:
        if self.tensor.on_chip:
            raise NKIIndexError("indirect (runtime) indices only address HBM tensors",
                                "err_indirect_indices_free_dim")
        if axis != 0:
            raise NKIIndexError(
                "indirect indices are only supported on the first (partition) dimension",
                "err_indirect_indices_free_dim",
            )
        if not index_tile.on_chip or not dt.is_int(index_tile.dtype):
            raise NKITypeError("an indirect index must be an integer tile in SBUF",
                               "err_indirect_index_type")

    @property
    def dtype(self):
        return self.tensor.dtype

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def storage(self):
        return self.tensor.storage

    @property
    def name(self):
        return self.tensor.name

    @property
    def on_chip(self):
        return self.tensor.on_chip

    def __getitem__(self, key):
        if isinstance(key, Predicate) and self.operand_mask is None:
            access = Access.__new__(Access)
            access.__dict__.update(self.__dict__)
            access.operand_mask = key
            return access
        raise NKIIndexError("an indexed access can only be restricted further by a mask",
                            "err_unsupported_indexing")

    def __setitem__(self, key, value):
        from . import language

        language.assign(self[key], value)

    # --- concrete index arrays ------------------------------------------------------------
    def _arrays(self) -> list[np.ndarray]:
        arrays = list(self.indices)
        if self.indirect is not None:
            axis, tile = self.indirect
            values = tile.data.astype(np.int64)
            if values.ndim > 1:
                values = values.reshape(values.shape[0], *([1] * (len(self.shape) - 1)))
            arrays[axis] = values
        return arrays

    def _slices(self, arrays):
        """Basic slices equivalent to the index arrays, when every array is an arithmetic
        progression along its own axis (the common ``t[i*128 + ip, if]`` case)."""
        if self.indirect is not None:
            return None
        rank = len(self.shape)
        key = []
        for axis, a in enumerate(arrays):
            a = a.reshape((1,) * (rank - a.ndim) + a.shape) if a.ndim < rank else a
            varying = [d for d, n in enumerate(a.shape) if n > 1]
            if not varying:
                v = int(a.reshape(-1)[0])
                key.append(slice(v, v + 1))
                if self.shape[axis] != 1 if axis < rank else False:
                    return None
                continue
            if varying != [axis] or a.shape[axis] != self.shape[axis]:
                return None
            flat = a.reshape(-1)
            step = int(flat[1] - flat[0]) if flat.size > 1 else 1
            if step <= 0 or (flat.size > 2 and not np.all(np.diff(flat) == step)):
                return None
            key.append(slice(int(flat[0]), int(flat[-1]) + 1, step))
        if len(arrays) != rank:
            return None
        return tuple(key)

    def _check_bounds(self, arrays, mask) -> None:
        for axis, (a, dim) in enumerate(zip(arrays, self.tensor.shape, strict=True)):
            sel = a if mask is None else np.broadcast_to(a, self.shape)[mask]
            if sel.size == 0:
                continue
            lo, hi = int(sel.min()), int(sel.max())
            if lo < 0 or hi >= dim:
                if self.indirect is not None and axis == self.indirect[0]:
                    bad = hi if hi >= dim else lo
                    raise NKIIndexError(
                        f"index {bad} is out of bounds for axis {axis} with size {dim}",
                        "err_dynamic_index_out_of_bound")
                raise NKIIndexError(
                    f"Out-of-bound access for tensor `{self.name}` on dimension {axis}: index "
                    f"range [{lo}, {hi}] exceed dimension size of {dim} (mask the "
                    "out-of-range points with mask=)",
                    "err_tensor_access_out_of_bound",
                )

    def combined_mask(self, mask):
        """AND the instruction mask with the operand mask, broadcast to the access shape."""
        if self.operand_mask is not None:
            om = np.broadcast_to(self.operand_mask.values, self.shape)
            mask = om if mask is None else (np.broadcast_to(mask, self.shape) & om)
        if mask is not None:
            mask = np.broadcast_to(mask, self.shape)
            if mask.all():
                return None
        return mask

    def read(self, mask=None) -> tuple[np.ndarray, np.ndarray | None]:
        """Gather the addressed elements. Returns (values, mask); masked-off points are
        never read (they hold the uninitialised value)."""
        mask = self.combined_mask(mask)
        if self.indices is None:
            return self.tensor.data, mask
        arrays = self._arrays()
        self._check_bounds(arrays, mask)
        if mask is None:
            key = self._slices(arrays)
            if key is not None:
                return self.tensor.data[key].reshape(self.shape), None
            return self.tensor.data[tuple(arrays)], None
        out = np.full(self.shape, dt.uninitialised(self.dtype), dtype=self.tensor.data.dtype)
        full = [np.broadcast_to(a, self.shape)[mask] for a in arrays]
        out[mask] = self.tensor.data[tuple(full)]
        return out, mask

    def write(self, values: np.ndarray, mask=None) -> None:
        """Scatter ``values`` (already in the tensor's dtype, access-shaped) to the addressed
        elements where the mask holds."""
        mask = self.combined_mask(mask)
        target = self.tensor.data
        if self.indices is None:
            if mask is None:
                target[...] = values
            else:
                target[mask] = np.broadcast_to(values, self.shape)[mask]
            return
        arrays = self._arrays()
        self._check_bounds(arrays, mask)
        if mask is None:
            key = self._slices(arrays)
            if key is not None:
                view = target[key]
                view[...] = np.broadcast_to(values, self.shape).reshape(view.shape)
                return
            target[tuple(np.broadcast_to(a, self.shape) for a in arrays)] = values
            return
        full = tuple(np.broadcast_to(a, self.shape)[mask] for a in arrays)
        target[full] = np.broadcast_to(values, self.shape)[mask]

    def box(self, mask=None):
        """Per base axis (first, last, step) of the addressed elements (see Tensor.box)."""
        mask = self.combined_mask(mask)
        if self.indices is None or self.indirect is not None:
            return self.tensor.box()
        lo, hi = [], []
        for a in self.indices:
            sel = a if mask is None else np.broadcast_to(a, self.shape)[mask]
            lo.append(int(sel.min()) if sel.size else 0)
            hi.append(int(sel.max()) if sel.size else 0)
        return self.tensor.box(lo, hi)

    def region(self, mask=None) -> Region:
        """Bounding byte range of the addressed elements (whole tensor if indirect)."""
        storage = self.tensor.storage
        if self.indices is None or self.indirect is not None:
            return self.tensor.region()
        arrays = self.indices
        lo_idx, hi_idx = [], []
        for a in arrays:
            lo_idx.append(int(a.min()) if a.size else 0)
            hi_idx.append(int(a.max()) if a.size else 0)
        data = self.tensor.data
        strides = data.strides
        if storage.memory == "hbm":
            start = sum(i * s for i, s in zip(lo_idx, strides, strict=True))
            stop = sum(i * s for i, s in zip(hi_idx, strides, strict=True)) + data.itemsize
            base = self.tensor.region()
            return Region("hbm", storage.id, base.start + start, base.start + stop)
        base = self.tensor.region()
        pa = self.tensor.par_axis
        free_lo = sum(i * s for d, (i, s) in enumerate(zip(lo_idx, strides, strict=True))
                      if d != pa)
        free_hi = sum(i * s for d, (i, s) in enumerate(zip(hi_idx, strides, strict=True))
                      if d != pa) + data.itemsize
        p0 = base.partitions[0] + lo_idx[pa]
        return Region(storage.memory, storage.id, base.start + free_lo, base.start + free_hi,
                      (p0, base.partitions[0] + hi_idx[pa] + 1))


def partition_count(shape) -> int:
    return int(shape[0]) if len(shape) else 1


def check_tile_shape(shape, what: str) -> None:
    if len(shape) < 2:
        raise NKIAssertionError(
            f"Insufficient rank! {what} must have a partition and a free axis",
            "err_insufficient_rank")
    _check_partitions(int(shape[0]), what)
