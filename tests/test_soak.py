"""Soak: 10,000 O1 steps of a small network, with memory that stays flat.

Not in the default run (``setup.cfg`` deselects the ``soak`` marker); run it
with ``python -m pytest -m soak``.

Checked: the weight-cast cache never holds more than one entry per
parameter and is empty after every backward; Python objects and resident
memory do not grow between the first quarter of the run and its end (beyond
the loss scaler's bounded history); the patch count never changes; and after
``deinitialize`` no wrapper, cache or AMP state outlives the run.
"""
from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
import torch
import wrapt
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.scaling.scaler import HISTORY_LENGTH

STEPS = 10_000
CHECKPOINTS = (2_500, 5_000, STEPS)

pytestmark = [pytest.mark.soak, pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")]


def _rss_bytes():
    """Resident memory now (Linux), else the peak so far (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _wrappers():
    return sum(1 for o in gc.get_objects() if issubclass(type(o), (wrapt.FunctionWrapper, wrapt.BoundFunctionWrapper)))


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_ten_thousand_o1_steps_with_flat_memory(half):
    from amp_patch.base import running

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    n_params = len(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(16)]

    gc.collect()
    wrappers_before = _wrappers()
    model, opt = amp_patch.initialize(model, opt, "O1", half_dtype=half, verbosity=0)
    amp = running.session()
    cache, patches = amp.cache, len(amp.patcher)
    scaler = amp.scaling.scalers[0]
    marks = {}
    worst_cache = 0
    first = last = None
    try:
        for step in range(1, STEPS + 1):
            x, t = data[step % len(data)]
            opt.zero_grad(set_to_none=step % 2 == 0)
            out = model(x)
            worst_cache = max(worst_cache, len(cache))
            loss = F.mse_loss(out.float(), t)
            loss.backward()
            assert len(cache) == 0  # emptied by every backward
            opt.step()
            if step == 1:
                first = loss.item()
            if step in CHECKPOINTS:
                gc.collect()
                marks[step] = (len(gc.get_objects()), _rss_bytes(), len(scaler.history))
                assert len(amp.patcher) == patches  # nothing patched twice, nothing lost
        last = loss.item()
        counters = amp_patch.counters()
    finally:
        amp_patch.deinitialize()

    assert out.dtype == half
    assert last < first
    assert counters["steps"] + counters["skipped"] == STEPS and counters["skipped"] <= 5
    assert 0 < worst_cache <= n_params  # one cast per weight, reused within the step
    (objs0, rss0, hist0), (objs1, rss1, hist1) = marks[CHECKPOINTS[0]], marks[STEPS]
    assert hist1 <= HISTORY_LENGTH
    # The scaler's history is bounded by design; nothing else may grow.
    assert objs1 - objs0 - (hist1 - hist0) < 200, (objs0, objs1, hist0, hist1)
    assert rss1 - rss0 < 16 * 2**20, f"resident memory grew {(rss1 - rss0) / 2**20:.1f} MiB"

    state = weakref.ref(amp)
    del amp, cache, scaler
    gc.collect()
    assert state() is None, "the AMP state outlived deinitialize: " + repr(gc.get_referrers(state())[:3])
    assert _wrappers() == wrappers_before
