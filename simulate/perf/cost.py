"""The cost model: turns an instruction trace into modeled time on one NeuronCore.

Every number comes from ``CONSTANTS`` below, one row per constant with a column per
NeuronCore generation and a source tag (``docs/design.md``, Sources): **D** documented, **D→**
arithmetic on documented numbers, **I** inferred (fitted to a published measurement, read
off a chart, or assumed). Targets: ``inf2`` and ``trn1`` (NeuronCore-v2), ``trn2`` (v3, one
physical core, LNC=1, or a logical core of two under LNC=2), ``trn3`` (v4, the same).

What the model assumes
----------------------
* **Engines.** Tensor (PE), Scalar (ACT), Vector (DVE) and GpSimd (Pool) run concurrently.
  An instruction occupies its engine for its cost in that engine's cycles (the documented
  per-instruction rules, docs/design.md, Sources): ``max(MIN_II, k·N / fast_mode)`` for ACT and
  DVE, ``GPSIMD_START + N`` for Pool index ops, ``max(min(64, N_stationary), N_moving)`` (×4
  for fp32) for matmuls; ``N`` is the free size (elements per partition). The partition
  count never changes the cost; the dtype does only through the documented fast modes
  (bf16/fp16 on NC-v3/v4) and fp32 matmuls; an innermost stride over 16 bytes halves the
  rate. A partition broadcast (``broadcast_to`` along partitions) is a matmul against ones
  on PE into one PSUM bank, and its reader streams it from PSUM, when its result fits a
  bank (2 KiB per partition as fp32); a wider one is copied out to SBUF (costed as that copy
  on the Vector engine) and read from SBUF.
* **Dependencies.** Read-after-write, write-after-read and (on chip) write-after-write
  between instructions whose memory regions overlap (same tile or HBM tensor, overlapping
  byte and partition ranges). An HBM access is one byte interval, so interleaved but
  disjoint stores would look overlapping; HBM write-after-write orders data, not progress,
  and is not a dependency. On-chip memory is tracked per tile: the compiler gives the tiles a loop
  body allocates enough buffers to overlap iterations, so only reuse the kernel spells out
  (one tile rewritten in every iteration) makes a writer wait for earlier readers.
  (``schedule(..., by_address=True)`` tracks on-chip addresses instead; the simulator's
  allocator hands a freed address out at once, which pins loops to about two buffers and
  makes small tiles wait for unrelated ones that held their address before.) A consumer on
  the same engine waits ``dependent_latency_cycles`` after its producer ends (pipeline
  drain), and an ACT/DVE instruction that reads the output of the instruction before it in
  its engine's program order pays the documented static overhead of a dependent instruction
  (``dependent_overhead_cycles``, engine busy); with MIN_II they make the measured 264-cycle
  chain of dependent 1-element activations, and with the documented per-instruction costs
  they give the Vector-engine busy time per step the fused-Mamba tutorial's profiles show
  (v1 / v2 / v3: 4,528 / 3,474 / 3,454 cycles modeled, 4,718 / 3,434 / 3,590 read off).
  The list scheduler below may start independent work in a drain wait, but the compiler's
  instruction order decides the static overhead. A consumer on another engine waits a
  semaphore latency; PE accumulation into the same PSUM tile chains with no wait.
* **Compiler reuse.** A ``tensor_tensor`` that recomputes the value of an earlier one (same
  op, same operand regions written by the same instructions, the earlier result unmodified)
  is elided, as common-subexpression elimination after loop unrolling does (evidence: the
  fused-Mamba tutorial's Vector-engine event counts and busy time, see
  ``_common_subexpression``).
* **Scheduling.** Whenever an engine (or DMA queue) is free it starts, among the next
  ``schedule_window`` instructions of its program-order stream, the first one whose inputs
  are ready, or else the one ready soonest (list scheduling, as the compiler's static
  scheduler does), so independent work, e.g. from the next loop iteration, fills dependency
  bubbles. ``affine_range`` and ``static_range`` iterations may overlap;
  each ``sequential_range`` iteration (and each SPMD program instance, which run serially
  on one core) starts only after everything of the previous one has finished (a barrier).
  On NeuronCore-v2, DVE and Pool share the SBUF port and DVE and ACT share the PSUM port:
  instructions that need the same port do not overlap.
* **DMA.** A ``dma_copy`` (``nl.load``/``nl.store``) goes on a queue chosen by its
  direction and the HBM tensor it reads or writes (up to ``dma_queues``; in order within a
  queue, queues overlap). The queue issues one transfer per ``dma_fixed_us`` (the
  per-transfer fixed cost that makes small transfers overhead-bound); the data then moves
  on the DMA engines that serve its partitions (8 partitions per engine, 16 engines), each
  at ``dma_engine_peak_gbps · dma_efficiency``, no faster than one descriptor (contiguous
  row) per ``dma_descriptor_ns``, with all HBM traffic capped at ``hbm_efficiency`` times
  the core's HBM share. An engine runs the transfers of one queue in order and serves its
  queues round robin (S6 L29): a transfer's share on an engine ends after its own data
  plus, from each other queue with work pending there, up to as much again (one turn each),
  and that queue's next transfer on the engine starts as much later. (The end of a
  transfer already under way is not pushed back: two equal transfers on two queues end at
  1x and 2x rather than both at 2x, and a short transfer that interleaves with a long one
  ends early while the long one keeps its end, so its consumers may start that early; the
  kernel's latency is never less than each DMA engine's data moved one transfer after
  another at its rate plus the completion latency, which keeps ``engine_floors`` a bound.)
  Consumers see the data ``dma_latency_us`` after issue plus the transfer time.
* **LNC=2** (``Trace.lnc == 2``: an ``nki`` 0.6 ``kernel[2]``, or a legacy grid with an
  ``nl.nc(2)`` dimension, on trn2/trn3). Each instruction runs on its ``core``: the two
  physical cores have their own four engines, DMA queues and 16 DMA engines and run
  concurrently; their HBM traffic shares one pool of ``hbm_cores_per_pool`` HBM shares (the
  bank both cores sit on). Cross-core dependencies: data through shared HBM (as above); the
  k-th ``sendrecv`` of a pipe on each core also waits for the writers of the other core's
  source; the k-th ``core_barrier`` (a GpSimd instruction that reads and writes its
  ``data``) of each core waits for everything the other core's waits for; the later core
  reaches the other after ``semaphore_latency_us``. SPMD instances placed on one core still
  run one after another.
* **Latency** is from the first instruction to the last completion. It excludes the fixed
  launch cost of a kernel on a device (``kernel_launch_us``), which ``nki.benchmark`` on
  hardware includes; the profiler reports it beside the latency.

What the model ignores: instruction fetch, ACT table loads, SBUF bank conflicts beyond the
NC-v2 ports, spills and buffer starvation (the simulator raises when SBUF is full), DVE/Pool
bus arbitration on v3/v4, HBM page effects, DMA QoS classes on v4, and compiler rewrites
other than the reuse above (fusion, hoisting). It is deterministic. See
``docs/calibration.md`` for how far it is from every published measurement; fixed costs
(DMA setup, semaphores) are ±50-100 %.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from ..core.targets import get_target
from ..core.trace import Trace

# --- the constants ------------------------------------------------------------------------
# (NC-v2 = inf2/trn1, NC-v3 = trn2, NC-v4 = trn3)   tag and source: docs/design.md, Sources
CONSTANTS: dict[str, tuple[float, float, float]] = {
    # engine clocks, GHz
    "pe_clock_ghz": (2.8, 2.4, 2.4),  # D S1 L65-73; S2 L44-64; S3 L44-61
    "act_clock_ghz": (1.4, 1.2, 1.2),  # D same
    "dve_clock_ghz": (1.12, 0.96, 1.2),  # D same (DVE instruction clock)
    "pool_clock_ghz": (1.4, 1.2, 1.2),  # D same
    # per-instruction rules, engine cycles
    "min_ii_cycles": (64, 64, 64),  # D S10 (every ACT/DVE cost); v3/v4 same: I
    # an ACT/DVE instruction reading the output of the one before it on its engine (program
    # order): D S1 L401-404 "add a static instruction overhead of 100 engine cycles" (busy;
    # S1 L498-500: the same for ACT); fits the Mamba tutorial's Vector busy time per step; and
    # its start waits for the producer's pipeline to drain: I, the rest of the measured
    # 264-cycle chain of dependent 1-element activations (S4 L424-429: 64 + 100 + 100)
    "dependent_overhead_cycles": (100, 100, 100),
    "dependent_latency_cycles": (100, 100, 100),
    "act_read_accumulator_cycles": (64, 64, 64),  # D S1 L492
    "pool_start_cycles": (150, 150, 150),  # D S10 L289-292, L565-567 (GPSIMD_START)
    "pe_stationary_floor": (64, 64, 64),  # D S10 L896-915: max(min(64, N_st), N_mov)
    "pe_fp32_factor": (4, 4, 4),  # D S1 L67; S2 L50-52 (fp32 at 1/4 rate)
    "pe_transpose_fp32_factor": (4, 2, 2),  # D S2 L194-201 (v3 transpose mode: 2x for fp32)
    "mm_init_latency_cycles": (64, 64, 64),  # D S1 L267; S4 L679
    "k_two_inputs": (2, 2, 2),  # D S10 L1660-1685, L1210-1222, L1382-1394: 2N for 2 SBUF inputs
    "k_scan": (2, 2, 2),  # D S10 L1753-1759: tensor_tensor_scan 2N
    "k_reduce_half": (0.5, 0.5, 0.5),  # D S10 L1466-1480: bf16 add/max tensor_reduce N/2
    "k_memset_zero_half": (0.5, 1, 1),  # D S10a L420 (v2: N/2); v3/v4 use dve_fast_copy
    "k_reciprocal": (8, 8, 8),  # D S10 L1182-1185
    "k_gpsimd_rsqrt": (4, 4, 4),  # D nki.api.shared.rst@81ce03ae L260-262 (4x below ACT)
    "k_bn_aggr": (13 / 3, 13 / 3, 13 / 3),  # D S10 L335-338
    # quantize_mx (NC-v4 only; the v2/v3 columns are never read): "four input elements per
    # partition, per cycle (i.e., 4x Vector performance mode)", D S3 L172
    "quantize_mx_elements_per_cycle": (4, 4, 4),
    "stride_penalty_bytes": (16, 16, 16),  # D S1 L756-762: innermost stride > 16 B ...
    "stride_penalty_factor": (2, 2, 2),  # D S1 L756-762: ... halves the access bandwidth
    # dtype fast modes (speed-up over the generic rule; docs/design.md, Sources)
    "dve_fast_copy": (1, 4, 4),  # D S2 L224-229: tensor_copy/tensor_scalar bf16/fp16 SBUF
    "dve_fast_copy_slow_path": (1, 2, 2),  # D S2 L231-234: strided or one side in PSUM
    "dve_fast_tensor_tensor": (1, 2, 2),  # D S2 L235-236 (? unverified: "2x vs NC-v2")
    "act_fast_copy": (1, 1, 2),  # D S3 L218: ACT tensor_scalar/tensor_copy bf16/fp16
    # dependencies
    "semaphore_latency_us": (0.1, 0.1, 0.1),  # I (compute->compute latency is undocumented)
    "schedule_window": (8, 8, 8),  # I (compiler list-scheduling look-ahead per engine)
    "nc_v2_ports": (1, 0, 0),  # D S1 L594-598, L764-770; lifted on v3 (S2 L266-273)
    # DMA
    "dma_engines": (16, 16, 16),  # D S6 L7; S1 L613; S2 L289
    "dma_partitions_per_engine": (8, 8, 8),  # D S6 L14, L34
    "dma_queues": (16, 16, 16),  # D S6 L26-29: 16 queues per engine, round robin between them
    "dma_engine_peak_gbps": (27.2, 27.2, 38.4),  # D S6 L16
    # v2: 17.5 B/ns = one engine moving 32 KiB in 1.81-1.93 us (I, S4 fig30; 17.0-18.1 B/ns);
    # v3/v4: D S5 L59-64 table (23/33 B/ns); v3 fits the S6 1416 ns tooltip
    "dma_efficiency": (17.5 / 27.2, 0.85, 0.86),
    "hbm_share_gbps": (410.0, 362.5, 612.0),  # D→ chip HBM bandwidth / physical cores (S1, S8)
    # LNC=2: a logical core is two physical cores (D S9 L14: trn2/trn3 only) "that have
    # shared HBM memory" (D nki/get-started/about/lnc.rst@81ce03ae L18-21). trn2: "four 24GB
    # HBM banks. Each bank is shared by two physical NeuronCore-v3" (D S9 L65, L100), so the
    # two cores' DMA traffic draws on one pool of 2 x hbm_share_gbps (D→: 2.9 TB/s / 4 banks
    # = 725 GB/s). trn3: 8 NeuronCores and "4 HBM stacks" (D S3 L15-16), two cores a stack
    # (D→: 1.22 TB/s). v2 has no LNC=2 (its column is never read).
    "hbm_cores_per_pool": (1, 2, 2),
    # I: HBM sustains ~85 % of its pin rate even for a plain copy (no NeuronCore figure is
    # published; a GPU device-to-device copy reaches ~85 % of nominal HBM bandwidth)
    "hbm_efficiency": (0.85, 0.85, 0.85),
    # per-transfer fixed cost on its queue: v2 has no hardware DGE, D S5 L39-42 "~1300 ns"
    # per transfer (fits the matmul tutorial's hoist/block kernels). v3: I, the S6 chart of
    # DMA throughput vs bytes per partition (P=128; a Trn2 page, target not stated) rises
    # linearly up to its knee, 2415 B per partition = 309 KB per transfer (1.4 % at 32 B ...
    # 42.4 % at 1 KiB of the 32 KiB rate), i.e. a fixed 309 KB / 308 GB/s (the model's trn2
    # ceiling) = 1.0 us per transfer. v4: 0.75, I (the chart knee at v3 rates, before the HBM
    # cap; ~600 ns per hardware-DGE DMA instruction, D S7 L124); no v4 measurement exists
    "dma_fixed_us": (1.3, 1.0, 0.75),
    "dma_latency_us": (1.3, 1.1, 1.1),  # D S5 L39-42 (~1300 ns); I S6 screenshots (1.0-1.3)
    "dma_descriptor_ns": (12.0, 12.0, 12.0),  # I S6: 97 ns per 8 descriptors of 256 B
    # partition broadcasts: a ones-matmul writes one PSUM bank (D S1 L170: 512 fp32 per partition)
    # a wider broadcast is evacuated to SBUF and read from there
    "psum_bank_bytes": (2048, 2048, 2048),
    # kernel launch seen by nki.benchmark on a device, reported beside the kernel's latency:
    # I (S6 figure 3: ~10 us of device activity for a trivial kernel; S14: 14-40 us thresholds)
    "kernel_launch_us": (12.0, 12.0, 12.0),
}

_GENERATION_COLUMN = {2: 0, 3: 1, 4: 2}
COMPUTE_ENGINES = ("pe", "act", "dve", "pool")
DMA_QUEUES = ("dma_load", "dma_store", "dma_copy")
RESOURCES = COMPUTE_ENGINES + DMA_QUEUES
_PE, _ACT, _DVE, _POOL = range(4)
_BARRIER = -1


class CostTable:
    """The constants of one target (attributes named as the rows of ``CONSTANTS``)."""

    def __init__(self, target, overrides=None):
        spec = get_target(target)
        self.target = spec.name
        self.nc_version = spec.nc_version
        column = _GENERATION_COLUMN[spec.nc_version]
        values = {key: row[column] for key, row in CONSTANTS.items()}
        for key, value in (overrides or {}).items():
            if key not in values:
                raise KeyError(
                    f"unknown cost-model constant {key!r}; expected one of {', '.join(CONSTANTS)}"
                )
            values[key] = value
        self.values = values
        self.__dict__.update(values)

    def clock_ghz(self, engine: str) -> float:
        return self.values[f"{engine}_clock_ghz"]


# --- per-instruction cost -----------------------------------------------------------------
_ITEMSIZE = {
    "float32": 4,
    "tfloat32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "bool": 1,
}
_HALF = ("bfloat16", "float16")
_ADD_MUL_SUB = ("add", "multiply", "subtract")
_REDUCE_FAST = ("add", "sum", "max", "maximum")


# Vector instructions costed by the legacy ISA reference's "Estimated instruction cost"
# (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py): max(MIN_II, N) cycles for
# nc_stream_shuffle (L991), range_select (L1133) and nc_match_replace8 (L793, which prints
# min(MIN_II, N): read as max like its siblings, a min would cap every tile at 64 cycles);
# N cycles for max8 (L671) and nc_find_index8 (L746); N the elements per partition.
_MIN_II_OR_N_VECTOR = ("nc_stream_shuffle", "range_select", "nc_match_replace8", "dropout")
# dropout: max(MIN_II, N) Vector cycles (L529-531). tensor_copy_dynamic_src/_dst, on any of
# the three engines: max(MIN_II_DYNAMIC, N), "MIN_II_DYNAMIC is roughly 600 engine cycles"
# (L1434-1438, L1467-1471).
_MIN_II_DYNAMIC = 600
# local_gather (GpSimd): 150 + V·E / C cycles with C = ((28 + t·E) / (t·E)) / min(4 / size, E),
# t = 4, V the valid indices per core, E the elements per index, size the itemsize (L630-634).
_LOCAL_GATHER_T = 4
_N_VECTOR = ("max8", "nc_find_index8")


def _op_names(details) -> tuple[str, ...]:
    op = details.get("op", ())
    return tuple(op) if isinstance(op, (list, tuple)) else (op,)


@dataclass
class Operands:
    """What the cost rules need to know about an instruction's streamed operands."""

    dtypes: tuple[str, ...]  # streamed inputs, then the output
    psum: tuple[bool, ...]  # per streamed input: in PSUM (or a PSUM-resident broadcast)
    out_psum: bool
    stride_bytes: int  # largest innermost stride of a streamed operand (0: one element)


