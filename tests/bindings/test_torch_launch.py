"""Launch paths of the PyTorch binding, and the simulated ``torch_neuronx.nki_jit``.

On a NeuronCore the binding launches through ``torch_neuronx.nki_jit`` (Neuron SDK 2.20 –
2.23, output-parameter kernels), the direct ``nki.jit`` call (SDK ≥ 2.24 on PyTorch/XLA) or
the TorchNeuron ``"neuron"`` device. Here the same launch code runs on CPU tensors by
pointing ``LAUNCHERS["cpu"]`` at the device launcher, with :mod:`simulate.torch_neuronx`
standing in for ``torch_neuronx``; every path must give the simulator path's results bit for
bit (the kernels share all code).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types

import pytest

torch = pytest.importorskip("torch")

from dialect_launches import record_launches  # noqa: E402

import simulate  # noqa: E402
from nki_rmsnorm import dialect, kernels  # noqa: E402
from nki_rmsnorm import torch as nki_torch  # noqa: E402
from simulate import torch_neuronx as simulated_torch_neuronx  # noqa: E402

#: The output-parameter kernels come from the kernels' branch; the tests that launch
#: them need them.
needs_output_kernels = pytest.mark.skipif(
    not hasattr(kernels, "rmsnorm_fwd_out"), reason="needs the output-parameter kernels"
)


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.fixture
def fake_torch_neuronx(monkeypatch):
    """``torch_neuronx`` resolves to the simulated module for the test (then is removed)."""
    for name in ("torch_neuronx", "torch_neuronx.xla_impl", "torch_neuronx.xla_impl.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # no real package
        assert simulated_torch_neuronx.install() is True
    yield sys.modules["torch_neuronx"]
    for name in ("torch_neuronx", "torch_neuronx.xla_impl", "torch_neuronx.xla_impl.ops"):
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def tutorial_kernel():
    simulate.install()  # the tutorial-style kernel imports neuronxcc.nki
    return importlib.import_module("tutorial_rmsnorm_kernel").rmsnorm_kernel


# ---------------------------------------------------------------------------------------------
# The Neuron RMSNorm tutorial's launch code, as SDK 2.20 wrote it
# ---------------------------------------------------------------------------------------------


def torch_rmsnorm_kernel(a_tensor, g_tensor):
    # the tutorial's PyTorch reference (general/nki/examples/rmsnorm/rmsnorm_torch.py)
    in_square = a_tensor.pow(2)
    mean = in_square.mean(dim=1, keepdim=True)
    tensor = a_tensor * torch.rsqrt(mean)
    return tensor * g_tensor


def _run_tutorial_launch(nki_rmsnorm_kernel, device):
    """The tutorial's launch lines (aws-neuron-sdk@72825d50,
    general/nki/examples/rmsnorm/rmsnorm_torch.py, lines 8 and 25-34), with ``device`` the
    CPU in place of ``xm.xla_device()``."""
    from torch_neuronx.xla_impl.ops import nki_jit

    nki_rmsnorm_kernel = nki_jit(nki_rmsnorm_kernel)

    a_tensor = torch.rand((250, 512), dtype=torch.float32).to(device=device)
    g_tensor = torch.rand((512), dtype=torch.float32).to(device=device)
    output_nki = torch.zeros((250, 512), dtype=torch.float32).to(device=device)

    nki_rmsnorm_kernel(a_tensor, g_tensor, output_nki)

    output_torch = torch_rmsnorm_kernel(a_tensor, g_tensor)
    return output_nki, output_torch, a_tensor, g_tensor


def test_tutorial_launch_code_runs_the_tutorial_kernel(fake_torch_neuronx, tutorial_kernel):
    torch.manual_seed(0)
    output_nki, output_torch, a, g = _run_tutorial_launch(tutorial_kernel, "cpu")
    assert torch.allclose(output_torch, output_nki, atol=1e-5, rtol=1e-3)
    a64 = a.double()
    expected = a64 * torch.rsqrt(a64.square().mean(1, keepdim=True)) * g.double()
    torch.testing.assert_close(output_nki.double(), expected, rtol=2e-6, atol=1e-6)


@needs_output_kernels
def test_tutorial_launch_code_runs_our_kernel(fake_torch_neuronx):
    from nki_rmsnorm.nki import nl

    def nki_rmsnorm_kernel(a_tensor, g_tensor, out_tensor):
        # The tutorial's signature over our output-parameter kernel: eps 0 (the tutorial has
        # none), no bias, rstd into a private HBM scratch.
        rstd = nl.ndarray((a_tensor.shape[0],), dtype=nl.float32, buffer=nl.hbm)
        # nki_jit (SDK 2.20 - 2.23) compiles legacy kernels only
        kernels.kernel("rmsnorm_fwd_out", "legacy")(
            a_tensor, g_tensor, None, out_tensor, rstd, 0.0, 0.0, "gemma"
        )

    torch.manual_seed(1)
    output_nki, output_torch, a, g = _run_tutorial_launch(nki_rmsnorm_kernel, "cpu")
    assert torch.allclose(output_torch, output_nki, atol=1e-5, rtol=1e-3)


# ---------------------------------------------------------------------------------------------
# The simulated nki_jit: outputs written in place, bad buffers rejected
# ---------------------------------------------------------------------------------------------


def _tutorial_args(seed=2, rows=130):
    a = _randn(rows, 64, seed=seed).abs() + 0.1
    g = _randn(64, seed=seed + 1)
    return a, g


def test_nki_jit_forms_and_grid(fake_torch_neuronx, tutorial_kernel):
    from torch_neuronx import nki_jit

    a, g = _tutorial_args()
    outputs = []
    for wrapped in (
        nki_jit(tutorial_kernel),
        nki_jit()(tutorial_kernel),
        nki_jit(simulate.jit(tutorial_kernel)),
    ):
        out = torch.full_like(a, float("nan"))
        assert wrapped(a, g, out) is None
        outputs.append(out)
    assert not outputs[0].isnan().any()
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])
    torch.testing.assert_close(outputs[0], torch_rmsnorm_kernel(a, g), rtol=2e-5, atol=2e-5)
    out = torch.full_like(a, float("nan"))
    nki_jit(tutorial_kernel)[1](a, g, out)
    assert torch.equal(out, outputs[0])


def test_nki_jit_writes_bfloat16_outputs_bit_for_bit(fake_torch_neuronx, tutorial_kernel):
    from torch_neuronx import nki_jit

    a, g = (t.bfloat16() for t in _tutorial_args(seed=4))
    out = torch.full_like(a, float("nan"))
    nki_jit(tutorial_kernel)(a, g, out)
    import numpy as np

    a_np = a.view(torch.int16).numpy().view(simulate.dtypes.bfloat16)
    g_np = g.view(torch.int16).numpy().view(simulate.dtypes.bfloat16)
    out_np = np.full(a_np.shape, np.nan, simulate.dtypes.bfloat16)
    simulate.simulate_kernel(tutorial_kernel, a_np, g_np, out_np)
    assert torch.equal(out.view(torch.int16), torch.from_numpy(out_np.view(np.int16)))


@pytest.mark.parametrize(
    "make_out, error, match",
    [
        (
            lambda a: torch.zeros(64, 130).t(),
            ValueError,
            "`out_tensor` must be a contiguous tensor",
        ),
        (
            lambda a: torch.zeros_like(a, requires_grad=True),
            ValueError,
            "`out_tensor` requires grad",
        ),
        (lambda a: a, ValueError, "`out_tensor` shares memory with argument `a_tensor`"),
        (lambda a: torch.zeros_like(a, device="meta"), TypeError, "`out_tensor` is on meta"),
        (
            lambda a: torch.zeros_like(a, dtype=torch.float64),
            TypeError,
            "`out_tensor` has dtype float64",
        ),
        (lambda a: torch.zeros(130, 32), AssertionError, None),  # the kernel's shape assert
    ],
    ids=["non-contiguous", "requires-grad", "aliases-input", "meta", "float64", "shape"],
)
def test_nki_jit_rejects_bad_output_buffers_and_leaves_them_untouched(
    fake_torch_neuronx, tutorial_kernel, make_out, error, match
):
    from torch_neuronx import nki_jit

    a, g = _tutorial_args(seed=6)
    a_before = a.clone()
    out = make_out(a)
    before = None if out.device.type == "meta" else out.detach().clone()
    with pytest.raises(error, match=match):
        nki_jit(tutorial_kernel)(a, g, out)
    assert torch.equal(a, a_before)
    if before is not None:
        assert torch.equal(out.detach(), before)


def test_nki_jit_takes_output_parameter_kernels_only(fake_torch_neuronx):
    from torch_neuronx import nki_jit

    from nki_rmsnorm.nki import nl

    def copy_returned(a_tensor):
        out = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=nl.load(a_tensor))
        return out

    with pytest.raises(TypeError, match="output-parameter kernels"):
        nki_jit(copy_returned)(_randn(4, 16, seed=8))


def test_install_never_shadows_a_real_torch_neuronx(monkeypatch):
    names = ("torch_neuronx", "torch_neuronx.xla_impl", "torch_neuronx.xla_impl.ops")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    real_spec = importlib.machinery.ModuleSpec("torch_neuronx", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real_spec)
    assert simulated_torch_neuronx.install() is False
    assert "torch_neuronx" not in sys.modules

    real = types.ModuleType("torch_neuronx")
    monkeypatch.setitem(sys.modules, "torch_neuronx", real)
    assert simulated_torch_neuronx.install() is False
    assert sys.modules["torch_neuronx"] is real and not hasattr(real, "nki_jit")


def test_install_registers_both_import_paths_once(fake_torch_neuronx):
    from torch_neuronx import nki_jit
    from torch_neuronx.xla_impl.ops import nki_jit as nki_jit_from_ops

    assert nki_jit is nki_jit_from_ops is simulated_torch_neuronx.nki_jit
    module = sys.modules["torch_neuronx"]
    assert simulated_torch_neuronx.install() is True  # idempotent
    assert sys.modules["torch_neuronx"] is module


# ---------------------------------------------------------------------------------------------
# The binding's device paths, run on CPU tensors
# ---------------------------------------------------------------------------------------------


def _binding_results(with_params, dtype=torch.bfloat16):
    """Forward and backward of the fused add, rms_norm and the RMSNorm module, and every
    gradient."""
    x = _randn(3, 5, 32, dtype=dtype, seed=10)
    r = _randn(3, 5, 32, dtype=dtype, seed=11)
    w = _randn(32, seed=12) if with_params else None
    b = _randn(32, seed=13) if with_params else None
    dy, dh = _randn(3, 5, 32, dtype=dtype, seed=14), _randn(3, 5, 32, dtype=dtype, seed=15)
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, r, w, b)]
    y, h = nki_torch.fused_add_rms_norm(
        leaves[0],
        leaves[1],
        leaves[2],
        1e-6,
        offset=0.5 if with_params else 0.0,
        bias=leaves[3],
        casting_mode="llama",
    )
    torch.autograd.backward((y, h), (dy, dh))
    x2 = x.clone().requires_grad_()
    y2 = nki_torch.rms_norm(x2, 32, leaves[2], 1e-5, bias=leaves[3], out_dtype=torch.float32)
    y2.backward(dy.float())
    module = nki_torch.RMSNorm(32, 1e-6, elementwise_affine=with_params, casting_mode="llama")
    x3 = x.clone().requires_grad_()
    y3 = module(x3)
    y3.backward(dy)
    outputs = [y, h, y2, x2.grad, y3, x3.grad] + [None if t is None else t.grad for t in leaves]
    return outputs + [None if module.weight is None else module.weight.grad]


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g, w)


#: Launch path → the entry points its forward and backward launch (fused add, rms_norm).
PATH_KERNELS = {
    "simulator": {"rmsnorm_add_fwd", "rmsnorm_fwd", "rmsnorm_bwd"},
    "nki.jit": {"rmsnorm_add_fwd", "rmsnorm_fwd", "rmsnorm_bwd"},
    "nki_jit": {"rmsnorm_add_fwd_out", "rmsnorm_fwd_out", "rmsnorm_bwd_out"},
    "neuron": {"rmsnorm_add_fwd_out", "rmsnorm_fwd_out", "rmsnorm_bwd_out"},
}


def _route(monkeypatch, launcher, torch_neuronx):
    """CPU tensors through ``LAUNCHERS[launcher]``, with ``torch_neuronx`` in sys.modules
    (None: the simulator path, nothing routed)."""
    if launcher is None:
        return
    monkeypatch.setitem(sys.modules, "torch_neuronx", torch_neuronx)
    monkeypatch.setitem(nki_torch.LAUNCHERS, "cpu", nki_torch.LAUNCHERS[launcher])


@pytest.mark.parametrize("dialect_name", ["legacy", "nki06"])
@pytest.mark.parametrize(
    "launcher, with_nki_jit, path",
    [
        (None, False, "simulator"),
        # SDK >= 2.24 (torch_neuronx without nki_jit), and every nki 0.5 - 0.6 SDK: the
        # nki.jit kernels are called with the framework tensors (the simulator's torch-tensor
        # mode stands in for the compiler).
        ("xla", False, "nki.jit"),
        # SDK 2.20 - 2.23: torch_neuronx.nki_jit wraps the output-parameter kernels; the 0.6
        # kernels never go through it (it was removed before nki 0.4) and are called directly.
        ("xla", True, None),
        # TorchNeuron: the output-parameter kernels called with preallocated outputs.
        ("neuron", False, "neuron"),
    ],
    ids=["simulator", "xla-nki.jit", "xla-nki_jit", "neuron"],
)
@pytest.mark.parametrize("with_params", [True, False], ids=["params", "no-params"])
def test_each_launch_path_runs_the_chosen_dialects_kernels(
    monkeypatch, dialect_name, launcher, with_nki_jit, path, with_params
):
    """Forward and backward of every entry point through each launch path, inside
    ``use_dialect``: every kernel that runs is that dialect's, and the results are the
    simulator path's bit for bit (the paths share all kernel code)."""
    if path is None:
        path = "nki_jit" if dialect_name == "legacy" else "nki.jit"
    with dialect.use_dialect(dialect_name):
        want = _binding_results(with_params)
        twin = types.ModuleType("torch_neuronx")
        if with_nki_jit:
            twin.nki_jit = simulated_torch_neuronx.nki_jit
        _route(monkeypatch, launcher, twin)
        launches = record_launches(monkeypatch)
        got = _binding_results(with_params)
    assert nki_torch.last_launch_path == path
    assert nki_torch.last_launch_dialect == dialect_name
    assert {launch.dialect for launch in launches} == {dialect_name}
    assert {launch.kernel for launch in launches} == PATH_KERNELS[path]
    _assert_same(got, want)


