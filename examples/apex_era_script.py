"""A training script written for NVIDIA Apex's ``apex.amp``, unchanged.

Apex's ``amp`` module is gone from current Apex releases. Run this script
through amp_patch's launcher and ``from apex import amp`` is served by
amp_patch, with Apex's API (``amp.initialize``, ``amp.scale_loss``,
``amp.master_params``, ``amp.state_dict``):

    python -m amp_patch run examples/apex_era_script.py --steps 10
    amp-patch run examples/apex_era_script.py --steps 10        # the same

Nothing below mentions amp_patch.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--opt-level", default="O1")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

g = torch.Generator().manual_seed(1)
x = torch.randn(64, 20, generator=g).to(device)
y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()

for step in range(args.steps):
    optimizer.zero_grad()
    output = model(x)
    loss = F.cross_entropy(output, y)
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=5.0)
    optimizer.step()
    if step == 0 or step == args.steps - 1:
        print(f"step {step}: loss {loss.item():.4f}")

accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"apex.amp is {amp.__name__}")
print(f"logits dtype: {output.dtype}")
print(f"loss scaler state: {dict(amp.state_dict()['loss_scaler0'])}")
print(f"training accuracy: {accuracy:.3f}")