def _local_gather_cycles(n: int, ops: Operands, details: dict) -> float:
    """D legacy ISA reference (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py
    L628-634): ``150 + (num_valid_indices * num_elem_per_idx)/C`` with ``C = ((28 + t *
    num_elem_per_idx)/(t * num_elem_per_idx)) / min(4/dtype_size, num_elem_per_idx)``, t = 4.
    C is read as cycles per element (28 cycles per group of t indices plus one per element,
    over the elements a 4-byte lane carries), so the elements are multiplied by C: divided,
    one element per index would cost 64x less per element than 32, against the reference's
    own "gathering of multiple contiguous elements ... to improve gather throughput"
    (L1857-1858 of the 0.6 reference). ``n`` is the gathered elements per partition; the 150
    is the Pool start added by the caller."""
    per_index = details.get("num_elem_per_idx", 1)
    group = 4 * per_index
    element_bytes = _ITEMSIZE.get(ops.dtypes[-1], 4)  # dst's dtype is src_buffer's
    cycles_per_element = ((28 + group) / group) / min(4 / element_bytes, per_index)
    return n * cycles_per_element


def compute_cycles(
    opcode: str, engine: str, n: int, ops: Operands, details: dict, table: CostTable
) -> tuple[float, bool]:
    """Engine cycles of one compute instruction; also whether a documented rule covers it."""
    min_ii = table.min_ii_cycles
    stride = table.stride_penalty_factor if ops.stride_bytes > table.stride_penalty_bytes else 1
    half = all(d in _HALF for d in ops.dtypes)
    unit_stride = ops.stride_bytes <= 2
    any_psum = any(ops.psum) or ops.out_psum
    if opcode == "tensor_copy_dynamic":
        return max(_MIN_II_DYNAMIC, n), True
    if engine == "pe":
        if opcode in ("nc_matmul", "nc_matmul_mx"):  # MX: the documented matmul rule with
            # n the moving free size in x4 elements, each PE taking the 4 values of one per
            # cycle (D→ S3 L79: "four pairs of MX multiplications ... per cycle")
            floor = min(table.pe_stationary_floor, details.get("stationary_free", 128))
            factor = table.pe_fp32_factor if details.get("fp32") else 1
            if details.get("transpose") and details.get("fp32"):
                factor = table.pe_transpose_fp32_factor
            return max(floor, n) * factor, True
        if opcode in ("nc_transpose", "partition_broadcast"):
            partitions = details.get("_partitions", 128)
            fp32 = "float32" in ops.dtypes
            if opcode == "nc_transpose":
                factor = table.pe_transpose_fp32_factor if fp32 else 1
                return max(partitions, min(table.pe_stationary_floor, n)) * factor, True
            # I: lowered to a matmul against a row of ones, moving the broadcast row
            return max(table.pe_stationary_floor, n) * (table.pe_fp32_factor if fp32 else 1), True
        return max(min_ii, n), False
    if engine == "pool":
        if opcode in ("iota", "affine_select", "rand", "tensor_partition_reduce"):
            return table.pool_start_cycles + n, True
        if opcode == "nc_n_gather":  # one ISA instruction per 512 gathered elements (its
            # docstring: n = ceil(elems_per_partition / 512)); I: each a Pool start + 1/elem
            return table.pool_start_cycles * max(1, -(-n // 512)) + n, True
        if opcode == "local_gather":
            return table.pool_start_cycles + _local_gather_cycles(n, ops, details), True
        if opcode in ("nonzero_with_count", "sequence_bounds"):  # I: one pass like iota
            return table.pool_start_cycles + n, True
        if opcode == "local_gather":
            per_index = details["elements_per_index"]
            size = _ITEMSIZE.get(ops.dtypes[0], 4)
            rate = ((28 + _LOCAL_GATHER_T * per_index) / (_LOCAL_GATHER_T * per_index)) / min(
                4 / size, per_index
            )
            return table.pool_start_cycles + details["gather_elements"] / rate, True
        if opcode == "core_barrier":  # no data: a Pool instruction start (I; none published)
            return table.pool_start_cycles, True
        if opcode == "tensor_scalar" and "rsqrt" in _op_names(details):
            # D: GpSimd's reverse square root "is 4x lower [throughput] than Scalar Engine"
            # (nki/api/nki.api.shared.rst@81ce03ae L260-262), whose rule is max(MIN_II, N)
            return max(min_ii, table.k_gpsimd_rsqrt * n) * stride, True
        k = table.k_two_inputs if opcode == "tensor_tensor" else 1  # as DVE v2: no rule exists
        return max(min_ii, k * n) * stride, False
    if engine == "act":
        if opcode in ("activation", "activation_reduce"):
            extra = (
                table.act_read_accumulator_cycles
                if (opcode == "activation_reduce" or details.get("_reduce_out"))
                else 0
            )
            return max(min_ii, n) * stride + extra, True
        if opcode in ("tensor_scalar", "tensor_copy", "memset"):
            speed = table.act_fast_copy if half else 1
            return max(min_ii, n * stride / speed), True
        return max(min_ii, n) * stride, False
    # Vector engine
    v2 = table.nc_version == 2
    if opcode in (
        "tensor_scalar",
        "tensor_copy",
        "memset",
        "nc_transpose",
        "partition_broadcast",
    ):  # a wide broadcast: its copy out of PSUM
        speed = 1
        if half and opcode != "nc_transpose":
            speed = (
                table.dve_fast_copy
                if unit_stride and not any_psum
                else table.dve_fast_copy_slow_path
            )
        k = (
            table.k_memset_zero_half
            if (opcode == "memset" and details.get("value", 1.0) == 0.0 and half)
            else 1
        )
        return max(min_ii, k * n * stride / speed), True
    if opcode == "tensor_tensor":
        k = table.k_two_inputs
        if sum(ops.psum) == 1:
            k = 1  # D S10 L1660-1685
        elif v2 and half and unit_stride and set(_op_names(details)) <= set(_ADD_MUL_SUB):
            k = 1  # D S10a L734-744
        elif not v2 and half and not any_psum:
            k = table.k_two_inputs / table.dve_fast_tensor_tensor
        return max(min_ii, k * n * stride), True
    if opcode == "scalar_tensor_tensor":
        # D S10 L1218-1226: the N-cycle mode asks only ``data`` and ``operand1`` (the
        # streamed inputs) to be bfloat16; the output dtype is not a condition.
        names = _op_names(details)
        inputs = ops.dtypes[: len(ops.psum)]
        fast = (
            bool(inputs)
            and all(d == "bfloat16" for d in inputs)
            and names[:2] == ("subtract", "multiply")
            and n % 2 == 0
        )
        return max(min_ii, (1 if fast else table.k_two_inputs) * n * stride), True
    if opcode == "tensor_tensor_scan":
        return max(min_ii, table.k_scan * n * stride), True
    if opcode == "tensor_reduce":
        fast = half and _op_names(details)[0] in _REDUCE_FAST
        return max(min_ii, (table.k_reduce_half if fast else 1) * n * stride), True
    if opcode == "tensor_scalar_reduce":
        return max(min_ii, n * stride) + min_ii, True
    if opcode == "bn_stats":
        return max(min_ii, n * stride), True
    if opcode == "bn_aggr":
        return max(min_ii, table.k_bn_aggr * n), True
    if opcode == "quantize_mx":  # n: the source elements per partition
        return max(min_ii, n * stride / table.quantize_mx_elements_per_cycle), True
    if opcode == "reciprocal":
        return max(min_ii, table.k_reciprocal * n * stride), True
    if opcode in _MIN_II_OR_N_VECTOR:
        return max(min_ii, n * stride), True
    if opcode in _N_VECTOR:
        return n * stride, True
    if opcode in ("select", "tensor_copy_predicated"):  # the legacy and 0.6 opcodes
        # D legacy ISA reference (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py
        # L1513-1526): max(MIN_II, N) with one of src/predicate in PSUM, max(MIN_II, 2N) with
        # both in SBUF; the 0.6 reference prints no cost (I: the same instruction, same rule)
        return max(min_ii, (1 if any(ops.psum) else table.k_two_inputs) * n * stride), True
    return max(min_ii, n * stride), False


# --- dependency tracking ------------------------------------------------------------------
_ONCHIP_CHUNK = 4096  # bytes of the per-partition address space per bucket
_HBM_CHUNK = 1 << 20
_READER_CAP = 16  # identical consecutive reads of one range keep their last 16 readers


class _Tracker:
    """Last writers and readers of every byte range (on-chip by address, HBM by tensor)."""

    def __init__(self, by_address: bool):
        self.writers: dict = {}
        self.readers: dict = {}
        self.by_address = by_address
        self.core = 0  # the physical core of the instruction being added (its own SBUF/PSUM)

    def _keys(self, region):
        if region.memory == "hbm":
            base, size = region.storage, _HBM_CHUNK
        elif self.by_address:
            base, size = (region.memory, self.core), _ONCHIP_CHUNK
        else:
            base, size = (region.memory, region.storage), _ONCHIP_CHUNK
        first = region.start // size
        last = (region.stop - 1) // size
        return [(base, c) for c in range(first, last + 1)]

    @staticmethod
    def _overlaps(rec, start, stop, p0, p1):
        return rec[0] < stop and start < rec[1] and rec[2] < p1 and p0 < rec[3]

    def writers_of(self, region, keys):
        p0, p1 = region.partitions
        found = []
        for key in keys:
            for rec in self.writers.get(key, ()):
                if self._overlaps(rec, region.start, region.stop, p0, p1):
                    found.extend(rec[4])
        return found

    def readers_of(self, region, keys):
        p0, p1 = region.partitions
        found = []
        for key in keys:
            for rec in self.readers.get(key, ()):
                if self._overlaps(rec, region.start, region.stop, p0, p1):
                    found.extend(rec[4])
        return found

    def add_read(self, region, keys, index):
        p0, p1 = region.partitions
        for key in keys:
            records = self.readers.setdefault(key, [])
            last = records[-1] if records else None
            if (
                last is not None
                and last[0] == region.start
                and last[1] == region.stop
                and last[2] == p0
                and last[3] == p1
            ):
                if last[4][-1] != index:
                    last[4].append(index)
                    if len(last[4]) > _READER_CAP:
                        del last[4][0]
                continue
            records.append((region.start, region.stop, p0, p1, [index]))

    def add_write(self, region, keys, index):
        p0, p1 = region.partitions
        start, stop = region.start, region.stop
        for key in keys:
            for table in (self.writers, self.readers):
                records = table.get(key)
                if records:
                    kept = [
                        r
                        for r in records
                        if not (start <= r[0] and r[1] <= stop and p0 <= r[2] and r[3] <= p1)
                    ]
                    if len(kept) != len(records):
                        table[key] = kept
            self.writers.setdefault(key, []).append((start, stop, p0, p1, [index]))


# --- the schedule -------------------------------------------------------------------------
@dataclass
class Schedule:
    """The modeled timeline of one trace (times in microseconds from the first issue)."""

    target: str
    latency_us: float
    resource: list[str]  # per instruction: "pe", "act", "dve", "pool" or a DMA queue
    start_us: list[float]
    end_us: list[float]  # when its engine (or for DMA: its data transfer) is done
    finish_us: list[float]  # when consumers may use the result
    busy_us: dict[str, float]  # per compute engine and DMA queue; "dma" = any DMA in flight
    stalls: dict[str, int]  # instructions that found their engine idle waiting for inputs
    stall_us: dict[str, float]  # total idle time of each engine spent waiting for inputs
    unmodeled: dict[str, int] = field(default_factory=dict)  # opcodes without a documented rule
    lnc: int = 1  # physical cores the trace ran on concurrently (LNC=2: two)
    core: list[int] = field(default_factory=list)  # per instruction: its physical core
    # per physical core: busy time of each compute engine and "dma" (any transfer in flight)
    core_busy_us: list[dict[str, float]] = field(default_factory=list)
    # the least time each resource needs for this instruction mix (``engine_floors``)
    floor_us: dict[str, float] = field(default_factory=dict)


FLOOR_RESOURCES = COMPUTE_ENGINES + ("dma", "hbm")


def engine_floors(sched: Schedule) -> dict[str, float]:
    """The per-resource floor of a modeled trace, in microseconds: for each compute engine
    the sum of its instructions' costs by the per-instruction rules alone (no dependency
    wait, no dependent-instruction overhead; elided recomputations cost nothing), for
    ``dma`` the busiest DMA engine's transfer time, and for ``hbm`` the HBM bytes over the
    capped HBM rate; the largest over the physical cores (LNC=2: the two share one HBM
    pool). No schedule of the same instructions can finish before the largest of them."""
    return dict(sched.floor_us)


def binding_resource(floors: dict[str, float]) -> str:
    """The resource with the largest floor: what binds the instruction mix."""
    return max(FLOOR_RESOURCES, key=lambda r: floors.get(r, 0.0))


def _dma_class(direction: str) -> int:
    """0 loads, 1 stores, 2 other copies (the index into ``DMA_QUEUES``, used to report)."""
    if direction.startswith("hbm") and not direction.endswith("hbm"):
        return 0
    if direction.endswith("hbm") and not direction.startswith("hbm"):
        return 1
    return 2


def _dma_queue_key(inst) -> tuple:
    """What decides a transfer's DMA queue: its direction and the HBM tensor it reads or
    writes. The compiler issues every DMA instruction from one trigger engine, and the queue
    "is typically tied to the trigger engine" (S6 L29), so the transfers of one instruction
    in a loop share a queue and run in order; transfers of different tensors overlap (I: the
    matmul tutorial's "tiled" kernel loads two tensors per step in the time the "hoist
    load" kernel takes for one)."""
    hbm = [r.storage for r in inst.reads + inst.writes if r is not None and r.memory == "hbm"]
    return (_dma_class(inst.dma_direction), hbm[0] if hbm else None)


def schedule(trace: Trace, target=None, overrides=None, by_address=False) -> Schedule:
    """Model the execution of ``trace`` on ``target`` (default: the trace's target)."""
    table = CostTable(target or trace.target, overrides)
    insts = trace.instructions
    n = len(insts)
    lnc = trace_lnc(trace, table)
    per_core = len(COMPUTE_ENGINES) + int(table.dma_queues)  # resources of one physical core
    window = int(table.schedule_window)
    ports_on = bool(table.nc_v2_ports)
    sem = table.semaphore_latency_us
    mm_init = table.mm_init_latency_cycles / (table.pe_clock_ghz * 1000.0)
    clocks = [table.clock_ghz(e) * 1000.0 for e in COMPUTE_ENGINES]  # cycles per us
    dep_lat = [table.dependent_latency_cycles / c for c in clocks]
    dep_overhead = [
        table.dependent_overhead_cycles / c if e in ("act", "dve") else 0.0
        for e, c in zip(COMPUTE_ENGINES, clocks)
    ]
    previous_on: dict[int, int] = {}  # resource -> its last (not elided) instruction
    computed: dict[tuple, int] = {}  # value key of a tensor_tensor -> the instruction

    # node arrays: instructions 0..n-1, then barrier nodes
    res: list[int] = []
    dur: list[float] = []
    preds: list[dict] = []
    ports: list[tuple] = []
    dma_info: list = []
    unmodeled: dict[str, int] = {}
    tracker = _Tracker(by_address)
    broadcast_nodes: set[int] = set()  # partition broadcasts whose result stays in PSUM
    bank = table.psum_bank_bytes
    queue_of: dict[tuple, int] = {}  # (core, DMA queue key) -> queue slot on that core
    queues_used = [0] * lnc
    core_of: list[int] = []  # per node: physical core (0 for barrier nodes)
    partners: dict[tuple, list[int]] = {}  # (kind, pipe, k-th) -> the cores' instructions
    arrivals: dict[tuple, int] = {}  # (kind, pipe, core) -> how many so far
    raw_preds: dict[int, dict] = {}  # sendrecv -> the edges to the writers of its source
    dma_class: list[int] = []  # per node: index into DMA_QUEUES (-1 for compute nodes)
    barriers: dict = {}  # loop id -> [iteration, members, barrier node]
    barrier_preds: list[list[int]] = []  # per barrier node (index n + k)
    rule_us: dict[tuple, float] = {}  # (core, engine) -> sum of per-instruction rule costs

    def barrier_for(key, iteration, index):
        state = barriers.get(key)
        if state is None:
            barriers[key] = [iteration, [index], None]
            return None
        if state[0] != iteration:
            members = state[1] + ([state[2]] if state[2] is not None else [])
            barrier_preds.append(members)
            node = n + len(barrier_preds) - 1
            barriers[key] = state = [iteration, [], node]
        state[1].append(index)
        return state[2]

    for i, inst in enumerate(insts):
        engine = inst.engine
        core = inst.core if lnc > 1 else 0
        core_of.append(core)
        offset = core * per_core
        tracker.core = core
        if inst.opcode == "partition_broadcast":
            # a ones-matmul on PE into one PSUM bank, read from there; a result wider than
            # a bank is copied out to SBUF bank by bank (the copy from PSUM binds: DVE)
            if _fp32_row_bytes(inst) <= bank:
                engine = "pe"
                broadcast_nodes.add(i)
        deps: dict[int, bool] = {}  # predecessor -> is read-after-write
        psum_reads = []
        for region in inst.reads:
            if region is None or region.stop <= region.start:
                psum_reads.append(False)
                continue
            keys = tracker._keys(region)
            writers = tracker.writers_of(region, keys)
            for w in writers:
                deps[w] = True
            psum_reads.append(
                region.memory == "psum"
                or any(w in broadcast_nodes for w in writers)
                or (
                    region.partitions[1] - region.partitions[0] == 1
                    and inst.partitions > 1
                    and _fp32_row_bytes(inst) <= bank
                )
            )
        for region in inst.writes:
            if region.stop <= region.start:
                continue
            keys = tracker._keys(region)
            earlier = tracker.readers_of(region, keys)
            if region.memory != "hbm":
                # HBM regions are one byte interval per access, so two stores of
                # interleaved rows look overlapping; a write-after-write on HBM orders data,
                # not the hardware's progress, so only on-chip WAW is a dependency
                earlier = earlier + tracker.writers_of(region, keys)
            for w in earlier:
                deps.setdefault(w, False)
        for region in inst.reads:
            if region is not None and region.stop > region.start:
                tracker.add_read(region, tracker._keys(region), i)
        for region in inst.writes:
            if region.stop > region.start:
                tracker.add_write(region, tracker._keys(region), i)
        deps.pop(i, None)

        if engine == "dma":
            key = (core, _dma_queue_key(inst))
            if key not in queue_of:
                queue_of[key] = queues_used[core] % int(table.dma_queues)
                queues_used[core] += 1
            r = offset + len(COMPUTE_ENGINES) + queue_of[key]
            dma_class.append(key[1][0])
            dma_info.append(_dma_plan(inst, table))
            dur.append(0.0)
            ports.append(())
        else:
            r = COMPUTE_ENGINES.index(engine)
            dma_class.append(-1)
            dma_info.append(None)
            ops = _operands(inst, psum_reads)
            details = inst.details
            if inst.opcode == "activation" and details.get("reduce") and len(inst.writes) > 1:
                details = dict(details, _reduce_out=True)
            if engine == "pe" and inst.opcode != "nc_matmul":
                details = dict(details, _partitions=inst.partitions)
            if inst.opcode == "partition_broadcast" and engine == "dve":
                ops = Operands(ops.dtypes, (True,), False, ops.stride_bytes)
            cycles, documented = compute_cycles(
                inst.opcode, engine, inst.free_size, ops, details, table
            )
            if not documented:
                unmodeled[f"{engine}.{inst.opcode}"] = (
                    unmodeled.get(f"{engine}.{inst.opcode}", 0) + 1
                )
            duration = cycles / clocks[r]
            original = _common_subexpression(i, inst, engine, core, computed, tracker)
            if original is not None:  # the compiler keeps the earlier result: no instruction
                duration = 0.0
                deps[original] = True
            else:
                rule_us[(core, engine)] = rule_us.get((core, engine), 0.0) + duration
                if deps.get(previous_on.get(r + offset, -1)):
                    duration += dep_overhead[r]  # reads the output of the one before it
                previous_on[r + offset] = i
            dur.append(duration)
            touches_psum = any(ops.psum) or ops.out_psum
            port = 2 * core  # each core's SBUF (+0) and PSUM (+1) port
            if not ports_on:
                ports.append(())
            elif r == _DVE:
                ports.append((port, port + 1) if touches_psum else (port,))
            elif r == _POOL:
                ports.append((port,))
            elif r == _ACT and touches_psum:
                ports.append((port + 1,))
            else:
                ports.append(())
            r += offset
        res.append(r)

        edges = {}
        for p, raw in deps.items():
            rp = res[p]
            if rp % per_core >= len(COMPUTE_ENGINES):
                lat = 0.0  # a DMA's finish time already includes its completion latency
            elif rp == r:  # PSUM accumulation is a write-after-write: it chains freely
                lat = dep_lat[r % per_core] if raw else 0.0
            else:
                lat = sem + (mm_init if rp % per_core == _PE else 0.0)
            edges[p] = lat
        for fid, kind, iteration in inst.loops:
            if kind == "sequential_range":
                node = barrier_for((core, fid), iteration, i)
                if node is not None:
                    edges[node] = 0.0
        if inst.program:  # SPMD instances on one core run one after another
            node = barrier_for(("spmd", core), inst.program, i)
            if node is not None:
                edges[node] = 0.0
        if lnc > 1 and inst.opcode in _CROSS_CORE:
            pipe = inst.details.get("pipe_id") if inst.opcode == "sendrecv" else None
            k = arrivals.get((inst.opcode, pipe, core), 0)
            arrivals[(inst.opcode, pipe, core)] = k + 1
            partners.setdefault((inst.opcode, pipe, k), []).append(i)
            raw_preds[i] = (
                {p: edges[p] for p, raw in deps.items() if raw}
                if inst.opcode == "sendrecv"
                else dict(edges)
            )
        preds.append(edges)

    _join_partners(partners, raw_preds, preds, sem)
    total = n + len(barrier_preds)
    for members in barrier_preds:
        preds.append(dict.fromkeys(members, 0.0))
        res.append(_BARRIER)
        core_of.append(0)
    result = _list_schedule(
        table,
        insts,
        res,
        dur,
        preds,
        ports,
        dma_info,
        total,
        window,
        unmodeled,
        dma_class,
        lnc,
        core_of,
    )
    result.floor_us = _floors(table, rule_us, dma_info, core_of, lnc)
    return result


def _floors(table, rule_us, dma_info, core_of, lnc) -> dict[str, float]:
    """See :func:`engine_floors`: the rule costs per engine, the DMA engines' transfer
    times, the HBM bytes over the rate ``_list_schedule`` caps HBM traffic at."""
    floors = dict.fromkeys(FLOOR_RESOURCES, 0.0)
    for (_, engine), us in rule_us.items():
        floors[engine] = max(floors[engine], us)
    per_dma_engine: dict[tuple, float] = {}
    hbm_bytes = 0
    for node, info in enumerate(dma_info):
        if info is None:
            continue
        plan, nbytes = info
        hbm_bytes += nbytes
        for e, us in plan:
            key = (core_of[node], e)
            per_dma_engine[key] = per_dma_engine.get(key, 0.0) + us
    floors["dma"] = max(per_dma_engine.values(), default=0.0)
    hbm_rate = table.hbm_share_gbps * table.hbm_efficiency * 1000.0  # bytes per us
    if lnc > 1:
        hbm_rate *= table.hbm_cores_per_pool
    floors["hbm"] = hbm_bytes / hbm_rate
    return floors


def _common_subexpression(index, inst, engine, core, computed, tracker):
    """The earlier instruction that computed the same value as ``inst``, if the compiler
    would reuse its result instead (common-subexpression elimination after unrolling).

    Only ``tensor_tensor`` qualifies: its two operands are tiles and its op is recorded, so
    equal operand regions with equal writers mean an equal value (other opcodes take
    immediates the trace does not keep). The earlier result must still be unmodified.
    Evidence (I, read off the fused-Mamba tutorial's profiles, S11 fused_mamba.rst@81ce03ae):
    v3's (L846-854, mamba_v3.png) counts 39,695 Vector-engine events for 8,192 (channel
    tile, state, chunk) steps, fewer than the five Vector instructions per step its kernel
    issues; v2's (L724-732, mamba_v2.png) Vector engine is active 1.57 ms for 512 steps,
    3.07 us each, less than the 3.66 us the documented costs give for its five. The
    state-invariant ``delta·u`` is the repeated value; the compiler likewise dropped about
    half of v1's repeated loads of delta and u (L590: reloaded "around 7 times", not 16)."""
    if inst.opcode != "tensor_tensor" or len(inst.reads) != 2 or None in inst.reads:
        return None
    writes = {(w.memory, w.storage) for w in inst.writes}
    if any((r.memory, r.storage) in writes for r in inst.reads):
        return None  # in place: the value read is not the value written
    operands = tuple(
        (
            r.memory,
            r.storage,
            r.start,
            r.stop,
            r.partitions,
            tuple(sorted(set(tracker.writers_of(r, tracker._keys(r))))),
        )
        for r in inst.reads
    )
    key = (core, engine, inst.out_dtype, repr(inst.details.get("op")), operands)
    earlier = computed.get(key)
    if earlier is not None and all(
        set(tracker.writers_of(w, tracker._keys(w))) == {earlier[0]} for w in earlier[1]
    ):
        return earlier[0]
    computed[key] = (index, inst.writes)
    return None


# instructions that meet their twin on the other physical core of an LNC=2 launch
_CROSS_CORE = ("sendrecv", "core_barrier")


def trace_lnc(trace: Trace, table: CostTable) -> int:
    """The physical cores a trace ran on concurrently: its launch's LNC degree (``Trace.lnc``:
    2 for an ``nki`` 0.6 ``kernel[2]`` or a legacy grid with an ``nl.nc(2)`` dimension on
    trn2/trn3, each instruction's ``core`` saying where it runs); 1 for every other trace,
    whose SPMD instances the model runs one after another on one core."""
    lnc = int(getattr(trace, "lnc", 1) or 1)
    if lnc not in (1, 2) or (lnc == 2 and table.nc_version < 3):
        raise ValueError(
            f"trace.lnc={lnc}: LNC=2 exists only on trn2/trn3 (NeuronCore-v3+), "
            f"LNC=1 everywhere; the target is {table.target}"
        )
    return lnc


def _join_partners(partners, raw_preds, preds, sem):
    """Cross-core dependencies of LNC=2 rendezvous: the k-th ``sendrecv`` of a pipe on one
    core moves the other core's source, so it also waits for the writers of that source;
    the k-th ``core_barrier`` of each core waits for everything the other's waits for. The
    later core's arrival reaches the other through a semaphore (``semaphore_latency_us``)."""
    for members in partners.values():
        if len(members) != 2:
            raise ValueError(
                f"cost model: {len(members)} core(s) reached a cross-core rendezvous "
                f"(instruction {members[0]}); both cores of an LNC=2 launch must reach it"
            )
        a, b = members
        for mine, theirs in ((a, b), (b, a)):
            for p, lat in raw_preds[theirs].items():
                if p == mine:  # the later core's barrier already waits for the earlier one
                    continue
                hop = lat + sem
                if preds[mine].get(p, -1.0) < hop:
                    preds[mine][p] = hop


def _fp32_row_bytes(inst) -> int:
    """Bytes per partition of an instruction's result held as fp32 (as PSUM holds it)."""
    return 4 * max(1, inst.free_size)


def _operands(inst, psum_reads) -> Operands:
    """The streamed inputs (not per-partition scalars) and the output of an instruction."""
    dtypes, psum = [], []
    n = max(1, inst.free_size)
    if len(inst.reads) == len(inst.in_dtypes):
        for region, dtype, in_psum in zip(inst.reads, inst.in_dtypes, psum_reads):
            if n == 1 or region.stop - region.start >= n * _ITEMSIZE.get(dtype, 4):
                dtypes.append(dtype)
                psum.append(in_psum)
    else:  # an operand without a region (a constant): keep every dtype, memories as read
        dtypes.extend(inst.in_dtypes)
        psum.extend(psum_reads)
    out_psum = bool(inst.writes) and inst.writes[0].memory == "psum"
    if inst.out_dtype:
        dtypes.append(inst.out_dtype)
    return Operands(
        tuple(dtypes), tuple(psum), out_psum, int(inst.details.get("max_stride_bytes", 0))
    )


def _dma_plan(inst, table: CostTable):
    """(DMA engines used with their transfer time in us, bytes through HBM)."""
    chip = [r for r in inst.writes + inst.reads if r is not None and r.memory != "hbm"]
    if chip:
        p0, p1 = chip[0].partitions
    else:
        p0, p1 = 0, max(1, inst.partitions)
    count = max(1, p1 - p0)
    per_partition = inst.dma_bytes / count
    rows = inst.dma_bytes / inst.dma_row_bytes if inst.dma_row_bytes else 0
    rate = table.dma_engine_peak_gbps * table.dma_efficiency  # bytes per ns = GB/s
    group = int(table.dma_partitions_per_engine)
    engines = int(table.dma_engines)
    usage: dict[int, int] = {}
    for p in range(p0, p1):
        e = (p // group) % engines
        usage[e] = usage.get(e, 0) + 1
    plan = []
    for e, parts in usage.items():
        ns = max(per_partition * parts / rate, rows * parts / count * table.dma_descriptor_ns)
        plan.append((e, ns / 1000.0))
    hbm_bytes = inst.dma_bytes if "hbm" in inst.dma_direction else 0
    if inst.dma_direction == "hbm->hbm":
        hbm_bytes *= 2
    return plan, hbm_bytes


def _list_schedule(
    table,
    insts,
    res,
    dur,
    preds,
    ports,
    dma_info,
    total,
    window,
    unmodeled,
    dma_class,
    lnc,
    core_of,
):
    n = len(insts)
    n_compute = len(COMPUTE_ENGINES)
    per_core = n_compute + int(table.dma_queues)
    n_res = lnc * per_core
    succs: list[list] = [[] for _ in range(total)]
    npend = [0] * total
    for i in range(total):
        for p, lat in preds[i].items():
            succs[p].append((i, lat))
        npend[i] = len(preds[i])
    ready = [0.0] * total
    start = [0.0] * total
    end = [0.0] * total
    finish = [0.0] * total

    streams: list[list[int]] = [[] for _ in range(n_res)]
    for i in range(n):
        streams[res[i]].append(i)
    cursor = [0] * n_res
    windows: list[list[int]] = [[] for _ in range(n_res)]
    in_window = [False] * total
    free = [0.0] * n_res
    port_free = [0.0, 0.0] * lnc
    port_users = {}
    for c in range(lnc):
        port_users[2 * c] = (c * per_core + _DVE, c * per_core + _POOL)
        port_users[2 * c + 1] = (c * per_core + _DVE, c * per_core + _ACT)
    n_dma_engines = int(table.dma_engines)
    # per DMA engine (each core has its own 16): queue -> when its last transfer there ends
    queue_done_on: list[dict[int, float]] = [{} for _ in range(n_dma_engines * lnc)]
    # per DMA engine: when all the data given to it so far is moved at its rate, one
    # transfer after another (round robin moves an under-way transfer's end, which the
    # schedule has already handed to its consumers, no later: this keeps the total honest)
    engine_drained = [0.0] * (n_dma_engines * lnc)
    hbm_free = 0.0
    # one HBM pool per logical core: LNC=2 cores share their bank (hbm_cores_per_pool)
    hbm_rate = table.hbm_share_gbps * table.hbm_efficiency * 1000.0  # bytes per us
    if lnc > 1:
        hbm_rate *= table.hbm_cores_per_pool
    fixed = table.dma_fixed_us
    tail = max(0.0, table.dma_latency_us - fixed)
    version = [0] * n_res
    heap: list = []
    busy = [0.0] * n_res
    stall_us_of: list = [None] * total  # idle time of its engine/queue it waited for inputs
    dma_intervals: list[list[tuple[float, float]]] = [[] for _ in DMA_QUEUES]
    core_dma_intervals: list[list[tuple[float, float]]] = [[] for _ in range(lnc)]

    def refill(r):
        win, stream = windows[r], streams[r]
        while len(win) < window and cursor[r] < len(stream):
            j = stream[cursor[r]]
            cursor[r] += 1
            win.append(j)
            in_window[j] = True

    def push(r):
        best_i, best_t = -1, 0.0
        f = free[r]
        for j in windows[r]:
            if npend[j]:
                continue
            t = ready[j] if ready[j] > f else f
            for p in ports[j]:
                if port_free[p] > t:
                    t = port_free[p]
            if best_i < 0 or t < best_t:
                best_i, best_t = j, t
        version[r] += 1
        if best_i >= 0:
            heapq.heappush(heap, (best_t, best_i, r, version[r]))

    def release(node, dirty):
        stack = [node]
        while stack:
            j = stack.pop()
            for s, lat in succs[j]:
                t = finish[j] + lat
                if t > ready[s]:
                    ready[s] = t
                npend[s] -= 1
                if npend[s] == 0:
                    if res[s] == _BARRIER:
                        start[s] = end[s] = finish[s] = ready[s]
                        stack.append(s)
                    elif in_window[s]:
                        dirty.add(res[s])

    for r in range(n_res):
        refill(r)
        push(r)
    while heap:
        t, i, r, v = heapq.heappop(heap)
        if v != version[r]:
            continue
        if t > free[r] + 1e-9 and free[r] > 0.0:
            stall_us_of[i] = t - free[r]
        start[i] = t
        dirty = {r}
        if r % per_core >= n_compute:
            plan, hbm_bytes = dma_info[i]
            base = core_of[i] * n_dma_engines
            free[r] = t + fixed
            data_start = data_end = t + fixed
            first_byte = None
            for e, share in plan:
                done = queue_done_on[base + e]
                begin = done.get(r, 0.0)  # in order within its queue on this engine
                if begin < data_start:
                    begin = data_start
                # round robin between queues (S6 L29; v4 arbitrates by QoS class, which
                # is not modeled): each other queue with work pending on this engine
                # interleaves up to as much of it as this share
                interleaved = 0.0
                for q, until in done.items():
                    if q != r and until > begin:
                        turns = min(until - begin, share)
                        interleaved += turns
                        done[q] = until + turns  # its next transfer here starts later
                done[r] = begin + share + interleaved
                drained = engine_drained[base + e]
                engine_drained[base + e] = (drained if drained > begin else begin) + share
                if done[r] > data_end:
                    data_end = done[r]
                if first_byte is None or begin < first_byte:
                    first_byte = begin
            if first_byte is not None:
                data_start = first_byte
            if hbm_bytes:
                hbm_start = hbm_free if hbm_free > data_start else data_start
                hbm_free = hbm_start + hbm_bytes / hbm_rate
                if hbm_free > data_end:
                    data_end = hbm_free
            end[i] = data_end
            finish[i] = data_end + tail
            dma_intervals[dma_class[i]].append((t, data_end))
            core_dma_intervals[core_of[i]].append((t, data_end))
        else:
            end[i] = finish[i] = free[r] = t + dur[i]
            busy[r] += dur[i]
            for p in ports[i]:
                port_free[p] = end[i]
                dirty.update(port_users[p])
        windows[r].remove(i)
        in_window[i] = False
        refill(r)
        release(i, dirty)
        for d in dirty:
            push(d)

    if any(cursor[r] < len(streams[r]) or windows[r] for r in range(n_res)):
        raise RuntimeError("cost model: the schedule stopped with instructions left")
    # the kernel is done no earlier than every DMA engine has moved all its data
    latency = max(
        max(finish[:n], default=0.0), max(engine_drained, default=0.0) + tail if n else 0.0
    )
    core_busy = [
        {name: busy[c * per_core + k] for k, name in enumerate(COMPUTE_ENGINES)} for c in range(lnc)
    ]
    for c in range(lnc):
        core_busy[c]["dma"] = _union(core_dma_intervals[c])
    # the logical core's engine figures are those of its busiest physical core
    busy_us = {name: max(cb[name] for cb in core_busy) for name in COMPUTE_ENGINES}
    all_dma = []
    for k, name in enumerate(DMA_QUEUES):
        intervals = dma_intervals[k]
        busy_us[name] = _union(intervals)
        all_dma.extend(intervals)
    busy_us["dma"] = _union(all_dma)
    names = [
        RESOURCES[r % per_core] if 0 <= r % per_core < n_compute else DMA_QUEUES[dma_class[i]]
        for i, r in enumerate(res[:n])
    ]
    by_name = {name: [0, 0.0] for name in RESOURCES}
    for i in range(n):  # stalls of the DMA queues are reported per direction
        if stall_us_of[i] is not None:
            by_name[names[i]][0] += 1
            by_name[names[i]][1] += stall_us_of[i]
    return Schedule(
        target=table.target,
        latency_us=latency,
        resource=names,
        start_us=start[:n],
        end_us=end[:n],
        finish_us=finish[:n],
        busy_us=busy_us,
        stalls={k: v[0] for k, v in by_name.items()},
        stall_us={k: v[1] for k, v in by_name.items()},
        unmodeled=unmodeled,
        lnc=lnc,
        core=core_of[:n],
        core_busy_us=core_busy,
    )


def _union(intervals) -> float:
    """Total length of the union of (start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        elif e > cur_end:
            cur_end = e
    if cur_end is not None:
        total += cur_end - cur_start
    return total


__all__ = [
    "CONSTANTS",
    "COMPUTE_ENGINES",
    "DMA_QUEUES",
    "CostTable",
    "Schedule",
    "compute_cycles",
    "schedule",
]