def test_the_dialects_agree_through_the_binding():
    """The nki06 kernels give the legacy kernels' results through the binding, forward and
    backward: bit for bit in bf16; float32 outputs within a few ulps (the rms_norm call with
    a bias and out_dtype=float32 differs in the last bits between the dialects)."""
    with dialect.use_dialect("legacy"):
        legacy = _binding_results(True)
    with dialect.use_dialect("nki06"):
        nki06 = _binding_results(True)
    for got, want in zip(nki06, legacy, strict=True):
        assert got.dtype == want.dtype
        if got.dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize(("target", "expected"), [("trn1", "legacy"), ("trn3", "nki06")])
def test_the_targets_dialect_reaches_a_backward_on_another_thread(monkeypatch, target, expected):
    """The dialect follows the target, which the environment names process-wide: a backward
    that autograd runs on another thread launches the same dialect as the forward, on the
    same target."""
    import simulate

    monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
    launches = record_launches(monkeypatch)
    x = _randn(6, 64, dtype=torch.bfloat16, seed=40).requires_grad_()
    w = _randn(64, seed=41).requires_grad_()
    y = nki_torch.rms_norm(x, 64, w, 1e-6)
    errors, targets = [], []

    def backward():
        try:
            y.float().square().sum().backward()
            targets.append(simulate.last_trace().target)
        except BaseException as error:  # noqa: BLE001 - reported by the test thread
            errors.append(error)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the backward did not finish within 120 s"
    assert not errors, errors
    backward_launches = [launch for launch in launches if launch.kernel == "rmsnorm_bwd"]
    assert len(backward_launches) == 1 and backward_launches[0].thread == thread.ident
    assert {launch.dialect for launch in launches} == {expected}
    assert targets == [target]
    assert x.grad is not None and w.grad is not None


