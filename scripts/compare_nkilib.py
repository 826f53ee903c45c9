"""Side by side on the simulator's cost model: AWS nki-library's ``rmsnorm_quant_kernel``,
run unmodified from a local checkout, against this package's ``rmsnorm_quant`` on the same
inputs, target and LNC, with the plain-copy yardstick of the same bytes.

Usage::

    python scripts/compare_nkilib.py --nkilib ~/src/nki-library \\
        [--target trn2] [--lnc 2] [--shapes 1x2048x8192,1x2048x16384,1x32768x8192]
        [--tkg [--tkg-shapes 1x1x4096,1x8x8192,1x64x8192]]
        [--mx [--mx-shapes 1x8x8192,1x64x8192,1x256x8192]]

``--mx`` (trn3, LNC=2) runs nki-library's MXFP8 decode subkernel ``rmsnorm_mx_quantize_tkg``
(from a small ``nki.jit`` wrapper that gives it SBUF outputs and stores them) beside this
package's ``rmsnorm_mx_quant`` on ``--mx-shapes`` (its token counts must be multiples of 4).

``--tkg`` also runs nki-library's decode subkernel ``rmsnorm_tkg`` (called unmodified from a
small ``nki.jit`` wrapper here that gives it its HBM input and a ``[128, B·S, H / 128]``
output) beside this package's ``rmsnorm_fwd`` (plain row layout) and
``rmsnorm_fwd_transposed`` (``output_layout="transposed"``: rmsnorm_tkg's layout, written by
the kernel) on the decode shapes. At LNC=1 the two transposed outputs are the same layout and
are compared element by element; under LNC=2 rmsnorm_tkg lays each core's half of H out after
the other's (its docstring's pseudocode), which is rearranged to the single-core layout first.

``--nkilib`` is the root of a checkout of https://github.com/aws-neuron/nki-library (its
``src/nkilib_src`` is put on ``sys.path``; nothing of it is copied here). ``import nki`` is
pointed at the simulator's 0.6 front-end (:func:`simulate.nki06.install`), so both kernels run
in the same simulator and are timed by the same cost model. Both write nki-library's packed
layout (fp8 ``float8_e4m3`` y_q with each row's float32 dequant scale in its last 4 bytes,
per-row absmax scales, RMSNorm with a weight, eps 1e-6); the script checks both against the
float64 reference (the dequantized values' largest error relative to each row's amax) and
prints modeled µs, the speed-up and each kernel's ratio to the copy.
"""

from __future__ import annotations

import argparse
import os
import sys

import ml_dtypes
import numpy as np

DEFAULT_SHAPES = "1x2048x8192,1x2048x16384,1x32768x8192"
DEFAULT_TKG_SHAPES = "1x1x4096,1x8x8192,1x29x8192,1x64x8192"
DEFAULT_MX_SHAPES = "1x8x8192,1x64x8192,1x256x8192"
EPS = 1e-6
QUANT_DTYPE = "float8_e4m3"  # what rmsnorm_quant_kernel writes (rmsnorm_quant_constants.py)


def _parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: {item!r} is not BxSxH with positive integers")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def _load_nkilib(root: str):
    """AWS's kernel and its argument class from the checkout at ``root``."""
    source = os.path.join(os.path.abspath(root), "src", "nkilib_src")
    if not os.path.isdir(os.path.join(source, "nkilib")):
        raise ValueError(
            f"--nkilib {root}: no src/nkilib_src/nkilib there (the root of an "
            "aws-neuron/nki-library checkout is expected)"
        )
    import simulate.nki06

    simulate.nki06.install()
    sys.path.insert(0, source)
    from nkilib.core.rmsnorm.rmsnorm_quant import RmsNormQuantKernelArgs, rmsnorm_quant_kernel

    return rmsnorm_quant_kernel, RmsNormQuantKernelArgs


def _launch(kernel, lnc, target, *args):
    """``kernel[lnc](*args)`` on ``target``: (outputs, modeled µs)."""
    import simulate
    import simulate.nki06

    previous = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = target
    try:
        outputs = kernel[lnc](*args) if lnc > 1 else kernel(*args)
    finally:
        if previous is None:
            del os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"]
        else:
            os.environ["NEURON_PLATFORM_TARGET_OVERRIDE"] = previous
    profile = simulate.Profile.from_trace(simulate.nki06.last_trace())
    return outputs, profile.latency_us


