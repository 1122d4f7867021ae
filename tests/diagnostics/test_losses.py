"""The loss of every backward (diagnostics.losses): recorded unscaled, kept
bounded, reported, and drawn by plot() beside the loss-scale history."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import AmpWarning
from amp_patch.diagnostics import losses


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_true_loss_of_each_plain_backward_is_recorded_under_fp16_scaling(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, init_scale=2.0 ** 24, verbosity=0)
    x, y = _data()
    seen = []
    try:
        for _ in range(12):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            seen.append(loss.item())
        rep = amp_patch.report()
        scaled = rep.loss_scale[0]
        assert scaled["skipped"] >= 1  # 2**24 overflows at first: the loss was scaled by millions
        assert rep.losses == [(0, step, v) for step, v in enumerate(seen)]  # unscaled, one per step
        assert "loss 0: 12 backwards" in str(rep) and rep.to_dict()["losses"][0] == [0, 0, seen[0]]
        amp_patch.plot(tmp_path / "both.png")
    finally:
        amp_patch.deinitialize()
    assert _png_size(tmp_path / "both.png") == (1250, 500)  # the loss beside the scale
    assert amp_patch.report().losses[-1] == (0, 11, seen[-1])  # after deinitialize: the last run's


def test_scale_loss_records_its_loss_once_with_its_loss_id():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, num_losses=2, verbosity=0)
    x, y = _data()
    try:
        for step in range(3):
            opt.zero_grad()
            a = F.mse_loss(model(x).float(), y)
            with amp_patch.scale_loss(a, opt, loss_id=1) as scaled:
                scaled.backward()
            opt.step()
        got = amp_patch.report().losses
    finally:
        amp_patch.deinitialize()
    assert [(lid, step) for lid, step, _ in got] == [(1, 0), (1, 1), (1, 2)]
    assert all(0 < v < 100 for _, _, v in got)  # the true loss, not the scaled one (65536 times more)


@pytest.mark.quick
def test_gradient_accumulation_gives_several_losses_to_one_step():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O4", verbosity=0)
    x, y = _data()
    try:
        for _ in range(2):
            for half in (x[:16], x[16:]):
                F.mse_loss(model(half), y[:16]).backward()
            opt.step()
            opt.zero_grad()
        steps = [step for _, step, _ in amp_patch.report().losses]
    finally:
        amp_patch.deinitialize()
    assert steps == [0, 0, 1, 1]


def test_o0_patches_no_backward_and_records_nothing_but_plot_draws_given_losses(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O0", verbosity=0)
    x, y = _data()
    mine = []
    try:
        for _ in range(4):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            mine.append(loss.detach())
        assert amp_patch.report().losses == []
        assert "loss (the true loss" not in str(amp_patch.report())
        with warnings.catch_warnings():
            warnings.simplefilter("error", AmpWarning)  # something to draw: no warning
            amp_patch.plot(tmp_path / "given.png", losses=mine)
    finally:
        amp_patch.deinitialize()
    assert _png_size(tmp_path / "given.png") == (1250, 500)


def test_the_log_copies_to_the_host_in_chunks_keeps_order_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(losses, "CHUNK", 4)
    log = losses.LossLog(maxlen=10)
    for i in range(13):
        log.add(torch.tensor(float(i)), 0, i // 2)
        assert len(log._pending) < 4
    assert log.count == 13
    assert log.last().item() == 12.0
    rows = log.rows()
    assert rows == [(0, i // 2, float(i)) for i in range(3, 13)]  # the newest 10, oldest first
    view = torch.arange(5.0)[2]  # a view: kept as a copy, not the tensor it views
    log.add(view, 1, 7)
    assert log._pending[-1][2]._base is None and log.rows()[-1] == (1, 7, 2.0)


@pytest.mark.quick
def test_non_losses_are_not_recorded():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O4", verbosity=0)
    x, y = _data()
    try:
        out = model(x)
        out.backward(torch.ones_like(out))  # an explicit gradient: not a loss
        F.mse_loss(model(x), y).backward(retain_graph=False)
        got = amp_patch.report().losses
    finally:
        amp_patch.deinitialize()
    assert len(got) == 1
