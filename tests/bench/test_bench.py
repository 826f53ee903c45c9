"""The ``nki-rmsnorm`` command: the ``bench --quick`` smoke run and its JSON records, the copy
kernel and the tutorial baseline it compares against, the one-line errors (exit code 2,
before any case runs) for bad arguments, and the README's bench tables against
``docs/bench.json``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import simulate
import simulate.nki06
from nki_rmsnorm import bench, dialect, reference
from nki_rmsnorm.kernels import baseline, nki06_baseline

ROOT = Path(__file__).resolve().parents[2]
REQUIRED_KEYS = {
    "kind",
    "target",
    "M",
    "N",
    "dtype",
    "modeled_us",
    "mbu",
    "hbm_bytes_ratio",
    "busiest_engine",
    "copy_us",
    "copy_ratio",
    "baseline",
    "speedup_vs_baseline",
    "sim_wall_s",
    "correct",
}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """The bench's yardstick cache in the test's folder, never the user's."""
    monkeypatch.setenv("NKI_RMSNORM_CACHE_DIR", str(tmp_path / "cache"))


def test_quick_run_checks_results_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    # one process: the suite's own workers share the cores (-j is tested in test_bench_runs)
    argv = ["bench", "--quick", "--target", "trn2", "-j", "1", "--json", str(path)]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    assert {(r["kind"], r["M"], r["N"]) for r in records} == {
        (k, M, N) for k in bench.KINDS for M, N in bench.QUICK_SHAPES
    }
    for r in records:
        assert REQUIRED_KEYS <= set(r)
        assert r["correct"] is True and r["target"] == "trn2" and r["dtype"] == "bfloat16"
        # the package's default on trn2
        assert (r["dialect"], r["lnc"]) == (dialect.for_target("trn2"), 1)
        assert 0 < r["mbu"] <= 1.0
        assert r["modeled_us"] > 0 and r["sim_wall_s"] > 0
        assert r["hbm_bytes_ratio"] >= 0.99  # never fewer bytes than the data itself
        assert r["busiest_engine"] in ("pe", "act", "dve", "pool")
        assert 0 < r["busiest_engine_util"] <= 1.0 and 0 < r["dma_busy"] <= 1.0
        # no kernel moving the same bytes beats a plain copy of them
        assert r["copy_ratio"] == pytest.approx(r["modeled_us"] / r["copy_us"])
        assert r["copy_ratio"] > 0.98
        assert r["speedup_vs_baseline"] is None or r["speedup_vs_baseline"] > 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("kind") and out.count("trn2") == len(records)


def test_minimal_bytes_follow_the_roofline_table():
    # docs/design.md: 4096² bf16 forward 67.12 MB (+ 4·M for rstd), backward 100.70 MB
    assert bench.minimal_hbm_bytes("fwd", 4096, 4096, 2) == 67_117_056 + 4 * 4096
    assert bench.minimal_hbm_bytes("bwd", 4096, 4096, 2) == 100_704_256
    assert bench.minimal_hbm_bytes("fused_add", 1, 1, 4) == 4 * 4 + 4 + 4


