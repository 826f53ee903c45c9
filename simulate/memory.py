"""On-chip memory: per-partition allocation of SBUF and PSUM with the target's capacities.

A tile owns its bytes while the kernel holds a reference to it (CPython frees it when the
last reference goes, which is when the compiler's liveness analysis would reuse the space),
so the high-water mark the trace reports is what the kernel really keeps live, and reused
addresses give the cost model the write-after-read hazards of buffer reuse. A single tile
larger than the memory is an error; live tiles that together exceed it raise a
:class:`~simulate.errors.CapacityWarning` (the compiler would spill).
"""

from __future__ import annotations

import bisect
import itertools
import warnings
import weakref

from .errors import CapacityError, CapacityWarning

_storage_ids = itertools.count(1)


class Storage:
    """One allocation: an on-chip tile (SBUF/PSUM) or an HBM tensor."""

    __slots__ = ("id", "memory", "kind", "name", "address", "bytes_per_partition", "written",
                 "param_index", "mutable", "par_axis", "array", "__weakref__")

    def __init__(self, memory: str, kind: str, name: str = "", bytes_per_partition: int = 0):
        self.id = next(_storage_ids)
        self.memory = memory  # "sbuf", "psum" or "hbm"
        self.kind = kind  # "sbuf", "psum", "shared_hbm", "private_hbm", "param", "constant"
        self.name = name
        self.address = 0
        self.bytes_per_partition = bytes_per_partition
        self.written = False
        self.param_index = None  # position (or keyword) of a kernel parameter
        self.mutable = False
        self.par_axis = 0  # axis of the backing array that is the partition axis
        self.array = None  # the C-contiguous backing array every view of the storage is in


class PartitionAllocator:
    """First-fit allocator of byte ranges within every partition (all partitions alike)."""

    def __init__(self, memory: str, capacity: int, granule: int, trace, peak_attr: str):
        self.memory = memory
        self.capacity = capacity
        self.granule = granule
        self.blocks: list[tuple[int, int]] = []  # sorted (start, size)
        self.used = 0
        self.trace = trace
        self.peak_attr = peak_attr
        self.oversubscribed = False

    def allocate(self, storage: Storage, nbytes: int, what: str) -> None:
        """Place a tile. A tile larger than the whole memory is an error; live tiles that
        together exceed it only warn (the compiler would spill, and Python may keep a
        rebound tile alive a little longer than the compiler's liveness analysis)."""
        size = max(self.granule, -(-nbytes // self.granule) * self.granule)
        unit = "PSUM" if self.memory == "psum" else "SBUF"
        if size > self.capacity:
            raise CapacityError(
                f"{unit} over capacity: {what} needs {nbytes} bytes per partition, more than the "
                f"target's {self.capacity} bytes per partition; tile the free dimension",
                "err_sbuf_capacity_exceeded" if self.memory == "sbuf"
                else "err_psum_capacity_exceeded",
            )
        start = 0
        for block_start, block_size in self.blocks:
            if block_start - start >= size:
                break
            start = block_start + block_size
        if start + size > self.capacity:
            start = max((b + n for b, n in self.blocks), default=0)
            if not self.oversubscribed:
                self.oversubscribed = True
                warnings.warn(
                    f"{unit} oversubscribed: {what} needs {nbytes} bytes per partition while live"
                    f" tiles hold {self.used} of the target's {self.capacity}; the compiler "
                    "would have to spill (release tiles earlier or tile the free dimension)",
                    CapacityWarning, stacklevel=5)
        bisect.insort(self.blocks, (start, size))
        self.used += size
        storage.address = start
        storage.bytes_per_partition = size
        if self.used > getattr(self.trace, self.peak_attr):
            setattr(self.trace, self.peak_attr, self.used)
        weakref.finalize(storage, self._release, start, size)

    def _release(self, start: int, size: int) -> None:
        index = bisect.bisect_left(self.blocks, (start, size))
        if index < len(self.blocks) and self.blocks[index] == (start, size):
            del self.blocks[index]
            self.used -= size
