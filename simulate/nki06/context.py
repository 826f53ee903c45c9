"""The state of one ``nki`` 0.6 kernel launch and of each program (physical core) in it.

A launch (:class:`Launch`) owns the target, the trace and the ``shared_hbm`` tensors;
each program (:class:`Program`) owns its SBUF/PSUM allocators, its Scalar-engine reduce
registers and its program id. The running program is thread-local, so launches from
several threads are independent. Under LNC=2 the two programs run in two threads that take
turns deterministically (:class:`Turns`): program 0 runs until it blocks on a rendezvous
(``sendrecv``, ``core_barrier``) or ends, then program 1, and so on, which is a valid
schedule of the concurrent hardware for every kernel whose cores only meet at those points
(LNC: "both cores must follow the same control flow",
``nki/get-started/about/lnc.rst@81ce03ae``).
"""

from __future__ import annotations

import os
import threading

import numpy as np

from simulate.core.memory import (
    PartitionAllocator,
    TileRecord,
    check_live_capacity,
    check_placement_clashes,
    with_transfers,
)
from simulate.core.targets import DIALECT_DEFAULT_TARGET, PSUM_BANK_BYTES, TARGETS, Target
from simulate.core.trace import Trace

from .errors import NkiDeadlockError, NkiRuntimeError, NkiValueError

_local = threading.local()
_TARGET_ALIASES = {
    "trn1": "trn1",
    "inf2": "inf2",
    "gen2": "trn1",
    "trn2": "trn2",
    "gen3": "trn2",
    "trn3": "trn3",
    "gen4": "trn3",
}
# The official simulator's default when NEURON_PLATFORM_TARGET_OVERRIDE is unset (SIM; the
# core's per-dialect table says why the legacy front-end's differs)
DEFAULT_TARGET = DIALECT_DEFAULT_TARGET["nki06"]
#: A safety net only: a real deadlock (every waiting program waits for a peer that cannot
#: run) is detected when it happens, by :class:`Turns`. A waiting program otherwise waits as
#: long as its peer's turn takes, which on a loaded machine ran past the former 60 s for
#: large LNC=2 kernels and was reported as a deadlock. ``NKI_SIM_LNC_TIMEOUT_S`` overrides.
RENDEZVOUS_TIMEOUT_S = float(os.environ.get("NKI_SIM_LNC_TIMEOUT_S", "3600"))


#: The debugging switch of the language checks (:mod:`.language_check`, the value checks of
#: :mod:`.classes`, the enum operators of :mod:`.isa`): ``=0`` turns them off, never the
#: NKIObject class rule. Default on.
LANGUAGE_CHECK_SWITCH = "NKI_SIM_LANGUAGE_CHECK"


def language_check_enabled() -> bool:
    """The language checks are on unless ``NKI_SIM_LANGUAGE_CHECK=0`` (a debugging aid)."""
    value = os.environ.get(LANGUAGE_CHECK_SWITCH, "1").strip().lower()
    return value not in ("0", "false", "off", "no")


#: Whether a 0.6 launch on NeuronCore-v2 (trn1, inf2) is an error: "NKI supports Trainium2 and
#: Trainium3 chips" (aws-neuron-sdk@81ce03ae ``nki/nki_faq.rst`` L23-27); those chips run the
#: legacy ``neuronxcc.nki`` dialect (:mod:`simulate.legacy`). The one switch of the gate.
REJECT_NEURONCORE_V2 = True


def check_target_supported(target: Target) -> None:
    """Raise when the 0.6 front-end is asked to run on a chip NKI 0.6 does not support."""
    if REJECT_NEURONCORE_V2 and target.nc_version < 3:
        raise NkiValueError(
            f'NKI 0.6 does not run on {target.name} (NeuronCore-v2): "NKI supports Trainium2 '
            'and Trainium3 chips" (aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27). Trn1/Inf2 '
            "kernels are written in the legacy neuronxcc.nki dialect (simulate.legacy; "
            "Neuron SDK <= 2.29)"
        )


