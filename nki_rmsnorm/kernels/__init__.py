"""The NKI kernels, in the dialect :mod:`nki_rmsnorm.dialect` picks for the target.

Each kernel exists once per dialect, under the same module and function name:
:mod:`nki_rmsnorm.kernels.legacy` (``neuronxcc.nki``) and :mod:`nki_rmsnorm.kernels.nki06`
(``nki`` 0.6). ``nki_rmsnorm.kernels.rmsnorm_fwd`` etc. resolve at each attribute access
(:func:`kernel`), so the target named at launch time decides. In the simulator both dialects
run on that target: the 0.6 front-end reads ``NEURON_PLATFORM_TARGET_OVERRIDE`` itself, and a
legacy kernel gets it as its ``platform_target`` (the legacy ``nki.jit`` option).

Two calling conventions over the same code:

* return convention (SDK ≥ 2.21; what ``nki.jit`` kernels called directly use):
  ``rmsnorm_fwd``, ``rmsnorm_add_fwd`` (fused residual add), ``rmsnorm_qk_fwd`` (the query
  and key norms in one launch) and ``rmsnorm_bwd`` create their HBM outputs and return them;
* output-parameter convention (``torch_neuronx.nki_jit``, ``jax_neuronx.nki_call``):
  ``rmsnorm_fwd_out``, ``rmsnorm_add_fwd_out`` and ``rmsnorm_bwd_out`` write the caller's
  preallocated outputs in place and return nothing; an output's dtype is its buffer's.

The NumPy launchers in :mod:`nki_rmsnorm.ops` validate, reshape and call them.
"""

from __future__ import annotations

import importlib

from nki_rmsnorm import dialect

#: Entry point → the module (same name in both dialects) that defines it.
MODULES = {
    "rmsnorm_fwd": "rmsnorm_fwd",
    "rmsnorm_fwd_out": "rmsnorm_fwd",
    "rmsnorm_add_fwd": "rmsnorm_fwd",
    "rmsnorm_add_fwd_out": "rmsnorm_fwd",
    "rmsnorm_qk_fwd": "rmsnorm_fwd",
    "rmsnorm_fwd_transposed": "rmsnorm_fwd",
    "rmsnorm_add_fwd_transposed": "rmsnorm_fwd",
    "rmsnorm_bwd": "rmsnorm_bwd",
    "rmsnorm_bwd_out": "rmsnorm_bwd",
    "rmsnorm_quant": "rmsnorm_quant",
    "rmsnorm_mx_quant": "rmsnorm_mx_quant",
}

#: Entry points only the 0.6 dialect has: MX quantization needs NeuronCore-v4 (trn3), which
#: runs NKI 0.6 only, and the legacy dtype table has no packed x4 or e8m0 types
#: (aws-neuron-sdk@8a38e733 general/nki/api/nki.api.shared.rst).
#: The transposed-output forward writes y through a raw HBM access pattern (``.ap``), an
#: NKI 0.6 tensor method.
NKI06_ONLY = ("rmsnorm_mx_quant", "rmsnorm_fwd_transposed", "rmsnorm_add_fwd_transposed")

__all__ = [*MODULES, "NKI06_ONLY", "available", "kernel", "nki_dtype"]


def kernel(name: str, dialect_name: str | None = None):
    """Entry point ``name`` in ``dialect_name`` (default: :func:`nki_rmsnorm.dialect.current`).
    ``NotImplementedError`` when that dialect does not have it yet."""
    if name not in MODULES:
        raise ValueError(f"name must be one of {tuple(MODULES)}, got {name!r}")
    dialect.check_launch()
    chosen = dialect.current() if dialect_name is None else dialect_name
    if chosen not in dialect.DIALECTS:
        raise ValueError(f"dialect_name must be one of {dialect.DIALECTS}, got {chosen!r}")
    if chosen == dialect.LEGACY:
        from nki_rmsnorm.nki import check_sdk

        check_sdk()
    module_name = f"{__name__}.{chosen}.{MODULES[name]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        module = None
    if module is None or not hasattr(module, name):
        raise NotImplementedError(
            f"{name} is not written in the {chosen!r} NKI dialect yet; it has "
            f"{available(chosen)} (the dialect follows the target, "
            f"{dialect.TARGET_ENV_VAR}; in the simulator {dialect.ENV_VAR} chooses it on "
            "trn2/trn3)"
        )
    return _on_target(getattr(module, name), chosen)


def _on_target(entry_point, dialect_name: str):
    """A simulated legacy kernel bound to the target ``NEURON_PLATFORM_TARGET_OVERRIDE``
    names (its ``platform_target``); anything else as it is (the 0.6 front-end and the real
    compilers read the target themselves)."""
    named = dialect.target()
    if dialect_name != dialect.LEGACY or named is None:
        return entry_point
    from nki_rmsnorm.nki import SIMULATED, nki

    return nki.jit(entry_point, platform_target=named) if SIMULATED else entry_point


def nki_dtype(name: str | None, dialect_name: str):
    """The NKI dtype called ``name`` ("float32", "bfloat16" ...) in ``dialect_name``'s
    ``nki.language``, as a kernel's dtype argument takes it (None stays None)."""
    if name is None:
        return None
    if dialect_name == dialect.NKI06:
        from nki_rmsnorm.kernels.nki06._nki import nl
    else:
        from nki_rmsnorm.nki import nl
    return getattr(nl, name)


def available(dialect_name: str) -> tuple[str, ...]:
    """The entry points dialect ``dialect_name`` has."""
    found = []
    for name, module in MODULES.items():
        try:
            found_module = importlib.import_module(f"{__name__}.{dialect_name}.{module}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{dialect_name}.{module}":
                raise
            continue
        if hasattr(found_module, name):
            found.append(name)
    return tuple(found)


def __getattr__(name: str):
    if name in MODULES:
        return kernel(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
