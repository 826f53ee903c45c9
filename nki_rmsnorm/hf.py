"""Hugging Face ``transformers``: swap every RMSNorm of a model for the NKI kernels in one call.

>>> from nki_rmsnorm import hf
>>> hf.apply(model)          # every Llama/Mistral/Qwen/Gemma RMSNorm, Qwen3's q_norm/k_norm too
['model.layers.0.input_layernorm', ...]

or one family at a time: :func:`patch_llama` (Llama, Mistral, Mixtral), :func:`patch_qwen`
(Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE) and :func:`patch_gemma` (Gemma, Gemma 2, Gemma 3), each
the same swap restricted to its family's classes. Before a model is built, in the style of
Liger-Kernel's ``apply_liger_kernel_to_*``, :func:`patch_transformers` patches the classes
themselves (``from_pretrained`` then builds on the kernels; :func:`unpatch_transformers`
undoes it).

:func:`apply` also swaps any other ``transformers`` RMSNorm class whose code is Llama's or
Gemma's (``Phi3RMSNorm`` and many more: :func:`family` compares the sources), and warns when it
leaves RMSNorm modules behind or finds none (a GPT-2 has LayerNorm);
:func:`nki_rmsnorm.torch.patch_module` swaps ``torch.nn.RMSNorm`` as well.
:func:`fuse_residual_norms` then routes each Llama-style decoder layer's residual add and
``post_attention_layernorm`` through the fused add + RMSNorm kernel.

Two families of RMSNorm exist in ``transformers``, and each swapped module reproduces its
family's arithmetic and output dtype (read from ``transformers`` 5.23's modeling files):

* **Llama** (``LlamaRMSNorm``, and the identical Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3,
  Qwen3-MoE classes): ``weight * (x·rstd).to(input_dtype)`` with ``x·rstd`` in fp32; the
  result has ``torch.promote_types(weight.dtype, input.dtype)`` (an fp32 weight with a bf16
  input returns fp32). Our preset: ``casting_mode="llama"``, no offset, that ``out_dtype``.
* **Gemma** (``GemmaRMSNorm``, ``Gemma2RMSNorm``, ``Gemma3RMSNorm``): ``(x·rstd) · (1 +
  weight)`` in fp32, cast to the input dtype; the weight starts at zeros. Our preset:
  ``casting_mode="gemma"``, ``offset=1.0``, the input dtype.

What is bit for bit HF's (tests/bindings/test_hf.py checks each norm call of every family):

* Llama-style, every target: the kernels do HF's arithmetic in HF's order and roundings;
  only rstd is computed differently (its own summation order and a Newton-refined rsqrt,
  one to three fp32 ulps off torch's in some rows), so outputs are bit for bit HF's in rows
  whose rstd equals torch's, and elsewhere at most 2 ulps of the input dtype off, only
  where x·rstd lies within an fp32 ulp of a rounding tie (about 1 element in 10⁵).
* Gemma-style on NeuronCore-v2 (trn1, inf2): as Llama-style, HF's order (h·rstd)·(1 + w).
* Gemma-style on NeuronCore-v3+ (trn2, trn3; the nki06 kernels' default): the kernel forms
  rstd·(1 + w) on the Tensor engine and multiplies h by it (one Vector pass with a PSUM
  operand instead of two SBUF operands), so its fp32 value is a few fp32 ulps from HF's and
  an output is 1 ulp of the input dtype off HF's where HF's value lies that close to a
  rounding tie, which then moves a few logits in a thousand by 1 ulp.

Logits of a patched model are therefore HF's bit for bit only when no norm output differs;
in fp32, every family agrees with HF within fp32 rounding (about 1e-6 relative).

The swapped module keeps the original ``weight`` Parameter (same object: optimiser state, tied
weights and ``state_dict`` keys stay as they were) and the original epsilon attribute
(``variance_epsilon`` or ``eps``). A weight in a third dtype (fp16 beside a bf16 input) is
widened to fp32 exactly, as HF's own promotion does; float64 is refused by the kernels. Modules
of other classes are left alone.
"""

from __future__ import annotations

from nki_rmsnorm._optional import require

require("transformers", extra="hf")  # a missing transformers is an ImportError naming the extra

