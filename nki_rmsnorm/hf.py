"""Hugging Face ``transformers``: swap every RMSNorm of a model for the NKI kernels in one call.

>>> from nki_rmsnorm import hf
>>> hf.apply(model)          # every Llama/Mistral/Qwen/Gemma RMSNorm, Qwen3's q_norm/k_norm too
['model.layers.0.input_layernorm', ...]

or one family at a time, in the style of Liger-Kernel's ``apply_liger_kernel_to_*``:
:func:`patch_llama` (Llama, Mistral, Mixtral), :func:`patch_qwen` (Qwen2, Qwen2-MoE, Qwen3,
Qwen3-MoE) and :func:`patch_gemma` (Gemma, Gemma 2, Gemma 3), each the same swap restricted
to its family's classes.

Two families of RMSNorm exist in ``transformers``, and each swapped module reproduces its
family's arithmetic and output dtype (read from ``transformers`` 5.23's modeling files):

* **Llama** (``LlamaRMSNorm``, and the identical Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3,
  Qwen3-MoE classes): ``weight * (x·rstd).to(input_dtype)`` with ``x·rstd`` in fp32; the
  result has ``torch.promote_types(weight.dtype, input.dtype)`` (an fp32 weight with a bf16
  input returns fp32). Our preset: ``casting_mode="llama"``, no offset, that ``out_dtype``.
* **Gemma** (``GemmaRMSNorm``, ``Gemma2RMSNorm``, ``Gemma3RMSNorm``): ``(x·rstd) · (1 +
  weight)`` in fp32, cast to the input dtype; the weight starts at zeros. Our preset:
  ``casting_mode="gemma"``, ``offset=1.0``, the input dtype.

What is bit for bit HF's (tests/test_hf.py checks each norm call of every family):

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

import torch
from torch import nn

from nki_rmsnorm import torch as nki_torch

__all__ = ["GemmaRMSNorm", "LlamaRMSNorm", "apply", "patch_gemma", "patch_llama", "patch_qwen"]

#: ``transformers`` RMSNorm classes computed as LlamaRMSNorm does (checked against the
#: modeling sources by tests/test_hf.py).
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


class LlamaRMSNorm(nn.Module):
    """HF ``LlamaRMSNorm`` on the NKI kernels: ``weight * (x·rstd).to(x.dtype)``."""

    def __init__(self, weight: nn.Parameter, variance_epsilon: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = variance_epsilon

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return nki_torch.rms_norm(
            hidden_states,
            hidden_states.shape[-1:],
            _kernel_weight(self.weight, hidden_states),
            self.variance_epsilon,
            casting_mode="llama",
            out_dtype=torch.promote_types(self.weight.dtype, hidden_states.dtype),
        )

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
        return nki_torch.rms_norm(
            x,
            x.shape[-1:],
            _kernel_weight(self.weight, x),
            self.eps,
            offset=1.0,
            casting_mode="gemma",
        )

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, NKI gemma preset"


def _replacement(module: nn.Module) -> nn.Module | None:
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return None
    if cls.__name__ in LLAMA_STYLE:
        return LlamaRMSNorm(module.weight, float(module.variance_epsilon))
    if cls.__name__ in GEMMA_STYLE:
        return GemmaRMSNorm(module.weight, float(module.eps))
    return None


def apply(model: nn.Module) -> list[str]:
    """Replace, in place, every Llama-/Gemma-family RMSNorm of a ``transformers`` model by
    the NKI-kernel module of its family; returns the qualified names of the replaced modules
    (empty when the model has none)."""
    return _swap(model, LLAMA_STYLE | GEMMA_STYLE)


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


def _swap(model: nn.Module, classes: frozenset) -> list[str]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    swaps = [
        (name, new)
        for name, module in model.named_modules()
        if type(module).__name__ in classes and (new := _replacement(module)) is not None
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
