"""Regenerate the generated tables of README.md and docs/ from the JSON records.

* ``docs/calibration.json`` (written by ``python tests/simulate/perf/calibration_kernels.py --json
  docs/calibration.json``): the cost model against published measurements
  (``docs/calibration.md``).
* ``docs/bench.json`` (written by ``nki-rmsnorm bench --json docs/bench.json``): the sweep
  (``docs/benchmark.md``) and the README's three-row headline.

Each table sits between ``<!-- generated:NAME begin -->`` and ``<!-- generated:NAME end -->``
comments; the text between them is replaced, nothing else is touched. Never edit the tables
by hand: ``tests/simulate/perf/test_calibration.py`` and ``tests/bench/test_bench.py`` fail
when they differ from what this script makes of the JSON.

    python scripts/gen_tables.py            # rewrite the files
    python scripts/gen_tables.py --check    # exit 1 if a file is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION_JSON = ROOT / "docs" / "calibration.json"
BENCH_JSON = ROOT / "docs" / "bench.json"
FILES = (ROOT / "README.md", ROOT / "docs" / "calibration.md", ROOT / "docs" / "benchmark.md")
KIND_TITLES = {"fwd": "Forward", "bwd": "Backward", "fused_add": "Fused residual add + forward"}
# Goals on the ratio to the copy kernel, for N >= 2048 (our goals): kind -> target -> bound
COPY_GOALS = {
    "fwd": dict.fromkeys(("trn1", "trn2", "trn3"), 1.03),
    "fused_add": dict.fromkeys(("trn1", "trn2", "trn3"), 1.03),
    "bwd": {"trn1": 1.30, "trn2": 1.15, "trn3": 1.15},
}
GOAL_MIN_N = 2048
# The serving shapes have goals of their own and stay out of the rows above: decode batches
# (M <= DECODE_MAX_M rows, any N) and QK-norm heads (N <= QK_NORM_MAX_N, many rows), forward
# only: kind -> target -> bound on the ratio to the copy kernel.
DECODE_MAX_M = 64
QK_NORM_MAX_N = 256
DECODE_COPY_GOALS = {"fwd": dict.fromkeys(("trn1", "trn2", "trn3"), 1.5)}
QK_NORM_COPY_GOALS = {"fwd": dict.fromkeys(("trn1", "trn2", "trn3"), 1.3)}
# Goal on the modeled speed-up of a trn2 logical core of two physical cores (LNC=2) over one
# core (LNC=1), for M >= 2048 (the project's goal).
LNC_SPEEDUP_GOAL = 1.9
LNC_GOAL_MIN_M = 2048


def _number(value: float, unit: str) -> str:
    if unit == "ratio":  # a throughput relative to a reference point
        return f"{value:.1%}"
    if unit == "us" and value >= 1000:
        return f"{value / 1000:,.2f} ms"
    return f"{value:,.1f} µs" if value >= 100 else f"{value:,.3f} µs"


def calibration_table(points: list[dict]) -> str:
    """Model vs measured for every point, then the summary over the asserted ones."""
    lines = [
        "| case | target | measured | model | error | what the model assumes / how "
        "compared | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        flag = "" if p["asserted"] else " (reported, not asserted)"
        lines.append(
            f"| {p['case']}{flag} | {p['target']} | {_number(p['measured'], p['unit'])} | "
            f"{_number(p['model'], p['unit'])} | {p['error']:+.1%} | {p['how']} | "
            f"{p['source']} |"
        )
    errors = [abs(p["error"]) for p in points if p["asserted"]]
    lines += [
        "",
        f"Over the {len(errors)} asserted points: median |error| "
        f"{statistics.median(errors):.1%}, largest {max(errors):.1%}.",
    ]
    return "\n".join(lines)


def _shape(r: dict) -> str:
    return f"{r['M']}×{r['N']}"


def _column(r: dict) -> tuple[str, int]:
    """A record's column: its target and LNC degree (records before LNC=2 have no ``lnc``)."""
    return r["target"], r.get("lnc", 1)


def _label(column: tuple[str, int]) -> str:
    target, lnc = column
    return target if lnc == 1 else f"{target} LNC={lnc}"


def _lnc_speedup(by_column: dict, column: tuple[str, int]) -> float | None:
    """LNC=1 time over this column's (LNC=2) time for the same shape and target."""
    single = by_column.get((column[0], 1))
    multi = by_column.get(column)
    if single is None or multi is None:
        return None
    return single["modeled_us"] / multi["modeled_us"]


