"""The ``nki`` 0.6 backward (``nki_rmsnorm.kernels.nki06.rmsnorm_bwd``) beside the legacy one.

``test_bwd.py`` checks both dialects' numbers against the float64 reference; here:

* LNC=2 (``kernel[2]`` on trn2/trn3, rows split across the two physical cores, the column
  sums exchanged with ``sendrecv``) gives bitwise the results of LNC=1, for both calling
  conventions, with one, two and an odd number of row tiles; each core moves its own rows.
* The 0.6 kernel's trace matches the legacy kernel's: the same HBM bytes per tensor, the same
  instructions per engine and opcode except the documented exchange (no memset of the
  column-sum accumulators, whose first products overwrite PSUM; with two row halves one
  PSUM → SBUF copy per accumulator bank at their boundary, and each final column sum an
  addition of the halves instead of a copy; with folded rows no Vector copy to repeat a
  row's sum over its partitions, a broadcast view instead), and bitwise the same dx. The
  streamed regime (hidden sizes that fit SBUF neither whole nor folded) spells the weight's
  partition broadcast as Tensor-engine matmuls: there the same HBM bytes, DMA and Scalar
  instructions, and bitwise the same dx.
"""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import pytest
from helpers import poison

import simulate
from nki_rmsnorm import reference
from nki_rmsnorm.kernels.legacy import rmsnorm_bwd as legacy_bwd
from nki_rmsnorm.kernels.nki06 import rmsnorm_bwd as bwd06
from nki_rmsnorm.plan import backward as plan_bwd
from simulate import nki06

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
P = 128


def _inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode, dy_dtype=None):
    x = rng.standard_normal((M, N)).astype(dtype)
    dy = rng.standard_normal((M, N)).astype(dy_dtype or dtype)
    weight = None if w_dtype is None else (1.0 + 0.5 * rng.standard_normal(N)).astype(w_dtype)
    dh_out = rng.standard_normal((M, N)).astype(dtype) if with_dh else None
    _, rstd = reference.rms_norm_fwd(x, weight, 1e-6, offset=offset, casting_mode=mode)
    return dy, x, weight, rstd, dh_out


