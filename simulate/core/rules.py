"""The NKI compilers' rules, as tables and checks both front-ends call.

Front-end-agnostic: this module imports no ``nl``/``nisa`` module, only the error classes.
Every check cites the documentation it enforces (repository ``aws-neuron/aws-neuron-sdk``:
the legacy ``neuronxcc.nki`` docs under ``general/nki/`` at ``8a38e733``, the ``nki`` 0.6
docs under ``nki/`` at ``81ce03ae``) and raises one error naming the rule (the ``err_`` key
of ``api/nki.errors.rst`` where one exists, otherwise a short name and the doc's words), the
instruction and the tile. Checks that differ between the two dialects take ``dialect``
("legacy" or "nki06") and cite each dialect's docs; the nki06 front-end re-raises the
errors as its ``NkiValidationError`` (:func:`simulate.nki06.errors.enforce`).

Engines are named as in the trace: ``dve`` (Vector), ``act`` (Scalar), ``pool`` (GpSimd),
``pe`` (Tensor).
"""

from __future__ import annotations

import sys

from .errors import NKITypeError, NKIValueError

SHARED = "general/nki/api/nki.api.shared.rst@8a38e733"
ISA = "general/nki/api/nki/isa/__init__.py@8a38e733"
LANG = "general/nki/api/nki/language/__init__.py@8a38e733"
PM = "general/nki/programming_model.rst@8a38e733"
KI = "general/nki/nki_known_issues.rst@8a38e733"
ERRORS = "general/nki/api/nki.errors.rst@8a38e733"

SHARED06 = "nki/api/nki.api.shared.rst@81ce03ae"
ISA06 = "nki/api/nki/isa/__init__.py@81ce03ae"
LANG06 = "nki/api/nki/language/__init__.py@81ce03ae"
DIALECTS = ("legacy", "nki06")

ENGINE_NAMES = {"dve": "Vector", "act": "Scalar", "pool": "GpSimd", "pe": "Tensor"}

# The "Legal Reduction ``op``" column of the Supported Math Operators table: the same Y rows
# in both dialects (legacy SHARED L63-L119, 0.6 SHARED06 L73-L135)
LEGAL_REDUCTION_OPS = frozenset(
    {
        "add",
        "subtract",
        "multiply",
        "maximum",
        "minimum",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "logical_and",
        "logical_or",
        "logical_xor",
    }
)
_ALU_TABLE = {"legacy": f"{SHARED}, L63-L119", "nki06": f"{SHARED06}, L73-L135"}

# Supported Activation Functions (the ``op`` of nisa.activation): legacy SHARED L140-L186;
# 0.6 SHARED06 L154-L204 adds prelu and gelu_apprx_sigmoid_dx (not simulated)
_LEGACY_ACTIVATIONS = frozenset(
    {
        "copy",
        "square",
        "sigmoid",
        "relu",
        "gelu",
        "gelu_dx",
        "gelu_apprx_tanh",
        "gelu_apprx_sigmoid",
        "silu",
        "silu_dx",
        "tanh",
        "softplus",
        "mish",
        "erf",
        "erf_dx",
        "exp",
        "log",
        "sin",
        "arctan",
        "sqrt",
        "rsqrt",
        "reciprocal",
        "sign",
        "abs",
    }
)
ACTIVATION_FUNCTIONS = {
    "legacy": _LEGACY_ACTIVATIONS,
    "nki06": _LEGACY_ACTIVATIONS | {"prelu", "gelu_apprx_sigmoid_dx"},
}
_ACTIVATION_TABLE = {"legacy": f"{SHARED}, L140-L186", "nki06": f"{SHARED06}, L154-L204"}

# ALU operators only one dialect's docs list: (dialect, first NeuronCore version)
DIALECT_ALU_OPS = {
    # nki/api/nki.api.shared.rst@81ce03ae, L122 and L124; "Available only on NeuronCore-v4
    # (trn3) and newer" (nki/api/nki/language/__init__.py@81ce03ae, L846 and L890)
    "abs_max": ("nki06", 4),
    "abs_min": ("nki06", 4),
}
_DIALECT_ALU_CITE = {
    "abs_max": f"{SHARED06}, L122; {LANG06}, L838-L879",
    "abs_min": f"{SHARED06}, L124; {LANG06}, L882-L923",
}

