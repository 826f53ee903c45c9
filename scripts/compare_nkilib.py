"""Side by side on the simulator's cost model: AWS nki-library's ``rmsnorm_quant_kernel``,
run unmodified from a local checkout, against this package's ``rmsnorm_quant`` on the same
inputs, target and LNC, with the plain-copy yardstick of the same bytes.

Usage::

    python scripts/compare_nkilib.py --nkilib ~/src/nki-library \\
        [--target trn2] [--lnc 2] [--shapes 1x2048x8192,1x2048x16384,1x32768x8192]

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


def _packed_error(packed, x, weight) -> float:
    """Largest |y_q · scale − y| / amax(row) of a packed [..., N + 4] output."""
    from nki_rmsnorm import reference

    n = x.shape[-1]
    packed = np.asarray(packed).reshape(-1, n + 4)
    scales = np.ascontiguousarray(packed[:, n:]).view(np.uint8).view("<f4")[:, :1]
    dequantized = packed[:, :n].astype(np.float64) * scales
    want = reference.rms_norm_quant(x.reshape(-1, n), weight, EPS, quant_dtype=QUANT_DTYPE)
    return float(np.max(np.abs(dequantized - want["y"]) / want["amax"][:, None]))


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nkilib", required=True, help="root of an nki-library checkout")
    parser.add_argument("--target", default="trn2", choices=("trn2", "trn3"))
    parser.add_argument("--lnc", type=int, default=2, choices=(1, 2))
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxSxH")
    args = parser.parse_args(argv)
    try:
        shapes = _parse_shapes(args.shapes)
        rows = compare(args.nkilib, args.target, args.lnc, shapes)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