def _run06(monkeypatch, kernel, *args, target, lnc=None):
    """Launch a 0.6 kernel on ``target`` (LNC ``lnc``; None: no launch bracket)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", target)
    outs = nki06.simulate(kernel if lnc is None else kernel[lnc])(*args)
    return outs, nki06.last_trace()


# (M, N, x dtype, weight dtype, offset, bias, dh_out, mode, target): one row tile (core 1
# idle), two, an odd number (3, 5: unequal halves) with a ragged last one, rows folded over 2
# partitions; both NeuronCore generations that have LNC=2.
LNC_CASES = [
    # 3 rows: with 2 the rows' bytes (2·300·2) equal the weight's two reads (300·2 each,
    # once per layout with the row dot on the Tensor engine), which the count below mixes up
    (3, 300, BF16, BF16, 0.0, True, False, "gemma", "trn2"),
    (130, 1000, F32, F32, 0.5, True, True, "llama", "trn2"),
    (300, 3000, BF16, None, 0.0, True, False, "gemma", "trn3"),
    (513, 700, F16, F32, 1.0, True, True, "none", "trn2"),
    (100, 32768, F32, F32, 1.0, True, False, "gemma", "trn2"),
    (130, 30001, BF16, BF16, 0.5, True, True, "llama", "trn3"),  # streamed
]


@pytest.mark.parametrize(
    "M, N, dtype, w_dtype, offset, has_bias, with_dh, mode, target",
    LNC_CASES,
    ids=[f"{c[0]}x{c[1]}-{c[7]}-{c[8]}" for c in LNC_CASES],
)
def test_lnc2_is_bitwise_lnc1(
    monkeypatch, M, N, dtype, w_dtype, offset, has_bias, with_dh, mode, target
):
    rng = np.random.default_rng([M, N, 2])
    dy, x, weight, rstd, dh_out = _inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode)
    args = (dy, x, weight, rstd, dh_out, offset, has_bias, mode)
    one, _ = _run06(monkeypatch, bwd06.rmsnorm_bwd, *args, target=target)
    two, trace = _run06(monkeypatch, bwd06.rmsnorm_bwd, *args, target=target, lnc=2)
    assert len(one) == len(two) == 1 + (weight is not None) + has_bias
    for a, b in zip(one, two):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert np.isfinite(one[0].astype(np.float32)).all()
    # each core reads its own rows of dy, x (and dh_out) from HBM: the first ⌈T/2⌉ row
    # tiles on core 0, the rest on core 1
    per_core = Counter()
    for inst in trace.select(engine="dma"):
        for region in inst.reads:
            if region is not None and region.memory == "hbm":
                per_core[inst.program, region.storage] += inst.dma_bytes
    plan = plan_bwd.make_plan(
        N,
        plan_bwd.BwdDtypes(dtype, dtype, w_dtype, dtype if with_dh else None),
        offset,
        mode,
        simulate.get_target(target).sbuf_bytes_per_partition,
    )
    rows_per_tile = P // (1 if plan is None else plan.fold)
    tiles = -(-M // rows_per_tile)
    rows0 = min(M, -(-tiles // 2) * rows_per_tile)
    for core, rows in (((0,), rows0), ((1,), M - rows0)):
        moved = [n for (program, _), n in per_core.items() if program == core]
        assert moved.count(rows * N * dtype.itemsize) == (2 + with_dh if rows else 0)

    # the output-parameter entry point at LNC=2 writes the same bits into poisoned buffers
    dx = poison((M, N), dtype)
    dweight = None if weight is None else poison((N,), weight.dtype)
    dbias = poison((N,), F32 if weight is None else weight.dtype) if has_bias else None
    got, _ = _run06(
        monkeypatch,
        bwd06.rmsnorm_bwd_out,
        dy,
        x,
        weight,
        rstd,
        dh_out,
        dx,
        dweight,
        dbias,
        offset,
        mode,
        target=target,
        lnc=2,
    )
    assert got is None
    for buffer, expected in zip([b for b in (dx, dweight, dbias) if b is not None], one):
        assert buffer.tobytes() == expected.tobytes()


def _hbm_bytes_per_tensor(trace):
    read, written = Counter(), Counter()
    for inst in trace.select(engine="dma"):
        for regions, totals in ((inst.reads, read), (inst.writes, written)):
            for region in regions:
                if region is not None and region.memory == "hbm":
                    totals[region.storage] += inst.dma_bytes
    return sorted(read.values()), sorted(written.values())


# (M, N, x dtype, dy dtype, weight dtype, offset, bias, dh_out, mode, target): the 0.6
# kernels' targets only (trn2, trn3; NKI 0.x supports no NeuronCore-v2).
PARITY_CASES = [
    (1, 64, F32, F32, F32, 0.0, True, False, "gemma", "trn2"),
    (257, 1000, BF16, BF16, BF16, 0.0, True, True, "gemma", "trn3"),
    (200, 2100, BF16, F32, F32, 1.0, True, False, "llama", "trn2"),
    (130, 5000, F16, F16, None, 0.0, False, True, "gemma", "trn3"),
    (37, 60000, BF16, BF16, BF16, 0.0, True, True, "gemma", "trn2"),  # folded over 4
    (70, 32768, F32, F32, F32, 1.0, False, False, "llama", "trn2"),  # folded over 2
]


@pytest.mark.parametrize(
    "M, N, dtype, dy_dtype, w_dtype, offset, has_bias, with_dh, mode, target",
    PARITY_CASES,
    ids=[f"{c[0]}x{c[1]}-{c[8]}-{c[9]}" for c in PARITY_CASES],
)
def test_trace_matches_legacy(
    monkeypatch, M, N, dtype, dy_dtype, w_dtype, offset, has_bias, with_dh, mode, target
):
    rng = np.random.default_rng([M, N, 6])
    args = (
        *_inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode, dy_dtype),
        offset,
        has_bias,
        mode,
    )
    dh_out_dtype = dtype if with_dh else None
    want, legacy = simulate.trace_kernel(legacy_bwd.rmsnorm_bwd, *args, target=target)
    got, trace = _run06(monkeypatch, bwd06.rmsnorm_bwd, *args, target=target)
    assert got[0].tobytes() == want[0].tobytes()  # dx is row-local: bitwise the same
    assert _hbm_bytes_per_tensor(trace) == _hbm_bytes_per_tensor(legacy)
    assert trace.hbm_bytes() == legacy.hbm_bytes()

    ops06 = Counter((i.engine, i.opcode) for i in trace)
    ops_legacy = Counter((i.engine, _opcode06(i.opcode)) for i in legacy)
    # The return convention computes the gradients it returns: dweight with a weight,
    # dbias with has_bias.
    accumulators = (w_dtype is not None) + bool(has_bias)
    plan = plan_bwd.make_plan(
        N,
        plan_bwd.BwdDtypes(dtype, dy_dtype, w_dtype, dh_out_dtype),
        offset,
        mode,
        simulate.get_target(target).sbuf_bytes_per_partition,
    )
    banks = -(-plan.n_groups * -(-plan.group // P) * plan.fold // 512)
    tiles = -(-M * plan.fold // P)
    expected = ops_legacy.copy()
    expected[("dve", "memset")] -= accumulators
    if tiles > 1:
        stores = accumulators * plan.n_groups
        expected[("dve", "tensor_copy")] += accumulators * banks - stores
        expected[("dve", "tensor_tensor")] += stores
    assert +ops06 == +expected


def _opcode06(opcode):
    """The 0.6 name of a legacy trace opcode (``nl.load``/``nl.store`` are DMA copies)."""
    return {"load": "dma_copy", "store": "dma_copy"}.get(opcode, opcode)


STREAMED_CASES = [
    (130, 30001, BF16, BF16, 0.5, True, True, "gemma", "trn2"),  # rows resident
    (150, 30001, F32, F32, 0.0, True, False, "llama", "trn2"),  # rows read twice
]


@pytest.mark.parametrize(
    "M, N, dtype, w_dtype, offset, has_bias, with_dh, mode, target",
    STREAMED_CASES,
    ids=[f"{c[0]}x{c[1]}-{c[8]}" for c in STREAMED_CASES],
)
def test_streamed_trace_matches_legacy(
    monkeypatch, M, N, dtype, w_dtype, offset, has_bias, with_dh, mode, target
):
    spec = simulate.get_target(target)
    dtypes = plan_bwd.BwdDtypes(dtype, dtype, w_dtype, dtype if with_dh else None)
    assert plan_bwd.make_plan(N, dtypes, offset, mode, spec.sbuf_bytes_per_partition) is None
    rng = np.random.default_rng([M, N, 9])
    args = (*_inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode), offset, has_bias, mode)
    want, legacy = simulate.trace_kernel(legacy_bwd.rmsnorm_bwd, *args, target=target)
    got, trace = _run06(monkeypatch, bwd06.rmsnorm_bwd, *args, target=target)
    assert got[0].tobytes() == want[0].tobytes()
    assert _hbm_bytes_per_tensor(trace) == _hbm_bytes_per_tensor(legacy)
    counts, legacy_counts = trace.count(), legacy.count()
    assert counts["dma"] == legacy_counts["dma"] and counts["act"] == legacy_counts["act"]
