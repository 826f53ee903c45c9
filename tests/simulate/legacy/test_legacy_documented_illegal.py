"""Every construct the legacy docs (aws-neuron-sdk@8a38e733 ``general/nki/``) call illegal,
as a kernel the simulator must reject, next to its legal twin, which must run. Sources: the
errors manual (``api/nki.errors.rst``, "E Lnn"), the known issues (``nki_known_issues.rst``,
"K Lnn"), the per-instruction rules of the ISA reference (``api/nki/isa/__init__.py``,
"I Lnn") and the language reference (``api/nki/language/__init__.py``, "L Lnn"). Each case
names the line it comes from; the error-manual cases that have their own test elsewhere
(scoping, control flow, annotations, indexing) are listed in ``docs/aws_code_vs_docs.md``
with that test."""

from __future__ import annotations

import numpy as np
import pytest

import simulate as nki
import simulate.compiler as ncc
import simulate.isa as nisa
import simulate.language as nl
from simulate.core.errors import NKIError

X = np.linspace(-1.0, 1.0, 128 * 512, dtype=np.float32).reshape(128, 512)


# --- the errors manual ---------------------------------------------------------------------
def activation_bias_int8(x):  # E L42-48: bias float32 / float16 / bfloat16
    bias = nisa.memset((128, 1), 1, dtype=nl.int8)
    result = nisa.activation(op=nl.exp, data=nl.load(x), bias=bias)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_bias_bf16(x):
    bias = nisa.memset((128, 1), 1.2, dtype=nl.bfloat16)
    result = nisa.activation(op=nl.exp, data=nl.load(x), bias=bias)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_scale_fp16(x):  # E L55-61: scale float32
    scale = nisa.memset((128, 1), 1.2, dtype=nl.float16)
    result = nisa.activation(op=nl.exp, data=nl.load(x), scale=scale)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_scale_row(x):  # E L68-75: scale a scalar or a (P, 1) vector
    scale = nisa.memset((1, 128), 1.2, dtype=nl.float32)
    result = nisa.activation(op=nl.exp, data=nl.load(x[0:1, 0:128]), scale=scale)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_scale_fp32(x):
    scale = nisa.memset((128, 1), 1.2, dtype=nl.float32)
    result = nisa.activation(op=nl.exp, data=nl.load(x), scale=scale)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def hbm_tensor_with_init_value(x):  # E L348-353
    t = nl.full((128, 512), fill_value=1.0, dtype=nl.float32, buffer=nl.shared_hbm)
    return t


def hbm_tensor_stored(x):
    t = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.store(t, value=1.0)
    return t


