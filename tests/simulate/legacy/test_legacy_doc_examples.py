"""AWS's legacy NKI doc examples (``general/nki/test/test_nki_*.py`` of aws-neuron-sdk at
8a38e733: each builds kernels with ``neuronxcc.nki`` and checks them in ``unittest`` cases),
unmodified, on the legacy simulator. ``NEURON_SDK_DOCS_PATH`` names an aws-neuron-sdk checkout
whose ``general/nki`` holds them; without it these tests skip. Nothing of AWS's code is copied
here: each file runs in its own interpreter with ``neuronxcc`` bound to the simulator.

The files listed in :data:`NOT_YET` still fail here, each for the reason given; they are
strict xfails, so a file that starts passing must leave the list."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(os.environ.get("NEURON_SDK_DOCS_PATH", "/nonexistent")) / "general" / "nki"
EXAMPLES = DOCS / "test"

#: file -> why it does not pass yet (the simulator's gap, not AWS's)
NOT_YET = {
    "test_nki_isa_activation.py": "an activation's result differs from AWS's golden",
    "test_nki_isa_dropout.py": "nisa.dropout is not simulated",
    "test_nki_isa_local_gather.py": "a nisa.local_gather form is rejected",
    "test_nki_isa_nc_match_replace8.py": "one case masks with `(ix < n // 2 and iy < m // 2)`: "
    "Python `and` on index predicates, which the simulator rejects "
    "(err_ambiguous_tensor_truth_value)",
    "test_nki_isa_nc_matmul.py": "an nc_matmul form is rejected",
    "test_nki_isa_partition_reduce.py": "the example calls a module attribute the simulator "
    "exposes as a module",
    "test_nki_isa_range_select.py": "its first kernel returns an SBUF tile, which the "
    "simulator rejects (err_top_level_tensor_must_be_hbm); its chaining example passes",
    "test_nki_isa_tensor_copy_dynamic.py": "tensor_copy_dynamic_src/dst are not simulated",
    "test_psum_modulo_alloc.py": "the example calls a module attribute the simulator exposes as "
    "a module",
    "test_sbuf_modulo_alloc.py": "the example calls a module attribute the simulator exposes as "
    "a module",
}

#: files that only define kernels (no unittest case checks them): nothing to run
NO_CHECKS = {"test_nki_isa_dma_transpose.py"}

_RUNNER = """
import os, runpy, sys, unittest
import simulate
simulate.install()
os.environ.setdefault("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
names = runpy.run_path(sys.argv[1], run_name="__main__")
suite = unittest.TestSuite()
for value in names.values():
    if isinstance(value, type) and issubclass(value, unittest.TestCase):
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(value))
result = unittest.TextTestRunner(verbosity=0).run(suite)
sys.exit(0 if result.wasSuccessful() and result.testsRun else 1)
"""


def _files():
    if not EXAMPLES.is_dir():
        return [pytest.param(None, marks=pytest.mark.skip(reason="NEURON_SDK_DOCS_PATH unset"))]
    params = []
    for path in sorted(EXAMPLES.glob("test_*.py")):
        if path.name in NO_CHECKS:
            continue
        reason = NOT_YET.get(path.name)
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        params.append(pytest.param(path, id=path.name, marks=marks))
    return params


@pytest.mark.parametrize("path", _files())
def test_legacy_doc_example_passes(path, tmp_path):
    root = Path(__file__).resolve().parents[3]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NKI_SIM_")}
    environment["PYTHONPATH"] = os.pathsep.join([str(root), *sys.path])
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(path)],
        cwd=tmp_path,  # some examples write files next to where they run
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
