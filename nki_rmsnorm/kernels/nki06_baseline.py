"""The bench's copy yardstick in the ``nki`` 0.6 dialect, for LNC=1 and LNC=2 launches.

The same plain DMA copies as :mod:`nki_rmsnorm.kernels.baseline` (HBM → SBUF → HBM over the
flat view of the tensors, whole rows of :func:`~nki_rmsnorm.kernels.baseline.copy_row_length`
elements for the given ``row_bytes``, 128 rows per transfer), written with
``nki.isa.dma_copy`` into SBUF tiles. Launched as ``kernel[2]`` on trn2/trn3, each physical
core copies its own contiguous half of the rows (``nl.program_id(0)``), so the copy time under
LNC=2 is what a logical core can move, the figure the RMSNorm kernels' LNC=2 copy ratio is
measured against.
"""

from __future__ import annotations

import math

import simulate.nki06
from nki_rmsnorm.kernels.baseline import _COPY_ROW_BYTES, copy_row_length
from nki_rmsnorm.plan.dtypes import dtype_bytes

if simulate.nki06.real_nki_available():  # pragma: no cover - needs the Neuron SDK 2.31+
    import nki
    import nki.isa as nisa
    import nki.language as nl
else:
    nki = simulate.nki06
    nisa = simulate.nki06.isa
    nl = simulate.nki06.language

_PARTITIONS = 128


def _core_rows(rows: int) -> tuple[int, int]:
    """This physical core's share ``[start, stop)`` of ``rows`` copy rows: whole 128-row
    tiles, the first core taking the extra tile when their count is odd."""
    cores = nl.num_programs(0) if nl.program_ndim() else 1
    core = nl.program_id(0) if nl.program_ndim() else 0
    tiles = math.ceil(rows / _PARTITIONS)
    per_core = math.ceil(tiles / cores)
    start = min(rows, core * per_core * _PARTITIONS)
    return start, min(rows, start + per_core * _PARTITIONS)


def _copy_tiles(views, targets):
    """Copy the 2-D ``views[k]`` into ``targets[k]`` for the targets given (a view without a
    target is loaded only), 128 rows at a time over this core's rows; the views share their
    row count, not their width."""
    start, stop = _core_rows(views[0].shape[0])
    for r0 in range(start, stop, _PARTITIONS):
        count = min(_PARTITIONS, stop - r0)
        tiles = []
        for view in views:
            tile = nl.ndarray((count, view.shape[1]), view.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=view[r0 : r0 + count])
            tiles.append(tile)
        for k in range(len(targets)):
            nisa.dma_copy(dst=targets[k][r0 : r0 + count], src=tiles[k])


def _copy_rows(sources, outputs, row_bytes):
    """Copy ``sources[k]`` into ``outputs[k]`` for the outputs given (a source without an
    output is loaded only), over this core's rows of the flat view; the last core also
    copies the ``size mod F`` trailing elements as one short row."""
    size = 1
    for extent in sources[0].shape:
        size *= extent
    width = copy_row_length(size, dtype_bytes(sources[0].dtype), row_bytes)
    rows, tail = divmod(size, width)
    flat = []
    views = []
    for t in sources:
        flat.append(t.reshape((size,)))
        views.append(flat[-1][0 : rows * width].reshape((rows, width)))
    flat_out = []
    targets = []
    for t in outputs:
        flat_out.append(t.reshape((size,)))
        targets.append(flat_out[-1][0 : rows * width].reshape((rows, width)))
    _copy_tiles(views, targets)
    last_core = (nl.program_id(0) if nl.program_ndim() else 0) == (
        nl.num_programs(0) if nl.program_ndim() else 1
    ) - 1
    if tail and last_core:
        tiles = []
        for t in flat:
            tile = nl.ndarray((1, tail), t.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=tile, src=t[rows * width : size].reshape((1, tail)))
            tiles.append(tile)
        for k in range(len(flat_out)):
            nisa.dma_copy(dst=flat_out[k][rows * width : size].reshape((1, tail)), src=tiles[k])


@nki.jit
def copy_one(a, row_bytes=_COPY_ROW_BYTES):
    """A copy of ``a`` (the bytes of a forward case)."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    _copy_rows([a], [out], row_bytes)
    return out


@nki.jit
def copy_two(a, b, row_bytes=_COPY_ROW_BYTES):
    """Copies of ``a`` and ``b`` (the bytes of a fused residual add + RMSNorm)."""
    out_a = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    out_b = nl.ndarray(b.shape, dtype=b.dtype, buffer=nl.shared_hbm)
    _copy_rows([a, b], [out_a, out_b], row_bytes)
    return out_a, out_b


@nki.jit
def copy_two_store_one(a, b, row_bytes=_COPY_ROW_BYTES):
    """Loads ``a`` and ``b`` and stores a copy of ``a`` (the bytes of a backward case: two
    tensors read, one written)."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    _copy_rows([a, b], [out], row_bytes)
    return out


@nki.jit
def copy_one_load_one(a, b):
    """Loads ``a`` and ``b`` (2-D, the same row count, any widths) and stores a copy of
    ``a``: the bytes of a case whose output is smaller than its input but not a whole
    tensor of it (the MX-quantized forward: x's bytes read as a and b, the fp8 values and
    their scales written as a's copy)."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    _copy_tiles([a, b], [out])
    return out
