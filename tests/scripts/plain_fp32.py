"""A plain FP32 training loop with no AMP code at all.

usage: plain_fp32.py [--steps N] [--exit CODE] [--raise] [--optimizer sgd|adamw] [-- extra ...]
"""
import os
import sys

import torch
import torch.nn.functional as F

from amp_script_util import Net, batch, record_linear_dtypes, report


def main(argv):
    steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 3
    torch.manual_seed(0)
    model = Net()
    if "adamw" in argv:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dtypes = record_linear_dtypes(model)
    losses = []
    for step in range(steps):
        x, y = batch(0)  # one batch, so the loss must fall step by step
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    report(
        name=__name__,
        file=__file__,
        argv=sys.argv,
        path0=sys.path[0],
        cwd=os.getcwd(),
        linear_dtypes=dtypes,
        losses=losses,
        weight_dtype=str(model.fc1.weight.dtype),
        grad_dtype=str(model.fc1.weight.grad.dtype),
    )
    if "--raise" in argv:
        raise RuntimeError("boom from the training script")
    if "--exit" in argv:
        sys.exit(int(argv[argv.index("--exit") + 1]))


if __name__ == "__main__":
    main(sys.argv[1:])
