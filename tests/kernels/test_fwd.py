"""The forward kernel (``nki_rmsnorm.kernels.rmsnorm_fwd``) against the float64 reference.

Shapes and options follow a covering design rather than the full cross product: every M
with a couple of N, every N with a couple of M, every option combination at one mid shape,
every dtype × casting mode, and the hidden-tiled path (rows too long for SBUF) with every
option. Inputs are fresh random draws (``rng`` from conftest.py, seeded from the test id);
the simulator fills every output with NaN before the kernel runs, so a point the kernel
never writes shows up.

Tolerances (``ulp`` = unit in the last place of the output dtype at the reference value;
the reference is float64, rounded once to the output dtype):

=========  ==============  ===========================================================
dtype      mode            bound on y
=========  ==============  ===========================================================
float32    every mode      relative error ≤ 1e-5
bf16/fp16  gemma           ≤ 1 ulp: the kernel's fp32 intermediates are ~2⁻²³ off the
                           exact value, far below half an output ulp, so only the final
                           rounding can differ, and by one ulp at most
bf16/fp16  llama           ≤ 2 ulp: x̂ = h·rstd is rounded to the input dtype mid-way;
                           when the exact x̂ sits within ~2⁻²³ of a rounding tie the
                           kernel's fp32 x̂ may round to the neighbour, and one ulp of x̂
                           times the weight is under two ulps of y
bf16/fp16  none            ≤ 2 ulp: as llama; ``weight + offset`` is rounded through fp32
                           (a possible double rounding, one ulp of the weight); products
                           of two bf16/fp16 numbers are exact in fp32, so nothing else
                           can differ
y finer    llama, none     as y's dtype, or ≤ 2 ulp of x's dtype (bf16 x with fp16 or
than x                     fp32 y, fp16 x with fp32 y): x̂ is rounded to x's dtype
                           mid-way, and a near-tie neighbour is an ulp of x's dtype
=========  ==============  ===========================================================

On top of the bound, at most 1 % (+2) of the bf16/fp16 points may differ from the reference
at all: a point can only differ when its exact value lies within fp32 rounding noise
(~2⁻²³ relative) of a rounding boundary of the output (or x̂) dtype, which happens to about
2⁻¹⁵ (bf16) or 2⁻¹² (fp16) of random points, while a wrong rounding order (say llama
computed as gemma) changes about 30 % of them: the ulp bound alone could not tell. Points
that differ with the same pair of values (reference, kernel) count once: they share one
near-tie (N = 1 gives every row about ±w + b).

With a bias, ``y = x̂·w + b`` can cancel, and an error relative to the (small) result says
nothing about the kernel; there the same bound is also accepted in units of the largest
term, ``|x̂·w| + |b|``. ``rstd`` (fp32, from fp32 statistics) is within 1e-5 relative in
every case, and ``h = x + residual`` (one fp32 add, one rounding, as the reference) is
bitwise equal.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import default_target, trace_launch

import simulate
from nki_rmsnorm import dialect as dialect_module
from nki_rmsnorm import kernels
from nki_rmsnorm import reference as ref
from nki_rmsnorm.plan.forward import DECODE_MAX_ROWS, SPREAD_MAX_ROWS, choose_layout, make_plan

# Every test runs with the kernels of both NKI dialects (the ``dialect`` fixture).
pytestmark = pytest.mark.usefixtures("dialect")

FP32, FP16 = np.dtype(np.float32), np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"fp32": FP32, "bf16": BF16, "fp16": FP16}

FP32_RTOL = 1e-5
MAX_ULPS = {"gemma": 1, "llama": 2, "none": 2}
MAX_INEXACT_FRACTION = 0.01
RSTD_RTOL = 1e-5
EPS = 1e-6


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _data(rng, shape, dtype, scale=1.0):
    """Normal data with a per-row scale and a non-zero mean, rounded to ``dtype``."""
    rows = scale * np.exp(rng.uniform(-1.5, 1.5, size=shape[:-1] + (1,)))
    return (rows * (rng.standard_normal(shape) + 0.3)).astype(dtype)


def _inputs(
    rng,
    M,
    N,
    dtype,
    *,
    weight=True,
    bias=False,
    residual=False,
    offset=0.0,
    weight_dtype=FP32,
    residual_dtype=None,
):
    x = _data(rng, (M, N), dtype)
    # Around 1 with offset 0, around 0 with offset 1 (Gemma's 1 + w): both realistic.
    w = None
    if weight:
        w = (rng.normal(1.0 - offset, 0.2, N)).astype(weight_dtype)
    b = rng.normal(0.0, 0.5, N).astype(weight_dtype) if bias else None
    r = None
    if residual:
        r = _data(rng, (M, N), residual_dtype or dtype, scale=2.0)
    return dict(x=x, weight=w, bias=b, residual=r, offset=offset)


def _run(
    x,
    weight=None,
    bias=None,
    residual=None,
    eps=EPS,
    offset=0.0,
    casting_mode="gemma",
    out_dtype=None,
    target=None,
):
    """Simulate the kernel of the current dialect: ``(outputs, trace)``. ``out_dtype`` goes
    to the kernel as the dialect's ``nki.language`` dtype, as the launchers pass it."""
    if out_dtype is not None:
        out_dtype = kernels.nki_dtype(np.dtype(out_dtype).name, dialect_module.current())
    if residual is None:
        kernel = kernels.kernel("rmsnorm_fwd")
        args = (x, weight, bias, eps, offset, casting_mode, out_dtype)
    else:
        kernel = kernels.kernel("rmsnorm_add_fwd")
        args = (x, residual, weight, bias, eps, offset, casting_mode, out_dtype)
    return trace_launch(kernel, *args, target=target)