import functools
import importlib
import inspect
import sys
import types
import warnings

import torch
from torch import nn

from nki_rmsnorm import torch as nki_torch

__all__ = [
    "GemmaRMSNorm",
    "LlamaRMSNorm",
    "apply",
    "family",
    "fuse_residual_norms",
    "patch_gemma",
    "patch_llama",
    "patch_qwen",
    "patch_transformers",
    "unpatch_transformers",
]

#: ``transformers`` RMSNorm classes computed as LlamaRMSNorm does (checked against the
#: modeling sources by tests/bindings/test_hf.py).
LLAMA_STYLE = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "MixtralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3RMSNorm",
        "Qwen3MoeRMSNorm",
    }
)
#: ``transformers`` RMSNorm classes computed as GemmaRMSNorm does (``1 + weight``).
GEMMA_STYLE = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
#: The classes each ``patch_*`` helper swaps.
LLAMA_FAMILY = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "MixtralRMSNorm"})
QWEN_FAMILY = LLAMA_STYLE - LLAMA_FAMILY


def _kernel_weight(weight: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """The weight in a dtype the kernels take beside ``input``: its own, or fp32 (exact for
    a bf16/fp16 weight, and what HF's arithmetic promotes it to)."""
    if weight.dtype in (torch.float32, input.dtype) or weight.dtype not in (
        torch.bfloat16,
        torch.float16,
    ):
        return weight
    return weight.float()


def _llama_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """HF ``LlamaRMSNorm.forward`` on the kernels (``weight``, ``variance_epsilon``)."""
    return nki_torch.rms_norm(
        hidden_states,
        hidden_states.shape[-1:],
        _kernel_weight(module.weight, hidden_states),
        module.variance_epsilon,
        casting_mode="llama",
        out_dtype=torch.promote_types(module.weight.dtype, hidden_states.dtype),
    )


def _gemma_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF ``GemmaRMSNorm.forward`` on the kernels (``weight``, ``eps``)."""
    return nki_torch.rms_norm(
        x,
        x.shape[-1:],
        _kernel_weight(module.weight, x),
        module.eps,
        offset=1.0,
        casting_mode="gemma",
    )


class LlamaRMSNorm(nn.Module):
    """HF ``LlamaRMSNorm`` on the NKI kernels: ``weight * (x·rstd).to(x.dtype)``."""

    def __init__(self, weight: nn.Parameter, variance_epsilon: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = variance_epsilon

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _llama_forward(self, hidden_states)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, NKI llama preset"


class GemmaRMSNorm(nn.Module):
    """HF ``GemmaRMSNorm`` on the NKI kernels: ``((x·rstd) · (1 + weight)).to(x.dtype)``."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)  # scale 1 + 0: Gemma's initial identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gemma_forward(self, x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, NKI gemma preset"


#: Where ``transformers`` defines each class of the tables (for :func:`patch_transformers`).
MODELING_MODULES = {
    name: f"transformers.models.{module}.modeling_{module}"
    for name, module in {
        "LlamaRMSNorm": "llama",
        "MistralRMSNorm": "mistral",
        "MixtralRMSNorm": "mixtral",
        "Qwen2RMSNorm": "qwen2",
        "Qwen2MoeRMSNorm": "qwen2_moe",
        "Qwen3RMSNorm": "qwen3",
        "Qwen3MoeRMSNorm": "qwen3_moe",
        "GemmaRMSNorm": "gemma",
        "Gemma2RMSNorm": "gemma2",
        "Gemma3RMSNorm": "gemma3",
    }.items()
}


def _source(cls: type, method: str) -> str | None:
    """``cls.method``'s source with the family prefix of the class name neutralised."""
    return _source_of(cls, method, "RMSNorm")


def _source_of(cls: type, method: str, suffix: str) -> str | None:
    """``cls.method``'s source with the class name's prefix before ``suffix`` (the model
    family: ``Llama`` of ``LlamaRMSNorm``) neutralised; None when the source is unavailable."""
    try:
        text = inspect.getsource(getattr(cls, method))
    except (OSError, TypeError, AttributeError):
        return None
    return text.replace(cls.__name__.removesuffix(suffix), "<family>")


@functools.cache
def family(cls: type) -> str | None:
    """``"llama"`` or ``"gemma"`` when the ``transformers`` class ``cls`` computes as that
    family's RMSNorm, else None: by the tables, else when its ``__init__`` and ``forward`` are
    textually those of ``LlamaRMSNorm`` / ``GemmaRMSNorm`` up to the class-name prefix (how
    ``transformers`` copies a norm into another model, e.g. ``Phi3RMSNorm``): the same code
    computes the same arithmetic, so the family's preset reproduces it."""
    if not cls.__module__.startswith("transformers.") or getattr(cls, "_nki_rmsnorm", False):
        return None
    if cls.__name__ in LLAMA_STYLE:
        return "llama"
    if cls.__name__ in GEMMA_STYLE:
        return "gemma"
    if not cls.__name__.endswith("RMSNorm"):
        return None
    for name, anchor_family in (("LlamaRMSNorm", "llama"), ("GemmaRMSNorm", "gemma")):
        anchor = getattr(importlib.import_module(MODELING_MODULES[name]), name)
        anchor = getattr(anchor, "_nki_rmsnorm_original", anchor)
        methods = ("__init__", "forward")
        if all(
            _source(cls, m) is not None and _source(cls, m) == _source(anchor, m) for m in methods
        ):
            return anchor_family
    return None


def _replacement(module: nn.Module, classes: frozenset | None = None) -> nn.Module | None:
    """The family module for ``module`` (sharing its weight), or None; ``classes`` restricts
    the swap to those class names (the ``patch_*`` helpers)."""
    cls = type(module)
    if classes is not None and cls.__name__ not in classes:
        return None
    kind = family(cls)
    if kind == "llama":
        return LlamaRMSNorm(module.weight, float(module.variance_epsilon))
    if kind == "gemma":
        return GemmaRMSNorm(module.weight, float(module.eps))
    return None


def apply(model: nn.Module, *, qk_norm: bool = True) -> list[str]:
    """Replace, in place, every Llama-/Gemma-family RMSNorm of a ``transformers`` model by
    the NKI-kernel module of its family (the classes of the tables, and any other class with
    the same code, see :func:`family`); returns the qualified names of the replaced modules.
    ``qk_norm=False`` leaves the attention's per-head ``q_norm`` / ``k_norm`` (Qwen3,
    Gemma 3) as they are. They are patched by default because the kernels' "packed" regime
    is faster there at every head size models use: modeled bf16 16384 rows × head_dim 16,
    32, 64, 128, 256, 2.3–8.1× the Neuron tutorial kernel on trn1, trn2 and trn3
    (``nki-rmsnorm bench --shapes 16384x16,...,16384x256``), the rule being by head_dim
    alone (the kernels pick the regime by N, never by M). Warns (``UserWarning``) when the
    model has RMSNorm modules of another arithmetic, left as they are, or none at all (e.g.
    GPT-2's LayerNorm);
    :func:`nki_rmsnorm.torch.patch_module` swaps ``torch.nn.RMSNorm`` too."""
    if not isinstance(qk_norm, bool):
        raise TypeError(f"qk_norm must be a bool, got {type(qk_norm).__name__}")
    swapped = _swap(model, None, qk_norm=qk_norm)
    names = set(swapped)
    left = sorted(
        {
            type(m).__name__
            for name, m in model.named_modules()
            if name not in names
            and (qk_norm or not _is_qk_norm(name))
            and type(m).__name__.endswith("RMSNorm")
            and not _on_kernels(m)
        }
    )
    if left:
        warnings.warn(
            f"nki_rmsnorm.hf.apply left {', '.join(left)} unpatched: their arithmetic is not "
            "the Llama or Gemma RMSNorm's (nki_rmsnorm.torch.patch_module swaps "
            "torch.nn.RMSNorm)",
            UserWarning,
            stacklevel=2,
        )
    elif not swapped and not any(_on_kernels(m) for m in model.modules()):
        norms = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
        warnings.warn(
            f"nki_rmsnorm.hf.apply patched nothing in {type(model).__name__}: it has no "
            f"RMSNorm of the Llama or Gemma family (its norms: {', '.join(norms) or 'none'}); "
            "nki_rmsnorm.torch.patch_module swaps torch.nn.RMSNorm",
            UserWarning,
            stacklevel=2,
        )
    return swapped


def _on_kernels(module: nn.Module) -> bool:
    """Whether ``module`` already runs the kernels (swapped, or built from a patched class)."""
    return isinstance(module, (LlamaRMSNorm, GemmaRMSNorm, nki_torch.RMSNorm)) or getattr(
        type(module), "_nki_rmsnorm", False
    )


def patch_llama(model: nn.Module) -> list[str]:
    """:func:`apply` restricted to the Llama, Mistral and Mixtral RMSNorm classes (llama
    preset)."""
    return _swap(model, LLAMA_FAMILY)


def patch_qwen(model: nn.Module) -> list[str]:
    """:func:`apply` restricted to the Qwen2, Qwen2-MoE, Qwen3 and Qwen3-MoE RMSNorm classes
    (llama preset; Qwen3's ``q_norm``/``k_norm`` included)."""
    return _swap(model, QWEN_FAMILY)


def patch_gemma(model: nn.Module) -> list[str]:
    """:func:`apply` restricted to the Gemma, Gemma 2 and Gemma 3 RMSNorm classes (gemma
    preset: offset 1, zeros-initialised weight)."""
    return _swap(model, GEMMA_STYLE)


#: ``patch_transformers`` family names → the classes each patches.
CLASS_FAMILIES = {"llama": LLAMA_FAMILY, "qwen": QWEN_FAMILY, "gemma": GEMMA_STYLE}


def _kernel_class(original: type, kind: str) -> type:
    """A subclass of the HF class ``original`` whose ``forward`` runs the kernels: HF's own
    ``__init__`` (weight init, attribute names, ``state_dict``) and ``isinstance`` checks
    (HF's ``_init_weights``) keep working."""
    forward = _llama_forward if kind == "llama" else _gemma_forward
    return type(
        original.__name__,
        (original,),
        {
            "forward": forward,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__doc__": f"HF {original.__name__} with its forward on the NKI kernels.",
            "_nki_rmsnorm": True,
            "_nki_rmsnorm_original": original,
        },
    )


def patch_transformers(*families: str) -> list[str]:
    """Patch the ``transformers`` classes themselves, before a model is built (the way
    Liger-Kernel's ``apply_liger_kernel_to_*`` do): each RMSNorm class of ``families``
    (``"llama"``, ``"qwen"``, ``"gemma"``; default all three) in its modeling module is
    replaced by a subclass whose ``forward`` runs the kernels, so
    ``AutoModelForCausalLM.from_pretrained`` / ``from_config`` afterwards build models on the
    kernels, with the checkpoint's weights loaded as usual. Returns the qualified names of the
    patched classes; :func:`unpatch_transformers` restores them. Classes the installed
    ``transformers`` does not have are skipped."""
    unknown = [f for f in families if f not in CLASS_FAMILIES]
    if unknown:
        raise ValueError(
            f"unknown families {unknown}: expected some of {', '.join(CLASS_FAMILIES)}"
        )
    patched = []
    for family_name in families or tuple(CLASS_FAMILIES):
        for name in sorted(CLASS_FAMILIES[family_name]):
            try:
                module = importlib.import_module(MODELING_MODULES[name])
            except ImportError:
                continue
            original = getattr(module, name, None)
            if original is None or getattr(original, "_nki_rmsnorm", False):
                continue
            kind = "gemma" if name in GEMMA_STYLE else "llama"
            setattr(module, name, _kernel_class(original, kind))
            patched.append(f"{module.__name__}.{name}")
    return patched


def unpatch_transformers() -> list[str]:
    """Undo :func:`patch_transformers`: the original classes back in their modules (models
    built meanwhile keep their patched modules); returns the restored qualified names."""
    restored = []
    for name, module_name in MODELING_MODULES.items():
        module = sys.modules.get(module_name)
        current = getattr(module, name, None)
        if current is not None and getattr(current, "_nki_rmsnorm", False):
            setattr(module, name, current._nki_rmsnorm_original)
            restored.append(f"{module_name}.{name}")
    return restored


def _llama_decoder_forward_source() -> str | None:
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    return _source_of(modeling.LlamaDecoderLayer, "forward", "DecoderLayer")


def _llama_style_norm(module: nn.Module) -> bool:
    return (
        isinstance(module, LlamaRMSNorm)
        or family(type(module)) == "llama"
        or (
            getattr(type(module), "_nki_rmsnorm", False)
            and family(type(module)._nki_rmsnorm_original) == "llama"
        )
    )


def fuse_residual_norms(model: nn.Module) -> list[str]:
    """Route the residual add before each Llama-style decoder layer's
    ``post_attention_layernorm`` through the fused add + RMSNorm kernel
    (:func:`nki_rmsnorm.torch.fused_add_rms_norm`), in place; returns the qualified names of
    the layers changed.

    A layer qualifies when its class's ``forward`` is, up to the class-name prefix, the
    installed ``LlamaDecoderLayer.forward`` (Llama, Mistral, Qwen2, Qwen3 ... in
    ``transformers`` 5.x): ``h = residual + self_attn(input_layernorm(x))``, then
    ``mlp(post_attention_layernorm(h)) + h``; and its ``post_attention_layernorm`` computes as
    ``LlamaRMSNorm`` (HF's, or swapped by :func:`apply`). Such a layer's forward becomes the
    same steps with ``h`` and the norm from one kernel launch (one HBM pass over ``h`` instead
    of a store and a reload). Where the attention output's dtype differs from the residual's
    (an fp32 residual stream), that call takes HF's unfused steps: HF normalises ``h`` in the
    promoted dtype there, which the llama preset of the fused kernel does not."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    reference = _llama_decoder_forward_source()
    fused = []
    for name, layer in model.named_modules():
        cls = type(layer)
        if (
            reference is None
            or "_nki_fused_forward" in vars(layer)
            or not cls.__name__.endswith("DecoderLayer")
            or not isinstance(getattr(layer, "post_attention_layernorm", None), nn.Module)
            or _source_of(cls, "forward", "DecoderLayer") != reference
            or not _llama_style_norm(layer.post_attention_layernorm)
        ):
            continue
        layer._nki_fused_forward = True
        layer._nki_forward_signature = inspect.signature(cls.forward)
        layer.forward = types.MethodType(_fused_decoder_forward, layer)
        fused.append(name)
    return fused


def _fused_decoder_forward(self, hidden_states, *args, **kwargs):
    """``LlamaDecoderLayer.forward`` with the residual add and ``post_attention_layernorm``
    fused (see :func:`fuse_residual_norms`)."""
    call = self._nki_forward_signature.bind(self, hidden_states, *args, **kwargs).arguments
    extra = dict(call.pop("kwargs", {}))
    for key in ("self", "hidden_states"):
        call.pop(key)
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **call, **extra)
    norm = self.post_attention_layernorm
    if hidden_states.dtype == residual.dtype:
        normed, residual = nki_torch.fused_add_rms_norm(
            hidden_states,
            residual,
            _kernel_weight(norm.weight, residual),
            norm.variance_epsilon,
            casting_mode="llama",
            out_dtype=torch.promote_types(norm.weight.dtype, residual.dtype),
        )
    else:
        residual = residual + hidden_states
        normed = norm(residual)
    return residual + self.mlp(normed)


def _is_qk_norm(name: str) -> bool:
    """Whether the module named ``name`` is an attention's per-head query / key norm (the
    attribute names of the Qwen3 and Gemma 3 attention modules)."""
    return name.rpartition(".")[2] in ("q_norm", "k_norm")


def _swap(model: nn.Module, classes: frozenset | None, qk_norm: bool = True) -> list[str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    swaps = [
        (name, new)
        for name, module in model.named_modules()
        if (qk_norm or not _is_qk_norm(name)) and (new := _replacement(module, classes)) is not None
    ]
    for name, new in swaps:
        if not name:
            raise ValueError(
                "model is itself an RMSNorm; wrap it in a parent module or use "
                "nki_rmsnorm.hf.LlamaRMSNorm / GemmaRMSNorm directly"
            )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
    return [name for name, _ in swaps]
