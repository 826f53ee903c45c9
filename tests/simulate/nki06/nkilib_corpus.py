"""Access to AWS's nki-library (aws-neuron/nki-library) from a local checkout, for the tests
that run AWS's kernels unmodified on the NKI 0.6 simulator.

``NKI_LIBRARY_PATH`` names the repository root (the directory holding ``src/nkilib_src``);
without it, or when it does not hold the library, the tests that use :data:`requires_library`
skip. Nothing of AWS's code lives in this repository: the kernels are imported from the
checkout with ``import nki`` bound to the simulator."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

import simulate

LIBRARY = Path(os.environ.get("NKI_LIBRARY_PATH", "/nonexistent"))
SOURCES = LIBRARY / "src"
PACKAGE = "nkilib_src.nkilib"

requires_library = pytest.mark.skipif(
    not (SOURCES / "nkilib_src" / "nkilib").is_dir(),
    reason="NKI_LIBRARY_PATH does not name an aws-neuron/nki-library checkout",
)


def import_library():
    """``nkilib_src.nkilib`` from the checkout; ``nki``, ``nki.language``, ``nki.isa`` are
    the simulator's from here on, and so is ``neuronxcc.nki`` (AWS's router_topk annotates
    with ``neuronxcc.nki.typing``, ``core/router_topk/router_topk.py`` L21)."""
    simulate.install()
    if str(SOURCES) not in sys.path:
        sys.path.insert(0, str(SOURCES))
    return importlib.import_module(PACKAGE)


def library_module(name: str):
    """The library module ``nkilib_src.nkilib.<name>`` (e.g. ``core.cumsum.cumsum``)."""
    return importlib.import_module(f"{PACKAGE}.{name}")
