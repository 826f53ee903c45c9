"""The cost model (simulate.cost) and the profiler API (simulate.profile, nki.benchmark).

Most cases build small traces by hand, so each rule of the model is checked in isolation with
the expected time written out from the constants; a few run tiny kernels end to end.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import simulate as nki
import simulate.isa as nisa
import simulate.language as nl
from simulate.cost import CONSTANTS, CostTable, schedule
from simulate.errors import NKIError
from simulate.trace import Region, Trace

_storage = itertools.count(1_000_000)


def _const(name, target):
    return CostTable(target).values[name]


def _us(cycles, engine, target):
    return cycles / (_const(f"{engine}_clock_ghz", target) * 1000.0)


class TraceBuilder:
    """Hand-written traces: tiles are fresh storages, instructions default to fp32."""

    def __init__(self, target="trn1"):
        self.trace = Trace(target)

    @staticmethod
    def tile(nbytes=4096, partitions=128, memory="sbuf", storage=None, start=0):
        storage = next(_storage) if storage is None else storage
        return Region(memory, storage, start, start + nbytes, (0, partitions))

    def op(
        self,
        engine,
        opcode,
        n,
        reads=(),
        writes=(),
        dtype="float32",
        loops=(),
        partitions=128,
        out_dtype=None,
        **details,
    ):
        return self.trace.add(
            engine=engine,
            opcode=opcode,
            partitions=partitions,
            free_size=n,
            in_dtypes=(dtype,) * len(reads),
            out_dtype=out_dtype or dtype,
            reads=tuple(reads),
            writes=tuple(writes),
            loops=tuple(loops),
            details=details,
        )

    def dma(self, direction, nbytes, partitions, reads=(), writes=(), row_bytes=None, loops=()):
        return self.trace.add(
            engine="dma",
            opcode="load" if direction.startswith("hbm") else "store",
            partitions=partitions,
            free_size=nbytes // partitions,
            in_dtypes=("bfloat16",),
            out_dtype="bfloat16",
            reads=tuple(reads),
            writes=tuple(writes),
            loops=tuple(loops),
            dma_bytes=nbytes,
            dma_direction=direction,
            dma_row_bytes=row_bytes or nbytes // partitions,
        )

    def hbm(self, nbytes):
        return Region("hbm", next(_storage), 0, nbytes)

    def run(self, target=None, **kwargs):
        return schedule(self.trace, target, **kwargs)


def _duration(sched, index):
    return sched.end_us[index] - sched.start_us[index]


# --- engines, dependencies, scheduling ---------------------------------------------------------
def test_independent_instructions_on_different_engines_overlap():
    b = TraceBuilder()
    b.op("act", "activation", 4096, [b.tile()], [b.tile()], op="exp")
    b.op("dve", "tensor_scalar", 4096, [b.tile()], [b.tile()], op=["multiply"])
    sched = b.run()
    act, dve = _us(4096, "act", "trn1"), _us(4096, "dve", "trn1")
    assert sched.latency_us == pytest.approx(max(act, dve))
    assert sched.busy_us["act"] == pytest.approx(act)
    assert sched.busy_us["dve"] == pytest.approx(dve)


def test_read_after_write_across_engines_serialises_with_a_semaphore():
    b = TraceBuilder()
    produced = b.tile()
    b.op("dve", "tensor_scalar", 4096, [b.tile()], [produced], op=["multiply"])
    b.op("act", "activation", 4096, [produced], [b.tile()], op="exp")
    sched = b.run()
    expected = (
        _us(4096, "dve", "trn1") + _const("semaphore_latency_us", "trn1") + _us(4096, "act", "trn1")
    )
    assert sched.latency_us == pytest.approx(expected)
    assert sched.start_us[1] == pytest.approx(sched.end_us[0] + 0.1)


def test_partition_ranges_decide_whether_regions_overlap():
    b = TraceBuilder()
    shared = next(_storage)
    b.op(
        "dve",
        "tensor_scalar",
        4096,
        [b.tile()],
        [Region("sbuf", shared, 0, 4096, (0, 64))],
        op=["multiply"],
    )
    b.op(
        "act",
        "activation",
        4096,
        [Region("sbuf", shared, 0, 4096, (64, 128))],
        [b.tile()],
        op="exp",
    )
    assert b.run().start_us[1] == 0.0  # the other half of the partitions: no dependency


def test_min_ii_floors_small_instructions():
    b = TraceBuilder()
    b.op("dve", "tensor_scalar", 8, [b.tile(32)], [b.tile(32)], op=["add"])
    b.op("dve", "tensor_scalar", 640, [b.tile()], [b.tile()], op=["add"])
    sched = b.run()
    assert _duration(sched, 0) == pytest.approx(_us(64, "dve", "trn1"))
    assert _duration(sched, 1) == pytest.approx(_us(640, "dve", "trn1"))


def test_dependent_chain_costs_the_measured_initiation_interval():
    b = TraceBuilder()
    value = b.tile(4)
    for _ in range(10):
        nxt = b.tile(4)
        b.op("act", "activation", 1, [value], [nxt], op="copy")
        value = nxt
    sched = b.run()
    # the first instruction reads a tile no instruction wrote: the chain starts at the second
    interval = (sched.start_us[9] - sched.start_us[1]) / 8
    assert interval == pytest.approx(_us(264, "act", "trn1"))  # 189 ns (S4 L424-429)
    static = _const("dependent_overhead_cycles", "trn1")  # D S1 L403: the engine is busy
    assert _duration(sched, 1) == pytest.approx(_us(64 + static, "act", "trn1"))
    assert _duration(sched, 0) == pytest.approx(_us(64, "act", "trn1"))


def test_list_scheduling_fills_a_dependency_bubble_with_independent_work():
    b = TraceBuilder()
    produced = b.tile()
    b.op("dve", "tensor_scalar", 1024, [b.tile()], [produced], op=["multiply"])
    b.op("dve", "tensor_scalar", 1024, [produced], [b.tile()], op=["add"])
    b.op("dve", "tensor_scalar", 1024, [b.tile()], [b.tile()], op=["add"])
    in_order = b.run(overrides={"schedule_window": 1})
    listed = b.run()
    # the consumer reads the output of the instruction before it (program order): it pays
    # the static overhead of a dependent instruction either way (S1 L403), and in order it
    # also waits for the producer's pipeline to drain
    work = 3 * _us(1024, "dve", "trn1") + _us(
        _const("dependent_overhead_cycles", "trn1"), "dve", "trn1"
    )
    drain = _us(_const("dependent_latency_cycles", "trn1"), "dve", "trn1")
    assert in_order.latency_us == pytest.approx(work + drain)
    assert listed.latency_us == pytest.approx(work)
    assert listed.start_us[2] < listed.start_us[1]  # the independent one ran in the gap


def test_a_repeated_tensor_tensor_on_the_same_operands_is_elided():
    b = TraceBuilder()
    x, y, first, again = b.tile(), b.tile(), b.tile(), b.tile()
    b.op("dve", "tensor_tensor", 1024, [x, y], [first], op="multiply")
    b.op("dve", "tensor_tensor", 1024, [x, y], [again], op="multiply")  # same value
    b.op("act", "activation", 1024, [again], [b.tile()], op="exp")
    sched = b.run()
    assert _duration(sched, 1) == 0.0  # the compiler reuses the first result
    assert sched.busy_us["dve"] == pytest.approx(_us(2 * 1024, "dve", "trn1"))
    assert sched.start_us[2] >= sched.end_us[0]  # its reader waits for the first one


@pytest.mark.parametrize(
    "change", ["other op", "operand rewritten", "in place", "result overwritten"]
)
def test_tensor_tensor_is_recomputed_when_the_value_may_differ(change):
    b = TraceBuilder()
    x, y, first = b.tile(), b.tile(), b.tile()
    b.op("dve", "tensor_tensor", 1024, [x, y], [first], op="multiply")
    if change == "operand rewritten":
        b.op("act", "activation", 1024, [b.tile()], [y], op="exp")
    if change == "result overwritten":
        b.op("act", "activation", 1024, [b.tile()], [first], op="exp")
    out = x if change == "in place" else b.tile()
    b.op(
        "dve",
        "tensor_tensor",
        1024,
        [x, y],
        [out],
        op="add" if change == "other op" else "multiply",
    )
    sched = b.run()
    assert _duration(sched, len(b.trace) - 1) >= _us(2 * 1024, "dve", "trn1")


def test_nc_v2_shares_the_sbuf_port_between_vector_and_gpsimd():
    results = {}
    for target in ("trn1", "trn2"):
        b = TraceBuilder(target)
        b.op("dve", "tensor_scalar", 2048, [b.tile()], [b.tile()], op=["add"])
        b.op("pool", "iota", 2048, [], [b.tile()], dtype="int32")
        results[target] = b.run()
    dve, pool = _us(2048, "dve", "trn1"), _us(150 + 2048, "pool", "trn1")
    assert results["trn1"].latency_us == pytest.approx(dve + pool)
    assert results["trn2"].latency_us == pytest.approx(
        max(_us(2048, "dve", "trn2"), _us(150 + 2048, "pool", "trn2"))
    )


def test_gpsimd_rsqrt_runs_at_a_quarter_of_the_scalar_engine_rate():
    """GpSimd's ``tensor_scalar(op0=nl.rsqrt)``: "4x lower [throughput] than Scalar Engine"
    (nki/api/nki.api.shared.rst@81ce03ae L260-262): 4·N Pool cycles, at least MIN_II; a
    documented rule, so not reported as unmodeled."""
    b = TraceBuilder("trn2")
    b.op("pool", "tensor_scalar", 1000, [b.tile()], [b.tile()], op=["rsqrt"])
    b.op("pool", "tensor_scalar", 8, [b.tile()], [b.tile()], op=["rsqrt"])
    sched = b.run()
    assert _duration(sched, 0) == pytest.approx(_us(4 * 1000, "pool", "trn2"))
    assert _duration(sched, 1) == pytest.approx(_us(64, "pool", "trn2"))
    assert "pool.tensor_scalar" not in sched.unmodeled


def test_address_tracking_turns_buffer_reuse_into_a_wait():
    b = TraceBuilder()
    old = b.tile(storage=next(_storage), start=8192)
    new = b.tile(storage=next(_storage), start=8192)  # a later tile at the same address
    b.op("act", "activation", 4096, [old], [b.tile()], op="exp")
    b.op("dve", "tensor_scalar", 512, [b.tile()], [new], op=["add"])
    by_tile, by_address = b.run(), b.run(by_address=True)
    assert by_tile.start_us[1] == 0.0
    assert by_address.start_us[1] == pytest.approx(
        _us(4096, "act", "trn1") + _const("semaphore_latency_us", "trn1")
    )


def test_sequential_range_iterations_do_not_overlap_affine_ones_do():
    def build(kind, iterations):
        b = TraceBuilder("trn2")
        source, dest = b.hbm(1 << 20), b.hbm(1 << 20)
        for i in range(iterations):
            loops = [(7, kind, i)]
            x, y = b.tile(8192), b.tile(8192)
            b.dma("hbm->sbuf", 1 << 20, 128, [source], [x], loops=loops)
            b.op("act", "activation", 4096, [x], [y], dtype="bfloat16", loops=loops, op="exp")
            b.dma("sbuf->hbm", 1 << 20, 128, [y], [dest], loops=loops)
        return b.run().latency_us

    one = build("sequential_range", 1)
    assert build("sequential_range", 4) == pytest.approx(4 * one)
    assert build("affine_range", 4) < 0.75 * 4 * one


def test_spmd_program_instances_run_one_after_another():
    b = TraceBuilder()
    for program, engine, opcode in (((0,), "act", "activation"), ((1,), "dve", "tensor_copy")):
        b.trace.add(
            engine=engine,
            opcode=opcode,
            partitions=128,
            free_size=1024,
            in_dtypes=("float32",),
            out_dtype="float32",
            reads=(b.tile(),),
            writes=(b.tile(),),
            loops=(),
            program=program,
            details={},
        )
    sched = b.run()  # independent work on two engines, yet the second instance waits
    assert sched.start_us[1] == pytest.approx(sched.end_us[0])
    assert sched.latency_us == pytest.approx(_us(1024, "act", "trn1") + _us(1024, "dve", "trn1"))


def test_accumulating_matmuls_chain_without_waiting():
    b = TraceBuilder()
    psum = b.tile(2048, memory="psum")
    for _ in range(8):
        b.op(
            "pe",
            "nc_matmul",
            512,
            [b.tile(256), b.tile(1024)],
            [psum],
            dtype="bfloat16",
            stationary_free=128,
            accumulate=True,
        )
    assert b.run().latency_us == pytest.approx(8 * _us(512, "pe", "trn1"))


def test_fp32_matmul_takes_four_times_as_long():
    times = {}
    for fp32 in (False, True):
        b = TraceBuilder()
        b.op(
            "pe",
            "nc_matmul",
            512,
            [b.tile(256), b.tile(1024)],
            [b.tile(2048, memory="psum")],
            stationary_free=128,
            fp32=fp32,
        )
        times[fp32] = b.run().latency_us
    assert times[False] == pytest.approx(_us(512, "pe", "trn1"))
    assert times[True] == pytest.approx(4 * times[False])


def test_matmul_with_a_narrow_stationary_and_short_moving_pays_the_floor():
    b = TraceBuilder()
    b.op(
        "pe",
        "nc_matmul",
        16,
        [b.tile(256), b.tile(32)],
        [b.tile(64, memory="psum")],
        dtype="bfloat16",
        stationary_free=128,
    )
    b.op(
        "pe",
        "nc_matmul",
        16,
        [b.tile(64), b.tile(32)],
        [b.tile(64, memory="psum")],
        dtype="bfloat16",
        stationary_free=32,
    )
    sched = b.run()
    assert _duration(sched, 0) == pytest.approx(_us(64, "pe", "trn1"))
    assert _duration(sched, 1) == pytest.approx(_us(32, "pe", "trn1"))


# --- dtype rules and per-target differences ----------------------------------------------------
@pytest.mark.parametrize(
    ("target", "dtype", "stride", "cycles"),
    [
        ("trn1", "bfloat16", 2, 4096),  # NC-v2: no fast mode
        ("trn2", "bfloat16", 2, 1024),  # NC-v3: 4x for bf16 SBUF unit stride
        ("trn3", "bfloat16", 2, 1024),
        ("trn2", "float32", 4, 4096),  # fp32: no fast mode
        ("trn2", "bfloat16", 4, 2048),  # not unit stride: 2x
        ("trn2", "bfloat16", 32, 4096),  # 2x mode, halved by the > 16 B stride
        ("trn1", "float32", 32, 8192),  # stride penalty alone
    ],
)
def test_vector_copy_fast_modes(target, dtype, stride, cycles):
    b = TraceBuilder(target)
    b.op(
        "dve",
        "tensor_copy",
        4096,
        [b.tile(8192)],
        [b.tile(8192)],
        dtype=dtype,
        max_stride_bytes=stride,
    )
    assert b.run().latency_us == pytest.approx(_us(cycles, "dve", target))


@pytest.mark.parametrize(
    ("target", "dtype", "in_psum", "cycles"),
    [
        ("trn1", "float32", False, 2 * 2048),  # two SBUF inputs: 2N
        ("trn1", "bfloat16", False, 2048),  # NC-v2 bf16 add with unit stride: N
        ("trn1", "float32", True, 2048),  # one input in PSUM: N
        ("trn2", "bfloat16", False, 2048),  # NC-v3 all-bf16: 2x over 2N
        ("trn2", "float32", False, 2 * 2048),
    ],
)
def test_tensor_tensor_rules(target, dtype, in_psum, cycles):
    b = TraceBuilder(target)
    other = b.tile(8192, memory="psum" if in_psum else "sbuf")
    b.op(
        "dve",
        "tensor_tensor",
        2048,
        [b.tile(8192), other],
        [b.tile(8192)],
        dtype=dtype,
        op="add",
        max_stride_bytes=2 if dtype == "bfloat16" else 4,
    )
    assert b.run().latency_us == pytest.approx(_us(cycles, "dve", target))


@pytest.mark.parametrize(
    ("n", "engine", "reader_cycles"),
    [
        (512, "pe", 512),  # 2 KiB of fp32 per partition: one PSUM bank, read from PSUM (N)
        (2048, "dve", 2 * 2048),  # 8 KiB: copied out to SBUF, read from there (2N)
    ],
)
def test_partition_broadcast_is_a_psum_operand_only_when_it_fits_a_bank(n, engine, reader_cycles):
    b = TraceBuilder("trn1")
    row = b.tile(4 * n, partitions=1)
    wide = b.tile(4 * n)
    b.op("dve", "partition_broadcast", n, [row], [wide])
    b.op(
        "dve",
        "tensor_tensor",
        n,
        [b.tile(4 * n), wide],
        [b.tile(4 * n)],
        op="multiply",
        max_stride_bytes=4,
    )
    sched = b.run()
    assert sched.resource[0] == engine
    # a reader of the instruction before it on the Vector engine pays the dependent overhead
    static = _const("dependent_overhead_cycles", "trn1") if engine == "dve" else 0
    assert _duration(sched, 1) == pytest.approx(_us(reader_cycles + static, "dve", "trn1"))
    if engine == "dve":  # the copy out of PSUM: one PSUM input, N cycles
        assert _duration(sched, 0) == pytest.approx(_us(n, "dve", "trn1"))


@pytest.mark.parametrize(
    ("target", "dtype", "value", "cycles"),
    [
        ("trn1", "bfloat16", 0.0, 2048),  # NC-v2: zero fill of bf16 at N/2
        ("trn1", "bfloat16", 1.0, 4096),
        ("trn1", "float32", 0.0, 4096),
        ("trn2", "bfloat16", 0.0, 1024),  # NC-v3: the bf16 fast mode
    ],
)
def test_memset_rules(target, dtype, value, cycles):
    b = TraceBuilder(target)
    b.op("dve", "memset", 4096, [], [b.tile(8192)], dtype=dtype, value=value)
    assert b.run().latency_us == pytest.approx(_us(cycles, "dve", target))


@pytest.mark.parametrize(
    ("opcode", "dtype", "op", "cycles"),
    [
        ("tensor_tensor_scan", "float32", None, 2 * 1024),
        ("tensor_reduce", "bfloat16", "add", 512),
        ("tensor_reduce", "float32", "add", 1024),
        ("reciprocal", "float32", None, 8 * 1024),
        ("bn_aggr", "float32", None, 13 * 1024 / 3),
        ("tensor_scalar_reduce", "float32", "add", 1024 + 64),
    ],
)
def test_vector_instruction_rules(opcode, dtype, op, cycles):
    b = TraceBuilder("trn1")
    b.op("dve", opcode, 1024, [b.tile(4096)], [b.tile(4096)], dtype=dtype, op=op)
    assert b.run().latency_us == pytest.approx(_us(cycles, "dve", "trn1"))


@pytest.mark.parametrize(
    ("dtype", "out_dtype", "ops", "n", "cycles"),
    [
        ("bfloat16", "bfloat16", ("subtract", "multiply"), 2048, 2048),
        ("bfloat16", "float32", ("subtract", "multiply"), 2048, 2048),  # output not a condition
        ("float16", "float16", ("subtract", "multiply"), 2048, 2 * 2048),  # bfloat16 only
        ("bfloat16", "bfloat16", ("add", "multiply"), 2048, 2 * 2048),
        ("bfloat16", "bfloat16", ("subtract", "multiply"), 2047, 2 * 2047),  # N even only
    ],
)
def test_scalar_tensor_tensor_fast_mode_follows_the_documented_condition(
    dtype, out_dtype, ops, n, cycles
):
    """legacy isa@8a38e733 L1218-1226: N cycles when data and operand1 are bfloat16,
    op0 subtract, op1 multiply and N even; 2N otherwise."""
    b = TraceBuilder("trn2")
    b.op(
        "dve",
        "scalar_tensor_tensor",
        n,
        [b.tile(2 * n), b.tile(2 * n)],
        [b.tile(4 * n)],
        dtype=dtype,
        out_dtype=out_dtype,
        op=ops,
        max_stride_bytes=2,
    )
    assert b.run().latency_us == pytest.approx(_us(cycles, "dve", "trn2"))


@pytest.mark.parametrize("opcode", ["select", "tensor_copy_predicated"])  # legacy, 0.6
@pytest.mark.parametrize(("predicate_memory", "cycles"), [("sbuf", 2 * 1024), ("psum", 1024)])
def test_tensor_copy_predicated_follows_the_documented_rule(opcode, predicate_memory, cycles):
    """legacy isa@8a38e733 L1513-1526: N with src or predicate in PSUM, 2N both in SBUF."""
    b = TraceBuilder("trn2")
    predicate = b.tile(4096, memory=predicate_memory)
    b.op(
        "dve",
        opcode,
        1024,
        [predicate, b.tile(4096), b.tile(4096)],
        [b.tile(4096)],
        max_stride_bytes=4,
    )
    sched = b.run()
    assert sched.unmodeled == {}
    assert sched.latency_us == pytest.approx(_us(cycles, "dve", "trn2"))


def test_opcodes_without_a_documented_rule_are_listed():
    b = TraceBuilder("trn1")
    b.op("pool", "gather_flattened", 1024, [b.tile()], [b.tile()])
    sched = b.run()
    assert sched.unmodeled == {"pool.gather_flattened": 1}
    assert sched.latency_us == pytest.approx(_us(1024, "pool", "trn1"))


def test_act_copy_fast_mode_only_on_trn3():
    for target, speed in (("trn2", 1), ("trn3", 2)):
        b = TraceBuilder(target)
        b.op(
            "act",
            "tensor_copy",
            4096,
            [b.tile(8192)],
            [b.tile(8192)],
            dtype="bfloat16",
            max_stride_bytes=2,
        )
        assert b.run().latency_us == pytest.approx(_us(4096 / speed, "act", target))


def test_per_partition_scalar_operands_do_not_disable_fast_modes():
    b = TraceBuilder("trn2")
    data, scale = b.tile(8192), b.tile(4)
    b.trace.add(
        engine="dve",
        opcode="tensor_scalar",
        partitions=128,
        free_size=4096,
        in_dtypes=("bfloat16", "float32"),
        out_dtype="bfloat16",
        reads=(data, scale),
        writes=(b.tile(8192),),
        loops=(),
        details={"op": ["multiply"], "max_stride_bytes": 2},
    )
    assert b.run().latency_us == pytest.approx(_us(1024, "dve", "trn2"))


def test_every_constant_has_a_value_per_generation_and_overrides_are_checked():
    assert all(len(row) == 3 for row in CONSTANTS.values())
    assert CostTable("inf2").dve_clock_ghz == CostTable("trn1").dve_clock_ghz == 1.12
    assert CostTable("trn2", {"dma_fixed_us": 2.0}).dma_fixed_us == 2.0
    with pytest.raises(KeyError, match="dma_fixed_seconds"):
        CostTable("trn2", {"dma_fixed_seconds": 2.0})
    with pytest.raises(NKIError, match="unknown platform target"):
        CostTable("trn9")


# --- DMA ---------------------------------------------------------------------------------------
def test_small_transfers_are_bound_by_the_fixed_cost_per_dma():
    b = TraceBuilder("trn2")
    source = b.hbm(1 << 20)
    for _ in range(6):  # 256 B per partition: far below the knee
        b.dma("hbm->sbuf", 128 * 256, 128, [source], [b.tile(256)])
    sched = b.run()
    fixed = _const("dma_fixed_us", "trn2")
    assert np.diff(sched.start_us) == pytest.approx([fixed] * 5)
    per_engine = max(8 * 256 / 23.12, 8 * _const("dma_descriptor_ns", "trn2")) / 1000
    through_hbm = 128 * 256 / _hbm_gbps("trn2") / 1000  # the HBM share binds on trn2
    data = max(per_engine, through_hbm)
    assert sched.latency_us == pytest.approx(5 * fixed + _const("dma_latency_us", "trn2") + data)


def _hbm_gbps(target):
    return _const("hbm_share_gbps", target) * _const("hbm_efficiency", target)


def test_transfers_of_one_tensor_queue_up_and_different_tensors_overlap():
    b = TraceBuilder("trn1")
    first, second = b.hbm(1 << 20), b.hbm(1 << 20)
    for source in (first, first, second):  # small: each bound by the fixed cost
        b.dma("hbm->sbuf", 128 * 256, 128, [source], [b.tile(256)])
    sched = b.run()
    fixed = _const("dma_fixed_us", "trn1")
    assert fixed == 1.3  # no hardware DGE on NeuronCore-v2: S5's ~1300 ns per transfer
    assert sched.start_us == pytest.approx([0.0, fixed, 0.0])


def test_dma_engines_serve_their_queues_round_robin():
    # 4 partitions: one DMA engine. A long load on one queue (tensor), then a short one on
    # another: the short one interleaves with the long one instead of waiting behind it
    # (S6 nki-dma-overview.rst L29); a second short one on the same queue as the first
    # short one runs after it, in order.
    b = TraceBuilder("trn1")
    big, small = b.hbm(1 << 22), b.hbm(1 << 20)
    b.dma("hbm->sbuf", 4 * 65536, 4, [big], [b.tile(65536, partitions=4)])
    b.dma("hbm->sbuf", 4 * 2048, 4, [small], [b.tile(2048, partitions=4)])
    b.dma("hbm->sbuf", 4 * 2048, 4, [small], [b.tile(2048, partitions=4)])
    sched = b.run()
    rate = _const("dma_engine_peak_gbps", "trn1") * _const("dma_efficiency", "trn1") * 1000
    fixed = _const("dma_fixed_us", "trn1")
    long_share, short_share = 4 * 65536 / rate, 4 * 2048 / rate
    assert sched.end_us[0] == pytest.approx(fixed + long_share)
    assert sched.end_us[1] == pytest.approx(fixed + 2 * short_share)  # one turn each
    assert sched.end_us[2] == pytest.approx(2 * fixed + 2 * short_share)  # its queue's next
    assert sched.end_us[1] < sched.end_us[0]


def test_a_short_transfer_interleaved_last_does_not_end_the_kernel_early():
    # One DMA engine, a long load and a short one on another queue, nothing after: the
    # short one ends early (round robin) and the long one keeps its end, but the kernel is
    # not done before the engine has moved both, so the DMA floor stays a lower bound.
    from simulate.cost import engine_floors

    b = TraceBuilder("trn2")
    b.dma("hbm->sbuf", 4 * 65536, 4, [b.hbm(1 << 22)], [b.tile(65536, partitions=4)])
    b.dma("hbm->sbuf", 4 * 16384, 4, [b.hbm(1 << 20)], [b.tile(16384, partitions=4)])
    sched = b.run()
    rate = _const("dma_engine_peak_gbps", "trn2") * _const("dma_efficiency", "trn2") * 1000
    fixed, latency = _const("dma_fixed_us", "trn2"), _const("dma_latency_us", "trn2")
    long_share, short_share = 4 * 65536 / rate, 4 * 16384 / rate
    assert sched.end_us[1] == pytest.approx(fixed + 2 * short_share)
    assert sched.end_us[0] == pytest.approx(fixed + long_share)
    assert sched.latency_us == pytest.approx(latency + long_share + short_share)
    assert max(engine_floors(sched).values()) <= sched.latency_us


def _copy_trace(target, blocks, bytes_per_partition):
    """A copy through SBUF: ``blocks`` loads of [128, bytes_per_partition] from one HBM
    tensor, each stored into another (loads and stores on two queues, the same engines)."""
    b = TraceBuilder(target)
    source, sink = b.hbm(1 << 26), b.hbm(1 << 26)
    nbytes = 128 * bytes_per_partition
    for k in range(blocks):
        tile = b.tile(bytes_per_partition)
        b.dma(
            "hbm->sbuf",
            nbytes,
            128,
            [Region("hbm", source.storage, k * nbytes, (k + 1) * nbytes)],
            [tile],
        )
        b.dma(
            "sbuf->hbm",
            nbytes,
            128,
            [tile],
            [Region("hbm", sink.storage, k * nbytes, (k + 1) * nbytes)],
        )
    return b


def test_round_robin_never_moves_more_than_the_dma_engines_rate():
    sched = _copy_trace("trn1", 16, 4096).run()
    moved = 2 * 16 * 128 * 4096 / (max(sched.end_us) - _const("dma_fixed_us", "trn1")) / 1000
    engines = 16 * _const("dma_engine_peak_gbps", "trn1") * _const("dma_efficiency", "trn1")
    assert moved <= engines * 1.001  # GB/s
    assert moved > 0.9 * engines


def test_hbm_efficiency_caps_a_copy_below_the_pin_rate():
    sched = _copy_trace("trn2", 8, 32768).run()
    nbytes = 128 * 32768
    achieved = 2 * 8 * nbytes / (sched.end_us[-1] - sched.start_us[0]) / 1000  # GB/s
    assert achieved <= _hbm_gbps("trn2") * 1.001
    assert achieved > 0.9 * _hbm_gbps("trn2")
    assert _hbm_gbps("trn2") < 0.9 * 362.5


def test_disjoint_stores_into_one_hbm_tensor_do_not_wait_for_each_other():
    b = TraceBuilder("trn2")
    out = b.hbm(1 << 22)
    # two stores of interleaved rows (even / odd column halves): the byte intervals overlap,
    # the bytes do not; only their DMA engines order them
    for half in range(2):
        b.dma(
            "sbuf->hbm",
            128 * 8192,
            128,
            [b.tile(8192)],
            [Region("hbm", out.storage, half * 8192, (1 << 22) - 8192 * (1 - half))],
        )
    sched = b.run()
    assert sched.start_us[1] == pytest.approx(sched.start_us[0] + _const("dma_fixed_us", "trn2"))


def test_large_transfers_are_bound_by_bandwidth():
    b = TraceBuilder("trn2")
    source = b.hbm(1 << 24)
    nbytes = 128 * 16384
    for _ in range(4):
        b.dma("hbm->sbuf", nbytes, 128, [source], [b.tile(16384)])
    sched = b.run()
    engines = 16 * 27.2 * 0.85  # GB/s = bytes per ns
    per_transfer = nbytes / min(engines, _hbm_gbps("trn2")) / 1000.0  # HBM binds on trn2
    assert np.diff(sched.end_us) == pytest.approx([per_transfer] * 3)


def test_few_partitions_use_few_dma_engines():
    b = TraceBuilder("trn2")
    b.dma("hbm->sbuf", 32768, 4, [b.hbm(32768)], [b.tile(8192, partitions=4)])
    sched = b.run()
    data = _duration(sched, 0) - _const("dma_fixed_us", "trn2")
    assert data == pytest.approx(32768 / 23.12 / 1000)  # one engine: the S6 1,416 ns


def test_short_rows_are_bound_by_descriptors():
    b = TraceBuilder("trn2")
    b.dma("hbm->sbuf", 128 * 512, 128, [b.hbm(1 << 20)], [b.tile(512)], row_bytes=16)
    sched = b.run()
    rows_per_engine = 8 * 512 // 16
    expected = rows_per_engine * _const("dma_descriptor_ns", "trn2") / 1000
    assert _duration(sched, 0) - _const("dma_fixed_us", "trn2") == pytest.approx(expected)


def test_compute_waits_for_the_dma_completion():
    b = TraceBuilder("trn1")
    tile = b.tile(4096)
    b.dma("hbm->sbuf", 128 * 4096, 128, [b.hbm(1 << 20)], [tile])
    b.op("act", "activation", 2048, [tile], [b.tile(4096)], dtype="bfloat16", op="exp")
    sched = b.run()
    assert sched.start_us[1] == pytest.approx(sched.finish_us[0])
    assert sched.finish_us[0] == pytest.approx(
        _const("dma_latency_us", "trn1") + 128 * 4096 / (16 * 17.5) / 1000
    )


# --- kernels through the profiler ----------------------------------------------------------------
@nki.jit
def exp_tiles(x, sequential: bool = False):
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    loop = nl.sequential_range if sequential else nl.affine_range
    for i in loop(x.shape[0] // P):
        tile = nl.load(x[i * P : (i + 1) * P, :])
        nl.store(out[i * P : (i + 1) * P, :], value=nisa.activation(op=nl.exp, data=tile))
    return out


def test_profile_returns_outputs_and_the_documented_fields():
    x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
    out, prof = nki.profile(exp_tiles, x, target="trn1")
    np.testing.assert_allclose(out, np.exp(x.astype(np.float64)), rtol=1e-6)
    assert prof.target == "trn1"
    assert prof.instructions == {"pe": 0, "act": 2, "dve": 0, "pool": 0, "dma": 4}
    assert prof.hbm_read_bytes == prof.hbm_write_bytes == x.nbytes
    assert prof.engine_busy_us["act"] == pytest.approx(2 * _us(512, "act", "trn1"))
    assert prof.sbuf_peak_bytes_per_partition >= 2 * 512 * 4
    assert prof.psum_peak_bytes_per_partition == 0
    assert prof.busiest_engine == "dma"
    assert 0 < prof.engine_utilization["act"] < 1
    assert prof.latency_us > prof.engine_busy_us["act"]
    assert prof.mbu == pytest.approx(
        2 * x.nbytes / prof.latency_us / 1000 / _const("hbm_share_gbps", "trn1")
    )
    assert prof.dma_transfers == 4 and prof.dma_small_transfers == 0
    text = prof.summary()
    for word in ("latency", "pe", "act", "dve", "pool", "dma", "HBM read", "SBUF peak"):
        assert word in text


def test_profile_sequential_loop_is_slower_than_affine():
    x = np.random.default_rng(1).standard_normal((512, 1024)).astype(np.float32)
    _, affine = nki.profile(exp_tiles, x, target="trn2")
    out, sequential = nki.profile(exp_tiles, x, True, target="trn2")
    np.testing.assert_allclose(out, np.exp(x.astype(np.float64)), rtol=1e-6)
    assert sequential.latency_us > 1.5 * affine.latency_us
    assert sequential.dependency_stalls["dma_load"] > affine.dependency_stalls["dma_load"]


def test_profile_targets_give_different_latencies():
    x = np.random.default_rng(2).standard_normal((256, 2048)).astype(np.float32)
    latencies = {
        t: nki.profile(exp_tiles, x, target=t)[1].latency_us
        for t in ("inf2", "trn1", "trn2", "trn3")
    }
    assert latencies["inf2"] == latencies["trn1"]
    assert len({latencies["trn1"], latencies["trn2"], latencies["trn3"]}) == 3


def test_profile_of_a_failing_kernel_raises_the_simulator_error():
    @nki.jit
    def too_many_partitions(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(x))
        return out

    with pytest.raises(NKIError, match="128"):
        nki.profile(too_many_partitions, np.ones((256, 4), np.float32) * 2.5, target="trn2")


def test_benchmark_reports_the_modeled_latency_at_every_percentile():
    x = np.random.default_rng(3).standard_normal((128, 1024)).astype(np.float32)
    bench = nki.benchmark(exp_tiles)
    out = bench(x)
    np.testing.assert_allclose(out, np.exp(x.astype(np.float64)), rtol=1e-6)
    latency = bench.benchmark_result.nc_latency
    expected = nki.profile(exp_tiles, x, target="trn1")[1].latency_us
    for p in (0, 1, 10, 25, 50, 90, 99, 100):
        assert latency.get_latency_percentile(p) == pytest.approx(expected)
    # the device's launch cost is reported beside the kernel's latency, not inside it
    assert bench.benchmark_result.launch_overhead_us == _const("kernel_launch_us", "trn1") > 0
    assert "kernel launch" in bench.benchmark_result.profile.summary()
    with pytest.raises(ValueError, match="percentile"):
        latency.get_latency_percentile(75)


# --- LNC=2: two physical cores ----------------------------------------------------------------
def _core_copies(b, nbytes_per_partition, partitions, program, transfers=4, pipe=None):
    """``transfers`` loads then stores of ``program``'s own tensors (fresh HBM storages)."""
    source, target = b.hbm(1 << 26), b.hbm(1 << 26)
    nbytes = partitions * nbytes_per_partition
    for k in range(transfers):
        tile = b.tile(nbytes_per_partition, partitions=partitions)
        b.dma(
            "hbm->sbuf",
            nbytes,
            partitions,
            [Region("hbm", source.storage, k * nbytes, (k + 1) * nbytes)],
            [tile],
        )
        b.trace.instructions[-1].program, b.trace.instructions[-1].core = program, program[0]
        b.dma(
            "sbuf->hbm",
            nbytes,
            partitions,
            [tile],
            [Region("hbm", target.storage, k * nbytes, (k + 1) * nbytes)],
        )
        b.trace.instructions[-1].program, b.trace.instructions[-1].core = program, program[0]


