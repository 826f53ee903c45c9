"""The RMSNorm backward kernel (``nki_rmsnorm.kernels.rmsnorm_bwd``) in the simulator, against
the float64 reference ``nki_rmsnorm.reference.rms_norm_bwd``.

Tolerances, per output (``ref`` = ``reference.rms_norm_bwd``: computed in float64 and rounded
once to the output dtype):

========================  =====================================================================
output                    accepted error
========================  =====================================================================
float32 dx                ``|dx − ref| ≤ 1e-5 · S`` with S the row's largest term (rstd·|g|,
                          rstd·|x̂·c| or |dh_out|): a handful of fp32 roundings (2⁻²⁴ each)
                          on terms of that size; dx itself may be far smaller after the
                          cancellation in g − x̂·c.
bf16 / fp16 dx            at most 1 ulp from ref (the kernel rounds an fp32 value once, so fp32
                          noise can tip a rounding to the neighbour), or the fp32 bound above
                          where dx is small next to its row's terms.
float32 dweight, dbias    ``|d − ref| ≤ 1e-5 · max|ref|``: fp32 products and fp32 accumulation
                          over M rows (one PSUM rounding per 128-row tile).
bf16 / fp16 dweight,      at most 1 ulp from ref (one rounding at the end), or the fp32 bound.
dbias
llama / none dweight      additionally the exact effect of one rounding difference: the kernel
                          rounds x̂ = x·rstd to fp32 and then to the input dtype, the reference
                          once from float64; the two differ by one ulp in rare near-tie cases
                          (≈ 2⁻¹⁶ of the elements for bf16, 2⁻¹³ for fp16), so each column
                          may be off by Σ |dy|·|twice − once| over its rows (usually 0), plus
                          one ulp of the output dtype (the final rounding).
========================  =====================================================================

Every output is a fresh ``nl.shared_hbm`` tensor that the simulator fills with NaN (its
uninitialised-memory value) before the kernel runs, so an element the kernel fails to write
shows up as NaN; every check below also requires the outputs to be finite where the
reference is.

Every test runs in both NKI dialects (the ``dialect`` parameter): the legacy kernel
(``nki_rmsnorm.kernels.legacy``) and the ``nki`` 0.6 one (``nki_rmsnorm.kernels.nki06``),
with the same tolerances, in every regime (``test_bwd_nki06.py`` has the 0.6 kernel's LNC=2
and trace-parity tests).
"""

from __future__ import annotations

import contextlib
import os

import ml_dtypes
import numpy as np
import pytest
from helpers import DEFAULT_TARGETS

import simulate
from nki_rmsnorm import reference
from nki_rmsnorm.kernels.legacy.rmsnorm_bwd import rmsnorm_bwd
from nki_rmsnorm.kernels.nki06 import rmsnorm_bwd as bwd06
from nki_rmsnorm.plan import backward as plan_bwd
from nki_rmsnorm.plan.backward import MAX_HIDDEN
from simulate import nki06

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
FP32_REL = 1e-5
V2_TARGETS = ("trn1", "inf2")


def _skip_nki06_on_v2(dialect, target):
    """NeuronCore-v2 targets run only the legacy dialect."""
    if dialect == "nki06" and target in V2_TARGETS:
        pytest.skip(
            "NKI 0.6 supports Trn2/Trn3 only (nki/nki_faq.rst L23-27); the legacy "
            "param covers NeuronCore-v2"
        )


@pytest.fixture(params=["legacy", "nki06"])
def dialect(request):
    """The NKI dialect whose backward kernel a test runs."""
    return request.param


