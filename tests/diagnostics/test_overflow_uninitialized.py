"""Overflow provenance does not blame a factory of uninitialized memory
(``torch.empty`` and its kin), whose output may hold any bit pattern, NaN
included, until the op that fills it runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch.base import running


@pytest.mark.quick
@pytest.mark.parametrize("factory", [torch.empty, torch.empty_like, torch.Tensor.new_empty])
def test_uninitialized_memory_is_not_an_overflow(factory):
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, find_overflow=True, verbosity=0)
    try:
        watch = running.session().diagnostics.watch
        assert watch is not None and watch.armed  # find_overflow=True armed it at initialize
        with torch.no_grad():  # the watch looks at the forward pass only: not at this line
            garbage = torch.full((3,), float("nan"))  # what uninitialized memory may hold
        with torch.enable_grad(), torch._C.DisableTorchFunction():
            watch._observe(factory, (), {}, garbage)
            assert watch.event is None
            watch._observe(torch.add, (garbage, 1.0), {}, garbage)  # an op that computes NaN is still named
        assert watch.event is not None and watch.event["op"] == "torch.add"
    finally:
        amp_patch.deinitialize()