def _layout(inputs, casting_mode="gemma", target=None, grouped=True):
    """The layout the kernel picks for ``inputs`` on ``target`` (default: the dialect's test
    target, ``helpers.DEFAULT_TARGETS``) (pure Python); ``grouped=False``: the legacy
    kernels' (whole-row statistics, decode batches in "spread")."""
    x, w, b, r = (inputs[k] for k in ("x", "weight", "bias", "residual"))
    spec = simulate.get_target(target or default_target())
    plan = make_plan(
        x.dtype,
        None if w is None else w.dtype,
        None if b is None else b.dtype,
        None if r is None else r.dtype,
        inputs["offset"],
        casting_mode,
        None,
        FP32,
        BF16,
        tensor_engine=spec.nc_version >= 3,
    )
    return choose_layout(plan, *x.shape, spec.sbuf_bytes_per_partition, grouped=grouped)


def _streamed_bytes(inputs):
    """Bytes of the (M, N) inputs: x and the residual."""
    return sum(inputs[k].nbytes for k in ("x", "residual") if inputs[k] is not None)


def _parameter_bytes(inputs):
    """Bytes of the weight and bias."""
    return sum(inputs[k].nbytes for k in ("weight", "bias") if inputs[k] is not None)


def _term_magnitude(x, weight, bias, residual, offset, eps):
    """|x̂·(w + offset)| + |b| in float64: the size of the terms a bias may cancel."""
    h = ref.rms_norm_fwd(x, None, eps, residual=residual)[1] if residual is not None else x
    h = np.asarray(h, np.float64)
    rstd = 1.0 / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps)
    mag = np.abs(h * rstd)
    if weight is not None:
        mag = mag * np.abs(weight.astype(np.float64) + offset)
    return mag + np.abs(bias.astype(np.float64))


def _ulp(v, dtype):
    """Spacing of ``dtype`` at the float64 values ``v``."""
    fi = ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)
    _, e = np.frexp(np.abs(v))
    return np.ldexp(1.0, np.maximum(e - 1, fi.minexp) - fi.nmant)


def _mantissa_bits(dtype):
    return (ml_dtypes.finfo(dtype) if dtype == BF16 else np.finfo(dtype)).nmant


