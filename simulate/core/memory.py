"""On-chip memory: where SBUF and PSUM tiles are placed, and whether the tiles a kernel keeps
live fit the target's capacity.

Capacity follows the compiler's liveness, not Python's references: a tile is live from the
first instruction that touches it (its definition) to the last one (its last use), whatever
Python names still refer to it. "The block dimension of tensors is a **logical** dimension
... The compiler analyzes the memory dependency and allocates physical address to each tiles.
This means that the physical tiles may not be alive in the memory simultaneously"
(aws-neuron-sdk@8a38e733 general/nki/nki_block_dimension_migration_guide.rst L33), and
"Neuron Compiler inspects the above code and uses a heuristic-driven allocator to decide
how many physical tiles are allocated to each tensor" (nki_direct_allocation_guide.rst
L44-L46): so each (P, F) block of a ``(B, P, F)`` tensor has its own live range, and "at the
very minimum, only 1 physical tile of `a` needs to be alive. Then the execution is
completely serialized" (migration guide L50) -- the live set of the trace in issue order is
what the compiler's allocator has to fit. :func:`check_live_capacity` raises when it does
not; one tile (block) larger than a partition cannot be placed at all and is rejected when
it is created.

Addresses come from :class:`PartitionAllocator`, a first-fit allocator over the tiles Python
still references: only the cost model's optional address-reuse hazards depend on them.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import weakref
from dataclasses import dataclass

import numpy as np

from .errors import CapacityError, NKIValueError

_storage_ids = itertools.count(1)


class Storage:
    """One allocation: an on-chip tile (SBUF/PSUM) or an HBM tensor."""

    __slots__ = (
        "id",
        "memory",
        "kind",
        "name",
        "address",
        "bytes_per_partition",
        "written",
        "param_index",
        "mutable",
        "par_axis",
        "array",
        "out_of_scope",
        "__weakref__",
    )

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
    """First-fit allocator of byte ranges within every partition (all partitions alike),
    among the tiles Python still references and whose loop iteration is still running. It
    places tiles and records the high-water mark of what it holds in ``trace.<peak_attr>``;
    capacity is :func:`check_live_capacity`'s business."""

    def __init__(self, memory: str, granule: int, trace, peak_attr: str):
        self.memory = memory
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

    def allocate(self, storage: Storage, nbytes: int, scope=()) -> None:
        """Place a tile of ``nbytes`` per partition created in the loop iterations ``scope``."""
        size = max(self.granule, -(-nbytes // self.granule) * self.granule)
        live = self.live_bytes()
        # first fit among tiles in scope; out-of-scope tiles' bytes are free to reuse
        start = 0
        for block_start, block_size, block in self.blocks:
            if _stale(self.scopes[block]):
                continue
            if block_start - start >= size:
                break
            start = max(start, block_start + block_size)
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


@dataclass(frozen=True)
class TileRecord:
    """An on-chip tensor as the capacity check sees it: ``blocks`` (P, F) tiles of
    ``block_bytes`` bytes per partition each, from byte ``address`` of the partition on,
    each holding ``held_bytes`` (rounded up to the memory's allocation granule)."""

    memory: str  # "sbuf" or "psum"
    address: int
    block_bytes: int
    blocks: int
    held_bytes: int
    what: str


def blocks_touched(region, record: TileRecord) -> range:
    """The (P, F) blocks of ``record``'s tensor that ``region`` reaches into."""
    if region.stop <= region.start:  # an access masked off entirely
        return range(0)
    if record.blocks == 1:
        return range(1)
    first = (region.start - record.address) // record.block_bytes
    last = (region.stop - 1 - record.address) // record.block_bytes
    return range(max(first, 0), min(last, record.blocks - 1) + 1)


def _live_spans(instructions, tiles: dict[int, TileRecord]) -> dict[tuple[int, int], list[int]]:
    """(storage id, block) -> [first, last] position of the instructions touching it."""
    spans: dict[tuple[int, int], list[int]] = {}
    for position, inst in enumerate(instructions):
        for region in inst.reads + inst.writes:
            record = tiles.get(region.storage)
            if record is None:
                continue
            for block in blocks_touched(region, record):
                span = spans.setdefault((region.storage, block), [position, position])
                span[1] = position
    return spans


def check_modulo_lifetimes(instructions, tiles: dict[int, TileRecord], modulo_tiles) -> None:
    """Raise when two logical tiles of a modulo-allocated tensor share a physical tile and
    are live at once: "Another common lifetime conflict error is when the number of
    physical tiles is insufficient to hold all the logical tiles that need to be alive at
    the same time ... Only two tiles can be alive according to our allocation above ->
    ERROR" (aws-neuron-sdk@8a38e733 general/nki/nki_direct_allocation_guide.rst L397-L424).
    ``modulo_tiles`` maps a storage id to its block shape and, per block dimension, the
    (bank, partition, free) tile counts of ``mod_alloc``."""
    if not modulo_tiles:
        return
    spans = _live_spans(instructions, {sid: tiles[sid] for sid in modulo_tiles})
    physical: dict[tuple, list[tuple[int, int, tuple]]] = {}
    for (sid, block), (first, last) in spans.items():
        block_shape, moduli = modulo_tiles[sid]
        index = tuple(int(i) for i in np.unravel_index(block, block_shape)) if block_shape else ()
        key = tuple(
            tuple(i % (counts[d] if d < len(counts) else 1) for counts in moduli)
            for d, i in enumerate(index)
        )
        physical.setdefault((sid, key), []).append((first, last, index))
    for (sid, _), live in physical.items():
        live.sort()
        for (first, last, index), (next_first, _, next_index) in zip(live, live[1:]):
            if next_first <= last:
                raise NKIValueError(
                    f"lifetime conflict: logical tiles {list(index)} and {list(next_index)} "
                    f"of {tiles[sid].what} share one physical tile of its modulo allocation "
                    f"but are live together (instructions {instructions[first].index}-"
                    f"{instructions[last].index} and from {instructions[next_first].index}); "
                    "allocate more physical tiles or finish with one logical tile before the "
                    "next (general/nki/nki_direct_allocation_guide.rst L397-L424)",
                    "err_allocation_lifetime_conflict",
                )


def check_live_capacity(
    instructions, tiles: dict[int, TileRecord], capacity: dict[str, int], target: str
) -> dict[str, int]:
    """The peak bytes per partition of the (P, F) tiles live at once in ``instructions``
    (issue order) per memory; raise :class:`CapacityError` where it exceeds ``capacity``.
    A tile is live from the first instruction that touches it to the last."""
    spans = _live_spans(instructions, tiles)
    peaks = {}
    for memory, limit in capacity.items():
        # a tile takes its bytes at its first instruction and frees them after its last;
        # at one position frees (-1) sort before takes (+1)
        events = sorted(
            event
            for key, (first, last) in spans.items()
            if tiles[key[0]].memory == memory
            for event in ((first, 1, key), (last + 1, -1, key))
        )
        live, peak, at, held, worst = 0, 0, 0, set(), set()
        for position, step, key in events:
            live += step * tiles[key[0]].held_bytes
            (held.add if step > 0 else held.discard)(key)
            if live > peak:
                peak, at, worst = live, position, set(held)
        peaks[memory] = peak
        if peak > limit:
            per_tensor: dict[int, int] = collections.Counter()
            for sid, _ in worst:
                per_tensor[sid] += tiles[sid].held_bytes
            largest = sorted(per_tensor.items(), key=lambda item: -item[1])[:3]
            unit = "PSUM" if memory == "psum" else "SBUF"
            inst = instructions[at]
            raise CapacityError(
                f"{unit} over capacity on {target}: at instruction {inst.index} "
                f"({inst.opcode}) the tiles live from their first to their last use need "
                f"{peak} of the target's {limit} bytes per partition; largest: "
                + ", ".join(
                    f"{tiles[sid].what} ({held_bytes} B live)" for sid, held_bytes in largest
                )
                + (" (PSUM is allocated in 2 KiB banks)" if memory == "psum" else "")
                + "; use tiles for a shorter stretch of the kernel or tile the free dimension",
                f"err_{memory}_capacity_exceeded",
            )
    return peaks