def test_the_operators_take_no_dialect():
    """The dialect is no argument of the custom operators: it follows the target."""
    for name in ("rms_norm_fwd", "rms_norm_add_fwd", "rms_norm_bwd", "rms_norm_add_bwd"):
        schema = getattr(torch.ops.nki_rmsnorm, name).default._schema
        assert "dialect" not in {argument.name for argument in schema.arguments}, schema


def test_a_compiled_model_launches_the_targets_dialect_at_each_call(monkeypatch):
    """``torch.compile(fullgraph=True)`` keeps no dialect from tracing: each call of the
    compiled graph launches the kernels of the target named at that call, forward and
    backward, without recompiling."""
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda x, w: nki_torch.rms_norm(x, 64, w, 1e-6).float().square().sum(), fullgraph=True
    )
    x = _randn(6, 64, dtype=torch.bfloat16, seed=42)
    w = _randn(64, seed=43)
    launches = record_launches(monkeypatch)
    for target, name in (("trn1", "legacy"), ("trn2", "nki06"), ("inf2", "legacy")):
        monkeypatch.setenv(dialect.TARGET_ENV_VAR, target)
        launches.clear()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        compiled(xs, ws).backward()
        assert [(launch.dialect, launch.kernel) for launch in launches] == [
            (name, "rmsnorm_fwd"),
            (name, "rmsnorm_bwd"),
        ]


