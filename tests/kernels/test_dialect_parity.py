"""The forward kernel in the two NKI dialects, trace against trace, and the nki06 kernel at
LNC = 1 against LNC = 2, in every regime ("rows", "packed", "split", "long", "two_pass").

Both dialects plan with ``nki_rmsnorm.plan.forward`` and emit the same arithmetic, so their
outputs are bitwise equal and their HBM traffic is the same. Their instruction streams are
the same per engine but for one documented step: the nki06 dialect has no partition
broadcast instruction, so a row broadcast across the partitions (the weight of the
"vector" plan, the bias) is a ones-row matmul per 512-column PSUM bank and a Vector copy out
of it, plus one memset of the ones row, where the legacy kernel has one Vector
``partition_broadcast``: per broadcast row, one more Tensor-engine instruction per bank and
as many more Vector instructions (copies + memset − broadcast). "rows" broadcasts once per
kernel, "long" and "two_pass" once per row tile and column chunk, "split" never (its
per-partition weight and bias segments are doubled by SBUF-to-SBUF DMAs in both dialects).

One regime's arithmetic differs, by design: in "packed" (short rows) with a weight in gemma
mode on trn2 / trn3, the 0.6 kernel has the Tensor engine form rstd ⊗ w (each row's rstd
pieces at the start of a 32-row PE tile, ``tile_position``, which the legacy kernel cannot
use: it first appears in SDK 2.22, the legacy kernels claim 2.21), so y = h·(rstd ⊗ w)
there and (h·rstd)·w in the legacy kernel: h and rstd stay bitwise equal, y within a few
units in the last place, and the 0.6 kernel issues fewer Scalar-engine instructions.

The parity holds per target, on trn2 and trn3: the nki06 kernels run there only (NKI 0.x
supports Trn2/Trn3, aws-neuron-sdk@81ce03ae nki/nki_faq.rst L23-27; a trn1 or inf2 target
runs the legacy kernels alone, and test_fwd holds their trn1 "scalar" product plan,
``(h·rstd)·w``, to the reference). The two simulators default to different targets (legacy
trn1, nki06 trn3: ``simulate.core.targets.DIALECT_DEFAULT_TARGET``), so every comparison here
pins the target.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest
from helpers import BF16, poison, trace_launch

import simulate
from nki_rmsnorm import kernels
from nki_rmsnorm.plan.forward import (
    GROUP_MIN_COLUMNS,
    GROUP_MIN_COLUMNS_NC_V3,
    PMAX,
    PSUM_COLS,
    choose_layout,
    make_plan,
)

FP32 = np.dtype(np.float32)
FP16 = np.dtype(np.float16)

# (target, M, N, x dtype, weight, bias, residual, casting mode, offset): every regime with
# each product engine it has on trn2 / trn3 ("tensor" for gemma with a weight, "vector"
# otherwise), ragged last tiles and column chunks, several rows per partition (4096 × 1024 on
# trn2: k = 2), the three bf16 rstd pieces and the one fp32 piece.
CASES = [
    ("trn3", 300, 640, FP32, True, True, False, "gemma", 0.5),  # rows
    ("trn2", 4096, 1024, BF16, True, False, True, "gemma", 0.5),
    ("trn3", 130, 768, BF16, True, True, False, "llama", 0.5),
    ("trn2", 257, 512, BF16, False, True, True, "none", 0.0),
    ("trn3", 20, 40000, BF16, True, True, True, "gemma", 0.0),  # split, 3 bf16 pieces
    ("trn2", 20, 40000, FP32, True, False, False, "gemma", 0.5),  # split, 1 fp32 piece
    ("trn2", 9, 40000, BF16, True, True, True, "llama", 0.5),  # split, vector
    ("trn2", 130, 20000, BF16, True, True, True, "none", 0.5),  # long, vector (none)
    ("trn2", 29, 17389, BF16, True, True, True, "gemma", 0.0),  # long, tensor
    ("trn3", 29, 30001, BF16, False, True, False, "gemma", 0.0),  # long, vector
    ("trn2", 3, 65536, FP32, True, True, True, "gemma", 1.0),  # two_pass
    ("trn2", 8192, 128, BF16, True, True, True, "gemma", 0.0),  # packed, k = 16
    ("trn3", 1000, 64, BF16, True, False, False, "llama", 0.5),  # packed, k = 1
    ("trn2", 4096, 128, FP32, False, True, True, "none", 0.0),  # packed, fp32
]


def _case_id(case):
    return f"{case[0]}-{case[1]}x{case[2]}-{case[7]}"


def _plan(target, x, r, w, b, offset, mode):
    spec = simulate.get_target(target)
    plan = make_plan(
        x.dtype,
        None if w is None else w.dtype,
        None if b is None else b.dtype,
        None if r is None else r.dtype,
        offset,
        mode,
        None,
        FP32,
        BF16,
        tensor_engine=spec.nc_version >= 3,
        # as the nki06 kernel plans (rmsnorm_fwd._plan)
        group_min_columns=GROUP_MIN_COLUMNS_NC_V3 if spec.nc_version == 3 else GROUP_MIN_COLUMNS,
    )
    return plan, choose_layout(plan, *x.shape, spec.sbuf_bytes_per_partition)


def _group_sums(layout, M):
    """(extra Scalar-engine, extra Vector-engine) instructions of nki06's grouped row
    statistics in "rows" (one ``activation_reduce`` per group instead of one per row of a
    tile, and one ``tensor_reduce`` of the group sums); the legacy kernel keeps whole-row
    statistics."""
    if layout.regime != "rows" or not layout.groups:
        return 0, 0
    k = layout.rows_per_partition
    row_sets = math.ceil(M // k / PMAX) * k
    return (layout.groups - 1) * row_sets, row_sets


def _broadcast_banks(plan, layout, M, N, weight, bias):
    """PSUM banks of the rows the nki06 kernel broadcasts by matmul where the legacy one
    has a partition broadcast (see the module docstring)."""
    if layout.regime in ("split", "packed"):  # "packed" broadcasts by matmul in both
        return 0
    if layout.regime == "rows":
        return (int(weight and plan.product_engine == "vector") + int(bias)) * math.ceil(
            N / PSUM_COLS
        )
    if layout.regime == "long":
        engine = plan.product_engine if weight else "vector"
        engine = "vector" if engine == "tensor" and plan.rstd_pieces != 3 else engine
        rows, chunk = int(weight and engine == "vector") + int(bias), layout.output_chunk
    else:
        rows, chunk = int(weight) + int(bias), layout.chunk
    widths = [min(chunk, N - c0) for c0 in range(0, N, chunk)]
    return rows * math.ceil(M / PMAX) * sum(math.ceil(w / PSUM_COLS) for w in widths)


def _launch(
    dialect, target, x, residual, weight, bias, casting_mode, lnc=None, offset=None, out_dtype=None
):
    offset = (0.0 if weight is None else 0.5) if offset is None else offset
    if out_dtype is not None:  # the dialect's nki.language dtype, as the launchers pass it
        out_dtype = kernels.nki_dtype(np.dtype(out_dtype).name, dialect)
    common = (weight, bias, 1e-6, offset, casting_mode, out_dtype)
    if residual is None:
        kernel = kernels.kernel("rmsnorm_fwd", dialect)
        return trace_launch(kernel, x, *common, target=target, lnc=lnc)
    kernel = kernels.kernel("rmsnorm_add_fwd", dialect)
    return trace_launch(kernel, x, residual, *common, target=target, lnc=lnc)


def _inputs(rng, M, N, dtype, weight, bias, residual):
    x = rng.standard_normal((M, N)).astype(dtype)
    w = rng.normal(1.0, 0.2, N).astype(dtype) if weight else None
    b = rng.normal(0.0, 0.5, N).astype(FP32) if bias else None
    r = rng.standard_normal((M, N)).astype(FP32) if residual else None
    return x, r, w, b


def _bitwise(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def _close(got, want):
    """y of the two products, (h·rstd)·w and h·(rstd ⊗ w), each rounded twice in fp32 (and
    once to y's dtype): a few units in the last place of y's dtype apart, relative to the
    row's largest |y|."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        ulp = float(np.finfo(np.float32).eps) if g.dtype == FP32 else 2.0**-7
        scale = np.max(np.abs(w64), axis=-1, keepdims=True) + 1e-30
        np.testing.assert_array_less(np.abs(g64 - w64) / scale, 4 * ulp)


def _outer_packed(plan, layout, weight):
    """Whether the 0.6 kernel forms rstd ⊗ w on the Tensor engine in "packed" (see the
    module docstring): y then differs from the legacy kernel's in the last bits."""
    return layout.regime == "packed" and weight is not None and plan.product_engine == "tensor"


def _agree(plan, layout, weight, nki06, legacy):
    """Bitwise, or for the packed Tensor-engine product: h and rstd bitwise, y close."""
    if not _outer_packed(plan, layout, weight):
        _bitwise(nki06, legacy)
        return
    _bitwise(nki06[1:], legacy[1:])
    _close(nki06[:1], legacy[:1])


def _engine_counts(trace):
    return collections.Counter(i.engine for i in trace.instructions)


def _act_into_psum(trace):
    """Scalar-engine instructions writing PSUM (the "split" regime's w · rstd)."""
    return sum(
        1
        for i in trace.instructions
        if i.engine == "act" and i.writes and i.writes[0].memory == "psum"
    )


def test_the_cases_cover_every_regime(rng):
    regimes = set()
    for target, M, N, dtype, weight, bias, residual, mode, offset in CASES:
        x, r, w, b = _inputs(rng, 1, N, dtype, weight, bias, residual)
        regimes.add(_plan(target, np.empty((M, N), dtype), r, w, b, offset, mode)[1].regime)
    assert regimes == {"rows", "packed", "split", "long", "two_pass"}


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dialects_agree_bitwise_with_the_same_traffic(rng, case):
    target, M, N, dtype, weight, bias, residual, mode, offset = case
    x, r, w, b = _inputs(rng, M, N, dtype, weight, bias, residual)
    legacy, legacy_trace = _launch("legacy", target, x, r, w, b, mode, offset=offset)
    nki06, nki06_trace = _launch("nki06", target, x, r, w, b, mode, offset=offset)
    plan, layout = _plan(target, x, r, w, b, offset, mode)
    _agree(plan, layout, w, nki06, legacy)
    assert nki06_trace.hbm_bytes() == legacy_trace.hbm_bytes()
    if _outer_packed(plan, layout, w):
        # the Scalar engine only reduces: no h·rstd there
        nki06_counts, legacy_counts = _engine_counts(nki06_trace), _engine_counts(legacy_trace)
        assert nki06_counts["act"] < legacy_counts["act"]
        return

    if weight is not None and plan.product_engine == "tensor":
        # both dialects keep non-finite weights out of the Tensor-engine product (its finite
        # part there, the rest against the high rstd piece), each with its own weight
        # preparation (nki06's "packed" also on PE); nki06's "split" forms w · rstd on the
        # Scalar engine into PSUM, multiplied on the Vector engine
        weighted = _act_into_psum(nki06_trace)
        assert (weighted > 0) == (layout.regime == "split")
        nki06_counts, legacy_counts = _engine_counts(nki06_trace), _engine_counts(legacy_trace)
        assert nki06_counts["act"] - weighted <= legacy_counts["act"] + _group_sums(layout, M)[0]
        return
    banks = _broadcast_banks(plan, layout, M, N, weight, bias)
    expected = _engine_counts(legacy_trace)
    expected["pe"] += banks
    expected["dve"] += banks
    extra_act, extra_dve = _group_sums(layout, M)
    expected["act"] += extra_act
    expected["dve"] += extra_dve
    counts = _engine_counts(nki06_trace)
    if layout.regime == "split":
        # nki06's "split" takes each tile's rstd from its row of sums to the segments in
        # fewer steps (rmsnorm_fwd_split._split_statistics): no engine runs more
        for engine in set(counts) | set(expected):
            assert counts[engine] <= expected[engine], engine
        return
    assert counts == expected


def _assert_float32_y_agrees(target, x, r, w, b, mode, offset):
    legacy, _ = _launch("legacy", target, x, r, w, b, mode, offset=offset, out_dtype=FP32)
    nki06, _ = _launch("nki06", target, x, r, w, b, mode, offset=offset, out_dtype=FP32)
    assert legacy[0].dtype == FP32
    _agree(*_plan(target, x, r, w, b, offset, mode), w, nki06, legacy)


# A float32 y keeps the last fp32 bits that a bf16 / fp16 y rounds away: 15 rows of 32 (the
# reported 3 × 5 × 32 batch) on every nki06 target, in every casting mode, with and without a
# weight (an fp32 one: the one-piece "tensor" plan; no offset: the three bf16 pieces), a
# bias and a residual.
SMALL_FP32_Y = [
    (target, dtype, weight, bias, residual, mode, offset)
    for target in ("trn2", "trn3")
    for dtype in (BF16, FP16)
    for mode in ("gemma", "llama", "none")
    for weight, bias, residual, offset in ((dtype, True, False, 0.5), (dtype, False, True, 0.0))
] + [
    (target, BF16, weight, True, residual, "gemma", offset)
    for target in ("trn2", "trn3")
    for weight, residual, offset in ((FP32, False, 0.0), (FP32, True, 1.0), (None, True, 0.0))
]


@pytest.mark.parametrize(
    "case",
    SMALL_FP32_Y,
    ids=lambda c: "-".join(str(v if not isinstance(v, np.dtype) else v.name) for v in c),
)
def test_dialects_agree_bitwise_with_a_float32_y(rng, case):
    target, dtype, weight_dtype, bias, residual, mode, offset = case
    x = rng.standard_normal((15, 32)).astype(dtype)
    w = None if weight_dtype is None else rng.normal(1.0, 0.2, 32).astype(weight_dtype)
    b = rng.normal(0.0, 0.5, 32).astype(FP32) if bias else None
    r = rng.standard_normal((15, 32)).astype(FP32) if residual else None
    _assert_float32_y_agrees(target, x, r, w, b, mode, offset)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] != FP32], ids=_case_id)
