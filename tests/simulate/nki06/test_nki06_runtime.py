"""nki 0.6 front-end: entry points (``nki.jit``, ``nki.simulate``, ``kernel[lnc]``), LNC=2
with ``shared_hbm``, ``program_id``, ``sendrecv`` and ``core_barrier``, calling conventions,
registers and loops, ``install()``, and the trace the cost model reads."""

from __future__ import annotations

import sys
import types
import warnings

import numpy as np
import pytest

import simulate
import simulate.nki06 as nki
from simulate.nki06 import context
from simulate.nki06 import isa as nisa
from simulate.nki06 import language as nl
from simulate.nki06 import typing as nt
from simulate.nki06.errors import NkiDeadlockError


@pytest.fixture(autouse=True)
def _trn2(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)


def double(x):
    """A kernel: 2 * x into a shared_hbm output."""
    t = nl.load(x)
    o = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nl.store(o, value=nl.multiply(t, 2.0))
    return o


def test_jit_forms(rng):
    x = rng.standard_normal((4, 4)).astype(np.float32)
    for kernel in (nki.jit(double), nki.jit()(double), nki.jit(nki.jit(double))):
        np.testing.assert_array_equal(kernel(x), 2 * x)
    np.testing.assert_array_equal(nki.simulate(double)(x), 2 * x)
    with pytest.warns(DeprecationWarning, match="mode"):
        nki.jit(double, mode="jax")
    with pytest.raises(TypeError, match="platform_target"):
        nki.jit(double, platform_target="trn2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        nki.jit(double, foo=1)


def test_kernel_without_arguments_is_a_type_error():
    with pytest.raises(TypeError, match="no arguments"):
        nki.jit(double)()


def test_decorated_sub_kernel_runs_inside_its_caller(rng):
    """The migration guide has the decorator come off sub-kernels (nki/migration/index.rst
    L1152-1165), AWS's moe_cte entry keeps it on its jitted sub-kernels: accepted, see
    docs/aws_code_vs_docs.md and test_nki06_sub_kernels.py."""
    inner = nki.jit(double)

    def outer(x):
        return inner(x)

    x = rng.standard_normal((2, 2)).astype(np.float32)
    np.testing.assert_array_equal(nki.simulate(outer)(x), 2 * x)


def test_nki_calls_outside_a_kernel_are_errors():
    with pytest.raises(RuntimeError, match="inside an NKI kernel"):
        nl.ndarray((2, 2), nl.float32)


def test_list_arguments_are_rejected_tuples_pass(rng):
    def kernel(x, sizes):
        assert sizes == (1, 2)
        return double(x)

    x = rng.standard_normal((2, 2)).astype(np.float32)
    nki.simulate(kernel)(x, (1, 2))
    with pytest.raises(TypeError, match="list"):
        nki.simulate(kernel)(x, [1, 2])


def test_outputs_must_be_shared_hbm(rng):
    def kernel(x, buffer):
        o = nl.ndarray(x.shape, x.dtype, buffer=buffer)
        nl.store(o, value=nl.load(x))
        return o

    x = rng.standard_normal((2, 2)).astype(np.float32)
    nki.simulate(kernel)(x, nl.shared_hbm)
    with pytest.raises(ValueError, match="shared_hbm"):
        nki.simulate(kernel)(x, nl.hbm)


@pytest.mark.parametrize("lnc", [1, 2])
def test_a_returned_list_comes_back_as_a_list_of_arrays(rng, lnc):
    """Each NkiTensor result is converted (nki_simulator.rst L204), in a list as in a tuple:
    AWS's mlp entry returns [out] or [out, fused_add] (core/mlp/mlp.py@ddbca35 L183-184)."""

    def kernel(x, buffer):
        first = nl.ndarray(x.shape, x.dtype, buffer=buffer)
        second = nl.ndarray(x.shape, x.dtype, buffer=buffer)
        nl.store(first, value=nl.load(x))
        nl.store(second, value=nl.multiply(nl.load(x), 2.0))
        return [first, second]

    x = rng.standard_normal((2, 2)).astype(np.float32)
    launch = nki.jit(kernel)
    result = (launch[2] if lnc == 2 else launch)(x, nl.shared_hbm)
    assert isinstance(result, list) and all(isinstance(r, np.ndarray) for r in result)
    np.testing.assert_array_equal(result[0], x)
    np.testing.assert_array_equal(result[1], 2 * x)
    with pytest.raises(ValueError, match="shared_hbm"):
        nki.simulate(kernel)(x, nl.hbm)


def test_written_inputs_are_copied_back(rng):
    def kernel(x, y):
        nl.store(y, value=nl.multiply(nl.load(x), 3.0))

    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = np.full_like(x, np.nan)
    assert nki.simulate(kernel)(x, y) is None
    np.testing.assert_array_equal(y, 3 * x)


def test_typing_annotation_is_checked(rng):
    def kernel(x: nt.tensor[4, 4]):
        return double(x)

    nki.simulate(kernel)(rng.standard_normal((4, 4)).astype(np.float32))
    with pytest.raises(ValueError, match=r"declares nt.tensor\[4, 4\]"):
        nki.simulate(kernel)(rng.standard_normal((4, 5)).astype(np.float32))


def test_default_target_is_trn3_and_override_applies(monkeypatch):
    versions = []

    def kernel(x):
        versions.append(nisa.get_nc_version())

    monkeypatch.delenv("NEURON_PLATFORM_TARGET_OVERRIDE")
    nki.simulate(kernel)(np.zeros(1, np.float32))
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "gen2")
    with pytest.raises(ValueError, match=r"NKI 0.6 does not run on trn1.*nki_faq.rst L23-27"):
        nki.simulate(kernel)(np.zeros(1, np.float32))
    monkeypatch.setattr(context, "REJECT_NEURONCORE_V2", False)  # the gate's one switch
    nki.simulate(kernel)(np.zeros(1, np.float32))
    assert versions == [nisa.nc_version.gen4, nisa.nc_version.gen2]
    assert versions[0] >= nisa.nc_version.gen3


