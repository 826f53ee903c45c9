"""``nki-rmsnorm bench --device``: the timing loop, percentiles, model column and row format
run here; the measurement itself needs a NeuronDevice (``-m neuron``, skipped elsewhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nki_rmsnorm import bench, device, dialect

ROOT = Path(__file__).resolve().parents[2]


def test_time_iterations_warms_up_then_times_each_synchronised_step(monkeypatch):
    clock = {"now": 0.0}
    events = []
    durations = iter([5e-6] * 3 + [1e-6 * k for k in range(1, 11)])  # warm-up, then 1..10 µs

    def step():
        events.append("step")
        clock["now"] += next(durations)

    def synchronize():
        events.append("sync")

    monkeypatch.setattr(device.time, "perf_counter", lambda: clock["now"])
    p50, p99 = device.time_iterations(step, synchronize, warmup=3, iters=10)
    assert events.count("step") == 13
    # every measured step starts and ends on a synchronised device
    measured = events[6:]
    assert measured == ["sync", "step", "sync"] * 10
    assert p50 == pytest.approx(5.5) and p99 == pytest.approx(9.91)


def test_percentiles_need_a_sample():
    assert device.percentiles([3.0]) == (3.0, 3.0)
    with pytest.raises(ValueError, match="no samples"):
        device.percentiles([])


def test_model_column_comes_from_the_bench_records(tmp_path):
    records = json.loads((ROOT / "docs" / "bench.json").read_text())
    r = next(r for r in records if r["lnc"] == 1)
    assert (
        device.model_estimate(r["kind"], r["target"], r["M"], r["N"], r["dtype"])
        == (r["modeled_us"])
    )
    assert device.model_estimate("fwd", "trn2", 3, 5, "bfloat16") is None
    assert device.model_estimate("fwd", "trn2", 3, 5, "bfloat16", 1, str(tmp_path / "x")) is None


def test_a_row_without_a_framework_says_n_a():
    record = device.DeviceRecord(
        kind="bwd", target="trn1", M=4096, N=4096, dtype="bfloat16", nki_p50_us=101.25,
        nki_p99_us=110.0, nki_method="nki.benchmark", model_us=None, framework_p50_us=None,
        framework_p99_us=None, framework=None, dialect="legacy", warmup=5, iters=20,
    )  # fmt: skip
    row = device.format_row(record)
    assert row.split() == ["bwd", "trn1", "4096x4096", "101.2", "110.0", "n/a", "n/a", "n/a",
                           "n/a"]  # fmt: skip
    assert len(device.DEVICE_HEADER) >= len(row) - 2


@pytest.mark.neuron
@pytest.mark.skipif(dialect.simulated(), reason="needs the Neuron SDK and a NeuronDevice")
def test_device_bench_measures_every_case(tmp_path, capsys):  # pragma: no cover - device
    path = tmp_path / "device.json"
    argv = ["bench", "--device", "--quick", "--warmup", "2", "--iters", "5", "--json", str(path)]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    assert {(r["kind"], r["M"], r["N"]) for r in records} == {
        (k, M, N) for k in bench.KINDS for M, N in bench.QUICK_SHAPES
    }
    for r in records:
        assert 0 < r["nki_p50_us"] <= r["nki_p99_us"]
        assert r["framework"] is None or 0 < r["framework_p50_us"] <= r["framework_p99_us"]
    assert capsys.readouterr().out.startswith("device: ")


def test_device_run_plumbing_on_a_stand_in_device(tmp_path, monkeypatch, capsys):
    """The ``--device`` run end to end with the CPU standing in for the NeuronDevice (the
    binding's simulated kernels and F.rms_norm, a no-op synchronise): every kind's two steps
    run, both figures per row, the JSON records. Says nothing about device timings."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(device, "_device_dialect", lambda: dialect.NKI06)
    monkeypatch.setattr(device, "detected_target", lambda: "trn2")
    monkeypatch.setattr(device, "_framework", lambda: ("stand-in", torch.device("cpu"), _noop))
    path = tmp_path / "device.json"
    argv = ["bench", "--shapes", "64x256", "--warmup", "1", "--iters", "3", "--json", str(path)]
    args = bench.build_parser().parse_args(argv)
    nki_torch = pytest.importorskip("nki_rmsnorm.torch")
    nki_torch.last_launch_path = None
    assert device.bench(args, bench._check(args)) == 0
    assert nki_torch.last_launch_path == "simulator"  # the NKI column ran our binding
    records = json.loads(path.read_text())
    assert [r["kind"] for r in records] == list(bench.KINDS)
    for r in records:
        assert (r["target"], r["M"], r["N"], r["dialect"]) == ("trn2", 64, 256, "nki06")
        assert r["nki_method"] == "wall clock (stand-in)" and r["framework"] == "stand-in"
        assert 0 < r["nki_p50_us"] <= r["nki_p99_us"]
        assert 0 < r["framework_p50_us"] <= r["framework_p99_us"]
        assert r["model_us"] is None and (r["warmup"], r["iters"]) == (1, 3)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("device: trn2, NKI dialect nki06, framework stand-in")
    assert out[1] == device.DEVICE_HEADER and len(out) == 2 + len(records)


def _noop():
    return None
