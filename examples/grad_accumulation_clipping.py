"""Gradient accumulation with gradient clipping, under amp_patch.

Each optimizer step sums the gradients of ``--accumulate`` micro-batches,
then clips them to ``--max-norm``. The loop is the plain FP32 one: amp_patch
scales each ``loss.backward()`` and hands back unscaled gradients, so the
clipping sees the true gradient norm, and a step whose gradients overflowed
is skipped.

At the end it checks what clipping sees: the accumulated gradient norm under
AMP against the same micro-batches in FP32.

    python examples/grad_accumulation_clipping.py --steps 20 --accumulate 4
"""
import argparse
import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
parser.add_argument("--micro-batch", type=int, default=16)
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--half-dtype", default=None,
                    help="float16 or bfloat16 (default: FP16 on CUDA, BF16 on CPU; float16 on a CPU shows loss scaling)")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

torch.manual_seed(0)
true_w = torch.randn(32, 1, device=device)


def batch(n):
    x = torch.randn(n, 32, device=device)
    return x, x @ true_w + 0.1 * torch.randn(n, 1, device=device)


model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp_patch.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=args.half_dtype)


held_out = batch(256)


def held_out_loss():
    with torch.no_grad():
        return F.mse_loss(model(held_out[0]), held_out[1]).item()


def grads():
    return torch.cat([p.grad.flatten() for p in model.parameters()])


try:
    largest_clipped = 0.0
    loss_before = held_out_loss()
    for step in range(args.steps):
        total = 0.0
        for _ in range(args.accumulate):
            xm, ym = batch(args.micro_batch)
            loss = F.mse_loss(model(xm), ym) / args.accumulate
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm).item()
        after = grads().norm().item()
        if math.isfinite(after):  # an overflowed step is skipped, not clipped
            largest_clipped = max(largest_clipped, after)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}: loss {total:.4f}, gradient norm {norm:.4f} before clipping")
    print(f"largest gradient norm after clipping: {largest_clipped:.4f} (max_norm {args.max_norm})")
    print(f"held-out loss: {loss_before:.4f} before training, {held_out_loss():.4f} after")

    # What clipping sees is the true gradient: the same micro-batches with
    # casting (and so loss scaling) off give the FP32 gradient norm.
    micro = [batch(args.micro_batch) for _ in range(args.accumulate)]
    norms = []
    for casts_off in (False, True):
        with amp_patch.disable_casts() if casts_off else contextlib.nullcontext():
            for xm, ym in micro:
                (F.mse_loss(model(xm), ym) / args.accumulate).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf).item())
        optimizer.zero_grad()
    amp_norm, fp32_norm = norms
    print(f"gradient norm clipping sees: {amp_norm:.4f} with AMP, {fp32_norm:.4f} in FP32 "
          f"(relative difference {abs(amp_norm - fp32_norm) / fp32_norm:.2e})")
    for s in amp_patch.report().loss_scale:
        print(f"loss scale: {s['steps']} steps, {s['skipped']} skipped, scale now {s['scale']:g}")
finally:
    amp_patch.deinitialize()