def test_dialects_agree_bitwise_with_a_float32_y_in_every_regime(rng, case):
    target, M, N, dtype, weight, bias, residual, mode, offset = case
    x, r, w, b = _inputs(rng, M, N, dtype, weight, bias, residual)
    _assert_float32_y_agrees(target, x, r, w, b, mode, offset)


@pytest.mark.parametrize("residual", [False, True])
def test_bindings_agree_bitwise_on_one_target(rng, monkeypatch, residual):
    """``nki_rmsnorm.rms_norm`` under each dialect, both on trn2 (the target
    ``NEURON_PLATFORM_TARGET_OVERRIDE`` names reaches the kernels of both): bf16 x of
    3 × 5 × 32 with a weight, a bias and a float32 y, the reported case."""
    import nki_rmsnorm
    from nki_rmsnorm.dialect import use_dialect

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    x = rng.standard_normal((3, 5, 32)).astype(BF16)
    w = rng.normal(1.0, 0.2, 32).astype(BF16)
    b = rng.normal(0.0, 0.5, 32).astype(FP32)
    r = rng.standard_normal((3, 5, 32)).astype(BF16) if residual else None
    outputs = {}
    for name in ("legacy", "nki06"):
        with use_dialect(name):
            got = nki_rmsnorm.rms_norm(x, w, bias=b, offset=0.5, residual=r, out_dtype=FP32)
        outputs[name] = got if residual else (got,)
    assert outputs["legacy"][0].dtype == FP32
    # packed rows (N = 32) with a weight in gemma: the 0.6 kernel's Tensor-engine product
    x2, r2 = x.reshape((15, 32)), None if r is None else r.reshape((15, 32))
    plan, layout = _plan("trn2", x2, r2, w, b, 0.5, "gemma")
    assert _outer_packed(plan, layout, w)
    _agree(plan, layout, w, outputs["nki06"], outputs["legacy"])


