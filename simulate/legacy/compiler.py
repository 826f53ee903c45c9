"""``neuronxcc.nki.compiler``: explicit-allocation and compiler directives.

They only change where the compiler places tiles and how it schedules, never the numbers.
The directives pass through; the direct-allocation APIs (``ncc.sbuf/psum.alloc`` and
``mod_alloc``) carry the kernel's placement function, whose locations the simulator checks
against the allocation guide's rules and against each other
(:func:`simulate.core.memory.check_direct_placement`, :func:`check_placement_clashes`).
"""

from __future__ import annotations

from ..core.errors import NKITypeError, NKIValueError

_GUIDE = "aws-neuron-sdk@8a38e733 general/nki/nki_direct_allocation_guide.rst"


class _Allocator:
    def __init__(self, buffer: str, modulo=None, place=None):
        self.__nki_buffer__ = buffer
        # per block dimension, the moduli that pick a logical tile's physical tile (mod_alloc)
        self.__nki_modulo__ = modulo
        # (idx, pdim_size, fdim_size) -> the physical location of logical block ``idx``
        self.__nki_place__ = place

    def __repr__(self):
        return f"<{self.__nki_buffer__} allocator>"


class _Memory:
    def __init__(self, buffer: str):
        self.buffer = buffer

    def auto_alloc(self, *args, **kwargs):
        return _Allocator(self.buffer)

    def alloc(self, func):
        """``ncc.sbuf.alloc(func)`` / ``ncc.psum.alloc(func)``: ``func(idx, pdim_size,
        fdim_size)`` returns the physical location of logical block ``idx``:
        ``(start_partition, byte_addr)`` in SBUF, ``(bank_id, start_partition, byte_addr)`` in
        PSUM (general/nki/api/nki/compiler/sbuf.py L6-L66, psum.py L4-L67 @8a38e733); the
        compiler "will statically evaluate ``func`` over indices of all the logical tiles"
        (general/nki/nki_direct_allocation_guide.rst L160-L161), as the simulator does when the
        tensor is created."""
        if not callable(func):
            raise NKITypeError(
                f"ncc.{self.buffer}.alloc(func): func must be a callable (idx, pdim_size, "
                f"fdim_size) -> physical location, got {type(func).__name__} "
                f"({_GUIDE} L137-L145)",
                "err_unsupported_buffer",
            )
        return _Allocator(self.buffer, place=func)

    def mod_alloc(
        self,
        *,
        base_addr=0,
        base_partition=0,
        base_bank=0,
        num_bank_tiles=(),
        num_par_tiles=(),
        num_free_tiles=(),
    ):
        """Logical tile ``idx`` of the tensor lives in physical tile ``idx % n`` along each
        block dimension (``n`` from ``num_par_tiles`` / ``num_free_tiles``, PSUM's
        ``num_bank_tiles``; an empty tuple is ``(1, 1, ...)``: one physical tile), at
        ``base + linearized(idx % n) * scale`` as ``modulo_allocate_func`` computes it
        (aws-neuron-sdk@8a38e733 general/nki/test/test_sbuf_modulo_alloc.py L11-L31,
        test_psum_modulo_alloc.py L11-L35; api/nki/compiler/sbuf.py L68-L137, psum.py
        L69-L149). "For ``ncc.psum.mod_alloc``, the ``base_addr`` and ``start_partition``
        input fields must be 0" (general/nki/nki_direct_allocation_guide.rst L449; psum.py
        L138, L141); SBUF's ``base_partition`` "Must be 0 in the current version" (sbuf.py
        L131)."""
        for field, value in (("base_addr", base_addr), ("base_partition", base_partition)):
            if (field == "base_partition" or self.buffer == "psum") and value != 0:
                raise NKIValueError(
                    f"ncc.{self.buffer}.mod_alloc: {field} must be 0 in the current release, "
                    f"got {value} ({_GUIDE} L449; "
                    "general/nki/api/nki/compiler/sbuf.py L131, psum.py L138-L141)",
                    "err_unsupported_buffer",
                )
        counts = (tuple(num_bank_tiles), tuple(num_par_tiles), tuple(num_free_tiles))
        bank_tiles, par_tiles, free_tiles = counts

        def modulo_place(idx, pdim_size, fdim_size):
            bank = base_bank + _linear_modulo(idx, bank_tiles)
            partition = base_partition + _linear_modulo(idx, par_tiles) * pdim_size
            byte_addr = base_addr + _linear_modulo(idx, free_tiles) * fdim_size
            if self.buffer == "psum":
                return (bank, partition, byte_addr)
            return (partition, byte_addr)

        return _Allocator(self.buffer, counts, place=modulo_place)


def _linear_modulo(idx, counts) -> int:
    """Row-major linear index of ``idx % counts`` within ``counts`` (``()``: all ones)."""
    counts = tuple(counts) or (1,) * len(idx)
    linear = 0
    for i, n in zip(idx, counts):
        linear = linear * n + i % n
    return linear


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
