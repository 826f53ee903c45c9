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
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import ml_dtypes
import numpy as np

from nki_rmsnorm import dialect as dialects
from nki_rmsnorm import reference
from nki_rmsnorm.plan.backward import MAX_HIDDEN as MAX_HIDDEN_BWD

DEFAULT_SHAPES = ((29, 17389), (256, 65536), (1024, 32768), (2048, 16384), (4096, 1024),
                  (4096, 12288), (8192, 2048), (8192, 4096), (8192, 8192), (16384, 4096))
QUICK_SHAPES = ((129, 1024), (256, 4096))
KINDS = ("fwd", "bwd", "fused_add")
TARGETS = ("inf2", "trn1", "trn2", "trn3")
DIALECTS = ("legacy", "nki06")
LNC_TARGETS = ("trn2", "trn3")  # logical cores of two physical cores (LNC=2) exist only there
DEFAULT_TARGETS = ("trn1", "trn2", "trn3")
#: Added to the default sweep when the kernels are the 0.6 ones: trn2 at LNC=2.
DEFAULT_LNC2_TARGETS = ("trn2x2",)
NKI06_MODULES = ("nki_rmsnorm.dialect", "nki_rmsnorm.kernels.nki06")
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
EPS = 1e-6
# Largest error against the float64 reference, in units of the dtype's epsilon times the
# error's scale: the largest |reference| value for the forward outputs and dweight (≤ 1 ulp
# for bf16/fp16 in gemma mode), and for dx the row's largest term rstd·max(|g|, |x̂·c|), as in
# tests/test_bwd.py (dx itself can be far smaller than its terms after the cancellation).
TOLERANCE_EPS = {"fwd": 2.0, "fused_add": 2.0, "bwd": 8.0}
BASELINES = {"fwd": "Neuron RMSNorm tutorial kernel",
             "fused_add": "tutorial add, then the tutorial RMSNorm kernel",
             "bwd": "straightforward nl backward (no published kernel)"}


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
    sim_wall_s: float
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
    """Bytes each kernel must move at least (hw_cost_facts §6a), incl. the fp32 rstd."""
    if kind == "fwd":
        return 2 * itemsize * M * N + itemsize * N + 4 * M
    if kind == "fused_add":
        return 4 * itemsize * M * N + itemsize * N + 4 * M
    return 3 * itemsize * M * N + itemsize * N + 4 * N + 4 * M


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", item)
        if not match or int(match[1]) < 1 or int(match[2]) < 1:
            raise ValueError(f"malformed shape {item!r}: expected MxN with positive integers, "
                             "e.g. 4096x4096")
        shapes.append((int(match[1]), int(match[2])))
    return tuple(shapes)


