"""Importing an optional framework, with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """``import module``, or an ImportError saying ``pip install 'nki-rmsnorm[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{module} is not installed; install the extra: pip install 'nki-rmsnorm[{extra}]'"
        ) from error
