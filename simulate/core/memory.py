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
what the compiler's allocator has to fit. Where it does not, the compiler does not reject
the kernel: "the Neuron compiler will insert the necessary spills or refills"
(general/nki/programming_model.rst L172-L175; aws-neuron-sdk@81ce03ae
nki/get-started/about/memory-hierarchy-overview.rst L86; nki_perf_guide.rst L70-L143 "data
spillage", measured by neuron-profile's ``spill_save_bytes`` / ``spill_reload_bytes``, and
issued as DMAs on spill/reload queues: nki/guides/tutorials/fused_mamba.rst L754-L766), and
the errors manual has no over-capacity code for it (general/nki/api/nki.errors.rst).
:func:`check_live_capacity` plans those spills (which tiles and when is inferred: the docs
give no algorithm) and inserts them into the trace as DMA transfers. One tile (block) larger
than a partition cannot be placed at all and is rejected when it is created, and the tiles
of one instruction that alone exceed the memory cannot be spilled. Tiles the kernel places
itself (direct allocation) keep the allocation guide's placement errors.

Addresses come from :class:`PartitionAllocator`, a first-fit allocator over the tiles Python
still references: only the cost model's optional address-reuse hazards depend on them.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np

from .errors import CapacityError, NKIValueError, SpillWarning
from .trace import Instruction, Region

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


_ALLOCATION_GUIDE = "general/nki/nki_direct_allocation_guide.rst@8a38e733"


@dataclass(frozen=True)
class Placement:
    """Where the kernel put one logical (P, F) block of a directly allocated tensor:
    partitions ``[partition, partition_end)``, bytes ``[byte, byte_end)`` of each partition
    (of PSUM bank ``bank``; ``bank`` is 0 in SBUF)."""

    bank: int
    partition: int
    partition_end: int
    byte: int
    byte_end: int

    def overlaps(self, other: Placement) -> bool:
        return (
            self.bank == other.bank
            and self.partition < other.partition_end
            and other.partition < self.partition_end
            and self.byte < other.byte_end
            and other.byte < self.byte_end
        )


def _start_partitions(pdim_size: int) -> tuple[int, ...]:
    """The start partitions the ISA allows a tile of ``pdim_size`` partitions (guide
    L148-L150)."""
    if pdim_size > 64:
        return (0,)
    if pdim_size > 32:
        return (0, 64)
    return (0, 32, 64, 96)


def check_direct_placement(
    memory: str,
    idx: tuple,
    location,
    pdim_size: int,
    fdim_size: int,
    capacity: int,
    min_align: int,
    what: str,
) -> Placement:
    """Check the location ``ncc.sbuf/psum.alloc``'s ``func`` (or ``mod_alloc``) returned for
    logical block ``idx`` against the allocation guide's rules, and return it.

    SBUF ``(start_partition, byte_addr)``: the start partition follows the ISA rules for the
    tile's partition count (guide L146-L150); ``byte_addr`` lies in ``[0, capacity)`` with
    "192KiB-16KiB" usable on NeuronCore-v2 (L151-L157; ``capacity`` is the target's usable
    SBUF per partition, so the tile must end within it too) and "must be aligned to
    ``nki.language.constants.sbuf_min_align``" (L158). PSUM ``(bank_id, start_partition,
    byte_addr)``: "``start_partition`` and ``byte_addr`` must both be 0" and ``fdim_size``
    "cannot exceed 2KiB, which is the size of a single PSUM bank per partition"
    (general/nki/api/nki/compiler/psum.py@8a38e733 L43-L56; guide L449-L454), in one of the
    PSUM's banks."""
    from .targets import PSUM_BANK_BYTES, PSUM_BANKS

    where = f"{what}, logical block {list(idx)} placed at {location!r}"
    width = 3 if memory == "psum" else 2
    if (
        not isinstance(location, tuple)
        or len(location) != width
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in location)
    ):
        form = (
            "(bank_id, start_partition, byte_addr)"
            if memory == "psum"
            else ("(start_partition, byte_addr)")
        )
        raise NKIValueError(
            f"{where}: the allocation function must return a tuple of {width} integers {form} "
            f"({_ALLOCATION_GUIDE} L145; general/nki/api/nki/compiler/psum.py L47)",
            "err_unsupported_buffer",
        )
    bank, partition, byte = (
        (int(v) for v in location)
        if memory == "psum"
        else (
            0,
            *(int(v) for v in location),
        )
    )
    allowed = _start_partitions(pdim_size)
    if partition not in allowed:
        raise NKIValueError(
            f"{where}: a tile of {pdim_size} partitions must start at partition "
            f"{' / '.join(map(str, allowed))}, got {partition} ({_ALLOCATION_GUIDE} L146-L150)",
            "err_unsupported_buffer",
        )
    if memory == "psum":
        if partition != 0 or byte != 0:
            raise NKIValueError(
                f"{where}: a PSUM tile's start_partition and byte_addr must both be 0 in the "
                "current release: one physical tile per bank "
                "(general/nki/api/nki/compiler/psum.py@8a38e733 L56; "
                f"{_ALLOCATION_GUIDE} L449-L451)",
                "err_unsupported_buffer",
            )
        if not 0 <= bank < PSUM_BANKS:
            raise NKIValueError(
                f"{where}: bank_id must be one of the {PSUM_BANKS} PSUM banks 0..{PSUM_BANKS - 1}"
                f" (general/nki/api/nki/compiler/psum.py@8a38e733 L50)",
                "err_unsupported_buffer",
            )
        if fdim_size > PSUM_BANK_BYTES:
            raise NKIValueError(
                f"{where}: a PSUM tile cannot cross bank boundaries, its {fdim_size} bytes per "
                f"partition exceed one {PSUM_BANK_BYTES}-byte bank ({_ALLOCATION_GUIDE} "
                "L453-L454; general/nki/api/nki/compiler/psum.py L43-L44)",
                "err_unsupported_buffer",
            )
        return Placement(bank, 0, pdim_size, 0, fdim_size)
    if not 0 <= byte or byte + fdim_size > capacity:
        raise NKIValueError(
            f"{where}: the tile's {fdim_size} bytes from byte_addr {byte} must lie within the "
            f"{capacity} bytes per partition the kernel may allocate (byte_addr in [0, "
            f"{capacity}); {_ALLOCATION_GUIDE} L151-L157)",
            "err_unsupported_buffer",
        )
    if byte % min_align:
        raise NKIValueError(
            f"{where}: byte_addr must be aligned to nki.language.constants.sbuf_min_align == "
            f"{min_align} ({_ALLOCATION_GUIDE} L158)",
            "err_unsupported_buffer",
        )
    return Placement(0, partition, partition + pdim_size, byte, byte + fdim_size)