@contextlib.contextmanager
def _on_target(target):
    """The 0.6 front-end picks its target from ``NEURON_PLATFORM_TARGET_OVERRIDE``."""
    name = "NEURON_PLATFORM_TARGET_OVERRIDE"
    saved = os.environ.get(name)
    os.environ[name] = target or DEFAULT_TARGETS["nki06"]
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _assert_close(out, ref, dtype, *, scale, extra=0.0, what=""):
    """``out`` (kernel) against ``ref`` (the reference, rounded to ``dtype``) with the
    table's rule: |err| ≤ 1e-5·scale (+ extra), or, for narrow dtypes, ≤ 1 ulp apart."""
    assert out.dtype == np.dtype(dtype), f"{what}: dtype {out.dtype}, expected {dtype}"
    assert out.shape == ref.shape, f"{what}: shape {out.shape}, expected {ref.shape}"
    out64, ref64 = out.astype(np.float64), ref.astype(np.float64)
    finite = np.isfinite(ref64)
    assert np.array_equal(np.isfinite(out64), finite), f"{what}: non-finite where ref is finite"
    err = np.where(finite, np.abs(out64 - ref64), 0.0)
    ok = err <= FP32_REL * scale + extra
    if np.dtype(dtype) != F32:
        ok |= reference.ulp_distance(out64, ref64, dtype) <= 1
        # the allowed deviation, then the kernel's one rounding to dtype on top of it
        ok |= err <= FP32_REL * scale + extra + np.abs(np.spacing(ref)).astype(np.float64)
    assert ok.all(), (
        f"{what}: {(~ok).sum()} of {ok.size} elements off, worst error {err[~ok].max():.3g} "
        f"at ref {ref64[~ok][np.argmax(err[~ok])]:.6g}"
    )


def _make_inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode, eps=1e-6):
    x = rng.standard_normal((M, N)).astype(dtype)
    dy = rng.standard_normal((M, N)).astype(dtype)
    weight = None if w_dtype is None else (1.0 + 0.5 * rng.standard_normal(N)).astype(w_dtype)
    dh_out = rng.standard_normal((M, N)).astype(dtype) if with_dh else None
    _, rstd = reference.rms_norm_fwd(x, weight, eps, offset=offset, casting_mode=mode)
    return dy, x, weight, rstd, dh_out


def _launch(dialect, *args, target=None):
    """Run the return-convention backward of ``dialect``: (outputs, trace)."""
    if dialect == "legacy":
        return simulate.trace_kernel(rmsnorm_bwd, *args, target=target)
    with _on_target(target):
        outs = nki06.simulate(bwd06.rmsnorm_bwd)(*args)
        return outs, nki06.last_trace()


def _run(dy, x, weight, rstd, dh_out, offset, has_bias, mode, target=None, dialect="legacy"):
    outs, _ = _launch(dialect, dy, x, weight, rstd, dh_out, offset, has_bias, mode, target=target)
    assert isinstance(outs, tuple)
    assert len(outs) == 1 + (weight is not None) + has_bias
    dx = outs[0]
    dweight = outs[1] if weight is not None else None
    dbias = outs[-1] if has_bias else None
    return dx, dweight, dbias


def _check_against_reference(
    dy, x, weight, rstd, dh_out, offset, has_bias, mode, target=None, dialect="legacy"
):
    dx, dweight, dbias = _run(dy, x, weight, rstd, dh_out, offset, has_bias, mode, target, dialect)
    ref_dx, ref_dw, ref_db = reference.rms_norm_bwd(
        dy, x, weight, rstd, offset=offset, has_bias=has_bias, dh_out=dh_out, casting_mode=mode
    )
    # dx is row-local: the fp32 bound scales with the row's largest term, rstd·|g|,
    # rstd·|x̂·c| or |dh_out| (dx itself can be far smaller after the cancellation).
    with np.errstate(invalid="ignore", over="ignore"):
        r = rstd.astype(np.float64)[:, None]
        xhat = x.astype(np.float64) * r
        g = dy.astype(np.float64)
        if weight is not None:
            g = g * (weight.astype(np.float64) + offset)
        c = np.abs(np.mean(g * xhat, axis=1, keepdims=True))
        terms = r * np.maximum(np.abs(g), np.abs(xhat) * c)
        if dh_out is not None:
            terms = np.maximum(terms, np.abs(dh_out.astype(np.float64)))
        row_scale = np.max(terms, axis=1, keepdims=True)
    _assert_close(dx, ref_dx, x.dtype, scale=row_scale, what="dx")

    if weight is not None:
        extra = 0.0
        if mode != "gemma" and x.dtype != F32:
            # The kernel rounds x̂ to fp32 (x·rstd) and then to x's dtype; the reference rounds
            # once. Allow exactly the columns' share of the rare double-rounding differences.
            once = reference.round_to(xhat, x.dtype)
            twice = xhat.astype(np.float32).astype(x.dtype).astype(np.float64)
            extra = (np.abs(dy.astype(np.float64)) * np.abs(twice - once)).sum(axis=0)
        _assert_close(
            dweight,
            ref_dw,
            weight.dtype,
            scale=np.abs(ref_dw.astype(np.float64)).max(),
            extra=extra,
            what="dweight",
        )
    else:
        assert dweight is None
    if has_bias:
        _assert_close(
            dbias, ref_db, ref_db.dtype, scale=np.abs(ref_db.astype(np.float64)).max(), what="dbias"
        )


