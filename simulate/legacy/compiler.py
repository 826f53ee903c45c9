"""``neuronxcc.nki.compiler``: explicit-allocation and compiler directives.

They only change where the compiler places tiles and how it schedules, never the numbers,
so the simulator accepts them and lets its own allocator place tiles.
"""

from __future__ import annotations


class _Allocator:
    def __init__(self, buffer: str, modulo=None):
        self.__nki_buffer__ = buffer
        # per block dimension, the moduli that pick a logical tile's physical tile (mod_alloc)
        self.__nki_modulo__ = modulo

    def __repr__(self):
        return f"<{self.__nki_buffer__} allocator>"


class _Memory:
    def __init__(self, buffer: str):
        self.buffer = buffer

    def auto_alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)

    def alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)

    def mod_alloc(self, *, num_bank_tiles=(), num_par_tiles=(), num_free_tiles=(), **kwargs):
        """Logical tile ``idx`` of the tensor lives in physical tile ``idx % n`` along each
        block dimension (``n`` from ``num_par_tiles`` / ``num_free_tiles``, PSUM's
        ``num_bank_tiles``; an empty tuple is ``(1, 1, ...)``: one physical tile), as
        ``modulo_allocate_func`` computes it (aws-neuron-sdk@8a38e733
        general/nki/test/test_sbuf_modulo_alloc.py L11-L31; api/nki/compiler/sbuf.py
        L68-L137, psum.py L69-L149)."""
        return _Allocator(
            self.buffer, (tuple(num_bank_tiles), tuple(num_par_tiles), tuple(num_free_tiles))
        )


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
