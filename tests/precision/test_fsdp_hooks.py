"""The pieces of O2/O5-on-FSDP2 that need no process group: the first-forward
check that refuses a model sharded after ``initialize`` goes away once it has
looked (the sharded runs themselves are in ``tests/test_fsdp.py``)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp  # noqa: F401  imported, as a script that shards imports it
import torch.nn.functional as F
from torch.nn.modules import module as module_mod

import amp_patch
from amp_patch.precision import fsdp
from amp_patch.precision.model import LateShard
from helpers import amp, mlp

pytestmark = pytest.mark.quick


def _late_hooks():
    return [h for h in module_mod._global_forward_pre_hooks.values() if isinstance(h, LateShard)]


def test_the_late_shard_check_looks_once_at_the_first_forward_and_goes():
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        assert len(_late_hooks()) == 1  # FSDP is imported: a fully_shard after initialize would be caught
        F.mse_loss(model(torch.randn(3, 4)).float(), torch.zeros(3, 2)).backward()
        opt.step()
        assert _late_hooks() == []  # looked once; no cost on later forwards
    assert _late_hooks() == []


def test_the_late_shard_check_goes_after_its_limit_when_only_parts_of_the_model_run():
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        (hook,) = _late_hooks()
        x = torch.randn(3, 4, dtype=torch.bfloat16)
        for _ in range(hook.LIMIT):
            model[0](x)  # a part, never the model itself
        assert _late_hooks() == []
    assert _late_hooks() == []


def test_the_late_shard_check_is_gone_after_deinitialize_even_with_no_forward():
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16):
        assert len(_late_hooks()) == 1
    assert _late_hooks() == []


def test_plain_tensors_are_their_own_local_shards_and_no_model_here_is_sharded():
    t = torch.randn(3)
    assert fsdp.local(t) is t and not fsdp.is_dtensor(t)
    assert not fsdp.sharded(mlp(4, 8, 2)) and fsdp.states(mlp(4, 2)) == []
    assert fsdp.shard_bytes([t]) == (12, 12)
    assert amp_patch.is_initialized() is False
