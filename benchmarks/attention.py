"""Attention on half inputs: torch's half kernel against the FP32 kernel O2 uses where faster.

For each shape, the forward and backward of ``F.scaled_dot_product_attention``
on BF16 (or FP16) inputs, against ``patching.attention.Fp32Attention`` (the
inputs cast up, torch's FP32 CPU flash kernel, the output cast back), timed
in alternation, best of the rounds, one thread; then what
``patching.attention.fp32_wins`` decides for the shape's class here (its own
one-sample measurement and ``MARGIN``).

    python benchmarks/attention.py                # BF16, a table
    python benchmarks/attention.py --dtype float16 --markdown
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from amp_patch.frontends.demo import cpu_name
from amp_patch.patching import attention

#: (batch, heads, query length, key length, head size, causal)
SHAPES = [
    (8, 8, 128, 128, 64, False),   # the suite's transformer
    (8, 8, 128, 128, 64, True),
    (4, 12, 256, 256, 64, True),
    (2, 16, 512, 512, 64, True),
    (8, 4, 64, 64, 32, False),
    (2, 8, 128, 128, 128, False),
    (1, 8, 1024, 1024, 64, True),
]


def measure(shape, dtype, rounds):
    b, h, lq, lk, e, causal = shape
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, h, lq, e, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, h, lk, e, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, h, lk, e, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(b, h, lq, e, generator=g).to(dtype)

    def half():
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dout)

    def fp32():
        torch.autograd.grad(attention.Fp32Attention.apply(q, k, v, None, causal, None), (q, k, v), dout)

    half(), fp32()  # warm-up
    t_half, t_fp32 = attention.time_pair(half, fp32, rounds)
    chosen = attention.fp32_wins(lq, lk, e, causal, False, dtype, F.scaled_dot_product_attention)
    return t_half, t_fp32, chosen


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} thread(s), {args.dtype}; forward+backward, best of {args.rounds}")
    head = "| batch x heads x query x key x head size | causal | half ms | FP32 kernel ms | FP32 / half | O2 runs it in |"
    print(head if args.markdown else head.replace("|", " "))
    if args.markdown:
        print("|---|---|---|---|---|---|")
    for shape in SHAPES:
        t_half, t_fp32, chosen = measure(shape, dtype, args.rounds)
        b, h, lq, lk, e, causal = shape
        row = (f"| {b} x {h} x {lq} x {lk} x {e} | {'yes' if causal else 'no'} | {t_half:.2f} | {t_fp32:.2f} | "
               f"{t_fp32 / t_half:.2f} | {'float32' if chosen else args.dtype} |")
        print(row if args.markdown else row.replace("|", " "))


if __name__ == "__main__":
    main()