def check_placement_clashes(
    instructions, tiles: dict[int, TileRecord], placements: dict[int, list[Placement]]
) -> None:
    """Raise when two logical tiles the kernel placed itself share memory while both are
    live (from the first to the last instruction touching each): the compiler takes the
    kernel's addresses as given ("the exact mapping between logical tile and physical tile in
    SBUF", guide L132-L135), so overlapping tiles are a lifetime conflict (L397-L424). A tile
    whose last use is the instruction that first writes the other (an in-place update) does
    not clash: the instruction reads its operands before it writes."""
    if not placements:
        return
    spans = _live_spans(instructions, {sid: tiles[sid] for sid in placements})
    live = sorted(
        (first, last, sid, block, placements[sid][block])
        for (sid, block), (first, last) in spans.items()
        if block < len(placements[sid])
    )
    active: list[tuple] = []
    for first, last, sid, block, place in live:
        active = [entry for entry in active if entry[1] > first]
        for other_first, other_last, other_sid, other_block, other_place in active:
            if place.overlaps(other_place) and tiles[sid].memory == tiles[other_sid].memory:
                raise NKIValueError(
                    f"lifetime conflict: logical block {other_block} of {tiles[other_sid].what}"
                    f" and block {block} of {tiles[sid].what} are placed on overlapping memory "
                    f"({other_place} and {place}) and are live together (instructions "
                    f"{instructions[other_first].index}-{instructions[other_last].index} and "
                    f"{instructions[first].index}-{instructions[last].index}); place them apart "
                    f"or end one's use before the other's first ({_ALLOCATION_GUIDE} L132-L135, "
                    "L397-L424)",
                    "err_allocation_lifetime_conflict",
                )
        active.append((first, last, sid, block, place))


def _uses(instructions, tiles: dict[int, TileRecord]) -> dict[tuple[int, int], list]:
    """(storage id, block) -> [[(position, writes it), ...] in issue order, first byte,
    end byte, first partition, end partition] of what the instructions touch of it."""
    uses: dict[tuple[int, int], list] = {}
    for position, inst in enumerate(instructions):
        for region, writes in [(r, False) for r in inst.reads] + [(r, True) for r in inst.writes]:
            record = tiles.get(region.storage)
            if record is None:
                continue
            for block in blocks_touched(region, record):
                start, stop = region.start, region.stop
                if record.blocks > 1:  # the block's bytes of the region
                    first = record.address + block * record.block_bytes
                    start, stop = max(start, first), min(stop, first + record.block_bytes)
                entry = uses.setdefault(
                    (region.storage, block), [[], start, stop, *region.partitions]
                )
                steps = entry[0]
                if steps and steps[-1][0] == position:
                    steps[-1] = (position, steps[-1][1] or writes)
                else:
                    steps.append((position, writes))
                entry[1], entry[2] = min(entry[1], start), max(entry[2], stop)
                entry[3] = min(entry[3], region.partitions[0])
                entry[4] = max(entry[4], region.partitions[1])
    return uses