@pytest.mark.parametrize("target", ["trn2", "trn3"])
@pytest.mark.parametrize(
    "M,N,dtype,residual,regime",
    [
        (4100, 512, BF16, True, "rows"),
        (3 * 128 + 5, 1000, BF16, False, "rows"),
        (8200, 128, BF16, True, "packed"),
        (1, 512, BF16, False, "rows"),
        (20, 40000, BF16, True, "split"),
        (200, 17389, BF16, True, "long"),
        (130, 60001, FP32, False, "two_pass"),
    ],
    ids=["k2-ragged", "odd-tiles", "packed", "one-row", "split", "long", "two-pass"],
)
def test_lnc2_is_bitwise_lnc1(rng, target, M, N, dtype, residual, regime):
    """Under ``kernel[2]`` the row tiles are split between the two physical cores, each
    issuing its own instructions, and every output bit is the one LNC = 1 gives."""
    x, r, w, b = _inputs(rng, M, N, dtype, True, True, residual)
    assert _plan(target, x, r, w, b, 0.5, "gemma")[1].regime == regime
    one, _ = _launch("nki06", target, x, r, w, b, "gemma", lnc=1)
    two, trace = _launch("nki06", target, x, r, w, b, "gemma", lnc=2)
    _bitwise(two, one)
    cores = collections.Counter(i.program for i in trace.instructions if i.engine == "dma")
    assert set(cores) == {(0,), (1,)}
    if M > 128 or regime == "split":  # both cores move rows, not only the weight and bias
        assert min(cores.values()) > 4