def assert_y_close(y, y64, dtype, casting_mode, magnitude=None, what="y", x_dtype=None):
    """y against the float64 reference with the bound of the module docstring's table."""
    assert y.dtype == dtype, f"{what} has dtype {y.dtype}, expected {dtype}"
    got = y.astype(np.float64)
    assert not np.isnan(got).any(), f"{what} has NaN: points the kernel never wrote?"
    want = np.asarray(y64, np.float64)
    err = np.abs(got - want)
    if dtype == FP32:
        scale = np.abs(want) if magnitude is None else np.maximum(np.abs(want), magnitude)
        bad = err > FP32_RTOL * scale
        bound = f"{FP32_RTOL} relative"
    else:
        max_ulps = MAX_ULPS[casting_mode]
        ulps = ref.ulp_distance(got, want, dtype)
        # Points that share one (reference, kernel) pair of values count once: they are the
        # same near-tie (N = 1 maps every row to about ±w + b).
        differ = ulps != 0
        inexact = len(set(zip(want[differ].tolist(), got[differ].tolist())))
        assert inexact <= MAX_INEXACT_FRACTION * ulps.size + 2, (
            f"{what}: {inexact} distinct values of {ulps.size} points differ from the "
            f"correctly rounded reference ({casting_mode} mode)"
        )
        bad = ulps > max_ulps
        if magnitude is not None:
            bad &= err > max_ulps * _ulp(magnitude, dtype)
        bound = f"{max_ulps} ulp"
    if (
        x_dtype is not None
        and casting_mode != "gemma"
        and _mantissa_bits(x_dtype) < _mantissa_bits(dtype)
    ):
        # x̂ is rounded to x's (coarser) dtype mid-way: a near-tie neighbour is an ulp of
        # x's dtype, many ulps of y's
        within = ref.ulp_distance(got, want, x_dtype) <= MAX_ULPS[casting_mode]
        if magnitude is not None:  # a bias may cancel: ulps of the largest term
            within |= err <= MAX_ULPS[casting_mode] * _ulp(magnitude, x_dtype)
        flips = bad & within
        assert flips.sum() <= MAX_INEXACT_FRACTION * flips.size + 2, (
            f"{what}: {int(flips.sum())} of {flips.size} x̂ roundings differ"
        )
        bad &= ~flips
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.size} points beyond {bound}, first at "
            f"{i}: kernel {got[i]!r}, reference {want[i]!r}"
        )


def check_forward(inputs, casting_mode="gemma", out_dtype=None, eps=EPS, target=None):
    """Run the kernel and compare every output with the reference; returns the trace."""
    x, w, b, r, offset = (inputs[k] for k in ("x", "weight", "bias", "residual", "offset"))
    outputs, trace = _run(x, w, b, r, eps, offset, casting_mode, out_dtype, target)
    want = ref.rms_norm_fwd(
        x, w, eps, offset=offset, bias=b, residual=r, casting_mode=casting_mode, out_dtype=out_dtype
    )
    assert len(outputs) == len(want)
    y_dtype = x.dtype if out_dtype is None else np.dtype(out_dtype)
    magnitude = None if b is None else _term_magnitude(x, w, b, r, offset, eps)
    assert_y_close(outputs[0], want[0], y_dtype, casting_mode, magnitude, x_dtype=x.dtype)
    if r is not None:
        assert outputs[1].dtype == r.dtype
        np.testing.assert_array_equal(outputs[1], want[1], err_msg="h = x + residual")
    rstd = outputs[-1]
    assert rstd.dtype == FP32 and rstd.shape == (x.shape[0],)
    np.testing.assert_allclose(rstd, want[-1], rtol=RSTD_RTOL, err_msg="rstd")
    return trace


