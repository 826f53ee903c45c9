"""The kernels at both ends of the supported Neuron SDK range, in the normal CI run.

The whole kernel suite can run under any emulated release (``pytest --nki-sdk=2.21
--nki-approx``); this module keeps a representative subset in every run: the forward pass,
the fused add, the backward pass and each of their regimes once, in bf16, under the oldest
supported release with approximate Scalar-engine transcendentals and under the newest with
exact math. The checks and tolerances are the kernel suites' own (``test_fwd.py``,
``test_bwd.py``) against the float64 reference.
"""

from __future__ import annotations

import pytest
from test_bwd import _check_against_reference, _make_inputs
from test_fwd import BF16, _inputs, _layout, check_forward

import simulate
from nki_rmsnorm import nki as nki_module
from nki_rmsnorm.dialect import use_dialect
from nki_rmsnorm.plan.backward import BwdDtypes, make_plan

OLDEST = "{}.{}".format(*nki_module.OLDEST_SDK)
NEWEST = "{}.{}".format(*nki_module.NEWEST_SDK)
MODES = [(OLDEST, True), (NEWEST, False)]
MODE_IDS = [f"sdk{OLDEST}-approx", f"sdk{NEWEST}-exact"]


@pytest.fixture(params=MODES, ids=MODE_IDS)
def sdk_mode(request):
    """Emulate the release (and approximate mode) for the test; check that it is in force.
    The releases are legacy SDKs (2.21 - 2.29), so the kernels are the legacy ones on every
    target, trn2 included (``nki_rmsnorm.dialect``: Trn2 on SDK <= 2.29 runs legacy)."""
    release, approximate = request.param
    with (
        simulate.use_sdk(release),
        simulate.use_approx(approximate),
        use_dialect("legacy") as kernel_dialect,
    ):
        assert simulate.sdk_version() == release
        assert bool(simulate.approx_bound()) == approximate
        assert kernel_dialect == "legacy"
        yield release


# (regime, target, M, N, _inputs options, casting mode); the residual cases run the fused add
FORWARD = [
    ("rows", "trn1", 130, 512, dict(bias=True, offset=0.5), "gemma"),
    ("rows", "trn1", 130, 512, dict(residual=True), "llama"),
    ("packed", "trn1", 1030, 128, dict(bias=True, offset=0.5), "gemma"),
    ("packed", "trn1", 1024, 64, dict(residual=True), "llama"),
    ("long", "trn1", 3, 40000, dict(residual=True), "llama"),
    ("split", "trn2", 3, 40000, dict(weight_dtype=BF16, residual=True), "gemma"),
    ("two_pass", "trn1", 3, 65536, dict(bias=True, residual=True, offset=1.0), "none"),
    # decode batches (the legacy kernels: "spread" on every target)
    ("spread", "trn1", 8, 4096, dict(bias=True, offset=0.5), "gemma"),
    ("spread", "trn1", 29, 2048, dict(residual=True), "llama"),
    ("spread", "trn2", 8, 4096, dict(weight_dtype=BF16, bias=True), "gemma"),
]


@pytest.mark.parametrize(
    "regime, target, M, N, options, casting_mode",
    FORWARD,
    ids=[f"{c[0]}-{'add-' if c[4].get('residual') else ''}{c[1]}" for c in FORWARD],
)
def test_forward(rng, sdk_mode, regime, target, M, N, options, casting_mode):
    inputs = _inputs(rng, M, N, BF16, **options)
    assert _layout(inputs, casting_mode, target, grouped=False).regime == regime
    check_forward(inputs, casting_mode, target=target)


# (regime, M, N, weight dtype, offset, bias, dh_out, casting mode) on trn1
BACKWARD = [
    ("unfolded", 130, 2100, BF16, 1.0, True, True, "gemma"),
    ("folded", 3, 20000, BF16, 0.0, True, True, "llama"),
    ("streamed", 3, 30001, BF16, 0.5, True, False, "gemma"),
]


def _backward_regime(x, weight, offset, dh_out, casting_mode) -> str:
    dtypes = BwdDtypes(x.dtype, x.dtype, weight.dtype, None if dh_out is None else dh_out.dtype)
    plan = make_plan(
        x.shape[1],
        dtypes,
        offset,
        casting_mode,
        simulate.get_target("trn1").sbuf_bytes_per_partition,
    )
    if plan is None:
        return "streamed"
    return "unfolded" if plan.fold == 1 else "folded"


@pytest.mark.parametrize(
    "regime, M, N, w_dtype, offset, has_bias, with_dh, mode", BACKWARD, ids=[c[0] for c in BACKWARD]
)
def test_backward(rng, sdk_mode, regime, M, N, w_dtype, offset, has_bias, with_dh, mode):
    dy, x, weight, rstd, dh_out = _make_inputs(rng, M, N, BF16, w_dtype, offset, with_dh, mode)
    assert _backward_regime(x, weight, offset, dh_out, mode) == regime
    _check_against_reference(dy, x, weight, rstd, dh_out, offset, has_bias, mode, "trn1")


def test_both_ends_are_the_supported_range():
    """The releases above are the simulator's oldest the kernels claim and its newest."""
    assert simulate.SDK_RELEASES[-1] == NEWEST
    assert OLDEST in simulate.SDK_RELEASES