def test_lnc2_keeps_as_many_row_tiles_per_core(rng):
    """Under LNC=2 the planner gives "rows" thinner tiles, so that each core keeps
    ``MIN_TILES`` tiles to pipeline (8192 rows of 2048: k = 4 on one core, 2 on two), or
    half as many while a tile moves under ``CHUNK_BYTES`` per partition; the decisions for
    one core are unchanged. The kernel follows it: 4100 rows of 512 (1 KiB a row) are
    9 tiles of k = 4 at LNC=1 and 17 tiles of k = 2 at LNC=2, each one rstd store."""
    plan = make_plan(BF16, BF16, None, None, 0.0, "gemma", None, FP32, BF16, tensor_engine=True)
    budget = simulate.get_target("trn2").sbuf_bytes_per_partition
    assert choose_layout(plan, 8192, 2048, budget).rows_per_partition == 4
    assert choose_layout(plan, 8192, 2048, budget, cores=2).rows_per_partition == 2
    assert choose_layout(plan, 4100, 512, budget).rows_per_partition == 4
    assert choose_layout(plan, 4100, 512, budget, cores=2).rows_per_partition == 2
    assert choose_layout(plan, 4096, 1024, budget, cores=2).rows_per_partition == 2
    assert choose_layout(plan, 300, 40000, budget, cores=2) == choose_layout(
        plan, 300, 40000, budget
    )

    x, _, w, _ = _inputs(rng, 4100, 512, BF16, True, False, False)
    for lnc, tiles in ((1, 9), (2, 17)):
        _, trace = _launch("nki06", "trn2", x, None, w, None, "gemma", lnc=lnc)
        # per tile: x in, y and rstd out; once per core: the weight (its load, its finite
        # and non-finite rows into place)
        dmas = sum(i.engine == "dma" for i in trace.instructions)
        assert dmas == 3 * tiles + 3 * lnc


def test_lnc2_output_parameters(rng):
    x, _, w, _ = _inputs(rng, 600, 384, BF16, True, False, False)
    want, _ = _launch("nki06", "trn2", x, None, w, None, "gemma")
    y, rstd = poison((600, 384), BF16), poison((600,), FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out", "nki06")
    trace_launch(kernel, x, w, None, y, rstd, 1e-6, 0.5, "gemma", target="trn2", lnc=2)
    _bitwise((y, rstd), want)


def test_lnc2_on_neuroncore_v2_is_refused(rng):
    """``kernel[2]`` on trn1 / inf2 is an error naming the target (NeuronCore-v2 has no
    logical cores of two, and no NKI 0.x)."""
    x, _, w, _ = _inputs(rng, 8, 64, BF16, True, False, False)
    for target in ("trn1", "inf2"):
        with pytest.raises(ValueError, match=target):
            _launch("nki06", target, x, None, w, None, "gemma", lnc=2)
