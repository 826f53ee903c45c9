"""The check kernel code (and the planners it calls) makes of its inputs.

NKI kernels are evaluated by the NKI compiler as the NKI meta-programming language, which has
no ``raise`` and no exception classes (aws-neuron-sdk@81ce03ae
nki/get-started/nki-language-guide.rst L54-56, L141-155); AWS's kernels check with a plain
``assert`` wrapped in ``kernel_assert`` (nki-library@d2ad3a5
src/nkilib_src/nkilib/core/utils/kernel_assert.py L17-18). The bindings validate every
argument before a launch (``ValueError`` / ``TypeError``), so a failing kernel assertion
means a caller bypassed them.
"""

from __future__ import annotations

__all__ = ["kernel_assert"]


def kernel_assert(condition, message):
    """Stop specialization with ``message`` unless ``condition`` holds."""
    assert condition, message
