"""An Apex-era training script, unmodified: apex.amp, scale_loss,
master_params clipping and an amp.state_dict() checkpoint.

usage: apex_style.py CHECKPOINT_PATH [--opt-level O1]
"""
import argparse
import math

import torch
import torch.nn.functional as F

import apex
from apex import amp

from amp_script_util import Net, batch, record_linear_dtypes, report

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--opt-level", default="O1")
args = parser.parse_args()

torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
dtypes = record_linear_dtypes(model)

losses = []
for step in range(4):
    x, y = batch(step)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), max_norm=1.0)
    optimizer.step()
    losses.append(loss.item())

state = amp.state_dict()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": state}, args.checkpoint)
checkpoint = torch.load(args.checkpoint)
amp.load_state_dict(checkpoint["amp"])

report(
    linear_dtypes=dtypes,
    losses=losses,
    finite=all(math.isfinite(v) for v in losses),
    amp_module=amp.__name__,
    amp_state={k: {"loss_scale": float(v["loss_scale"]), "unskipped": int(v["unskipped"])} for k, v in state.items() if k.startswith("loss_scaler")},
    reloaded=amp.state_dict()["loss_scaler0"]["loss_scale"] == state["loss_scaler0"]["loss_scale"],
    weight_dtype=str(checkpoint["model"]["fc1.weight"].dtype),
)
