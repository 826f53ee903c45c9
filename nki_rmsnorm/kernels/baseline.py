"""The benchmark's yardsticks: kernels users would write or pick before this package's.

* :func:`tutorial_rmsnorm` follows the Neuron RMSNorm tutorial's kernel step by step (legacy
  docs ``general/nki/examples/rmsnorm/rmsnorm_nki_kernels.py``, aws-neuron-sdk@8a38e733):
  the same ``nl`` calls in the same order and dtypes, no eps, and the output-parameter
  convention of the tutorial's earlier releases (``out_tensor`` is written in place).
* :func:`tutorial_add` then :func:`tutorial_rmsnorm` is the unfused residual add + RMSNorm,
  and :func:`tutorial_rmsnorm_bwd` the gradient written the same straightforward way (no
  published kernel exists for either). Both keep the input dtype, as the tutorial does, so
  bf16 inputs get the Vector engine's bf16 modes.
* :func:`copy_one`, :func:`copy_two` and :func:`copy_two_store_one` are plain DMA copies
  (HBM → SBUF → HBM) moving the bytes a forward, fused-add or backward case moves: the
  tensors are viewed flat as rows of up to ``row_bytes`` (default 16 KiB), 128 rows per
  transfer, so every transfer is large and the loads of different tensors overlap. The
  bench models each row length of :data:`COPY_ROW_BYTES` and keeps the fastest, so the
  yardstick is as fast as the model allows (large transfers amortise the fixed cost per
  DMA, more tiles shorten the unoverlapped first load and last store).
"""

from __future__ import annotations

import math

from nki_rmsnorm.nki import nki, nl

_COPY_ROW_BYTES = 16 * 1024  # S5 L75-86: ≥ 4 KiB per partition saturates DMA
_COPY_MIN_ROW_BYTES = 4 * 1024  # S5 L75-86: the target for full saturation
#: Row lengths (bytes per partition at most) the bench tries for the copy yardstick.
COPY_ROW_BYTES = (2 * 1024, 4 * 1024, 8 * 1024, 16 * 1024, 32 * 1024)


def tutorial_rmsnorm(a_tensor, g_tensor, out_tensor):
    """``out = a / sqrt(mean(a², axis=1)) · g`` for ``a`` (M, N), ``g`` (N,), written into
    ``out_tensor`` (M, N). Per 128-row tile: load → square → sum → divide by N → rsqrt →
    multiply by the row factor → broadcast the weight → multiply → store."""
    assert a_tensor.shape[1] == g_tensor.shape[0]
    i_row = nl.arange(128)[:, None]
    i_one = nl.arange(1)[:, None]
    i_col = nl.arange(a_tensor.shape[1])[None, :]
    num_rows = a_tensor.shape[0]
    g_tile = nl.load(g_tensor.reshape((1, g_tensor.shape[0]))[i_one, i_col])
    for i in nl.affine_range(math.ceil(num_rows / 128)):
        a_tile = nl.load(a_tensor[i * 128 + i_row, i_col], mask=(i * 128 + i_row < num_rows))
        in_square = nl.square(a_tile)
        square_sum = nl.sum(in_square, axis=[1])
        mean = square_sum / a_tensor.shape[1]
        rms_reciprocal = nl.rsqrt(mean)
        out_tile = nl.multiply(a_tile, rms_reciprocal)
        g_bcast = g_tile.broadcast_to((128, g_tensor.shape[0]))
        out_tile[...] = nl.multiply(out_tile, g_bcast, mask=(i * 128 + i_row < num_rows))
        nl.store(
            out_tensor[i * 128 + i_row, i_col], value=out_tile, mask=(i * 128 + i_row < num_rows)
        )


def tutorial_add(a, b, out):
    """``out = a + b`` for (M, N) tensors, one 128-row tile at a time (the unfused first
    half of a residual add + RMSNorm)."""
    M, N = a.shape
    i_p = nl.arange(128)[:, None]
    i_f = nl.arange(N)[None, :]
    for t in nl.affine_range(math.ceil(M / 128)):
        rows = t * 128 + i_p
        a_tile = nl.load(a[rows, i_f], mask=rows < M)
        b_tile = nl.load(b[rows, i_f], mask=rows < M)
        nl.store(out[rows, i_f], value=nl.add(a_tile, b_tile), mask=rows < M)