def test_xla_device_without_the_sdk_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)  # not importable
    with pytest.raises(RuntimeError, match="torch_neuronx is not importable"):
        nki_torch.LAUNCHERS["xla"]._nki_jit("xla", "legacy")
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    with pytest.raises(RuntimeError, match="neuronxcc"):
        nki_torch.LAUNCHERS["xla"]._nki_jit("xla", "legacy")


def _torchneuron_available() -> bool:
    return importlib.util.find_spec("torch_neuronx") is not None and hasattr(torch, "neuron")


@pytest.mark.neuron
@pytest.mark.skipif(not _torchneuron_available(), reason="needs TorchNeuron (device 'neuron')")
def test_on_torchneuron_matches_the_simulator():
    """On a Trainium instance with TorchNeuron: eager and torch.compile(backend="neuron")
    give the simulator's results within a few ulps."""
    x = _randn(4, 300, 512, dtype=torch.bfloat16, seed=20)
    w = _randn(512, dtype=torch.bfloat16, seed=21)

    def run(device, compile_backend=None):
        xs, ws = x.to(device).requires_grad_(), w.to(device).requires_grad_()
        fn = nki_torch.rms_norm
        if compile_backend:
            fn = torch.compile(fn, backend=compile_backend, fullgraph=True)
        y = fn(xs, 512, ws, 1e-6)
        y.sum().backward()
        return [t.cpu() for t in (y, xs.grad, ws.grad)]

    want = run("cpu")
    for got in (run("neuron"), run("neuron", "neuron")):
        for g, w_ in zip(got, want):
            torch.testing.assert_close(g, w_, rtol=3e-2, atol=3e-2)


def test_a_device_without_a_launcher_is_rejected_before_launch(monkeypatch, no_launch):
    monkeypatch.delitem(nki_torch.LAUNCHERS, "cpu")
    with pytest.raises(ValueError, match="input is on cpu; the kernels run on a NeuronCore"):
        nki_torch.rms_norm(_randn(2, 8, seed=30), 8)