# (M, N, x dtype, weight dtype or None, offset, bias, dh_out, casting mode): a covering
# design over rows, hidden sizes, dtypes, options and modes, not the cross product. The
# hidden sizes also cover the kernel's tilings on the default target (trn1): one or more
# column groups per row (2048, 1024 and 512 wide), ragged groups, chunks and 128-column
# blocks, one or more row tiles with a ragged last one, and rows folded over 2 or 8
# partitions.
CASES = [
    (1, 1, F32, F32, 0.0, False, False, "gemma"),
    (2, 3, BF16, BF16, 1.0, True, False, "llama"),
    (127, 64, F16, None, 0.0, True, True, "gemma"),
    (128, 100, BF16, F32, 0.5, False, True, "none"),
    (129, 1024, F32, F32, 0.0, True, True, "llama"),
    (1000, 64, BF16, BF16, 0.0, False, False, "gemma"),
    (4097, 100, BF16, BF16, 1.0, True, True, "gemma"),
    (129, 4096, BF16, BF16, 0.0, True, False, "gemma"),
    (128, 5120, F16, F32, 1.0, False, False, "llama"),
    (200, 8192, F32, F32, 0.0, True, False, "none"),
    (129, 16384, BF16, BF16, 0.0, False, True, "none"),
    (2, 16384, F32, F32, 1.0, True, False, "gemma"),  # folded over 2 partitions
    (127, 20000, BF16, BF16, 0.0, True, True, "llama"),  # folded over 2
    (129, 20000, F32, None, 0.0, True, False, "gemma"),  # folded over 2, 3 row tiles
    (37, 32768, BF16, F32, 1.0, True, True, "llama"),  # folded over 2
    (2, 65536, F32, F32, 1.0, True, True, "gemma"),  # folded over 8
]


@pytest.mark.parametrize(
    "M, N, dtype, w_dtype, offset, has_bias, with_dh, mode",
    CASES,
    ids=[
        f"{c[0]}x{c[1]}-{c[2].name}-w{c[3].name if c[3] else 'none'}-off{c[4]}"
        f"{'-bias' if c[5] else ''}{'-dh' if c[6] else ''}-{c[7]}"
        for c in CASES
    ],
)
def test_matches_reference(dialect, M, N, dtype, w_dtype, offset, has_bias, with_dh, mode):
    rng = np.random.default_rng([M, N, len(mode)])
    inputs = _make_inputs(rng, M, N, dtype, w_dtype, offset, with_dh, mode)
    _check_against_reference(*inputs, offset, has_bias, mode, dialect=dialect)


def test_deterministic_and_batch_invariant(dialect):
    """Two runs are bitwise identical; a row's dx does not depend on the other rows."""
    rng = np.random.default_rng(7)
    M, N = 300, 3000
    dy, x, weight, rstd, _ = _make_inputs(rng, M, N, BF16, BF16, 1.0, False, "gemma")
    first = _run(dy, x, weight, rstd, None, 1.0, True, "gemma", dialect=dialect)
    second = _run(dy, x, weight, rstd, None, 1.0, True, "gemma", dialect=dialect)
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()
    for lo, hi in ((5, 133), (299, 300), (128, 256)):
        part = _run(
            dy[lo:hi], x[lo:hi], weight, rstd[lo:hi], None, 1.0, True, "gemma", dialect=dialect
        )
        assert part[0].tobytes() == first[0][lo:hi].tobytes()


