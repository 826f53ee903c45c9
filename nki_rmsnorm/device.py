"""``nki-rmsnorm bench --device``: the kernels timed on a NeuronDevice, beside the cost model's
estimate and beside ``torch.nn.functional.rms_norm`` compiled by the framework's own compiler.

How each figure is measured, with the SDK's documented APIs only:

* **NKI kernel, legacy SDK (2.21 – 2.29, ``neuronxcc.nki``)**: ``nki.benchmark(warmup=,
  iters=)`` around the ``nki.jit`` kernel, called once with NumPy arrays; p50/p99 are
  ``benchmark_result.nc_latency.get_latency_percentile(50 / 99)`` in µs
  (aws-neuron-sdk@8a38e733 general/nki/api/nki/__init__.py L282-L364; the same call in the
  matmul tutorial, general/nki/examples/matrix_multiplication/
  matrix_multiplication_nki_kernels.py L405-L410). ``neuron-bench`` runs the NEFF without a
  framework; its latency includes the host-device transfers.
* **NKI kernel, NKI 0.5 – 0.6 (SDK 2.31 – 2.32)**: ``nki.benchmark`` is not available since
  NKI 0.2.0 (aws-neuron-sdk@81ce03ae release-notes/components/nki.rst L743), and the docs'
  way to time a workload without the profiler is the wall clock around it with the device
  synchronised (aws-neuron-sdk@81ce03ae
  tools/neuron-explorer/troubleshooting.rst L343-L356). The kernel runs through the PyTorch
  binding on the framework's device, timed like the framework baseline below.
* **Framework baseline**: ``F.rms_norm`` on the same tensors, compiled by torch-xla (device
  ``xla``: one ``xm.mark_step()`` per iteration, ``xm.wait_device_ops()`` before the clock
  stops) or run by TorchNeuron (device ``neuron``: ``torch.neuron.synchronize()`` around each
  iteration, as the page above shows). The fused-add case times ``F.rms_norm(x + residual)``;
  the backward one ``torch.autograd.grad`` of it.

Each figure is the p50 and p99 over ``--iters`` iterations after ``--warmup`` unmeasured ones.
The model column is the cost model's estimate for the same case (the record in
``docs/bench.json`` when the checkout has it; else ``n/a``: run ``nki-rmsnorm bench --shapes
MxN`` on any machine for it; the simulator does not run where the real SDK is installed).

The measurement needs a NeuronDevice (``tests/bench/test_device.py`` marks that test ``neuron``);
the run's plumbing is tested there with the CPU standing in for the device.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import numpy as np

from nki_rmsnorm import dialect

#: NeuronCore version (``nisa.get_nc_version()``) → the bench's target name.
NC_VERSION_TARGETS = {2: "trn1", 3: "trn2", 4: "trn3"}
DEVICE_HEADER = (
    f"{'kind':9s} {'target':6s} {'shape':>12s} {'NKI p50 µs':>11s} {'NKI p99 µs':>11s} "
    f"{'model µs':>9s} {'F.rms_norm p50':>15s} {'p99':>9s} {'via':>14s}"
)


@dataclass
class DeviceRecord:
    kind: str
    target: str
    M: int  # noqa: N815 - the bench's key names
    N: int  # noqa: N815
    dtype: str
    nki_p50_us: float
    nki_p99_us: float
    nki_method: str  # "nki.benchmark" or "wall clock (<framework>)"
    model_us: float | None
    framework_p50_us: float | None
    framework_p99_us: float | None
    framework: str | None  # "torch-xla" or "torchneuron"
    dialect: str
    warmup: int
    iters: int


def check_available() -> None:
    """``ValueError`` (a usage error of ``--device``) when no real Neuron SDK is installed:
    the kernels would run on the simulator, and there is nothing to measure."""
    if dialect.hardware_dialect() is None:
        version = dialect.real_nki_version()
        found = (
            f"nki {version[0]}.{version[1]} is installed but not supported "
            f"(the 0.6 kernels support {_range(dialect.NKI_VERSIONS)})"
            if version is not None
            else "neither the nki package (SDK 2.31 - 2.32) nor neuronxcc.nki (SDK 2.21 - "
            "2.29) is installed"
        )
        raise ValueError(
            f"--device needs the Neuron SDK on a machine with a NeuronDevice: {found}; "
            "without --device the bench reports the cost model's estimates"
        )


def _range(versions) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = versions
    return f"{lo_major}.{lo_minor} - {hi_major}.{hi_minor}"


def percentiles(samples_us) -> tuple[float, float]:
    """p50 and p99 of a list of latencies in µs (linear interpolation, as NumPy's default)."""
    values = np.asarray(samples_us, np.float64)
    if values.size == 0:
        raise ValueError("no samples: --iters must be at least 1")
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def time_iterations(step, synchronize, warmup: int, iters: int) -> tuple[float, float]:
    """p50/p99 in µs of ``step()`` followed by ``synchronize()`` (the device finished), over
    ``iters`` iterations after ``warmup`` unmeasured ones."""
    for _ in range(warmup):
        step()
        synchronize()
    samples = []
    for _ in range(iters):
        synchronize()
        start = time.perf_counter()
        step()
        synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    return percentiles(samples)


def model_estimate(kind, target, M, N, dtype_name, lnc=1, records_path=None) -> float | None:
    """The cost model's µs for the case from a bench JSON (default: the checkout's
    ``docs/bench.json``); None when the file or the case is not there."""
    path = records_path or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "bench.json"
    )
    try:
        with open(path) as f:
            records = json.load(f)
    except (OSError, ValueError):
        return None
    for r in records:
        if (
            r.get("kind"),
            r.get("target"),
            r.get("M"),
            r.get("N"),
            r.get("dtype"),
            r.get("lnc", 1),
        ) == (kind, target, M, N, dtype_name, lnc):
            return r.get("modeled_us")
    return None