# Supported Math Operators for NKI ISA: the "Supported Engine" column
# (nki.api.shared.rst@8a38e733, L63-L119)
ALU_ENGINES: dict[str, frozenset[str]] = {
    **{
        op: frozenset({"dve"})
        for op in (
            "invert",
            "bitwise_and",
            "bitwise_or",
            "bitwise_xor",
            "left_shift",
            "right_shift",
            "subtract",
            "maximum",
            "minimum",
            "equal",
            "not_equal",
            "greater_equal",
            "greater",
            "less_equal",
            "less",
            "logical_not",
            "logical_and",
            "logical_or",
            "logical_xor",
        )
    },
    "add": frozenset({"dve", "pool", "act"}),  # L82
    "multiply": frozenset({"dve", "pool", "act"}),  # L86
    "rsqrt": frozenset({"pool", "act"}),  # L112
    "reciprocal": frozenset({"dve", "act"}),  # L114
    "abs": frozenset({"dve", "act"}),  # L116
    "power": frozenset({"pool"}),  # L118
}
# ALU ops the table does not list (divide, mod, fmod, ...): the Vector engine, where the
# nl.* lowering puts them (the table is the only per-engine statement)
DEFAULT_ALU_ENGINES = frozenset({"dve"})

# "Add and Multiply are supported on Scalar Engine only from NeuronCore-v3" (L121)
SCALAR_ALU_FROM_V3 = frozenset({"add", "multiply"})
# tensor_scalar on the Scalar engine of trn2: only these combinations (isa L1663-L1667)
SCALAR_TENSOR_SCALAR_COMBOS = frozenset({("multiply", "add"), ("multiply",), ("add",)})
# tensor_tensor on GpSimd: power and integer add/subtract/multiply (isa L1767)
GPSIMD_TENSOR_TENSOR_FLOAT = frozenset({"power"})
GPSIMD_TENSOR_TENSOR_INT = frozenset({"add", "subtract", "multiply"})

PSUM_FMAX = 512  # PM L346-L347 (TC#2)
PSUM_PARTITION_BYTES = 2048  # one PSUM bank per partition


def _tile(what) -> str:
    return f" ({what})" if what else ""


