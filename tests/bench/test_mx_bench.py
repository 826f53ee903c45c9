"""``nki-rmsnorm bench --kind mx``: the MXFP8 case runs on trn3 (LNC 1 and 2), is checked
against the float64 reference and measured against a copy of the same bytes (x read, the fp8
values and their scale bytes written); it is refused where the kernel does not exist."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import bench


def test_mx_kind_runs_checks_and_records(tmp_path):
    path = tmp_path / "mx.json"
    argv = [
        "bench",
        "--kind",
        "mx",
        "--dialect",
        "nki06",
        "--target",
        "trn3,trn3x2",
        "--shapes",
        "130x1024",
        "--no-cache",
        "-j",
        "1",
        "--json",
        str(path),
    ]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    assert [(r["target"], r["lnc"]) for r in records] == [("trn3", 1), ("trn3", 2)]
    for r in records:
        assert r["kind"] == "mx" and r["correct"] and r["baseline_us"] is None
        assert 0.0 <= r["max_error"] <= 1.0
        assert r["copy_ratio"] > 1.0
        # x and the weight read once per core, the values and a scale byte per 32 written
        assert r["min_hbm_bytes"] == 130 * 1024 * 2 + 1024 * 2 + 130 * 1024 + 130 * 32
        assert r["hbm_bytes_ratio"] < 1.02
    assert records[1]["modeled_us"] < records[0]["modeled_us"]


def test_mx_check_catches_a_wrong_scale(monkeypatch):
    """The check can fail: scales one binade off (a kernel writing 2X) are caught."""
    real = bench._mx_run

    def doubled(*args, **kwargs):
        (y_q, scales), prof = real(*args, **kwargs)
        return (y_q, scales + np.uint8(1)), prof

    monkeypatch.setattr(bench, "_mx_run", doubled)
    record = bench.run_case(
        "mx", "trn3", 64, 512, "bfloat16", np.random.default_rng(3), False, "nki06", 1
    )
    assert not record.correct and record.max_error > 1.0


def test_mx_check_catches_a_flipped_value(monkeypatch):
    """... and one fp8 value two steps off in its block's top binade."""
    real = bench._mx_run

    def flipped(*args, **kwargs):
        (y_q, scales), prof = real(*args, **kwargs)
        y_q = y_q.copy()
        lanes = y_q.view(np.uint8)  # (N / 4, M · 4): byte 0 of [0, 0] is y[0, 0]
        lanes[0, 0] = lanes[0, 0] ^ 0x02  # e4m3fn: two mantissa steps
        return (y_q, scales), prof

    monkeypatch.setattr(bench, "_mx_run", flipped)
    x = np.full((8, 512), 1.0, ml_dtypes.bfloat16)
    x[:, 0] = 1.75  # y[0, 0] the largest of its block: the flip is in the top binade
    monkeypatch.setattr(bench, "_inputs", lambda *a: (x, None, None, None))
    record = bench.run_case(
        "mx", "trn3", 8, 512, "bfloat16", np.random.default_rng(0), False, "nki06", 1
    )
    assert not record.correct and record.max_error >= 2.0


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32])
@pytest.mark.parametrize("row_bytes", [2048, 32 * 1024])
def test_mx_copy_yardstick_moves_the_cases_bytes(dtype, row_bytes):
    x = np.zeros((130, 1536), dtype)
    a, b = bench._mx_copy_views(x, row_bytes)
    assert a.shape[0] == b.shape[0] and a.shape[1] <= row_bytes
    assert a.nbytes + b.nbytes == x.nbytes  # read: x's bytes
    assert a.nbytes == x.size + x.size // 32  # written: the values and their scales


def test_mx_copy_yardstick_runs_at_both_lncs():
    x = np.zeros((256, 1024), ml_dtypes.bfloat16)
    one = bench._copy_us("mx", "trn3", x, None, None, "nki06", 1)
    two = bench._copy_us("mx", "trn3", x, None, None, "nki06", 2)
    assert 0 < two < one


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--target", "trn2", "--dialect", "nki06"], "--kind mx needs --target trn3"),
        (["--target", "trn3,trn2x2", "--dialect", "nki06"], "not trn2"),
        (["--target", "trn3", "--dialect", "legacy"], "--kind mx needs --dialect nki06"),
        (["--target", "trn3", "--dialect", "nki06", "--shapes", "8x1000"], "multiple of 512"),
        (["--target", "trn3", "--dialect", "nki06", "--device"], "--kind mx runs on the cost"),
    ],
)
def test_mx_kind_refused_where_it_cannot_run(capsys, extra, words):
    argv = ["bench", "--kind", "mx", "--shapes", "8x512", *extra]
    assert bench.main(argv) == 2
    assert words in capsys.readouterr().err