def partition_count_over_128(x):  # E L553-559
    result = nl.zeros((256, 64), dtype=nl.float32, buffer=nl.sbuf)[0:128, :]
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def partition_mismatch(x):  # E L569-576
    a = nl.load(x)
    result = nisa.tensor_tensor(a, nl.load(x[0:1, :]), op=nl.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def partition_broadcast_explicit(x):
    a = nl.load(x)
    result = nisa.tensor_tensor(a, nl.load(x[0:1, :]).broadcast_to((128, 512)), op=nl.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def transpose_wide(x):  # E L628-629
    result = nl.transpose(nl.load(x))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def transpose_square(x):
    result = nl.copy(nl.transpose(nl.load(x[:, 0:128])))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def assign_wide_into_narrow(x):  # E L647-650
    y = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    y[...] = nl.load(x)
    result = y
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def assign_narrow_into_wide(x):
    wide = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    wide[...] = nl.load(x[:, 0:1])
    result = wide
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def store_out_of_bound(x):  # E L668-671
    out = nl.ndarray((128, 4000), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in nl.affine_range((4000 + 512 - 1) // 512):
        tile = nl.mgrid[0:128, 0:512]
        nl.store(out[tile.p, i * 512 + tile.x], value=0.0)
    return out


def store_masked_in_bound(x):
    out = nl.ndarray((128, 4000), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in nl.affine_range((4000 + 512 - 1) // 512):
        tile = nl.mgrid[0:128, 0:512]
        nl.store(out[tile.p, i * 512 + tile.x], value=0.0, mask=i * 512 + tile.x < 4000)
    return out


def output_dependency_in_affine_loop(x):  # E L786-791
    a = nl.ndarray((4, nl.par_dim(128), 512), dtype=nl.float32, buffer=nl.sbuf)
    for _i in nl.affine_range(4):
        a[0] = nl.load(x)
    result = nl.copy(a[0])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def output_dependency_in_sequential_loop(x):
    a = nl.ndarray((4, nl.par_dim(128), 512), dtype=nl.float32, buffer=nl.sbuf)
    for _i in nl.sequential_range(4):
        a[0] = nl.load(x)
    result = nl.copy(a[0])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def mask_modulo(x):  # E L834-839: not affine
    out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    for i in range(8):
        nl.store(out[:, i], value=nl.load(x[:, i]), mask=(i % 4) < 2)
    return out


def mask_affine(x):
    out = nl.ndarray((128, 8), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.store(out, value=0.0)
    for i in range(8):
        for j in range(2):
            nl.store(out[:, i], value=nl.load(x[:, i]), mask=(2 * i + 3 * j + 1) < 20)
    return out


def load_from_sbuf(x):  # E L873-874
    tmp = nl.zeros((4, 4), dtype=nl.float32, buffer=nl.sbuf)
    result = nl.load(tmp)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def exp_of_hbm(x):  # E L876-877
    result = nl.exp(x)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def exp_of_loaded(x):
    result = nl.exp(nl.load(x))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def mixed_basic_advanced(x):  # E L886-890
    a = nl.load(x[0:4, 0:4])
    i = nl.arange(4)[:, None]
    result = nl.exp(a[i, :])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def advanced_only(x):
    a = nl.load(x[0:4, 0:4])
    i, j = nl.arange(4)[:, None], nl.arange(4)[None, :]
    result = nl.exp(a[i, j])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


# --- the known issues ----------------------------------------------------------------------
def one_dimensional_sbuf_tile(x):  # K L20-26
    buf = nl.zeros((128,), dtype=nl.float32, buffer=nl.sbuf)
    result = nl.copy(buf)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def two_dimensional_sbuf_tile(x):
    buf = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    result = nl.copy(buf)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def mask_with_python_and(x):  # K L38
    i, j = nl.mgrid[0:128, 0:512]
    result = nl.exp(nl.load(x), mask=(i < 64 and j < 256))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def mask_with_ampersand(x):
    i, j = nl.mgrid[0:128, 0:512]
    tile = nl.zeros((128, 512), dtype=nl.float32)
    tile[i, j] = nl.exp(nl.load(x), mask=(i < 64) & (j < 256))
    result = tile
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def bn_stats_mask_on_reduce_axis(x):  # K L41-42
    i, j = nl.mgrid[0:128, 0:512]
    result = nisa.bn_stats(nl.load(x), mask=(j < 256))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def bn_stats_mask_on_partitions(x):
    i, j = nl.mgrid[0:128, 0:512]
    stats = nl.zeros((128, 6), dtype=nl.float32)
    stats[...] = nisa.bn_stats(nl.load(x), mask=(i < 64))
    result = stats
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def operator_partition_broadcast(x):  # K L44-45
    result = nl.load(x) + nl.load(x[0:1, :])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def api_partition_broadcast(x):
    result = nl.add(nl.load(x), nl.load(x[0:1, :]))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


# --- the ISA reference ---------------------------------------------------------------------
def activation_reduce_max_on_v2(x):  # I L213: NeuronCore-v2 reduces with add only
    res = nl.zeros((128, 1), dtype=nl.float32)
    t = nisa.activation_reduce(op=nl.exp, data=nl.load(x), reduce_op=np.max, reduce_res=res)
    result = nl.add(t, res)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_reduce_add_on_v2(x):
    res = nl.zeros((128, 1), dtype=nl.float32)
    t = nisa.activation_reduce(op=nl.exp, data=nl.load(x), reduce_op=np.add, reduce_res=res)
    result = nl.add(t, res)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_reduce_non_trailing_axes(x):  # I L1587, L1619: trailing contiguous free axes
    t = nl.load(x.reshape((128, 8, 8, 8)))
    result = nisa.tensor_reduce(np.add, t, axis=(1, 3))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_reduce_trailing_axes(x):
    t = nl.load(x.reshape((128, 8, 8, 8)))
    result = nisa.tensor_reduce(np.add, t, axis=(1, 2, 3))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_reduce_partition_axis(x):  # I L1589, L1619: free axes only
    result = nisa.tensor_reduce(np.add, nl.load(x), axis=0)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_reduce_free_axis(x):
    result = nisa.tensor_reduce(np.add, nl.load(x), axis=1)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_reduce_bitvec(x):  # I L1719-1721: op0 arithmetic only
    res = nl.zeros((128, 1), dtype=nl.int32)
    t = nl.load(x, dtype=nl.int32)
    nisa.tensor_scalar_reduce(
        data=t, op0=np.bitwise_and, operand0=3, reduce_op=np.add, reduce_res=res
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_reduce_arithmetic(x):
    res = nl.zeros((128, 1), dtype=nl.float32)
    nisa.tensor_scalar_reduce(
        data=nl.load(x), op0=np.multiply, operand0=2.0, reduce_op=np.add, reduce_res=res
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_add(x):  # I L1280, L1310: reduce_op max only
    dst = nl.zeros((128, 512), dtype=nl.float32)
    res = nl.zeros((128, 1), dtype=nl.float32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(
        dst=dst,
        predicate=pred,
        on_true=nl.load(x),
        on_false=0.0,
        reduce_res=res,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_op=np.add,
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_max(x):
    dst = nl.zeros((128, 512), dtype=nl.float32)
    res = nl.zeros((128, 1), dtype=nl.float32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(
        dst=dst,
        predicate=pred,
        on_true=nl.load(x),
        on_false=0.0,
        reduce_res=res,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_op=np.max,
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def matmul_tile_size_32_on_v2(x):  # I L933: not both 32 on NeuronCore-v2
    t = nl.load(x[0:32, 0:32])
    result = nl.copy(nisa.nc_matmul(t, t, tile_position=(0, 0), tile_size=(32, 32)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def matmul_tile_size_64_on_v2(x):
    t = nl.load(x[0:32, 0:32])
    result = nl.copy(nisa.nc_matmul(t, t, tile_position=(0, 0), tile_size=(64, 64)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def matmul_wide_stationary(x):  # I L879-881: stationary free <= 128
    result = nl.copy(nisa.nc_matmul(nl.load(x[:, 0:256]), nl.load(x)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def matmul_stationary_128(x):
    result = nl.copy(nisa.nc_matmul(nl.load(x[:, 0:128]), nl.load(x)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def dma_rmw_with_skip(x):  # I L414-416: dst_rmw_op only with oob_mode=error
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    nisa.dma_copy(dst=out, src=x, dst_rmw_op=np.add, oob_mode=nisa.oob_mode.skip)
    return out


def dma_rmw_with_error_mode(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    nisa.dma_copy(dst=out, src=x, dst_rmw_op=np.add)
    return out


def hwdge_on_v2(x):  # I L428: HWDGE only on NeuronCore-v3+
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x, dge_mode=nisa.dge_mode.hwdge)
    return out


def swdge_on_v2(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x, dge_mode=nisa.dge_mode.swdge)
    return out


def sequence_bounds_float16(x):  # I L1352, L1363: dtype float32 or int32
    ids = nl.load(x[0:1, :], dtype=nl.int32)
    result = nisa.sequence_bounds(segment_ids=ids, dtype=nl.float16)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def sequence_bounds_int32(x):
    ids = nl.load(x[0:1, :], dtype=nl.int32)
    result = nisa.sequence_bounds(segment_ids=ids, dtype=nl.int32)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_copy_gpsimd_from_psum(x):  # I L1392-1393
    acc = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
    result = nisa.tensor_copy(acc, engine=nisa.gpsimd_engine)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_copy_vector_from_psum(x):
    acc = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
    result = nisa.tensor_copy(acc, engine=nisa.vector_engine)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def max8_too_few(x):  # I L664: 8 to 16384 elements per partition
    result = nisa.max8(src=nl.load(x[:, 0:4]))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def max8_eight(x):
    result = nisa.max8(src=nl.load(x[:, 0:8]))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def affine_select_fp16_false_value(x):  # I L286-287: on_false_value float32
    i, j = nl.mgrid[0:128, 0:512]
    result = nisa.affine_select(i > j, nl.load(x), np.float16(-1.0))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def affine_select_fp32_false_value(x):
    i, j = nl.mgrid[0:128, 0:512]
    result = nisa.affine_select(i > j, nl.load(x), np.float32(-1.0))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_on_v2(x):  # I L1091: NeuronCore-v3 and beyond
    bound = nl.zeros((128, 1), dtype=nl.float32)
    result = nisa.range_select(
        on_true_tile=nl.load(x),
        comp_op0=nl.greater_equal,
        comp_op1=nl.less,
        bound0=bound,
        bound1=bound,
    )
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_reduce_add(x):  # I L1159: reduce_op np.max only
    bound = nl.zeros((128, 1), dtype=nl.float32)
    res = nl.zeros((128, 1), dtype=nl.float32)
    result = nisa.range_select(
        on_true_tile=nl.load(x),
        comp_op0=nl.greater_equal,
        comp_op1=nl.less,
        bound0=bound,
        bound1=bound,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_res=res,
        reduce_op=np.add,
    )
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_reduce_max(x):
    bound = nl.zeros((128, 1), dtype=nl.float32)
    res = nl.zeros((128, 1), dtype=nl.float32)
    result = nisa.range_select(
        on_true_tile=nl.load(x),
        comp_op0=nl.greater_equal,
        comp_op1=nl.less,
        bound0=bound,
        bound1=bound,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_res=res,
        reduce_op=np.max,
    )
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_both_in_psum(x):  # I L1864: data0 and data1 not both in PSUM
    a = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
    b = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
    result = nisa.tensor_tensor_scan(a, b, 0.0, np.multiply, np.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_one_in_psum(x):
    a = nl.zeros((128, 512), dtype=nl.float32, buffer=nl.psum)
    result = nisa.tensor_tensor_scan(a, nl.load(x), 0.0, np.multiply, np.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_mixed_operator_kinds(x):  # I L1657: op0 and op1 of one kind
    result = nisa.tensor_scalar(
        nl.load(x, dtype=nl.int32), np.add, 1, op1=np.bitwise_and, operand1=3
    )
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_bitvec_pair(x):
    result = nisa.tensor_scalar(
        nl.load(x, dtype=nl.int32), np.bitwise_or, 1, op1=np.bitwise_and, operand1=3
    )
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_int32_result(x):  # I L1279: reduce_res of float type
    dst = nl.zeros((128, 512), dtype=nl.float32)
    res = nl.zeros((128, 1), dtype=nl.int32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(
        dst=dst,
        predicate=pred,
        on_true=nl.load(x),
        on_false=0.0,
        reduce_res=res,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_op=np.max,
    )
    result = dst
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_wide_result(x):  # I L1278, L1308: reduce_res of shape (P, 1)
    dst = nl.zeros((128, 512), dtype=nl.float32)
    res = nl.zeros((128, 2), dtype=nl.float32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(
        dst=dst,
        predicate=pred,
        on_true=nl.load(x),
        on_false=0.0,
        reduce_res=res,
        reduce_cmd=nisa.reduce_cmd.reset_reduce,
        reduce_op=np.max,
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_fp16_on_false(x):  # I L1275: a scalar on_false is float32
    dst = nl.zeros((128, 512), dtype=nl.float32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(dst=dst, predicate=pred, on_true=nl.load(x), on_false=np.float16(0.0))
    result = dst
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def select_reduce_fp32_on_false(x):
    dst = nl.zeros((128, 512), dtype=nl.float32)
    pred = nisa.memset((128, 512), 1, dtype=nl.uint8)
    nisa.select_reduce(dst=dst, predicate=pred, on_true=nl.load(x), on_false=np.float32(0.0))
    result = dst
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def activation_reduce_wide_result(x):  # I L211-212, L246: reduce_res of shape (P, 1)
    res = nl.zeros((128, 2), dtype=nl.float32)
    t = nisa.activation_reduce(op=nl.exp, data=nl.load(x), reduce_op=np.add, reduce_res=res)
    result = nl.add(t, res[:, 0:1])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_reduce_wide_result(x):  # I L1725-1726, L1751
    res = nl.zeros((128, 2), dtype=nl.float32)
    nisa.tensor_scalar_reduce(
        data=nl.load(x), op0=np.multiply, operand0=2.0, reduce_op=np.add, reduce_res=res
    )
    result = res
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_bitvec_operators(x):  # I L1872-1873, L1898-1899: arithmetic operators only
    a = nl.load(x, dtype=nl.int32)
    result = nisa.tensor_tensor_scan(a, a, 0, np.bitwise_and, np.bitwise_or)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_arithmetic_operators_on_integers(x):
    a = nl.load(x, dtype=nl.int32)
    result = nisa.tensor_tensor_scan(a, a, 0, np.maximum, np.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_fp16_initial(x):  # I L1860-1862: a scalar initial is float32
    a = nl.load(x)
    result = nisa.tensor_tensor_scan(a, a, np.float16(0.0), np.multiply, np.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def scan_fp32_initial(x):
    a = nl.load(x)
    result = nisa.tensor_tensor_scan(a, a, np.float32(0.0), np.multiply, np.add)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_operand1_without_op1(x):  # I L1646: both None when unused
    result = nisa.tensor_scalar(nl.load(x), np.add, 3.0, operand1=2.0)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def tensor_scalar_two_operators(x):
    result = nisa.tensor_scalar(nl.load(x), np.add, 3.0, op1=np.multiply, operand1=2.0)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def affine_select_int32_tile(x):  # I L282-283: float or 8/16-bit integer tiles
    i, j = nl.mgrid[0:128, 0:512]
    result = nisa.affine_select(i > j, nl.load(x, dtype=nl.int32), np.float32(-1.0))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def affine_select_int16_tile(x):
    i, j = nl.mgrid[0:128, 0:512]
    result = nisa.affine_select(i > j, nl.load(x, dtype=nl.int16), np.float32(-1.0))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def dma_transpose_hwdge(x):  # I L483: HWDGE only on NeuronCore-v3+
    result = nisa.dma_transpose(x[0:32, 0:32], dge_mode=nisa.dge_mode.hwdge)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def max8_six_dimensional(x):  # I L663: the source is up to 5-dimensional
    result = nisa.max8(src=nl.load(x.reshape((128, 2, 2, 2, 2, 32))))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def max8_five_dimensional(x):
    result = nisa.max8(src=nl.load(x.reshape((128, 2, 2, 4, 32))))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def find_index8_four_dimensional_vals(x):  # I L735-736: vals up to 3-dimensional
    data = nl.load(x)
    result = nisa.nc_find_index8(data=data, vals=nl.load(x[:, 0:8]).reshape((128, 2, 2, 2)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def find_index8_three_dimensional_vals(x):
    data = nl.load(x)
    result = nisa.nc_find_index8(data=data, vals=nl.load(x[:, 0:8]).reshape((128, 2, 4)))
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def shuffle_from_partition_16(x):  # I L980-989: 32 active partitions start at 0/32/64/96
    dst = nl.zeros((128, 512), dtype=nl.float32)
    src = nl.load(x)
    nisa.nc_stream_shuffle(src=src[16:48, :], dst=dst[0:32, :], shuffle_mask=list(range(32)))
    result = dst
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def shuffle_from_partition_32(x):
    dst = nl.zeros((128, 512), dtype=nl.float32)
    src = nl.load(x)
    nisa.nc_stream_shuffle(src=src[32:64, :], dst=dst[0:32, :], shuffle_mask=list(range(32)))
    result = dst
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def _range_select(x, dtype=nl.float32, range_start=0):
    bound = nl.zeros((128, 1), dtype=nl.float32)
    result = nisa.range_select(
        on_true_tile=nl.load(x, dtype=dtype),
        comp_op0=nl.greater_equal,
        comp_op1=nl.less,
        bound0=bound,
        bound1=bound,
        range_start=range_start,
    )
    return result


def range_select_int32_tile(x):  # I L1128: on_true_tile of a float dtype
    result = _range_select(x, dtype=nl.int32)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_bf16_tile(x):
    result = _range_select(x, dtype=nl.bfloat16)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_float_start(x):  # I L1161-1162: range_start a compile-time integer
    result = _range_select(x, range_start=1.5)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_start_past_2_24(x):  # I L1130-1131: start + index within 2^24
    result = _range_select(x, range_start=1 << 24)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def range_select_integer_start(x):
    result = _range_select(x, range_start=4)
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def loop_bound_from_tensor(x):  # E L285-294: no control flow on tensor values
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    count = nl.load(x[0:1, 0:1], dtype=nl.int32)
    for _i in nl.sequential_range(count):
        nl.store(out, value=nl.load(x))
    return out


def loop_bound_constant(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    for _i in nl.sequential_range(2):
        nl.store(out, value=nl.load(x))
    return out


def column_indexed_with_one_index(x):  # K L28-29: index [N, 1] buffers with both indices
    column = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    result = nl.copy(column[0:128])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def column_indexed_with_both_indices(x):
    column = nl.zeros((128, 1), dtype=nl.float32, buffer=nl.sbuf)
    result = nl.copy(column[0:128, 0:1])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def gather_flattened_five_dimensional(x):  # L L667: data and indices 2- to 4-dimensional
    indices = nl.zeros((128, 2, 2, 2, 2), dtype=nl.uint32)
    result = nl.gather_flattened(nl.load(x.reshape((128, 2, 2, 4, 32))), indices)
    out = nl.ndarray((128, 16), dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result.reshape((128, 16)))
    return out


def gather_flattened_four_dimensional(x):
    indices = nl.zeros((128, 2, 2, 4), dtype=nl.uint32)
    result = nl.gather_flattened(nl.load(x.reshape((128, 2, 8, 32))), indices)
    out = nl.ndarray((128, 16), dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result.reshape((128, 16)))
    return out


def indirect_load_with_mgrid(x):  # K L31-32: nl.arange for indirect access, not nl.mgrid
    rows = nisa.memset((128, 1), 3, dtype=nl.int32)
    i_p, i_f = nl.mgrid[0:128, 0:512]
    result = nl.load(x[rows[i_p, 0], i_f])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def indirect_load_with_arange(x):
    rows = nisa.memset((128, 1), 3, dtype=nl.int32)
    i_p, i_f = nl.arange(128)[:, None], nl.arange(512)[None, :]
    result = nl.load(x[rows[i_p, 0], i_f])
    out = nl.ndarray(result.shape, dtype=result.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


# --- direct allocation (general/nki/nki_direct_allocation_guide.rst@8a38e733, "D") ----------
# the twins place the kernel's tiles with ncc.sbuf/psum.alloc and mod_alloc as AWS's
# attention tutorial does (general/nki/examples/attention/attention_kernels.py L926-L1022)


def _at(start_partition, byte_addr):
    def place(idx, pdim_size, fdim_size):
        return (start_partition, byte_addr)

    return place


def _in_bank(bank, start_partition=0, byte_addr=0):
    def place(idx, pdim_size, fdim_size):
        return (bank, start_partition, byte_addr)

    return place


def _double_via_sbuf(x, out, tile_buffer, rows=128):
    tile = nl.ndarray((nl.par_dim(rows), 512), dtype=nl.float32, buffer=tile_buffer)
    tile[...] = nl.load(x[0:rows, :])
    nl.store(out[0:rows, :], value=nisa.tensor_scalar(data=tile, op0=nl.multiply, operand0=2.0))


def full_tile_from_partition_32(x):  # D L148: 64 < pdim_size <= 128 starts at partition 0
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(32, 0)))
    return out


def full_tile_from_partition_0(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(0, 0)))
    return out


def half_tile_from_partition_32(x):  # D L149: 32 < pdim_size <= 64 starts at 0 or 64
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(32, 0)), rows=64)
    return out


def half_tile_from_partition_64(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(64, 0)), rows=64)
    return out


def tile_past_usable_sbuf(x):  # D L151-157: byte_addr in [0, (192-16) KiB) on NeuronCore-v2
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(0, (192 - 16) * 1024 - 1024)))
    return out


def tile_at_end_of_usable_sbuf(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_at(0, (192 - 16) * 1024 - 2048)))
    return out


def sbuf_mod_alloc_from_partition_32(x):  # sbuf.py L131: base_partition must be 0
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.mod_alloc(base_addr=0, base_partition=32))
    return out


def sbuf_mod_alloc_from_partition_0(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.mod_alloc(base_addr=0, base_partition=0))
    return out


def _transpose_via_psum(x, out, psum_buffer):
    identity = nl.shared_constant(np.identity(128, dtype=np.int8), dtype=nl.float32)
    eye = nl.ndarray((nl.par_dim(128), 128), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 0)))
    eye[...] = nl.load(identity)
    tile = nl.ndarray((nl.par_dim(128), 128), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 512)))
    tile[...] = nl.load(x[:, 0:128])
    product = nl.ndarray((nl.par_dim(128), 128), dtype=nl.float32, buffer=psum_buffer)
    product[...] = nisa.nc_matmul(tile, eye)
    nl.store(out, value=nl.copy(product))


def psum_mod_alloc_at_byte_512(x):  # D L449: psum mod_alloc base_addr must be 0
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.mod_alloc(base_bank=1, base_addr=512))
    return out


def psum_mod_alloc_at_byte_0(x):
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.mod_alloc(base_bank=1, base_addr=0))
    return out


def psum_alloc_at_byte_512(x):  # psum.py L56: start_partition and byte_addr both 0
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.alloc(_in_bank(2, byte_addr=512)))
    return out


def psum_alloc_at_bank_start(x):
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.alloc(_in_bank(2)))
    return out


def psum_alloc_in_bank_8(x):  # psum.py L50: bank_id is one of the 8 PSUM banks
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.alloc(_in_bank(8)))
    return out


def psum_alloc_in_bank_7(x):
    out = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.shared_hbm)
    _transpose_via_psum(x, out, ncc.psum.alloc(_in_bank(7)))
    return out


def _two_tiles(x, out, second_byte_addr, second_after_first):
    """Two SBUF tiles the kernel places itself, the second at ``second_byte_addr``; both
    live at once unless ``second_after_first``."""
    first = nl.ndarray((nl.par_dim(128), 256), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 0)))
    second = nl.ndarray(
        (nl.par_dim(128), 256), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, second_byte_addr))
    )
    first[...] = nl.load(x[:, 0:256])
    if second_after_first:
        nl.store(out[:, 0:256], value=nl.copy(first))
    second[...] = nl.load(x[:, 256:512])
    if not second_after_first:
        nl.store(out[:, 0:256], value=nl.copy(first))
    nl.store(out[:, 256:512], value=nl.copy(second))


def live_tiles_overlapping(x):  # D L132-135, L397-424: the kernel's addresses are honoured
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_tiles(x, out, 512, second_after_first=False)
    return out


def live_tiles_side_by_side(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_tiles(x, out, 1024, second_after_first=False)
    return out


def tiles_sharing_an_address_one_after_the_other(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_tiles(x, out, 0, second_after_first=True)
    return out


def tiles_sharing_an_address_while_both_live(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_tiles(x, out, 0, second_after_first=False)
    return out


def _one_location(idx, pdim_size, fdim_size):
    return 0


def sbuf_alloc_function_returning_one_integer(x):  # D L145: (start_partition, byte_addr)
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _double_via_sbuf(x, out, ncc.sbuf.alloc(_one_location))
    return out


def _two_products(x, out, second_bank):
    """Two PSUM matmul results, both live until both are copied out, in banks 0 and
    ``second_bank``."""
    identity = nl.shared_constant(np.identity(128, dtype=np.int8), dtype=nl.float32)
    eye = nl.ndarray((nl.par_dim(128), 128), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 0)))
    eye[...] = nl.load(identity)
    tile = nl.ndarray((nl.par_dim(128), 256), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 512)))
    tile[...] = nl.load(x[:, 0:256])
    first = nl.ndarray((nl.par_dim(128), 128), dtype=nl.float32, buffer=ncc.psum.alloc(_in_bank(0)))
    second = nl.ndarray(
        (nl.par_dim(128), 128), dtype=nl.float32, buffer=ncc.psum.alloc(_in_bank(second_bank))
    )
    first[...] = nisa.nc_matmul(tile[:, 0:128], eye)
    second[...] = nisa.nc_matmul(tile[:, 128:256], eye)
    nl.store(out[:, 0:128], value=nl.copy(first))
    nl.store(out[:, 128:256], value=nl.copy(second))


def live_psum_tiles_in_one_bank(x):  # D L426-428: a PSUM tensor lifetime conflict is an error
    out = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_products(x, out, 0)
    return out


def live_psum_tiles_in_two_banks(x):
    out = nl.ndarray((128, 256), dtype=nl.float32, buffer=nl.shared_hbm)
    _two_products(x, out, 1)
    return out


def _copy_twice(x, out, second_buffer):
    first = nl.ndarray((nl.par_dim(128), 512), dtype=nl.float32, buffer=ncc.sbuf.alloc(_at(0, 0)))
    second = nl.ndarray((nl.par_dim(128), 512), dtype=nl.float32, buffer=second_buffer)
    first[...] = nl.load(x)
    second[...] = nisa.tensor_copy(first)
    nl.store(out, value=second)


def direct_and_automatic_declarations(x):  # sbuf.py L59-61, L142-145: one kind per kernel
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _copy_twice(x, out, nl.sbuf)
    return out


def direct_declarations_only(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    _copy_twice(x, out, ncc.sbuf.alloc(_at(0, 2048)))
    return out


CASES = [  # (illegal, legal twin, error key, target or (illegal's, twin's target))
    (activation_bias_int8, activation_bias_bf16, "err_activation_bias_invalid_type", None),
    (activation_scale_fp16, activation_scale_fp32, "err_activation_scale_invalid_type", None),
    (activation_scale_row, activation_scale_fp32, "err_activation_scale_scalar_or_vector", None),
    (
        hbm_tensor_with_init_value,
        hbm_tensor_stored,
        "err_hbm_tensor_with_init_value_not_supported",
        None,
    ),
    (
        partition_count_over_128,
        two_dimensional_sbuf_tile,
        "err_num_partition_exceed_arch_limit",
        None,
    ),
    (partition_mismatch, partition_broadcast_explicit, "err_num_partition_mismatch", None),
    (transpose_wide, transpose_square, "err_size_of_dimension_exceed_arch_limit", None),
    (
        assign_wide_into_narrow,
        assign_narrow_into_wide,
        "err_store_dst_shape_smaller_than_other_shape",
        None,
    ),
    (store_out_of_bound, store_masked_in_bound, "err_tensor_access_out_of_bound", None),
    (
        output_dependency_in_affine_loop,
        output_dependency_in_sequential_loop,
        "err_unexpected_output_dependencies",
        None,
    ),
    (mask_modulo, mask_affine, "err_unsupported_expression_in_mask", None),
    (load_from_sbuf, exp_of_loaded, "err_unsupported_memory", None),
    (exp_of_hbm, exp_of_loaded, "err_unsupported_memory", None),
    (
        mixed_basic_advanced,
        advanced_only,
        "err_unsupported_mixing_basic_advanced_tensor_indexing",
        None,
    ),
    (one_dimensional_sbuf_tile, two_dimensional_sbuf_tile, "rank", None),
    (mask_with_python_and, mask_with_ampersand, "mask", None),
    (bn_stats_mask_on_reduce_axis, bn_stats_mask_on_partitions, "bn_stats", None),
    (operator_partition_broadcast, api_partition_broadcast, "partition", None),
    (activation_reduce_max_on_v2, activation_reduce_add_on_v2, "reduce", "trn1"),
    (tensor_reduce_non_trailing_axes, tensor_reduce_trailing_axes, "err_reduce_axis", None),
    (tensor_reduce_partition_axis, tensor_reduce_free_axis, "err_reduce_axis", None),
    (tensor_scalar_reduce_bitvec, tensor_scalar_reduce_arithmetic, "op0", None),
    (select_reduce_add, select_reduce_max, "reduce_op", "trn2"),
    (matmul_tile_size_32_on_v2, matmul_tile_size_64_on_v2, "32", "trn1"),
    (
        matmul_wide_stationary,
        matmul_stationary_128,
        "err_size_of_dimension_exceed_arch_limit",
        None,
    ),
    (dma_rmw_with_skip, dma_rmw_with_error_mode, "oob_mode", None),
    (hwdge_on_v2, swdge_on_v2, "hwdge", "trn1"),
    (sequence_bounds_float16, sequence_bounds_int32, "dtype", "trn2"),
    (tensor_copy_gpsimd_from_psum, tensor_copy_vector_from_psum, "err_unsupported_memory", None),
    (max8_too_few, max8_eight, "8 to 16384", None),
    (affine_select_fp16_false_value, affine_select_fp32_false_value, "err_unsupported_dtype", None),
    (range_select_on_v2, range_select_reduce_max, "NeuronCore-v3", ("trn1", "trn2")),
    (range_select_reduce_add, range_select_reduce_max, "err_unsupported_reduce_op", "trn2"),
    (scan_both_in_psum, scan_one_in_psum, "err_unsupported_memory", None),
    (
        tensor_scalar_mixed_operator_kinds,
        tensor_scalar_bitvec_pair,
        "err_mixed_operator_kinds",
        None,
    ),
    (select_reduce_int32_result, select_reduce_max, "err_unsupported_dtype", "trn2"),
    (select_reduce_wide_result, select_reduce_max, "err_reduce_res_shape", "trn2"),
    (select_reduce_fp16_on_false, select_reduce_fp32_on_false, "err_unsupported_dtype", "trn2"),
    (activation_reduce_wide_result, activation_reduce_add_on_v2, "err_reduce_res_shape", None),
    (
        tensor_scalar_reduce_wide_result,
        tensor_scalar_reduce_arithmetic,
        "err_reduce_res_shape",
        None,
    ),
    (scan_bitvec_operators, scan_arithmetic_operators_on_integers, "err_unsupported_op", None),
    (scan_fp16_initial, scan_fp32_initial, "err_unsupported_dtype", None),
    (tensor_scalar_operand1_without_op1, tensor_scalar_two_operators, "err_unused_operand", None),
    (affine_select_int32_tile, affine_select_int16_tile, "err_unsupported_dtype", None),
    (dma_transpose_hwdge, dma_transpose_hwdge, "err_dge_mode", ("trn1", "trn2")),
    (max8_six_dimensional, max8_five_dimensional, "err_exceed_max_supported_dimension", None),
    (
        find_index8_four_dimensional_vals,
        find_index8_three_dimensional_vals,
        "err_exceed_max_supported_dimension",
        None,
    ),
    (shuffle_from_partition_16, shuffle_from_partition_32, "start_partition", None),
    (range_select_int32_tile, range_select_bf16_tile, "err_unsupported_dtype", "trn2"),
    (range_select_float_start, range_select_integer_start, "compiler time integer", "trn2"),
    (range_select_start_past_2_24, range_select_integer_start, "2\\^24", "trn2"),
    (loop_bound_from_tensor, loop_bound_constant, "err_dynamic_control_flow_not_supported", None),
    (
        column_indexed_with_one_index,
        column_indexed_with_both_indices,
        "err_insufficient_indices",
        None,
    ),
    (
        gather_flattened_five_dimensional,
        gather_flattened_four_dimensional,
        "err_exceed_max_supported_dimension",
        None,
    ),
    (indirect_load_with_mgrid, indirect_load_with_arange, "err_indirect_indexing_with_mgrid", None),
    (full_tile_from_partition_32, full_tile_from_partition_0, "must start at partition 0,", None),
    (half_tile_from_partition_32, half_tile_from_partition_64, "start at partition 0 / 64,", None),
    (tile_past_usable_sbuf, tile_at_end_of_usable_sbuf, "must lie within the 180224 bytes", None),
    (
        sbuf_mod_alloc_from_partition_32,
        sbuf_mod_alloc_from_partition_0,
        "err_unsupported_buffer.*base_partition must be 0",
        None,
    ),
    (
        psum_mod_alloc_at_byte_512,
        psum_mod_alloc_at_byte_0,
        "err_unsupported_buffer.*base_addr must be 0",
        None,
    ),
    (psum_alloc_at_byte_512, psum_alloc_at_bank_start, "byte_addr must both be 0", None),
    (psum_alloc_in_bank_8, psum_alloc_in_bank_7, "one of the 8 PSUM banks", None),
    (live_tiles_overlapping, live_tiles_side_by_side, "err_allocation_lifetime_conflict", None),
    (
        tiles_sharing_an_address_while_both_live,
        tiles_sharing_an_address_one_after_the_other,
        "err_allocation_lifetime_conflict.*overlapping memory",
        None,
    ),
    (
        sbuf_alloc_function_returning_one_integer,
        full_tile_from_partition_0,
        "must return a tuple of 2 integers",
        None,
    ),
    (
        live_psum_tiles_in_one_bank,
        live_psum_tiles_in_two_banks,
        "err_allocation_lifetime_conflict.*overlapping memory",
        None,
    ),
    (
        direct_and_automatic_declarations,
        direct_declarations_only,
        "err_unsupported_buffer.*either all with automatic",
        None,
    ),
]


@pytest.mark.parametrize(
    "illegal, legal, key, target", CASES, ids=[case[0].__name__ for case in CASES]
)
def test_documented_illegal_construct_is_rejected_and_its_twin_runs(illegal, legal, key, target):
    illegal_target, legal_target = target if isinstance(target, tuple) else (target or "trn1",) * 2
    with pytest.raises(NKIError, match=key):
        nki.trace_kernel(illegal, X, target=illegal_target)
    outputs, _ = nki.trace_kernel(legal, X, target=legal_target)
    assert outputs is not None


def every_instance_stores_the_whole_output(x):  # E L780-785: instances write their own part
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    nl.store(out, value=nl.load(x))
    return out


def each_instance_stores_its_half(x):
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.shared_hbm)
    half = nl.program_id(0) * 256
    nl.store(out[:, half : half + 256], value=nl.load(x[:, half : half + 256]))
    return out


def test_spmd_instances_writing_one_region_are_rejected_and_their_own_parts_run():
    with pytest.raises(NKIError, match="err_unexpected_output_dependencies"):
        nki.trace_kernel(every_instance_stores_the_whole_output, X, target="trn1", grid=(2,))
    outputs, _ = nki.trace_kernel(each_instance_stores_its_half, X, target="trn1", grid=(2,))
    np.testing.assert_array_equal(np.asarray(outputs), X)
