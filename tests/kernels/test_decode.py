"""Decode batches (at most ``DECODE_MAX_ROWS`` rows) on NeuronCore-v3+, nki06 kernels: where
the row statistics are grouped (``plan.forward.statistic_groups``) they run the "split"
regime, each row over G partitions, and larger batches "rows" with the same grouped
statistics. The batch invariance this must keep: a row's y, h and rstd are bitwise the same
in a batch of one row, of 29 rows and of 200 rows, for every kernel dtype, casting mode and
option, including rows of Inf, NaN, zeros and extreme magnitudes; and N not a multiple of
128 (17389, 127, 1) against the float64 reference. The legacy kernels keep whole-row
statistics on every target (``choose_layout(..., grouped=False)``) and run decode batches
in "spread" (``rmsnorm_fwd_spread``), bitwise "rows" too; the same checks run for them."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import BF16, poison, trace_launch
from test_fwd import _inputs, check_forward

import simulate
from nki_rmsnorm import kernels
from nki_rmsnorm.plan.forward import (
    DECODE_MAX_ROWS,
    DECODE_MAX_ROWS_FUSED,
    DECODE_MIN_GROUPS,
    GROUP_MIN_COLUMNS,
    GROUP_MIN_COLUMNS_NC_V3,
    SPREAD_MAX_ROWS,
    choose_layout,
    group_width,
    make_plan,
    statistic_groups,
)

FP32, FP16 = np.dtype(np.float32), np.dtype(np.float16)
EPS = 1e-6


def _layout(target, M, N, dtype, residual=None, grouped=True):
    """(layout, G) the planner gives; ``grouped``: the nki06 kernels' plan (the legacy
    kernels pass False)."""
    spec = simulate.get_target(target)
    plan = make_plan(
        dtype,
        dtype,
        None,
        residual,
        0.0,
        "gemma",
        None,
        FP32,
        BF16,
        tensor_engine=spec.nc_version >= 3,
        # as the nki06 kernel plans (rmsnorm_fwd._plan)
        group_min_columns=GROUP_MIN_COLUMNS_NC_V3 if spec.nc_version == 3 else GROUP_MIN_COLUMNS,
    )
    budget = spec.sbuf_bytes_per_partition
    return choose_layout(plan, M, N, budget, grouped=grouped), statistic_groups(plan, N, budget)


@pytest.mark.parametrize(
    "target, N, groups",
    [
        ("trn3", 4096, 4),
        ("trn3", 8192, 8),
        ("trn3", 2048, 2),
        # NeuronCore-v3: groups of 512 columns (GROUP_MIN_COLUMNS_NC_V3)
        ("trn2", 4096, 8),
        ("trn2", 8192, 16),
        ("trn2", 1024, 2),
    ],
)
def test_planner_spreads_small_batches_only(target, N, groups):
    """Decode batches take "split" with G segments, larger ones "rows" with G groups; N
    and the target alone decide G. Rows of fewer than ``DECODE_MIN_GROUPS`` groups take
    "split" only while the batch fits one split tile."""
    spec = simulate.get_target(target)

    def limit(rows, cores=1):
        return rows * cores if groups >= DECODE_MIN_GROUPS else 128 * cores // groups

    for M in (1, 8, 29, limit(DECODE_MAX_ROWS)):
        layout, g = _layout(target, M, N, BF16)
        assert g == groups and layout.regime == "split" and layout.segments == groups, M
    for M in (limit(DECODE_MAX_ROWS) + 1, 8192):
        layout, g = _layout(target, M, N, BF16)
        assert layout.regime == "rows" and layout.groups == groups, M
    # per core: twice the rows under LNC=2
    budget = spec.sbuf_bytes_per_partition
    columns = GROUP_MIN_COLUMNS_NC_V3 if spec.nc_version == 3 else GROUP_MIN_COLUMNS
    plan = make_plan(
        BF16,
        BF16,
        None,
        None,
        0.0,
        "gemma",
        None,
        FP32,
        BF16,
        tensor_engine=True,
        group_min_columns=columns,
    )
    most = limit(DECODE_MAX_ROWS, cores=2)
    assert choose_layout(plan, most, N, budget, cores=2).regime == "split"
    assert choose_layout(plan, most + 1, N, budget, cores=2).regime == "rows"
    # with a residual, up to DECODE_MAX_ROWS_FUSED rows
    assert _layout(target, limit(DECODE_MAX_ROWS_FUSED), N, BF16, FP32)[0].regime == "split"
    assert _layout(target, limit(DECODE_MAX_ROWS_FUSED) + 1, N, BF16, FP32)[0].regime == "rows"


@pytest.mark.parametrize(
    "N, M, segments", [(4096, 1, 128), (4096, 8, 16), (4096, 29, 4), (8192, 32, 4), (1000, 1, 8)]
)
def test_planner_spreads_small_batches_on_neuroncore_v2(N, M, segments):
    """trn1 (no exact transpose): batches of at most ``SPREAD_MAX_ROWS`` rows, with or
    without a residual, take "spread" with the largest power of two dividing N that keeps
    them on 128 partitions; larger batches and N with no even divisor (17389) "rows"."""
    layout, groups = _layout("trn1", M, N, BF16)
    assert groups == 0 and layout.regime == "spread" and layout.segments == segments
    assert _layout("trn1", M, N, BF16, FP32)[0].regime == "spread"
    assert _layout("trn1", SPREAD_MAX_ROWS + 1, N, BF16)[0].regime == "rows"
    assert _layout("trn1", SPREAD_MAX_ROWS + 1, N, BF16, FP32)[0].regime == "rows"
    assert _layout("trn1", 8, 17389, BF16)[0].regime == "rows"


def test_planner_keeps_whole_row_statistics_elsewhere():
    """trn1 (no exact transpose), rows too short to group or not divisible, and the legacy
    kernels' plan (``grouped=False``: whole-row statistics, decode batches in "spread"):
    no groups."""
    assert _layout("trn1", 1, 4096, BF16)[1] == 0
    assert _layout("trn1", 8192, 4096, BF16)[0].groups == 0
    for target, N in [("trn2", n) for n in (1, 127, 1000)] + [("trn3", 1536)]:
        layout, groups = _layout(target, 1, N, BF16)
        assert groups == 0 and layout.groups == 0, N
    assert _layout("trn2", 1, 1536, BF16)[1] == 2  # 2 groups of 768 on NeuronCore-v3
    for target in ("trn2", "trn3"):
        assert _layout(target, 1, 4096, BF16, grouped=False)[0].regime == "spread"
        layout = _layout(target, 8192, 4096, BF16, grouped=False)[0]
        assert layout.regime == "rows" and layout.groups == 0


@pytest.mark.parametrize(
    "target, N, groups, width", [("trn2", 17389, 32, 544), ("trn3", 17389, 16, 1087)]
)
def test_planner_groups_odd_rows_unevenly(target, N, groups, width):
    """N without a power-of-two divisor: G − 1 groups of ⌈N / G⌉ columns and the rest in
    the last, chosen by N alone; decode batches "split" over G partitions per row, larger
    ones "rows" with the same groups."""
    for M in (1, 29, 128):
        layout, g = _layout(target, M, N, BF16)
        assert g == groups and layout.regime == "split" and layout.segments == groups, M
    layout, g = _layout(target, 2048, N, BF16)
    assert layout.regime == "rows" and layout.groups == groups
    assert group_width(N, groups) == width and 0 < N - (groups - 1) * width < width


def _edge_rows(x):
    """Rows 0–5 of ``x`` made IEEE edge cases: an Inf, a NaN, all zeros, huge, tiny and
    a single non-zero element."""
    x[0, 3] = np.inf
    x[1, -1] = np.nan
    x[2] = 0
    # huge and tiny, yet with squares (and their sum) finite and normal in fp32
    big, tiny = (200.0, 1e-2) if x.dtype == FP16 else (1e15, 1e-15)
    x[3] = (x[3].astype(np.float64) * big).astype(x.dtype)
    x[4] = (x[4].astype(np.float64) * tiny).astype(x.dtype)
    x[5] = 0
    x[5, 7] = 3
    return x


def _run(dialect, target, x, weight, bias, residual, mode, eps=EPS):
    common = (weight, bias, eps, 0.0, mode, None)
    if residual is None:
        kernel = kernels.kernel("rmsnorm_fwd", dialect)
        return trace_launch(kernel, x, *common, target=target)
    kernel = kernels.kernel("rmsnorm_add_fwd", dialect)
    return trace_launch(kernel, x, residual, *common, target=target)


# (target, N, x dtype, casting mode, weight, bias, residual dtype)
INVARIANCE_CASES = [
    ("trn2", 4096, BF16, "gemma", True, False, None),  # "tensor" product, 3 bf16 pieces
    ("trn2", 4096, FP32, "gemma", True, True, None),  # "tensor", 1 fp32 piece, bias
    ("trn2", 4096, FP16, "llama", True, True, FP32),  # "vector", x̂ rounded, fused add
    ("trn3", 4096, BF16, "none", False, True, BF16),  # "vector", no weight
    ("trn2", 2048, BF16, "gemma", True, True, BF16),  # G = 4, fused add
    ("trn3", 8192, FP32, "gemma", False, False, None),  # rstd only
    # odd N: G − 1 groups of ⌈N / G⌉ and a narrower, zero-padded last one
    ("trn2", 17389, BF16, "gemma", True, False, None),  # G = 32, "tensor" product
    ("trn3", 8191, FP16, "llama", True, False, FP16),  # G = 8 of 1024 and 1023, fused add
    ("trn2", 4097, FP32, "none", False, True, None),  # G = 8 of 513 and 506, no weight
    # NeuronCore-v2 decode batches run "spread" (whole-row statistics; legacy kernels only)
    ("trn1", 4096, BF16, "gemma", True, True, FP32),  # "scalar" product, bias, fused add
    ("trn1", 2048, FP32, "llama", True, False, None),  # x̂ rounded
    ("trn1", 8192, FP16, "none", False, True, None),  # no weight
]


@pytest.mark.parametrize("case", INVARIANCE_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_row_results_do_not_depend_on_the_batch(kernel_dialect, rng, case):
    target, N, dtype, mode, weight, bias, residual_dtype = case
    if target == "trn1" and kernel_dialect != "legacy":
        pytest.skip(
            "NKI 0.6 has no NeuronCore-v2 target (aws-neuron-sdk@81ce03ae nki_faq.rst L23-27)"
        )
    x = _edge_rows(rng.standard_normal((200, N)).astype(dtype))
    w = rng.normal(1.0, 0.2, N).astype(dtype) if weight else None
    b = rng.normal(0.0, 0.5, N).astype(FP32) if bias else None
    r = None if residual_dtype is None else rng.standard_normal((200, N)).astype(residual_dtype)
    residual = None if r is None else r.dtype
    grouped = kernel_dialect == "nki06"
    assert _layout(target, 200, N, dtype, residual, grouped)[0].regime == "rows"
    # the legacy kernels' "spread" needs an even N; odd rows stay whole in "rows"
    decode = "split" if grouped else ("spread" if N % 2 == 0 else "rows")
    assert _layout(target, 29, N, dtype, residual, grouped)[0].regime == decode
    big, _ = _run(kernel_dialect, target, x, w, b, r, mode)
    # 1 and 8 rows: one tile, y formed in the spread layout (rmsnorm_fwd_split)
    for M in (1, 8, 29):
        small_r = None if r is None else r[:M].copy()
        small, _ = _run(kernel_dialect, target, x[:M].copy(), w, b, small_r, mode)
        for got, want in zip(small, big):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(
                got.view(np.uint8), want[:M].view(np.uint8), err_msg=f"M={M}"
            )
    # the edge rows: Inf → rstd 0, NaN → NaN, zeros → y 0 (eps > 0, no bias)
    rstd = big[-1]
    if residual_dtype is None:
        assert rstd[0] == 0 and np.isnan(rstd[1])
        assert bias or np.all(big[0][2] == 0)


@pytest.mark.parametrize("M", [1, 8, 29, 64])
@pytest.mark.parametrize("N", [4096, 17389, 127, 1])
def test_decode_shapes_match_the_reference(kernel_dialect, rng, M, N):
    """Decode batches (N = 17389 and the short rows of other regimes too) in each dialect
    against the float64 reference, with ``test_fwd``'s tolerances."""
    inputs = _inputs(rng, M, N, BF16, bias=N == 17389, residual=M == 8)
    check_forward(inputs, target="trn2")


