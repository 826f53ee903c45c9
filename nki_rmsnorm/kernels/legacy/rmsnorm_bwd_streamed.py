"""RMSNorm backward, streamed regime: rows that neither fit SBUF nor fold evenly.

``rmsnorm_bwd`` (``rmsnorm_bwd.py``) folds a row that does not fit SBUF over f partitions,
which needs a power-of-two f dividing N. For the hidden sizes where no such f exists
(e.g. bf16 N = 30,001 on trn1) it calls :func:`streamed_backward`, which works through
each row tile in column chunks and reads dy and x twice (≈ 1.67× the minimal HBM bytes):
slower, but every N up to ``rmsnorm_bwd.MAX_HIDDEN`` works.

Math (per row of length N; every statistic and intermediate in fp32)::

    x̂  = x · rstd                      g = dy · (w + offset)     (g = dy without a weight)
    c  = mean(g · x̂)                   dx = rstd · (g − x̂ · c) + dh_out
    dweight = Σ_rows dy · x̂            dbias = Σ_rows dy

``x`` is ``h`` when the forward pass added a residual; ``dh_out`` is the gradient flowing into
that ``h`` output. In the "llama" and "none" casting modes the forward multiplied the weight by
``x̂`` rounded to the input dtype, so there ``dweight = Σ_rows dy · round(x̂)`` (an fp32 input
rounds to itself, so nothing extra runs for it); ``dx`` is the same in every mode.

Shapes and dtypes: ``dy``, ``x``, ``dh_out``: (M, N) in float32 / bfloat16 / float16;
``weight``: (N,) float32 or x's dtype, or None; ``rstd``: (M,) float32. ``dx`` comes back in x's
dtype, ``dweight`` in the weight's dtype, ``dbias`` in the weight's dtype (float32 without a
weight). Rows M ≥ 1.

Tiling. Rows go on the partitions, 128 per row tile; a ragged last tile (M % 128 rows) runs
the same code with fewer partitions, so no masks are needed and nothing beyond row M is read.
The hidden axis is worked through in chunks of ``CHUNK_COLS`` columns (fp32 working tiles of
8 KiB per partition), in two passes per row tile:

1. statistic pass, per chunk: load dy and x (DMA); ``dy·x̂`` = (x·rstd)·dy (Vector,
   ``scalar_tensor_tensor``); ``g·x̂`` = (w + offset)·(dy·x̂) (Vector, ``scalar_tensor_tensor``);
   its row sum into one column of a per-chunk partials tile (Scalar, ``activation_reduce``).
   The same pass feeds the parameter gradients: per 128-column block, the column sums of
   ``dy·x̂`` (fp32, dweight) and of ``dy`` (its own dtype, dbias) are added into fp32 PSUM
   accumulators by an ``nc_matmul`` of the block (stationary) with a ones vector (moving) on
   the Tensor engine, which is also the cross-partition reduction; nothing is accumulated in
   SBUF.
   In llama/none mode ``round(x̂)`` comes from one Scalar ``activation`` (x·rstd cast to the
   input dtype) and ``dy·round(x̂)`` from one Vector ``tensor_tensor``.
2. after the pass: ``k = rstd · Σ(g·x̂) / N`` (Vector ``tensor_reduce`` over the chunk partials,
   ``tensor_scalar``).
3. gradient pass, per chunk: ``g`` (Vector ``scalar_tensor_tensor``), ``t = g − x·k`` (Vector
   ``scalar_tensor_tensor``), ``dx = rstd·t`` cast to x's dtype (Scalar ``activation``), or
   ``rstd·t + dh_out`` (Vector ``scalar_tensor_tensor``) with a residual; store (DMA).

Residency, decided from N and the dtypes only (the SBUF budget is
``nl.tile_size.total_available_sbuf_size`` per partition, 176 KiB on trn1/inf2 and the figure
the simulator reports for every target, less ``CHUNK_SCRATCH_BYTES`` for the chunk working
tiles); the figures below are for that budget:

* dy and x rows stay in SBUF between the two passes when ``2·e·N`` bytes fit next to the
  scratch (e = x's item size): each element of dy and x is then read from HBM once. Otherwise
  (bf16 N > 32,768, fp32 N > 16,384 on trn1) the gradient pass loads them again: 4·e·M·N
  instead of 2·e·M·N bytes read for them, ≈ 1.67× the minimal traffic of the kernel.
* the weight is broadcast across the partitions once (``broadcast_to``) and kept when its
  ``e_w·N`` bytes fit as well (bf16 rows and weight: N ≤ 21,845; fp32: N ≤ 10,922);
  otherwise each chunk of it is loaded (e_w·N bytes per row tile and pass) and broadcast
  where it is used.

The parameter-gradient accumulators hold column block j (columns 128·j … 128·j + 127) in PSUM
column j, one 2 KiB bank per 65,536 columns (two each up to ``MAX_HIDDEN``); after
the last row tile they are rounded to the parameter dtype once (Vector copy out of PSUM) and
stored with a strided DMA (element (p, j) to column 128·j + p).

Determinism and batch invariance: every reduction has a fixed order that depends only on N
(chunk partials summed in chunk order; PSUM accumulation in row-tile order), so two runs give
bitwise identical results, and a row's ``dx`` never depends on the other rows or on M.
A NaN in a row makes that row's ``dx`` NaN and, through the column sums, ``dweight``; the other
rows' ``dx`` are untouched.
"""