def target_from_env(name=None) -> Target:
    """The target ``name`` (a target name or :class:`Target`), else the one
    ``NEURON_PLATFORM_TARGET_OVERRIDE`` names (STUB-NKI ``jit``), else trn3."""
    if isinstance(name, Target):
        return name
    name = (name or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE", "")).strip().lower()
    if not name:
        return TARGETS[DEFAULT_TARGET]
    if name not in _TARGET_ALIASES:
        raise NkiValueError(
            f"NEURON_PLATFORM_TARGET_OVERRIDE={name!r} is not a target; expected "
            "one of " + ", ".join(_TARGET_ALIASES)
        )
    return TARGETS[_TARGET_ALIASES[name]]


class Turns:
    """Deterministic turn-taking of the programs of one launch (one runs at a time)."""

    def __init__(self, count: int):
        self.cond = threading.Condition()
        self.active = 0
        self.finished: set[int] = set()
        self.waiting: dict[int, object] = {}  # program -> predicate it waits for
        self.count = count
        self.failed = False

    def _next(self, me: int) -> int | None:
        for step in range(1, self.count + 1):
            other = (me + step) % self.count
            if other in self.finished or other == me:
                continue
            wait = self.waiting.get(other)
            if wait is None or wait():
                return other
        return None

    def start(self, me: int) -> None:
        with self.cond:
            if not self.cond.wait_for(
                lambda: self.active == me or self.failed, RENDEZVOUS_TIMEOUT_S
            ):
                raise NkiDeadlockError(f"program {me} never got its turn")

    def block_until(self, me: int, ready, what: str) -> None:
        """Give the turn away until ``ready()`` holds (called by the running program)."""
        with self.cond:
            if ready():
                return
            self.waiting[me] = ready
            other = self._next(me)
            if other is None:
                raise NkiDeadlockError(
                    f"{what}: program {me} waits for a peer that has finished or waits too "
                    "(the programs of an LNC launch must follow the same control flow)"
                )
            self.active = other
            self.cond.notify_all()
            ok = self.cond.wait_for(
                lambda: (self.active == me and ready()) or self.failed, RENDEZVOUS_TIMEOUT_S
            )
            del self.waiting[me]
            if self.failed or not ok:
                raise NkiDeadlockError(f"{what}: program {me} waited for its peer in vain")

    def finish(self, me: int, failed: bool) -> None:
        with self.cond:
            self.finished.add(me)
            self.failed = self.failed or failed
            other = self._next(me)
            if other is None and len(self.finished) < self.count:
                self.failed = True  # the rest wait for something that will never come
            elif other is not None:
                self.active = other
            self.cond.notify_all()


class Launch:
    """One kernel launch: target, trace, shared HBM and the rendezvous mailboxes."""

    def __init__(self, target: Target, lnc: int, grid_ndim: int):
        self.target = target
        self.lnc = lnc
        self.grid_ndim = grid_ndim
        self.trace = Trace(target.name)
        self.trace.lnc = lnc
        self.shared_hbm: list = []  # k-th shared_hbm allocation, common to all programs
        self.turns = Turns(lnc)
        self.mailbox: dict = {}  # (pipe_id, sender) -> list of pending sends
        self.barrier_counts: dict[int, int] = {}
        self.peaks: dict[int, dict[str, int]] = {}  # program -> live-range peak per memory
        self.lock = threading.Lock()


class Program:
    """One physical core's view of a launch.

    SBUF/PSUM capacity is checked when the program ends (over capacity, the compiler's spills
    are inserted into the trace: simulate.core.memory), on the live ranges of its tiles
    (from the first to the last instruction that touches each), as the compiler's allocator
    sees them after unrolling: a tile still referenced by a Python variable but no longer
    used does not count, a tile kept in a list for later use does. Addresses come from the
    core's first-fit allocator, which places tiles among those still referenced (only the
    cost model's reuse hazards depend on them).
    """

    def __init__(self, launch: Launch, program_id: int):
        self.launch = launch
        self.program_id = program_id
        self.target = launch.target
        trace = launch.trace
        # placement only: capacity is checked on live ranges by check_capacity()
        self.sbuf = PartitionAllocator("sbuf", 4, trace, "sbuf_peak_bytes_per_partition")
        self.psum = PartitionAllocator(
            "psum", PSUM_BANK_BYTES, trace, "psum_peak_bytes_per_partition"
        )
        self.tiles: dict[int, tuple[str, int, str]] = {}  # storage id -> (memory, bytes, what)
        # storage id -> [where ``nl.ndarray(address=...)`` placed it]
        self.placements: dict[int, list] = {}
        self.instructions: list = []  # this program's trace records, in program order
        self.shared_cursor = 0
        self.barrier_cursor = 0
        self.no_reorder_depth = 0  # open nl.no_reorder() blocks
        # the storages allocated by each open nl.fori_loop / nl.while_loop body (innermost last)
        self.loop_body_storages: list[list] = []
        self.loop_scopes: list[int] = []  # serial numbers of the open runtime-loop bodies
        self.loop_serial = 0
        # the Scalar engine's 128 fp32 reduce registers: undefined (NaN) until reset
        self.act_regs = np.full((launch.target.partitions, 1), np.nan, np.float32)
        self.vector_regs = np.full((launch.target.partitions, 1), np.nan, np.float32)

    def check_capacity(self) -> None:
        """Insert the compiler's spills into the launch's trace where the tiles live at some
        instruction need more SBUF or PSUM per partition than the target has
        (simulate.core.memory.check_live_capacity: the same model as the legacy front-end,
        each tile one block); record this program's peaks in ``launch.peaks`` and add its
        spill traffic to the trace's ``spill_save_bytes`` / ``spill_reload_bytes``."""
        tiles = {
            sid: TileRecord(memory, 0, nbytes, 1, nbytes, what)
            for sid, (memory, nbytes, what) in self.tiles.items()
        }
        check_placement_clashes(self.instructions, tiles, self.placements)
        limits = {
            "sbuf": self.target.sbuf_bytes_per_partition,
            "psum": self.target.psum_bytes_per_partition,
        }
        peaks, plans, transfers = check_live_capacity(
            self.instructions, tiles, limits, self.target.name
        )
        trace = self.launch.trace
        trace.instructions = with_transfers(trace.instructions, transfers)
        trace.spill_save_bytes += sum(plan.save_bytes for plan in plans)
        trace.spill_reload_bytes += sum(plan.reload_bytes for plan in plans)
        self.launch.peaks[self.program_id] = peaks


def current(api: str = "this API") -> Program:
    """The running program; NKI calls outside a kernel are errors."""
    program = getattr(_local, "program", None)
    if program is None:
        raise NkiRuntimeError(
            f"{api} can only be called inside an NKI kernel "
            "(run it with nki.simulate(kernel)(...) or call the @nki.jit kernel)"
        )
    return program


def active() -> Program | None:
    return getattr(_local, "program", None)


def enter(program: Program | None) -> Program | None:
    previous = getattr(_local, "program", None)
    _local.program = program
    return previous