def test_zero_rows(dialect):
    """All-zero rows of x (rstd = 1/sqrt(eps)) give dx = rstd·g and contribute nothing to
    dweight."""
    rng = np.random.default_rng(11)
    M, N = 130, 200
    x = rng.standard_normal((M, N)).astype(BF16)
    x[[0, 64, 129]] = 0
    dy = rng.standard_normal((M, N)).astype(BF16)
    weight = rng.standard_normal(N).astype(F32)
    _, rstd = reference.rms_norm_fwd(x, weight, 1e-5)
    _check_against_reference(dy, x, weight, rstd, None, 0.0, True, "gemma", dialect=dialect)


def test_nan_row_stays_in_its_row(dialect):
    """A NaN in one row of x makes that row's dx NaN and dweight NaN (a column sum over
    rows), but leaves every other row's dx and dbias exact."""
    rng = np.random.default_rng(13)
    M, N = 200, 300
    dy, x, weight, rstd, _ = _make_inputs(rng, M, N, F32, F32, 0.0, False, "gemma")
    x[150, 17] = np.nan
    _, rstd = reference.rms_norm_fwd(x, weight, 1e-6)
    dx, dweight, dbias = _run(dy, x, weight, rstd, None, 0.0, True, "gemma", dialect=dialect)
    ref_dx, _, ref_db = reference.rms_norm_bwd(dy, x, weight, rstd, has_bias=True)
    assert np.isnan(dx[150]).all()
    others = np.arange(M) != 150
    assert np.isfinite(dx[others]).all()
    scale = np.abs(ref_dx[others]).max()
    assert np.abs(dx[others] - ref_dx[others]).max() <= FP32_REL * scale
    assert np.isnan(dweight).all()
    assert np.abs(dbias - ref_db).max() <= FP32_REL * np.abs(ref_db).max()


def test_fp16_large_values(dialect):
    """fp16 inputs near the top of the range: every statistic is fp32, nothing overflows."""
    rng = np.random.default_rng(17)
    M, N = 129, 512
    x = np.clip(20000 * rng.standard_normal((M, N)), -65000, 65000).astype(F16)
    dy = np.clip(300 * rng.standard_normal((M, N)), -65000, 65000).astype(F16)
    weight = rng.standard_normal(N).astype(F16)
    _, rstd = reference.rms_norm_fwd(x, weight, 1e-6)
    _check_against_reference(dy, x, weight, rstd, None, 0.0, True, "gemma", dialect=dialect)


def _hbm_bytes_per_tensor(trace):
    """HBM bytes each DMA'd tensor had read and written: two {storage id: bytes} dicts."""
    read, written = {}, {}
    for inst in trace.select(engine="dma"):
        for regions, totals in ((inst.reads, read), (inst.writes, written)):
            for region in regions:
                if region is not None and region.memory == "hbm":
                    totals[region.storage] = totals.get(region.storage, 0) + inst.dma_bytes
    return read, written


def _remove_each(values, wanted, what):
    """``values`` without one occurrence of each of ``wanted`` (all must be there)."""
    rest = list(values)
    for w in wanted:
        assert w in rest, f"{what}: no tensor moved exactly {w} bytes ({sorted(values)})"
        rest.remove(w)
    return rest


