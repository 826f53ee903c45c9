"""What each engine computes, once for both front-ends: pure functions on NumPy arrays.

The front-ends (``simulate.legacy`` for ``neuronxcc.nki``, ``simulate.nki06`` for ``nki``
0.6) check their own signatures and operands, read the operand values (float32 for
arithmetic, the stored integers for bit operations), call these functions, and round the
result into the destination dtype when they write it (``core.dtypes.cast``). Nothing here
reads or writes a tile or records an instruction.

``spec`` arguments are :class:`simulate.core.functions.OpSpec`; a ``valid`` argument is a
boolean array of the points that take part (None: all of them), as masks give it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from . import functions as fn

# The value a masked-off (or padding) element contributes to a reduction.
REDUCE_IDENTITY = {
    "add": 0,
    "subtract": 0,
    "multiply": 1,
    "maximum": -np.inf,
    "minimum": np.inf,
    "bitwise_and": -1,
    "bitwise_or": 0,
    "bitwise_xor": 0,
    "logical_and": 1,
    "logical_or": 0,
    "logical_xor": 0,
}
# The reductions the Scalar engine's accumulator and the Vector engine's reduce registers
# fold with (the front-ends decide which of them each instruction and target allows).
REGISTER_REDUCE_OPS = ("add", "multiply", "maximum", "minimum")


def per_partition(value, ndim):
    """A per-partition ``(P, 1)`` operand reshaped to broadcast against a rank-``ndim``
    tile (scalars pass through)."""
    if isinstance(value, np.ndarray) and value.ndim:
        return value.reshape((value.shape[0],) + (1,) * (ndim - 1))
    return value


# --- ALU (Vector / GpSimd / Scalar arithmetic) ------------------------------------------------
def alu(spec, a, b, reverse=False, out=None):
    """One ALU stage ``spec(a, b)`` (``spec(b, a)`` with ``reverse``); a unary op ignores
    ``b``. ``out`` is a float32 work array the result may be computed into."""
    if spec.unary and spec.name not in fn.BINARY:
        return spec.apply(a, out=out)
    return spec.apply(b, a, out=out) if reverse else spec.apply(a, b, out=out)


def alu_stages(values, stages, work=None):
    """``tensor_scalar``'s pipeline: ``values`` through each ``(spec, operand, reverse)``
    stage in turn, per-partition operands broadcast along the free axes. ``work`` (a float32
    copy of ``values`` the caller owns) is reused while the result still lives in it."""
    for spec, operand, reverse in stages:
        out = work if work is not None and values is work else None
        values = alu(spec, values, per_partition(operand, np.ndim(values)), reverse, out=out)
    return values


def elementwise(spec, a, b, *, exact_int=False, work=None):
    """``tensor_tensor``: ``spec(a, b)`` of two operands of the same shape. ``exact_int``
    computes integer add/subtract/multiply exactly (GpSimd), bit operations take the stored
    integers, everything else runs in float32 (into ``work``, a float32 copy of ``a``, when
    the caller gives one)."""
    if exact_int:
        return spec.apply(np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64))
    if spec.bitvec:
        return spec.apply(a, b)
    if work is not None and spec.name not in fn.COMPARISONS:
        return spec.apply(work, b, out=work)  # the ufunc converts ``b`` to float32 on the fly
    return spec.apply(_f32(a), _f32(b))


def scalar_tensor_tensor(
    spec0, scalar, spec1, other, data, reverse0=False, reverse1=False, work=None
):
    """``spec1(spec0(data, scalar), other)``: ``scalar`` a number or ``(P, 1)`` array,
    ``other`` shaped like ``data``. With ``work`` (``data`` itself, a float32 copy the
    caller owns) the stages compute into it and ``other`` converts to float32 on the fly."""
    values = alu(spec0, data, per_partition(scalar, np.ndim(data)), reverse0, out=work)
    in_place = work is not None and values is work
    return alu(
        spec1, values, other if in_place else _f32(other), reverse1, out=work if in_place else None
    )


def _f32(values):
    values = np.asarray(values)
    return values if values.dtype == np.float32 else values.astype(np.float32)


def reciprocal(x):
    """``1 / x`` in float32 (the Vector engine's divide; 1/0 is inf)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.float32(1.0) / x


def select(keep, on_true, on_false):
    """``on_true`` where ``keep`` holds, else ``on_false`` (``affine_select``, ``nl.where``,
    ``tensor_copy_predicated``)."""
    return np.where(keep, on_true, on_false)


# --- Scalar engine -----------------------------------------------------------------------------
def activation(spec, x, scale=None, bias=None, *, approximate=None):
    """``spec(x * scale + bias)`` in float32, computed in ``x`` (a float32 work array the
    caller owns). ``scale``: a number or a ``(P, 1)`` array (None or 1.0: no multiply);
    ``bias``: None or a ``(P, 1)`` array / number. ``approximate(name, inputs, values)``
    replaces the exact values by the engine's piece-wise approximation."""
    with np.errstate(all="ignore"):  # inf·0 and overflow are values here, not errors
        if isinstance(scale, np.ndarray) or (scale is not None and scale != 1.0):
            np.multiply(x, per_partition(scale, x.ndim), out=x)
        if bias is not None:
            np.add(x, per_partition(bias, x.ndim), out=x)
    inputs = x.copy() if approximate is not None else None
    values = spec.apply(x, out=x)
    if approximate is not None:
        values = approximate(spec.name, inputs, values)
    return values


# --- reductions ----------------------------------------------------------------------------------
def _with_identity(spec, values, valid):
    if valid is None:
        return values
    identity = np.array(REDUCE_IDENTITY[spec.name]).astype(values.dtype)
    return np.where(valid, values, identity)


def reduce_last(spec, values, negate=False, valid=None):
    """``spec`` folded over the last axis of ``values`` (float32, or integers for bit ops);
    ``subtract`` gives ``x0 - x1 - x2 ...``; ``negate`` multiplies the result by -1."""
    values = _with_identity(spec, values, valid)
    with np.errstate(all="ignore"):
        if spec.name == "subtract":
            result = 2 * values[..., 0] - values.sum(axis=-1, dtype=np.float32)
        else:
            result = np.asarray(spec.reduce(values, -1))
        if negate:
            result = -result
    return result


# The value a masked-off element contributes to each ``nl`` reduction.
_NAMED_REDUCE_IDENTITY = {
    "sum": 0.0,
    "mean": 0.0,
    "var": 0.0,
    "prod": 1.0,
    "max": -np.inf,
    "min": np.inf,
    "all": 1.0,
}


def reduce_axes(name, values, axes, valid=None):
    """The ``nl`` reduction ``name`` (sum, prod, max, min, all, mean, var: population
    variance) of float32 ``values`` over ``axes``, dims kept. ``mean``/``var`` divide by
    the number of valid elements. Returns (result, mask of the output points with at least
    one valid input, or None when every point is valid)."""
    out_mask = None
    if valid is not None:
        values = np.where(valid, values, np.float32(_NAMED_REDUCE_IDENTITY[name]))
        count = valid.sum(axis=axes, keepdims=True, dtype=np.float32)
        out_mask = count > 0
    else:
        count = np.float32(np.prod([values.shape[a] for a in axes]))
    with np.errstate(all="ignore"):
        if name == "sum":
            result = np.sum(values, axis=axes, keepdims=True, dtype=np.float32)
        elif name == "prod":
            result = np.prod(values, axis=axes, keepdims=True, dtype=np.float32)
        elif name == "max":
            result = np.max(values, axis=axes, keepdims=True)
        elif name == "min":
            result = np.min(values, axis=axes, keepdims=True)
        elif name == "all":
            result = np.all(values != 0, axis=axes, keepdims=True).astype(np.float32)
        else:
            result = np.sum(values, axis=axes, keepdims=True, dtype=np.float32) / count
            if name == "var":
                deviation = values - result
                if valid is not None:
                    deviation = np.where(valid, deviation, np.float32(0))
                result = (
                    np.sum(deviation * deviation, axis=axes, keepdims=True, dtype=np.float32)
                    / count
                )
    return result, out_mask


def fold_partitions(spec, values, valid=None):
    """The per-partition ``(P, 1)`` float32 reduction of ``values`` over all its free axes
    (what an instruction folds into the engine's reduce registers)."""
    values = _with_identity(spec, values, valid)
    flat = values.reshape(values.shape[0], -1).astype(np.float32, copy=False)
    return np.asarray(reduce_last(spec, flat), np.float32).reshape(-1, 1)


def update_registers(regs, spec, folded, command, *, initial=None, rows=None):
    """Update per-partition reduce registers ``regs`` (``(P, 1)`` float32, in place) with an
    instruction's ``folded`` reduction: ``reset`` sets the identity, ``reset_reduce`` the
    reduction, ``reduce`` folds the reduction into the registers, ``load_reduce`` folds it
    into ``initial``, ``idle`` leaves them. ``rows``: the partitions that ran (None: all)."""
    identity = np.float32(REDUCE_IDENTITY[spec.name])
    if command == "idle":
        return regs
    if command == "reset":
        new = np.full_like(folded, identity)
    elif command == "reduce":
        new = spec.apply(regs, folded).astype(np.float32)
    elif command == "load_reduce":
        new = spec.apply(np.float32(initial), folded).astype(np.float32)
    elif command == "reset_reduce":
        new = folded
    else:
        raise ValueError(
            f"reduce command {command!r} is not one of idle, reset, reduce, "
            "load_reduce, reset_reduce"
        )
    if rows is None:
        regs[...] = new
    else:
        regs[rows] = new[rows]
    return regs


def batch_norm_stats(x, valid=None):
    """``bn_stats``: per row of ``x`` (P, F) float32, ``[count, mean, var*count]`` of the
    even- and then of the odd-indexed elements (``valid``: the elements that count; an empty
    group gives count 0, mean 0, M2 0)."""
    if valid is None:
        valid = np.ones(x.shape, bool)
    out = np.zeros((x.shape[0], 6), np.float32)
    for parity in (0, 1):
        group, counted = x[:, parity::2], valid[:, parity::2]
        count = counted.sum(axis=1, dtype=np.float32)
        mean = np.where(counted, group, np.float32(0)).sum(axis=1, dtype=np.float32) / np.maximum(
            count, np.float32(1)
        )
        deviation = np.where(counted, group - mean[:, None], np.float32(0))
        out[:, 3 * parity], out[:, 3 * parity + 1] = count, mean
        out[:, 3 * parity + 2] = (deviation * deviation).sum(axis=1, dtype=np.float32)
    return out


def batch_norm_aggregate(stats):
    """``bn_aggr``: rows of ``(count, mean, var*count)`` triples -> ``[mean, population
    variance]`` per row (float32)."""
    count, mean, m2 = stats[:, 0::3], stats[:, 1::3], stats[:, 2::3]
    total = np.maximum(count.sum(axis=1), np.float32(1))
    grand = (count * mean).sum(axis=1) / total
    var = (m2 + count * (mean - grand[:, None]) ** 2).sum(axis=1) / total
    return np.stack([grand, var], axis=1).astype(np.float32)


def scan(spec0, spec1, data0, data1, initial, reverse0=False, reverse1=False):
    """``tensor_tensor_scan`` per row of ``data0``/``data1`` (P, F) float32:
    ``r[i] = spec1(spec0(data0[i], r[i-1]), data1[i])`` with ``r[-1] = initial`` (a number
    or a ``(P, 1)`` array)."""
    out = np.empty_like(data0)
    previous = np.broadcast_to(
        np.asarray(initial, np.float32).reshape(-1), (data0.shape[0],)
    ).copy()
    for i in range(data0.shape[1]):  # a true recurrence: the engine walks the free axis too
        stage = alu(spec0, data0[:, i], previous, reverse0)
        previous = np.asarray(alu(spec1, stage, data1[:, i], reverse1), np.float32)
        out[:, i] = previous
    return out


# --- Tensor engine --------------------------------------------------------------------------------
def matmul(stationary, moving):
    """``stationary.T @ moving`` of (K, M) and (K, N) float32 arrays: exact products summed
    in float64, rounded once to float32."""
    return (stationary.astype(np.float64).T @ moving.astype(np.float64)).astype(np.float32)


def is_identity(moving) -> bool:
    """True when ``moving`` is a square identity (``is_transpose=True`` matmuls)."""
    return moving.shape[0] == moving.shape[1] and np.array_equal(
        moving, np.eye(moving.shape[0], dtype=moving.dtype)
    )


def transpose(values):
    """Partition and flattened free axes swapped (exact: a data movement)."""
    return values.reshape(values.shape[0], -1).T


# --- GpSimd ---------------------------------------------------------------------------------
def iota_pattern(partitions, pattern, offset=0, channel_multiplier=0):
    """``offset + p * channel_multiplier + sum(step_k * i_k)`` per partition ``p`` over the
    ``(step, count)`` pairs of ``pattern`` (outermost first), as int32 (P, prod(counts))."""
    grids = np.meshgrid(*[np.arange(n, dtype=np.int64) * s for s, n in pattern], indexing="ij")
    free = sum(g for g in grids).reshape(-1)
    rows = np.arange(partitions, dtype=np.int64)[:, None] * int(channel_multiplier)
    return (int(offset) + rows + free[None, :]).astype(np.int32)


# --- DMA ----------------------------------------------------------------------------------------
# The permutation a DMA transpose applies, by rank (the only one each rank supports)
DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_accumulate(spec, *values):
    """A DMA's read-modify-write: ``spec`` (add) folded over float32 copies of ``values``
    (the destination's current values first, when the DMA accumulates into it)."""
    total = np.asarray(values[0]).astype(np.float32)
    for more in values[1:]:
        total = spec.apply(total, np.asarray(more).astype(np.float32))
    return total


# --- cross-partition movement and the top-8 instructions (NKI 0.6 ISA) --------------------------
QUADRANT = 32
SHUFFLE_KEEP = 255  # shuffle_mask[i] == 255: output partition i keeps its data


def stream_shuffle(src, dst, mask):
    """``nc_stream_shuffle``: output partition ``i`` of each 32-partition quadrant takes input
    partition ``mask[i % 32]`` of the same quadrant; ``255`` keeps the destination's data
    (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L2052-2062; release-notes/components/
    nki.rst L281). ``src`` and ``dst`` are ``(P, F)``; partitions count from each operand's
    first. Returns the new ``dst``; a source partition outside ``src`` raises IndexError."""
    out = np.array(dst, copy=True)
    for p in range(out.shape[0]):
        source = mask[p % QUADRANT]
        if source == SHUFFLE_KEEP:
            continue
        q = (p // QUADRANT) * QUADRANT + source
        if q >= src.shape[0]:
            raise IndexError(q)
        out[p] = src[q]
    return out


def max8(values):
    """``max8``: the 8 largest of each partition's elements (read as fp32), descending
    (nki/api/nki/isa/__init__.py L2415-2420). ``values`` is ``(P, F)``, F >= 8."""
    return -np.sort(-values.astype(np.float32), axis=1, kind="stable")[:, :8]


def find_index8(data, vals, missing):
    """``nc_find_index8``: per partition, the index of the first occurrence of each of the 8
    ``vals`` in ``data``; a value found again takes its next occurrence (duplicates advance,
    in ascending order); not found: ``missing`` (all ones)
    (nki/api/nki/isa/__init__.py L3169-3187; release-notes/components/nki.rst L75-77)."""
    out = np.full(vals.shape, missing, np.int64)
    for p in range(data.shape[0]):
        taken: set[int] = set()
        for i, value in enumerate(vals[p]):
            for j in np.flatnonzero(data[p] == value):
                if int(j) not in taken:
                    taken.add(int(j))
                    out[p, i] = j
                    break
    return out


def match_replace8(data, vals, imm, missing):
    """``nc_match_replace8``: per partition, the first not yet replaced occurrence of each of
    the 8 ``vals`` becomes ``imm``, ``vals`` taken in reverse order (i = 7 .. 0), so duplicate
    values pair with matches in descending slot order; returns (new data, indices with
    ``missing`` where no match) (nki/api/nki/isa/__init__.py L3193-3214; release-notes/
    components/nki.rst L73-74)."""
    out = np.array(data, copy=True)
    index = np.full(vals.shape, missing, np.int64)
    for p in range(data.shape[0]):
        for i in range(vals.shape[1] - 1, -1, -1):
            hits = np.flatnonzero(out[p] == vals[p, i])
            if hits.size:
                out[p, hits[0]] = imm
                index[p, i] = hits[0]
    return out, index


def nonzero_with_count(src, index_offset, padding_val):
    """``nonzero_with_count`` for one partition: the indices (+ ``index_offset``) of the
    nonzero elements, ``padding_val`` up to the input length, then the count
    (nki/api/nki/isa/__init__.py L3221-3300)."""
    found = np.flatnonzero(src != 0) + index_offset
    out = np.full(src.shape[0] + 1, padding_val, np.int64)
    out[: found.size] = found
    out[-1] = found.size
    return out


def affine_select(predicate_spec, affine, on_true, on_false):
    """``affine_select``: ``on_true`` where ``cmp_op(affine, 0)`` holds, else ``on_false``
    (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py L1774-1794); ``affine`` is the
    :func:`iota_pattern` of the instruction's pattern."""
    keep = predicate_spec.apply(affine.astype(np.float64), np.float64(0)).astype(bool)
    return np.where(keep, on_true, np.float32(on_false))


def range_select(values, bound0, bound1, spec0, spec1, range_start, on_false):
    """``range_select``'s NumPy equivalent (nki/api/nki/isa/__init__.py range_select): the
    free index + ``range_start`` (fp32) kept where ``spec0(index, bound0)`` and
    ``spec1(index, bound1)`` both hold, else ``on_false``. ``values`` is ``(P, F)`` float32,
    the bounds ``(P, 1)``."""
    index = np.float32(range_start) + np.arange(values.shape[1], dtype=np.float32)[None, :]
    keep = spec0.apply(index, bound0).astype(bool) & spec1.apply(index, bound1).astype(bool)
    return np.where(keep, values, np.float32(on_false))


def partition_reduce(name, values):
    """``tensor_partition_reduce``: ``name`` (add, average, maximum, bitwise_or, bitwise_and)
    over the partitions of ``(P, F)`` values, as ``(1, F)``."""
    if name == "average":
        return values.astype(np.float64).mean(axis=0, keepdims=True)
    reducer = {
        "add": np.add,
        "maximum": np.maximum,
        "bitwise_or": np.bitwise_or,
        "bitwise_and": np.bitwise_and,
    }[name]
    return reducer.reduce(values, axis=0, keepdims=True)


def sequence_bounds(ids):
    """``sequence_bounds`` of one row of segment ids: per element the start of its run of
    equal ids and one past its end; padding (id 0) gets start ``n`` and end ``-1``
    (aws-neuron-sdk@8a38e733 general/nki/api/nki/isa/__init__.py sequence_bounds and the
    NumPy equivalent of its example, general/nki/test/test_nki_isa_sequence_bounds.py
    L56-L82). Returns ``(2, n)``."""
    ids = np.asarray(ids)
    n = ids.shape[0]
    start = np.empty(n, np.int64)
    end = np.empty(n, np.int64)
    for i in range(n):
        if ids[i] == 0:
            start[i] = n
        elif i and ids[i] == ids[i - 1]:
            start[i] = start[i - 1]
        else:
            start[i] = i
    for i in range(n - 1, -1, -1):
        if ids[i] == 0:
            end[i] = -1
        elif i < n - 1 and ids[i] == ids[i + 1]:
            end[i] = end[i + 1]
        else:
            end[i] = i + 1
    return np.stack([start, end])


def dropout(values, drop_probability, uniform):
    """``dropout``: an element becomes 0 where its uniform [0, 1) draw is below its
    partition's drop probability (so 1.0 drops all, 0.0 keeps all); the kept elements are
    not rescaled, the docs speak of replacing elements with zeros only (aws-neuron-sdk@8a38e733
    general/nki/api/nki/isa/__init__.py L499-506)."""
    return np.where(uniform < drop_probability, np.zeros_like(values), values)


#: partitions each of GpSimd's eight cores reads and writes for ``local_gather``
GPSIMD_CORE_PARTITIONS = 16


def local_gather(src, index, num_elem_per_idx, num_valid):
    """``local_gather`` over (partitions, elements) ``src`` and ``index``: each block of 16
    partitions (one GpSimd core) flattens its own ``index`` rows partition first, keeps the
    first ``num_valid`` indices, and every partition of the block reads ``num_elem_per_idx``
    contiguous elements of its own row from each index (an element offset) — the reference's
    NumPy semantics, ``index[start_par:end_par].flatten(order='F')[0:num_valid_indices]``
    then ``np.take(src_buffer[start_par:end_par], indices_1d, axis=1)`` with the index given
    in elements (``index_hw = index * num_elem_per_idx``)
    (aws-neuron-sdk@8a38e733 general/nki/test/test_nki_isa_local_gather.py L60-88)."""
    block = GPSIMD_CORE_PARTITIONS
    out = np.empty((src.shape[0], num_valid * num_elem_per_idx), src.dtype)
    for start in range(0, src.shape[0], block):
        flat = index[start : start + block].flatten(order="F")[:num_valid].astype(np.int64)
        columns = (flat[:, None] + np.arange(num_elem_per_idx)).reshape(-1)
        out[start : start + block] = src[start : start + block][:, columns]
    return out


# --- OCP Microscaling (MX) ------------------------------------------------------------------
# A scaling group is 32 values: 8 partitions x 4 consecutive free elements, the four values of
# one packed x4 element on 8 partitions (aws-neuron-sdk@81ce03ae nki/api/nki/isa/__init__.py
# L2776-2777, L724-725). Its scale is an e8m0 exponent: byte b means 2**(b - 127), 0xFF NaN
# (nki/api/nki/language/__init__.py L56-57).
MX_GROUP_PARTITIONS = 8
MX_GROUP_ELEMENTS = 4
MX_SCALE_BIAS = 127
MX_SCALE_NAN = 0xFF
MX_SCALE_ROWS_PER_QUADRANT = QUADRANT // MX_GROUP_PARTITIONS  # 4 scale partitions a quadrant
# E_max, the largest unbiased exponent of each element type (isa L2798-2799; float4_e2m1fn's
# from aws-neuron-sdk@81ce03ae nki/deep-dives/src/mxfp-matmul/mx_cpu_utils.py L35-46)
MX_EMAX = {"float8_e4m3fn": 8, "float8_e5m2": 15, "float4_e2m1fn": 2}


def mx_scale_rows(partitions: int) -> np.ndarray:
    """The scale partition of each 8-partition group of ``partitions`` data partitions: the
    4 groups of a 32-partition quadrant write partitions 0-3 of that quadrant (relative to
    the scale tile), "the full scale tensor is split across four SBUF quadrants, where each
    quadrant holds 4 partitions worth of scales" (nki/guides/architecture/trainium3_arch.rst
    @81ce03ae L105; AWS's golden, aws-neuron/nki-library@d2ad3a5
    src/nkilib_src/nkilib/core/utils/mx_torch_common.py L266-278)."""
    groups = np.arange(partitions // MX_GROUP_PARTITIONS)
    quadrant, row = np.divmod(groups, MX_SCALE_ROWS_PER_QUADRANT)
    return quadrant * QUADRANT + row


def quantize_mx(values, element: str):
    """``nisa.quantize_mx`` of a (P, F) array (P a multiple of 8, F of 4) into ``element``
    (``float8_e4m3fn`` / ``float8_e5m2``): (the quantized values as ``element``, (P, F),
    and the scale bytes, (P/8, F/4) uint8, one per group, dense).

    The scale is X = 2**(floor(log2(a_max)) - (E_max - 1)), two times the OCP sample
    algorithm's (isa L2790-2809, L2752-2756; release-notes/components/nki.rst L166-168),
    2**-127 for an all-zero group (isa L2811-2812); a group whose exponent would fall below
    -127 (a_max under 2**-120 for e4m3fn) also takes 2**-127, the least e8m0 value
    (inferred: the docs give no other encoding). Each value is V / X rounded to nearest even
    into ``element``; |V / X| < 2**E_max never reaches the type's largest finite value, so
    nothing saturates.
    A group holding an Inf or a NaN gets the NaN scale 0xFF and NaN values, as the OCP
    conversion the ISA reference links to gives (floor(log2(Inf)) exceeds every scale; the
    ISA reference says nothing of non-finite inputs: inferred)."""
    v = np.asarray(values, np.float64)
    p, f = v.shape
    groups = np.abs(v).reshape(
        p // MX_GROUP_PARTITIONS, MX_GROUP_PARTITIONS, f // MX_GROUP_ELEMENTS, MX_GROUP_ELEMENTS
    )
    with np.errstate(invalid="ignore"):
        amax = groups.max(axis=(1, 3))  # NaN when the group holds a NaN
    special = ~np.isfinite(amax)
    finite = np.where(special | (amax == 0), 1.0, amax)
    exponent = np.frexp(finite)[1] - 1 - (MX_EMAX[element] - 1)  # floor(log2 a_max) - ...
    exponent = np.where(amax == 0, -MX_SCALE_BIAS, np.maximum(exponent, -MX_SCALE_BIAS))
    scale_bytes = np.where(special, MX_SCALE_NAN, exponent + MX_SCALE_BIAS).astype(np.uint8)
    factor = np.ldexp(1.0, -exponent)
    factor = np.repeat(np.repeat(factor, MX_GROUP_PARTITIONS, 0), MX_GROUP_ELEMENTS, 1)
    scaled = v * factor  # exact: a power of two, inside float64's range
    nan_rows = np.repeat(np.repeat(special, MX_GROUP_PARTITIONS, 0), MX_GROUP_ELEMENTS, 1)
    scaled = np.where(nan_rows, np.nan, scaled)
    return scaled.astype(np.dtype(getattr(ml_dtypes, element))), scale_bytes


def mx_dequantize(elements, scale_bytes) -> np.ndarray:
    """float64 values of MX data: ``elements`` (P, F) in an MX element type times the scale
    of their group from ``scale_bytes`` (P/8, F/4; 0xFF is NaN)."""
    scale = np.where(
        scale_bytes == MX_SCALE_NAN,
        np.nan,
        np.ldexp(1.0, scale_bytes.astype(np.int64) - MX_SCALE_BIAS),
    )
    scale = np.repeat(np.repeat(scale, MX_GROUP_PARTITIONS, 0), MX_GROUP_ELEMENTS, 1)
    return np.asarray(elements).astype(np.float64) * scale


def matmul_mx(stationary, stationary_scale, moving, moving_scale):
    """``nisa.nc_matmul_mx``: (K, 4M) and (K, 4N) unpacked MX values with their dense scale
    bytes (K/8, M) and (K/8, N) -> (M, N) float32: the contraction runs over the K partitions
    and the four values of each x4 element (isa L767-769; trainium3_arch.rst L79-87), each
    value dequantized by its group's scale; exact products summed in float64, rounded once."""
    a = mx_dequantize(stationary, stationary_scale)
    b = mx_dequantize(moving, moving_scale)
    k = a.shape[0]
    a = a.reshape(k, -1, MX_GROUP_ELEMENTS)
    b = b.reshape(k, -1, MX_GROUP_ELEMENTS)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.einsum("kiq,kjq->ij", a, b).astype(np.float32)
