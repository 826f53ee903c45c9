"""Concurrent calls through every front end give the serial results and never deadlock.

8 threads × 3 front ends (NumPy launchers, PyTorch, jitted JAX forward and ``grad``) × 20
calls, each thread on its own inputs, every result bitwise equal to the serial one
(``concurrency_workload.py``). The workload runs in a fresh interpreter under a timeout,
so a deadlock fails the test instead of hanging CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
TIMEOUT_S = 300


def test_threads_through_every_front_end_match_serial_results():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    try:
        done = subprocess.run(
            [sys.executable, str(HERE / "concurrency_workload.py")],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
            cwd=HERE.parents[1],
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"concurrent calls did not finish in {TIMEOUT_S} s (deadlock?):\n"
            f"{(exc.stderr or b'')[-4000:]!r}"
        )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-4000:]}"
    assert done.stdout.strip() == "OK 480 calls"
