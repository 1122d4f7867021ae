"""Helpers shared by the launcher's test scripts (imported as a sibling module,
which needs the script's folder at sys.path[0], as `python script.py` puts it)."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def record_linear_dtypes(model):
    """{layer name: dtype of its output}, filled in by forward hooks."""
    seen = {}
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(name, str(out.dtype)))
    return seen


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)


def report(**fields):
    # One JSON line the tests look for, written with its newline in a single
    # write: torchrun's ranks share one pipe, and an unbuffered print writes
    # the text and the newline separately, so another rank's line could land
    # between them. Flushed so it survives a later exit code.
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(fields, default=str) + "\n").encode())


def destroy_process_group():
    """``dist.destroy_process_group()`` after letting gloo's worker thread finish
    the last collective (as tests/helpers.py does): destroyed while that thread
    still runs, the process aborts at exit ("terminate called without an active
    exception"), with or without amp_patch."""
    time.sleep(0.05)
    dist.destroy_process_group()