def tutorial_rmsnorm_bwd(dy, x, weight, rstd, dx, dweight):
    """The RMSNorm gradient the straightforward way, one 128-row tile at a time, in the
    input dtype (rstd is cast to it once per tile): ``x̂ = x·rstd``, ``g = dy·w``,
    ``dx = rstd·(g − x̂·mean(g·x̂))`` and ``dweight = Σ_rows dy·x̂``, accumulated in fp32 with
    a ones-vector matmul (Tensor engine) per 512-column chunk. Inputs: dy, x (M, N), weight
    (N,), rstd (M,) fp32; outputs dx (M, N), dweight (N,) written in place."""
    M, N = x.shape
    P = nl.tile_size.pmax
    F = nl.tile_size.psum_fmax
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(N)[None, :]
    i_one = nl.arange(1)[:, None]
    w_row = nl.load(weight.reshape((1, N))[i_one, i_f])
    ones = nl.ones((P, 1), dtype=x.dtype)
    dw_acc = nl.zeros((1, N), dtype=nl.float32)
    for t in nl.sequential_range(math.ceil(M / P)):
        rows = t * P + i_p
        x_tile = nl.load(x[rows, i_f], mask=rows < M)
        dy_tile = nl.load(dy[rows, i_f], mask=rows < M)
        # rstd (M,) viewed as (M, 1) before a 2-D index, as the legacy tutorial reshapes its
        # 1-D weight (general/nki/tutorials/rmsnorm.rst@8a38e733, L65-L68)
        r_tile = nl.load(
            rstd.reshape((M, 1))[rows, nl.arange(1)[None, :]], mask=rows < M, dtype=x.dtype
        )
        x_hat = nl.multiply(x_tile, r_tile)
        g = nl.multiply(dy_tile, w_row.broadcast_to((P, N)))
        c = nl.mean(nl.multiply(g, x_hat), axis=[1])
        dx_tile = nl.multiply(nl.subtract(g, nl.multiply(x_hat, c)), r_tile, mask=rows < M)
        nl.store(dx[rows, i_f], value=dx_tile, mask=rows < M)
        dw_part = nl.zeros((P, N), dtype=x.dtype)  # rows past M must add nothing
        dw_part[...] = nl.multiply(dy_tile, x_hat, mask=rows < M)
        for c0 in nl.static_range(0, N, F):
            width = min(F, N - c0)
            part = nl.matmul(ones, dw_part[:, c0 : c0 + width], transpose_x=True)
            dw_acc[:, c0 : c0 + width] = nl.add(dw_acc[:, c0 : c0 + width], part)
    nl.store(dweight.reshape((1, N))[i_one, i_f], value=nl.copy(dw_acc, dtype=dweight.dtype))


def copy_row_length(size: int, itemsize: int, row_bytes: int = _COPY_ROW_BYTES) -> int:
    """Elements per row of the flat copy view of a tensor of ``size`` elements: ``row_bytes``,
    or down to 4 KiB (S5 L75-86: saturates the DMA engines) so that the copy has at least 4 tiles to
    overlap loads with stores, or fewer still so that a tile spans 128 rows (all 16 DMA
    engines busy)."""
    overlap = max(_COPY_MIN_ROW_BYTES // itemsize, size // (4 * 128))
    return max(1, min(row_bytes // itemsize, overlap, size // 128))


def _copy_rows(sources, outputs, row_bytes):
    """Copy ``sources[k]`` into ``outputs[k]`` for the outputs given (a source without an
    output is loaded only). The tensors are viewed flat: whole rows of F elements, 128 rows
    per transfer, then the last ``size mod F`` elements as one short row."""
    size = math.prod(sources[0].shape)
    F = copy_row_length(size, sources[0].itemsize, row_bytes)
    rows, tail = divmod(size, F)
    flat = [t.reshape((size,)) for t in sources]
    flat_out = [t.reshape((size,)) for t in outputs]
    views = [t[0 : rows * F].reshape((rows, F)) for t in flat]
    targets = [t[0 : rows * F].reshape((rows, F)) for t in flat_out]
    P = nl.tile_size.pmax
    i_p = nl.arange(P)[:, None]
    i_f = nl.arange(F)[None, :]
    for t in nl.affine_range(math.ceil(rows / P)):
        r = t * P + i_p
        tiles = [nl.load(v[r, i_f], mask=r < rows) for v in views]
        for target, tile in zip(targets, tiles):
            nl.store(target[r, i_f], value=tile, mask=r < rows)
    if tail:
        tiles = [nl.load(t[rows * F : size].reshape((1, tail))) for t in flat]
        for target, tile in zip(flat_out, tiles):
            nl.store(target[rows * F : size].reshape((1, tail)), value=tile)


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
