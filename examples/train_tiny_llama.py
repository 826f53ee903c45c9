"""Train a tiny two-layer Llama-style model twice: with ``torch.nn.RMSNorm`` and with ours.

A pre-norm decoder (RMSNorm → causal attention → residual, RMSNorm → SwiGLU MLP → residual,
a final RMSNorm and the LM head) learns next-token prediction on a few seeded batches of
random tokens. The two runs share the initial weights, the data and the optimizer; the only
difference is the norm: PyTorch's, or ``nki_rmsnorm.torch.RMSNorm(casting_mode="llama")``,
whose forward and backward run the NKI kernels (simulated on the CPU). In float32 the two
loss curves must agree to about 1e-4; the script prints both and exits non-zero otherwise.

    python examples/train_tiny_llama.py [--steps 30]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from nki_rmsnorm.torch import RMSNorm

VOCAB, D_MODEL, HEADS, D_FF, LAYERS = 128, 64, 4, 128, 2
BATCH, SEQ = 4, 32
EPS = 1e-6
TOLERANCE = 1e-4


class Block(nn.Module):
    def __init__(self, make_norm):
        super().__init__()
        self.attn_norm, self.mlp_norm = make_norm(), make_norm()
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL, bias=False)
        self.out = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.gate_up = nn.Linear(D_MODEL, 2 * D_FF, bias=False)
        self.down = nn.Linear(D_FF, D_MODEL, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, -1).transpose(1, 3).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, D_MODEL))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyLlama(nn.Module):
    def __init__(self, make_norm):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block(make_norm) for _ in range(LAYERS))
        self.norm = make_norm()
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def train(make_norm, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = TinyLlama(make_norm)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A few fixed batches of random tokens, cycled: the model can memorise them, so the
    # loss falls well below log(VOCAB) within a few dozen steps.
    data = torch.randint(0, VOCAB, (4, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(steps):
        tokens = data[step % len(data)]
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    runs = {}
    for name, make_norm in (
        ("torch.nn.RMSNorm", lambda: nn.RMSNorm(D_MODEL, eps=EPS)),
        ("nki_rmsnorm (llama)", lambda: RMSNorm(D_MODEL, eps=EPS, casting_mode="llama")),
    ):
        start = time.perf_counter()
        runs[name] = train(make_norm, args.steps)
        print(f"{name:>20}: {args.steps} steps in {time.perf_counter() - start:.1f} s")

    (name_a, losses_a), (name_b, losses_b) = runs.items()
    print(f"\n{'step':>4}  {name_a:>20}  {name_b:>20}  {'|diff|':>9}")
    for step, (a, b) in enumerate(zip(losses_a, losses_b)):
        print(f"{step:>4}  {a:>20.6f}  {b:>20.6f}  {abs(a - b):>9.2e}")
    worst = max(abs(a - b) for a, b in zip(losses_a, losses_b))
    print(
        f"\nmax |loss difference| = {worst:.2e} (tolerance {TOLERANCE:.0e}); "
        f"loss {losses_a[0]:.3f} -> {losses_a[-1]:.3f}"
    )
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
