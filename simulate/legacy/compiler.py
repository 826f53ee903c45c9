"""``neuronxcc.nki.compiler``: explicit-allocation and compiler directives.

They only change where the compiler places tiles and how it schedules, never the numbers,
so the simulator accepts them and lets its own allocator place tiles.
"""

from __future__ import annotations


class _Allocator:
    def __init__(self, buffer: str):
        self.__nki_buffer__ = buffer

    def __repr__(self):
        return f"<{self.__nki_buffer__} allocator>"


class _Memory:
    def __init__(self, buffer: str):
        self.buffer = buffer

    def auto_alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)

    def alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)

    def mod_alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)


sbuf = _Memory("sbuf")
psum = _Memory("psum")


def _passthrough(func=None, **kwargs):
    if func is None:
        return lambda f: f
    return func


skip_middle_end_transformations = _passthrough
enable_stack_allocator = _passthrough
force_auto_alloc = _passthrough


def multi_buffer(n: int):
    """``ncc.multi_buffer(n)``: a loop directive (performance hint)."""
    return ("multi_buffer", int(n))


def no_reorder():
    """``ncc.no_reorder()``: a loop directive that keeps the compiler from reordering the
    loop's operations ("Create an OperationOrderGuard to prevent operation reordering",
    aws-neuron-sdk@8a38e733 general/nki/api/nki/compiler/__init__.py L48-L50). The simulator
    runs and traces instructions in program order already."""
    return ("no_reorder",)