def bench_tables(records: list[dict]) -> str:
    """Per kind: modeled µs, ratio to the copy kernel (the yardstick) and MBU per target
    (and per LNC=2 target, with its speed-up over the same target at LNC=1), HBM bytes over
    the minimum, and the speed-up over the baseline."""
    columns = list(dict.fromkeys(_column(r) for r in records))
    out = []
    for kind in KIND_TITLES:
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        dialects = " / ".join(dict.fromkeys(r.get("dialect", "legacy") for r in rows))
        out += [
            f"**{KIND_TITLES[kind]}** ({rows[0]['dtype']}; {dialects} kernels; modeled; "
            f"baseline: {rows[0]['baseline']})",
            "",
        ]
        head = "| M×N |"
        for column in columns:
            label = _label(column)
            head += f" {label} µs | {label} ×copy | {label} MBU |"
            if column[1] > 1:
                head += f" {label} speed-up vs LNC=1 |"
        extra = sum(column[1] > 1 for column in columns)
        out += [
            head + " HBM/min | vs baseline (" + " / ".join(map(_label, columns)) + ") |",
            "|---|" + "---|---|---|" * len(columns) + "---|" * extra + "---|---|",
        ]
        for shape in dict.fromkeys(_shape(r) for r in rows):
            by_column = {_column(r): r for r in rows if _shape(r) == shape}
            cells = []
            for column in columns:
                r = by_column.get(column)
                cells += (
                    ["n/a"] * 3
                    if r is None
                    else [
                        f"{r['modeled_us']:,.1f}",
                        f"{r['copy_ratio']:.3f}",
                        f"{100 * r['mbu']:.1f} %",
                    ]
                )
                if column[1] > 1:
                    speedup = _lnc_speedup(by_column, column)
                    cells.append("n/a" if speedup is None else f"{speedup:.2f}×")
            any_row = next(iter(by_column.values()))
            speedups = " / ".join(
                f"{by_column[c]['speedup_vs_baseline']:.2f}×"
                if c in by_column and by_column[c]["speedup_vs_baseline"]
                else "n/a"
                for c in columns
            )
            out.append(
                f"| {shape} | "
                + " | ".join(cells)
                + f" | {any_row['hbm_bytes_ratio']:.3f} | {speedups} |"
            )
        out.append("")
    out.append(goal_summary(records))
    return "\n".join(out).rstrip()


#: The README's headline: one shape (8192 tokens of a hidden size of 4096, bf16), each kind.
HEADLINE_SHAPE = (8192, 4096)
HEADLINE_TARGETS = ("trn1", "trn2", "trn3")


def headline_table(records: list[dict]) -> str:
    """Three rows (forward, backward, fused add) at :data:`HEADLINE_SHAPE`: the modeled time
    per target at LNC=1, its ratio to a plain DMA copy, and the speed-up over the baseline."""
    M, N = HEADLINE_SHAPE
    labels = " | ".join(target.capitalize() for target in HEADLINE_TARGETS)
    lines = [
        f"| {M} × {N} bf16 | {labels} | vs the Neuron tutorial kernel |",
        "|---|" + "---|" * len(HEADLINE_TARGETS) + "---|",
    ]
    for kind, title in KIND_TITLES.items():
        by_target = {
            r["target"]: r
            for r in records
            if r["kind"] == kind and (r["M"], r["N"]) == (M, N) and r.get("lnc", 1) == 1
        }
        if not by_target:
            continue
        cells = [
            f"{by_target[t]['modeled_us']:,.0f} µs ({by_target[t]['copy_ratio']:.2f}× copy)"
            if t in by_target
            else "n/a"
            for t in HEADLINE_TARGETS
        ]
        speedups = " / ".join(
            f"{by_target[t]['speedup_vs_baseline']:.2f}×"
            if t in by_target and by_target[t]["speedup_vs_baseline"]
            else "n/a"
            for t in HEADLINE_TARGETS
        )
        lines.append(f"| {title.lower().capitalize()} | " + " | ".join(cells) + f" | {speedups} |")
    return "\n".join(lines)