@dataclass
class SpillPlan:
    """What the compiler would spill to fit the live tiles of one memory in its capacity:
    ``transfers`` [(position of the instruction it goes before, "save" or "reload",
    (storage id, block))], and the bytes over all partitions of each direction."""

    memory: str
    peak: int  # bytes per partition the tiles live at once (first to last use) need
    transfers: list = field(default_factory=list)
    save_bytes: int = 0
    reload_bytes: int = 0
    spilled: collections.Counter = field(default_factory=collections.Counter)  # sid -> bytes


def _plan_spills(memory, uses, tiles, limit, instructions, target) -> SpillPlan:
    """Belady's choice (inferred: the docs give no spill algorithm): walk the instructions
    in issue order; where the tiles resident at one need more than ``limit`` bytes per
    partition, save the resident tile (block) whose next use is farthest away to HBM (only
    when written since it was last saved) and reload it before that use. Raise
    :class:`CapacityError` when the tiles of one instruction alone do not fit."""
    keys = [key for key in uses if tiles[key[0]].memory == memory]
    at: dict[int, list] = collections.defaultdict(list)
    for key in keys:
        for step, (position, _) in enumerate(uses[key][0]):
            at[position].append((key, step))
    # the demand: every tile live from its first to its last use
    # (position, bytes): a tile takes its bytes at its first use and frees them after its
    # last; at one position the frees (negative) sort first
    events = sorted(
        event
        for key in keys
        for event in (
            (uses[key][0][0][0], tiles[key[0]].held_bytes),
            (uses[key][0][-1][0] + 1, -tiles[key[0]].held_bytes),
        )
    )
    plan = SpillPlan(memory, max(itertools.accumulate(e[1] for e in events), default=0))
    if plan.peak <= limit:
        return plan
    resident: set = set()
    spilled: set = set()
    dirty: set = set()
    upcoming: list = []  # heap of (-next use position, key) of resident tiles (lazily pruned)
    next_use: dict = {}
    live = 0
    for position in sorted(at):
        needed = set()
        for key, step in at[position]:
            needed.add(key)
            held = tiles[key[0]].held_bytes
            if key in spilled:
                spilled.discard(key)
                plan.transfers.append((position, "reload", key))
                plan.reload_bytes += held * (uses[key][4] - uses[key][3])
            if key not in resident:
                resident.add(key)
                live += held
            if uses[key][0][step][1]:
                dirty.add(key)
            steps = uses[key][0]
            next_use[key] = steps[step + 1][0] if step + 1 < len(steps) else None
        while live > limit:
            victim = None
            while upcoming:
                negative, key = heapq.heappop(upcoming)
                if key in resident and key not in needed and next_use[key] == -negative:
                    victim = key
                    break
            if victim is None:
                inst = instructions[position]
                unit = "PSUM" if memory == "psum" else "SBUF"
                raise CapacityError(
                    f"{unit} over capacity on {target}: the tiles instruction {inst.index} "
                    f"({inst.opcode}) reads and writes need {live} of the target's {limit} "
                    "bytes per partition at once, which no spilling can fit; tile the free "
                    "dimension",
                    f"err_{memory}_capacity_exceeded",
                )
            held = tiles[victim[0]].held_bytes
            resident.discard(victim)
            spilled.add(victim)
            live -= held
            if victim in dirty:
                dirty.discard(victim)
                plan.transfers.append((position, "save", victim))
                nbytes = held * (uses[victim][4] - uses[victim][3])
                plan.save_bytes += nbytes
                plan.spilled[victim[0]] += nbytes
        for key in needed:
            if next_use[key] is None:
                resident.discard(key)
                dirty.discard(key)
                live -= tiles[key[0]].held_bytes
            else:
                heapq.heappush(upcoming, (-next_use[key], key))
    plan.transfers.sort(key=lambda transfer: (transfer[0], transfer[1] != "save"))
    return plan