@pytest.mark.parametrize("M, N", [(257, 1000), (37, 40000)])
def test_reads_each_input_once(dialect, M, N):
    """dy, x, dh_out, weight and rstd are read from HBM once (the weight twice where the
    row dot runs on the Tensor engine, which needs its column layout too) and dx, dweight,
    dbias written once, folded rows (N = 40000) included; the only other traffic is the
    small per-row-tile rstd table the kernel writes and reads back (under 1 % of the minimal
    bytes) and two 128×128 bf16 identity matrices (for x and dh_out)."""
    rng = np.random.default_rng(19)
    dy, x, weight, rstd, dh_out = _make_inputs(rng, M, N, BF16, BF16, 0.0, True, "gemma")
    _, trace = _launch(dialect, dy, x, weight, rstd, dh_out, 0.0, True, "gemma")
    read, written = _hbm_bytes_per_tensor(trace)
    spec = simulate.get_target(DEFAULT_TARGETS[dialect])
    dtypes = plan_bwd.BwdDtypes(BF16, BF16, BF16, BF16)
    plan = plan_bwd.make_plan(
        N, dtypes, 0.0, "gemma", spec.sbuf_bytes_per_partition, spec.nc_version >= 3
    )
    # with the row dot on the Tensor engine the weight is read once more, down the
    # partitions (its column layout): N elements
    weight_reads = 2 if plan.row_dot_on_pe else 1
    minimal_read = [2 * M * N] * 3 + [2 * N * weight_reads, 4 * M]
    minimal_written = [2 * M * N, 2 * N, 2 * N]
    extra = sum(_remove_each(read.values(), minimal_read, "read")) + sum(
        _remove_each(written.values(), minimal_written, "written")
    )
    identities = 2 * 128 * 128 * 2
    assert 0 < extra <= 0.01 * (sum(minimal_read) + sum(minimal_written)) + identities
    assert (
        trace.sbuf_peak_bytes_per_partition
        <= simulate.get_target(DEFAULT_TARGETS[dialect]).sbuf_bytes_per_partition
    )


def test_folded_rows_keep_nans_and_batch_invariance(dialect):
    """With rows folded over several partitions (N = 24576 bf16 on trn1), a row's dx does
    not depend on the other rows, and a NaN in dy or x leaves every other row's dx bitwise
    unchanged (no data tile passes through a matmul, where 0 · NaN would spread it)."""
    rng = np.random.default_rng(29)
    M, N = 70, 24576
    dy, x, weight, rstd, _ = _make_inputs(rng, M, N, BF16, BF16, 0.0, False, "gemma")
    first = _run(dy, x, weight, rstd, None, 0.0, False, "gemma", dialect=dialect)
    part = _run(dy[3:40], x[3:40], weight, rstd[3:40], None, 0.0, False, "gemma", dialect=dialect)
    assert part[0].tobytes() == first[0][3:40].tobytes()
    dy[40, 5] = np.nan
    x[10, 100] = np.nan
    rstd[10] = reference.rms_norm_fwd(x[10:11], weight, 1e-6)[1][0]
    dx, dweight, _ = _run(dy, x, weight, rstd, None, 0.0, False, "gemma", dialect=dialect)
    assert np.isnan(dx[40]).any() and np.isnan(dx[10]).all()
    others = (np.arange(M) != 40) & (np.arange(M) != 10)
    assert dx[others].tobytes() == first[0][others].tobytes()
    assert np.isnan(dweight).all()


@pytest.mark.parametrize("target", ["inf2", "trn2", "trn3"])
def test_other_targets(dialect, target):
    """The kernel runs within every target's limits (the engines of dy·x depend on the
    NeuronCore generation, see the kernel) and matches the reference, and a row's dx is the
    same in any batch there too."""
    _skip_nki06_on_v2(dialect, target)
    rng = np.random.default_rng(23)
    for mode, w_dtype in (("gemma", BF16), ("llama", F32)):
        dy, x, weight, rstd, dh_out = _make_inputs(rng, 130, 2100, BF16, w_dtype, 1.0, True, mode)
        _check_against_reference(dy, x, weight, rstd, dh_out, 1.0, True, mode, target, dialect)
    dx = _run(dy, x, weight, rstd, dh_out, 1.0, True, mode, target, dialect)[0]
    part = _run(
        dy[7:99], x[7:99], weight, rstd[7:99], dh_out[7:99], 1.0, True, mode, target, dialect
    )
    assert part[0].tobytes() == dx[7:99].tobytes()