# ---------------------------------------------------------------------------------------------
# Shapes: every M with a couple of N, every N with a couple of M
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M", [1, 2, 127, 128, 129, 1000, 4097])
@pytest.mark.parametrize("N", [64, 1000])
def test_rows(rng, M, N):
    check_forward(_inputs(rng, M, N, BF16, weight_dtype=BF16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [2, 129])
@pytest.mark.parametrize("N", [1, 3, 64, 100, 1024, 4096, 5120, 8192, 16384, 20000])
def test_hidden_sizes(rng, M, N, dtype):
    check_forward(_inputs(rng, M, N, DTYPES[dtype]))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_hidden_65536(rng, dtype):
    """The largest required hidden size (hidden-tiled on every target), two ragged tiles."""
    check_forward(
        _inputs(rng, 3, 65536, DTYPES[dtype], bias=True, residual=True, offset=1.0),
        casting_mode="gemma",
    )


# ---------------------------------------------------------------------------------------------
# Options and casting modes
# ---------------------------------------------------------------------------------------------

OPTION_SETS = {
    "plain": dict(weight=False),
    "w": dict(),
    "w_offset": dict(offset=1.0),
    "bias": dict(weight=False, bias=True),
    "w_bias": dict(bias=True),
    "w_offset_bias": dict(offset=1.0, bias=True),
    "res": dict(weight=False, residual=True),
    "w_res": dict(residual=True),
    "w_offset_res": dict(offset=1.0, residual=True),
    "bias_res": dict(weight=False, bias=True, residual=True),
    "w_bias_res": dict(bias=True, residual=True),
    "w_offset_bias_res": dict(offset=1.0, bias=True, residual=True),
}


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("options", OPTION_SETS, ids=list(OPTION_SETS))
def test_options(rng, options, casting_mode):
    check_forward(_inputs(rng, 129, 200, BF16, **OPTION_SETS[options]), casting_mode)


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["fp32", "input"])
def test_dtypes_and_modes(rng, dtype, casting_mode, weight_dtype):
    x_dtype = DTYPES[dtype]
    wd = FP32 if weight_dtype == "fp32" else x_dtype
    check_forward(
        _inputs(rng, 130, 256, x_dtype, bias=True, residual=True, offset=0.5, weight_dtype=wd),
        casting_mode,
    )


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_long_rows_with_every_option(rng, dtype, casting_mode):
    """N = 30001 with every option is too long for two row tiles (trn1, trn2) and odd, so not
    spread over partitions either: one row tile stays on chip, worked through in column
    chunks (a ragged last chunk and a ragged last row tile); x and the residual are still
    read once."""
    inputs = _inputs(rng, 130, 30001, DTYPES[dtype], bias=True, residual=True, offset=1.0)
    assert _layout(inputs, casting_mode).regime == "long"
    trace = check_forward(inputs, casting_mode)
    read, _ = trace.hbm_bytes()
    tiles = 2  # the weight and bias are read once per row tile
    assert read == _streamed_bytes(inputs) + tiles * _parameter_bytes(inputs)


@pytest.mark.parametrize("options", OPTION_SETS, ids=list(OPTION_SETS))
def test_long_rows_options(rng, options):
    inputs = _inputs(rng, 3, 30001, BF16, **OPTION_SETS[options])
    assert _layout(inputs, "llama").regime == "long"
    trace = check_forward(inputs, "llama")
    assert trace.hbm_bytes()[0] == _streamed_bytes(inputs) + _parameter_bytes(inputs)


@pytest.mark.parametrize("residual", [False, True])
def test_two_pass_reads_x_twice(rng, residual):
    """fp32 rows of 60001 with a bias and an offset fit neither two row tiles nor one (and,
    odd, are not spread over partitions): the statistics pass and the output pass each read
    x (and the residual)."""
    inputs = _inputs(rng, 3, 60001, FP32, bias=True, residual=residual, offset=1.0)
    assert _layout(inputs).regime == "two_pass"
    trace = check_forward(inputs)
    assert trace.hbm_bytes()[0] == 2 * _streamed_bytes(inputs) + _parameter_bytes(inputs)


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
def test_hidden_tiled_path_out_dtype(rng, casting_mode):
    check_forward(_inputs(rng, 5, 30000, BF16, bias=True, offset=1.0), casting_mode, out_dtype=FP32)


@pytest.mark.parametrize(
    "in_out", [("bf16", "fp32"), ("fp32", "bf16"), ("fp16", "bf16"), ("bf16", "fp16")]
)
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
def test_out_dtype(rng, in_out, casting_mode):
    x_dtype, y_dtype = (DTYPES[d] for d in in_out)
    check_forward(
        _inputs(rng, 129, 96, x_dtype, bias=True, offset=1.0), casting_mode, out_dtype=y_dtype
    )


def test_residual_in_float32_beside_bf16_activations(rng):
    inputs = _inputs(rng, 129, 512, BF16, weight_dtype=BF16, residual=True, residual_dtype=FP32)
    check_forward(inputs, "llama")


# ---------------------------------------------------------------------------------------------
# Memory traffic and SBUF
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [False, True])
def test_rows_that_fit_are_read_and_written_once(rng, residual):
    M, N = 300, 1024
    inputs = _inputs(rng, M, N, BF16, weight_dtype=BF16, bias=True, residual=residual)
    trace = check_forward(inputs)
    e = 2
    streams = 2 if residual else 1  # x (and residual) in; y (and h) out
    read, written = trace.hbm_bytes()
    assert read == streams * e * M * N + 2 * e * N  # + weight and bias, once
    assert written == streams * e * M * N + 4 * M  # + rstd


