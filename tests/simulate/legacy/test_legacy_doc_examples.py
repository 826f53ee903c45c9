"""AWS's legacy NKI doc examples (``general/nki/test/test_nki_*.py`` of aws-neuron-sdk at
8a38e733: each builds kernels with ``neuronxcc.nki`` and checks them in ``unittest`` cases),
unmodified, on the legacy simulator. ``NEURON_SDK_DOCS_PATH`` names an aws-neuron-sdk checkout
whose ``general/nki`` holds them; without it these tests skip. Nothing of AWS's code is copied
here: each file runs in its own interpreter with ``neuronxcc`` bound to the simulator.

Each file runs whole, except the checks listed in :data:`CHECKS_OF_AWS_SIMULATOR`: they
assert what only AWS's CPU simulator does, against the documented semantics; the kernels they
check are checked against the docs in ``test_legacy_doc_example_semantics.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(os.environ.get("NEURON_SDK_DOCS_PATH", "/nonexistent")) / "general" / "nki"
EXAMPLES = DOCS / "test"

#: (file, unittest method) -> why its assertion holds only in AWS's simulator
CHECKS_OF_AWS_SIMULATOR = {
    (
        "test_nki_isa_activation.py",
        "test_activation",
    ): "compares a dtype=bfloat16 result to fp32 at 1e-5; AWS's simulator computes bfloat16 "
    "in fp32 precision (general/nki/nki_known_issues.rst L60-64)",
    (
        "test_nki_isa_dropout.py",
        "test_dropout",
    ): "drop probabilities in [0, 100) drop every element of most partitions; the check "
    "holds only without dropout ('we don't have dropout simulation implementation', L65)",
    (
        "test_nki_isa_nc_match_replace8.py",
        "test_nc_match_replace_indices8_mask",
    ): "masks with Python `and`: 'We do not support using and for masks' "
    "(general/nki/nki_known_issues.rst L38)",
}

#: files that only define kernels (no unittest case checks them): checked elsewhere
NO_CHECKS = {"test_nki_isa_dma_transpose.py"}

_RUNNER = """
import os, runpy, sys, unittest
import simulate
simulate.install()
os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
names = runpy.run_path(sys.argv[1], run_name="__main__")
excluded = set(sys.argv[2:])
suite = unittest.TestSuite()
for value in names.values():
    if isinstance(value, type) and issubclass(value, unittest.TestCase):
        for case in unittest.defaultTestLoader.loadTestsFromTestCase(value):
            if case._testMethodName not in excluded:
                suite.addTest(case)
result = unittest.TextTestRunner(verbosity=0).run(suite)
sys.exit(0 if result.wasSuccessful() and (result.testsRun or excluded) else 1)
"""


def _files():
    if not EXAMPLES.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="NEURON_SDK_DOCS_PATH unset"))]
    params = []
    for path in sorted(EXAMPLES.glob("test_*.py")):
        if path.name in NO_CHECKS:
            continue
        params.append(pytest.param(path, id=path.name))
    return params


@pytest.mark.parametrize("path", _files())
def test_legacy_doc_example_passes(path, tmp_path):
    root = Path(__file__).resolve().parents[3]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment["PYTHONPATH"] = os.pathsep.join([str(root), *sys.path])
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _RUNNER,
            str(path),
            *(method for (name, method) in CHECKS_OF_AWS_SIMULATOR if name == path.name),
        ],
        cwd=tmp_path,  # some examples write files next to where they run
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


# --- the example scripts (general/nki/examples) ------------------------------------------------
SCRIPTS = DOCS / "examples"

#: scripts that run on a CPU (NumPy, the simulator's torch_neuronx / jax_neuronx twins);
#: those that need an XLA device (``torch_xla``) or define kernels only are left out
RUNNABLE_SCRIPTS = {
    "average_pool2d/average_pool2d_nki_kernels.py": (),
    "average_pool2d/average_pool2d_jax.py": (),
    "transpose2d/transpose2d_nki_kernels.py": (),
    "transpose2d/transpose2d_jax.py": (),
    "tensor_addition/spmd_tensor_addition_nki_kernels.py": (),
    "tensor_addition/spmd_tensor_addition_jax.py": (),
    "tensor_addition/spmd_multiple_nc_tensor_addition_nki_kernels.py": (),
    "tensor_addition/spmd_multiple_nc_tensor_addition_jax.py": (),
    "getting_started_baremetal.py": (),
    "getting_started_jax.py": (),
    "rmsnorm/rmsnorm_nki_kernels.py": (),
    "fused_mamba/mamba_nki_kernels.py": (),
    "prof-kernel-benchmark.py": (),
    "prof-kernel-profile.py": (),
    "attention/test_attention.py": (),
    "sd_attention/sd_attention_nki_kernels.py": (pytest.mark.slow,),  # ~3 minutes
    "layernorm/layernorm_nki_kernel.py": (),
}

_SCRIPT_RUNNER = """
import os, runpy, sys
import simulate
simulate.install()
os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
sys.path.insert(0, os.path.dirname(sys.argv[1]))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _scripts():
    if not SCRIPTS.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="NEURON_SDK_DOCS_PATH unset"))]
    return [pytest.param(name, id=name, marks=marks) for name, marks in RUNNABLE_SCRIPTS.items()]