from __future__ import annotations

from nki_rmsnorm.nki import nisa, nl, usable_sbuf_bytes
from nki_rmsnorm.plan.backward import (
    CHUNK_COLS,
    PSUM_BANK_COLS,
    StreamedInputs,
    StreamedParamGrads,
    make_streamed_plan,
)


def streamed_backward(dy, x, weight, rstd, dh_out, offset, casting_mode, dx, dweight, dbias):
    """Write ``dx`` (and ``dweight`` / ``dbias`` when not None) of the RMSNorm backward into
    the given HBM outputs; see the module docstring for the math, tiling and engines."""
    M, N = x.shape
    P = nl.tile_size.pmax
    plan = make_streamed_plan(
        N,
        x.dtype,
        dy.dtype,
        None if weight is None else weight.dtype,
        casting_mode,
        usable_sbuf_bytes(),
    )
    w_all = _broadcast_weight(weight) if plan.weight_resident else None
    inputs = StreamedInputs(
        dy=dy,
        x=x,
        weight=weight,
        w_all=w_all,
        rstd=rstd.reshape((M, 1)),
        dh_out=dh_out,
        offset=offset,
    )
    grads = StreamedParamGrads(
        dweight=_column_sum_accumulators(N) if dweight is not None else None,
        dbias=_column_sum_accumulators(N) if dbias is not None else None,
        ones_f32=nl.ones((P, 1), dtype=nl.float32),
        ones_dy=nl.ones((P, 1), dtype=dy.dtype),
    )

    for tile in nl.affine_range(M // P):
        _row_tile(plan, inputs, grads, dx, tile * P, P)
    if M % P:
        _row_tile(plan, inputs, grads, dx, M - M % P, M % P)

    if dweight is not None:
        _store_column_sums(dweight, grads.dweight)
    if dbias is not None:
        _store_column_sums(dbias, grads.dbias)


def _row_tile(plan, inputs, grads, dx, r0, rows):
    """Both passes over rows r0 … r0+rows (one per partition), chunk by chunk."""
    N = inputs.x.shape[1]
    rstd_t = nl.load(inputs.rstd[nl.ds(r0, rows), :], dtype=nl.float32)
    # conditional expressions, not ``if`` blocks: a tile made in a block may not be used
    # after it (general/nki/api/nki.errors.rst@8a38e733, lines 417-474)
    dy_row = nl.ndarray((rows, N), dtype=inputs.dy.dtype) if plan.rows_resident else None
    x_row = nl.ndarray((rows, N), dtype=inputs.x.dtype) if plan.rows_resident else None
    partials = nl.ndarray((rows, plan.n_chunks), dtype=nl.float32)
    for c in nl.static_range(plan.n_chunks):
        c0 = c * CHUNK_COLS
        _statistic_chunk(
            plan,
            inputs,
            grads,
            r0,
            rows,
            c0,
            min(CHUNK_COLS, N - c0),
            rstd_t,
            dy_row,
            x_row,
            partials[:, c : c + 1],
        )
    # k = rstd · mean(g·x̂), so that dx = rstd · (g − x·k).
    g_xhat_sum = (
        nisa.tensor_reduce(nl.add, partials, axis=[1], dtype=nl.float32)
        if plan.n_chunks > 1
        else partials
    )
    k = nisa.tensor_scalar(g_xhat_sum, nl.multiply, rstd_t, op1=nl.multiply, operand1=1.0 / N)
    for c in nl.static_range(plan.n_chunks):
        c0 = c * CHUNK_COLS
        _gradient_chunk(inputs, dx, r0, rows, c0, min(CHUNK_COLS, N - c0), rstd_t, k, dy_row, x_row)


def _statistic_chunk(plan, inputs, grads, r0, rows, c0, width, rstd_t, dy_row, x_row, partial_col):
    """Pass 1 on one chunk: Σ g·x̂ into ``partial_col``; the dweight / dbias column sums.
    With resident rows the chunk is loaded into them, for pass 2."""
    dy_c = _load_chunk(inputs.dy, dy_row, r0, rows, c0, width)
    x_c = _load_chunk(inputs.x, x_row, r0, rows, c0, width)
    dy_xhat = nisa.scalar_tensor_tensor(
        data=x_c, op0=nl.multiply, operand0=rstd_t, op1=nl.multiply, operand1=dy_c, dtype=nl.float32
    )
    _row_sum_g_xhat(dy_xhat, _weight_chunk(inputs, rows, c0, width), inputs.offset, partial_col)
    if grads.dweight is not None:
        dw_terms = _dy_times_rounded_xhat(dy_c, x_c, rstd_t) if plan.round_xhat else dy_xhat
        _accumulate_column_sums(grads.dweight, dw_terms, grads.ones_f32, c0)
    if grads.dbias is not None:
        _accumulate_column_sums(grads.dbias, dy_c, grads.ones_dy, c0)


def _gradient_chunk(inputs, dx, r0, rows, c0, width, rstd_t, k, dy_row, x_row):
    """Pass 2 on one chunk: dx from the resident rows (or loaded again), stored."""
    dy_c = _resident_or_loaded(inputs.dy, dy_row, r0, rows, c0, width)
    x_c = _resident_or_loaded(inputs.x, x_row, r0, rows, c0, width)
    dh_c = _resident_or_loaded(inputs.dh_out, None, r0, rows, c0, width)
    dx_c = _dx_chunk(
        dy_c,
        x_c,
        _weight_chunk(inputs, rows, c0, width),
        dh_c,
        inputs.offset,
        rstd_t,
        k,
        inputs.x.dtype,
    )
    nl.store(dx[nl.ds(r0, rows), nl.ds(c0, width)], value=dx_c)


def _resident_or_loaded(src, resident_row, r0, rows, c0, width):
    """Columns c0 … c0+width of a chunk for pass 2: the resident row's slice, else loaded
    from ``src`` (None for an absent ``src``); each tile is returned from the block that
    made it."""
    if src is None:
        return None
    if resident_row is not None:
        return resident_row[:, c0 : c0 + width]
    return _load_chunk(src, None, r0, rows, c0, width)


def _load_chunk(src, resident_row, r0, rows, c0, width):
    """Load columns c0 … c0+width of rows r0 … r0+rows of ``src`` (DMA); when a resident row
    buffer is given, into its slice, which is returned."""
    chunk = nl.load(src[nl.ds(r0, rows), nl.ds(c0, width)])
    if resident_row is None:
        return chunk
    resident_row[:, c0 : c0 + width] = chunk
    return resident_row[:, c0 : c0 + width]


def _broadcast_weight(weight):
    """The weight replicated on every partition, (P, N) in its own dtype, chunk by chunk:
    load (DMA) and partition broadcast (the tile's ``broadcast_to``: ``nl.broadcast_to``
    appears only in SDK 2.22, general/nki/nki_rn.rst@8a38e733)."""
    P = nl.tile_size.pmax
    N = weight.shape[0]
    w_row = weight.reshape((1, N))
    w_all = nl.ndarray((P, N), dtype=weight.dtype)
    for c in nl.static_range((N + CHUNK_COLS - 1) // CHUNK_COLS):
        c0 = c * CHUNK_COLS
        width = min(CHUNK_COLS, N - c0)
        w_all[:, c0 : c0 + width] = nl.load(w_row[0:1, c0 : c0 + width]).broadcast_to((P, width))
    return w_all


def _weight_chunk(inputs, rows, c0, width):
    """Columns c0 … c0+width of the weight on ``rows`` partitions (None without a weight): a
    slice of the resident broadcast, or loaded and broadcast here when it does not stay."""
    if inputs.weight is None:
        return None
    if inputs.w_all is not None:
        return inputs.w_all[0:rows, c0 : c0 + width]
    w_row = inputs.weight.reshape((1, inputs.weight.shape[0]))
    return nl.load(w_row[0:1, c0 : c0 + width]).broadcast_to((rows, width))


def _scaled_grad(dy_c, w_c, offset):
    """``g = (w + offset) · dy`` in fp32 (Vector ``scalar_tensor_tensor``; the offset is added
    in fp32, not in the weight's dtype); ``dy`` itself without a weight."""
    if w_c is None:
        return dy_c
    return nisa.scalar_tensor_tensor(
        data=w_c, op0=nl.add, operand0=offset, op1=nl.multiply, operand1=dy_c, dtype=nl.float32
    )


def _row_sum_g_xhat(dy_xhat, w_c, offset, partial_col):
    """``partial_col = Σ_chunk g·x̂ = Σ (w + offset)·(dy·x̂)``: the product on the Vector
    engine, the row sum by the Scalar engine's reduction (an fp32 identity ``activation``)."""
    g_xhat = _scaled_grad(dy_xhat, w_c, offset)
    nisa.activation_reduce(
        op=nl.copy, data=g_xhat, reduce_op=nl.add, reduce_res=partial_col, dtype=nl.float32
    )


def _dy_times_rounded_xhat(dy_c, x_c, rstd_t):
    """``dy · round(x̂)`` in fp32 for llama/none mode: x·rstd rounded to the input dtype
    (Scalar ``activation``), times dy (Vector ``tensor_tensor``)."""
    xhat_rounded = nisa.activation(op=nl.copy, data=x_c, scale=rstd_t, dtype=x_c.dtype)
    return nisa.tensor_tensor(dy_c, xhat_rounded, op=nl.multiply, dtype=nl.float32)


def _dx_chunk(dy_c, x_c, w_c, dh_c, offset, rstd_t, k, out_dtype):
    """``dx = rstd · (g − x·k) (+ dh_out)`` for one chunk, rounded once to ``out_dtype``:
    ``g − x·k`` on the Vector engine, then the rstd scale on the Scalar engine, or fused with
    the dh_out add on the Vector engine."""
    t = nisa.scalar_tensor_tensor(
        data=x_c,
        op0=nl.multiply,
        operand0=k,
        op1=nl.subtract,
        operand1=_scaled_grad(dy_c, w_c, offset),
        reverse1=True,
        dtype=nl.float32,
    )
    if dh_c is None:
        return nisa.activation(op=nl.copy, data=t, scale=rstd_t, dtype=out_dtype)
    return nisa.scalar_tensor_tensor(
        data=t, op0=nl.multiply, operand0=rstd_t, op1=nl.add, operand1=dh_c, dtype=out_dtype
    )


def _column_sum_accumulators(N):
    """A zeroed fp32 PSUM tile ``(banks, P, 512)`` holding the column sums of an (M, N)
    operand: column j (bank j // 512, column j % 512) accumulates the 128 columns
    128·j … 128·j + 127, one per partition."""
    P = nl.tile_size.pmax
    blocks = (N + P - 1) // P
    return nl.zeros(
        (-(-blocks // PSUM_BANK_COLS), nl.par_dim(P), PSUM_BANK_COLS),
        dtype=nl.float32,
        buffer=nl.psum,
    )


def _accumulate_column_sums(acc, data, ones, c0):
    """``acc += Σ_rows data`` for the chunk ``data`` (rows, width) starting at column c0 (a
    multiple of 128): per 128-column block, ``data_blockᵀ @ ones`` on the Tensor engine sums
    the rows (partitions) into one fp32 PSUM column."""
    P = nl.tile_size.pmax
    rows, width = data.shape
    for b in nl.static_range((width + P - 1) // P):
        lo = b * P
        block = min(P, width - lo)
        bank, col = divmod((c0 + lo) // P, PSUM_BANK_COLS)
        acc[bank, 0:block, col : col + 1] += nisa.nc_matmul(
            data[:, lo : lo + block], ones[0:rows, :], is_moving_onezero=True
        )


def _store_column_sums(dst, acc):
    """Round the PSUM column sums to ``dst``'s dtype once (Vector copy) and store them:
    element (p, j) of bank b is ``dst[(512·b + j)·128 + p]`` (strided DMA). The full
    128-column blocks go in one store per bank, the last partial block (N mod 128 columns)
    in its own, so no mask mixes the two axes (general/nki/api/nki.api.shared.rst@8a38e733,
    lines 201-207)."""
    P = nl.tile_size.pmax
    N = dst.shape[0]
    full_blocks, rest = divmod(N, P)
    i_p = nl.arange(P)[:, None]
    for bank in nl.static_range(acc.shape[0]):
        first = bank * PSUM_BANK_COLS
        full = max(0, min(PSUM_BANK_COLS, full_blocks - first))
        sums = nl.copy(acc[bank], dtype=dst.dtype)
        if full:
            i_j = nl.arange(full)[None, :]
            # the tutorial's form: the 1-D tensor reshaped whole to 2-D, then indexed
            nl.store(dst.reshape((N, 1))[(first + i_j) * P + i_p, 0], value=sums[:, 0:full])
        if rest and first <= full_blocks < first + PSUM_BANK_COLS:
            last = full_blocks - first
            start = full_blocks * P
            # the whole tensor reshaped, then sliced (never a slice reshaped)
            nl.store(
                dst.reshape((N, 1))[start : start + rest, :], value=sums[0:rest, last : last + 1]
            )