@pytest.mark.parametrize("eps", [EPS, 0.0])
@pytest.mark.parametrize("N", [4096, 9999])
def test_decode_writes_every_output_against_float64(rng, eps, N):
    """The output-parameter kernel writes every element of poisoned outputs; y and rstd
    match the float64 reference, Inf/NaN/zero/extreme rows included (odd N: 16 uneven
    groups, the last zero-padded)."""
    M = 29
    layout, groups = _layout("trn2", M, N, FP32)
    assert layout.regime == "split" and layout.segments == groups > 1
    x = _edge_rows(rng.standard_normal((M, N)).astype(FP32))
    w = rng.normal(1.0, 0.2, N).astype(FP32)
    y, rstd = poison((M, N), FP32), poison((M,), FP32)
    kernel = kernels.kernel("rmsnorm_fwd_out", "nki06")
    trace_launch(kernel, x, w, None, y, rstd, eps, 0.0, "gemma", target="trn2")
    x64 = x.astype(np.float64)
    with np.errstate(all="ignore"):
        want_rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1) + eps)
        want_y = x64 * want_rstd[:, None] * w
    finite = np.isfinite(want_rstd) & np.isfinite(np.mean(x64 * x64, axis=1))
    np.testing.assert_allclose(rstd[finite], want_rstd[finite], rtol=2e-6)
    np.testing.assert_allclose(y[finite], want_y[finite], rtol=2e-5, atol=1e-30)
    assert rstd[0] == 0 and np.isnan(rstd[1])  # Σ = inf → rstd 0; NaN stays NaN
    assert np.isnan(y[0, 3]) and np.all(y[0, :3] == 0) and np.all(np.isnan(y[1]))
    if eps == 0.0:
        assert rstd[2] == np.inf and np.all(np.isnan(y[2]))
    else:
        assert np.all(y[2] == 0)


