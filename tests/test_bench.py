"""The ``nki-rmsnorm bench`` command: the --quick smoke run, its JSON records, and the
one-line errors (exit code 2) for bad arguments."""

from __future__ import annotations

import json

import pytest

from nki_rmsnorm import bench

REQUIRED_KEYS = {"kind", "target", "M", "N", "dtype", "modeled_us", "mbu", "hbm_bytes_ratio",
                 "busiest_engine", "speedup_vs_baseline", "sim_wall_s", "correct"}


def test_quick_run_checks_results_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["bench", "--quick", "--target", "trn2", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {(r["kind"], r["M"], r["N"]) for r in records} == {
        (k, M, N) for k in bench.KINDS for M, N in bench.QUICK_SHAPES}
    for r in records:
        assert REQUIRED_KEYS <= set(r)
        assert r["correct"] is True and r["target"] == "trn2" and r["dtype"] == "bfloat16"
        assert 0 < r["mbu"] <= 1.0
        assert r["modeled_us"] > 0 and r["sim_wall_s"] > 0
        assert r["hbm_bytes_ratio"] >= 0.99  # never fewer bytes than the data itself
        assert r["busiest_engine"] in ("pe", "act", "dve", "pool")
        assert 0 < r["busiest_engine_util"] <= 1.0 and 0 < r["dma_busy"] <= 1.0
        assert r["speedup_vs_baseline"] is None or r["speedup_vs_baseline"] > 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("kind") and out.count("trn2") == len(records)


def test_minimal_bytes_follow_the_roofline_table():
    # hw_cost_facts §6a: 4096² bf16 forward 67.12 MB (+ 4·M for rstd), backward 100.70 MB
    assert bench.minimal_hbm_bytes("fwd", 4096, 4096, 2) == 67_117_056 + 4 * 4096
    assert bench.minimal_hbm_bytes("bwd", 4096, 4096, 2) == 100_704_256
    assert bench.minimal_hbm_bytes("fused_add", 1, 1, 4) == 4 * 4 + 4 + 4


@pytest.mark.parametrize("argv, message", [
    (["bench", "--target", "trn9"], "unknown target 'trn9'"),
    (["bench", "--dtype", "fp64"], "unknown dtype 'fp64'"),
    (["bench", "--shapes", "4096by4096"], "malformed shape '4096by4096'"),
    (["bench", "--shapes", "0x4096"], "malformed shape '0x4096'"),
    (["bench", "--kind", "fwd,sideways"], "unknown kind 'sideways'"),
    (["frobnicate"], "unknown command 'frobnicate'"),
])
def test_bad_arguments_exit_2_with_one_line_error(argv, message, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