def _packed_error(packed, x, weight, rows_per_chunk=1024) -> float:
    """Largest |y_q · scale − y| / amax(row) of a packed [..., N + 4] output (in row chunks:
    the float64 reference of a 32K × 8K input would need tens of GB at once)."""
    from nki_rmsnorm import reference

    n = x.shape[-1]
    packed = np.asarray(packed).reshape(-1, n + 4)
    x = x.reshape(-1, n)
    worst = 0.0
    for r0 in range(0, x.shape[0], rows_per_chunk):
        part = packed[r0 : r0 + rows_per_chunk]
        scales = np.ascontiguousarray(part[:, n:]).view(np.uint8).view("<f4")[:, :1]
        dequantized = part[:, :n].astype(np.float64) * scales
        want = reference.rms_norm_quant(
            x[r0 : r0 + rows_per_chunk], weight, EPS, quant_dtype=QUANT_DTYPE
        )
        error = np.max(np.abs(dequantized - want["y"]) / want["amax"][:, None])
        worst = max(worst, float(error))
    return worst


def _tkg_wrapper():
    """An ``nki.jit`` kernel around nki-library's ``rmsnorm_tkg`` subkernel (imported after
    :func:`_load_nkilib`): HBM x (B, S, H) and gamma (1, H) in, its transposed layout out."""
    import nki
    import nki.language as nl
    from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg

    @nki.jit
    def rmsnorm_tkg_kernel(x, gamma):
        b, s, h = x.shape
        out = nl.ndarray(
            (nl.tile_size.pmax, b * s, h // nl.tile_size.pmax), dtype=x.dtype, buffer=nl.shared_hbm
        )
        rmsnorm_tkg(x, gamma, out, eps=EPS)
        return out

    return rmsnorm_tkg_kernel


def compare_tkg(nkilib: str, target: str, lnc: int, shapes) -> list[dict]:
    """``rmsnorm_tkg`` against ``rmsnorm_fwd`` on decode shapes (None where AWS's kernel does
    not run on this simulator, with the reason)."""
    _load_nkilib(nkilib)
    from nki_rmsnorm import kernels, reference

    aws = _tkg_wrapper()
    ours = kernels.kernel("rmsnorm_fwd", "nki06")
    ours_t = kernels.kernel("rmsnorm_fwd_transposed", "nki06")
    rng = np.random.default_rng(0)
    rows = []
    for b, s, h in shapes:
        x = rng.standard_normal((b, s, h)).astype(ml_dtypes.bfloat16)
        weight = (1.0 + 0.1 * rng.standard_normal(h)).astype(ml_dtypes.bfloat16)
        want = reference.rms_norm(x.reshape(-1, h), weight, EPS)
        row = {"shape": f"{b}x{s}x{h}", "aws_us": None, "note": ""}
        args = (x.reshape(-1, h), weight, None, EPS, 0.0, "gemma", None)
        (y_t, _), row["ours_t_us"] = _launch(ours_t, lnc, target, *args)
        y_t = np.asarray(y_t, np.float64)
        try:
            out, row["aws_us"] = _launch(aws, lnc, target, x, weight.reshape(1, h))
            got = _single_core_layout(np.asarray(out, np.float64), lnc)
            row["note"] = (
                f"max |err| {np.max(np.abs(got - _transposed(want))):.3g}, "
                f"vs our transposed y {np.max(np.abs(got - y_t)):.3g}"
            )
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            row["note"] = f"does not run here: {type(error).__name__}: {error}"[:110]
        (y, _), row["ours_us"] = _launch(ours, lnc, target, *args)
        row["ours_error"] = float(np.max(np.abs(np.asarray(y, np.float64) - want)))
        row["ours_t_error"] = float(np.max(np.abs(y_t - _transposed(want))))
        rows.append(row)
    return rows


def _transposed(y):
    """(M, N) y in the single-core transposed layout: [p, m, k] = y[m, p · N / 128 + k]."""
    y = np.asarray(y, np.float64)
    return y.reshape(y.shape[0], 128, -1).transpose(1, 0, 2)


def _single_core_layout(out, lnc):
    """rmsnorm_tkg's [128, rows, H / 128] output in the single-core layout: under LNC=2
    each core's half of H is laid out after the other's (its docstring's pseudocode)."""
    halves = np.split(out, lnc, axis=2)  # [128, rows, H / 128 / lnc] each
    rows = [half.transpose(1, 0, 2).reshape(out.shape[1], -1) for half in halves]
    return _transposed(np.concatenate(rows, axis=1))


def compare(nkilib: str, target: str, lnc: int, shapes) -> list[dict]:
    aws_kernel, aws_args = _load_nkilib(nkilib)
    from nki_rmsnorm import bench, kernels

    ours = kernels.kernel("rmsnorm_quant", "nki06")
    rng = np.random.default_rng(0)
    rows = []
    for b, s, h in shapes:
        x = rng.standard_normal((b, s, h)).astype(ml_dtypes.bfloat16)
        weight = (1.0 + 0.1 * rng.standard_normal(h)).astype(ml_dtypes.bfloat16)
        aws_out, aws_us = _launch(aws_kernel, lnc, target, x, weight, aws_args(eps=EPS))
        x2d = x.reshape(b * s, h)
        our_out, our_us = _launch(
            ours, lnc, target, *bench.quant_launch_args(x2d, weight, QUANT_DTYPE)
        )
        our_packed = our_out[0] if isinstance(our_out, tuple) else our_out
        copy_us = bench._copy_us("quant", target, x2d, None, None, "nki06", lnc)
        rows.append(
            {
                "shape": f"{b}x{s}x{h}",
                "aws_us": aws_us,
                "ours_us": our_us,
                "speedup": aws_us / our_us,
                "copy_us": copy_us,
                "aws_copy": aws_us / copy_us,
                "ours_copy": our_us / copy_us,
                "aws_error": _packed_error(aws_out, x, weight),
                "ours_error": _packed_error(our_packed, x, weight),
            }
        )
    return rows


def _mx_wrapper():
    """An LNC=2 ``nki.jit`` kernel around nki-library's ``rmsnorm_mx_quantize_tkg`` (imported
    after :func:`_load_nkilib`; its outputs live in SBUF): allocates them, calls it, and
    stores each core's half of the tokens (the scales from partitions 0-3 of each quadrant,
    where ``quantize_mx`` writes them)."""
    import nki
    import nki.isa as nisa
    import nki.language as nl
    from nkilib.core.subkernels.rmsnorm_mx_quantize_tkg import rmsnorm_mx_quantize_tkg

    @nki.jit
    def rmsnorm_mx_kernel(x, gamma):
        b, s, h = x.shape
        tokens = b * s
        out_sb = nl.ndarray((128, tokens, h // 128), dtype=x.dtype, buffer=nl.sbuf)
        shape = (128, h // 512, tokens)
        quant_sb = nl.ndarray(shape, dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
        scale_sb = nl.ndarray(shape, dtype=nl.uint8, buffer=nl.sbuf)
        rmsnorm_mx_quantize_tkg(
            input=x, gamma=gamma, output=out_sb, output_quant=quant_sb, output_scale=scale_sb
        )
        out = nl.ndarray(out_sb.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        quant = nl.ndarray(shape, dtype=nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
        scale = nl.ndarray((16, h // 512, tokens), dtype=nl.uint8, buffer=nl.shared_hbm)
        half = tokens // 2
        t0 = nl.program_id(0) * half
        nisa.dma_copy(dst=out[:, t0 : t0 + half, :], src=out_sb[:, t0 : t0 + half, :])
        nisa.dma_copy(dst=quant[:, :, t0 : t0 + half], src=quant_sb[:, :, t0 : t0 + half])
        for quadrant in range(4):
            nisa.dma_copy(
                dst=scale[quadrant * 4 : quadrant * 4 + 4, :, t0 : t0 + half],
                src=scale_sb[quadrant * 32 : quadrant * 32 + 4, :, t0 : t0 + half],
            )
        return out, quant, scale

    return rmsnorm_mx_kernel


def compare_mx(nkilib: str, shapes) -> list[dict]:
    """``rmsnorm_mx_quantize_tkg`` against ``rmsnorm_mx_quant`` on trn3 at LNC=2 (the AWS
    kernel's only configuration), bf16 in, float8_e4m3fn_x4 out, with the quant copy
    yardstick (x read, its fp8 bytes written)."""
    _load_nkilib(nkilib)
    from nki_rmsnorm import bench, kernels
    from nki_rmsnorm.kernels.nki06._nki import nl

    aws = _mx_wrapper()
    ours = kernels.kernel("rmsnorm_mx_quant", "nki06")
    rng = np.random.default_rng(0)
    rows = []
    for b, s, h in shapes:
        x = rng.standard_normal((b, s, h)).astype(ml_dtypes.bfloat16)
        weight = (1.0 + 0.1 * rng.standard_normal(h)).astype(ml_dtypes.bfloat16)
        _, aws_us = _launch(aws, 2, "trn3", x, weight.reshape(1, h))
        x2d = x.reshape(b * s, h)
        args = (x2d, None, weight, EPS, nl.float8_e4m3fn_x4, nl.float8_e8m0fnu)
        _, ours_us = _launch(ours, 2, "trn3", *args)
        copy_us = bench._copy_us("quant", "trn3", x2d, None, None, "nki06", 2)
        rows.append(
            {"shape": f"{b}x{s}x{h}", "aws_us": aws_us, "ours_us": ours_us, "copy_us": copy_us}
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nkilib", required=True, help="root of an nki-library checkout")
    parser.add_argument("--target", default="trn2", choices=("trn2", "trn3"))
    parser.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxSxH")
    parser.add_argument("--tkg", action="store_true", help="also rmsnorm_tkg vs rmsnorm_fwd")
    parser.add_argument("--tkg-shapes", default=DEFAULT_TKG_SHAPES, help="comma list of BxSxH")
    parser.add_argument(
        "--mx", action="store_true", help="also rmsnorm_mx_quantize_tkg vs rmsnorm_mx_quant"
    )
    parser.add_argument("--mx-shapes", default=DEFAULT_MX_SHAPES, help="comma list of BxSxH")
    args = parser.parse_args(argv)
    try:
        shapes = _parse_shapes(args.shapes)
        tkg_shapes = _parse_shapes(args.tkg_shapes)
        mx_shapes = _parse_shapes(args.mx_shapes)
        rows = compare(args.nkilib, args.target, args.lnc, shapes)
        tkg_rows = compare_tkg(args.nkilib, args.target, args.lnc, tkg_shapes) if args.tkg else []
        mx_rows = compare_mx(args.nkilib, mx_shapes) if args.mx else []
    except ValueError as error:
        parser.error(str(error))
    print(
        f"rmsnorm_quant_kernel (nki-library) vs nki_rmsnorm rmsnorm_quant, {args.target} "
        f"LNC={args.lnc}, bf16 in, {QUANT_DTYPE} packed out, modeled"
    )
    print(
        f"{'shape':>14s} {'AWS µs':>9s} {'ours µs':>9s} {'speed-up':>9s} {'copy µs':>9s} "
        f"{'AWS×copy':>9s} {'ours×copy':>10s} {'AWS err':>8s} {'our err':>8s}"
    )
    for r in rows:
        print(
            f"{r['shape']:>14s} {r['aws_us']:9.1f} {r['ours_us']:9.1f} {r['speedup']:8.2f}× "
            f"{r['copy_us']:9.1f} {r['aws_copy']:9.2f} {r['ours_copy']:10.2f} "
            f"{r['aws_error']:8.4f} {r['ours_error']:8.4f}"
        )
    if tkg_rows:
        print(
            f"\nrmsnorm_tkg (nki-library) vs nki_rmsnorm rmsnorm_fwd, {args.target} "
            f"LNC={args.lnc}, bf16, modeled"
        )
        print(
            f"{'shape':>14s} {'AWS µs':>9s} {'ours µs':>9s} {'ours_t µs':>10s} "
            f"{'AWS/ours_t':>11s}  AWS result"
        )
        for r in tkg_rows:
            aws = "n/a" if r["aws_us"] is None else f"{r['aws_us']:.2f}"
            speedup = "n/a" if r["aws_us"] is None else f"{r['aws_us'] / r['ours_t_us']:.2f}×"
            print(
                f"{r['shape']:>14s} {aws:>9s} {r['ours_us']:9.2f} {r['ours_t_us']:10.2f} "
                f"{speedup:>11s}  {r['note']}"
            )
    if mx_rows:
        print(
            "\nrmsnorm_mx_quantize_tkg (nki-library) vs nki_rmsnorm rmsnorm_mx_quant, trn3 "
            "LNC=2, bf16 in, float8_e4m3fn_x4 out, modeled"
        )
        print(f"{'shape':>14s} {'AWS µs':>9s} {'ours µs':>9s} {'speed-up':>9s} {'copy µs':>9s}")
        for r in mx_rows:
            print(
                f"{r['shape']:>14s} {r['aws_us']:9.1f} {r['ours_us']:9.1f} "
                f"{r['aws_us'] / r['ours_us']:8.2f}× {r['copy_us']:9.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
