"""A DistributedDataParallel script (gloo, CPU) with no AMP code; run under torchrun."""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from amp_script_util import Net, batch, destroy_process_group, record_linear_dtypes, report

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
dtypes = record_linear_dtypes(model)
for step in range(3):
    x, y = batch(step * world + rank)  # each rank its own data
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
report(
    rank=rank,
    world=world,
    linear_dtypes=dtypes,
    ranks_identical=all(torch.equal(gathered[0], g) for g in gathered),
    local_rank=os.environ.get("LOCAL_RANK"),
)
destroy_process_group()
