"""An Apex-era FP16_Optimizer script (the shape of the 2018-2019 language-model
and translation trainers), unmodified: a model.half() model, FP16_Optimizer with a
dynamic loss scale, optimizer.backward(loss), clip_master_grads, and its
state_dict in the checkpoint.

usage: fp16_optimizer_lm.py CHECKPOINT [--steps 4]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex.fp16_utils import FP16_Optimizer, to_python_float

parser = argparse.ArgumentParser()
parser.add_argument("checkpoint")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()


class LM(nn.Module):
    def __init__(self, vocab=20, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.out(self.norm(torch.tanh(self.rnn(self.emb(tokens)))))


torch.manual_seed(0)
model = LM().half()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True, verbose=False)

g = torch.Generator().manual_seed(7)
tokens = torch.randint(0, 20, (8, 6), generator=g)
losses, scales = [], []
for step in range(args.steps):
    optimizer.zero_grad()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, 20), tokens[:, 1:].reshape(-1))
    optimizer.backward(loss)
    optimizer.clip_master_grads(1.0)
    optimizer.step()
    losses.append(to_python_float(loss))
    scales.append(optimizer.loss_scale)

torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.checkpoint)
state = torch.load(args.checkpoint, weights_only=False)
optimizer.load_state_dict(state["optimizer"])
sys.stdout.flush()
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(dict(
    losses=losses, scales=scales, weight_dtype=str(model.out.weight.dtype),
    master_dtype=str(optimizer.param_groups[0]["params"][0].dtype),
)) + "\n").encode())
