"""Checkpoint and resume a mixed-precision run, bit for bit.

Trains ``--steps`` steps without stopping, then again from the same start but
stopping half way: the model, the optimizer and amp_patch's loss-scaler state
are saved with ``torch.save``, everything is torn down (as if the process
ended), rebuilt, restored, and trained to the end. The resumed run's losses
and final weights equal the uninterrupted run's exactly.

The order that makes it exact: build the model and optimizer, call
``amp_patch.initialize``, *then* load the three state dicts.

    python examples/checkpoint_resume.py --steps 12
"""
import argparse
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--half-dtype", default=None,
                    help="float16 or bfloat16 (default: FP16 on CUDA, BF16 on CPU; float16 on a CPU has a loss scale to save)")
parser.add_argument("--init-scale", type=float, default=None,
                    help="first loss scale of a dynamic scaler (e.g. 16777216 to see it back off before the save)")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
half = args.steps // 2

data_gen = torch.Generator().manual_seed(0)
data = [(torch.randn(16, 20, generator=data_gen).to(device), torch.randint(0, 5, (16,), generator=data_gen).to(device))
        for _ in range(args.steps)]


def build():
    """Model, optimizer and AMP as a fresh process would set them up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 5)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return amp_patch.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=args.half_dtype,
                                init_scale=args.init_scale, verbosity=0)


def train(model, optimizer, steps):
    losses = []
    for x, y in steps:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


# 1. Uninterrupted.
model, optimizer = build()
try:
    straight = train(model, optimizer, data)
    straight_weights = weights(model)
finally:
    amp_patch.deinitialize()

# 2. Stop half way and save.
path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
model, optimizer = build()
try:
    first = train(model, optimizer, data[:half])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "amp": amp_patch.state_dict(), "step": half}, path)
    saved_scale = amp_patch.report().loss_scale[0]["scale"]
finally:
    amp_patch.deinitialize()
del model, optimizer

# 3. A new start: build, initialize, then load.
model, optimizer = build()
try:
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp_patch.load_state_dict(checkpoint["amp"])
    restored_scale = amp_patch.report().loss_scale[0]["scale"]
    second = train(model, optimizer, data[checkpoint["step"]:])
    resumed_weights = weights(model)
finally:
    amp_patch.deinitialize()
os.remove(path)

resumed = first + second
print(f"uninterrupted losses: {' '.join(f'{v:.6f}' for v in straight)}")
print(f"resumed losses:       {' '.join(f'{v:.6f}' for v in resumed)}")
print(f"saved at step {half} of {args.steps} with loss scale {saved_scale:g}; restored {restored_scale:g}")
print(f"losses identical: {resumed == straight}")
print(f"weights identical: {all(torch.equal(a, b) for a, b in zip(straight_weights, resumed_weights))}")