@pytest.mark.parametrize("dialect", ["legacy"])  # nki06 never runs on NeuronCore-v2
def test_dy_times_x_engines_give_the_same_bits(dialect):
    """Two bf16 tiles: dy·x from SBUF as ``(dy − 0)·x`` on NeuronCore-v2 (trn1) and -v3
    (trn2) alike; the row dot on the Vector engine on v2 and on the Tensor engine on v3.
    With the same tiling dweight and dbias are bitwise the same (the fp32 product of two
    bf16 values is exact, subtracting 0 changes no bit, the column sums run in the same
    order), and dx is within the reference bounds on both."""
    _skip_nki06_on_v2(dialect, "trn1")
    rng = np.random.default_rng(31)
    M, N = 150, 3000
    dy, x, weight, rstd, dh_out = _make_inputs(rng, M, N, BF16, BF16, 0.0, True, "gemma")
    dtypes = plan_bwd.BwdDtypes(BF16, BF16, BF16, BF16)
    plans = [
        plan_bwd.make_plan(
            N,
            dtypes,
            0.0,
            "gemma",
            simulate.get_target(target).sbuf_bytes_per_partition,
            version >= 3,
        )
        for target, version in (("trn1", 2), ("trn2", 3))
    ]
    assert [plan.x_from_psum for plan in plans] == [False, False]
    assert [plan.row_dot_on_pe for plan in plans] == [False, True]
    assert (plans[0].fold, plans[0].group) == (plans[1].fold, plans[1].group)
    on_v2 = _run(dy, x, weight, rstd, dh_out, 0.0, True, "gemma", "trn1", dialect)
    on_v3 = _run(dy, x, weight, rstd, dh_out, 0.0, True, "gemma", "trn2", dialect)
    for v2, v3 in zip(on_v2[1:], on_v3[1:]):
        assert v2.tobytes() == v3.tobytes()
    for target in ("trn1", "trn2"):
        _check_against_reference(dy, x, weight, rstd, dh_out, 0.0, True, "gemma", target, dialect)


def test_planner_keeps_the_psum_copy_of_x_where_it_pays():
    """The plan multiplies dy·x from SBUF on NeuronCore-v2, and on v3+ for two bf16 tiles
    (N cycles by the documented rule, no copy), where dweight sums dy·x (gemma, or a 4-byte
    x): llama / none need the PSUM copy of x for p1·x anyway. (The plan is shared by both
    dialects.)"""
    psum, sbuf = True, False
    budget = simulate.get_target("trn1").sbuf_bytes_per_partition
    for x_dtype, mode, version, want in (
        (BF16, "gemma", 2, sbuf),
        (F32, "llama", 2, sbuf),
        (BF16, "llama", 2, psum),
        (BF16, "gemma", 3, sbuf),
        (BF16, "gemma", 4, sbuf),
        (F16, "gemma", 3, psum),
        (F32, "gemma", 4, psum),
    ):
        dtypes = plan_bwd.BwdDtypes(x_dtype, x_dtype, BF16, None)
        plan = plan_bwd.make_plan(4096, dtypes, 0.0, mode, budget, version >= 3)
        assert plan.x_from_psum == want, (x_dtype, mode, version)