@pytest.mark.parametrize("M", [1, 29, 200])
@pytest.mark.parametrize("N", [4096, 17389])
def test_lnc2_decode_is_bitwise_lnc1(rng, M, N):
    """Under LNC=2 the split tiles of a decode batch are shared by the two cores (200 rows:
    split at LNC=2, rows at LNC=1; 17389: uneven groups); every output is bitwise that of
    LNC=1."""
    x = (
        _edge_rows(rng.standard_normal((M, N)).astype(BF16))
        if M > 5
        else (rng.standard_normal((M, N)).astype(BF16))
    )
    w = rng.normal(1.0, 0.2, N).astype(BF16)
    kernel = kernels.kernel("rmsnorm_fwd", "nki06")
    args = (x, w, None, EPS, 0.0, "gemma", None)
    one, _ = trace_launch(kernel, *args, target="trn2")
    two, _ = trace_launch(kernel, *args, target="trn2", lnc=2)
    for got, want in zip(two, one):
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def _check_nonfinite_weight(y, x, w, eps, rtol, atol):
    """y against the float64 reference for a weight with ±Inf and NaN elements: exactly the
    columns IEEE makes non-finite are (x·rstd·w, x finite and non-zero), with the reference's
    sign of infinity; the finite columns match to ``rtol`` (``atol``: fp16's subnormals)."""
    x64 = x.astype(np.float64)
    rstd = 1.0 / np.sqrt(np.mean(x64 * x64, axis=1) + eps)
    with np.errstate(all="ignore"):
        want = x64 * rstd[:, None] * w.astype(np.float64)
    y64 = y.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(y64), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y64), np.isinf(want))
    inf = np.isinf(want)
    np.testing.assert_array_equal(np.sign(y64[inf]), np.sign(want[inf]))
    finite = np.isfinite(want)
    np.testing.assert_allclose(y64[finite], want[finite], rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "target, N, dtype, mode",
    [
        ("trn2", 4096, BF16, "gemma"),  # "tensor" product, 3 bf16 pieces
        ("trn2", 4096, FP32, "gemma"),  # "tensor", 1 fp32 piece
        ("trn3", 8192, BF16, "gemma"),
        ("trn2", 4096, FP16, "llama"),  # "vector" product
    ],
)
def test_non_finite_weight_stays_in_its_column(rng, target, N, dtype, mode):
    """A weight with +Inf, −Inf and NaN elements (one in each of three segments) and a −0: a
    decode batch (split) and a large batch (rows, the weight under the Tensor engine) give
    bitwise the same rows, and each matches the float64 reference, non-finite in those
    columns only."""
    w = rng.normal(1.0, 0.2, N).astype(dtype)
    F = N // statistic_groups_for(target, N, dtype)
    w[5], w[F + 17], w[2 * F + 100] = np.inf, -np.inf, np.nan
    w[F + 1] = -0.0  # y = ±0 with the sign of x·(−0) in both regimes
    x = rng.standard_normal((200, N)).astype(dtype)
    x[x == 0] = 1  # x·Inf is NaN at x = 0; keep the expected pattern per column
    assert _layout(target, 29, N, dtype)[0].regime == "split"
    assert _layout(target, 200, N, dtype)[0].regime == "rows"
    rtol, atol = (2e-5, 1e-30) if dtype == FP32 else (1e-2, 4 * 2.0**-24)
    big, _ = _run("nki06", target, x, w, None, None, mode)
    _check_nonfinite_weight(big[0], x, w, EPS, rtol, atol)
    small, _ = _run("nki06", target, x[:29].copy(), w, None, None, mode)
    _check_nonfinite_weight(small[0], x[:29], w, EPS, rtol, atol)
    for got, want in zip(small, big):
        np.testing.assert_array_equal(got.view(np.uint8), want[:29].view(np.uint8))


