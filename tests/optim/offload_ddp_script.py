"""OffloadAdamW under DistributedDataParallel on gloo (run by test_offload_adamw): each rank takes half of every
batch of 8; DDP averages the gradients, so the losses (averaged over the ranks) are one process's over the
whole batch. The state is on NVMe under <out>/nvme; rank 0 writes the losses to <out>/losses.txt."""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from test_offload_adamw import VOCAB, TinyLM, batch, groups  # noqa: E402

from infinity.optim import OffloadAdamW  # noqa: E402

out = sys.argv[1]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = TinyLM()
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = OffloadAdamW(groups(model), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, offload="nvme",
                   nvme_path=os.path.join(out, "nvme"), sub_group_size=700)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * max(0.1, 1 - s / 40))
g = torch.Generator().manual_seed(1)
losses = []
for _ in range(8):
    x, y = batch(g)
    share = slice(rank * 8 // world, (rank + 1) * 8 // world)
    loss = F.cross_entropy(ddp(x[share]).reshape(-1, VOCAB), y[share].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    sched.step()
    opt.zero_grad()
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    losses.append(whole.item() / world)
opt.close()
if rank == 0:
    with open(os.path.join(out, "losses.txt"), "w") as f:
        f.write(" ".join(repr(v) for v in losses))
dist.destroy_process_group()
