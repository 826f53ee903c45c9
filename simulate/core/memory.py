"""On-chip memory: per-partition allocation of SBUF and PSUM with the target's capacities.

A tile owns its bytes while the kernel holds a reference to it (CPython frees it when the
last reference goes, which is when the compiler's liveness analysis would reuse the space),
so the high-water mark the trace reports is what the kernel really keeps live, and reused
addresses give the cost model the write-after-read hazards of buffer reuse.

NKI scoping decides what counts as live: a tile created inside a loop body is out of scope
once that iteration is over (``err_local_variable_used_out_of_scope``), so a tile from an
earlier iteration that Python still holds (``x = nl.load(...)`` keeps the previous ``x``
until the assignment) does not count. Live tiles that need more than the target's SBUF or
PSUM per partition are an error, as the compiler's allocator fails on them.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import weakref

from .errors import CapacityError

_storage_ids = itertools.count(1)


class Storage:
    """One allocation: an on-chip tile (SBUF/PSUM) or an HBM tensor."""

    __slots__ = ("id", "memory", "kind", "name", "address", "bytes_per_partition", "written",
                 "param_index", "mutable", "par_axis", "array", "out_of_scope", "__weakref__")

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
        self.out_of_scope = ""  # set when the kernel block that created it has ended


def _stale(scope) -> bool:
    """True once any loop iteration the tile was created in is over."""
    return any(not frame.active or frame.iteration != iteration for frame, iteration in scope)


class PartitionAllocator:
    """First-fit allocator of byte ranges within every partition (all partitions alike)."""

    def __init__(self, memory: str, capacity: int, granule: int, trace, peak_attr: str):
        self.memory = memory
        self.capacity = capacity
        self.granule = granule
        self.blocks: list[tuple[int, int, int]] = []  # sorted (start, size, block id)
        self.scopes: dict[int, tuple] = {}  # block id -> ((loop frame, iteration), ...)
        self.ids = itertools.count()
        # Blocks whose tiles were garbage-collected. Their finalizers run on whichever thread
        # collects them, at any point (also in the middle of ``allocate``), so they only queue
        # the block; the allocator's own thread removes it before it next reads the blocks.
        self.released: collections.deque[tuple[int, int, int]] = collections.deque()
        self.trace = trace
        self.peak_attr = peak_attr

    def live_bytes(self) -> int:
        """Bytes per partition held by tiles still in scope."""
        self._remove_released()
        return sum(size for _, size, block in self.blocks if not _stale(self.scopes[block]))

    def allocate(self, storage: Storage, nbytes: int, what: str, scope=()) -> None:
        """Place a tile created in the loop iterations ``scope``; raise when the tiles in
        scope would need more than the target's bytes per partition."""
        size = max(self.granule, -(-nbytes // self.granule) * self.granule)
        live = self.live_bytes()
        if live + size > self.capacity:
            unit = "PSUM" if self.memory == "psum" else "SBUF"
            raise CapacityError(
                f"{unit} over capacity: {what} needs {nbytes} bytes per partition while live "
                f"tiles hold {live} of the target's {self.capacity} bytes per partition"
                + (" (PSUM is allocated in 2 KiB banks)" if self.memory == "psum" else "")
                + "; release tiles earlier or tile the free dimension",
                "err_sbuf_capacity_exceeded" if self.memory == "sbuf"
                else "err_psum_capacity_exceeded",
            )
        # first fit among tiles in scope; out-of-scope tiles' bytes are free to reuse
        start = 0
        for block_start, block_size, block in self.blocks:
            if _stale(self.scopes[block]):
                continue
            if block_start - start >= size:
                break
            start = max(start, block_start + block_size)
        if start + size > self.capacity:  # fragmented: place after everything in scope
            start = self.capacity - size
        block = next(self.ids)
        self.scopes[block] = tuple(scope)
        bisect.insort(self.blocks, (start, size, block))
        storage.address = start
        storage.bytes_per_partition = size
        if live + size > getattr(self.trace, self.peak_attr):
            setattr(self.trace, self.peak_attr, live + size)
        weakref.finalize(storage, self.released.append, (start, size, block))

    def _remove_released(self) -> None:
        while self.released:
            entry = self.released.popleft()
            index = bisect.bisect_left(self.blocks, entry)
            if index < len(self.blocks) and self.blocks[index] == entry:
                del self.blocks[index]
                del self.scopes[entry[2]]
