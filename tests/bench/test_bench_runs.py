"""How ``nki-rmsnorm bench`` runs its cases: the default subset, ``--full`` and ``--quick``;
cases in parallel processes (``-j``) giving the records one process gives; the on-disk cache
of the copy and baseline yardsticks; per-case random inputs; the reference computed in row
blocks; and a ``--help`` a user can read (plain text, a legend for every column)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import bench, reference

#: Record fields that are measurements of this machine, not results of the model.
WALL_FIELDS = ("sim_wall_s",)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NKI_RMSNORM_CACHE_DIR", str(tmp_path / "cache"))


def _sweep(*argv):
    return bench._check(bench.build_parser().parse_args(["bench", *argv]))


def _modeled(path):
    records = json.loads(path.read_text())
    for r in records:
        for field in WALL_FIELDS:
            r.pop(field)
    return records


def test_default_run_is_the_headline_subset_and_full_is_the_sweep():
    assert _sweep().shapes == bench.SUBSET_SHAPES
    assert _sweep("--full").shapes == bench.FULL_SHAPES
    assert _sweep("--quick").shapes == bench.QUICK_SHAPES
    assert _sweep("--full", "--shapes", "64x512").shapes == ((64, 512),)
    assert set(bench.SUBSET_SHAPES) <= set(bench.FULL_SHAPES)  # its rows are the sweep's rows
    assert len(bench.FULL_SHAPES) == 17
    # the serving shapes: every decode batch and QK-norm head shape, one of each by default
    assert set(bench.DECODE_SHAPES) | set(bench.QK_NORM_SHAPES) <= set(bench.FULL_SHAPES)
    assert {(8, 4096), (16384, 128)} <= set(bench.SUBSET_SHAPES)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--full", "--quick"], "not allowed with argument"),
        (["-j", "0"], "-j/--jobs 0: expected a positive number"),
        (["--iters", "0"], "--iters 0: expected a count >= 1"),
        (["--warmup", "-1"], "--warmup -1: expected a count >= 0"),
    ],
)
def test_bad_run_options_exit_2_before_any_case(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("a case ran"))
    assert bench.main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_parallel_processes_give_the_records_of_one_process(tmp_path):
    argv = [
        "bench",
        "--shapes",
        "129x1024,64x2048",
        "--target",
        "trn2",
        "--kind",
        "fwd,bwd",
        "--no-cache",
    ]
    assert bench.main([*argv, "-j", "1", "--json", str(tmp_path / "one.json")]) == 0
    assert bench.main([*argv, "-j", "2", "--json", str(tmp_path / "two.json")]) == 0
    one, two = _modeled(tmp_path / "one.json"), _modeled(tmp_path / "two.json")
    assert [(r["kind"], r["M"]) for r in one] == [
        ("fwd", 129),
        ("fwd", 64),
        ("bwd", 129),
        ("bwd", 64),
    ]
    assert one == two  # same order, same inputs (per-case seeds), same modeled figures


def test_a_case_draws_the_same_inputs_whatever_runs_beside_it():
    first = bench.case_rng(0, "fwd", "trn2", 1, 128, 512).standard_normal(4)
    again = bench.case_rng(0, "fwd", "trn2", 1, 128, 512).standard_normal(4)
    other = bench.case_rng(0, "fwd", "trn1", 1, 128, 512).standard_normal(4)
    reseeded = bench.case_rng(1, "fwd", "trn2", 1, 128, 512).standard_normal(4)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other) and not np.array_equal(first, reseeded)


def test_yardstick_cache_serves_the_second_run_and_follows_the_sources(tmp_path, monkeypatch):
    cache = bench.YardstickCache(str(tmp_path / "c"))
    args = ("fused_add", "trn2", 256, 2048, "bfloat16")
    first = bench.run_case(*args, np.random.default_rng(0), True, "nki06", 1, cache)
    assert cache.hits == 0 and len(list((tmp_path / "c" / "bench").iterdir())) == 2
    again = bench.run_case(*args, np.random.default_rng(5), True, "nki06", 1, cache)
    assert cache.hits == 2
    assert (again.copy_us, again.baseline_us) == (first.copy_us, first.baseline_us)
    assert again.modeled_us == first.modeled_us
    # an edited simulator or yardstick kernel makes every stored value stale
    changed = bench.YardstickCache(str(tmp_path / "c"))
    monkeypatch.setattr(bench, "_yardstick_sources", lambda: "edited")
    bench.run_case(*args, np.random.default_rng(0), True, "nki06", 1, changed)
    assert changed.hits == 0 and len(list((tmp_path / "c" / "bench").iterdir())) == 4


@pytest.mark.parametrize(
    ("kind", "target", "lnc", "dialect"),
    [("fwd", "trn1", 1, "legacy"), ("bwd", "trn2", 2, "nki06")],  # trn1 runs legacy only
)
def test_yardsticks_do_not_depend_on_the_input_values(kind, target, lnc, dialect):
    """Why the cache key holds no seed: the cost model reads the trace, not the data."""
    nocache = bench.YardstickCache(None)
    a, b = (
        bench.run_case(
            kind,
            target,
            300,
            1024,
            "bfloat16",
            np.random.default_rng(seed),
            True,
            dialect,
            lnc,
            nocache,
        )
        for seed in (0, 1)
    )
    assert a.max_error != b.max_error  # the data did differ
    assert (a.modeled_us, a.copy_us, a.baseline_us) == (b.modeled_us, b.copy_us, b.baseline_us)


@pytest.mark.parametrize(
    ("kind", "target", "M", "N", "dialect", "lnc"),
    [
        ("fwd", "trn1", 300, 1024, "legacy", 1),
        ("fused_add", "trn2", 29, 17389, "nki06", 1),  # the "long" regime (odd N)
        ("fused_add", "trn2", 29, 17389, "legacy", 1),
        ("bwd", "trn3", 256, 2048, "nki06", 2),
        ("quant", "trn2", 256, 2048, "nki06", 1),
    ],
)
def test_every_floor_is_a_lower_bound_of_the_modeled_time(kind, target, M, N, dialect, lnc):
    """The record's per-resource floors (``floor_us``, what ``binds``) are least times: no
    floor exceeds the modeled latency of the same kernel."""
    record = bench.run_case(
        kind,
        target,
        M,
        N,
        "bfloat16",
        np.random.default_rng(0),
        False,
        dialect,
        lnc,
        bench.YardstickCache(None),
    )
    assert record.correct
    assert set(record.floor_us) == {"pe", "act", "dve", "pool", "dma", "hbm"}
    assert 0.0 < record.floor_us[record.binds] <= record.modeled_us * (1 + 1e-9)
    assert max(record.floor_us.values()) == record.floor_us[record.binds]


@pytest.mark.parametrize("residual", [False, True])
def test_reference_in_row_blocks_is_bitwise_the_one_call_reference(residual, monkeypatch):
    monkeypatch.setattr(bench, "_REFERENCE_ROWS", 7)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 300)) * 3).astype(ml_dtypes.bfloat16)
    x[5] = 0  # a zero row: rstd = 1/sqrt(eps)
    w = rng.standard_normal(300).astype(ml_dtypes.bfloat16)
    r = rng.standard_normal((40, 300)).astype(ml_dtypes.bfloat16) if residual else None
    blocks = bench._reference_fwd(x, w, r)
    whole = reference.rms_norm_fwd(x, w, bench.EPS, residual=r)
    assert len(blocks) == len(whole)
    for got, want in zip(blocks, whole):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_help_is_plain_text_with_a_legend_for_every_column(capsys):
    assert bench.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":mod:", ":data:"):
        assert markup not in text
    legend = text[text.index("columns:") :]
    columns = (
        "kind",
        "target",
        "shape",
        "model µs",
        "GB/s",
        "MBU",
        "busiest",
        "DMA",
        "HBM/min",
        "sim s",
        "×copy",
        "vs base",
        "ok",
    )
    assert [c for c in columns if c in bench.HEADER] == list(columns)  # the table's columns
    for column in columns:
        assert f"\n  {column} " in legend, column
    for option in ("--full", "--quick", "-j", "--device", "--cache-dir"):
        assert option in text
    assert "smoke run" in text and "used by tests" not in text