@pytest.mark.parametrize("target", ["trn1", "trn2", "trn3"])
def test_plan_matches_the_simulated_sbuf(rng, target):
    """At the widest N the plan keeps resident, the kernel runs within the target's SBUF
    and reads x once; one step wider it switches regime. More rows than a decode batch
    (nki06's "split" reads the weight once per row of a one-tile batch, "spread" x twice)."""
    spec = simulate.get_target(target)
    budget = spec.sbuf_bytes_per_partition
    plan = make_plan(
        BF16, FP32, None, None, 1.0, "gemma", None, FP32, BF16, tensor_engine=spec.nc_version >= 3
    )
    n = max(n for n in range(8192, 32768, 16) if plan.fits_rows(n, 1, budget))
    x = _data(rng, (max(DECODE_MAX_ROWS, SPREAD_MAX_ROWS) + 1, n), BF16)
    w = rng.normal(0.0, 0.2, n).astype(np.float32)
    (y, rstd), trace = _run(x, w, offset=1.0, target=target)
    assert trace.sbuf_peak_bytes_per_partition <= budget
    assert trace.hbm_bytes()[0] == x.nbytes + w.nbytes
    assert_y_close(y, ref.rms_norm(x, w, EPS, offset=1.0), BF16, "gemma")
    assert not plan.fits_rows(n + 16, 1, budget)


# ---------------------------------------------------------------------------------------------
# Regimes and engine plans per target (the tests above run on the dialect's default target:
# trn1 for legacy, trn2 for nki06, ``helpers.DEFAULT_TARGETS``)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("options", OPTION_SETS, ids=list(OPTION_SETS))
def test_options_on_trn2(rng, options, casting_mode):
    """gemma with a weight: rstd ⊗ w on the Tensor engine; the rest on the Vector engine."""
    check_forward(_inputs(rng, 129, 700, BF16, **OPTION_SETS[options]), casting_mode, target="trn2")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", ["fp32", "input"])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_tensor_engine_weights_on_trn2(rng, dtype, weight_dtype, offset):
    """Three bf16 pieces of rstd against a bf16 weight, or fp32 rstd against an fp32
    weight (+ offset): still one gemma rounding."""
    x_dtype = DTYPES[dtype]
    inputs = _inputs(
        rng,
        130,
        600,
        x_dtype,
        offset=offset,
        weight_dtype=FP32 if weight_dtype == "fp32" else x_dtype,
    )
    plan = make_plan(
        x_dtype,
        inputs["weight"].dtype,
        None,
        None,
        offset,
        "gemma",
        None,
        FP32,
        BF16,
        tensor_engine=True,
    )
    assert plan.product_engine == "tensor"
    assert plan.rstd_pieces == (
        3 if x_dtype == BF16 and weight_dtype == "input" and not offset else 1
    )
    check_forward(inputs, target="trn2")


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("residual", [False, True])
def test_several_rows_per_partition(rng, target, residual):
    """Short rows: four consecutive rows per partition in each tile (one DMA moves them; a
    tile of 1 KiB rows under ``CHUNK_BYTES`` grows while 8 tiles remain), a ragged last
    tile, x read once."""
    inputs = _inputs(rng, 4100, 512, BF16, weight_dtype=BF16, bias=True, residual=residual)
    assert _layout(inputs, target=target).rows_per_partition == 4
    trace = check_forward(inputs, target=target)
    assert trace.hbm_bytes()[0] == _streamed_bytes(inputs) + _parameter_bytes(inputs)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("options", ["w", "w_offset_bias_res", "bias", "plain", "w_bias"])
def test_packed_rows(rng, options, casting_mode, target):
    """QK-norm heads (N = 128): 8 rows per partition in a tile (the largest divisor of M
    that leaves 4 tiles), a ragged last tile of 96 partitions, x and the residual read
    once, the weight and bias once each (replicated on chip, 4 rows of 128 in a PSUM bank)."""
    inputs = _inputs(rng, 7936, 128, BF16, weight_dtype=BF16, **OPTION_SETS[options])
    layout = _layout(inputs, casting_mode, target=target)
    assert (layout.regime, layout.rows_per_partition) == ("packed", 8)
    trace = check_forward(inputs, casting_mode, target=target)
    assert trace.hbm_bytes()[0] == _streamed_bytes(inputs) + _parameter_bytes(inputs)