@pytest.mark.parametrize("M, N", [(29, 17389), (300, 1000), (1, 130)])
def test_copy_kernels_copy_and_use_all_dma_engines_when_they_can(M, N):
    rng = np.random.default_rng(M)
    a = rng.standard_normal((M, N)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((M, N)).astype(ml_dtypes.bfloat16)
    out, prof = simulate.profile(baseline.copy_one, a, target="trn2")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
    assert prof.hbm_read_bytes == prof.hbm_write_bytes == a.nbytes
    out_a, out_b = simulate.profile(baseline.copy_two, a, b, target="trn2")[0]
    np.testing.assert_array_equal(np.asarray(out_b), np.asarray(b))
    out, prof = simulate.profile(baseline.copy_two_store_one, a, b, target="trn2")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
    assert prof.hbm_read_bytes == 2 * a.nbytes and prof.hbm_write_bytes == a.nbytes
    row = baseline.copy_row_length(M * N, 2)
    assert 1 <= row and row * 2 <= 16 * 1024
    assert M * N // row >= 128  # every 128-row transfer spans all 16 DMA engines


def test_copy_reaches_the_modeled_memory_ceiling():
    x = np.random.default_rng(0).standard_normal((2048, 4096)).astype(ml_dtypes.bfloat16)
    _, prof = simulate.profile(baseline.copy_one, x, target="trn2")
    table = simulate.cost.CostTable("trn2")
    ceiling = min(
        table.hbm_share_gbps * table.hbm_efficiency,
        16 * table.dma_engine_peak_gbps * table.dma_efficiency,
    )
    assert 2 * x.nbytes / prof.latency_us / 1000 > 0.95 * ceiling


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_tutorial_baseline_matches_the_tutorial_formula(dtype):
    rng = np.random.default_rng(1)
    a = (rng.standard_normal((200, 384)) + 0.5).astype(dtype)
    g = rng.uniform(0.5, 1.5, 384).astype(dtype)
    out = np.full(a.shape, np.nan, dtype)
    simulate.profile(baseline.tutorial_rmsnorm, a, g, out, target="trn1")
    a64 = a.astype(np.float64)
    want = a64 / np.sqrt(np.mean(a64 * a64, axis=1, keepdims=True)) * g.astype(np.float64)
    rtol = 2e-6 if dtype == np.float32 else 3e-2
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=rtol, atol=rtol * 1e-2)


def test_backward_baseline_keeps_the_input_dtype_on_the_vector_engine():
    rng = np.random.default_rng(2)
    x, dy = (rng.standard_normal((256, 2048)).astype(ml_dtypes.bfloat16) for _ in range(2))
    w = (1 + 0.1 * rng.standard_normal(2048)).astype(ml_dtypes.bfloat16)
    _, rstd = reference.rms_norm_fwd(x, w, 1e-6)
    dx, dw = np.empty_like(x), np.empty_like(w)
    _, trace = simulate.trace_kernel(baseline.tutorial_rmsnorm_bwd, dy, x, w, rstd, dx, dw)
    full_width = [
        i
        for i in trace
        if i.engine == "dve"
        and i.free_size == 2048
        and i.opcode in ("tensor_tensor", "tensor_scalar")
    ]
    assert full_width and all(i.out_dtype == "bfloat16" for i in full_width)
    ref_dx = reference.rms_norm_bwd(dy, x, w, rstd)[0]
    scale = bench._dx_row_scale(dy, x, w, rstd)
    assert np.max(np.abs(dx.astype(np.float64) - ref_dx.astype(np.float64)) / scale) < 0.1


