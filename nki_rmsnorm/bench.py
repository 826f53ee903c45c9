"""``nki-rmsnorm bench``: the benchmark sweep, on the simulator's cost model.

For every case (kind × target × shape) it runs the kernel once in the simulator, checks the
result against the float64 reference (a wrong result stops the run with exit code 1), and
reports the modeled latency, effective bandwidth, MBU (share of the per-core HBM roofline),
the busiest compute engine and its utilisation, the share of the time a DMA is in flight,
HBM bytes over the minimum, the simulator's wall time, the ratio to a plain DMA copy of the
same bytes on the same target (the yardstick: it does not depend on the model's HBM and DMA
efficiencies), and the speed-up over the kernel a user would start from (the Neuron RMSNorm
tutorial's). Times are cost-model estimates, not device measurements (see
``simulate/perf/cost.py`` for what the model assumes).

The dialect follows the target (:mod:`nki_rmsnorm.dialect`): trn1 and inf2 rows run the
legacy kernels, always (NKI 0.x supports Trn2/Trn3 only); trn2 and trn3 rows run the dialect
``--dialect`` names, by default the package's for them (``nki06`` in the simulator unless
``NKI_RMSNORM_DIALECT`` says otherwise); each record names the dialect it ran. The NKI 0.6 kernels
are measured against the 0.6 copy yardstick (:mod:`nki_rmsnorm.kernels.nki06_baseline`), the
legacy ones against the legacy copy (:mod:`nki_rmsnorm.kernels.baseline`). A 0.6 kernel can
run on a trn2/trn3 logical core of two physical cores (LNC=2, launched as ``kernel[2]``;
the copy yardstick too), which the cost model runs concurrently on one shared HBM bank, so
MBU is then against the logical core's HBM: ``--lnc 2`` runs every target so, and a target
named ``trn2x2`` runs trn2 at LNC=2 beside the others. The default sweep with the 0.6 kernels
adds ``trn2x2`` to trn1, trn2 and trn3, for the speed-up of LNC=2 over LNC=1. The "vs base"
column always compares with the legacy tutorial kernel on one core.

Runs: the default is the headline subset (:data:`SUBSET_SHAPES`), ``--full`` the sweep the
published tables come from (:data:`FULL_SHAPES`), ``--quick`` a smoke run. Cases run in ``-j``
processes (default: the usable cores), each with inputs drawn from its own seed
(:func:`case_rng`), so the records do not depend on ``-j``. The copy and baseline yardsticks
are cached on disk (:class:`YardstickCache`). ``--device`` measures on a NeuronDevice instead
(:mod:`nki_rmsnorm.device`); the ``doctor`` command prints what this installation runs
(:mod:`nki_rmsnorm.doctor`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import ml_dtypes
import numpy as np

from nki_rmsnorm import dialect as dialects
from nki_rmsnorm import reference
from nki_rmsnorm.plan.backward import MAX_HIDDEN as MAX_HIDDEN_BWD

#: ``--full``: the sweep docs/bench.json and the README tables come from.
#: Serving shapes: decode batches (a few rows of a model's hidden size) ...
DECODE_SHAPES = ((1, 4096), (8, 4096), (29, 17389), (64, 8192))
#: ... and QK-norm heads (tokens × heads rows of head_dim).
QK_NORM_SHAPES = ((4096, 128), (16384, 128), (8192, 64), (8192, 256))
#: ``--full``: the sweep docs/bench.json and the README tables come from.
FULL_SHAPES = (
    DECODE_SHAPES
    + (
        (256, 65536),
        (1024, 32768),
        (2048, 16384),
        (4096, 1024),
        (4096, 12288),
        (8192, 2048),
        (8192, 4096),
        (8192, 8192),
        (16384, 4096),
    )
    + QK_NORM_SHAPES
)
#: The default run: the headline shape (8192 tokens of a 4096-wide model), a decode batch
#: and the QK-norm heads of 4096 tokens × 32 heads (Qwen3-8B's q_norm), on every target.
SUBSET_SHAPES = ((8192, 4096), (8, 4096), (16384, 128))
QUICK_SHAPES = ((129, 1024), (256, 4096))
#: The kinds the sweep runs without ``--kind``.
KINDS = ("fwd", "bwd", "fused_add")
#: ... and those ``--kind`` takes: also "quant", the fp8 quantized forward (legacy kernels on
#: trn1/inf2, either dialect on trn2, nki06 on trn3), and "mx", the MXFP8 quantized forward
#: (nki06 on trn3 only: ``quantize_mx`` is NeuronCore-v4's).
ALL_KINDS = KINDS + ("quant", "mx")
#: The targets of the "mx" kind, and the multiple its N must be (the kernel's 512-value chunk).
MX_TARGETS = ("trn3",)
MX_N_MULTIPLE = 512
TARGETS = ("inf2", "trn1", "trn2", "trn3")
DIALECTS = ("legacy", "nki06")
LNC_TARGETS = ("trn2", "trn3")  # logical cores of two physical cores (LNC=2) exist only there
DEFAULT_TARGETS = ("trn1", "trn2", "trn3")
#: Added to the default sweep when the kernels are the 0.6 ones: trn2 at LNC=2.
DEFAULT_LNC2_TARGETS = ("trn2x2",)
NKI06_MODULES = ("nki_rmsnorm.dialect", "nki_rmsnorm.kernels.nki06")
DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float32": "float32",
}
EPS = 1e-6
# Largest error against the float64 reference, in units of the dtype's epsilon times the
# error's scale: the largest |reference| value for the forward outputs and dweight (≤ 1 ulp
# for bf16/fp16 in gemma mode), and for dx the row's largest term rstd·max(|g|, |x̂·c|), as in
# tests/kernels/test_bwd.py (dx itself can be far smaller than its terms after the cancellation).
TOLERANCE_EPS = {"fwd": 2.0, "fused_add": 2.0, "bwd": 8.0, "quant": 1.0, "mx": 1.0}
#: "quant": the dequantized y_q · scale against the float64 y, relative to the row's amax, in
#: units of half the spacing of fp8 values just below fp8_max (1/16 for e4m3 and e4m3fn,
#: 1/8 for e5m2): the error RNE can make.
QUANT_HALF_SPACING = {"float8_e4m3": 2.0**-4, "float8_e4m3fn": 2.0**-4, "float8_e5m2": 2.0**-3}
#: "mx": the dequantized output against the float64 reference's (the documented roundings and
#: quantization, :mod:`nki_rmsnorm.reference_mx`), in units of the fp8 step at the top binade
#: of the value's block: a block's values reach [2^7, 2^8) times its scale X, where e4m3fn
#: steps by 2^4 X. The kernel's float32 rstd can put a rare y on the other side of a bf16
#: rounding boundary than the float64 one: one bf16 ulp of y, at most one fp8 step.
MX_QUANT_DTYPE = "float8_e4m3fn_x4"
MX_TOP_STEP = 2.0**4
BASELINES = {
    "fwd": "Neuron RMSNorm tutorial kernel",
    "fused_add": "tutorial add, then the tutorial RMSNorm kernel",
    "bwd": "straightforward nl backward (no published kernel)",
    "quant": "none here: scripts/compare_nkilib.py runs AWS's rmsnorm_quant_kernel",
    "mx": "none here: scripts/compare_nkilib.py --mx runs AWS's rmsnorm_mx_quantize_tkg",
}


@dataclass
class Record:
    kind: str
    target: str
    M: int  # noqa: N815 - the issue's key names
    N: int  # noqa: N815
    dtype: str
    modeled_us: float
    gbps: float
    mbu: float
    busiest_engine: str  # the busiest compute engine (pe, act, dve, pool)
    busiest_engine_util: float
    dma_busy: float  # share of the time at least one DMA transfer is in flight
    hbm_bytes: int
    min_hbm_bytes: int
    hbm_bytes_ratio: float
    sim_wall_s: float  # wall time of the kernel's simulation alone
    copy_us: float  # a plain HBM → SBUF → HBM DMA copy of the same tensors
    copy_ratio: float  # modeled_us / copy_us
    baseline: str
    baseline_us: float | None
    speedup_vs_baseline: float | None
    correct: bool
    max_error: float
    dialect: str = "legacy"
    lnc: int = 1  # physical cores of the logical core the kernel ran on
    # the least time each engine, the DMA engines and HBM need for the instruction mix, by
    # the cost model's per-instruction rules (simulate.cost.engine_floors), and the largest
    floor_us: dict = field(default_factory=dict)
    binds: str = ""


def minimal_hbm_bytes(kind: str, M: int, N: int, itemsize: int) -> int:
    """Bytes each kernel must move at least (docs/design.md, Sources), incl. the fp32 rstd."""
    if kind == "fwd":
        return 2 * itemsize * M * N + itemsize * N + 4 * M
    if kind == "fused_add":
        return 4 * itemsize * M * N + itemsize * N + 4 * M
    if kind == "quant":  # x in, fp8 y_q with its 4 scale bytes per row out (packed layout)
        return itemsize * M * N + itemsize * N + M * (N + 4)
    if kind == "mx":  # x in, fp8 y_q with one e8m0 scale byte per 32 values out
        return itemsize * M * N + itemsize * N + M * N + M * N // 32
    return 3 * itemsize * M * N + itemsize * N + 4 * N + 4 * M


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", item)
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise ValueError(
                f"malformed shape {item!r}: expected MxN with positive integers, e.g. 4096x4096"
            )
        shapes.append((int(match[1]), int(match[2])))
    return tuple(shapes)


def _parse_list(text: str, allowed, what: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise ValueError(
            f"--{what} {text!r} names no {what}: expected a comma list of {', '.join(allowed)}"
        )
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {what} {item!r}: expected one of {', '.join(allowed)}")
    return items


def _inputs(kind: str, M: int, N: int, dtype, rng):
    def normal(shape):  # drawn in fp32: half the time of float64 draws, and as random
        return rng.standard_normal(shape, dtype=np.float32)

    x = normal((M, N)).astype(dtype)
    weight = (1.0 + 0.1 * normal(N)).astype(dtype)
    residual = normal((M, N)).astype(dtype) if kind == "fused_add" else None
    dy = normal((M, N)).astype(dtype) if kind == "bwd" else None
    return x, weight, residual, dy


def case_rng(seed: int, kind: str, target: str, lnc: int, M: int, N: int):
    """The random generator of one case: its inputs depend on the seed and the case alone,
    so a case draws the same data whichever cases run beside it and in which process."""
    key = (ALL_KINDS.index(kind), TARGETS.index(target), lnc, M, N)
    return np.random.default_rng([seed, *key])


#: Rows per call of the float64 reference: its temporaries stay small (a whole 8192x8192
#: case makes float64 temporaries of 512 MB each). Every row is normalised on its own, so
#: the rows come out bit for bit as from one call.
_REFERENCE_ROWS = 256


def _reference_fwd(x, weight, residual=None):
    """:func:`reference.rms_norm_fwd` of the case, computed ``_REFERENCE_ROWS`` rows at a
    time: ``(y, rstd)`` or ``(y, h, rstd)``."""
    blocks = [
        reference.rms_norm_fwd(
            x[i : i + _REFERENCE_ROWS],
            weight,
            EPS,
            residual=None if residual is None else residual[i : i + _REFERENCE_ROWS],
        )
        for i in range(0, x.shape[0], _REFERENCE_ROWS)
    ]
    return tuple(np.concatenate(parts) for parts in zip(*blocks))


def _kernels(dialect: str):
    """The (rmsnorm_fwd, rmsnorm_add_fwd, rmsnorm_bwd) kernels of ``dialect``."""
    from nki_rmsnorm import kernels

    names = ("rmsnorm_fwd", "rmsnorm_add_fwd", "rmsnorm_bwd")
    return tuple(kernels.kernel(name, dialect) for name in names)


def _profile(dialect, lnc, kernel, *args, target):
    """Run ``kernel`` once in the simulator: (outputs, Profile). A legacy kernel goes through
    ``simulate.profile``; an ``nki`` 0.6 kernel is launched as ``kernel[lnc]`` with the
    target in ``NEURON_PLATFORM_TARGET_OVERRIDE`` (how 0.6 names it) and its trace modeled."""
    import simulate

    if dialect == "legacy":
        return simulate.profile(kernel, *args, target=target)
    import simulate.nki06

    previous = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    try:
        outputs = kernel[lnc](*args)
    finally:
        if previous is None:
            del os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"]
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = previous
    return outputs, simulate.Profile.from_trace(simulate.nki06.last_trace())


def run_case(
    kind, target, M, N, dtype_name, rng, with_baseline=True, dialect="legacy", lnc=1, cache=None
) -> Record:
    """Simulate one case with the cost model and check it against the reference; the copy
    and baseline yardsticks come from ``cache`` (a :class:`YardstickCache`) when it has
    them."""
    import simulate.cost
    from nki_rmsnorm import kernels

    rmsnorm_fwd, rmsnorm_add_fwd, rmsnorm_bwd = _kernels(dialect)
    dtype = np.dtype(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else dtype_name)
    x, weight, residual, dy = _inputs(kind, M, N, dtype, rng)
    rstd = _reference_fwd(x, weight)[1] if kind == "bwd" else None
    start = time.perf_counter()
    if kind == "quant":
        packed, prof = _quant_run(target, lnc, x, weight, dialect)
    elif kind == "mx":
        packed, prof = _mx_run(lnc, x, weight, target)
    elif kind == "bwd":
        outputs, prof = _profile(
            dialect, lnc, rmsnorm_bwd, dy, x, weight, rstd, None, 0.0, False, "gemma", target=target
        )
    else:
        from nki_rmsnorm import kernels

        launch = (rmsnorm_fwd, x) if residual is None else (rmsnorm_add_fwd, x, residual)
        outputs, prof = _profile(
            dialect,
            lnc,
            *launch,
            weight,
            None,
            EPS,
            0.0,
            "gemma",
            kernels.nki_dtype(dtype_name, dialect),
            target=target,
        )
    wall = time.perf_counter() - start
    eps_dtype = (
        float(np.finfo(np.float32).eps)
        if dtype_name == "float32"
        else (2.0**-8 if dtype_name == "bfloat16" else 2.0**-11)
    )
    if kind == "quant":
        errors, eps_dtype = _quant_errors(packed, target, x, weight)
    elif kind == "mx":
        errors, eps_dtype = _mx_errors(packed, x, weight)
    elif kind == "bwd":
        want = reference.rms_norm_bwd(dy, x, weight, rstd)
        errors = [
            _max_error(outputs[0], want[0], _dx_row_scale(dy, x, weight, rstd)),
            _max_error(outputs[1], want[1], _scale(want[1])),
        ]
    else:
        want = _reference_fwd(x, weight, residual)
        errors = [_max_error(o, w, _scale(w)) for o, w in zip(outputs[:-1], want[:-1])]
    max_error = max(errors)
    correct = max_error <= TOLERANCE_EPS[kind] * eps_dtype
    cache = cache or YardstickCache(None)
    case_key = (kind, target, lnc, M, N, dtype_name, dialect)
    copy_us = cache.get_or_compute(
        "copy", case_key, lambda: _copy_us(kind, target, x, residual, dy, dialect, lnc)
    )
    baseline_us = (
        cache.get_or_compute(
            "baseline",
            case_key,
            lambda: _baseline_us(kind, target, x, weight, residual, dy, rstd),
        )
        if with_baseline
        else None
    )
    hbm = prof.hbm_read_bytes + prof.hbm_write_bytes
    minimal = minimal_hbm_bytes(kind, M, N, dtype.itemsize)
    busiest = max(("pe", "act", "dve", "pool"), key=lambda e: prof.engine_busy_us[e])
    table = simulate.cost.CostTable(target)
    roofline_gbps = table.hbm_share_gbps * (table.hbm_cores_per_pool if lnc > 1 else 1)
    gbps = minimal / (prof.latency_us * 1e3)
    return Record(
        kind=kind,
        target=target,
        M=M,
        N=N,
        dtype=dtype_name,
        modeled_us=prof.latency_us,
        gbps=gbps,
        mbu=gbps / roofline_gbps,
        busiest_engine=busiest,
        busiest_engine_util=prof.engine_busy_us[busiest] / prof.latency_us,
        dma_busy=prof.engine_busy_us["dma"] / prof.latency_us,
        hbm_bytes=hbm,
        min_hbm_bytes=minimal,
        hbm_bytes_ratio=hbm / minimal,
        sim_wall_s=wall,
        copy_us=copy_us,
        copy_ratio=prof.latency_us / copy_us,
        baseline=BASELINES[kind],
        baseline_us=baseline_us,
        speedup_vs_baseline=baseline_us / prof.latency_us if baseline_us else None,
        correct=bool(correct),
        max_error=max_error,
        dialect=dialect,
        lnc=lnc,
        **_floor_fields(prof),
    )


def quant_dtype_for(target: str) -> str:
    """The fp8 dtype the quantized case writes on ``target``: the OCP e4m3 on trn3, the
    NeuronCore e4m3 (max 240) before (:func:`nki_rmsnorm.ops.quant_dtype_name`'s default)."""
    return "float8_e4m3fn" if target == "trn3" else "float8_e4m3"


def quant_launch_args(x, weight, quant_dtype: str):
    """The ``rmsnorm_quant`` kernel's arguments for the benchmark's case: per-row scales in
    nki-library's packed ``[..., N + 4]`` layout, as AWS's ``rmsnorm_quant_kernel`` writes."""
    from nki_rmsnorm import kernels

    return (
        x,
        None,
        weight,
        None,
        EPS,
        kernels.nki_dtype(quant_dtype, "nki06"),
        "row",
        128,
        None,
        1e-6,
        False,
        False,
        True,
        False,
    )


def _quant_run(target, lnc, x, weight, dialect="nki06"):
    """Run the quantized case: (the packed output, Profile). The legacy kernel has no packed
    layout: it writes y_q and the scale column, packed here on the host for the check."""
    from nki_rmsnorm import kernels

    kernel = kernels.kernel("rmsnorm_quant", dialect)
    args = quant_launch_args(x, weight, quant_dtype_for(target))
    if dialect == "legacy":
        args = args[:5] + (kernels.nki_dtype(quant_dtype_for(target), dialect),) + args[6:12]
        args = args + (False, False)
    out, prof = _profile(dialect, lnc, kernel, *args, target=target)
    if dialect == "legacy":
        y_q, scales = (np.asarray(a) for a in out)
        scale_bytes = np.ascontiguousarray(scales.astype("<f4")).view(np.uint8).view(y_q.dtype)
        return np.concatenate([y_q, scale_bytes], axis=1), prof
    return np.asarray(out[0] if isinstance(out, tuple) else out), prof


def _quant_errors(packed, target, x, weight):
    """([error], its unit) of the quantized case: the dequantized y_q · scale against the
    float64 y, relative to each row's amax, in units of half an fp8 step at the top."""
    name = quant_dtype_for(target)
    n = x.shape[1]
    error = 0.0
    for r0 in range(0, x.shape[0], _CHECK_ROWS):  # the float64 reference, a slice at a time
        part = packed[r0 : r0 + _CHECK_ROWS]
        scales = np.ascontiguousarray(part[:, n:]).view(np.uint8).view("<f4")[:, :1]
        dequantized = part[:, :n].astype(np.float64) * scales
        want = reference.rms_norm_quant(x[r0 : r0 + _CHECK_ROWS], weight, EPS, quant_dtype=name)
        error = max(error, _max_error(dequantized, want["y"], want["amax"][:, None]))
    return [error], QUANT_HALF_SPACING[name]


#: Rows of the quantized case checked against the float64 reference at once.
_CHECK_ROWS = 1024


def _mx_run(lnc, x, weight, target):
    """Run the MX case (``rmsnorm_mx_quant``, e4m3fn values, e8m0 scales): ((y_q (N / 4, M)
    as uint32, scales (N / 32, M) as uint8), Profile)."""
    from nki_rmsnorm import kernels

    kernel = kernels.kernel("rmsnorm_mx_quant", "nki06")
    args = (
        x,
        None,
        weight,
        EPS,
        kernels.nki_dtype(MX_QUANT_DTYPE, "nki06"),
        kernels.nki_dtype("float8_e8m0fnu", "nki06"),
    )
    out, prof = _profile("nki06", lnc, kernel, *args, target=target)
    y_q = np.ascontiguousarray(np.asarray(out[0])).view(np.uint32)
    return (y_q, np.ascontiguousarray(np.asarray(out[1])).view(np.uint8)), prof


def _mx_errors(packed, x, weight):
    """([error], its unit) of the MX case: the dequantized output against the float64
    reference's, in units of the fp8 step at the top of the value's block (its NaN blocks
    must be the reference's)."""
    from nki_rmsnorm import mx, reference_mx

    y_q, scales = packed
    error = 0.0
    for r0 in range(0, x.shape[0], _CHECK_ROWS):
        rows = slice(r0, r0 + _CHECK_ROWS)
        got = mx.mx_dequantize(y_q[:, rows], scales[:, rows], MX_QUANT_DTYPE)
        want = reference_mx.rms_norm_mx_quant(x[rows], weight, EPS, quant_dtype=MX_QUANT_DTYPE)
        expected = want["dequantized"]
        if not np.array_equal(np.isnan(got), np.isnan(expected)):
            return [float("inf")], 1.0
        step = np.ldexp(MX_TOP_STEP, want["scale_bytes"].astype(np.int64) - 127)
        finite = np.isfinite(expected)
        deviation = np.abs(got - expected) / np.repeat(step, 32, axis=1)
        error = max(error, float(deviation[finite].max(initial=0.0)))
    return [error], 1.0


def _mx_copy_views(x, row_bytes):
    """The (a, b) fp8 tensors of the MX case's copy yardstick for ``row_bytes``: together
    x's bytes (read), a's alone the bytes the case writes, fp8 values and scales (33 bytes
    per 32 values; b the other 31). They share their row count, a's rows at most
    ``row_bytes`` long where the shape allows."""
    unit = x.size // 32  # per 32 values of x: 33 bytes written, 32 · itemsize read
    width = max([k for k in range(1, max(1, row_bytes // 33) + 1) if unit % k == 0])
    rows = unit // width
    fp8 = ml_dtypes.float8_e4m3fn
    return (
        np.zeros((rows, 33 * width), fp8),
        np.zeros((rows, (32 * x.dtype.itemsize - 33) * width), fp8),
    )


def _floor_fields(prof) -> dict:
    """The record's per-engine floor and the resource it names as binding."""
    import simulate.cost

    floors = simulate.cost.engine_floors(prof.schedule)
    return {
        "floor_us": {k: round(v, 3) for k, v in floors.items()},
        "binds": simulate.cost.binding_resource(floors),
    }


def _max_error(got, want, scale) -> float:
    """Largest |got − want| relative to ``scale`` (a number or a per-row column)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - want) / scale)) if got.size else 0.0


def _scale(reference_values) -> float:
    values = np.abs(np.asarray(reference_values, np.float64))
    return float(values.max()) if values.size and values.max() > 0 else 1.0


def _dx_row_scale(dy, x, weight, rstd) -> np.ndarray:
    """Per row, the largest term of ``dx = rstd·(g − x̂·c)``: rstd·max(|g|, |x̂·c|)."""
    r = np.asarray(rstd, np.float64)[:, None]
    x_hat = np.asarray(x, np.float64) * r
    g = np.asarray(dy, np.float64) * np.asarray(weight, np.float64)
    c = np.abs(np.mean(g * x_hat, axis=1, keepdims=True))
    scale = np.max(r * np.maximum(np.abs(g), np.abs(x_hat) * c), axis=1, keepdims=True)
    return np.where(scale > 0, scale, 1.0)


def _copy_us(kind, target, x, residual, dy, dialect="legacy", lnc=1) -> float:
    """Modeled time of a plain DMA copy moving the tensors the case moves: x → y (forward),
    x, residual → y, h (fused add), dy, x read and one tensor written (backward), x read
    and its fp8 bytes written (quant; mx: with a scale byte per 32 values), in the
    case's dialect and on its logical core (under LNC=2 each core copies half the rows); the
    fastest of the row lengths :data:`~nki_rmsnorm.kernels.baseline.COPY_ROW_BYTES`."""
    if dialect == "nki06":
        from nki_rmsnorm.kernels import nki06_baseline as copies
    else:
        from nki_rmsnorm.kernels import baseline as copies

    from nki_rmsnorm.kernels.baseline import COPY_ROW_BYTES

    if kind == "mx":  # x's bytes read, the fp8 values' and scales' bytes written
        return min(
            _profile(
                dialect, lnc, copies.copy_one_load_one, *_mx_copy_views(x, row_bytes), target=target
            )[1].latency_us
            for row_bytes in COPY_ROW_BYTES
        )
    if kind == "fwd":
        launch = (copies.copy_one, x)
    elif kind == "quant":  # x's bytes read (as two fp8 halves), its fp8 bytes written
        halves = np.zeros((2,) + x.shape, ml_dtypes.float8_e4m3)
        launch = (copies.copy_two_store_one, halves[0], halves[1])
    elif kind == "fused_add":
        launch = (copies.copy_two, x, residual)
    else:
        launch = (copies.copy_two_store_one, dy, x)
    # the fastest row length: the yardstick is as fast as the model allows on this target
    return min(
        _profile(dialect, lnc, *launch, row_bytes, target=target)[1].latency_us
        for row_bytes in COPY_ROW_BYTES
    )


def _baseline_us(kind, target, x, weight, residual, dy, rstd) -> float | None:
    """Modeled time of the kernel(s) a user would start from doing the same work (None when
    it cannot run the shape, e.g. a row that does not fit SBUF); ``rstd`` is the backward's
    saved statistic."""
    import simulate
    from nki_rmsnorm.kernels import baseline

    out = np.empty_like(x)
    if kind in ("quant", "mx"):
        return None
    try:
        if kind == "fwd":
            return simulate.profile(baseline.tutorial_rmsnorm, x, weight, out, target=target)[
                1
            ].latency_us
        if kind == "fused_add":
            _, add = simulate.profile(baseline.tutorial_add, x, residual, out, target=target)
            _, norm = simulate.profile(
                baseline.tutorial_rmsnorm, out, weight, np.empty_like(x), target=target
            )
            return add.latency_us + norm.latency_us
        return simulate.profile(
            baseline.tutorial_rmsnorm_bwd,
            dy,
            x,
            weight,
            rstd,
            out,
            np.empty_like(weight),
            target=target,
        )[1].latency_us
    except simulate.NKIError:
        return None


def _yardstick_sources() -> str:
    """SHA-256 of everything a yardstick's modeled time depends on: the simulator and its
    cost model (every ``simulate`` source file), the yardstick kernels and the functions of
    this module that launch them. A change to any of them makes every cached value stale."""
    import inspect

    import simulate
    from nki_rmsnorm import nki as nki_shim
    from nki_rmsnorm.kernels import baseline, nki06_baseline

    digest = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(simulate.__file__))
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    for module in (nki_shim, baseline, nki06_baseline):
        digest.update(inspect.getsource(module).encode())
    for function in (_profile, _copy_us, _baseline_us):
        digest.update(inspect.getsource(function).encode())
    return digest.hexdigest()


def default_cache_dir() -> str:
    """``$NKI_RMSNORM_CACHE_DIR``, else ``$XDG_CACHE_HOME/nki-rmsnorm``, else
    ``~/.cache/nki-rmsnorm``; the yardsticks go in its ``bench`` folder."""
    explicit = os.environ.get("NKI_RMSNORM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nki-rmsnorm")


class YardstickCache:
    """The copy and baseline yardsticks' modeled µs, one small JSON file per case in
    ``folder/bench`` (None: nothing is stored, every value is computed).

    On disk rather than in the process: within one sweep no two cases share a yardstick (each
    is a function of kind, target, LNC, shape, dtype and dialect), so only a later run can
    reuse one, typically the next sweep after a change to our kernels, which leaves the
    yardsticks alone. A value is keyed by :func:`_yardstick_sources` and the case; the input
    data is not in the key because the cost model reads the trace, never the values (checked
    by tests/bench/test_bench_runs.py). Files are written atomically, so parallel workers may
    share the folder."""

    def __init__(self, folder: str | None) -> None:
        self.folder = None if folder is None else os.path.join(folder, "bench")
        self._sources: str | None = None
        self.hits = 0

    def _path(self, what: str, case_key: tuple) -> str:
        if self._sources is None:
            self._sources = _yardstick_sources()
        text = json.dumps([self._sources, what, *case_key])
        return os.path.join(self.folder, hashlib.sha256(text.encode()).hexdigest() + ".json")

    def get_or_compute(self, what: str, case_key: tuple, compute):
        if self.folder is None:
            return compute()
        path = self._path(what, case_key)
        try:
            with open(path) as f:
                value = json.load(f)["us"]
            self.hits += 1
            return value
        except (OSError, ValueError, KeyError):
            pass
        value = compute()
        os.makedirs(self.folder, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        with os.fdopen(handle, "w") as f:
            json.dump({"us": value, "case": [what, *case_key]}, f)
        os.replace(partial, path)
        return value


HEADER = (
    f"{'kind':9s} {'target':6s} {'shape':>12s} {'model µs':>10s} {'GB/s':>7s} "
    f"{'MBU':>6s} {'busiest':>11s} {'DMA':>6s} {'HBM/min':>8s} {'sim s':>6s} "
    f"{'×copy':>6s} {'vs base':>8s} ok {'binds':>11s}"
)


def _target_name(r: Record) -> str:
    """The record's target as ``--target`` names it: ``trn2``, or ``trn2x2`` at LNC=2."""
    return r.target if r.lnc == 1 else f"{r.target}x{r.lnc}"


def format_row(r: Record) -> str:
    speedup = f"{r.speedup_vs_baseline:7.2f}×" if r.speedup_vs_baseline else "     n/a"
    target = _target_name(r)
    return (
        f"{r.kind:9s} {target:6s} {f'{r.M}x{r.N}':>12s} {r.modeled_us:10.1f} "
        f"{r.gbps:7.1f} {100 * r.mbu:5.1f}% {r.busiest_engine:>4s} "
        f"{100 * r.busiest_engine_util:5.1f}% {100 * r.dma_busy:5.1f}% "
        f"{r.hbm_bytes_ratio:8.3f} {r.sim_wall_s:6.2f} {r.copy_ratio:6.3f} {speedup} "
        f"{'yes' if r.correct else 'NO'} {_binds(r):>11s}"
    )


def _binds(r: Record) -> str:
    """The binding resource with its floor as a share of the modeled time."""
    if not r.floor_us:
        return "-"
    return f"{r.binds} {100 * r.floor_us.get(r.binds, 0.0) / r.modeled_us:4.0f}%"


def _progress_bar(total: int):
    """A tqdm bar with an ETA on stderr (tqdm hides itself when stderr is not a terminal);
    ``None`` without tqdm (the ``bench`` extra installs it)."""
    if importlib.util.find_spec("tqdm") is None:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="case", disable=None, leave=False, file=sys.stderr)


def plot(records, path: str) -> None:
    """MBU per shape and target (one panel per kind), with the roofline at 100 %."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ALL_KINDS if any(r.kind == k for r in records)]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(11, 3.2 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        rows = [r for r in records if r.kind == kind]
        shapes = list(dict.fromkeys(f"{r.M}x{r.N}" for r in rows))
        targets = list(dict.fromkeys(_target_name(r) for r in rows))
        width = 0.8 / max(len(targets), 1)
        for t, target in enumerate(targets):
            values = [
                next(
                    (
                        100 * r.mbu
                        for r in rows
                        if _target_name(r) == target and f"{r.M}x{r.N}" == s
                    ),
                    0.0,
                )
                for s in shapes
            ]
            ax.bar(np.arange(len(shapes)) + t * width, values, width, label=target)
        ax.axhline(100, color="black", linestyle="--", linewidth=1, label="HBM roofline")
        ax.set_xticks(
            np.arange(len(shapes)) + width * (len(targets) - 1) / 2, shapes, rotation=20, fontsize=8
        )
        ax.set_ylabel("MBU %")
        ax.set_ylim(0, 110)
        ax.set_title(f"{kind} ({rows[0].dtype}), modeled")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


class _UsageError(Exception):
    """A bad command line: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(message)


def _version() -> str:
    try:
        return importlib.metadata.version("nki-rmsnorm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


BENCH_DESCRIPTION = """\
Benchmark the RMSNorm kernels on the CPU simulator's cost model (no NeuronDevice needed).

Every case runs the kernel once in the simulator, checks its result against a float64
reference (a wrong result exits 1) and prints one row of modeled figures. The times are
cost-model estimates (about +-20 % on steady-state kernels), not device measurements; on a
machine with a NeuronDevice, --device measures instead.

Runs:
  (default)   the headline subset: fwd, bwd and fused_add at 8192x4096, a decode batch
              (8x4096) and QK-norm heads (16384x128), bf16, on every default target (36
              cases, about 85 CPU-seconds: a minute or so on 2 idle cores)
  --full      the full sweep: 17 shapes, decode batches (1x4096 to 64x8192), 256x65536 to
              16384x4096 and QK-norm heads (4096x128 to 8192x256) (204 cases, about 15
              CPU-minutes: some 8 minutes on 2 idle cores at -j 2, less with a warm cache)
  --quick     a smoke run: two small shapes (129x1024, 256x4096), seconds per case; checks
              the install and the kernels' results, its times say little about large shapes
"""

BENCH_LEGEND = """\
columns:
  kind      fwd (forward), bwd (backward), fused_add (residual add + forward), quant (fp8
            output, row scales), mx (MXFP8 output, a scale per 32 values)
  target    trn1, trn2, trn3, inf2; trn2x2 / trn3x2 = that target at LNC=2 (two cores)
  shape     M x N: rows x hidden size
  model µs  the modeled kernel latency in microseconds
  GB/s      minimal HBM bytes / modeled time
  MBU       that as a share of the core's HBM bandwidth (memory-bandwidth utilisation)
  busiest   the busiest compute engine (pe, act, dve, pool) and its busy share
  DMA       share of the time at least one DMA transfer is in flight
  HBM/min   HBM bytes moved / the minimum the kernel must move
  sim s     wall-clock seconds the simulator took for the kernel (not a kernel time)
  ×copy     modeled time / a plain DMA copy of the same bytes (1.0 = as fast as a copy)
  vs base   speed-up over what a user would start from: fwd the Neuron RMSNorm tutorial
            kernel, fused_add the tutorial add then that kernel, bwd a straightforward nl
            backward (n/a where it cannot run the shape)
  ok        the result matched the float64 reference
  binds     the resource with the largest floor (the least time an engine, the DMA queues
            or HBM need for the kernel's instructions) and that floor's share of the time

The copy and baseline yardsticks are cached in the cache folder (--cache-dir); a change to
the simulator or the yardstick kernels invalidates them.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nki-rmsnorm", description="RMSNorm kernels for AWS Trainium: tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="command"
    )
    sweep = commands.add_parser(
        "bench",
        help="benchmark the kernels (simulator cost model, or --device)",
        description=BENCH_DESCRIPTION,
        epilog=BENCH_LEGEND,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    runs = sweep.add_mutually_exclusive_group()
    runs.add_argument(
        "--full",
        action="store_true",
        help="the full sweep (17 shapes, 204 cases) instead of the subset",
    )
    runs.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run on two small shapes (checks results, not speed)",
    )
    sweep.add_argument(
        "--shapes",
        help="comma-separated MxN list, e.g. 4096x4096,8192x2048 (replaces the run's shapes)",
    )
    sweep.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    sweep.add_argument(
        "--target",
        help="comma list of " + ",".join(TARGETS) + "; trn2x2 / trn3x2: that "
        "target at LNC=2 (nki06). Default: trn1,trn2,trn3, plus trn2x2 "
        "with the nki06 kernels at --lnc 1",
    )
    sweep.add_argument(
        "--kind",
        default=",".join(KINDS),
        help="comma list of fwd,bwd,fused_add (default), quant (the fp8 "
        "quantized forward; legacy on trn1/inf2, either dialect on trn2, "
        "nki06 on trn3) and mx (the MXFP8 quantized forward; trn3 and "
        "trn3x2 only)",
    )
    sweep.add_argument(
        "--dialect",
        help="kernel dialect of the trn2/trn3 rows: legacy (neuronxcc.nki, SDK "
        "<= 2.29) or nki06 (SDK >= 2.31); default: the package's (nki06 "
        "unless NKI_RMSNORM_DIALECT says otherwise). trn1/inf2 rows always "
        "run the legacy kernels",
    )
    sweep.add_argument(
        "--lnc",
        default="1",
        help="physical cores per logical core for the targets named without "
        "x2: 1 (default) or 2 (trn2/trn3, nki06 kernels launched as "
        "kernel[2])",
    )
    sweep.add_argument(
        "-j",
        "--jobs",
        type=int,
        default=None,
        help="cases run in this many processes at once (default: the CPU "
        "cores this process may use)",
    )
    sweep.add_argument(
        "--cache-dir",
        default=None,
        help="folder of the yardstick cache (default: $NKI_RMSNORM_CACHE_DIR, "
        "else $XDG_CACHE_HOME/nki-rmsnorm, else ~/.cache/nki-rmsnorm)",
    )
    sweep.add_argument(
        "--no-cache",
        action="store_true",
        help="compute the copy and baseline yardsticks afresh, store nothing",
    )
    sweep.add_argument("--json", help="write the records as a JSON list to this path")
    sweep.add_argument(
        "--plot", help="write a PNG of MBU per shape and target to this path (needs matplotlib)"
    )
    sweep.add_argument("--no-baseline", action="store_true", help="skip the vs base column")
    sweep.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    sweep.add_argument(
        "--device",
        action="store_true",
        help="measure on a NeuronDevice with the SDK's nki.benchmark instead of "
        "the cost model (needs the Neuron SDK and a device; see "
        "docs/device.md)",
    )
    sweep.add_argument(
        "--warmup", type=int, default=5, help="--device: warm-up iterations (default 5)"
    )
    sweep.add_argument(
        "--iters", type=int, default=20, help="--device: measured iterations (default 20)"
    )
    commands.add_parser(
        "doctor",
        help="print the detected Neuron SDK, NKI dialect and launch paths",
        description="Print what this installation will run: the Neuron SDK and NKI found, "
        "the kernel dialect, the launch path per framework, and whether the "
        "kernels run on a NeuronDevice or are simulated on the CPU.",
    )
    return parser


@dataclass
class _Sweep:
    shapes: tuple[tuple[int, int], ...]
    dtype_name: str
    targets: tuple[tuple[str, int], ...]  # (target, LNC degree)
    kinds: tuple[str, ...]
    dialect: str = "legacy"  # of the trn2/trn3 rows (trn1/inf2 rows: legacy, always)

    def dialect_on(self, target: str) -> str:
        """The dialect of a row on ``target``."""
        return dialects.LEGACY if target in dialects.LEGACY_ONLY_TARGETS else self.dialect


def _targets(text: str, lnc: int, dialect_name: str) -> tuple[tuple[str, int], ...]:
    """``--target`` as (target, LNC) pairs: ``trn2`` at ``lnc``, ``trn2x2`` at LNC=2."""
    allowed = TARGETS + tuple(f"{t}x2" for t in LNC_TARGETS)
    pairs = []
    for item in _parse_list(text, allowed, "target"):
        pairs.append((item[:-2], 2) if item.endswith("x2") else (item, lnc))
    if lnc == 2:
        single = [t for t, degree in pairs if t not in LNC_TARGETS]
        if single:
            raise ValueError(
                f"--lnc 2 needs trn2 or trn3 (logical cores of two physical "
                f"cores); not {', '.join(single)}"
            )
    if dialect_name != "nki06" and any(degree == 2 for _, degree in pairs):
        what = "--lnc 2" if lnc == 2 else "a target at LNC=2 (x2)"
        raise ValueError(
            f"{what} needs --dialect nki06: the legacy kernels run on one physical core"
        )
    return tuple(pairs)


def _check(args) -> _Sweep:
    """Every argument, checked before the first case runs (ValueError names the bad one)."""
    if args.shapes:
        shapes = parse_shapes(args.shapes)
    else:
        shapes = FULL_SHAPES if args.full else QUICK_SHAPES if args.quick else SUBSET_SHAPES
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"-j/--jobs {args.jobs}: expected a positive number of processes")
    for option, count in (("--warmup", args.warmup), ("--iters", args.iters)):
        if count < (1 if option == "--iters" else 0):
            raise ValueError(
                f"{option} {count}: expected a count >= {1 if option == '--iters' else 0}"
            )
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}: expected bf16, fp16 or fp32")
    kinds = _parse_list(args.kind, ALL_KINDS, "kind")
    dialect_name = args.dialect or dialects.for_target(dialects.NKI06_TARGETS[0])
    if dialect_name not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect_name!r}: expected one of {', '.join(DIALECTS)}")
    if dialect_name == "nki06":
        missing = [m for m in NKI06_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"--dialect nki06 is not available: {', '.join(missing)} "
                "(the NKI 0.6 kernels) is missing; use --dialect legacy"
            )
    if args.lnc not in ("1", "2"):
        raise ValueError(f"--lnc {args.lnc!r}: expected 1 or 2")
    lnc = int(args.lnc)
    target_text = args.target
    if target_text is None:
        defaults = DEFAULT_TARGETS
        if dialect_name == "nki06" and lnc == 1:  # LNC=2 beside its own LNC=1 target
            defaults = sorted(defaults + DEFAULT_LNC2_TARGETS)
        target_text = ",".join(defaults)
    targets = _targets(target_text, lnc, dialect_name)
    if "quant" in kinds and dialect_name != "nki06" and any(t == "trn3" for t, _ in targets):
        raise ValueError(
            "--kind quant on trn3 needs --dialect nki06: its OCP float8_e4m3fn is "
            "not a legacy NKI dtype"
        )
    if "mx" in kinds:
        _check_mx(shapes, targets, dialect_name)
    if "bwd" in kinds:
        for M, N in shapes:
            if N > MAX_HIDDEN_BWD:
                raise ValueError(
                    f"shape {M}x{N}: N={N} is over the backward kernel's limit "
                    f"N <= {MAX_HIDDEN_BWD}; drop it or leave bwd out of --kind"
                )
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"{option} {path}: directory {folder} does not exist")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'nki-rmsnorm[bench]'")
    for kind in ("quant", "mx"):
        if args.device and kind in kinds:
            raise ValueError(
                f"--kind {kind} runs on the cost model only (no --device "
                "measurement of the quantized kernels yet)"
            )
    if args.device:
        from nki_rmsnorm import device

        device.check_available()  # ValueError naming what is missing, before any case
    return _Sweep(shapes, DTYPES[args.dtype], targets, kinds, dialect_name)


def _check_mx(shapes, targets, dialect_name) -> None:
    """ValueError unless every ``--kind mx`` case can run: the 0.6 kernel on trn3 (LNC 1 or
    2), N a multiple of 512."""
    others = sorted({t for t, _ in targets if t not in MX_TARGETS})
    if others:
        raise ValueError(
            f"--kind mx needs --target trn3 or trn3x2 (quantize_mx exists on "
            f"NeuronCore-v4 only); not {', '.join(others)}"
        )
    if dialect_name != "nki06":
        raise ValueError(
            "--kind mx needs --dialect nki06: the legacy NKI dialect has no MX "
            "dtypes or quantize_mx"
        )
    for M, N in shapes:
        if N % MX_N_MULTIPLE:
            raise ValueError(
                f"shape {M}x{N}: --kind mx needs N a multiple of "
                f"{MX_N_MULTIPLE} (the MX kernel's chunk of a row)"
            )


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _run_job(job) -> Record:
    """One case in a worker process (a module-level function, so it pickles)."""
    kind, target, lnc, M, N, dtype_name, with_baseline, dialect_name, seed, cache_dir = job
    return run_case(
        kind,
        target,
        M,
        N,
        dtype_name,
        case_rng(seed, kind, target, lnc, M, N),
        with_baseline,
        dialect_name,
        lnc,
        YardstickCache(cache_dir),
    )


def _results(jobs: list, processes: int):
    """The records of ``jobs`` in their order, each as soon as it and every earlier one are
    done: in this process for one process, else in a pool of fresh ("spawn") processes, so
    no worker inherits threads or state of the caller."""
    if processes <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield _run_job(job)
        return
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(processes, len(jobs)), context) as pool:
        futures = [pool.submit(_run_job, job) for job in jobs]
        try:
            for future in futures:
                yield future.result()
        finally:
            for future in futures:
                future.cancel()


def bench(args, sweep: _Sweep) -> int:
    """Run the checked sweep (``args`` as parsed by :func:`build_parser`)."""
    if args.device:
        from nki_rmsnorm import device

        return device.bench(args, sweep)
    cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir())
    cases = [
        (k, t, lnc, M, N) for k in sweep.kinds for t, lnc in sweep.targets for M, N in sweep.shapes
    ]
    jobs = [
        (
            kind,
            target,
            lnc,
            M,
            N,
            sweep.dtype_name,
            not args.no_baseline,
            sweep.dialect_on(target),
            args.seed,
            cache_dir,
        )
        for kind, target, lnc, M, N in cases
    ]
    records = []
    print(HEADER, flush=True)
    bar = _progress_bar(len(cases))
    try:
        for record in _results(jobs, args.jobs or available_cores()):
            records.append(record)
            line = format_row(record)
            if bar is not None:
                bar.write(line, file=sys.stdout)
                bar.update()
            else:
                print(line, flush=True)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    if args.plot:
        plot(records, args.plot)
    wrong = [r for r in records if not r.correct]
    if wrong:
        for r in wrong:
            print(
                f"WRONG RESULT: {r.kind} {r.target} {r.M}x{r.N} {r.dtype}: max error "
                f"{r.max_error:.3g} (relative to the output's scale)",
                file=sys.stderr,
            )
        return 1
    return 0


def main(argv=None) -> int:
    """Entry point of the ``nki-rmsnorm`` console script: exit code 0 on success, 1 on a
    wrong kernel result, 2 on a bad command line (one line on stderr, before anything runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "nki-rmsnorm" + (" bench" if argv[:1] == ["bench"] else "")
    try:
        args = build_parser().parse_args(argv)
        sweep = _check(args) if args.command == "bench" else None
    except (_UsageError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    if args.command == "doctor":
        from nki_rmsnorm import doctor

        print(doctor.report())
        return 0
    return bench(args, sweep)


if __name__ == "__main__":
    sys.exit(main())