def statistic_groups_for(target, N, dtype):
    return _layout(target, 1, N, dtype)[1]


@pytest.mark.parametrize(
    "N, M, dtype, regime",
    [
        (32768, 20, BF16, "split"),
        (32768, 20, FP32, "split"),
        (128, 300, BF16, "packed"),
        (65537, 4, BF16, "long"),
    ],
)
def test_non_finite_weight_in_other_regimes(rng, N, M, dtype, regime):
    """The same for long rows ("split" at every M, 8 segments; "long" where N has no
    power-of-two divisor) and short ones ("packed")."""
    w = rng.normal(1.0, 0.2, N).astype(dtype)
    w[5], w[N // 4 + 17], w[N // 2 + 30] = np.inf, -np.inf, np.nan
    x = rng.standard_normal((M, N)).astype(dtype)
    x[x == 0] = 1
    assert _layout("trn2", M, N, dtype)[0].regime == regime
    y = _run("nki06", "trn2", x, w, None, None, "gemma")[0][0]
    rtol, atol = (2e-5, 1e-30) if dtype == FP32 else (1e-2, 4 * 2.0**-24)
    _check_nonfinite_weight(y, x, w, EPS, rtol, atol)


@pytest.mark.parametrize("target", ["trn2", "trn3"])
def test_non_finite_weight_in_either_split_product(rng, target):
    """ "split" forms w · rstd per 512-column chunk either on the Scalar engine into PSUM or
    on the Vector engine alone (every fourth chunk, trn3 every second): non-finite weights
    in chunks of both kinds stay in their column."""
    M, N, dtype = 20, 32768, BF16
    w = rng.normal(1.0, 0.2, N).astype(dtype)
    # segments of 4096 columns: chunks 0, 1 and 3 of segment 0, chunk 7 of segment 5
    w[5], w[512 + 9], w[1536 + 2], w[5 * 4096 + 3584 + 11] = np.inf, np.nan, -np.inf, np.inf
    x = rng.standard_normal((M, N)).astype(dtype)
    x[x == 0] = 1
    assert _layout(target, M, N, dtype)[0].regime == "split"
    y = _run("nki06", target, x, w, None, None, "gemma")[0][0]
    _check_nonfinite_weight(y, x, w, EPS, 1e-2, 4 * 2.0**-24)


@pytest.mark.parametrize(
    "target, M, N, dtype, regime",
    [
        ("trn1", 200, 4096, BF16, "rows"),
        ("trn2", 200, 4096, BF16, "rows"),  # "tensor" product, 3 bf16 pieces
        ("trn2", 200, 4096, FP32, "rows"),  # "tensor", 1 fp32 piece
        ("trn2", 20, 32768, BF16, "split"),
        ("trn2", 4, 65537, BF16, "long"),
        ("trn1", 4, 65537, BF16, "long"),
        ("trn2", 20, 32768, FP32, "split"),
        ("trn1", 20, 4096, BF16, "spread"),  # decode batch, segments of 1024 on 4 partitions
        ("trn1", 3, 8192, FP32, "spread"),
    ],
)
def test_non_finite_weight_stays_in_its_column_legacy(rng, target, M, N, dtype, regime):
    """The legacy kernels (trn1, and trn2 on SDK <= 2.29) against the float64 reference for a
    weight with +Inf, −Inf and NaN elements in different segments and a −0."""
    w = rng.normal(1.0, 0.2, N).astype(dtype)
    w[5], w[N // 4 + 17], w[N // 2 + 30] = np.inf, -np.inf, np.nan
    w[N // 4 + 1] = -0.0
    x = rng.standard_normal((M, N)).astype(dtype)
    x[x == 0] = 1
    plan = make_plan(
        dtype,
        dtype,
        None,
        None,
        0.0,
        "gemma",
        None,
        FP32,
        BF16,
        tensor_engine=simulate.get_target(target).nc_version >= 3,
    )
    budget = simulate.get_target(target).sbuf_bytes_per_partition
    assert choose_layout(plan, M, N, budget, grouped=False).regime == regime
    y = _run("legacy", target, x, w, None, None, "gemma")[0][0]
    rtol, atol = (2e-5, 1e-30) if dtype == FP32 else (1e-2, 4 * 2.0**-24)
    _check_nonfinite_weight(y, x, w, EPS, rtol, atol)


@pytest.mark.parametrize(
    "M, x_dtype, residual_dtype, bias",
    [(1, BF16, None, False), (32, BF16, FP32, True), (29, FP16, FP32, True)],
)
def test_spread_within_sbuf_at_its_widest_rows(rng, M, x_dtype, residual_dtype, bias):
    """At the widest N (step 64) the planner gives "spread" on trn1, "rows" takes a large
    batch of it, the legacy kernel runs within SBUF and matches the float64 reference
    (fp32 weight, offset, fp32 output)."""
    spec = simulate.get_target("trn1")
    budget = spec.sbuf_bytes_per_partition
    plan = make_plan(
        x_dtype, FP32, FP32 if bias else None, residual_dtype, 1.0, "gemma", FP32, FP32, BF16
    )
    N = max(
        n for n in range(2048, 70000, 64) if choose_layout(plan, M, n, budget).regime == "spread"
    )
    # only where "rows" holds the row whole, whose statistics "spread" repeats
    assert choose_layout(plan, 4096, N, budget).regime == "rows"
    x = rng.standard_normal((M, N)).astype(x_dtype)
    w = rng.normal(0.0, 0.2, N).astype(FP32)
    b = rng.normal(0.0, 0.5, N).astype(FP32) if bias else None
    r = None if residual_dtype is None else rng.standard_normal((M, N)).astype(residual_dtype)
    common = (w, b, EPS, 1.0, "gemma", FP32)
    if r is None:
        (y, rstd), trace = trace_launch(
            kernels.kernel("rmsnorm_fwd", "legacy"), x, *common, target="trn1"
        )
        h = x.astype(np.float64)
    else:
        kernel = kernels.kernel("rmsnorm_add_fwd", "legacy")
        (y, h_out, rstd), trace = trace_launch(kernel, x, r, *common, target="trn1")
        h = (x.astype(np.float64) + r).astype(residual_dtype).astype(np.float64)
        np.testing.assert_array_equal(h_out, h.astype(residual_dtype))
    assert trace.sbuf_peak_bytes_per_partition <= budget
    want_rstd = 1.0 / np.sqrt(np.mean(h * h, axis=1) + EPS)
    want_y = h * want_rstd[:, None] * (w.astype(np.float64) + 1.0)
    if b is not None:
        want_y = want_y + b
    np.testing.assert_allclose(rstd, want_rstd, rtol=2e-6)
    np.testing.assert_allclose(y, want_y, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("dialect", ["nki06", "legacy"])
def test_non_finite_weight_in_the_long_regime_with_an_odd_hidden_size(rng, dialect):
    """ "long" splits the weight once per kernel, over 128 partitions (135 columns each) and a
    tail of 109 elements, and reads it back per column chunk for every row tile: +Inf in the
    first part, −Inf in the middle, NaN, −0 and +Inf in the tail (its first and last
    element), two row tiles of a fused add on trn2, each column against the float64
    reference. The split's select runs once per piece for the whole kernel (2, not per
    tile or chunk), and each PSUM bank of y is one K = 4 matmul (the 3 rstd pieces and the
    high piece again against the finite copies and the non-finite part)."""
    M, N = 130, 17389
    w = rng.normal(1.0, 0.2, N).astype(BF16)
    w[3], w[N // 2], w[17280], w[17385], w[N - 1] = np.inf, -np.inf, np.nan, -0.0, np.inf
    x = rng.standard_normal((M, N)).astype(BF16)
    x[x == 0] = 1
    residual = (x.astype(np.float32) * 0.5).astype(BF16)  # h = 1.5·x, never 0
    assert _layout("trn2", M, N, BF16, BF16)[0].regime == "long"
    outputs, trace = _run(dialect, "trn2", x, w, None, residual, "gemma")
    h = (x.astype(np.float32) + residual.astype(np.float32)).astype(BF16)
    _check_nonfinite_weight(outputs[0], h, w, EPS, 1e-2, 4 * 2.0**-24)
    select = "tensor_copy_predicated" if dialect == "nki06" else "select"  # nl.where
    assert sum(i.opcode == select for i in trace.instructions) == 2
    products = [i for i in trace.instructions if i.opcode == "nc_matmul" and i.partitions == 4]
    assert len(products) == 2 * math.ceil(N / 512)  # two row tiles
