"""pytest-benchmark view of the suite: one benchmark per workload and mode.

    python -m pytest benchmarks --benchmark-enable --benchmark-group-by=param:workload

Each benchmark runs in this process, so amp_patch modes are initialized and
deinitialized around their own benchmark. For ratios that survive this CPU's
swings in speed use `python benchmarks/suite.py`, which interleaves modes.
"""
from __future__ import annotations

import pytest
import torch

import amp_patch
from amp_patch.precision import onepass
from workloads import MODES, Runner, build

WORKLOADS = ("simplenet", "transformer", "convnet", "smallops")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workload", WORKLOADS)
def test_step(benchmark, workload, mode):
    wl = build(workload, scale=0.25)
    native = onepass.native  # O2-plain and O2-fused leave the one-pass step out
    runner = Runner(wl, mode, "cpu", torch.bfloat16)
    try:
        runner.step()
        benchmark.pedantic(runner.step, rounds=5, iterations=1, warmup_rounds=1)
        assert torch.isfinite(runner.step())
    finally:
        amp_patch.deinitialize()
        onepass.native = native
