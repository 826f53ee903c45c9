"""``nki-rmsnorm doctor``: what this installation runs, in a few lines a user can paste into a
bug report: the package and Python versions, the real Neuron SDK / NKI found (or none), the
kernel dialect and why, whether the kernels run on a NeuronDevice or on the CPU simulator,
and the launch path each framework binding takes."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys

from nki_rmsnorm import dialect


def _distribution(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _sdk_lines() -> list[str]:
    nki_version = dialect.real_nki_version()
    legacy = dialect._legacy_sdk_release()
    lines = [
        "nki (NKI 0.5 - 0.6, SDK 2.31 - 2.32): "
        + ("not installed" if nki_version is None else f"{nki_version[0]}.{nki_version[1]}"),
        "neuronxcc.nki (legacy, SDK 2.21 - 2.29): "
        + (
            "not installed"
            if dialect._real_module("neuronxcc.nki") is None
            else f"neuronx-cc {_distribution('neuronx-cc') or '(version unknown)'}"
            + ("" if legacy is None else f", SDK {legacy[0]}.{legacy[1]}")
        ),
    ]
    return lines


def _torch_line(simulated: bool, current: str) -> str:
    version = _distribution("torch")
    if version is None:
        return "torch: not installed (pip install 'nki-rmsnorm[torch]')"
    paths = ["cpu tensors -> simulator"]
    if not simulated and _distribution("torch-neuronx") is not None:
        # torch-neuronx is PyTorch/XLA's Neuron plugin up to SDK 2.30 and TorchNeuron, the
        # native "neuron" device, from SDK 2.31 (frameworks/torch/pytorch-native-overview.rst)
        if _distribution("torch-xla") is not None:
            legacy_nki_jit = current == dialect.LEGACY and _has_nki_jit()
            paths.append(
                "xla tensors -> "
                + ("torch_neuronx.nki_jit" if legacy_nki_jit else "nki.jit kernels called directly")
            )
        else:
            paths.append("neuron tensors (TorchNeuron) -> nki.jit kernels called directly")
    return f"torch {version}: " + "; ".join(paths)


def _has_nki_jit() -> bool:  # pragma: no cover - needs torch-neuronx
    try:
        import torch_neuronx
    except ImportError:
        return False
    return hasattr(torch_neuronx, "nki_jit")


def _jax_line(simulated: bool, current: str) -> str:
    version = _distribution("jax")
    if version is None:
        return "jax: not installed (pip install 'nki-rmsnorm[jax]')"
    if simulated:
        return f"jax {version}: simulator (kernels in a host callback)"
    jax_neuronx = _distribution("jax-neuronx")
    path = "nki_call" if current == dialect.LEGACY and jax_neuronx else "nki.jit"
    return f"jax {version}: on the neuron backend -> {path}; elsewhere -> simulator"


def _target() -> str:
    try:
        return dialect.target() or "not set"
    except ValueError as error:
        return f"invalid: {error}"


def _dialect_or_error(target_name: str | None) -> str:
    """The dialect on ``target_name`` (None: the target now), or why there is none."""
    try:
        return dialect.for_target(target_name) if target_name else dialect.current()
    except (RuntimeError, ValueError) as error:
        return f"none ({error})"


def report() -> str:
    """The doctor's text (the ``doctor`` command prints it)."""
    from nki_rmsnorm import __version__

    real = dialect.hardware_dialect()
    simulated = real is None
    current = _dialect_or_error(None)
    if real is not None:
        why = "the hardware and the installed SDK decide"
    else:
        override = os.environ.get(dialect.ENV_VAR)
        why = "the simulator: trn1/inf2 legacy; trn2/trn3 " + (
            f"{override} ({dialect.ENV_VAR})"
            if override
            else "nki06 unless NKI_RMSNORM_DIALECT says"
        )
    per_target = ", ".join(
        f"{t} {_dialect_or_error(t)}" for t in dialect.LEGACY_ONLY_TARGETS + dialect.NKI06_TARGETS
    )
    problem = dialect.unsupported_sdk()
    require = os.environ.get(dialect.REQUIRE_DEVICE_ENV, "") not in ("", "0")
    if simulated:
        where = "SIMULATED on the CPU (no NeuronDevice is used; times are model estimates)"
        if require:
            where += f"; {dialect.REQUIRE_DEVICE_ENV} is set, so launches will raise"
    else:
        where = f"on a NeuronDevice, compiled by the installed SDK ({real} kernels)"
    lines = [
        f"nki-rmsnorm {__version__} on Python {platform.python_version()} ({sys.platform})",
        *_sdk_lines(),
        f"target ({dialect.TARGET_ENV_VAR}): {_target()}",
        f"kernel dialect: {current} now; per target: {per_target} ({why})",
        f"kernels run: {where}",
        f"unsupported SDK: {problem}" if problem else "unsupported SDK: none found",
        _torch_line(simulated, current),
        _jax_line(simulated, current),
    ]
    return "\n".join(lines)
