"""What the kernels do on Trn1, Trn2 and Trn3, in a few minutes on any CPU (``make run``).

For each hardware generation, in the NKI dialect its Neuron SDK compiles (Trn1: legacy
``neuronxcc.nki``, SDK 2.21 – 2.29; Trn2 and Trn3: NKI 0.6, SDK 2.31 – 2.32), the forward,
backward and fused residual-add kernels run once on the simulator on a bf16 batch of
8192 tokens × hidden 4096. Each result is checked against the float64 NumPy reference, then
the cost model's latency is printed beside a plain DMA copy of the same bytes (the floor
for a memory-bound kernel) and the Neuron RMSNorm tutorial's kernel (what a user would
start from). The times are model estimates, not device measurements (docs/calibration.md
says how far the model is from published measurements).

    python examples/quickstart.py [--shape 8192x4096] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from nki_rmsnorm import bench

#: (target, dialect, what runs it): the dialect follows the hardware.
HARDWARE = (
    ("trn1", "legacy", "Trn1 / Inf2, Neuron SDK 2.21-2.29 (neuronxcc.nki)"),
    ("trn2", "nki06", "Trn2, Neuron SDK 2.31-2.32 (NKI 0.6)"),
    ("trn3", "nki06", "Trn3, Neuron SDK 2.31-2.32 (NKI 0.6)"),
)
KINDS = {"fwd": "forward", "bwd": "backward", "fused_add": "residual add + forward"}
BF16_EPS = 2.0**-8


def _case(args):
    kind, target, dialect, M, N, seed = args
    rng = np.random.default_rng(seed)
    return bench.run_case(kind, target, M, N, "bfloat16", rng, dialect=dialect)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8192x4096", help="MxN (tokens x hidden)")
    parser.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="cases simulated in parallel processes (default 2)",
    )
    args = parser.parse_args(argv)
    try:
        ((M, N),) = bench.parse_shapes(args.shape)
    except ValueError as error:
        parser.error(f"--shape: {error}")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")

    cases = [
        (kind, target, dialect, M, N, seed)
        for seed, ((target, dialect, _), kind) in enumerate(
            (hw, kind) for hw in HARDWARE for kind in KINDS
        )
    ]
    print(
        f"RMSNorm, bf16, {M} x {N}, gemma casting, eps {bench.EPS:g}: simulating "
        f"{len(cases)} kernel runs on {args.jobs} process(es)...",
        flush=True,
    )
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        records = list(pool.map(_case, cases))

    print()
    print(
        f"{'hardware (dialect)':52s} {'kernel':22s} {'model µs':>9s} {'×copy':>6s} "
        f"{'MBU':>6s} {'vs tutorial':>11s} {'error':>6s}  ok"
    )
    for (_, _, what), rows in zip(HARDWARE, _chunks(records, len(KINDS))):
        for r in rows:
            versus = f"{r.speedup_vs_baseline:.2f}× fast" if r.speedup_vs_baseline else "n/a"
            print(
                f"{what:52s} {KINDS[r.kind]:22s} {r.modeled_us:9.1f} {r.copy_ratio:6.2f} "
                f"{100 * r.mbu:5.1f}% {versus:>11s} {r.max_error / BF16_EPS:6.2f}  "
                f"{'yes' if r.correct else 'NO'}"
            )
    print()
    print(
        "model µs: modeled kernel latency on one NeuronCore (cost model, not a device "
        "measurement);\n×copy: that over a plain DMA copy of the same tensors; MBU: "
        "minimal HBM bytes / time / the core's HBM bandwidth;\nvs tutorial: the Neuron "
        "RMSNorm tutorial kernel's modeled time over ours; error: largest |kernel - float64 "
        "reference|\nin bf16 ulps of the largest output (backward: of each row's largest "
        "term); ok: within the benchmark's tolerance."
    )
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        f"\n{len(records)} runs simulated in {time.perf_counter() - start:.0f} s "
        f"({children.ru_utime + children.ru_stime:.0f} s of CPU). "
        "The full sweep: nki-rmsnorm bench --full; results in docs/benchmark.md."
    )
    return 0 if all(r.correct for r in records) else 1


def _chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


if __name__ == "__main__":
    sys.exit(main())
