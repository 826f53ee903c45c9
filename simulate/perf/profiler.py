"""``simulate.profile`` and the modeled ``nki.benchmark`` result.

``profile(kernel, *args, target="trn1", **kwargs)`` runs a kernel once in the simulator and
returns its outputs with a :class:`Profile`: the latency the cost model (:mod:`simulate.cost`)
predicts on the target, how busy each engine and DMA queue is, where engines waited for
inputs, HBM traffic, and on-chip memory high-water marks. Every number is a model estimate,
not a device measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.trace import Trace
from .cost import COMPUTE_ENGINES, DMA_QUEUES, CostTable, Schedule, schedule

PROFILE_ENGINES = COMPUTE_ENGINES + ("dma",)
PERCENTILES = (0, 1, 10, 25, 50, 90, 99, 100)


@dataclass
class Profile:
    """Modeled performance of one kernel run on one NeuronCore.

    Times are microseconds. ``engine_busy_us["dma"]`` is the time at least one DMA transfer
    is in flight; ``dma_queue_busy_us`` splits it by queue (loads, stores, other copies).
    ``engine_utilization`` is busy time over latency. ``dependency_stalls`` counts the
    instructions that found their engine (or DMA queue) idle, waiting for an input or a
    barrier, and ``stall_us`` sums that idle time. ``mbu`` is HBM bytes moved per second over
    the core's HBM share (the memory-bandwidth utilisation of ``nki_perf_guide``).
    ``unmodeled`` lists opcodes no documented cost rule covers (costed as ``max(MIN_II, N)``).
    ``instructions`` counts by the engine the model runs them on (a partition broadcast, which
    the trace records on the Vector engine, counts as "pe" when its result fits one PSUM
    bank). ``launch_us`` is the fixed cost of launching a kernel on a device, which
    ``nki.benchmark`` on hardware includes; it is not part of ``latency_us``. ``schedule``
    holds the modeled start and end of every instruction.

    ``lnc`` is the number of physical cores the kernel ran on concurrently (2 for an ``nki``
    0.6 ``kernel[2]`` launch on trn2/trn3). ``core_busy_us`` has one entry per physical core:
    the busy time of each of its engines and of its DMA ("dma": a transfer in flight). Under
    LNC=2 ``engine_busy_us`` and ``engine_utilization`` are those of the busier core, and
    ``mbu`` is measured against the logical core's HBM (the two cores' shared bank).
    """

    target: str
    latency_us: float
    engine_busy_us: dict[str, float]
    instructions: dict[str, int]
    hbm_read_bytes: int
    hbm_write_bytes: int
    sbuf_peak_bytes_per_partition: int
    psum_peak_bytes_per_partition: int
    engine_utilization: dict[str, float]
    busiest_engine: str
    dma_queue_busy_us: dict[str, float]
    dma_transfers: int
    dma_bytes: int
    dma_small_transfers: int  # transfers of < 2 KiB per partition (S5: overhead-bound)
    dependency_stalls: dict[str, int]
    stall_us: dict[str, float]
    hbm_bandwidth_gbps: float
    mbu: float
    unmodeled: dict[str, int]
    launch_us: float
    schedule: Schedule = field(repr=False)
    lnc: int = 1
    core_busy_us: list[dict[str, float]] = field(default_factory=list)
    # bytes (all partitions) the compiler's spills save to and reload from HBM where the live
    # tiles exceed SBUF/PSUM: neuron-profile's metrics (general/nki/nki_perf_guide.rst
    # L70-L143); the transfers are DMAs of the trace, in the figures above
    spill_save_bytes: int = 0
    spill_reload_bytes: int = 0

    @classmethod
    def from_trace(cls, trace: Trace, target=None, overrides=None) -> Profile:
        """Model ``trace`` (on ``target``, default the trace's own) and summarise it.
        ``overrides`` replaces constants of :data:`simulate.cost.CONSTANTS` by name."""
        table = CostTable(target or trace.target, overrides)
        sched = schedule(trace, table.target, overrides)
        latency = sched.latency_us
        busy = {e: sched.busy_us[e] for e in COMPUTE_ENGINES}
        busy["dma"] = (
            max(cb["dma"] for cb in sched.core_busy_us) if sched.lnc > 1 else sched.busy_us["dma"]
        )
        counts = dict.fromkeys(PROFILE_ENGINES, 0)
        for name in sched.resource:
            counts["dma" if name in DMA_QUEUES else name] += 1
        read, written = trace.hbm_bytes()
        dmas = [i for i in trace.instructions if i.engine == "dma"]
        small = sum(1 for i in dmas if i.dma_bytes < 2048 * max(1, i.partitions))
        utilization = {e: (busy[e] / latency if latency else 0.0) for e in PROFILE_ENGINES}
        bandwidth = (read + written) / latency / 1000.0 if latency else 0.0  # GB/s
        return cls(
            target=table.target,
            latency_us=latency,
            engine_busy_us=busy,
            instructions=counts,
            hbm_read_bytes=read,
            hbm_write_bytes=written,
            sbuf_peak_bytes_per_partition=trace.sbuf_peak_bytes_per_partition,
            psum_peak_bytes_per_partition=trace.psum_peak_bytes_per_partition,
            engine_utilization=utilization,
            busiest_engine=max(PROFILE_ENGINES, key=lambda e: busy[e]),
            dma_queue_busy_us={q: sched.busy_us[q] for q in DMA_QUEUES},
            dma_transfers=len(dmas),
            dma_bytes=sum(i.dma_bytes for i in dmas),
            dma_small_transfers=small,
            dependency_stalls={e: sched.stalls[e] for e in COMPUTE_ENGINES + DMA_QUEUES},
            stall_us={e: sched.stall_us[e] for e in COMPUTE_ENGINES + DMA_QUEUES},
            hbm_bandwidth_gbps=bandwidth,
            mbu=bandwidth
            / (table.hbm_share_gbps * (table.hbm_cores_per_pool if sched.lnc > 1 else 1)),
            unmodeled=dict(sched.unmodeled),
            launch_us=table.kernel_launch_us,
            schedule=sched,
            lnc=sched.lnc,
            core_busy_us=[dict(cb) for cb in sched.core_busy_us],
            spill_save_bytes=trace.spill_save_bytes,
            spill_reload_bytes=trace.spill_reload_bytes,
        )

    def summary(self) -> str:
        """A readable table of the profile."""
        lines = [
            f"modeled on {self.target}"
            + (f" (LNC={self.lnc}, two physical cores)" if self.lnc > 1 else "")
            + f": latency {self.latency_us:,.2f} us (busiest engine: {self.busiest_engine})",
            f"  {'engine':<7}{'instr':>9}{'busy us':>13}{'util':>8}{'stalls':>9}{'stall us':>12}",
        ]
        for e in PROFILE_ENGINES:
            stalls = (
                sum(self.dependency_stalls[q] for q in DMA_QUEUES)
                if e == "dma"
                else self.dependency_stalls[e]
            )
            stall_us = sum(self.stall_us[q] for q in DMA_QUEUES) if e == "dma" else self.stall_us[e]
            lines.append(
                f"  {e:<7}{self.instructions[e]:>9,}{self.engine_busy_us[e]:>13,.2f}"
                f"{self.engine_utilization[e]:>8.1%}{stalls:>9,}{stall_us:>12,.2f}"
            )
        queues = ", ".join(f"{q[4:]} {self.dma_queue_busy_us[q]:,.2f} us" for q in DMA_QUEUES)
        lines += [
            f"  DMA queues busy: {queues}; {self.dma_transfers:,} transfers, "
            f"{self.dma_small_transfers:,} under 2 KiB/partition",
            f"  HBM read {self.hbm_read_bytes:,} B, written {self.hbm_write_bytes:,} B: "
            f"{self.hbm_bandwidth_gbps:,.1f} GB/s = {self.mbu:.1%} of the HBM share",
            f"  kernel launch on a device: +{self.launch_us:,.1f} us (not in the latency)",
            *(
                f"  core {c} busy: " + ", ".join(f"{e} {cb[e]:,.2f} us" for e in PROFILE_ENGINES)
                for c, cb in enumerate(self.core_busy_us)
                if self.lnc > 1
            ),
            f"  SBUF peak {self.sbuf_peak_bytes_per_partition:,} B/partition, "
            f"PSUM peak {self.psum_peak_bytes_per_partition:,} B/partition",
        ]
        if self.spill_save_bytes or self.spill_reload_bytes:
            lines.append(
                f"  spill_save_bytes {self.spill_save_bytes:,}, "
                f"spill_reload_bytes {self.spill_reload_bytes:,} (live tiles over capacity)"
            )
        if self.unmodeled:
            names = ", ".join(f"{k} x{v}" for k, v in sorted(self.unmodeled.items()))
            lines.append(f"  no documented cost rule (costed max(MIN_II, N)): {names}")
        lines.append("  (cost-model estimate, not a device measurement)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


#: the options of the legacy ``nki.profile`` decorator (aws-neuron-sdk@8a38e733
#: general/nki/api/nki/__init__.py L402-424)
_LEGACY_PROFILE_OPTIONS = {
    "working_directory",
    "save_neff_name",
    "save_trace_name",
    "additional_compile_opt",
    "overwrite",
    "profile_nth",
}


def _legacy_profile_decorator(options):
    """``@nki.profile(working_directory=..., ...)``: the decorated kernel runs in the simulator
    and returns None, as documented (L424; its outputs are undefined, L456-458). No NEFF or
    NTFF is written: there is no device; the modeled profile of the run is the decorated
    function's ``last_profile``."""
    if not options.get("working_directory"):
        raise ValueError("nki.profile needs working_directory= (an absolute path, L412-413)")

    def decorate(func):
        def run(*args, **kwargs):
            run.last_profile = profile(func, *args, **kwargs)[1]

        run.last_profile = None
        return run

    return decorate


def profile(kernel=None, *args, target=None, **kwargs):
    """``simulate.profile(kernel, *args, target="trn1", **kwargs) -> (outputs, Profile)``.

    Called with only the legacy ``nki.profile`` options (``working_directory=`` ...), it is
    that decorator instead (:func:`_legacy_profile_decorator`).

    Runs ``kernel`` once in the simulator (outputs as ``nki.simulate_kernel`` returns them)
    and models its trace on ``target`` ("inf2", "trn1", "trn2" = one NeuronCore-v3 with LNC=1,
    "trn3"). ``kernel`` is a legacy kernel (without ``target``: its ``platform_target`` or
    trn1) or an ``nki`` 0.6 ``@nki.jit`` kernel, ``kernel[2]`` included (without ``target``:
    ``NEURON_PLATFORM_TARGET_OVERRIDE`` or trn3); a front-end that launches its own kernels
    says so with a ``__simulate_trace__`` method. A kernel that fails raises the simulator's
    error; no timing is produced for it.
    """
    from ..core.runtime import trace_kernel

    if kernel is None or (not args and kwargs and set(kwargs) <= _LEGACY_PROFILE_OPTIONS):
        if kernel is not None:
            return _legacy_profile_decorator(kwargs)(kernel)
        return _legacy_profile_decorator(kwargs)
    own_launcher = getattr(kernel, "__simulate_trace__", None)
    if own_launcher is not None:
        outputs, trace = own_launcher(*args, target=target, **kwargs)
    else:
        outputs, trace = trace_kernel(kernel, *args, target=target, **kwargs)
    return outputs, Profile.from_trace(trace)


class LatencyStats:
    """``benchmark_result.nc_latency``: modeled latency percentiles in microseconds."""

    def __init__(self, latency_us: float):
        self.latency_us = latency_us

    def get_latency_percentile(self, percentile) -> float:
        """The modeled latency in microseconds for ``percentile`` in {0, 1, 10, 25, 50, 90, 99,
        100}. The cost model is deterministic, so every percentile is the same number."""
        if percentile not in PERCENTILES:
            raise ValueError(f"percentile must be one of {PERCENTILES}, got {percentile!r}")
        return self.latency_us


@dataclass
class BenchmarkResult:
    """``kernel.benchmark_result`` after a ``nki.benchmark`` run in the simulator."""

    nc_latency: LatencyStats
    profile: Profile = field(repr=False)
    launch_overhead_us: float = 0.0  # what a device run adds on top of ``nc_latency``


def benchmark_result_from_trace(trace: Trace) -> BenchmarkResult:
    """The ``nki.benchmark`` result of a traced run: the cost model's latency (a model
    estimate, deterministic, so all percentiles are equal), the full :class:`Profile`, and
    the modeled kernel launch cost, reported beside the latency rather than in it."""
    prof = Profile.from_trace(trace)
    return BenchmarkResult(LatencyStats(prof.latency_us), prof, prof.launch_us)
