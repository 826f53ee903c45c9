"""The emulated Neuron SDK release (2.20 … 2.29) and which legacy NKI API appears in which one.

``NKI_SIM_SDK=2.24`` in the environment, :func:`set_sdk` or the :func:`sdk` context manager
choose the release (default: the newest, 2.29). The choice lives in a context variable, so it
is per thread / per asyncio task. Under an older release, an API the release does not have
yet raises ``AttributeError`` and a parameter it does not have yet raises ``TypeError``, both
naming the first release that has it.

Evidence: the legacy API reference at each release's documentation commit of
``aws-neuron/aws-neuron-sdk`` (2.20 ``72825d50``, 2.21 ``752349fd``, 2.22 ``2ae3525e``,
2.23 ``4eba310f``, 2.24 ``65992b22``, 2.26 ``8a38e733``) and the NKI release notes
``general/nki/nki_rn.rst@8a38e733``. The legacy API reference did not change between 2.24 and
2.26 except for the rows marked 2.26 (no 2.25 entry exists), and 2.27–2.29 froze the legacy
``neuronxcc.nki`` namespace (``release-notes/prev/2.27.0/nki.rst@HEAD``: 2.27 introduces the new
``nki.*`` namespace side by side), so 2.25 behaves as 2.24 and 2.27–2.29 as 2.26.

This module imports nothing from the front-end modules, so both dialects can share it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import types

RELEASES = ("2.20", "2.21", "2.22", "2.23", "2.24", "2.25", "2.26", "2.27", "2.28", "2.29")
NEWEST = RELEASES[-1]
OLDEST = RELEASES[0]

_RN = "general/nki/nki_rn.rst@8a38e733"
_ISA = "general/nki/api/nki/isa/__init__.py"
_LANG = "general/nki/api/nki/language/__init__.py"
_NKI = "general/nki/api/nki/__init__.py"
_COMMIT = {
    "2.21": "752349fd",
    "2.22": "2ae3525e",
    "2.23": "4eba310f",
    "2.24": "65992b22",
    "2.26": "8a38e733",
}


def _doc(path, release, line):
    return f"{path}@{_COMMIT[release]}, L{line}"


# (front-end name, first release, citation). Attribute rows: the name appears in that release.
API_TABLE: dict[str, tuple[str, str]] = {
    "nki.jit": ("2.21", _doc(_NKI, "2.21", 279)),
    "nki.profile": ("2.21", _doc(_NKI, "2.21", 313)),
    "nisa.activation_reduce": ("2.21", _doc(_ISA, "2.21", 63)),
    "nisa.dma_copy": ("2.21", _doc(_ISA, "2.21", 255)),
    "nisa.dma_transpose": ("2.21", _doc(_ISA, "2.21", 278)),
    "nisa.get_nc_version": ("2.21", _doc(_ISA, "2.21", 355)),
    "nisa.nc_version": ("2.21", _doc(_ISA, "2.21", 638)),
    "nisa.scalar_tensor_tensor": ("2.21", _doc(_ISA, "2.21", 696)),
    "nisa.tensor_copy": ("2.21", _doc(_ISA, "2.21", 739)),
    "nisa.tensor_copy_dynamic_src": ("2.21", _doc(_ISA, "2.21", 782)),
    "nisa.tensor_copy_dynamic_dst": ("2.22", _doc(_ISA, "2.22", 1034)),
    "nisa.tensor_partition_reduce": ("2.21", _doc(_ISA, "2.21", 825)),
    "nisa.tensor_scalar_reduce": ("2.21", _doc(_ISA, "2.21", 990)),
    "nl.ds": ("2.21", _doc(_LANG, "2.21", 311)),
    "nl.float8_e5m2": ("2.21", _doc(_LANG, "2.21", 403)),
    "nl.left_shift": ("2.21", _doc(_LANG, "2.21", 536)),
    "nl.right_shift": ("2.21", _doc(_LANG, "2.21", 1107)),
    "nl.nc": ("2.21", _doc(_LANG, "2.21", 916)),
    "nl.shared_identity_matrix": ("2.21", _doc(_LANG, "2.21", 1224)),
    "nl.silu": ("2.21", _doc(_LANG, "2.21", 1269)),
    "nl.silu_dx": ("2.21", _doc(_LANG, "2.21", 1282)),
    "nl.spmd_dim": ("2.21", _doc(_LANG, "2.21", 1337)),
    "nl.tan": ("2.21", _doc(_LANG, "2.21", 1472)),
    "nisa.engine": ("2.22", _doc(_ISA, "2.22", 403)),
    "nisa.reduce_cmd": ("2.22", _doc(_ISA, "2.22", 929)),
    "nl.broadcast_to": ("2.22", _doc(_LANG, "2.22", 232)),
    "nl.empty_like": ("2.22", _doc(_LANG, "2.22", 341)),
    "nl.fmod": ("2.22", _doc(_LANG, "2.22", 454)),
    "nl.mod": ("2.22", _doc(_LANG, "2.22", 952)),
    "nl.reciprocal": ("2.22", _doc(_LANG, "2.22", 1159)),
    "nisa.dge_mode": ("2.23", _doc(_ISA, "2.23", 5)),
    "nisa.oob_mode": ("2.23", _doc(_ISA, "2.23", 70)),
    "nl.fp32": ("2.23", _doc(_LANG, "2.23", 22)),
    "nl.gather_flattened": ("2.24", _doc(_LANG, "2.24", 639)),
    "nl.gelu_apprx_sigmoid": ("2.26", _doc(_LANG, "2.26", 730)),
    "nl.bfp16": ("2.26", _doc(_LANG, "2.26", 7)),
    "nl.tile_size.total_available_sbuf_size": ("2.26", f"{_RN}, L18"),
    "return convention": ("2.21", f"{_RN}, L148"),
}

# (front-end name, parameter) -> (first release, citation)
PARAM_TABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("nisa.nc_matmul", "is_transpose"): ("2.21", _doc(_ISA, "2.21", 499)),
    ("nisa.memset", "engine"): ("2.21", _doc(_ISA, "2.21", 464)),
    # the 2.21 API reference already lists engine= on tensor_scalar (L916), the release notes
    # announce it with 2.22 (nki_rn L94): the later release is taken
    ("nisa.tensor_scalar", "engine"): ("2.22", f"{_RN}, L94"),
    ("nisa.tensor_tensor", "engine"): ("2.22", _doc(_ISA, "2.22", 1373)),
    ("nisa.activation", "reduce_op"): ("2.22", f"{_RN}, L92"),
    ("nisa.activation", "reduce_res"): ("2.22", f"{_RN}, L92"),
    ("nisa.activation", "reduce_cmd"): ("2.22", f"{_RN}, L92"),
    ("nisa.nc_matmul", "tile_position"): ("2.22", f"{_RN}, L91"),
    ("nisa.nc_matmul", "tile_size"): ("2.22", f"{_RN}, L91"),
    ("nisa.dma_copy", "mask"): ("2.23", _doc(_ISA, "2.23", 405)),
    ("nisa.dma_copy", "dst_rmw_op"): ("2.23", f"{_RN}, L67"),
    ("nisa.dma_copy", "oob_mode"): ("2.23", f"{_RN}, L67"),
    ("nisa.dma_copy", "dge_mode"): ("2.23", f"{_RN}, L67"),
    ("nisa.tensor_copy_dynamic_src", "engine"): ("2.23", f"{_RN}, L66"),
    ("nisa.tensor_copy_dynamic_dst", "engine"): ("2.23", f"{_RN}, L66"),
    ("nisa.dma_transpose", "axes"): ("2.26", f"{_RN}, L26"),
    ("nisa.dma_transpose", "dge_mode"): ("2.26", f"{_RN}, L27"),
}

# operator values an instruction accepts only from a release on
OP_TABLE: dict[tuple[str, str], tuple[str, str]] = {
    ("nisa.activation", "abs"): ("2.23", f"{_RN}, L63"),
    ("nisa.activation", "silu"): ("2.21", f"{_RN}, L118"),
    ("nisa.activation", "silu_dx"): ("2.21", f"{_RN}, L118"),
    ("nisa.activation", "identity"): ("2.21", f"{_RN}, L118"),
    ("nisa.activation", "gelu_apprx_sigmoid"): ("2.26", f"{_RN}, L29"),
    ("tensor instruction", "abs"): ("2.23", f"{_RN}, L62"),
    ("tensor instruction", "power"): ("2.23", f"{_RN}, L62"),
}


def _parse(release) -> str:
    text = str(release).strip()
    if text.count(".") > 1:  # "2.24.0"
        text = ".".join(text.split(".")[:2])
    if text not in RELEASES:
        raise ValueError(
            f"Neuron SDK release {release!r} is not emulated; choose one of {', '.join(RELEASES)}"
        )
    return text


_ENV_RELEASE = _parse(os.environ.get("NKI_SIM_SDK") or NEWEST)
_current: contextvars.ContextVar[str] = contextvars.ContextVar("nki_sim_sdk", default=_ENV_RELEASE)


def sdk_version() -> str:
    """The emulated Neuron SDK release, e.g. ``"2.29"`` (compare with :func:`at_least`)."""
    return _current.get()


def at_least(release) -> bool:
    """True when the emulated release is ``release`` or newer."""
    return _key(_current.get()) >= _key(_parse(release))


def _key(release: str) -> tuple[int, int]:
    major, minor = release.split(".")
    return int(major), int(minor)


def set_sdk(release) -> str:
    """Emulate ``release`` (``"2.20"`` … ``"2.29"``) in the current context; returns the
    previous release."""
    previous = _current.get()
    _current.set(_parse(release))
    return previous


@contextlib.contextmanager
def sdk(release):
    """``with simulate.sdk("2.24"): ...`` emulates a release inside the block only."""
    token = _current.set(_parse(release))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


def require(name: str) -> None:
    """Raise ``AttributeError`` when API ``name`` is newer than the emulated release."""
    row = API_TABLE.get(name)
    if row is not None and not at_least(row[0]):
        raise AttributeError(
            f"{name} does not exist in Neuron SDK {sdk_version()}: it first appears in SDK "
            f"{row[0]} ({row[1]})"
        )


def require_convention(convention: str) -> None:
    """The return calling convention is a 2.21 feature (a ``TypeError`` before it)."""
    row = API_TABLE["return convention"]
    if convention == "return" and not at_least(row[0]):
        raise TypeError(
            f"a kernel that returns its outputs needs Neuron SDK {row[0]} or later (the "
            f"emulated SDK {sdk_version()} only has output parameters; {row[1]})"
        )


def check_params(api: str, names) -> None:
    """Raise ``TypeError`` for a keyword argument ``api`` does not take in this release."""
    for name in names:
        row = PARAM_TABLE.get((api, name))
        if row is not None and not at_least(row[0]):
            raise TypeError(
                f"{api}() got an unexpected keyword argument '{name}' in Neuron SDK "
                f"{sdk_version()}: it first appears in SDK {row[0]} ({row[1]})"
            )


def check_op(api: str, op_name: str) -> None:
    """Raise ``TypeError`` for an operator ``api`` does not accept yet in this release."""
    row = OP_TABLE.get((api, op_name))
    if row is not None and not at_least(row[0]):
        raise TypeError(
            f"{api} does not support op={op_name} in Neuron SDK {sdk_version()}: "
            f"it first appears in SDK {row[0]} ({row[1]})"
        )


class _GatedModule(types.ModuleType):
    """A module whose attributes in :data:`API_TABLE` vanish under older releases and whose
    functions in :data:`PARAM_TABLE` reject parameters the release does not have."""

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        if name.startswith("_"):
            return value
        prefix = super().__getattribute__("__nki_prefix__")
        qualified = f"{prefix}.{name}"
        if qualified in API_TABLE:
            require(qualified)
        if qualified in _GATED_FUNCTIONS and callable(value):
            return _param_gate(qualified, value)
        return value


_GATED_FUNCTIONS = {api for api, _ in PARAM_TABLE}


@functools.cache
def _param_gate(api, func):
    @functools.wraps(func)
    def gated(*args, **kwargs):
        check_params(api, kwargs)
        return func(*args, **kwargs)

    return gated


def gate_module(module: types.ModuleType, prefix: str) -> None:
    """Make ``module`` (``nl``, ``nisa`` or ``nki``) follow the emulated release."""
    module.__nki_prefix__ = prefix
    module.__class__ = _GatedModule
