"""What a user adopting the package into an existing model needs: ``RMSNorm`` is a
``torch.nn.RMSNorm``; ``patch_module`` swaps the norms of a plain model; ``hf.apply`` finds
every class with Llama's or Gemma's code (Phi3's) and warns instead of a silent ``[]``;
``hf.patch_transformers`` patches the classes before a model is built."""

from __future__ import annotations

import copy
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from nki_rmsnorm import hf  # noqa: E402
from nki_rmsnorm import torch as nki_torch  # noqa: E402

FP32_REL = 1e-5


@pytest.fixture(autouse=True)
def _neuroncore_v2(monkeypatch):
    """trn1, where the kernels reproduce HF's roundings bit for bit (tests/bindings/test_hf.py)."""
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_rmsnorm_is_a_torch_rmsnorm_with_its_state_dict():
    ours = nki_torch.RMSNorm(64, eps=1e-5)
    assert isinstance(ours, torch.nn.RMSNorm)
    theirs = torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.3)
    ours.load_state_dict(theirs.state_dict())
    assert set(ours.state_dict()) == {"weight"}
    x = _randn(4, 7, 64, dtype=torch.bfloat16, seed=1)
    ours, theirs = ours.bfloat16(), theirs.bfloat16()
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))  # gemma mode: F.rms_norm bit for bit
    gemma = nki_torch.RMSNorm(8, offset=1.0, bias=True)
    assert torch.equal(gemma.weight, torch.zeros(8)) and torch.equal(gemma.bias, torch.zeros(8))
    assert set(gemma.state_dict()) == {"weight", "bias"}


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)
        self.norm = torch.nn.RMSNorm(32, eps=1e-5)
        self.inner = torch.nn.Sequential(torch.nn.RMSNorm(32, elementwise_affine=False))

    def forward(self, x):
        return self.inner(self.proj(self.norm(x)))


def test_patch_module_swaps_the_norms_of_a_plain_model():
    model = torch.nn.Sequential(_Block(), torch.nn.RMSNorm(32)).to(torch.bfloat16).train()
    with torch.no_grad():
        model[0].norm.weight.normal_(1.0, 0.3)
    reference = copy.deepcopy(model)
    weight = model[0].norm.weight
    assert nki_torch.patch_module(model) == ["0.norm", "0.inner.0", "1"]
    norm = model[0].norm
    assert isinstance(norm, nki_torch.RMSNorm) and norm.weight is weight
    assert norm.eps == 1e-5 and norm.training
    assert model[0].inner[0].weight is None
    x = _randn(3, 5, 32, dtype=torch.bfloat16, seed=2)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert nki_torch.patch_module(model) == []  # already on the kernels
    with pytest.raises(ValueError, match="itself an RMSNorm"):
        nki_torch.patch_module(torch.nn.RMSNorm(4))
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        nki_torch.patch_module("model")