def format_row(r: DeviceRecord) -> str:
    def us(value):
        return "n/a" if value is None else f"{value:.1f}"

    via = r.framework or "n/a"
    return (
        f"{r.kind:9s} {r.target:6s} {f'{r.M}x{r.N}':>12s} {r.nki_p50_us:11.1f} "
        f"{r.nki_p99_us:11.1f} {us(r.model_us):>9s} {us(r.framework_p50_us):>15s} "
        f"{us(r.framework_p99_us):>9s} {via:>14s}"
    )


def _device_dialect() -> str | None:
    """The installed SDK's dialect (trn1/inf2 devices run legacy ones, which
    :func:`detected_target` tells apart only on the device)."""
    return dialect.hardware_dialect()


def detected_target() -> str:  # pragma: no cover - needs a NeuronDevice
    """The bench target of the NeuronCore this process runs on."""
    if dialect.hardware_dialect() == dialect.NKI06:
        import nki.isa as nisa
    else:
        import neuronxcc.nki.isa as nisa
    return NC_VERSION_TARGETS.get(int(nisa.get_nc_version()), f"nc-v{nisa.get_nc_version()}")


def _framework():  # pragma: no cover - needs a NeuronDevice
    """``(name, device, synchronize)`` of the installed framework device: torch-xla's
    ``xla`` device, else TorchNeuron's ``neuron`` device; None without either."""
    try:
        import torch
    except ImportError:
        return None
    try:
        import torch_xla.core.xla_model as xm

        def synchronize():
            xm.mark_step()
            xm.wait_device_ops()

        return "torch-xla", xm.xla_device(), synchronize
    except ImportError:
        pass
    if hasattr(torch, "neuron"):
        return "torchneuron", torch.device("neuron"), torch.neuron.synchronize
    return None


def _legacy_kernel_latency(kind, arrays, warmup, iters):  # pragma: no cover - device only
    from neuronxcc import nki as real_nki

    from nki_rmsnorm import kernels
    from nki_rmsnorm.bench import EPS

    x, weight, residual, dy, rstd = arrays
    if kind == "bwd":
        kernel = kernels.kernel("rmsnorm_bwd", dialect.LEGACY)
        args = (dy, x, weight, rstd, None, 0.0, False, "gemma", None)
    elif kind == "fused_add":
        kernel = kernels.kernel("rmsnorm_add_fwd", dialect.LEGACY)
        args = (x, residual, weight, None, EPS, 0.0, "gemma", None)
    else:
        kernel = kernels.kernel("rmsnorm_fwd", dialect.LEGACY)
        args = (x, weight, None, EPS, 0.0, "gemma", None)
    timed = real_nki.benchmark(warmup=warmup, iters=iters)(kernel)
    timed(*args)
    latency = timed.benchmark_result.nc_latency
    return latency.get_latency_percentile(50), latency.get_latency_percentile(99)