@pytest.mark.parametrize("name", _scripts())
def test_legacy_example_script_runs(name, tmp_path):
    """The script runs to its end; those that compare with NumPy / JAX print a match (a
    mismatch prints "differ"/"False" or raises)."""
    root = Path(__file__).resolve().parents[3]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment["PYTHONPATH"] = os.pathsep.join([str(root), *sys.path])
    environment["HOME"] = str(tmp_path)  # nki.profile's working directory lives under it
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT_RUNNER, str(SCRIPTS / name)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lowered = result.stdout.lower()
    assert "differ" not in lowered and "? false" not in lowered, result.stdout[-2000:]


# --- the attention tutorial's kernel versions (general/nki/examples/attention) ----------------
#: attn_fwd_v1 ... v11 of attention_kernels.py; test_attention.py runs only v1 when executed,
#: its ``test_attn_tutorial("accuracy", version)`` checks any of them against NumPy
ATTENTION_VERSIONS = {
    "attn_fwd_v1": (),
    "attn_fwd_v2": (),
    # its 32 x 8 blocks of `qk` (2 KiB of PSUM each) are all live from the first matmul loop
    # to the subtraction loop, 512 KiB per partition against PSUM's 16 KiB: the compiler
    # "inserts the necessary spills or refills" (general/nki/programming_model.rst L172-L175)
    "attn_fwd_v3": (),
    "attn_fwd_v4": (),
    "attn_fwd_v5": (),
    "attn_fwd_v6": (),
    "attn_fwd_v7": (),
    "attn_fwd_v8": (),
    "attn_fwd_v8a": (pytest.mark.slow,),  # ~45 s each from here on
    "attn_fwd_v9": (pytest.mark.slow,),
    "attn_fwd_v10": (pytest.mark.slow,),
    "attn_fwd_v11": (pytest.mark.slow,),
}

_ATTENTION_RUNNER = """
import os, runpy, sys
import simulate
simulate.install()
os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
sys.path.insert(0, os.path.dirname(sys.argv[1]))
names = runpy.run_path(sys.argv[1], run_name="__main__")
names["test_attn_tutorial"]("accuracy", names[sys.argv[2]])
"""


def _attention_versions():
    if not (SCRIPTS / "attention").is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="NEURON_SDK_DOCS_PATH unset"))]
    return [pytest.param(name, id=name, marks=marks) for name, marks in ATTENTION_VERSIONS.items()]


@pytest.mark.parametrize("version", _attention_versions())
def test_legacy_attention_tutorial_version_matches_numpy(version, tmp_path):
    """AWS's own accuracy check (``np.allclose(kernel, numpy, atol=1e-2)`` on fresh random
    inputs, sequence length 4096 from v3 on) passes for the version."""
    root = Path(__file__).resolve().parents[3]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment["PYTHONPATH"] = os.pathsep.join([str(root), *sys.path])
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            _ATTENTION_RUNNER,
            str(SCRIPTS / "attention" / "test_attention.py"),
            version,
        ],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
