"""Optional framework dependencies: a missing one is an ImportError naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str) -> ModuleType:
    """Import ``module``; if it is missing, raise an ``ImportError`` that says which extra of
    this package installs it (``pip install 'nki-rmsnorm[extra]'``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"this part of nki_rmsnorm needs {module!r}, which is not installed; install it "
            f"with: pip install 'nki-rmsnorm[{extra}]'"
        ) from exc