def _kernel_line() -> str:
    """``file:line (function)`` of the innermost caller outside the simulator: the kernel
    statement a rule without an instruction name (masks, indexing) is about."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("simulate"):
        frame = frame.f_back
    if frame is None:
        return ""
    code = frame.f_code
    return f" at {code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} ({code.co_name})"


def alu_engines(op: str) -> frozenset[str]:
    return ALU_ENGINES.get(op, DEFAULT_ALU_ENGINES)


def check_alu_engine(api: str, engine: str, ops, nc_version: int, tile="") -> None:
    """Every ALU op of an instruction must run on its engine (shared L63-L119, L121)."""
    for op in ops:
        # general/nki/api/nki.api.shared.rst@8a38e733, L63-L119 (Supported Engine column)
        if engine not in alu_engines(op):
            allowed = "/".join(ENGINE_NAMES[e] for e in sorted(alu_engines(op)))
            raise NKIValueError(
                f"{api}: operator {op} is not supported on the {ENGINE_NAMES[engine]} engine "
                f"(Supported Math Operators table: {allowed} only; {SHARED}, L63-L119)"
                f"{_tile(tile)}",
                "unsupported_engine_for_operator",
            )
        # general/nki/api/nki.api.shared.rst@8a38e733, L121
        if engine == "act" and op in SCALAR_ALU_FROM_V3 and nc_version < 3:
            raise NKIValueError(
                f"{api}: Add and Multiply are supported on Scalar Engine only from "
                f"NeuronCore-v3 ({SHARED}, L121){_tile(tile)}",
                "unsupported_engine_for_operator",
            )


def default_engine(ops, candidates=("dve", "pool", "act")) -> str | None:
    """The engine the compiler would pick for ``engine=unknown``: the first that runs
    every op (None when none does)."""
    for engine in candidates:
        if all(engine in alu_engines(op) for op in ops):
            return engine
    return None


def check_tensor_scalar_engine(
    engine: str, ops, nc_version: int, tile="", dialect="legacy"
) -> None:
    """``nisa.tensor_scalar`` engine rules: GpSimd only for rsqrt; the Scalar engine of
    NeuronCore-v3 only (multiply), (add), (multiply, add). The legacy table also binds each
    op to its engines (and Add/Multiply on Scalar from v3); the 0.6 table has no engine
    column, and the 0.6 front-end puts (multiply, add) on the Scalar engine from v3 only
    (the only target the docs name for it is trn2)."""
    ops = tuple(ops)
    if engine == "pool" and "rsqrt" not in ops:
        cite = f"{ISA06}, L1157" if dialect == "nki06" else f"{ISA}, L1699"
        # general/nki/api/nki/isa/__init__.py@8a38e733, L1699 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L1157
        raise NKIValueError(
            f"nisa.tensor_scalar: runs on the gpsimd engine only for nl.rsqrt (engine=gpsimd "
            f"is only allowed for rsqrt), got op0/op1={'/'.join(ops)} ({cite}){_tile(tile)}",
            "unsupported_engine_for_operator",
        )
    combos_apply = nc_version >= 3 or dialect == "nki06"
    if (
        engine == "act"
        and combos_apply
        and (ops not in SCALAR_TENSOR_SCALAR_COMBOS or nc_version < 3)
    ):
        cite = f"{ISA06}, L1106-L1111" if dialect == "nki06" else f"{ISA}, L1663-L1667"
        # general/nki/api/nki/isa/__init__.py@8a38e733, L1663-L1667 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L1106-L1111
        raise NKIValueError(
            "nisa.tensor_scalar: the Scalar Engine on trn2 only supports op0=multiply, "
            f"op1=add / op0=multiply / op0=add, got {'/'.join(ops)} on NeuronCore-v{nc_version}"
            f" ({cite}){_tile(tile)}",
            "unsupported_engine_for_operator",
        )
    if dialect == "legacy":
        check_alu_engine("nisa.tensor_scalar", engine, ops, nc_version, tile)


def check_tensor_tensor_engine(
    engine: str, op: str, integer: bool, tile="", dialect="legacy"
) -> None:
    """``nisa.tensor_tensor``: Vector runs the Vector ops; GpSimd runs power and integer
    arithmetic (legacy: add/subtract/multiply, isa L1766-L1767; 0.6: any arithmetic op when
    every tile is int32/uint32, isa L1025-L1036)."""
    if engine == "pool":
        integer_op = integer and (dialect == "nki06" or op in GPSIMD_TENSOR_TENSOR_INT)
        if op not in GPSIMD_TENSOR_TENSOR_FLOAT and not integer_op:
            if dialect == "nki06":
                # nki/api/nki/isa/__init__.py@81ce03ae, L1025-L1036
                raise NKIValueError(
                    f"nisa.tensor_tensor: op={op} does not run on the gpsimd engine: it runs "
                    f"nl.power, or integer arithmetic when every tile is int32/uint32 "
                    f"({ISA06}, L1025-L1036){_tile(tile)}",
                    "unsupported_engine_for_operator",
                )
            # general/nki/api/nki/isa/__init__.py@8a38e733, L1766-L1767
            raise NKIValueError(
                f"nisa.tensor_tensor: op={op} does not run on the GpSimd engine: it runs "
                f"``power`` or integer ``add``, ``multiply``, ``subtract`` ({ISA}, L1767)"
                f"{_tile(tile)}",
                "unsupported_engine_for_operator",
            )
        return
    if dialect == "legacy" and engine == "dve" and "dve" not in alu_engines(op):
        # general/nki/api/nki.api.shared.rst@8a38e733, L118
        raise NKIValueError(
            f"nisa.tensor_tensor: operator {op} is not supported on the Vector engine "
            f"({SHARED}, L63-L119){_tile(tile)}",
            "unsupported_engine_for_operator",
        )


def check_gpsimd_memory(api: str, engine: str, memories, tile="", dialect="legacy") -> None:
    """GpSimd cannot read or write PSUM (legacy isa L1392, L1778; 0.6 isa L399, L1038,
    L1914, L2116, L2235)."""
    if engine == "pool" and "psum" in memories:
        if dialect == "nki06":
            # nki/api/nki/isa/__init__.py@81ce03ae, L399, L1038, L1914, L2116, L2235
            raise NKIValueError(
                f"{api} on the gpsimd engine cannot access PSUM{_tile(tile)}: GpSimd Engine "
                f"cannot access PSUM ({ISA06}, L399, L1038, L1914, L2116, L2235)",
                "err_unsupported_memory",
            )
        # general/nki/api/nki/isa/__init__.py@8a38e733, L1392 and L1778
        raise NKITypeError(
            f"{api}: GpSimd Engine cannot access PSUM, so its input or output tiles cannot be "
            f"in PSUM ({ISA}, L1392, L1778){_tile(tile)}",
            "err_unsupported_memory",
        )


def check_reduce_op(api: str, op: str, dialect: str, tile="") -> None:
    """A reduction's ``op`` is one the ALU table marks as a legal reduction."""
    if op not in LEGAL_REDUCTION_OPS:
        # general/nki/api/nki.api.shared.rst@8a38e733, L63-L119 /
        # nki/api/nki.api.shared.rst@81ce03ae, L73-L135 (Legal Reduction ``op`` column)
        raise NKIValueError(
            f"{api}: op={op} is not a legal reduction operator (the Legal Reduction op column "
            f"of the Supported Math Operators table: {', '.join(sorted(LEGAL_REDUCTION_OPS))}; "
            f"{_ALU_TABLE[dialect]}){_tile(tile)}",
            "err_unsupported_reduce_op",
        )