def _two_core_copy(lnc, per_partition=32768, partitions=128, **overrides):
    b = TraceBuilder("trn2")
    for program in ((0,), (1,)):
        _core_copies(b, per_partition, partitions, program)
    b.trace.lnc = lnc
    return b.run(overrides=overrides or None)


def test_lnc2_runs_two_dma_bound_programs_concurrently():
    # 8 partitions: one DMA engine per core (23 GB/s), far below the HBM share
    serial, concurrent = (_two_core_copy(lnc, partitions=8) for lnc in (1, 2))
    assert concurrent.lnc == 2 and serial.lnc == 1
    assert concurrent.latency_us == pytest.approx(serial.latency_us / 2, rel=1e-6)
    assert [c["dma"] for c in concurrent.core_busy_us] == pytest.approx(
        [concurrent.core_busy_us[0]["dma"]] * 2
    )
    assert set(concurrent.core) == {0, 1} and set(serial.core) == {0}


def test_lnc2_shares_one_hbm_pool_between_the_cores():
    # DMA engines made fast so that HBM binds: two cores move twice the bytes only because
    # their logical core's pool is two physical shares (one HBM bank); a pool of one share
    # gives no speed-up at all
    fast = {"dma_engine_peak_gbps": 1000.0}
    serial = _two_core_copy(1, **fast)
    shared = _two_core_copy(2, **fast)
    one_share = _two_core_copy(2, hbm_cores_per_pool=1, **fast)
    moved = 2 * 2 * 4 * 128 * 32768  # bytes: both cores, load + store, 4 transfers
    pool = 2 * _hbm_gbps("trn2")  # GB/s of the logical core
    assert moved / (shared.latency_us * 1000) <= pool * 1.001
    assert moved / (shared.latency_us * 1000) > 0.9 * pool
    assert shared.latency_us == pytest.approx(serial.latency_us / 2, rel=0.05)
    assert one_share.latency_us == pytest.approx(serial.latency_us, rel=0.02)
    assert _const("hbm_cores_per_pool", "trn2") == 2