def _parse_list(text: str, allowed, what: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    if not items:
        raise ValueError(f"--{what} {text!r} names no {what}: expected a comma list of "
                         f"{', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise ValueError(f"unknown {what} {item!r}: expected one of {', '.join(allowed)}")
    return items


def _inputs(kind: str, M: int, N: int, dtype, rng):
    x = rng.standard_normal((M, N)).astype(dtype)
    weight = (1.0 + 0.1 * rng.standard_normal(N)).astype(dtype)
    residual = rng.standard_normal((M, N)).astype(dtype) if kind == "fused_add" else None
    dy = rng.standard_normal((M, N)).astype(dtype) if kind == "bwd" else None
    return x, weight, residual, dy


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


def run_case(kind, target, M, N, dtype_name, rng, with_baseline=True, dialect="legacy",
             lnc=1) -> Record:
    """Simulate one case with the cost model and check it against the reference."""
    import simulate.cost

    rmsnorm_fwd, rmsnorm_add_fwd, rmsnorm_bwd = _kernels(dialect)
    dtype = np.dtype(ml_dtypes.bfloat16 if dtype_name == "bfloat16" else dtype_name)
    x, weight, residual, dy = _inputs(kind, M, N, dtype, rng)
    start = time.perf_counter()
    if kind == "bwd":
        _, rstd = reference.rms_norm_fwd(x, weight, EPS)
        outputs, prof = _profile(dialect, lnc, rmsnorm_bwd, dy, x, weight, rstd, None, 0.0,
                                 False, "gemma", target=target)
        want = reference.rms_norm_bwd(dy, x, weight, rstd)
        errors = [_max_error(outputs[0], want[0], _dx_row_scale(dy, x, weight, rstd)),
                  _max_error(outputs[1], want[1], _scale(want[1]))]
    else:
        launch = ((rmsnorm_fwd, x) if residual is None
                  else (rmsnorm_add_fwd, x, residual))
        outputs, prof = _profile(dialect, lnc, *launch, weight, None, EPS, 0.0, "gemma",
                                 dtype, target=target)
        want = reference.rms_norm_fwd(x, weight, EPS, residual=residual)
        errors = [_max_error(o, w, _scale(w)) for o, w in zip(outputs[:-1], want[:-1])]
    wall = time.perf_counter() - start
    eps_dtype = float(np.finfo(np.float32).eps) if dtype_name == "float32" else (
        2.0 ** -8 if dtype_name == "bfloat16" else 2.0 ** -11)
    max_error = max(errors)
    correct = max_error <= TOLERANCE_EPS[kind] * eps_dtype
    copy_us = _copy_us(kind, target, x, residual, dy, dialect, lnc)
    baseline_us = _baseline_us(kind, target, x, weight, residual, dy) if with_baseline else None
    hbm = prof.hbm_read_bytes + prof.hbm_write_bytes
    minimal = minimal_hbm_bytes(kind, M, N, dtype.itemsize)
    busiest = max(("pe", "act", "dve", "pool"), key=lambda e: prof.engine_busy_us[e])
    table = simulate.cost.CostTable(target)
    roofline_gbps = table.hbm_share_gbps * (table.hbm_cores_per_pool if lnc > 1 else 1)
    gbps = minimal / (prof.latency_us * 1e3)
    return Record(
        kind=kind, target=target, M=M, N=N, dtype=dtype_name, modeled_us=prof.latency_us,
        gbps=gbps, mbu=gbps / roofline_gbps, busiest_engine=busiest,
        busiest_engine_util=prof.engine_busy_us[busiest] / prof.latency_us,
        dma_busy=prof.engine_busy_us["dma"] / prof.latency_us,
        hbm_bytes=hbm, min_hbm_bytes=minimal, hbm_bytes_ratio=hbm / minimal, sim_wall_s=wall,
        copy_us=copy_us, copy_ratio=prof.latency_us / copy_us, baseline=BASELINES[kind],
        baseline_us=baseline_us,
        speedup_vs_baseline=baseline_us / prof.latency_us if baseline_us else None,
        correct=bool(correct), max_error=max_error, dialect=dialect, lnc=lnc,
        **_floor_fields(prof))


def _floor_fields(prof) -> dict:
    """The record's per-engine floor and the resource it names as binding."""
    import simulate.cost

    floors = simulate.cost.engine_floors(prof.schedule)
    return {"floor_us": {k: round(v, 3) for k, v in floors.items()},
            "binds": simulate.cost.binding_resource(floors)}


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
    x, residual → y, h (fused add), dy, x read and one tensor written (backward), in the
    case's dialect and on its logical core (under LNC=2 each core copies half the rows); the
    fastest of the row lengths :data:`~nki_rmsnorm.kernels.baseline.COPY_ROW_BYTES`."""
    if dialect == "nki06":
        from nki_rmsnorm.kernels import nki06_baseline as copies
    else:
        from nki_rmsnorm.kernels import baseline as copies

    from nki_rmsnorm.kernels.baseline import COPY_ROW_BYTES

    if kind == "fwd":
        launch = (copies.copy_one, x)
    elif kind == "fused_add":
        launch = (copies.copy_two, x, residual)
    else:
        launch = (copies.copy_two_store_one, dy, x)
    # the fastest row length: the yardstick is as fast as the model allows on this target
    return min(_profile(dialect, lnc, *launch, row_bytes, target=target)[1].latency_us
               for row_bytes in COPY_ROW_BYTES)


def _baseline_us(kind, target, x, weight, residual, dy) -> float | None:
    """Modeled time of the kernel(s) a user would start from doing the same work (None when
    it cannot run the shape, e.g. a row that does not fit SBUF)."""
    import simulate
    from nki_rmsnorm.kernels import baseline

    out = np.empty_like(x)
    try:
        if kind == "fwd":
            return simulate.profile(baseline.tutorial_rmsnorm, x, weight, out,
                                    target=target)[1].latency_us
        if kind == "fused_add":
            _, add = simulate.profile(baseline.tutorial_add, x, residual, out, target=target)
            _, norm = simulate.profile(baseline.tutorial_rmsnorm, out, weight, np.empty_like(x),
                                       target=target)
            return add.latency_us + norm.latency_us
        _, rstd = reference.rms_norm_fwd(x, weight, EPS)
        return simulate.profile(baseline.tutorial_rmsnorm_bwd, dy, x, weight, rstd, out,
                                np.empty_like(weight), target=target)[1].latency_us
    except simulate.NKIError:
        return None


HEADER = (f"{'kind':9s} {'target':6s} {'shape':>12s} {'model µs':>10s} {'GB/s':>7s} "
          f"{'MBU':>6s} {'busiest':>11s} {'DMA':>6s} {'HBM/min':>8s} {'sim s':>6s} "
          f"{'×copy':>6s} {'vs base':>8s} ok {'binds':>11s}")


def _target_name(r: Record) -> str:
    """The record's target as ``--target`` names it: ``trn2``, or ``trn2x2`` at LNC=2."""
    return r.target if r.lnc == 1 else f"{r.target}x{r.lnc}"


def format_row(r: Record) -> str:
    speedup = f"{r.speedup_vs_baseline:7.2f}×" if r.speedup_vs_baseline else "     n/a"
    target = _target_name(r)
    return (f"{r.kind:9s} {target:6s} {f'{r.M}x{r.N}':>12s} {r.modeled_us:10.1f} "
            f"{r.gbps:7.1f} {100 * r.mbu:5.1f}% {r.busiest_engine:>4s} "
            f"{100 * r.busiest_engine_util:5.1f}% {100 * r.dma_busy:5.1f}% "
            f"{r.hbm_bytes_ratio:8.3f} {r.sim_wall_s:6.2f} {r.copy_ratio:6.3f} {speedup} "
            f"{'yes' if r.correct else 'NO'} {_binds(r):>11s}")


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

    kinds = [k for k in KINDS if any(r.kind == k for r in records)]
    fig, axes = plt.subplots(len(kinds), 1, figsize=(11, 3.2 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        rows = [r for r in records if r.kind == kind]
        shapes = list(dict.fromkeys(f"{r.M}x{r.N}" for r in rows))
        targets = list(dict.fromkeys(_target_name(r) for r in rows))
        width = 0.8 / max(len(targets), 1)
        for t, target in enumerate(targets):
            values = [next((100 * r.mbu for r in rows if _target_name(r) == target
                            and f"{r.M}x{r.N}" == s), 0.0) for s in shapes]
            ax.bar(np.arange(len(shapes)) + t * width, values, width, label=target)
        ax.axhline(100, color="black", linestyle="--", linewidth=1, label="HBM roofline")
        ax.set_xticks(np.arange(len(shapes)) + width * (len(targets) - 1) / 2, shapes,
                      rotation=20, fontsize=8)
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="nki-rmsnorm", description="RMSNorm kernels for AWS Trainium: tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                     metavar="command")
    sweep = commands.add_parser("bench", help=__doc__.split("\n")[0],
                                description=__doc__.split("\n")[0])
    sweep.add_argument("--shapes", help="comma-separated MxN list, e.g. 4096x4096,8192x2048")
    sweep.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    sweep.add_argument("--target",
                       help="comma list of " + ",".join(TARGETS) + "; trn2x2 / trn3x2: that "
                            "target at LNC=2 (nki06). Default: trn1,trn2,trn3, plus trn2x2 "
                            "with the nki06 kernels at --lnc 1")
    sweep.add_argument("--kind", default=",".join(KINDS), help="comma list of fwd,bwd,fused_add")
    sweep.add_argument("--dialect",
                       help="kernel dialect of the trn2/trn3 rows: legacy (neuronxcc.nki, SDK "
                            "<= 2.29) or nki06 (SDK >= 2.30); default: the package's (nki06 "
                            "unless NKI_RMSNORM_DIALECT says otherwise). trn1/inf2 rows always "
                            "run the legacy kernels")
    sweep.add_argument("--lnc", default="1",
                       help="physical cores per logical core for the targets named without "
                            "x2: 1 (default) or 2 (trn2/trn3, nki06 kernels launched as "
                            "kernel[2])")
    sweep.add_argument("--json", help="write the records as a JSON list to this path")
    sweep.add_argument("--plot", help="write a PNG of MBU per shape and target to this path "
                                      "(needs matplotlib)")
    sweep.add_argument("--quick", action="store_true", help="a small smoke run (used by tests)")
    sweep.add_argument("--no-baseline", action="store_true", help="skip the baseline column")
    sweep.add_argument("--seed", type=int, default=0)
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
            raise ValueError(f"--lnc 2 needs trn2 or trn3 (logical cores of two physical "
                             f"cores); not {', '.join(single)}")
    if dialect_name != "nki06" and any(degree == 2 for _, degree in pairs):
        what = "--lnc 2" if lnc == 2 else "a target at LNC=2 (x2)"
        raise ValueError(f"{what} needs --dialect nki06: the legacy kernels run on one "
                         "physical core")
    return tuple(pairs)


def _check(args) -> _Sweep:
    """Every argument, checked before the first case runs (ValueError names the bad one)."""
    shapes = parse_shapes(args.shapes) if args.shapes else (
        QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    if args.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {args.dtype!r}: expected bf16, fp16 or fp32")
    kinds = _parse_list(args.kind, KINDS, "kind")
    dialect_name = args.dialect or dialects.for_target(dialects.NKI06_TARGETS[0])
    if dialect_name not in DIALECTS:
        raise ValueError(f"unknown dialect {dialect_name!r}: expected one of "
                         f"{', '.join(DIALECTS)}")
    if dialect_name == "nki06":
        missing = [m for m in NKI06_MODULES if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(f"--dialect nki06 is not available: {', '.join(missing)} "
                             "(the NKI 0.6 kernels) is missing; use --dialect legacy")
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
    if "bwd" in kinds:
        for M, N in shapes:
            if N > MAX_HIDDEN_BWD:
                raise ValueError(f"shape {M}x{N}: N={N} is over the backward kernel's limit "
                                 f"N <= {MAX_HIDDEN_BWD}; drop it or leave bwd out of --kind")
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                raise ValueError(f"{option} {path}: directory {folder} does not exist")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install 'nki-rmsnorm[bench]'")
    return _Sweep(shapes, DTYPES[args.dtype], targets, kinds, dialect_name)


def bench(args, sweep: _Sweep) -> int:
    """Run the checked sweep (``args`` as parsed by :func:`build_parser`)."""
    rng = np.random.default_rng(args.seed)
    cases = [(k, t, lnc, M, N) for k in sweep.kinds for t, lnc in sweep.targets
             for M, N in sweep.shapes]
    records = []
    print(HEADER, flush=True)
    bar = _progress_bar(len(cases))
    try:
        for kind, target, lnc, M, N in cases:
            if bar is not None:
                bar.set_description(f"{kind} {target}{'x2' if lnc == 2 else ''} {M}x{N}")
            record = run_case(kind, target, M, N, sweep.dtype_name, rng, not args.no_baseline,
                              sweep.dialect_on(target), lnc)
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
            print(f"WRONG RESULT: {r.kind} {r.target} {r.M}x{r.N} {r.dtype}: max error "
                  f"{r.max_error:.3g} (relative to the output's scale)", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    """Entry point of the ``nki-rmsnorm`` console script: exit code 0 on success, 1 on a
    wrong kernel result, 2 on a bad command line (one line on stderr, before anything runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "nki-rmsnorm" + (" bench" if argv[:1] == ["bench"] else "")
    try:
        args = build_parser().parse_args(argv)
        sweep = _check(args)
    except (_UsageError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 0
    return bench(args, sweep)


if __name__ == "__main__":
    sys.exit(main())