@pytest.mark.parametrize(("N", "vector_blocks"), [(1000, [5]), (3000, [5, 11, 17, 23]), (640, [])])
def test_trn3_row_dot_splits_by_128_column_block(N, vector_blocks):
    """On NeuronCore-v4 one 128-column block in VECTOR_ROW_DOT_EVERY (6) of every row takes
    the Vector row dot (the same blocks in every row: batch invariance), each with its own
    partial column; the Tensor-engine runs end where a Vector block starts."""
    dtypes = plan_bwd.BwdDtypes(BF16, BF16, BF16, None)
    budget = simulate.get_target("trn3").sbuf_bytes_per_partition
    plan = plan_bwd.make_plan(N, dtypes, 0.0, "gemma", budget, True, True)
    assert plan.row_dot_on_pe and plan.vector_row_dot_every == 6
    blocks = -(-N // 128)
    chosen = [b for b in range(blocks) if plan_bwd.vector_row_dot_block(plan, b * 128)]
    assert chosen == vector_blocks
    assert plan_bwd.partial_columns(plan) == max(1, len(vector_blocks))
    assert plan_bwd.has_vector_row_dot(plan) == bool(vector_blocks)
    for b in range(blocks):
        if b not in vector_blocks:
            end = plan_bwd.tensor_row_dot_end(plan, b * 128, N)
            following = [v for v in vector_blocks if v > b]
            assert end == (following[0] * 128 if following else N)
    on_v3 = plan_bwd.make_plan(N, dtypes, 0.0, "gemma", budget, True, False)
    assert plan_bwd.tensor_row_dot_end(on_v3, 0, N) == N
    assert not plan_bwd.has_vector_row_dot(on_v3)


def test_hidden_size_limit(dialect):
    """Past MAX_HIDDEN the PSUM accumulators would not fit: a clear error, not a wrong
    answer (the kernel's own check is an ``assert``, as AWS's kernels check; the bindings
    raise ValueError before any launch)."""
    N = MAX_HIDDEN + 1
    x = np.ones((1, N), np.float32)
    with pytest.raises(AssertionError, match=f"hidden size {N}"):
        _launch(dialect, x, x, x[0], np.ones(1, np.float32), None, 0.0, False, "gemma")


def test_rows_that_neither_fit_nor_fold_are_streamed(dialect):
    """N = 30,001 (bf16 on trn1, fp32 on trn2, where 0.6 runs) does not fit SBUF and has no
    power-of-two factor to fold it by: the streamed regime re-reads the rows (≈ 1.67× the
    minimal HBM bytes) and is exact."""
    rng = np.random.default_rng(30001)
    M, N = 130, 30001
    target = DEFAULT_TARGETS[dialect]
    dtype = BF16 if dialect == "legacy" else F32
    inputs = _make_inputs(rng, M, N, dtype, dtype, 0.5, True, "gemma")
    _check_against_reference(*inputs, 0.5, True, "gemma", target, dialect)
    dy, x, weight, rstd, dh_out = inputs
    _, trace = _launch(dialect, dy, x, weight, rstd, dh_out, 0.5, True, "gemma", target=target)
    read, _ = trace.hbm_bytes()
    assert read > 2 * 3 * M * N  # dy and x (and dh_out) read twice, not folded


def test_planner_reads_nki_dtypes_as_the_tests_numpy_ones():
    """The kernels hand the planner ``nki.language`` dtypes (NKI values only), the tests NumPy
    ones: the same sizes and the same plans, folded and streamed."""
    from nki_rmsnorm.kernels.nki06._nki import nl

    pairs = ((BF16, nl.bfloat16), (F16, nl.float16), (F32, nl.float32))
    for numpy_dtype, nki_dtype in pairs:
        assert plan_bwd.dtype_bytes(nki_dtype) == plan_bwd.dtype_bytes(numpy_dtype)
        assert plan_bwd.dtype_bytes(nki_dtype) == numpy_dtype.itemsize
    budget = simulate.get_target("trn1").sbuf_bytes_per_partition
    for (numpy_dtype, nki_dtype), mode in zip(pairs, ("gemma", "llama", "none")):
        for N in (4096, 40960):
            plans = [
                plan_bwd.make_plan(N, plan_bwd.BwdDtypes(d, d, d, None), 0.0, mode, budget, False)
                for d in (numpy_dtype, nki_dtype)
            ]
            assert plans[0] == plans[1]
        streamed = [
            plan_bwd.make_streamed_plan(30001, d, d, d, mode, budget)
            for d in (numpy_dtype, nki_dtype)
        ]
        assert streamed[0] == streamed[1]
    folded = plan_bwd.make_plan(
        40960,
        plan_bwd.BwdDtypes(nl.bfloat16, nl.bfloat16, nl.bfloat16, None),
        0.0,
        "gemma",
        budget,
        False,
    )
    stacked = plan_bwd.SPLIT if folded.rstd_parts == 1 else 1
    assert folded.fold > 1 and folded.stationary_rows == folded.kw * folded.fold * stacked