def test_lnc2_needs_a_neuroncore_v3():
    b = TraceBuilder("trn1")
    _core_copies(b, 4096, 128, (0,), transfers=1)
    b.trace.lnc = 2
    with pytest.raises(ValueError, match="LNC=2 exists only on trn2/trn3"):
        b.run()


def test_shared_hbm_dependency_between_the_cores_serialises_them():
    b = TraceBuilder("trn2")
    shared = b.hbm(128 * 32768)
    tile0, tile1 = b.tile(32768), b.tile(32768)
    b.dma("hbm->sbuf", 128 * 32768, 128, [b.hbm(128 * 32768)], [tile0])
    b.dma("sbuf->hbm", 128 * 32768, 128, [tile0], [shared])
    b.dma("hbm->sbuf", 128 * 32768, 128, [shared], [tile1])  # core 1 reads core 0's output
    for index, program in enumerate(((0,), (0,), (1,))):
        b.trace.instructions[index].program = program
        b.trace.instructions[index].core = program[0]
    b.trace.lnc = 2
    sched = b.run()
    assert sched.core == [0, 0, 1]
    assert sched.start_us[2] == pytest.approx(sched.finish_us[1])


def _activation(b, n, program, reads, writes):
    b.trace.add(
        engine="act",
        opcode="activation",
        partitions=128,
        free_size=n,
        in_dtypes=("float32",),
        out_dtype="float32",
        reads=tuple(reads),
        writes=tuple(writes),
        loops=(),
        program=program,
        core=program[0],
        details={"op": "exp"},
    )


