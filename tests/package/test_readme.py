"""Every example in the README runs: each ```python block is executed as written (on the
simulator), the commands it names exist, and ``make run``'s script works on a small shape."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
#: Top-level modules a block imports that are optional extras: the block needs them.
OPTIONAL = ("torch", "jax", "transformers", "flax", "equinox")


def _needs(block: str) -> list[str]:
    imported = re.findall(r"^\s*(?:import|from)\s+([a-z_]+)", block, flags=re.M)
    imported += re.findall(r"^\s*from\s+nki_rmsnorm\s+import\s+(jax|hf)\b", block, flags=re.M)
    names = {"hf": "transformers"}
    return sorted({names.get(m, m) for m in imported} & set(OPTIONAL))


def test_readme_has_the_user_examples():
    assert len(PYTHON_BLOCKS) >= 3, "the PyTorch, Hugging Face and JAX examples"
    needs = [_needs(block) for block in PYTHON_BLOCKS]
    assert ["torch"] in needs and ["jax"] in needs and ["transformers"] in needs, needs


@pytest.mark.parametrize(
    "block", PYTHON_BLOCKS, ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))]
)
def test_readme_python_block_runs(block):
    for module in _needs(block):
        pytest.importorskip(module)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    if "RMSNorm(4096" in block:  # the PyTorch example: forward and backward really ran
        y = namespace["y"]
        assert y.shape == (8, 4096) and str(y.dtype) == "torch.bfloat16"
        assert namespace["norm"].weight.grad is not None
    if "hf.apply" in block:
        assert namespace["replaced"], "hf.apply swapped no norm"
        assert all(type(m).__module__.startswith("nki_rmsnorm") for m in _norms(namespace))
    if "nki_jax.rms_norm" in block:
        import numpy as np

        y = np.asarray(namespace["y"], np.float32)
        assert y.shape == (8, 4096) and np.all(y == 1.0)  # ones normalise to ones


def _norms(namespace):
    model = namespace["model"]
    return [model.get_submodule(name) for name in namespace["replaced"]]


def test_readme_commands_are_make_targets():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", README, flags=re.M):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target} is no target"
    assert "examples/quickstart.py" in makefile


def test_quickstart_runs_and_checks_every_kernel():
    """``make run``'s script, on a small shape: nine results, each checked correct."""
    result = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--shape", "256x1024", "--jobs", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("Trn", "Inf"))]
    assert len(rows) == 9, result.stdout
    assert all(line.endswith("yes") for line in rows), result.stdout
    assert "Trn1 / Inf2" in rows[0] and "neuronxcc.nki" in rows[0]
