"""Change which ops run in low precision with a YAML override.

The same model runs twice under O1: with the default op lists, then with
``yaml_override.yaml`` beside this script, which moves ``F.linear`` to FP32
and puts ``torch.tanh`` (on no default list) in the half dtype. For each run
it prints the dtype every layer ran in and amp_patch's op report, whose
"unlisted ops seen" section is where ops like ``torch.tanh`` show up first.

    python examples/yaml_override.py
    amp-patch check examples/yaml_override.yaml      # validate a list file
"""
import argparse
import os

import torch
import torch.nn as nn

import amp_patch

HERE = os.path.dirname(os.path.abspath(__file__))
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--lists", default=os.path.join(HERE, "yaml_override.yaml"))
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()


class Tanh(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


model = nn.Sequential()
model.add_module("tanh", Tanh())
model.add_module("fc", nn.Linear(16, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def run(title, lists=None):
    seen = {}
    hooks = [m.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
             for name, m in model.named_children()]
    amp_patch.initialize(model, optimizer, opt_level="O1", lists=lists, collect_stats=True)
    try:
        for _ in range(args.steps):
            optimizer.zero_grad()
            model(torch.randn(4, 16)).square().mean().backward()
            optimizer.step()
        print(f"{title}: " + ", ".join(f"{name} {str(dt).replace('torch.', '')}" for name, dt in seen.items()))
        print(amp_patch.report())
        print()
    finally:
        amp_patch.deinitialize()
        for h in hooks:
            h.remove()


run("default lists")
run(f"with {os.path.basename(args.lists)}", lists=args.lists)