def test_sendrecv_waits_for_the_peer_source():
    b = TraceBuilder("trn2")
    sources, targets = [b.tile(4), b.tile(4)], [b.tile(4), b.tile(4)]
    for core, n in ((0, 65536), (1, 64)):  # core 0's source is ready much later
        _activation(b, n, (core,), [b.tile(4 * n)], [sources[core]])
    for core in (0, 1):
        b.trace.add(
            engine="dma",
            opcode="sendrecv",
            partitions=128,
            free_size=1,
            in_dtypes=("float32",),
            out_dtype="float32",
            reads=(sources[core],),
            writes=(targets[core],),
            loops=(),
            program=(core,),
            core=core,
            dma_bytes=512,
            dma_direction="sbuf->sbuf",
            dma_row_bytes=4,
            details={"pipe_id": 0},
        )
    b.trace.lnc = 2
    sched = b.run()
    sem = _const("semaphore_latency_us", "trn2")
    assert sched.end_us[1] < sched.end_us[0] / 100  # core 1's own source is ready at once
    assert sched.start_us[3] == pytest.approx(sched.end_us[0] + 2 * sem)
    assert sched.start_us[2] == pytest.approx(sched.end_us[0] + sem)  # its own source


def test_core_barrier_makes_the_earlier_core_wait_for_the_later_one(monkeypatch):
    import simulate.nki06 as nki06
    from simulate.perf.profiler import Profile

    isa, lang = nki06.isa, nki06.language

    def kernel(x):
        """Core 1 stores its half after a long activation chain; core 0 stores its half at
        once (the simulator runs it first), meets core 1 at the barrier and then reads
        core 1's half."""
        pid = lang.program_id(0)
        half = x.shape[0] // 2
        out = lang.ndarray(x.shape, x.dtype, buffer=lang.shared_hbm)
        tile = lang.ndarray((half, x.shape[1]), x.dtype, buffer=lang.sbuf)
        isa.dma_copy(dst=tile, src=x[pid * half : (pid + 1) * half])
        if pid == 1:
            for _ in range(8):
                isa.activation(dst=tile, op=lang.exp, data=tile)
        isa.dma_copy(dst=out[pid * half : (pid + 1) * half], src=tile)
        isa.core_barrier(out, (0, 1))
        again = lang.ndarray((half, x.shape[1]), x.dtype, buffer=lang.sbuf)
        isa.dma_copy(dst=again, src=out[(1 - pid) * half : (2 - pid) * half])
        return out

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x = np.random.default_rng(3).standard_normal((256, 2048)).astype(np.float32) / 8
    nki06.jit(kernel)[2](x)
    trace = nki06.last_trace()
    sched = Profile.from_trace(trace).schedule
    barriers = [i for i, inst in enumerate(trace) if inst.opcode == "core_barrier"]
    stores = [i for i, inst in enumerate(trace) if inst.dma_direction == "sbuf->hbm"]
    reads = [i for i, inst in enumerate(trace) if inst.dma_direction == "hbm->sbuf"][2:]
    assert len(barriers) == 2 and sorted(sched.core[i] for i in barriers) == [0, 1]
    slow_store = next(i for i in stores if sched.core[i] == 1)
    fast_store = next(i for i in stores if sched.core[i] == 0)
    assert sched.finish_us[fast_store] < sched.finish_us[slow_store] / 2
    for i in barriers:  # neither core passes the barrier before core 1's store is done
        assert sched.start_us[i] >= sched.finish_us[slow_store]
    late_read = next(i for i in reads if sched.core[i] == 0)
    assert sched.start_us[late_read] >= sched.finish_us[slow_store]


