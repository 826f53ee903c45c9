"""``nl.NkiTensor``: a view (shape, strides, offset, dtype) of one storage buffer.

Every view shares its storage: an element ``(i0, ..., in-1)`` lives at storage position
``offset + sum(strides[k] * ik)`` (STUB-NL ``NkiTensor``, ``nki/api/nki/language/__init__.py
@81ce03ae``, lines 109-166). HBM storage is linear; SBUF/PSUM storage is ``partitions x
free`` with dim 0 of every on-chip tensor the partition dim, so the partition stride of a
fresh on-chip tensor is its free element count. The simulator keeps each storage as one
flat NumPy array in the storage dtype and reads/writes views of it with ``as_strided``.
"""

from __future__ import annotations

import enum
import math
import warnings

import numpy as np
from numpy.lib.stride_tricks import as_strided

from simulate.core.memory import Storage
from simulate.core.trace import Region

from . import context, release
from . import dtypes as dt
from .errors import NkiIndexError, NkiTypeError, NkiValidationError, NkiValueError

MAX_RANK = 5  # LG: a view is an access pattern "with up to 5 dimensions"


class MemoryRegion(enum.Enum):
    """``nl.MemoryRegion``; ``nl.hbm`` is ``private_hbm`` (STUB-NL)."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    @property
    def memory(self) -> str:
        return "hbm" if self.value.endswith("hbm") else self.value


def as_buffer(buffer, argname: str = "buffer") -> MemoryRegion:
    """Buffers are ``nl.sbuf`` etc.; string names are rejected since 0.3 (MIG 0.2->0.3)."""
    if isinstance(buffer, MemoryRegion):
        return buffer
    raise NkiTypeError(
        f"{argname}={buffer!r}: expected nl.sbuf, nl.psum, nl.hbm, nl.private_hbm "
        "or nl.shared_hbm (buffer names as strings are not accepted since NKI 0.3)"
    )


class Shape(tuple):
    """A tensor shape; compares equal to lists too (the docs compare ``.shape == [512, 512]``)."""

    def __eq__(self, other):
        if isinstance(other, list):
            other = tuple(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


class Buffer(Storage):
    """A storage of the 0.6 front-end: one flat array plus the on-chip geometry."""

    __slots__ = (
        "region_kind",
        "partitions",
        "free_size",
        "matmul_written",
        "value_written",
        "nki_dtype",
        "root",
        "expired",
    )

    def __init__(
        self, region: MemoryRegion, name: str, dtype, partitions: int, free_size: int, fill_value
    ):
        super().__init__(region.memory, region.value, name)
        self.root = None  # (shape, dtype, buffer, name) of the first tensor over it
        self.expired = None  # the loop API whose body declared it, once that loop has ended
        self.region_kind = region
        self.nki_dtype = dtype
        self.partitions = partitions  # 1 for HBM
        self.free_size = free_size  # elements per partition (all elements for HBM)
        self.array = np.empty(partitions * free_size, dt.storage_dtype(dtype))
        if fill_value is not None:
            self.array[...] = dt.cast(np.asarray(fill_value), dtype, self.array.dtype)
        # PSUM: which elements a matmul wrote since allocation (nc_matmul(accumulate=None)),
        # and which any instruction wrote (nc_matmul(accumulate=True)); on-chip memory is
        # allocated uninitialised (nl.zeros/nl.full issue a memset)
        psum = region is MemoryRegion.psum
        self.matmul_written = np.zeros(self.array.size, bool) if psum else None
        self.value_written = np.zeros(self.array.size, bool) if psum else None


def _row_major(shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _check_rank(shape, what):
    if not 1 <= len(shape) <= MAX_RANK:
        raise NkiValueError(
            f"{what}: a tensor has 1 to {MAX_RANK} dimensions, got shape {tuple(shape)}"
        )


class NkiTensor:
    """A tensor view in HBM, SBUF or PSUM (``nl.ndarray`` and friends return these)."""

    indexed = False  # made by indexing another tensor (chained slicing is NKI 0.5+)

    def __init__(
        self,
        shape,
        dtype,
        storage: Buffer,
        buffer=None,
        name: str = "",
        *,
        strides=None,
        offset: int = 0,
    ):
        self._shape = Shape(int(n) for n in shape)
        _check_rank(self._shape, name or "tensor")
        self.dtype = dt.as_dtype(dtype)
        self._stored = dt.storage_dtype(self.dtype)  # the element type views read and write
        self.storage = storage
        self.buffer = storage.region_kind if buffer is None else as_buffer(buffer)
        self.name = name or storage.name
        self.strides = tuple(
            int(s) for s in (strides if strides is not None else self._fresh_strides())
        )
        self.offset = int(offset)
        self._check_bounds()
        if storage.root is None:
            storage.root = (self._shape, self.dtype, self.buffer, self.name)

    def _fresh_strides(self):
        if self.on_chip:
            return (self.free_units(),) + _row_major(self._shape[1:])
        return _row_major(self._shape)

    # --- attributes ----------------------------------------------------------------------
    @property
    def base_tensor(self) -> NkiTensor:
        """The whole tensor this view was cut from. Not in the API reference; AWS's MX MoE
        reads ``weight.base_tensor.dtype`` of a kernel argument (aws-neuron/nki-library@d2ad3a5
        src/nkilib_src/nkilib/core/moe/moe_tkg/gate_up_projection_mx.py L354,
        down_projection_mx.py L105), as of its TensorView (core/utils/tensor_view.py L45-51);
        inferred: the storage's first tensor (shape, dtype, buffer)."""
        shape, dtype, buffer, name = self.storage.root
        return NkiTensor(shape, dtype, self.storage, buffer, name)

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def on_chip(self) -> bool:
        return self.storage.memory != "hbm"

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def free_units(self) -> int:
        """Elements of this view's dtype per partition of its storage."""
        storage = self.storage
        return storage.free_size * storage.array.dtype.itemsize // self._stored.itemsize

    def __repr__(self):
        return (
            f"NkiTensor({self.name or 'tensor'}, shape={tuple(self._shape)}, "
            f"dtype={self.dtype}, buffer={self.buffer.value})"
        )

    def __len__(self):
        return self._shape[0]

    # --- storage access ------------------------------------------------------------------
    def _flat(self) -> np.ndarray:
        """The storage as a flat array of this view's (storage) element type."""
        expired = getattr(self.storage, "expired", None)
        if expired is not None:
            raise NkiValidationError(
                f"`{self.name or 'tensor'}` was declared inside the body of an {expired} and "
                "is used after the loop: 'Tensors (nl.ndarray) declared inside a body function "
                "cannot be referenced outside of the loop' (aws-neuron-sdk@81ce03ae "
                "nki/migration/index.rst L139-140)"
            )
        flat = self.storage.array
        return flat if flat.dtype == self._stored else flat.view(self._stored)

    def _extent(self) -> tuple[int, int]:
        lo = hi = self.offset
        for n, s in zip(self._shape, self.strides):
            if s > 0:
                hi += (n - 1) * s
            else:
                lo += (n - 1) * s
        return lo, hi

    def _check_bounds(self) -> None:
        lo, hi = self._extent()
        size = self._flat().size
        if lo < 0 or hi >= size:
            raise NkiIndexError(
                f"view of `{self.name or 'tensor'}` with shape "
                f"{tuple(self._shape)}, strides {self.strides} and offset "
                f"{self.offset} reaches outside its storage of {size} elements"
            )

    def array(self) -> np.ndarray:
        """The view as a (writeable) NumPy array over the storage, in the storage dtype."""
        flat = self._flat()
        isz = flat.dtype.itemsize
        base = flat[self.offset :]
        # ml_dtypes' float8_e5m2 says "<f1" in its array interface, which NumPy cannot parse
        # back (as_strided goes through it): stride the bytes and view them as the dtype
        bytewise = base.dtype.kind == "f" and isz == 1
        view = as_strided(
            base.view(np.uint8) if bytewise else base,
            shape=tuple(self._shape),
            strides=tuple(s * isz for s in self.strides),
        )
        return view.view(base.dtype) if bytewise else view

    def values(self) -> np.ndarray:
        """A copy of the elements (storage dtype)."""
        return np.array(self.array(), copy=True)

    def _derive(self, shape, strides, offset, dtype=None) -> NkiTensor:
        return NkiTensor(
            shape,
            dtype or self.dtype,
            self.storage,
            self.buffer,
            self.name,
            strides=strides,
            offset=offset,
        )

    # --- indexing --------------------------------------------------------------------------
    def __getitem__(self, key) -> NkiTensor:
        if self.indexed:
            release.require("indexing a view made by indexing (chained slicing)")
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            at = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = (slice(None),) * (self.ndim - len(key) + 1)
            key = key[:at] + fill + key[at + 1 :]
        if len(key) > self.ndim:
            raise NkiIndexError(
                f"too many indices for `{self.name}` of shape {tuple(self._shape)}: {len(key)}"
            )
        key = key + (slice(None),) * (self.ndim - len(key))
        shape, strides, offset, dropped = [], [], self.offset, None
        for dim, (k, n, s) in enumerate(zip(key, self._shape, self.strides)):
            if isinstance(k, slice):
                start, stop, step = _slice_range(k, n, dim, self.name)
                offset += start * s
                shape.append(len(range(start, stop, step)))
                strides.append(s * step)
                continue
            if isinstance(k, VirtualRegister):  # "Register values can be used to index
                k = k.value  # tensors" (nki-language-guide.rst@81ce03ae L518-521): run time
            elif isinstance(k, NkiTensor) or not hasattr(k, "__index__"):
                raise NkiIndexError(
                    f"index {k!r} of `{self.name}`: NKI 0.6 indexes with ints, "
                    "slices and nl.ds(start, size) (no index arrays, nl.arange "
                    "was removed)"
                )
            i = int(k)
            if not -n <= i < n:
                raise NkiIndexError(
                    f"index {i} is out of bounds for dimension {dim} of `{self.name}` with size {n}"
                )
            i %= n
            offset += i * s
            if self.on_chip and dim == 0:  # an int on the partition dim keeps it (size 1)
                shape.append(1)
                strides.append(s)
            else:
                dropped = s
        if self.on_chip and len(shape) < 2:  # on-chip views keep >= 2 dims (LG indexing)
            shape.append(1)
            strides.append(1 if dropped is None else dropped)
        if not shape:  # HBM: an index never leaves rank 0
            shape, strides = [1], [1]
        view = self._derive(shape, strides, offset)
        view.indexed = True
        return view

    # --- view methods (STUB-NL NkiTensor, RN 0.5) --------------------------------------------
    def _dim(self, dim: int, api: str, allow_partition: bool = False) -> int:
        if not -self.ndim <= dim < self.ndim:
            raise NkiIndexError(f"{api}: dim {dim} out of range for rank {self.ndim}")
        dim %= self.ndim
        if dim == 0 and self.on_chip and not allow_partition:
            raise NkiValidationError(
                f"{api}: dim 0 is the partition dimension of on-chip "
                f"tensor `{self.name}` and cannot be changed"
            )
        return dim

    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        release.require("NkiTensor.slice")
        dim = self._dim(dim, "slice", allow_partition=True)
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index) -> NkiTensor:
        release.require("NkiTensor.select")
        dim = self._dim(dim, "select", allow_partition=True)
        if isinstance(index, NkiTensor):
            raise NkiTypeError(
                "select with a dynamic (tensor) index is not supported by this simulator"
            )
        index = int(index)
        if not 0 <= index < self._shape[dim]:
            raise NkiIndexError(
                f"select: index {index} out of range for dim {dim} of size {self._shape[dim]}"
            )
        shape = list(self._shape)
        strides = list(self.strides)
        offset = self.offset + index * strides[dim]
        del shape[dim], strides[dim]
        return self._derive(shape, strides, offset)

    def permute(self, dims) -> NkiTensor:
        release.require("NkiTensor.permute")
        dims = tuple(int(d) % self.ndim for d in dims)
        if sorted(dims) != list(range(self.ndim)):
            raise NkiValidationError(f"permute: {dims} is not a permutation of {self.ndim} dims")
        if self.on_chip and dims[0] != 0:
            raise NkiValidationError(
                "permute: dims[0] must be 0 for an on-chip tensor (the "
                "partition dimension stays first)"
            )
        return self._derive(
            [self._shape[d] for d in dims], [self.strides[d] for d in dims], self.offset
        )

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        release.require("NkiTensor.broadcast")
        dim = self._dim(dim, "broadcast")
        if self._shape[dim] != 1:
            raise NkiValidationError(
                f"broadcast: dim {dim} has size {self._shape[dim]}, only size-1 dims broadcast"
            )
        shape, strides = list(self._shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        view = self._derive(shape, strides, self.offset)
        view.read_only_broadcast = True  # "repeating elements": a source, never a destination
        return view

    def expand_dim(self, dim: int) -> NkiTensor:
        release.require("NkiTensor.expand_dim")
        dim = int(dim) % (self.ndim + 1)
        if dim == 0 and self.on_chip:
            raise NkiValidationError(
                "expand_dim: cannot insert a dim before the partition dim of an on-chip tensor"
            )
        shape, strides = list(self._shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, strides[dim] * shape[dim + 1] if dim < self.ndim else 1)
        return self._derive(shape, strides, self.offset)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        release.require("NkiTensor.squeeze_dim")
        dim = self._dim(dim, "squeeze_dim")
        if self._shape[dim] != 1:
            raise NkiValidationError(f"squeeze_dim: dim {dim} has size {self._shape[dim]}, not 1")
        shape, strides = list(self._shape), list(self.strides)
        del shape[dim], strides[dim]
        return self._derive(shape, strides, self.offset)

    def reshape_dim(self, dim: int, shape) -> NkiTensor:
        release.require("NkiTensor.reshape_dim")
        dim = self._dim(dim, "reshape_dim", allow_partition=len(shape) == 1)
        sizes = list(shape)
        if sizes.count(-1) > 1:
            raise NkiValidationError("reshape_dim: at most one -1")
        if -1 in sizes:
            known = math.prod(s for s in sizes if s != -1)
            sizes[sizes.index(-1)] = self._shape[dim] // known
        if math.prod(sizes) != self._shape[dim]:
            raise NkiValidationError(
                f"reshape_dim: {tuple(shape)} does not split dim {dim} of size {self._shape[dim]}"
            )
        inner = [self.strides[dim] * s for s in _row_major(sizes)]
        return self._derive(
            list(self._shape[:dim]) + sizes + list(self._shape[dim + 1 :]),
            list(self.strides[:dim]) + inner + list(self.strides[dim + 1 :]),
            self.offset,
        )

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        release.require("NkiTensor.flatten_dims")
        start, end = int(start_dim) % self.ndim, int(end_dim) % self.ndim
        if self.on_chip and start == 0:
            raise NkiValidationError("flatten_dims: start_dim must be > 0 for an on-chip tensor")
        for d in range(start, end):
            if (
                self._shape[d + 1] != 1
                and self._shape[d] != 1
                and (self.strides[d] != self.strides[d + 1] * self._shape[d + 1])
            ):
                raise NkiValidationError(
                    f"flatten_dims: dims {start}..{end} are not contiguous in memory"
                )
        merged = math.prod(self._shape[start : end + 1])
        return self._derive(
            list(self._shape[:start]) + [merged] + list(self._shape[end + 1 :]),
            list(self.strides[:start]) + [self.strides[end]] + list(self.strides[end + 1 :]),
            self.offset,
        )

    def is_contiguous(self) -> bool:
        """Row-major dense; for on-chip tensors dim 0 (partitions) is skipped."""
        release.require("NkiTensor.is_contiguous")
        first = 1 if self.on_chip else 0
        expected = 1
        for n, s in zip(reversed(self._shape[first:]), reversed(self.strides[first:])):
            if n != 1 and s != expected:
                return False
            expected *= n
        return True

    def reshape(self, shape) -> NkiTensor:
        shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if math.prod(shape) != self.size:
            raise NkiValidationError(
                f"reshape: cannot reshape `{self.name}` of shape "
                f"{tuple(self._shape)} ({self.size} elements) into {shape} "
                f"({math.prod(shape)} elements)"
            )
        if self.on_chip and shape[0] != self._shape[0]:
            raise NkiValidationError(
                f"reshape: the partition dimension of on-chip `{self.name}` "
                f"must stay {self._shape[0]}, got {shape}"
            )
        if not self.is_contiguous():
            raise NkiValidationError(f"reshape: `{self.name}` is not contiguous in memory")
        strides = (self.strides[0],) + _row_major(shape[1:]) if self.on_chip else _row_major(shape)
        return self._derive(shape, strides, self.offset)

    def view(self, dtype) -> NkiTensor:
        """Reinterpret the bits; the last dim scales by the itemsize ratio."""
        new = dt.kernel_dtype(dtype)
        old_size, new_size = self.itemsize, new.itemsize
        if self.strides[-1] != 1 and self._shape[-1] != 1:
            raise NkiValidationError("view: the last dim must be contiguous")
        last = self._shape[-1] * old_size
        if last % new_size or (self.offset * old_size) % new_size:
            raise NkiValidationError(
                f"view: last dim of {last} bytes does not divide into {new} elements"
            )
        ratio = old_size / new_size
        strides = [int(s * ratio) for s in self.strides[:-1]] + [1]
        shape = list(self._shape[:-1]) + [last // new_size]
        return NkiTensor(
            shape,
            new,
            self.storage,
            self.buffer,
            self.name,
            strides=strides,
            offset=self.offset * old_size // new_size,
        )

    reinterpret_cast = view

    def get_pattern(self) -> list[list[int]]:
        return [[s, n] for s, n in zip(self.strides, self._shape)]

    def is_indirect(self) -> bool:
        release.require("NkiTensor.is_indirect")
        return False

    def ap(
        self,
        pattern,
        offset=None,
        scalar_offset=None,
        vector_offset=None,
        indirect_dim=0,
        dtype=None,
    ) -> NkiTensor:
        """A raw access pattern over the storage (APS, STUB-NL ``ap``): ``pattern`` is a list
        of ``[stride, count]`` pairs, outermost first, interpreted against the storage (the
        view's own shape and strides are ignored). An explicit ``offset`` is added to the
        view's offset (0.6 docstring; spec decision, warned about when the view's offset is
        non-zero)."""
        pairs = [tuple(int(v) for v in pair) for pair in pattern]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise NkiValidationError(
                f"ap: pattern must be a list of [stride, count] pairs, got {pattern!r}"
            )
        new = dt.kernel_dtype(dtype) if dtype is not None else self.dtype
        base = self.offset * self.itemsize // new.itemsize
        start = base
        if offset is not None:
            if base:
                warnings.warn(
                    "ap(offset=...) on a view with a non-zero offset: the offset is "
                    "added to the view's (NKI 0.6 docstring); APS/LG say it replaces "
                    "it",
                    stacklevel=2,
                )
            start = base + int(offset)
        if vector_offset is not None:
            return _vector_indirect(
                self, pairs, new, start, vector_offset, indirect_dim, scalar_offset
            )
        if scalar_offset is not None:
            value = _scalar_value(scalar_offset, "ap(scalar_offset=)")
            start += value * self.strides[int(indirect_dim)] * self.itemsize // new.itemsize
        strides = [s for s, _ in pairs]
        shape = [n for _, n in pairs]
        if scalar_offset is not None and not self.on_chip:
            try:
                view = NkiTensor(
                    shape, new, self.storage, self.buffer, self.name, strides=strides, offset=start
                )
            except NkiIndexError:  # checked row by row when the DMA runs (its oob_mode)
                return ScalarIndirectView(self, shape, strides, new, start, scalar_offset)
            view.dynamic_start = True  # a DMA through it may take oob_mode=skip
            return view
        if self.on_chip and shape[0] > 1:
            strides[0] = _partition_step(strides, shape, self, new)
        return NkiTensor(
            shape, new, self.storage, self.buffer, self.name, strides=strides, offset=start
        )

    # --- no arithmetic ---------------------------------------------------------------------
    def _no_operator(self, *_):
        raise NkiTypeError(
            "NkiTensor has no arithmetic operators in NKI 0.6: use nl.add / "
            "nl.multiply ... or nisa.tensor_tensor / nisa.tensor_scalar with dst="
        )

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _no_operator
    __truediv__ = __rtruediv__ = __iadd__ = __isub__ = __imul__ = __neg__ = _no_operator
    __pow__ = __matmul__ = _no_operator

    def __bool__(self):
        """A tensor is true as a condition, whatever it holds: "All ``if`` statements with
        compile-time conditions are resolved at specialization time"
        (aws-neuron-sdk@81ce03ae nki/get-started/nki-language-guide.rst L90) and a tensor's
        contents exist only when the kernel runs, so the test can only be whether the object
        is there. AWS's code relies on exactly that: ``if params.expert_params and
        params.expert_params.expert_index:`` reads the top-k width of any index tensor
        (nki-library@d2ad3a5 core/mlp/mlp_tkg/mlp_tkg_constants.py L173), zeros included."""
        return True


class VectorIndirectView(NkiTensor):
    """An HBM access pattern whose outermost term is a per-partition index read when the DMA
    runs: element ``(i, j...)`` is storage element ``offset + index[i]·scale + Σ j_k·s_k``,
    the pattern's first ``[stride, count]`` giving only the count (aws-neuron-sdk@81ce03ae
    nki/api/nki/isa/__init__.py dma_copy "Indirect addressing": the gather example's
    ``[[F, P], [1, F]]`` reads row ``idx[i]``; AWS's attention_block_tkg.py L1311-1315 passes
    ``[[1, tile_B], ...]`` with the index scaled by the stride of ``indirect_dim``). Only
    ``dma_copy`` reads or writes through it."""

    def __init__(self, base, shape, strides, dtype, offset, index, scale):
        self.index, self.scale = index, scale
        super().__init__(
            shape, dtype, base.storage, base.buffer, base.name, strides=strides, offset=offset
        )

    def is_indirect(self) -> bool:
        return True

    def index_columns(self) -> int:
        """Columns of the index: 1, or N of a [128, N] index (dma_transpose only)."""
        return self.index.shape[1] if self.index is not None and self.index.ndim == 2 else 1

    def _extent(self) -> tuple[int, int]:
        return 0, self._flat().size - 1  # any row the index may name

    def array(self) -> np.ndarray:
        raise NkiTypeError(
            f"`{self.name}`: an access pattern with vector_offset is read or written only by "
            "nisa.dma_copy (its indirect gather/scatter)"
        )

    def positions(self) -> np.ndarray:
        """The storage element of each element of the view, (rows, elements per row), from
        the index values the DMA reads now."""
        # a [128, N] index lists its rows column by column: "flat_indices =
        # indices.T.flatten()[:src.shape[0]]" (nki/api/nki/isa/__init__.py L907-908)
        rows = self.index.values().T.reshape(-1)[: self._shape[0]].astype(np.int64)
        inner = np.zeros(1, np.int64)
        for n, s in zip(self._shape[1:], self.strides[1:]):
            inner = (inner[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
        return self.offset + rows[:, None] * self.scale + inner[None, :]

    def storage_values(self) -> np.ndarray:
        return self._flat()


class ScalarIndirectView(VectorIndirectView):
    """An HBM access pattern moved by a ``scalar_offset`` so that some of its rows reach
    outside the tensor: a DMA checks its rows when it runs and raises or, with
    ``oob_mode.skip``, skips those rows (dma_copy docstring: "the src and dst tensors can have
    a dynamic start address ... out-of-bound address checking is turned on automatically";
    AWS's indexed_flatten.py L185-195 relies on the skip)."""

    def __init__(self, base, shape, strides, dtype, offset, source):
        self._rows_at = offset
        index = source if isinstance(source, NkiTensor) else None
        super().__init__(base, shape, strides, dtype, offset, index, 0)

    def positions(self) -> np.ndarray:
        flat = np.full(1, self._rows_at, np.int64)
        for n, s in zip(self._shape, self.strides):
            flat = (flat[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
        return flat.reshape(self._shape[0], -1)


def _vector_indirect(base, pairs, dtype, start, index, indirect_dim, scalar_offset):
    """``base.ap(pattern, vector_offset=index, indirect_dim=d)`` (dma_copy docstring,
    "Vector indirection"): ``base`` in HBM, ``index`` an SBUF ``(P, 1)`` integer tile with one
    row index per pattern row, not together with ``scalar_offset``."""
    if scalar_offset is not None:
        raise NkiValueError("ap: vector_offset and scalar_offset are mutually exclusive")
    if base.on_chip:
        raise NkiValueError(
            f"ap(vector_offset=): the indexed tensor must be in HBM, `{base.name}` is in "
            f"{base.buffer.value}"
        )
    if not isinstance(index, NkiTensor) or index.storage.memory != "sbuf":
        raise NkiTypeError("ap(vector_offset=) takes an SBUF tensor of row indices")
    if not dt.is_int(index.dtype):
        raise NkiTypeError(f"ap(vector_offset=) indices must be integers, got {index.dtype}")
    rows = pairs[0][1]
    columns = index.ndim == 2 and index.shape[1] > 1
    if columns and not (index.shape[0] == 128 and index.size >= rows):
        raise NkiValueError(
            f"ap(vector_offset=): a [P, N] index with N > 1 must have P = 128 and at least "
            f"{rows} elements, one row index per row of the pattern taken column by column "
            f"(dma_transpose, nki/api/nki/isa/__init__.py L897-908), got {tuple(index.shape)}"
        )
    if not columns and (index.size != index.shape[0] or index.shape[0] != rows):
        raise NkiValueError(
            f"ap(vector_offset=): the index must be ({rows}, 1), one row index per "
            f"row of the pattern, or [128, N] for dma_transpose, got {tuple(index.shape)}"
        )
    scale = base.strides[int(indirect_dim)] * base.itemsize // dtype.itemsize
    strides = [0] + [stride for stride, _ in pairs[1:]]
    shape = [count for _, count in pairs]
    return VectorIndirectView(base, shape, strides, dtype, start, index, scale)


def _scalar_value(value, api) -> int:
    if isinstance(value, VirtualRegister):
        return int(value.value)
    if isinstance(value, NkiTensor) and value.size == 1:
        return int(value.array().reshape(-1)[0])
    raise NkiTypeError(f"{api} takes a VirtualRegister or a 1-element tensor, got {value!r}")


def _slice_range(k: slice, n: int, dim: int, name: str) -> tuple[int, int, int]:
    step = 1 if k.step is None else int(k.step)
    start = 0 if k.start is None else int(k.start)
    stop = n if k.stop is None else int(k.stop)
    start = start + n if start < 0 else start
    stop = stop + n if stop < 0 else stop
    if step < 1 or not 0 <= start < stop <= n:
        raise NkiIndexError(
            f"slice {start}:{stop}:{step} is out of range (or empty) for "
            f"dimension {dim} of `{name}` with size {n}"
        )
    return start, stop, step


class VirtualRegister:
    """A 32-bit engine register holding a value known when the simulation runs it."""

    def __init__(self, value=0, read_only: bool = False):
        self.value = int(value)
        self.read_only = read_only

    def __int__(self):
        raise NkiTypeError(
            "a VirtualRegister has no compile-time value: use it as a loop bound, "
            "scalar_offset or iota offset"
        )

    __index__ = __int__

    def __bool__(self):
        warnings.warn(
            "`while reg:` is deprecated in NKI 0.6: use nl.while_loop",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.value != 0

    def _compared(self, *other):
        raise NkiTypeError(
            "a VirtualRegister is a device register, not a Python int: it cannot be compared "
            "at specialization time ('You cannot use it in host-side Python expressions (e.g., "
            "``if i == 0:``)', aws-neuron-sdk@81ce03ae nki/deep-dives/nki-dynamic-loops.rst "
            "L110-113)"
        )

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _compared
    __hash__ = object.__hash__

    def __repr__(self):
        return f"VirtualRegister({self.value})"


# --- allocation --------------------------------------------------------------------------------
def allocate(shape, dtype, buffer, name: str = "", fill="uninitialised") -> NkiTensor:
    """A new tensor in the running program; on-chip bytes are accounted against the target's
    SBUF/PSUM per partition (the core allocator), fresh memory holds NaN / 4 (SIM)."""
    program = context.current("nl.ndarray")
    region = as_buffer(buffer)
    dtype = dt.kernel_dtype(dtype)
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(n) for n in shape)
    if not shape or any(n < 1 for n in shape):
        raise NkiValueError(f"shape {shape} of `{name or 'tensor'}`: dims must be positive ints")
    _check_rank(shape, name or "tensor")
    fill_value = dt.uninitialised(dtype) if isinstance(fill, str) else fill
    if region is MemoryRegion.shared_hbm and program.launch.lnc > 1:
        return _in_loop_body(program, _shared(program, shape, dtype, name, fill_value))
    if region.memory == "hbm":
        storage = Buffer(region, name, dtype, 1, math.prod(shape), fill_value)
        return _in_loop_body(program, NkiTensor(shape, dtype, storage, region, name))
    if len(shape) == 1:
        warnings.warn(
            f"rank-1 on-chip tensor `{name or 'tensor'}` of shape {shape}: taken as "
            f"{shape[0]} partitions x 1 element",
            stacklevel=3,
        )
        shape = (shape[0], 1)
    free = math.prod(shape[1:])
    storage = Buffer(region, name, dtype, shape[0], free, fill_value)
    allocator = program.sbuf if region is MemoryRegion.sbuf else program.psum
    allocator.allocate(storage, free * dtype.itemsize)
    program.tiles[storage.id] = (
        region.memory,
        storage.bytes_per_partition,
        f"`{name or 'tensor'}` {shape} {dtype}",
    )
    return _in_loop_body(program, NkiTensor(shape, dtype, storage, region, name))


def _in_loop_body(program, tensor: NkiTensor) -> NkiTensor:
    """Note a tensor declared inside an ``nl.fori_loop`` / ``nl.while_loop`` body, which
    expires when the loop ends (:func:`simulate.nki06.language.fori_loop`)."""
    if program.loop_body_storages:
        program.loop_body_storages[-1].append(tensor.storage)
    return tensor


def _shared(program, shape, dtype, name, fill_value) -> NkiTensor:
    """Under LNC=2 the k-th shared_hbm allocation of every program is one tensor."""
    launch = program.launch
    with launch.lock:
        k = program.shared_cursor
        program.shared_cursor += 1
        if k == len(launch.shared_hbm):
            storage = Buffer(MemoryRegion.shared_hbm, name, dtype, 1, math.prod(shape), fill_value)
            launch.shared_hbm.append(
                NkiTensor(shape, dtype, storage, MemoryRegion.shared_hbm, name)
            )
        tensor = launch.shared_hbm[k]
    if tuple(tensor.shape) != shape or tensor.dtype is not dtype:
        raise NkiValueError(
            f"shared_hbm allocation #{k} differs between programs: "
            f"{tuple(tensor.shape)} {tensor.dtype} vs {shape} {dtype} (both "
            "cores must follow the same control flow)"
        )
    return tensor


# --- reads, writes and trace regions ------------------------------------------------------------
def partition_start(t: NkiTensor) -> int:
    return t.offset // t.free_units() if t.on_chip else 0


def region(t: NkiTensor) -> Region:
    """The bytes of the storage ``t`` covers (per partition on chip), for the trace."""
    lo, hi = t._extent()
    isz = t.itemsize
    storage = t.storage
    if not t.on_chip:
        return Region("hbm", storage.id, lo * isz, (hi + 1) * isz)
    free = t.free_units()
    p0 = lo // free
    p1 = p0 + (t.shape[0] if t.strides[0] else 1)
    f_lo = lo - p0 * free
    f_hi = f_lo + sum((n - 1) * s for n, s in zip(t.shape[1:], t.strides[1:]) if s > 0)
    base = storage.address
    return Region(storage.memory, storage.id, base + f_lo * isz, base + (f_hi + 1) * isz, (p0, p1))


def write(t: NkiTensor, values: np.ndarray, accumulated_by_matmul: bool = False) -> None:
    """Round ``values`` (any shape with ``t.size`` elements, paired in row-major order) into
    the view ``t``; a non-matmul write into PSUM forgets the matmul accumulation state.
    Through a stride-0 dimension the elements land on one place in access order, so the last
    one stays: AWS's qkv_cte.py L3046-3056 writes an unused ``activation_reduce`` result
    through ``.ap(pattern=[[1, s], [0, H]])``; the ``ap`` docs ban no zero stride ("Analogous
    to torch.as_strided", nki/api/nki/language/__init__.py L486-491); last-wins is inferred
    from the access order."""
    if getattr(t, "read_only_broadcast", False):
        raise NkiValidationError(
            f"`{t.name}`: an instruction cannot write through a broadcast() view (it repeats "
            "elements for reading; write through .ap() to alias a destination)"
        )
    target = t.array()
    values = np.asarray(values).reshape(target.shape)
    for dim, (n, stride) in enumerate(zip(t.shape, t.strides)):
        if stride == 0 and n > 1:
            values = values.take([n - 1], axis=dim)
            target = target[(slice(None),) * dim + (slice(0, 1),)]
    target[...] = dt.cast(values, t.dtype, target.dtype)
    storage = t.storage
    storage.written = True
    if storage.matmul_written is not None:
        initialized_mask(t)[...] = True
        if not accumulated_by_matmul:
            matmul_mask(t)[...] = False


def matmul_mask(t: NkiTensor) -> np.ndarray:
    """The per-element "written by a matmul" flags of a PSUM view."""
    return _psum_flags(t, t.storage.matmul_written)


def initialized_mask(t: NkiTensor) -> np.ndarray:
    """The per-element "written by any instruction" flags of a PSUM view."""
    return _psum_flags(t, t.storage.value_written)


def _psum_flags(t: NkiTensor, flags: np.ndarray) -> np.ndarray:
    ratio = t.storage.array.dtype.itemsize
    if t._flat().dtype.itemsize != ratio:
        raise NkiValidationError(
            "a PSUM view reinterpreted to another element size cannot take matmul results"
        )
    return as_strided(flags[t.offset :], shape=tuple(t.shape), strides=tuple(t.strides))


def _partition_step(strides, shape, tensor, dtype) -> int:
    """The storage stride of one partition for an on-chip ``.ap()`` pattern whose first
    ``[stride, count]`` pair is the partition dim. The docs' example gives it the storage's
    free size (``sb.ap(pattern=[[32, 128], [1, 32]])`` on a ``(128, 32)`` tile,
    aws-neuron-sdk@81ce03ae nki/api/nki/language/__init__.py L495-497); AWS's mlp_cte gives
    it the dense extent of the pattern's free pairs on a wider tile (``[[I_SHARD_SIZE *
    len(hidden_subtiles), 128], [I_SHARD_SIZE, len(hidden_subtiles)], [1, I_SHARD_SIZE]]``,
    nki-library@d2ad3a5 src/nkilib_src/nkilib/core/mlp/mlp_cte/mlp_cte_projection.py
    L1117-1124) and then reads the same elements at the start of each partition, so both
    step exactly one partition (inferred from that read-back). Any other stride is
    rejected: the docs give on-chip patterns no other meaning."""
    stored = dt.storage_dtype(dtype)
    free = tensor.storage.free_size * tensor.storage.array.dtype.itemsize // stored.itemsize
    dense = 1 + sum((n - 1) * abs(s) for s, n in zip(strides[1:], shape[1:]))
    if strides[0] not in (free, dense):
        raise NkiValidationError(
            f"ap: the partition stride {strides[0]} of an on-chip access pattern must be "
            f"the free size {free} of `{tensor.name}`'s storage or the pattern's dense free "
            f"extent {dense} (one partition either way)"
        )
    return free
