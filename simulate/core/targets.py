"""Per-target hardware facts the simulator enforces: partitions, SBUF/PSUM capacity, tile limits.

Documented values: the architecture guides (S1-S3, S8 in ``docs/design.md``, Sources) and the
legacy programming model's tile-size limits (``general/nki/programming_model.rst@8a38e733``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NKIValueError

PMAX = 128
PSUM_BANK_BYTES = 2048
PSUM_BANKS = 8


@dataclass(frozen=True)
class Target:
    """What one NeuronCore of a given generation offers a kernel."""

    name: str
    nc_version: int  # 2 = NeuronCore-v2 (trn1/inf2), 3 = v3 (trn2), 4 = v4 (trn3)
    sbuf_bytes_per_partition: int  # what the compiler lets a kernel allocate
    psum_bytes_per_partition: int = PSUM_BANKS * PSUM_BANK_BYTES
    partitions: int = PMAX


TARGETS = {
    "inf2": Target("inf2", 2, 180224),
    "trn1": Target("trn1", 2, 180224),
    "trn2": Target("trn2", 3, 212984),
    "trn3": Target("trn3", 4, 245752),
}
# The target a kernel runs on when nothing names one, per dialect. nki 0.6: "otherwise
# defaults to trn3" (nki/guides/nki_simulator.rst@81ce03ae, L117-L118). neuronxcc.nki: its
# docs name no default, and their simulated examples that need NeuronCore-v3 say
# platform_target='trn2' (e.g. general/nki/test/test_nki_isa_nc_matmul.py@8a38e733, L82),
# so the simulator keeps the NeuronCore-v2 trn1 that the legacy kernels and tests assume.
DIALECT_DEFAULT_TARGET = {"legacy": "trn1", "nki06": "trn3"}
DEFAULT_TARGET = DIALECT_DEFAULT_TARGET["legacy"]


def get_target(name: str | Target | None) -> Target:
    """Look a target up by name (``inf2``, ``trn1``, ``trn2``, ``trn3``)."""
    if isinstance(name, Target):
        return name
    key = (name or DEFAULT_TARGET).lower()
    if key not in TARGETS:
        raise NKIValueError(
            f"unknown platform target {name!r}; expected one of {', '.join(TARGETS)}",
            "err_unknown_platform_target",
        )
    return TARGETS[key]


# Largest free size one Vector/Scalar instruction may read (ARCH2 "Layout & Tile Size").
MAX_FREE_ELEMENTS_SBUF = 65536
MAX_FREE_ELEMENTS_PSUM = 4096