def test_profile_reports_the_lnc_and_each_core_busy_time(monkeypatch, rng):
    import simulate.nki06 as nki06
    from nki_rmsnorm.kernels import nki06_baseline
    from simulate.perf.profiler import Profile

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x = rng.standard_normal((1024, 1024)).astype(np.float32)
    profiles = {}
    for lnc in (1, 2):
        np.testing.assert_array_equal(nki06_baseline.copy_one[lnc](x), x)
        profiles[lnc] = Profile.from_trace(nki06.last_trace())
    one, two = profiles[1], profiles[2]
    assert (one.lnc, len(one.core_busy_us), two.lnc, len(two.core_busy_us)) == (1, 1, 2, 2)
    # each core moves half the bytes: its DMA is busy about half as long as the lone core's
    for core in two.core_busy_us:
        assert 0.4 * one.core_busy_us[0]["dma"] < core["dma"] < 0.6 * one.core_busy_us[0]["dma"]
    assert two.engine_busy_us["dma"] == max(c["dma"] for c in two.core_busy_us)
    assert two.latency_us < 0.6 * one.latency_us
    assert 0 < two.mbu <= 1 and two.mbu == pytest.approx(one.mbu, rel=0.1)
    assert "LNC=2" in two.summary() and "core 1 busy" in two.summary()
    assert "LNC" not in one.summary()