def _tiny(config_name, model_name, dtype=torch.float32, **settings):
    config = getattr(transformers, config_name)(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def _logits(model, seed=3):
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def _close(got, want):
    return bool(((got - want).abs() <= FP32_REL * want.abs().max()).all())


def test_patch_module_swaps_hf_norms_too():
    model = _tiny("LlamaConfig", "LlamaForCausalLM", **LLAMA)
    reference = copy.deepcopy(model)
    assert nki_torch.patch_module(model) == hf.apply(copy.deepcopy(reference))
    assert len(nki_torch.patch_module(copy.deepcopy(reference))) == 5
    assert _close(_logits(model), _logits(reference))


def test_apply_finds_classes_with_the_llama_code_by_their_source():
    """Phi3RMSNorm is not in the tables; its code is LlamaRMSNorm's, so it is swapped."""
    phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    assert "Phi3RMSNorm" not in hf.LLAMA_STYLE
    assert hf.family(phi3.Phi3RMSNorm) == "llama"
    assert hf.family(torch.nn.RMSNorm) is None and hf.family(torch.nn.LayerNorm) is None
    model = _tiny("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **LLAMA)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swapped = hf.apply(model)
    assert len(swapped) == 5 and all(isinstance(model.get_submodule(n), hf.LlamaRMSNorm)
                                     for n in swapped)  # fmt: skip
    assert _close(_logits(model), _logits(reference))


def test_apply_warns_where_it_patches_nothing_or_leaves_norms_behind():
    gpt2 = _tiny("GPT2Config", "GPT2LMHeadModel", vocab_size=96, n_embd=64, n_layer=2, n_head=4)
    with pytest.warns(UserWarning, match=r"patched nothing in GPT2LMHeadModel.*LayerNorm"):
        assert hf.apply(gpt2) == []
    mixed = torch.nn.Sequential(copy.deepcopy(_tiny("LlamaConfig", "LlamaModel", **LLAMA)),
                                torch.nn.RMSNorm(64))  # fmt: skip
    with pytest.warns(UserWarning, match=r"left RMSNorm unpatched.*patch_module"):
        assert len(hf.apply(mixed)) == 5
    # restricted helpers stay quiet about other families: that is what they are for
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf.patch_gemma(_tiny("LlamaConfig", "LlamaForCausalLM", **LLAMA)) == []


def test_patch_transformers_builds_models_on_the_kernels():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    original = modeling.LlamaRMSNorm
    reference = _tiny("LlamaConfig", "LlamaForCausalLM", **LLAMA)
    try:
        patched_names = hf.patch_transformers("llama")
        assert f"{modeling.__name__}.LlamaRMSNorm" in patched_names
        assert all("qwen" not in n and "gemma" not in n for n in patched_names)
        assert hf.patch_transformers("llama") == []  # idempotent
        model = _tiny("LlamaConfig", "LlamaForCausalLM", **LLAMA)
        norms = [m for m in model.modules() if isinstance(m, original)]
        assert len(norms) == 5 and all(type(m) is modeling.LlamaRMSNorm for m in norms)
        model.load_state_dict(reference.state_dict())  # a checkpoint loads as usual
        nki_torch.last_launch_path = None
        assert _close(_logits(model), _logits(reference))
        assert nki_torch.last_launch_path == "simulator"  # the norms ran the kernels
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert hf.apply(model) == []  # already on the kernels: nothing to do, no warning
    finally:
        restored = hf.unpatch_transformers()
    assert modeling.LlamaRMSNorm is original
    assert f"{modeling.__name__}.LlamaRMSNorm" in restored
    with pytest.raises(ValueError, match="unknown families"):
        hf.patch_transformers("gpt2")


def _spy_fused(monkeypatch):
    calls = []
    fused = nki_torch.fused_add_rms_norm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    monkeypatch.setattr(nki_torch, "fused_add_rms_norm", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decoder_layers_reach_the_fused_add_norm(dtype, monkeypatch):
    """Llama-style layers: residual add + post_attention_layernorm in one launch per layer;
    the logits are those of the unfused swap bit for bit (and HF's bit for bit in bf16),
    gradients flow through both outputs of the fused kernel."""
    reference = _tiny("LlamaConfig", "LlamaForCausalLM", dtype, **LLAMA)
    unfused = copy.deepcopy(reference)
    hf.apply(unfused)
    model = copy.deepcopy(unfused)
    assert hf.fuse_residual_norms(model) == ["model.layers.0", "model.layers.1"]
    assert hf.fuse_residual_norms(model) == []  # once
    calls = _spy_fused(monkeypatch)
    got = _logits(model)
    assert len(calls) == 2
    assert torch.equal(got, _logits(unfused))
    if dtype == torch.bfloat16:
        assert torch.equal(got, _logits(reference))
    else:
        assert _close(got, _logits(reference))
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
        for m in (model, reference):
            m.zero_grad()
            m(ids).logits.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _close(p.grad, q.grad), name


def test_fusion_needs_the_llama_layer_structure_and_norm():
    phi3 = _tiny("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **LLAMA)  # fused qkv layer
    assert hf.fuse_residual_norms(phi3) == []
    qwen3 = _tiny("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **LLAMA)  # same layer code
    assert len(hf.fuse_residual_norms(qwen3)) == 2
    gemma = _tiny("GemmaConfig", "GemmaForCausalLM", head_dim=16, **LLAMA)  # a Gemma norm
    assert hf.fuse_residual_norms(gemma) == []
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        hf.fuse_residual_norms("model")
