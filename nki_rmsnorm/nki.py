"""The one place the package imports NKI from.

Kernels say ``from nki_rmsnorm.nki import nki, nl, nisa``. With the Neuron compiler installed
that is the real ``neuronxcc.nki`` and the kernels compile for a NeuronDevice; anywhere else
it is :mod:`simulate`, the package's NumPy NKI simulator, which runs the same kernel code on
the CPU. ``SIMULATED`` says which one was picked.

:func:`sdk_version` names the legacy Neuron SDK release the kernels are built for, so a
kernel can pick an API that only newer releases have and keep the older path for the rest;
:func:`usable_sbuf_bytes` is the per-partition SBUF a kernel may allocate on the target.
"""

from __future__ import annotations

import simulate

SIMULATED = not simulate.real_nki_available()

if SIMULATED:
    import simulate as nki
    import simulate.isa as nisa
    import simulate.language as nl
else:  # pragma: no cover - needs the Neuron SDK
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl

__all__ = [
    "NEWEST_SDK",
    "OLDEST_SDK",
    "SIMULATED",
    "check_sdk",
    "nki",
    "nisa",
    "nl",
    "sdk_version",
    "usable_sbuf_bytes",
]

#: The legacy SDK releases the kernels support: the return convention they use exists from
#: 2.21 (general/nki/nki_rn.rst@8a38e733, "[2.21]"), and 2.29 is the last legacy release.
OLDEST_SDK = (2, 21)
NEWEST_SDK = (2, 29)
#: Neuron SDK 2.x ships neuronx-cc 2.(x − 5): compiler 2.16 on 12/20/2024 with SDK 2.21, 2.17
#: with 2.22 (04/03/2025), … 2.20 with 2.25 (07/31/2025)
#: (release-notes/compiler/neuronx-cc/index.rst@8a38e733, lines 10-45, against the NKI
#: release dates in general/nki/nki_rn.rst@8a38e733).
_COMPILER_TO_SDK_MINOR = 5
#: First release with ``nl.tile_size.total_available_sbuf_size``
#: (general/nki/nki_rn.rst@8a38e733, line 18, the "[2.26]" entry).
SBUF_SIZE_API_SDK = (2, 26)
#: Per-partition SBUF a kernel may allocate before that API, by NeuronCore version: the
#: physical partition (192 KiB on v2, general/nki/arch/trainium_inferentia2_arch.rst@8a38e733
#: line 76; 224 KiB on v3, nki/guides/architecture/trainium2_arch.rst line 39, and 32 MiB /
#: 128 = 256 KiB on v4, trainium3_arch.rst line 36, at the mirror's HEAD, aws-neuron-sdk
#: repository) less the 16 KiB the compiler keeps for itself
#: (general/nki/nki_direct_allocation_guide.rst@8a38e733, lines 153-155). v3 and v4 keep 8
#: more bytes: the figure ``total_available_sbuf_size`` reports for them from 2.26 on.
SBUF_BYTES_BY_NC_VERSION = {
    2: (192 - 16) * 1024,
    3: (224 - 16) * 1024 - 8,
    4: (256 - 16) * 1024 - 8,
}


def sdk_version() -> tuple[int, int]:
    """The legacy Neuron SDK release as ``(2, minor)``: the simulator's emulated release, or
    the installed neuronx-cc's SDK release on a real compiler; the newest supported release
    when neither says."""
    if SIMULATED:
        emulated = getattr(simulate, "sdk_version", None)
        return NEWEST_SDK if emulated is None else _release(emulated())
    from importlib.metadata import PackageNotFoundError, version  # pragma: no cover

    try:  # pragma: no cover - needs the Neuron SDK
        major, minor = _release(version("neuronx-cc"))
    except (PackageNotFoundError, ValueError, IndexError):  # pragma: no cover
        return NEWEST_SDK
    return (major, minor + _COMPILER_TO_SDK_MINOR)  # pragma: no cover


def check_sdk() -> tuple[int, int]:
    """The SDK release (:func:`sdk_version`) when the legacy kernels support it, else a
    ``RuntimeError`` naming the release and the supported range, raised before any launch:
    before 2.21 the return convention does not exist, and from 2.30 on ``neuronxcc.nki``
    inside a kernel is a compile error (the ``nki`` 0.6 kernels serve those releases)."""
    release = sdk_version()
    if not OLDEST_SDK <= release <= NEWEST_SDK:
        raise RuntimeError(
            "the legacy nki_rmsnorm kernels support Neuron SDK {}.{} to {}.{}, but the "
            "{} SDK is {}.{}".format(
                *OLDEST_SDK, *NEWEST_SDK, "emulated" if SIMULATED else "installed", *release
            )
        )
    return release


def _release(value) -> tuple[int, int]:
    """``"2.24"`` (or ``"2.24.0"``, or ``(2, 24)``) as ``(2, 24)``."""
    parts = value.split(".") if isinstance(value, str) else value
    return int(parts[0]), int(parts[1])


def usable_sbuf_bytes() -> int:
    """SBUF bytes per partition a kernel may allocate on the running target: the compiler's
    own figure from SDK 2.26 on (or whenever the API answers), the documented
    per-generation figure before."""
    if sdk_version() >= SBUF_SIZE_API_SDK:
        try:
            return nl.tile_size.total_available_sbuf_size
        except AttributeError:  # an older SDK whose version could not be read
            pass
    return SBUF_BYTES_BY_NC_VERSION[min(int(nisa.get_nc_version()), 4)]