def _torch_steps(kind, arrays, device, dtype_name):
    """``(nki_step, framework_step)``: our binding and ``F.rms_norm`` on ``device``."""
    import torch
    import torch.nn.functional as F

    from nki_rmsnorm import torch as nki_torch
    from nki_rmsnorm.bench import EPS

    dtype = getattr(torch, dtype_name)

    def tensor(a):
        if a is None:
            return None
        return torch.from_numpy(np.asarray(a, np.float32)).to(dtype).to(device)

    x, weight, residual, dy = (tensor(a) for a in arrays[:4])
    shape = x.shape[-1:]
    if kind == "fwd":
        return (
            lambda: nki_torch.rms_norm(x, shape, weight, EPS),
            lambda: F.rms_norm(x, shape, weight, EPS),
        )
    if kind == "fused_add":
        return (
            lambda: nki_torch.fused_add_rms_norm(x, residual, weight, EPS),
            lambda: F.rms_norm(x + residual, shape, weight, EPS),
        )
    leaf = x.detach().requires_grad_(True)

    def grad(norm):
        return lambda: torch.autograd.grad(norm(leaf, shape, weight, EPS), leaf, dy)

    return grad(nki_torch.rms_norm), grad(F.rms_norm)


def bench(args, sweep) -> int:
    """The ``--device`` run: every kind and shape of the sweep on this machine's
    NeuronDevice (``--target`` is ignored: the device is the target)."""
    import ml_dtypes

    from nki_rmsnorm import reference
    from nki_rmsnorm.bench import EPS, TARGETS, _inputs, case_rng

    dialect_name = _device_dialect()
    target = detected_target()
    framework = _framework()
    print(
        f"device: {target}, NKI dialect {dialect_name}, framework "
        f"{framework[0] if framework else 'none'}; {args.warmup} warm-up and {args.iters} "
        "measured iterations per figure",
        flush=True,
    )
    print(DEVICE_HEADER, flush=True)
    dtype = np.dtype(ml_dtypes.bfloat16 if sweep.dtype_name == "bfloat16" else sweep.dtype_name)
    seed_target = target if target in TARGETS else "trn2"  # the inputs the simulator run draws
    records = []
    for kind in sweep.kinds:
        for M, N in sweep.shapes:
            rng = case_rng(args.seed, kind, seed_target, 1, M, N)
            x, weight, residual, dy = _inputs(kind, M, N, dtype, rng)
            rstd = reference.rms_norm_fwd(x, weight, EPS)[1] if kind == "bwd" else None
            arrays = (x, weight, residual, dy, rstd)
            framework_p50 = framework_p99 = None
            if framework is not None:
                _, device, synchronize = framework
                nki_step, torch_step = _torch_steps(kind, arrays, device, sweep.dtype_name)
                framework_p50, framework_p99 = time_iterations(
                    torch_step, synchronize, args.warmup, args.iters
                )
            if dialect_name == dialect.LEGACY:
                nki_p50, nki_p99 = _legacy_kernel_latency(kind, arrays, args.warmup, args.iters)
                method = "nki.benchmark"
            elif framework is not None:
                nki_p50, nki_p99 = time_iterations(nki_step, synchronize, args.warmup, args.iters)
                method = f"wall clock ({framework[0]})"
            else:
                raise RuntimeError(
                    "NKI 0.6 kernels are timed through PyTorch on the device; "
                    "install torch-neuronx (torch-xla) or TorchNeuron"
                )
            record = DeviceRecord(
                kind=kind,
                target=target,
                M=M,
                N=N,
                dtype=sweep.dtype_name,
                nki_p50_us=nki_p50,
                nki_p99_us=nki_p99,
                nki_method=method,
                model_us=model_estimate(kind, target, M, N, sweep.dtype_name),
                framework_p50_us=framework_p50,
                framework_p99_us=framework_p99,
                framework=framework[0] if framework else None,
                dialect=dialect_name,
                warmup=args.warmup,
                iters=args.iters,
            )
            records.append(record)
            print(format_row(record), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1)
    return 0