def _legacy_tile_copies(x):
    """Each SPMD instance copies its own 128 rows (legacy dialect, DMA only)."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    row = (nl.program_id(0) * nl.num_programs(1) + nl.program_id(1)) * 128
    tile = nl.load(x[row : row + 128, :])
    nl.store(out[row : row + 128, :], value=tile)
    return out


@pytest.mark.parametrize(
    "grid, cores",
    [
        ((nl.nc(2), 2), [0, 0, 1, 1]),  # legacy language docs: kernel[nl.nc(2), 2]
        ((nl.spmd_dim(nl.nc(2), 2), 1), [0, 0, 1, 1]),  # test_nki_spmd_grid.py example 2
        ((2 * nl.nc(2), 1), [0, 1, 0, 1]),  # example 3: spmd_dim(2, nl.nc(2))
    ],
)
def test_legacy_grid_with_an_nc_dimension_runs_on_two_cores_of_trn2(grid, cores):
    x = np.random.default_rng(5).standard_normal((512, 2048)).astype(np.float32)
    kernel = nki.jit(_legacy_tile_copies)
    out, two = nki.profile(kernel[grid], x, target="trn2")
    np.testing.assert_array_equal(out, x)
    trace = nki.last_trace()
    assert trace.lnc == 2
    by_program = {inst.program: inst.core for inst in trace}
    assert [by_program[p] for p in sorted(by_program)] == cores
    plain = nki.profile(kernel[4, 1] if grid[1] == 1 else kernel[2, 2], x, target="trn2")[1]
    assert plain.lnc == 1 and two.lnc == 2
    assert two.latency_us < 0.6 * plain.latency_us  # two instances at a time, not one
    one_core = nki.profile(kernel[grid], x, target="trn1")[1]  # NeuronCore-v2: no LNC=2
    assert one_core.lnc == 1


@pytest.mark.parametrize("lnc", [1, 2])
def test_dma_busy_time_is_reported_per_direction_on_every_core(lnc):
    b = TraceBuilder("trn2")
    for core in range(lnc):
        tile = b.tile(8192)
        b.dma("hbm->sbuf", 128 * 8192, 128, [b.hbm(1 << 20)], [tile])
        b.dma("sbuf->hbm", 128 * 8192, 128, [tile], [b.hbm(1 << 20)])
        for inst in b.trace.instructions[-2:]:
            inst.program, inst.core = (core,), core
    b.trace.lnc = lnc
    sched = b.run()
    assert sched.resource == ["dma_load", "dma_store"] * lnc
    assert sched.busy_us["dma_load"] > 0 and sched.busy_us["dma_store"] > 0
    assert sched.busy_us["dma_copy"] == 0


# --- per-engine floors (the bench's "binds") ---------------------------------------------------
def test_engine_floors_sum_the_rule_costs_without_waits():
    """A dependent chain on DVE: the floor is the sum of the rule costs (no semaphore, drain
    or dependent-instruction overhead), below the modeled latency; the idle engines' floors
    are zero, and DVE binds."""
    from simulate.cost import binding_resource, engine_floors

    b = TraceBuilder()
    value = b.tile()
    for _ in range(4):
        nxt = b.tile()
        b.op("dve", "tensor_scalar", 4096, [value], [nxt], op=["multiply"])
        value = nxt
    sched = b.run()
    floors = engine_floors(sched)
    assert floors["dve"] == pytest.approx(4 * _us(4096, "dve", "trn1"))
    assert floors["act"] == floors["pe"] == floors["pool"] == floors["dma"] == 0.0
    assert floors["dve"] < sched.latency_us
    assert binding_resource(floors) == "dve"


def test_engine_floors_of_a_copy_name_the_dma_engines_or_hbm():
    """A large copy: the DMA floor is its bytes over the 16 DMA engines' rate, the HBM floor
    its bytes over the capped HBM rate; the modeled latency is no lower than either."""
    from simulate.cost import binding_resource, engine_floors

    sched = _copy_trace("trn2", 8, 32768).run()
    floors = engine_floors(sched)
    nbytes = 2 * 8 * 128 * 32768
    engines = 16 * _const("dma_engine_peak_gbps", "trn2") * _const("dma_efficiency", "trn2")
    assert floors["dma"] == pytest.approx(nbytes / engines / 1000, rel=1e-6)
    assert floors["hbm"] == pytest.approx(nbytes / _hbm_gbps("trn2") / 1000, rel=1e-6)
    assert max(floors.values()) <= sched.latency_us
    assert binding_resource(floors) in ("dma", "hbm")
    assert floors["dve"] == 0.0
