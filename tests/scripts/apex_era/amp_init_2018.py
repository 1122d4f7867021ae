"""A 2018 apex.amp training script, unmodified: the handle API
(`amp_handle = amp.init()`, `amp_handle.scale_loss`) and a user function
registered before init.

usage: amp_init_2018.py [--steps 4] [--no-fp16]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--no-fp16", action="store_true")
args = parser.parse_args()


def gelu_fast(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


class Mods:
    gelu_fast = staticmethod(gelu_fast)


amp.register_float_function(Mods, "gelu_fast")
amp_handle = amp.init(enabled=not args.no_fp16)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

g = torch.Generator().manual_seed(3)
x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
losses, dtypes = [], {}
for step in range(args.steps):
    optimizer.zero_grad()
    hidden = model[0](x)
    dtypes["linear"] = str(hidden.dtype)
    act = Mods.gelu_fast(hidden)
    dtypes["gelu_fast"] = str(act.dtype)
    loss = F.mse_loss(model[1](act).float(), y)
    with amp_handle.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    losses.append(loss.item())

active = amp_handle.is_active()
amp_handle._deactivate()
sys.stdout.flush()
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(dict(
    losses=losses, dtypes=dtypes, active=active, after=str(model[0](x).dtype),
)) + "\n").encode())