# --- LNC ---
def rows_split(x):
    """Each physical core doubles its half of the rows into one shared output."""
    rows = x.shape[0] // nl.num_programs()
    r0 = nl.program_id(0) * rows
    o = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.load(x[r0 : r0 + rows])
    nl.store(o[r0 : r0 + rows], value=nl.multiply(t, 2.0))
    return o


def test_lnc2_splits_rows_over_shared_hbm(rng):
    x = rng.standard_normal((128, 64)).astype(np.float32)
    kernel = nki.jit(rows_split)
    np.testing.assert_array_equal(kernel[2](x), 2 * x)
    np.testing.assert_array_equal(nki.simulate(kernel[2])(x), 2 * x)
    np.testing.assert_array_equal(kernel[1](x), 2 * x)
    programs = {inst.program for inst in nki.last_trace()}
    assert programs == {(0,)}
    kernel[2](x)
    assert {inst.program for inst in nki.last_trace()} == {(0,), (1,)}


def test_program_ids_and_grid_rank():
    seen = []

    def kernel(x):
        seen.append((nl.program_id(0), nl.num_programs(), nl.program_ndim()))

    nki.simulate(kernel)(np.zeros(1, np.float32))
    nki.jit(kernel)[1](np.zeros(1, np.float32))
    nki.jit(kernel)[2](np.zeros(1, np.float32))
    assert seen[:2] == [(0, 1, 0), (0, 1, 1)]
    assert sorted(seen[2:]) == [(0, 2, 1), (1, 2, 1)]


def test_launch_degree_rules(monkeypatch):
    kernel = nki.jit(double)
    for bad in (3, (1, 2), 0):
        with pytest.raises(ValueError, match="LNC degree|one int"):
            kernel[bad]
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(ValueError, match="NEURON_LOGICAL_NC_CONFIG"):
        kernel[2](np.zeros((2, 2), np.float32))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    monkeypatch.setattr(context, "REJECT_NEURONCORE_V2", False)  # the LNC rule behind the gate
    with pytest.raises(ValueError, match="LNC=2 needs trn2 or trn3"):
        kernel[2](np.zeros((2, 2), np.float32))