def check_activation_op(api: str, op: str, dialect: str, tile="") -> None:
    """``nisa.activation``'s ``op`` is in the dialect's Supported Activation Functions."""
    if op not in ACTIVATION_FUNCTIONS[dialect]:
        # general/nki/api/nki.api.shared.rst@8a38e733, L140-L186 /
        # nki/api/nki.api.shared.rst@81ce03ae, L154-L204
        raise NKIValueError(
            f"{api}: op={op} is not an activation function of the Scalar engine (Supported "
            f"Activation Functions table, {_ACTIVATION_TABLE[dialect]}){_tile(tile)}",
            "err_unsupported_activation",
        )


def check_alu_op(api: str, op: str, dialect: str, nc_version: int, tile="") -> None:
    """An ALU operator only one dialect's docs list exists in that dialect only, from the
    NeuronCore generation they name."""
    found = DIALECT_ALU_OPS.get(op)
    if found is None:
        return
    owner, version = found
    if dialect != owner:
        # general/nki/api/nki.api.shared.rst@8a38e733, L63-L119 has no such operator
        raise NKIValueError(
            f"{api}: op={op} is not an operator of this NKI dialect (the Supported Math "
            f"Operators table, {_ALU_TABLE[dialect]}, does not list it; it is "
            f"nki.language.{op} of NKI 0.6, {_DIALECT_ALU_CITE[op]}){_tile(tile)}",
            "err_unsupported_operator",
        )
    if nc_version < version:
        # nki/api/nki/language/__init__.py@81ce03ae, L846 and L890
        raise NKIValueError(
            f"{api}: op={op} is available only on NeuronCore-v{version} (trn3) and newer, "
            f"this target is NeuronCore-v{nc_version} ({_DIALECT_ALU_CITE[op]}){_tile(tile)}",
            "err_unsupported_operator",
        )


def check_psum_tile(free_elements: int, itemsize: int, what: str) -> None:
    """A PSUM tile holds at most psum_fmax = 512 elements per partition (TC#2) in one 2 KiB
    bank."""
    if free_elements > PSUM_FMAX:
        # general/nki/programming_model.rst@8a38e733, L346-L347 and L354-L357
        raise NKIValueError(
            f"{what}: for tiles in PSUM, the F dimension size must not exceed "
            f"nki.tile_size.psum_fmax == {PSUM_FMAX} elements, got {free_elements} "
            f"({PM}, L346-L347, [TC#2])",
            "err_size_of_dimension_exceed_arch_limit",
        )
    if free_elements * itemsize > PSUM_PARTITION_BYTES:
        raise NKIValueError(
            f"{what}: a PSUM tile holds at most {PSUM_PARTITION_BYTES} bytes per partition "
            f"(one bank), got {free_elements * itemsize} ({PM}, L346-L347)",
            "err_size_of_dimension_exceed_arch_limit",
        )


def check_mask_comparison_axes(axes_per_comparison, what="mask") -> None:
    """Each comparison of a mask restricts one axis of the tile: the valid points form a box
    (shared L201-L207). ``axes_per_comparison``: for each comparison, the tile axes its
    index expression varies along."""
    for axes in axes_per_comparison:
        if len(axes) > 1:
            # general/nki/api/nki.api.shared.rst@8a38e733, L206-L207
            raise NKIValueError(
                f"{what}{_kernel_line()}: each comparison expression should indicate which "
                f"range of indices along one of the input tile axes should be valid; this one "
                f"mixes axes {sorted(axes)} (a non-box, 'staircase' mask; {SHARED}, L201-L207)",
                "err_unsupported_expression_in_mask",
            )


