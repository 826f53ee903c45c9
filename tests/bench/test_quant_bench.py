"""``nki-rmsnorm bench --kind quant``: the quantized case runs, is checked against the float64
reference and measured against its copy yardstick; it is refused where the kernel does not
exist (legacy dialect, trn1 / inf2)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from nki_rmsnorm import bench


def test_quant_kind_runs_checks_and_records(tmp_path, capsys):
    path = tmp_path / "quant.json"
    argv = [
        "bench",
        "--kind",
        "quant",
        "--dialect",
        "nki06",
        "--target",
        "trn2x2,trn3",
        "--shapes",
        "130x512",
        "--json",
        str(path),
    ]
    assert bench.main(argv) == 0
    records = json.loads(path.read_text())
    assert [(r["target"], r["lnc"]) for r in records] == [("trn2", 2), ("trn3", 1)]
    for r in records:
        assert r["kind"] == "quant" and r["correct"]
        assert 0 < r["max_error"] <= bench.QUANT_HALF_SPACING["float8_e4m3"]
        assert r["copy_ratio"] > 1.0 and r["baseline_us"] is None
        # x read once, fp8 y_q and its scale bytes written once, the weight read per core
        assert r["min_hbm_bytes"] == bench.minimal_hbm_bytes("quant", 130, 512, 2)
        assert r["hbm_bytes_ratio"] < 1.01
    assert "quant" in capsys.readouterr().out


def test_quant_case_error_grows_with_a_wrong_scale(monkeypatch):
    """The accuracy check can fail: a kernel whose scales are off by 2x is caught."""
    from nki_rmsnorm import reference

    real = reference.rms_norm_quant

    def doubled(*args, **kwargs):
        want = real(*args, **kwargs)
        want["y"] = want["y"] * 2.0
        return want

    monkeypatch.setattr(reference, "rms_norm_quant", doubled)
    rng = np.random.default_rng(1)
    record = bench.run_case("quant", "trn2", 64, 256, "bfloat16", rng, False, "nki06", 1)
    assert not record.correct


def test_quant_kind_refused_on_trn3_in_legacy(capsys):
    argv = ["bench", "--kind", "quant", "--shapes", "8x64", "--target", "trn3"]
    assert bench.main([*argv, "--dialect", "legacy"]) == 2
    assert "--kind quant on trn3" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_quant_case_runs_the_legacy_kernel(target):
    """The legacy kernel's y_q and scale column, packed on the host, pass the check."""
    rng = np.random.default_rng(2)
    record = bench.run_case("quant", target, 130, 256, "bfloat16", rng, False, "legacy", 1)
    assert record.correct and record.modeled_us > 0


def test_quant_copy_yardstick_moves_the_cases_bytes():
    x = np.zeros((256, 1024), ml_dtypes.bfloat16)
    assert bench._copy_us("quant", "trn2", x, None, None, "nki06", 1) > 0


def _compare_script():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "scripts" / "compare_nkilib.py"
    spec = importlib.util.spec_from_file_location("compare_nkilib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--shapes", "2048x8192"], "BxSxH"),
        (["--tkg-shapes", "1x0x4096"], "BxSxH"),
        (["--mx", "--mx-shapes", "8x8192"], "BxSxH"),
        ([], "no src/nkilib_src/nkilib"),
    ],
)
def test_compare_script_rejects_bad_arguments(tmp_path, capsys, argv, words):
    script = _compare_script()
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--nkilib", str(tmp_path), *argv])
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err
