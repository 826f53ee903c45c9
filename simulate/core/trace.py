"""The instruction trace: one record per instruction a kernel would issue on the hardware.

The cost model (:mod:`simulate.cost`) turns it into time. Each record says which engine
runs it, how many elements per partition it streams (the quantity every documented cost
rule is written in), the dtypes and memories it touches, and which storage it reads and
writes, so that dependencies between engines can be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ENGINES = ("pe", "act", "dve", "pool", "dma")


@dataclass(frozen=True)
class Region:
    """A byte range of one storage buffer touched by an instruction.

    ``memory`` is "sbuf", "psum" or "hbm"; for SBUF/PSUM ``start``/``stop`` are byte
    offsets within each partition and ``partitions`` the partition range; for HBM they are
    byte offsets in the tensor's linear memory.
    """

    memory: str
    storage: int  # id of the allocation
    start: int
    stop: int
    partitions: tuple[int, int] = (0, 1)


@dataclass
class Instruction:
    """One hardware instruction (or DMA transfer) of the trace."""

    index: int
    engine: str  # one of ENGINES
    opcode: str  # e.g. "activation", "tensor_scalar", "dma_copy", "nc_matmul"
    partitions: int
    free_size: int  # elements per partition streamed by the engine
    in_dtypes: tuple[str, ...]
    out_dtype: str
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    loops: tuple[tuple[int, str, int], ...]  # (loop id, kind, iteration) outermost first
    program: tuple[int, ...] = ()  # SPMD program id of the instance that issued it
    core: int = 0  # physical core of that instance when the trace's lnc is 2
    dma_bytes: int = 0
    dma_direction: str = ""  # "hbm->sbuf", "sbuf->hbm", "sbuf->sbuf", "hbm->hbm"
    dma_row_bytes: int = 0  # contiguous bytes per descriptor row
    details: dict = field(default_factory=dict)  # op names, strides, accumulate flags ...

    def memories(self) -> set[str]:
        return {r.memory for r in self.reads + self.writes}


class Trace:
    """The list of instructions of one kernel run, plus memory high-water marks."""

    def __init__(self, target: str):
        self.target = target
        # physical cores running the programs concurrently: 2 for an ``nki`` 0.6 kernel[2]
        # launch or a legacy grid with an nl.nc(2) dimension on trn2/trn3 (LNC=2); 1
        # otherwise, where SPMD instances run one after another
        self.lnc = 1
        self.instructions: list[Instruction] = []
        self.sbuf_peak_bytes_per_partition = 0
        self.psum_peak_bytes_per_partition = 0
        # bytes (all partitions) the compiler's spills save to / reload from HBM where the
        # live tiles exceed SBUF/PSUM (neuron-profile's metric names; simulate.core.memory)
        self.spill_save_bytes = 0
        self.spill_reload_bytes = 0

    def __len__(self) -> int:
        return len(self.instructions)

    def __iter__(self):
        return iter(self.instructions)

    def add(self, **fields) -> Instruction:
        inst = Instruction(index=len(self.instructions), **fields)
        self.instructions.append(inst)
        return inst

    def select(self, engine: str | None = None, opcode: str | None = None) -> list[Instruction]:
        """The instructions on ``engine`` and/or with ``opcode``, in issue order."""
        return [
            i
            for i in self.instructions
            if (engine is None or i.engine == engine) and (opcode is None or i.opcode == opcode)
        ]

    def count(self) -> dict[str, int]:
        """Instructions per engine."""
        counts = dict.fromkeys(ENGINES, 0)
        for inst in self.instructions:
            counts[inst.engine] += 1
        return counts

    def hbm_bytes(self) -> tuple[int, int]:
        """(bytes read from HBM, bytes written to HBM) by DMA."""
        read = sum(i.dma_bytes for i in self.instructions if i.dma_direction.startswith("hbm"))
        written = sum(i.dma_bytes for i in self.instructions if i.dma_direction.endswith("hbm"))
        return read, written

    def summary(self) -> str:
        counts = self.count()
        read, written = self.hbm_bytes()
        lines = [f"trace on {self.target}: {len(self)} instructions"]
        lines += [f"  {engine:5s} {counts[engine]:8d}" for engine in ENGINES]
        lines.append(f"  HBM read {read} B, written {written} B")
        lines.append(
            f"  SBUF peak {self.sbuf_peak_bytes_per_partition} B/partition, "
            f"PSUM peak {self.psum_peak_bytes_per_partition} B/partition"
        )
        return "\n".join(lines)
