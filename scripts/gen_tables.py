"""Regenerate the generated tables of README.md and docs/calibration.md from the JSON records.

* ``docs/calibration.json`` (written by ``python tests/calibration_kernels.py --json
  docs/calibration.json``): the cost model against published measurements.
* ``docs/bench.json`` (written by ``nki-rmsnorm bench --json docs/bench.json``): the sweep.

Each table sits between ``<!-- generated:NAME begin -->`` and ``<!-- generated:NAME end -->``
comments; the text between them is replaced, nothing else is touched. Never edit the tables
by hand: ``tests/test_calibration.py`` and ``tests/test_bench.py`` fail when they differ
from what this script makes of the JSON.

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
FILES = (ROOT / "README.md", ROOT / "docs" / "calibration.md")
KIND_TITLES = {"fwd": "Forward", "bwd": "Backward", "fused_add": "Fused residual add + forward"}
# Goals on the ratio to the copy kernel, for N >= 2048 (issue 11): kind -> target -> bound
COPY_GOALS = {
    "fwd": dict.fromkeys(("trn1", "trn2", "trn3"), 1.03),
    "fused_add": dict.fromkeys(("trn1", "trn2", "trn3"), 1.03),
    "bwd": {"trn1": 1.30, "trn2": 1.15, "trn3": 1.15},
}
GOAL_MIN_N = 2048


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


def bench_tables(records: list[dict]) -> str:
    """Per kind: modeled µs, ratio to the copy kernel (the yardstick) and MBU per target,
    HBM bytes over the minimum, and the speed-up over the baseline."""
    targets = list(dict.fromkeys(r["target"] for r in records))
    out = []
    for kind in KIND_TITLES:
        rows = [r for r in records if r["kind"] == kind]
        if not rows:
            continue
        out += [
            f"**{KIND_TITLES[kind]}** ({rows[0]['dtype']}; modeled; baseline: "
            f"{rows[0]['baseline']})",
            "",
        ]
        head = "| M×N |" + "".join(f" {t} µs | {t} ×copy | {t} MBU |" for t in targets)
        out += [
            head + " HBM/min | vs baseline (" + " / ".join(targets) + ") |",
            "|---|" + "---|---|---|" * len(targets) + "---|---|",
        ]
        for shape in dict.fromkeys(_shape(r) for r in rows):
            by_target = {r["target"]: r for r in rows if _shape(r) == shape}
            cells = []
            for t in targets:
                r = by_target.get(t)
                cells += (
                    ["n/a"] * 3
                    if r is None
                    else [
                        f"{r['modeled_us']:,.1f}",
                        f"{r['copy_ratio']:.3f}",
                        f"{100 * r['mbu']:.1f} %",
                    ]
                )
            any_row = next(iter(by_target.values()))
            speedups = " / ".join(
                f"{by_target[t]['speedup_vs_baseline']:.2f}×"
                if t in by_target and by_target[t]["speedup_vs_baseline"]
                else "n/a"
                for t in targets
            )
            out.append(
                f"| {shape} | "
                + " | ".join(cells)
                + f" | {any_row['hbm_bytes_ratio']:.3f} | {speedups} |"
            )
        out.append("")
    out.append(goal_summary(records))
    return "\n".join(out).rstrip()


def goal_summary(records: list[dict]) -> str:
    """The copy-ratio goals per kind and target over the N >= 2048 shapes: how many meet
    the goal, the worst ratio, and the worst once the one-tile shapes (M < 128) are left
    out."""
    lines = [
        "| kind | target | goal (×copy, N ≥ 2048) | shapes within | worst | at | "
        "worst with M ≥ 128 | at |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, goals in COPY_GOALS.items():
        for target, goal in goals.items():
            rows = [
                r
                for r in records
                if r["kind"] == kind and r["target"] == target and r["N"] >= GOAL_MIN_N
            ]
            if not rows:
                continue
            within = sum(r["copy_ratio"] <= goal for r in rows)
            worst = max(rows, key=lambda r: r["copy_ratio"])
            full = [r for r in rows if r["M"] >= 128]
            rest = max(full, key=lambda r: r["copy_ratio"]) if full else None
            rest_cells = f"{rest['copy_ratio']:.3f} | {_shape(rest)}" if rest else "n/a | n/a"
            lines.append(
                f"| {kind} | {target} | ≤ {goal:.2f} | {within} of {len(rows)} | "
                f"{worst['copy_ratio']:.3f} | {_shape(worst)} | {rest_cells} |"
            )
    return "\n".join(lines)


def generated_blocks() -> dict[str, str]:
    """Block name -> generated Markdown, from the JSON files that exist."""
    blocks = {}
    if CALIBRATION_JSON.exists():
        blocks["calibration"] = calibration_table(json.loads(CALIBRATION_JSON.read_text()))
    if BENCH_JSON.exists():
        blocks["bench"] = bench_tables(json.loads(BENCH_JSON.read_text()))
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
