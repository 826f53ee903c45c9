"""On-chip memory: per-partition allocation of SBUF and PSUM with the target's capacities.

A tile owns its bytes while the kernel holds a reference to it (CPython frees it when the
last reference goes, which is when the compiler's liveness analysis would reuse the space),
so the high-water mark the trace reports is what the kernel really keeps live, and reused
addresses give the cost model the write-after-read hazards of buffer reuse.
"""

from __future__ import annotations

import bisect
import itertools
import weakref

from .errors import CapacityError
from .targets import PSUM_BANK_BYTES

_storage_ids = itertools.count(1)


class Storage:
    """One allocation: an on-chip tile (SBUF/PSUM) or an HBM tensor."""

    __slots__ = ("id", "memory", "kind", "name", "address", "bytes_per_partition", "written",
                 "param_index", "mutable", "__weakref__")

    def __init__(self, memory: str, kind: str, name: str = "", bytes_per_partition: int = 0):
        self.id = next(_storage_ids)
        self.memory = memory  # "sbuf", "psum" or "hbm"
        self.kind = kind  # "sbuf", "psum", "shared_hbm", "private_hbm", "param", "constant"
        self.name = name
        self.address = 0
        self.bytes_per_partition = bytes_per_partition
        self.written = False
        self.param_index = None
        self.mutable = False


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

    def allocate(self, storage: Storage, nbytes: int, what: str) -> None:
        size = max(self.granule, -(-nbytes // self.granule) * self.granule)
        start = 0
        for block_start, block_size in self.blocks:
            if block_start - start >= size:
                break
            start = block_start + block_size
        if start + size > self.capacity:
            unit = "PSUM" if self.memory == "psum" else "SBUF"
            raise CapacityError(
                f"{unit} over capacity: {what} needs {nbytes} bytes per partition but only "
                f"{self.capacity - self.used} of the target's {self.capacity} bytes per partition"
                f" are free ({self.used} held by live tiles"
                + (f", in {PSUM_BANK_BYTES}-byte banks" if self.memory == "psum" else "")
                + "); release tiles or tile the free dimension",
                "err_sbuf_capacity_exceeded" if self.memory == "sbuf"
                else "err_psum_capacity_exceeded",
            )
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
