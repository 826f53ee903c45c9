"""``DistributedDataParallel`` (gloo, 2 processes on the loopback interface) vs one process.

Run as a script by ``test_distributed.py``: ``python dist_torch_ddp.py PORT``. Each rank
trains on its half of the batch; DDP averages the gradients, which must equal the gradients
of one process on the full batch. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from nki_rmsnorm.torch import RMSNorm

WORLD_SIZE = 2
BATCH, SEQ, HIDDEN = 4, 6, 32


class Block(nn.Module):
    """Linear → our RMSNorm (offset and bias, so every parameter gradient is exercised)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm = RMSNorm(HIDDEN, eps=1e-6, offset=1.0, bias=True)

    def forward(self, x):
        return self.norm(self.proj(x))


def make_model_and_data():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        model.norm.weight.normal_(0, 0.1)
        model.norm.bias.normal_(0, 0.1)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    target = torch.randn(BATCH, SEQ, HIDDEN)
    return model, x, target


def gradients(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def single_process_gradients():
    model, x, target = make_model_and_data()
    nn.functional.mse_loss(model(x), target).backward()
    return gradients(model)


def worker(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        model, x, target = make_model_and_data()
        ddp = nn.parallel.DistributedDataParallel(model)
        shard = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
        nn.functional.mse_loss(ddp(x[shard]), target[shard]).backward()

        expected = single_process_gradients()
        for name, grad in gradients(model).items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
        if rank == 0:
            diff = (model.norm.weight.grad - expected["norm.weight"]).abs().max().item()
            print(
                f"DDP over {WORLD_SIZE} gloo processes matches one process "
                f"(max |dweight diff| {diff:.3g})"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(int(sys.argv[1]),), nprocs=WORLD_SIZE, join=True)