def check_partition_step(step: int, what: str) -> None:
    """Strided indexing is supported along the free dimension only (PM L536-L540)."""
    if step != 1:
        # general/nki/programming_model.rst@8a38e733, L536-L540
        raise NKIValueError(
            f"{what}{_kernel_line()}: partition index with stride {step}: flexible (strided) "
            f"indexing is not supported along the partition dimension ({PM}, L536-L540)",
            "partition_stride",
        )


def check_dst_rmw(op: str | None, dst_memory: str, tile="") -> None:
    """``dma_copy(dst_rmw_op=)``: only np.add (isa L414), at an HBM destination."""
    if op is None:
        return
    if op != "add":
        # general/nki/api/nki/isa/__init__.py@8a38e733, L413-L414
        raise NKIValueError(
            f"nisa.dma_copy: dst_rmw_op={op}: currently only np.add is supported ({ISA}, "
            f"L414){_tile(tile)}",
            "dst_rmw_op",
        )
    if dst_memory != "hbm":
        # general/nki/api/nki/isa/__init__.py@8a38e733, L405-L416: the read-modify-write is
        # documented only with its example, an indirect HBM store
        # (general/nki/test/test_nki_isa_dma_copy.py@8a38e733, L146); strict reading
        raise NKITypeError(
            "nisa.dma_copy: dst_rmw_op is documented only for a destination in device memory "
            f"(HBM), got a destination in {dst_memory.upper()} ({ISA}, L405-L416){_tile(tile)}",
            "err_unsupported_memory",
        )


def check_bn_stats_mask(restricted_axes, tile="") -> None:
    """bn_stats: no mask on the reduce (free) dimension (known issues L41-L42)."""
    if any(axis >= 1 for axis in restricted_axes):
        # general/nki/nki_known_issues.rst@8a38e733, L41-L42
        raise NKIValueError(
            "nisa.bn_stats does not support mask on the reduce dimension: the mask sent to "
            f"bn_stats could not contain any indices from the reduction dimension ({KI}, "
            f"L41-L42){_tile(tile)}",
            "bn_stats_mask",
        )


def check_atomic_rmw(op: str, indirect: bool, tile="") -> None:
    """nl.atomic_rmw: op only np.add, dst with indirect indexing (language L345-L347)."""
    if op != "add":
        # general/nki/api/nki/language/__init__.py@8a38e733, L347
        raise NKIValueError(
            f"nl.atomic_rmw: op={op}: atomic operation only supports np.add currently ({LANG}, "
            f"L347){_tile(tile)}",
            "atomic_rmw_op",
        )
    if not indirect:
        # general/nki/api/nki/language/__init__.py@8a38e733, L345
        raise NKIValueError(
            "nl.atomic_rmw: dst is an HBM tensor with subscripts that only supports indirect "
            f"dynamic indexing currently ({LANG}, L345){_tile(tile)}",
            "atomic_rmw_dst",
        )


def check_gather_indices(dtype_name: str, tile="") -> None:
    """nl.gather_flattened: indices are uint32 (language L668)."""
    if dtype_name != "uint32":
        # general/nki/api/nki/language/__init__.py@8a38e733, L668
        raise NKITypeError(
            f"nl.gather_flattened: the indices tensor must contain uint32 values, got "
            f"{dtype_name} ({LANG}, L668){_tile(tile)}",
            "gather_indices_dtype",
        )


def check_allocated_init_value(api: str, allocated: bool) -> None:
    """No init value for SBUF/PSUM tensors of allocated kernels (errors L685-L695)."""
    if allocated:
        # general/nki/api/nki.errors.rst@8a38e733, L685-L695
        raise NKIValueError(
            f"{api}: Creating SBUF/PSUM tensor with init value is not supported in allocated "
            f"NKI kernels ({ERRORS}, L685-L695)",
            "err_tensor_creation_on_scratchpad_with_init_value_not_supported",
        )


def check_allocated_bias(api: str, allocated: bool, has_bias: bool) -> None:
    """Activations of allocated kernels name their bias tensor (errors L143-L158)."""
    if allocated and not has_bias:
        # general/nki/api/nki.errors.rst@8a38e733, L143-L158
        raise NKIValueError(
            f"{api}: Bias tensor of an activation op must be specified in allocated NKI "
            f"kernels (nl.* functions that map to activation cannot; {ERRORS}, L143-L158)",
            "err_bias_tensor_must_be_specified_in_allocation",
        )