def test_backward_check_scales_dx_by_its_row_terms(capsys):
    # one element per row: dx = rstd·(g − x̂·g·x̂) cancels to ~0, so max|reference| is no scale
    assert (
        bench.main(
            [
                "bench",
                "--shapes",
                "1x1",
                "--dtype",
                "fp16",
                "--kind",
                "bwd",
                "--target",
                "trn2",
                "--no-baseline",
                "-j",
                "1",
            ]
        )
        == 0
    )
    assert "WRONG RESULT" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--target", "trn9"], "unknown target 'trn9'"),
        (["bench", "--dtype", "fp64"], "unknown dtype 'fp64'"),
        (["bench", "--shapes", "4096by4096"], "malformed shape '4096by4096'"),
        (["bench", "--shapes", "0x4096"], "malformed shape '0x4096'"),
        (["bench", "--kind", "fwd,sideways"], "unknown kind 'sideways'"),
        (["bench", "--target", ","], "names no target"),
        (["bench", "--kind", ","], "names no kind"),
        (["bench", "--shapes", "1x140000", "--kind", "bwd"], "over the backward kernel's limit"),
        (["bench", "--json", "/missing/dir/x.json"], "directory /missing/dir does not exist"),
        (["bench", "--plot", "/missing/dir/x.png"], "directory /missing/dir does not exist"),
        (["bench", "--lnc", "3"], "--lnc '3': expected 1 or 2"),
        (["bench", "--lnc", "2", "--target", "trn2,trn1"], "--lnc 2 needs trn2 or trn3"),
        (
            ["bench", "--lnc", "2", "--target", "trn2", "--dialect", "legacy"],
            "--lnc 2 needs --dialect nki06",
        ),
        (
            ["bench", "--target", "trn2x2", "--dialect", "legacy"],
            "a target at LNC=2 (x2) needs --dialect nki06",
        ),
        (["bench", "--target", "trn1x2"], "unknown target 'trn1x2'"),
        (["bench", "--dialect", "v7"], "unknown dialect 'v7'"),
        (["bench", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "required: command"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_error_before_any_case(
    argv, message, capsys, monkeypatch
):
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    assert bench.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and len(err.splitlines()) == 1 and captured.out == ""


def test_nki06_dialect_without_its_kernels_is_a_usage_error(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in bench.NKI06_MODULES else real(name, *a),
    )
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    for argv in (["--dialect", "nki06"], ["--dialect", "nki06", "--lnc", "2", "--target", "trn2"]):
        assert bench.main(["bench", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "--dialect nki06 is not available" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("M, N", [(29, 17389), (300, 1000), (1, 130)])
@pytest.mark.parametrize("lnc", [1, 2])
def test_nki06_copy_kernels_copy_on_one_or_two_cores(M, N, lnc, monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    rng = np.random.default_rng(M + lnc)
    a = rng.standard_normal((M, N)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((M, N)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(nki06_baseline.copy_one[lnc](a), a)
    out_a, out_b = nki06_baseline.copy_two[lnc](a, b)
    np.testing.assert_array_equal(out_a, a)
    np.testing.assert_array_equal(out_b, b)
    np.testing.assert_array_equal(nki06_baseline.copy_two_store_one[lnc](a, b), a)
    trace = simulate.nki06.last_trace()
    read, written = trace.hbm_bytes()
    assert (read, written) == (2 * a.nbytes, a.nbytes)
    tiles = -(-(M * N // baseline.copy_row_length(M * N, 2)) // 128)
    cores = {inst.program for inst in trace}
    assert cores == ({(0,), (1,)} if lnc == 2 and tiles > 1 else {(0,)})


@pytest.mark.parametrize(
    ("argv", "targets"),
    [
        (["--dialect", "nki06"], [("trn1", 1), ("trn2", 1), ("trn2", 2), ("trn3", 1)]),
        (["--dialect", "legacy"], [("trn1", 1), ("trn2", 1), ("trn3", 1)]),
        (["--dialect", "nki06", "--lnc", "2", "--target", "trn2,trn3"], [("trn2", 2), ("trn3", 2)]),
        (["--dialect", "nki06", "--target", "trn3x2,inf2"], [("trn3", 2), ("inf2", 1)]),
    ],
)
def test_target_list_and_its_lnc_degrees(argv, targets):
    sweep = bench._check(bench.build_parser().parse_args(["bench", *argv]))
    assert list(sweep.targets) == targets


def test_trn1_and_inf2_rows_run_the_legacy_kernels(tmp_path):
    """The dialect follows the target: with ``--dialect nki06`` the trn1 and inf2 rows still
    run (and record) the legacy kernels, the trn2 row the 0.6 ones (NKI 0.x supports
    Trn2/Trn3 only)."""
    path = tmp_path / "bench.json"
    argv = [
        "bench",
        "--dialect",
        "nki06",
        "--target",
        "inf2,trn1,trn2",
        "--kind",
        "fwd",
        "--shapes",
        "129x1024",
        "--no-baseline",
        "--json",
        str(path),
    ]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    assert [(r["target"], r["dialect"], r["correct"]) for r in records] == [
        ("inf2", "legacy", True),
        ("trn1", "legacy", True),
        ("trn2", "nki06", True),
    ]


def test_default_dialect_is_the_packages(monkeypatch):
    for chosen in dialect.DIALECTS:
        monkeypatch.setenv(dialect.ENV_VAR, chosen)
        assert bench._check(bench.build_parser().parse_args(["bench"])).dialect == chosen


def test_nki06_dialect_runs_the_06_kernels_on_one_or_two_cores(tmp_path):
    """``--dialect nki06`` runs the 0.6 kernels and their 0.6 copy yardstick; a ``trn2x2``
    target launches both on the two physical cores of a trn2 logical core: the result is
    still checked against the reference, and the modeled time drops well below the LNC=1
    one. The tables made of these records show LNC=2 beside LNC=1, its speed-up, and the
    speed-up goal (its M threshold lowered to this small sweep's M)."""
    path = tmp_path / "bench.json"
    argv = [
        "bench",
        "-j",
        "1",
        "--dialect",
        "nki06",
        "--target",
        "trn2,trn2x2",
        "--kind",
        "fwd,bwd",
        "--shapes",
        "1024x2048",
        "--no-baseline",
        "--json",
        str(path),
    ]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    by_case = {(r["kind"], r["lnc"]): r for r in records}
    assert set(by_case) == {(kind, lnc) for kind in ("fwd", "bwd") for lnc in (1, 2)}
    speedups = {}
    for (kind, lnc), record in by_case.items():
        assert (record["dialect"], record["target"], record["correct"]) == ("nki06", "trn2", True)
        if lnc == 2:
            single = by_case[kind, 1]
            assert record["modeled_us"] < 0.75 * single["modeled_us"]
            assert record["copy_us"] < 0.75 * single["copy_us"]
            speedups[kind] = single["modeled_us"] / record["modeled_us"]

    gen = _gen_tables()
    gen.LNC_GOAL_MIN_M = 1024
    tables = gen.bench_tables(records)
    lnc2_columns = (
        "| trn2 LNC=2 µs | trn2 LNC=2 ×copy | trn2 LNC=2 MBU | trn2 LNC=2 speed-up vs LNC=1 |"
    )
    assert lnc2_columns in tables
    assert "nki06 kernels" in tables
    for kind, title in (("fwd", "Forward"), ("bwd", "Backward")):
        single, double = by_case[kind, 1], by_case[kind, 2]
        row = (
            f"| 1024×2048 | {single['modeled_us']:,.1f} | {single['copy_ratio']:.3f} | "
            f"{100 * single['mbu']:.1f} % | {double['modeled_us']:,.1f} | "
            f"{double['copy_ratio']:.3f} | {100 * double['mbu']:.1f} % | "
            f"{speedups[kind]:.2f}× |"
        )
        assert row in tables, (title, row)
        within = int(speedups[kind] >= gen.LNC_SPEEDUP_GOAL)
        goal = (
            f"| {kind} | trn2 LNC=2 | ≥ 1.9× LNC=1 (M ≥ 1024) | {within} of 1 | "
            f"{speedups[kind]:.2f}× | 1024×2048 |"
        )
        assert goal in tables
        # the copy-ratio goals are the LNC=1 core's: one trn2 row per kind, none for LNC=2
        copy_goals = [
            line
            for line in tables.splitlines()
            if line.startswith(f"| {kind} | trn2") and "×copy" in line
        ]
        assert len(copy_goals) == 1 and f"| {single['copy_ratio']:.3f} |" in copy_goals[0]


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert bench.main(["bench", "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_version_and_help(capsys):
    assert bench.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"nki-rmsnorm {importlib.metadata.version('nki-rmsnorm')}"
    )
    assert bench.main(["bench", "--help"]) == 0
    assert "--shapes" in capsys.readouterr().out


def _gen_tables():
    spec = importlib.util.spec_from_file_location("gen_tables", ROOT / "scripts" / "gen_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_bench_tables_are_generated_from_the_json():
    gen = _gen_tables()
    records = json.loads((ROOT / "docs" / "bench.json").read_text())
    assert REQUIRED_KEYS <= set(records[0])
    assert gen.bench_tables(records) in (ROOT / "docs" / "benchmark.md").read_text(), (
        "docs/benchmark.md is out of date: run python scripts/gen_tables.py"
    )
    assert gen.headline_table(records) in (ROOT / "README.md").read_text(), (
        "README.md is out of date: run python scripts/gen_tables.py"
    )
    assert gen.out_of_date() == []