def goal_summary(records: list[dict]) -> str:
    """The goals per kind and target: the copy ratio over the N >= 2048 shapes at LNC=1
    (how many meet the goal, the worst ratio, and the worst once the one-tile shapes,
    M < 128, are left out), the forward's over the decode shapes (M <= 64) and the QK-norm
    shapes (N <= 256), then the LNC=2 speed-up over LNC=1 at M >= 2048 for every
    target the records have at LNC=2. Records with per-engine floors (``floor_us``, the
    bench's ``binds``) add what binds the worst shape with M ≥ 128: the resource with the
    largest floor and that floor as a share of the modeled time."""
    with_floors = any(r.get("floor_us") for r in records)
    lines = [
        "| kind | target | goal | shapes within | worst | at | worst with M ≥ 128 | at |"
        + (" binds there |" if with_floors else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if with_floors else ""),
    ]
    regimes = (
        (COPY_GOALS, f"N ≥ {GOAL_MIN_N}", lambda r: r["N"] >= GOAL_MIN_N and r["M"] > DECODE_MAX_M),
        (DECODE_COPY_GOALS, f"decode, M ≤ {DECODE_MAX_M}", lambda r: r["M"] <= DECODE_MAX_M),
        (
            QK_NORM_COPY_GOALS,
            f"QK-norm, N ≤ {QK_NORM_MAX_N}",
            lambda r: r["N"] <= QK_NORM_MAX_N and r["M"] > DECODE_MAX_M,
        ),
    )
    for goal_table, scope, chosen in regimes:
        for kind, goals in goal_table.items():
            for target, goal in goals.items():
                rows = [
                    r
                    for r in records
                    if r["kind"] == kind and _column(r) == (target, 1) and chosen(r)
                ]
                if not rows:
                    continue
                within = sum(r["copy_ratio"] <= goal for r in rows)
                worst = max(rows, key=lambda r: r["copy_ratio"])
                full = [r for r in rows if r["M"] >= 128]
                rest = max(full, key=lambda r: r["copy_ratio"]) if full else None
                rest_cells = f"{rest['copy_ratio']:.3f} | {_shape(rest)}" if rest else "n/a | n/a"
                lines.append(
                    f"| {kind} | {target} | ≤ {goal:.2f} ×copy ({scope}) | {within} of "
                    f"{len(rows)} | {worst['copy_ratio']:.3f} | {_shape(worst)} | {rest_cells} |"
                    + (f" {_binds(rest or worst)} |" if with_floors else "")
                )
    for kind in KIND_TITLES:
        rows = [r for r in records if r["kind"] == kind]
        for column in dict.fromkeys(_column(r) for r in rows if r.get("lnc", 1) > 1):
            speedups = []
            for r in rows:
                if _column(r) == column and r["M"] >= LNC_GOAL_MIN_M:
                    same_shape = {_column(o): o for o in rows if _shape(o) == _shape(r)}
                    speedup = _lnc_speedup(same_shape, column)
                    if speedup is not None:
                        speedups.append((speedup, _shape(r)))
            if not speedups:
                continue
            within = sum(speedup >= LNC_SPEEDUP_GOAL for speedup, _ in speedups)
            worst, at = min(speedups)
            lines.append(
                f"| {kind} | {_label(column)} | ≥ {LNC_SPEEDUP_GOAL:.1f}× LNC=1 (M ≥ "
                f"{LNC_GOAL_MIN_M}) | {within} of {len(speedups)} | {worst:.2f}× | {at} | "
                f"{worst:.2f}× | {at} |" + (" n/a |" if with_floors else "")
            )
    return "\n".join(lines)


def _binds(r: dict | None) -> str:
    """The binding resource of a record and its floor as a share of the modeled time."""
    if r is None or not r.get("floor_us"):
        return "n/a"
    share = r["floor_us"][r["binds"]] / r["modeled_us"]
    return f"{r['binds']} {100 * share:.0f} %"


def generated_blocks() -> dict[str, str]:
    """Block name -> generated Markdown, from the JSON files that exist."""
    blocks = {}
    if CALIBRATION_JSON.exists():
        blocks["calibration"] = calibration_table(json.loads(CALIBRATION_JSON.read_text()))
    if BENCH_JSON.exists():
        records = json.loads(BENCH_JSON.read_text())
        blocks["bench"] = bench_tables(records)
        blocks["headline"] = headline_table(records)
    return blocks


def render(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every marked block replaced by its generated content."""

    def replace(match):
        name = match["name"]
        if name not in blocks:
            return match[0]
        return f"{match['begin']}\n{blocks[name]}\n{match['end']}"

    pattern = (
        r"(?P<begin><!-- generated:(?P<name>[a-z_]+) begin -->)\n.*?\n?"
        r"(?P<end><!-- generated:(?P=name) end -->)"
    )
    return re.sub(pattern, replace, text, flags=re.S)


def out_of_date() -> list[Path]:
    """The files whose generated blocks differ from what the JSON gives."""
    blocks = generated_blocks()
    return [
        path
        for path in FILES
        if path.exists() and render(path.read_text(), blocks) != path.read_text()
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    if args.check:
        stale = out_of_date()
        for path in stale:
            print(
                f"{path.relative_to(ROOT)} is out of date: run python scripts/gen_tables.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    blocks = generated_blocks()
    for path in FILES:
        if path.exists():
            path.write_text(render(path.read_text(), blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