def check_allocated_hbm(scratch: list[str], unreturned: list[str]) -> None:
    """An allocated kernel declares HBM tensors only as its outputs: "All tensors declared
    with buffer=nl.shared_hbm must be returned as the result of the kernel. Tensors declared
    with buffer=nl.hbm or buffer=nl.private_hbm are not allowed" (known issues L47-L55;
    direct allocation guide L440-L446)."""
    if scratch or unreturned:
        what = ", ".join(
            [f"`{n}` (private_hbm)" for n in scratch]
            + [f"`{n}` (shared_hbm, not returned)" for n in unreturned]
        )
        raise NKIValueError(
            f"Non IO HBM tensor is not supported in allocated NKI kernel: {what} ({KI}, "
            "L47-L55; general/nki/nki_direct_allocation_guide.rst@8a38e733, L440-L446)",
            "err_non_io_hbm_tensor_in_allocated_kernel",
        )


def check_allocated_transpose(api: str, allocated: bool) -> None:
    """No Tensor-engine transpose in allocated kernels (errors L751-L773)."""
    if allocated:
        # general/nki/api/nki.errors.rst@8a38e733, L751-L773
        raise NKIValueError(
            f"{api}: transpose on the Tensor engine is not allowed in allocated NKI kernels: "
            f"call nisa.nc_matmul with your own identity matrix, or nc_transpose on the Vector "
            f"engine ({ERRORS}, L751-L773)",
            "err_transpose_on_tensor_engine_not_allowed_in_allocated_kernel",
        )


def check_shared_hbm_blocks(blocks, name: str) -> None:
    """No shared_hbm tensor under an if/else or in a while loop of the kernel (NKI loops are
    checked by the front-end; a Python ``for`` over a sequence is unrolled while tracing and
    not counted)."""
    conditional = [block for block in blocks if block[0] in ("if", "else", "while")]
    if conditional:
        kind, line = conditional[-1]
        # general/nki/api/nki.errors.rst@8a38e733, L586-L590
        raise NKIValueError(
            f"shared_hbm tensor `{name}` can only be created in top level kernel scope, not "
            f"inside the {kind} block at line {line}: creating shared_hbm tensors inside a "
            f"loop, under if condition or inside another function called by the top-level nki "
            f"kernel is not supported ({ERRORS}, L581-L615)",
            "err_shared_hbm_must_in_kernel_level",
        )


def check_while_entry(entered: bool, line: int, runtime: bool = False) -> None:
    """Only do-while loops: the first iteration is always executed (errors L902-L947). A
    condition computed from a run-time scalar (``scalar(tile) < 10``) is checked before the
    first iteration even when it holds: the manual's unsupported example (L917-L924)."""
    if runtime:
        raise NKIValueError(
            f"while loop at line {line}: Traditional while loops are not supported - use "
            "do-while pattern instead (the condition is a run-time value on entry; enter with "
            f"cond = scalar(True) and update cond at the end of the body; {ERRORS}, L902-L947)",
            "err_while_loop_requires_unconditional_entry",
        )
    if not entered:
        # general/nki/api/nki.errors.rst@8a38e733, L902-L947
        raise NKIValueError(
            f"while loop at line {line}: Traditional while loops are not supported - use "
            f"do-while pattern instead (the condition is false on entry; {ERRORS}, L902-L947)",
            "err_while_loop_requires_unconditional_entry",
        )


def check_affine_select_pred(comparisons: int, tile="") -> None:
    """affine_select: pred is one affine comparison, not masks combined with & (isa L268)."""
    if comparisons > 1:
        # general/nki/api/nki/isa/__init__.py@8a38e733, L268
        raise NKIValueError(
            "nisa.affine_select: pred can't be multiple masks combined using logical operators "
            f"such as & and | ({ISA}, L268); use nl.where for a complex predicate{_tile(tile)}",
            "err_unsupported_expression_in_mask",
        )


BN_STATS_FMAX = 512  # nl.tile_size.bn_stats_fmax
GEMM_STATIONARY_FMAX = 128  # nl.tile_size.gemm_stationary_fmax
GEMM_MOVING_FMAX = 512  # nl.tile_size.gemm_moving_fmax: one PSUM bank of float32