def swap_partial_sums(x):
    """Each core sums the squares of its half of the columns; sendrecv swaps the partial
    sums so that both cores hold the full sum and store their half of the rows."""
    pid = nl.program_id(0)
    half = x.shape[1] // 2
    t = nl.load(x[:, pid * half : (pid + 1) * half])
    sq = nl.ndarray(t.shape, nl.float32)
    mine = nl.ndarray((x.shape[0], 1), nl.float32)
    nisa.activation_reduce(dst=sq, op=nl.square, data=t, reduce_op=nl.add, reduce_res=mine)
    theirs = nl.ndarray((x.shape[0], 1), nl.float32)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    total = nl.ndarray((x.shape[0], 1), nl.float32)
    nisa.tensor_tensor(dst=total, data1=mine, data2=theirs, op=nl.add)
    o = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
    rows = x.shape[0] // 2
    nisa.dma_copy(dst=o[pid * rows : (pid + 1) * rows], src=total[pid * rows : (pid + 1) * rows])
    nisa.core_barrier(o, (0, 1))
    return o


def test_sendrecv_swaps_partial_sums_between_the_cores(rng):
    x = rng.standard_normal((64, 40)).astype(np.float32)
    result = nki.jit(swap_partial_sums)[2](x)
    np.testing.assert_allclose(result[:, 0], (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_sendrecv_needs_lnc2(rng):
    with pytest.raises(AssertionError, match="needs an LNC=2 launch"):
        nki.jit(swap_partial_sums)[1](rng.standard_normal((4, 4)).astype(np.float32))


def test_divergent_rendezvous_is_a_deadlock_error():
    def kernel(x):
        t = nl.ndarray((2, 1), nl.float32)
        nisa.memset(dst=t, value=0.0)
        if nl.program_id(0) == 0:
            nisa.sendrecv(src=t, dst=t, send_to_rank=1, recv_from_rank=1, pipe_id=0)

    with pytest.raises(NkiDeadlockError, match="sendrecv"):
        nki.jit(kernel)[2](np.zeros(1, np.float32))


def test_lnc2_error_in_one_program_is_raised(rng):
    def kernel(x):
        if nl.program_id(0) == 1:
            nl.ndarray((2, 2), nl.float32, buffer="sbuf")
        return rows_split(x)

    with pytest.raises(TypeError, match="buffer names as strings"):
        nki.jit(kernel)[2](rng.standard_normal((4, 4)).astype(np.float32))


# --- registers and loops ---
def test_fori_loop_and_registers():
    def kernel(x):
        acc = nl.zeros((4, 1), nl.float32)

        def body(i):
            assert isinstance(i, nisa.VirtualRegister)
            nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)

        nl.fori_loop(0, nisa.register_alloc(5), body)
        o = nl.ndarray((4, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, value=acc)
        return o

    np.testing.assert_array_equal(nki.simulate(kernel)(np.zeros(1, np.float32)), 5)


def test_fori_loop_body_must_not_return_and_registers_have_no_int():
    def identity(i):
        return i

    def kernel(x):
        nl.fori_loop(0, 2, identity)

    with pytest.raises(AssertionError, match="must not return"):
        nki.simulate(kernel)(np.zeros(1, np.float32))
    with pytest.raises(TypeError, match="no compile-time value"):
        int(nisa.register_alloc(3))


def test_range_aliases_are_ranges():
    assert list(nl.affine_range(3)) == list(nl.sequential_range(0, 3)) == [0, 1, 2]
    assert list(nl.static_range(1, 7, 3)) == [1, 4]


# --- trace and install ---
def test_trace_records_engines_and_hbm_bytes(rng):
    x = rng.standard_normal((128, 256)).astype(np.float32)
    nki.jit(double)(x)
    trace = nki.last_trace()
    assert [i.opcode for i in trace] == ["dma_copy", "tensor_scalar", "dma_copy"]
    assert trace.count()["dve"] == 1 and trace.hbm_bytes() == (x.nbytes, x.nbytes)
    assert trace.instructions[1].partitions == 128 and trace.instructions[1].free_size == 256


def test_install_aliases_nki_and_never_shadows_a_real_one(monkeypatch):
    for name in ("nki", "nki.language", "nki.isa", "nki.typing"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert simulate.install() is not None
    import nki as imported
    import nki.isa as imported_isa
    import nki.language as imported_nl

    assert imported is nki and imported_nl is nl and imported_isa is nisa
    assert imported.__simulated__ and imported.__version__ == "0.6.0"
    monkeypatch.setitem(sys.modules, "nki", types.ModuleType("nki"))  # a real nki
    assert nki.install() is False and sys.modules["nki"] is not nki


def test_removed_entry_points_raise():
    for name in ("baremetal", "benchmark", "profile", "simulate_kernel"):
        with pytest.raises(NotImplementedError, match="removed"):
            getattr(nki, name)(double)


def test_deprecated_while_reg_warns():
    reg = nisa.register_alloc(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert bool(reg)
    assert caught and issubclass(caught[0].category, DeprecationWarning)


def test_torch_tensors_in_and_out(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal((8, 6)).astype(np.float32)).to(torch.bfloat16)
    y = torch.full((8, 6), float("nan"), dtype=torch.bfloat16)

    def kernel(x, y):
        nl.store(y, value=nl.multiply(nl.load(x), 2.0))
        return double(x)

    result = nki.simulate(kernel)(x, y)
    assert isinstance(result, torch.Tensor) and result.dtype == torch.bfloat16
    assert torch.equal(result, x * 2) and torch.equal(y, x * 2)


def test_jax_arrays_come_back_as_numpy(rng):
    jnp = pytest.importorskip("jax.numpy")
    x = rng.standard_normal((4, 4)).astype(np.float32)
    result = nki.simulate(double)(jnp.asarray(x))
    assert isinstance(result, np.ndarray)
    np.testing.assert_array_equal(result, 2 * x)


def test_launches_from_several_threads_are_independent(rng):
    from concurrent.futures import ThreadPoolExecutor

    inputs = [rng.standard_normal((64, 40)).astype(np.float32) for _ in range(6)]
    kernel = nki.jit(swap_partial_sums)
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [pool.submit(kernel[2], x) for x in inputs]
        results = [f.result(timeout=120) for f in futures]
    for x, result in zip(inputs, results):
        np.testing.assert_allclose(result[:, 0], (x.astype(np.float64) ** 2).sum(1), rtol=1e-5)


def test_runtime_loops_cannot_sit_inside_no_reorder():
    def kernel(x, inside):
        t = nl.zeros((2, 1), nl.float32)

        def body(i):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)

        if inside:
            with nl.no_reorder():
                nl.fori_loop(0, 2, body)
        else:
            with nl.no_reorder():
                body(None)
            nl.fori_loop(0, 2, body)

    nki.simulate(kernel)(np.zeros(1, np.float32), False)
    with pytest.raises(AssertionError, match="cannot sit inside an nl.no_reorder"):
        nki.simulate(kernel)(np.zeros(1, np.float32), True)


def test_while_loop_runs_until_the_register_is_zero():
    def kernel(x):
        t = nl.zeros((2, 1), nl.float32)
        counter = nl.full((1, 1), 3, nl.int32)

        def body(reg):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            nisa.tensor_scalar(dst=counter, data=counter, op0=nl.subtract, operand0=1.0)
            nisa.register_load(reg, counter)
            return reg

        condition = nisa.register_alloc()
        nisa.register_load(condition, counter)
        nl.while_loop(condition, body)
        o = nl.ndarray((2, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, value=t)
        return o

    np.testing.assert_array_equal(nki.simulate(kernel)(np.zeros(1, np.float32)), 3)


def test_register_alloc_from_a_one_element_tensor():
    """Beyond the documented int/None, AWS's MX MoE initialises a register from an SBUF
    element (core/moe/moe_tkg/all_expert_mx_impl.py L311): register_alloc + register_load."""

    def kernel(x, shape):
        t = nl.zeros((2, 1), nl.float32)
        counter = nl.full(shape, 3, nl.int32)

        def body(reg):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
            nisa.tensor_scalar(dst=counter, data=counter, op0=nl.subtract, operand0=1.0)
            nisa.register_load(reg, counter[0:1, 0:1])
            return reg

        nl.while_loop(nisa.register_alloc(counter[0:1, 0:1] if shape == (1, 1) else counter), body)
        o = nl.ndarray((2, 1), nl.float32, buffer=nl.shared_hbm)
        nl.store(o, value=t)
        return o

    np.testing.assert_array_equal(nki.simulate(kernel)(np.zeros(1, np.float32), (1, 1)), 3)
    with pytest.raises(AssertionError, match="1-element"):
        nki.simulate(kernel)(np.zeros(1, np.float32), (2, 1))