@pytest.mark.parametrize(
    ("M", "N", "dtype", "rows"),
    [
        (1, 64, "bf16", 1),
        (97, 256, "bf16", 1),
        (6000, 64, "fp32", 10),
        (2600, 1, "fp16", 5),
        (4096, 128, "fp32", 8),
    ],
)
def test_packed_shapes(rng, M, N, dtype, rows):
    """Short rows of every dtype: one row (k = 1), M prime (k = 1, a part tile), k the
    largest divisor of M within the tile's byte target, N = 1 (QK-norm's degenerate head),
    fp32 rows of 512 B (the regime's widest)."""
    inputs = _inputs(rng, M, N, DTYPES[dtype], bias=True, residual=True, offset=1.0)
    layout = _layout(inputs, target="trn2")
    assert (layout.regime, layout.rows_per_partition) == ("packed", rows)
    check_forward(inputs, target="trn2")


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
@pytest.mark.parametrize("options", ["w", "w_offset_bias_res", "bias", "plain"])
@pytest.mark.parametrize("M", [3, 50])
def test_split_rows_on_trn2(rng, M, options, casting_mode):
    """N = 40000 is too long for whole rows: each row is spread over 16 partitions (2500
    columns each), statistics combined across them; x and the residual read once, the
    weight and bias at most three times (the Tensor engine's moving rows). 50 rows are 7
    tiles, a ragged last one, and more tiles than the pipeline has buffer sets."""
    inputs = _inputs(rng, M, 40000, BF16, weight_dtype=BF16, **OPTION_SETS[options])
    layout = _layout(inputs, casting_mode, target="trn2")
    assert (layout.regime, layout.segments) == ("split", 16)
    trace = check_forward(inputs, casting_mode, target="trn2")
    read = trace.hbm_bytes()[0]
    assert _streamed_bytes(inputs) < read <= _streamed_bytes(inputs) + 3 * _parameter_bytes(
        inputs
    ) or (read == _streamed_bytes(inputs) and not _parameter_bytes(inputs))


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_split_rows_dtypes_on_trn2(rng, dtype):
    inputs = _inputs(rng, 20, 40000, DTYPES[dtype], bias=True, residual=True, offset=0.5)
    assert _layout(inputs, target="trn2").regime == "split"
    check_forward(inputs, target="trn2")


@pytest.mark.parametrize("N", [700, 40000])
def test_trn3(rng, N):
    check_forward(_inputs(rng, 129, N, BF16, weight_dtype=BF16, residual=True), target="trn3")


# ---------------------------------------------------------------------------------------------
# Batch invariance and numerical edge cases
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("N", [1000, 20000])
def test_batch_invariance(rng, N, target):
    """A row's y and rstd are bitwise the same whatever batch (and tile position) it is in."""
    inputs = _inputs(rng, 200, N, BF16, bias=True, residual=True, offset=1.0)
    full = _run(**inputs, target=target)[0]
    for rows in (slice(3, 4), slice(70, 199), slice(128, 200)):
        part = _run(
            **{k: (v[rows] if k in ("x", "residual") else v) for k, v in inputs.items()},
            target=target,
        )[0]
        for got, want in zip(part, full):
            np.testing.assert_array_equal(got, want[rows])


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_eps_goes_inside_the_root(rng, eps):
    """eps = 0.5 is comparable to mean(x²): it changes every rstd noticeably."""
    check_forward(_inputs(rng, 129, 64, FP32, bias=True), eps=eps)