def check_bn_stats_free(api: str, free: int, dialect: str, tile="") -> None:
    """``bn_stats`` reads at most bn_stats_fmax = 512 elements per partition."""
    if free > BN_STATS_FMAX:
        cite = f"{ISA06}, L1961" if dialect == "nki06" else f"{ISA}, L370"
        # general/nki/api/nki/isa/__init__.py@8a38e733, L370 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L1961
        raise NKIValueError(
            f"{api} data has {free} elements per partition, exceeds maximum {BN_STATS_FMAX} "
            f"(nl.tile_size.bn_stats_fmax; {cite}){_tile(tile)}",
            "err_size_of_dimension_exceed_arch_limit",
        )


def moving_fmax(dialect: str, nc_version: int, dst_dtype: str = "float32") -> int:
    """The largest ``nc_matmul`` moving free size: one PSUM bank of float32 (512); the 0.6
    docs let NeuronCore-v4 stream 8 banks (4096 float32 / 8192 bfloat16 results)."""
    if dialect == "nki06" and nc_version >= 4:
        # nki/api/nki/isa/__init__.py@81ce03ae, L610-L614
        return 8192 if dst_dtype == "bfloat16" else 4096
    return GEMM_MOVING_FMAX


def check_matmul_free_sizes(
    api: str,
    stationary_free: int,
    moving_free: int,
    dialect: str,
    nc_version: int,
    dst_dtype: str = "float32",
    tile="",
) -> None:
    """``nc_matmul``: stationary free size <= gemm_stationary_fmax, moving free size <=
    :func:`moving_fmax` (legacy nl.tile_size, language L144-L150; 0.6 isa L606-L614)."""
    cite = f"{ISA06}, L606-L614" if dialect == "nki06" else f"{LANG}, L144-L150"
    if stationary_free > GEMM_STATIONARY_FMAX:
        # general/nki/api/nki/language/__init__.py@8a38e733, L149-L150 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L608-L609
        raise NKIValueError(
            f"{api}: stationary free size {stationary_free} exceeds maximum "
            f"{GEMM_STATIONARY_FMAX} (nl.tile_size.gemm_stationary_fmax; {cite}){_tile(tile)}",
            "err_size_of_dimension_exceed_arch_limit",
        )
    limit = moving_fmax(dialect, nc_version, dst_dtype)
    if moving_free > limit:
        # general/nki/api/nki/language/__init__.py@8a38e733, L144-L145 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L610-L614
        raise NKIValueError(
            f"{api}: moving free size {moving_free} exceeds maximum {limit} on NeuronCore-"
            f"v{nc_version} (nl.tile_size.gemm_moving_fmax; {cite}){_tile(tile)}",
            "err_size_of_dimension_exceed_arch_limit",
        )


# nc_transpose: the Tensor engine takes up to 128 x 128, the Vector engine up to 32 x 32
TRANSPOSE_LIMITS = {"pe": 128, "dve": 32}


def check_legacy_matmul_result(api: str, dst_dtype: str, tile="") -> None:
    """Legacy ``nc_matmul`` (``is_transpose`` included) writes float32: "The matmul
    accumulation and results are always in float32" (legacy isa L876), so its result may be
    assigned (``psum[...] = nc_matmul(...)``) or accumulated (``+=``) only into a float32
    PSUM tile; AWS's legacy kernels transpose into float32 PSUM and cast on the copy out."""
    if dst_dtype != "float32":
        # general/nki/api/nki/isa/__init__.py@8a38e733, L876
        raise NKITypeError(
            f'{api}: the result of nc_matmul is float32 in this dialect ("The matmul '
            f'accumulation and results are always in float32", {ISA}, L876); it cannot be '
            f"written into a {dst_dtype} PSUM tile: allocate the PSUM tile as float32 and "
            f"cast on the copy to SBUF{_tile(tile)}",
            "err_matmul_dtype",
        )


