"""What amp_patch counts: steps taken and skipped per optimizer and per loss,
whether or not a loss scale is active (BF16 runs have none), as ``counters()``,
``state_dict()``, Apex's ``_amp_state`` and the report show them; and the last
run's figures after ``deinitialize``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import amp
from amp_patch.base import running
from helpers import amp as session, batch, mlp, sgd

pytestmark = pytest.mark.quick  # every test here is fast
bf16, f16 = torch.bfloat16, torch.float16


def _train(model, optimizers, steps):
    x, y = batch(0, 4, 1)
    for _ in range(steps):
        for opt in optimizers:
            opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        for opt in optimizers:
            opt.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_bf16_run_counts_its_steps_everywhere(level):
    model = mlp(4, 8, 1)
    with session(model, sgd(model), opt_level=level, half_dtype=bf16, verbosity=0) as (model, opt):
        _train(model, [opt], 10)
        c = amp_patch.counters()
        assert (c["steps"], c["skipped"], c["loss_scale"]) == (10, 0, [1.0])
        assert c["losses"] == [{"loss_scale": 1.0, "dynamic": False, "steps": 10, "skipped": 0, "growth_tracker": 10}]
        # an Apex-era script's view: its checkpoint and _amp_state count the clean steps, as Apex's static scaler did
        sd = amp.state_dict()["loss_scaler0"]
        assert (sd["loss_scale"], sd["unskipped"], sd["steps"]) == (1.0, 10, 10)
        assert amp._amp_state.loss_scalers[0]._unskipped == 10
        assert "loss 0: 10 steps, 0 skipped; scale 1 now (min 1, max 1)" in str(amp_patch.report())


def test_two_optimizers_stepping_each_iteration_count_one_step_of_the_loss():
    """Nothing says which optimizers an unscaled loss fed: its steps are counted
    once per round of optimizer steps, one training iteration here."""
    model = mlp(4, 8, 1)
    first, second = list(model.parameters())[:2], list(model.parameters())[2:]
    opts = [torch.optim.SGD(first, lr=0.01), torch.optim.SGD(second, lr=0.01)]
    with session(model, opts, opt_level="O1", half_dtype=bf16, verbosity=0) as (model, opts):
        _train(model, opts, 4)
        c = amp_patch.counters()
        assert c["steps"] == 8 and [o["steps"] for o in c["optimizers"]] == [4, 4]
        assert c["losses"][0]["steps"] == 4


def test_an_fp16_static_scale_counts_unskipped_steps_as_apex_did():
    model = mlp(4, 8, 1)
    with session(model, sgd(model), opt_level="O1", half_dtype=f16, loss_scale=128.0, verbosity=0) as (model, opt):
        _train(model, [opt], 3)
        sd = amp_patch.state_dict()["loss_scaler0"]
        assert (sd["loss_scale"], sd["unskipped"], sd["steps"], sd["dynamic"]) == (128.0, 3, 3, False)


def test_a_dynamic_scale_still_restarts_its_growth_count_when_it_grows():
    model = mlp(4, 8, 1)
    with session(model, sgd(model), opt_level="O1", half_dtype=f16, growth_interval=2, verbosity=0) as (model, opt):
        _train(model, [opt], 5)
        loss = amp_patch.counters()["losses"][0]
        assert (loss["loss_scale"], loss["steps"], loss["growth_tracker"], loss["dynamic"]) == (2.0**18, 5, 1, True)


def test_counters_and_report_after_deinitialize_are_the_last_runs():
    model = mlp(4, 8, 1)
    model, opt = amp_patch.initialize(model, sgd(model), opt_level="O1", half_dtype=f16, verbosity=0)
    _train(model, [opt], 3)
    during, text = amp_patch.counters(), str(amp_patch.report())
    amp_patch.deinitialize()
    assert amp_patch.counters() == during and during["steps"] == 3
    assert str(amp_patch.report()) == text and "loss 0: 3 steps, 0 skipped; scale 65536 now" in text
    amp_patch.counters()["steps"] = 99  # a copy: the kept figures do not change
    assert amp_patch.counters()["steps"] == 3
    assert running.session() is None

    other = mlp(4, 8, 1)
    with session(other, sgd(other), opt_level="O1", half_dtype=bf16, verbosity=0) as (other, opt):
        assert amp_patch.counters()["steps"] == 0  # a running session's own figures
        _train(other, [opt], 2)
    assert amp_patch.counters()["steps"] == 2 and amp_patch.report().half_dtype == "bfloat16"