def spill_transfers(instructions, plans, uses, tiles) -> dict[int, list[Instruction]]:
    """id() of an instruction of ``instructions`` -> the synthetic ``dma_copy`` transfers
    between a tile and an HBM scratch buffer that the spills of ``plans`` issue before it
    (the saves first): the cost model charges them as any SBUF<->HBM DMA. Where and when
    the compiler issues them is inferred (the docs give no spill algorithm)."""
    before: dict[int, list[Instruction]] = collections.defaultdict(list)
    scratch: dict = {}
    for plan in plans:
        for position, kind, key in plan.transfers:
            inst = instructions[position]
            _, start, stop, p0, p1 = uses[key]
            held = tiles[key[0]].held_bytes
            scratch.setdefault(key, next(_storage_ids))
            tile = Region(plan.memory, key[0], start, stop, (p0, p1))
            hbm = Region("hbm", scratch[key], 0, held * (p1 - p0))
            save = kind == "save"
            # the space changes hands: a save finishes before the instruction it makes room
            # for writes its tile there; a reload starts after the instruction before its
            # use (by then the tiles it replaces are dead)
            if save:
                reads, writes = (tile,), (hbm, *(r for r in inst.writes if r.memory == plan.memory))
            else:
                reads, writes = (hbm, *instructions[position - 1].writes), (tile,)
            before[id(inst)].append(
                Instruction(
                    index=0,
                    engine="dma",
                    opcode="dma_copy",
                    partitions=p1 - p0,
                    free_size=held,
                    in_dtypes=("uint8",),
                    out_dtype="uint8",
                    reads=reads,
                    writes=writes,
                    loops=inst.loops,
                    program=inst.program,
                    core=inst.core,
                    dma_bytes=held * (p1 - p0),
                    dma_direction=f"{plan.memory}->hbm" if save else f"hbm->{plan.memory}",
                    dma_row_bytes=held,
                    details={"spill": kind},
                )
            )
    return before


def with_transfers(instructions, before: dict[int, list[Instruction]]) -> list[Instruction]:
    """``instructions`` with the transfers of ``before`` inserted, all renumbered."""
    if not before:
        return instructions
    result = []
    for inst in instructions:
        result.extend(before.get(id(inst), ()))
        result.append(inst)
    for index, inst in enumerate(result):
        inst.index = index
    return result


def check_live_capacity(
    instructions,
    tiles: dict[int, TileRecord],
    capacity: dict[str, int],
    target: str,
    placed_by_kernel: bool = False,
) -> tuple[dict[str, int], list[SpillPlan], dict[int, list[Instruction]]]:
    """The peak bytes per partition of the (P, F) tiles live at once in ``instructions``
    (issue order) per memory (a tile is live from the first instruction that touches it to
    the last), the compiler's spills where that exceeds ``capacity`` (:func:`_plan_spills`)
    and their DMA transfers (:func:`spill_transfers`, to insert with
    :func:`with_transfers`), with one
    :class:`SpillWarning` naming the bytes and the largest spilled tiles. The spill traffic
    is counted in ``spill_save_bytes`` / ``spill_reload_bytes`` of the returned plans, the
    names of neuron-profile's metrics (aws-neuron-sdk@8a38e733
    general/nki/nki_perf_guide.rst L70-L143). A kernel that places its tiles itself
    (``placed_by_kernel``: direct allocation) is not the compiler's to spill: going over
    capacity is a :class:`CapacityError` there."""
    uses = _uses(instructions, tiles)
    plans = [
        _plan_spills(memory, uses, tiles, limit, instructions, target)
        for memory, limit in capacity.items()
    ]
    peaks = {plan.memory: plan.peak for plan in plans}
    spilling = [plan for plan in plans if plan.transfers]
    for plan in spilling if placed_by_kernel else ():
        unit = "PSUM" if plan.memory == "psum" else "SBUF"
        raise CapacityError(
            f"{unit} over capacity on {target}: the tiles the kernel allocated itself need "
            f"{plan.peak} of the target's {capacity[plan.memory]} bytes per partition at "
            "once; the compiler spills only the tiles it allocates "
            "(general/nki/nki_direct_allocation_guide.rst L97)",
            f"err_{plan.memory}_capacity_exceeded",
        )
    for plan in spilling:
        unit = "PSUM" if plan.memory == "psum" else "SBUF"
        largest = sorted(plan.spilled.items(), key=lambda item: -item[1])[:3]
        warnings.warn(
            f"{unit} over-subscribed on {target}: the tiles live from their first to their "
            f"last use need {plan.peak} of the target's {capacity[plan.memory]} bytes per "
            f"partition; the compiler would spill {plan.save_bytes} bytes to HBM and reload "
            f"{plan.reload_bytes} (general/nki/programming_model.rst L172-L175); largest "
            "spilled: " + ", ".join(f"{tiles[sid].what} ({nbytes} B)" for sid, nbytes in largest),
            SpillWarning,
            stacklevel=2,
        )
    return peaks, plans, spill_transfers(instructions, spilling, uses, tiles)