def check_legacy_reduce_axes(api: str, axes, ndim: int, tile="") -> None:
    """Legacy ``nisa.tensor_reduce`` reduces every free axis of its tile: the docs require
    both that "the reduction axes must contain axis 1" (legacy isa L1586) and that they be
    "the last contiguous dim(s) of the tile: [1], [1,2], [1,2,3], [1,2,3,4]" (L1619), and the
    only axes that meet both readings of a tile of any rank are 1 … rank − 1. A reduction
    over inner axes only is ``nl.sum`` / ``nl.max`` over an indexed view, as AWS's legacy
    pooling example does (general/nki/examples/average_pool2d/average_pool2d_nki_kernels.py@
    8a38e733, L49-L50, ``axis=[2,4]`` of a 5-D view)."""
    wanted = tuple(range(1, ndim))
    if tuple(axes) != wanted or len(wanted) > 4:
        # general/nki/api/nki/isa/__init__.py@8a38e733, L1584-L1587 and L1619
        raise NKIValueError(
            f"{api}: axis={list(axes)} on a rank-{ndim} tile: the reduction axes must contain "
            f"axis 1 and be the last contiguous dim(s) of the tile ([1], [1,2], [1,2,3], "
            f"[1,2,3,4]; {ISA}, L1584-L1587, L1619), i.e. every free axis, at most 4; reduce "
            f"inner axes with nl.sum / nl.max over an indexed view{_tile(tile)}",
            "err_reduce_axis",
        )


def check_transpose_size(
    api: str, engine: str, partitions: int, free: int, dialect: str, tile=""
) -> None:
    """``nc_transpose`` input at most 128 x 128 (Tensor) or 32 x 32 (Vector; another engine
    is held to the Tensor engine's limit)."""
    limit = TRANSPOSE_LIMITS.get(engine, TRANSPOSE_LIMITS["pe"])
    if partitions > limit or free > limit:
        cite = f"{ISA06}, L858-L859" if dialect == "nki06" else f"{ISA}, L1027-L1028"
        # general/nki/api/nki/isa/__init__.py@8a38e733, L1027-L1028 /
        # nki/api/nki/isa/__init__.py@81ce03ae, L858-L859
        raise NKIValueError(
            f"{api}: data ({partitions} x {free}) exceeds {limit} x {limit} on the "
            f"{ENGINE_NAMES.get(engine, engine).lower()} engine ({cite}){_tile(tile)}",
            "err_size_of_dimension_exceed_arch_limit",
        )


# nc_matmul input dtypes: legacy isa L874-L875; 0.6 isa L576-L579 (float8_e4m3fn from
# NeuronCore-v4, the only 0.6-only entry)
MATMUL_INPUT_DTYPES = frozenset(
    {"float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32"}
)
MATMUL_V4_INPUT_DTYPES = frozenset({"float8_e4m3fn"})


def check_matmul_inputs(
    api: str, stationary: str, moving: str, dialect: str, nc_version: int
) -> None:
    """``nc_matmul`` input dtypes (both dialects); the 0.6 docs add the pairing rules:
    float32/tfloat32 pair only with float32/tfloat32, float8_e4m3 and float8_e4m3fn do not
    mix (0.6 isa L578-L581)."""
    cite = f"{ISA06}, L576-L581" if dialect == "nki06" else f"{ISA}, L874-L875"
    for argname, dtype in (("stationary", stationary), ("moving", moving)):
        if dtype in MATMUL_V4_INPUT_DTYPES and dialect == "nki06":
            if nc_version < 4:
                # nki/api/nki/isa/__init__.py@81ce03ae, L578-L579
                raise NKITypeError(
                    f"{api} {argname} float8_e4m3fn needs NeuronCore-v4 ({cite})",
                    "err_matmul_dtype",
                )
            continue
        if dtype not in MATMUL_INPUT_DTYPES:
            # general/nki/api/nki/isa/__init__.py@8a38e733, L874-L875 /
            # nki/api/nki/isa/__init__.py@81ce03ae, L576-L579
            raise NKITypeError(
                f"{api} {argname} dtype {dtype} is not a matmul input type: nc_matmul takes "
                f"fp8/bf16/fp16/tf32/fp32 inputs ({cite})",
                "err_matmul_dtype",
            )
    if dialect != "nki06":
        return
    kinds = {stationary, moving}
    wide = {"float32", "tfloat32"}
    if kinds & wide and not kinds <= wide:
        # nki/api/nki/isa/__init__.py@81ce03ae, L580-L581
        raise NKITypeError(
            f"{api} float32/tfloat32 inputs pair only with float32/tfloat32, got {stationary} "
            f"and {moving} ({cite})",
            "err_matmul_dtype",
        )
    if {"float8_e4m3", "float8_e4m3fn"} <= kinds:
        # nki/api/nki/isa/__init__.py@81ce03ae, L579
        raise NKITypeError(
            f"{api} cannot mix float8_e4m3 and float8_e4m3fn ({cite})", "err_matmul_dtype"
        )
