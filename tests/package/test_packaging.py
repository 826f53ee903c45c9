"""Packaging promises: the version from the package metadata, the typing marker, and a
framework module imported without its framework naming the extra that installs it."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import nki_rmsnorm

ROOT = Path(__file__).resolve().parents[2]


def test_version_comes_from_the_package_metadata():
    try:
        expected = metadata.version("nki-rmsnorm")
    except metadata.PackageNotFoundError:
        expected = "0+unknown"
    assert nki_rmsnorm.__version__ == expected
    assert nki_rmsnorm.__version__ != ""


def test_package_is_marked_typed_and_ships_the_marker():
    assert (ROOT / "nki_rmsnorm" / "py.typed").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'nki_rmsnorm = ["py.typed"]' in pyproject


@pytest.mark.parametrize(
    "module, framework, extra",
    [
        ("nki_rmsnorm.torch", "torch", "torch"),
        ("nki_rmsnorm.jax", "jax", "jax"),
        ("nki_rmsnorm.hf", "transformers", "hf"),
    ],
)
def test_missing_framework_names_the_extra(module, framework, extra):
    """In a fresh interpreter where ``framework`` cannot be imported (``sys.modules`` entry
    None: Python's documented way to block an import), importing the binding raises an
    ImportError whose message gives the pip command with the right extra."""
    code = (
        "import sys\n"
        f"sys.modules[{framework!r}] = None\n"
        "try:\n"
        f"    import {module}\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert f"pip install 'nki-rmsnorm[{extra}]'" in result.stdout, result.stdout


def test_require_returns_the_module_when_present():
    from nki_rmsnorm._optional import require

    assert require("json", extra="unused") is sys.modules["json"]