@pytest.mark.parametrize("casting_mode", ref.CASTING_MODES)
def test_zero_row_is_finite(rng, casting_mode):
    inputs = _inputs(rng, 130, 64, BF16, bias=True)
    inputs["x"][5] = 0
    inputs["x"][129] = 0
    (y, rstd), _ = _run(**inputs, casting_mode=casting_mode)
    np.testing.assert_allclose(rstd[[5, 129]], 1 / np.sqrt(EPS), rtol=RSTD_RTOL)
    assert np.isfinite(y.astype(np.float32)).all()
    check_forward(inputs, casting_mode)


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eps_zero_on_a_zero_row_gives_inf_rstd_and_nan_y(rng, dtype, target):
    """Documented behaviour: rstd = 1/sqrt(0) = inf and y = 0·inf = NaN for that row only."""
    inputs = _inputs(rng, 20, 64, DTYPES[dtype], weight_dtype=DTYPES[dtype])
    inputs["x"][7] = 0
    (y, rstd), _ = _run(**inputs, eps=0.0, target=target)
    assert np.isposinf(rstd[7]) and np.isnan(y[7].astype(np.float32)).all()
    others = np.arange(20) != 7
    want_y, want_rstd = ref.rms_norm_fwd(inputs["x"], inputs["weight"], 0.0)
    assert np.isfinite(y[others].astype(np.float32)).all()
    assert_y_close(y[others], want_y[others], DTYPES[dtype], "gemma")
    np.testing.assert_allclose(rstd[others], want_rstd[others], rtol=RSTD_RTOL)


def test_fp16_values_whose_squares_overflow_fp16(rng):
    """|x| near 60000: x² overflows fp16 (max 65504) but the statistics are fp32."""
    inputs = _inputs(rng, 129, 256, FP16, weight_dtype=FP16)
    big = np.sign(rng.standard_normal((129, 256))) * rng.uniform(3e4, 6e4, (129, 256))
    inputs["x"] = big.astype(np.float16)
    check_forward(inputs)
    # The discarded squares go to a bf16 scratch tile, not the fp16 y tile.
    assert make_plan(FP16, FP16, None, None, 0.0, "gemma", None, FP32, BF16).squares_in == "scratch"


@pytest.mark.parametrize("target", ["trn1", "trn2"])
def test_packed_rows_keep_a_nan_and_an_inf_in_their_own_row(rng, target):
    """Packed rows share a partition (4096 × 128: 8 rows per partition): a NaN in one and
    an inf in another leave their partition neighbours bitwise as they were; the NaN row's
    rstd is NaN, the inf row's 0 (y NaN where x is inf, else 0, as the reference)."""
    inputs = _inputs(rng, 4096, 128, BF16, weight_dtype=BF16, residual=True)
    assert _layout(inputs, target=target).rows_per_partition == 8
    clean = _run(**inputs, target=target)[0]
    inputs["x"][13, 100] = np.nan
    inputs["x"][14, 3] = np.inf
    dirty = _run(**inputs, target=target)[0]
    rows = (np.arange(4096) != 13) & (np.arange(4096) != 14)
    for got, want in zip(dirty, clean):
        np.testing.assert_array_equal(got[rows], want[rows])
    y, h, rstd = dirty
    assert np.isnan(rstd[13]) and np.isnan(y[13].astype(np.float32)).all()
    x14, r14 = inputs["x"][14:15], inputs["residual"][14:15]
    want = ref.rms_norm_fwd(x14, inputs["weight"], EPS, residual=r14)
    assert rstd[14] == want[-1][0] == 0.0
    nan_y = np.isnan(y[14].astype(np.float32))
    np.testing.assert_array_equal(nan_y, np.isnan(want[0][0].astype(np.float32)))
    assert nan_y.any() and not nan_y.all()


@pytest.mark.parametrize("target", ["trn1", "trn2"])
@pytest.mark.parametrize("N", [300, 20000, 40000])
def test_nan_in_one_row_leaves_the_others_untouched(rng, N, target):
    """Also across the partitions a split row shares with its neighbours (trn2, N = 40000)
    and the Tensor-engine transposes of rstd (trn2)."""
    inputs = _inputs(rng, 140, N, BF16, weight_dtype=BF16, residual=True)
    clean = _run(**inputs, target=target)[0]
    inputs["x"][131, N // 2] = np.nan
    dirty = _run(**inputs, target=target)[0]
    rows = np.arange(140) != 131
    for got, want in zip(dirty, clean):
        np.testing.assert_array_equal(got[rows], want[rows])
    y, h, rstd = dirty
    assert np.isnan(rstd[131]) and np.isnan(y[131].astype(np.float32)).all()
