"""apex.fp16_utils stand-in: FP16_Optimizer, the loss scalers, the conversion
and master-weight helpers, checked against Apex's rules written out here.

Everything runs in FP16 on the CPU with tiny tensors, without
amp_patch.initialize, as the scripts that use these run.
"""
from __future__ import annotations

import importlib
import io
import logging
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.apex import fp16_utils
from amp_patch.apex.scaler import LossScaler as Served
from amp_patch.apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Module,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from amp_patch.frontends import alias
from helpers import batch, mlp, unannotated

f16, f32 = torch.float16, torch.float32

# apex/fp16_utils/__init__.py at e13873de (the last Apex with fp16_utils), and
# FP16_Module with its two helpers, which 2018 Apex exported too
APEX_NAMES = {
    "BN_convert_float", "network_to_half", "prep_param_lists", "model_grads_to_master_grads",
    "master_params_to_model_params", "tofp16", "to_python_float", "clip_grad_norm", "convert_module",
    "convert_network", "FP16Model", "FP16_Optimizer", "LossScaler", "DynamicLossScaler",
}
APEX_2018_NAMES = {"FP16_Module", "fp32_to_fp16", "fp16_to_fp32"}
APEX_SUBMODULES = {"fp16_optimizer", "fp16util", "loss_scaler"}
APEX_STATE_KEYS = {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                   "optimizer_state_dict", "fp32_from_fp16"}


def half_net(seed=0):
    """Linear -> BatchNorm1d -> ReLU -> Linear, through network_to_half: FP16 with the batchnorm FP32."""
    return network_to_half(mlp(6, 8, 3, seed=seed, norm="batch"))


class Inf:
    """A gradient hook that makes the gradient inf while ``on``."""

    def __init__(self):
        self.on = False

    def __call__(self, grad):
        if not self.on:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad


def loss_of(model, i):
    x, y = batch(i, 6, 3)
    return F.mse_loss(model(x).float(), y)


def train(model, opt, steps, first=0, inf=None, overflow_at=()):
    """``steps`` Apex-style steps on batches ``first``...; returns the scale each step used."""
    used = []
    for i in range(first, first + steps):
        if inf is not None:
            inf.on = i in overflow_at
        opt.zero_grad()
        used.append(opt.loss_scale)
        opt.backward(loss_of(model, i))
        opt.clip_master_grads(1.0)
        opt.step()
    return used


# ------------------------------------------------------------------ the names scripts import


def test_star_import_and_signatures_match_apex():
    ns = {}
    exec("from amp_patch.apex.fp16_utils import *", ns)
    assert set(ns) - {"__builtins__"} == APEX_NAMES | APEX_2018_NAMES | APEX_SUBMODULES
    assert ns["fp16util"] is fp16_utils.fp16util and ns["clip_grad_norm"] is torch.nn.utils.clip_grad_norm_
    assert unannotated(FP16_Optimizer.__init__) == (
        "(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)"
    )
    assert unannotated(FP16_Optimizer.backward) == "(self, loss, update_master_grads=True, retain_graph=False)"
    assert unannotated(FP16_Optimizer.zero_grad) == "(self, set_grads_to_None=False)"
    assert unannotated(FP16_Optimizer.clip_master_grads) == "(self, max_norm, norm_type=2)"
    assert unannotated(FP16_Optimizer.step) == "(self, closure=None)"
    assert unannotated(prep_param_lists) == "(model, flat_master=False)"
    assert unannotated(DynamicLossScaler.__init__) == "(self, init_scale=4294967296, scale_factor=2.0, scale_window=1000)"
    assert unannotated(LossScaler.__init__) == "(self, scale=1)"
    assert fp16_utils.loss_scaler.to_python_float is to_python_float


# ------------------------------------------------------------------ FP16_Optimizer training


@pytest.mark.quick
def test_training_loop_masters_match_a_hand_written_fp32_step():
    """Apex's loop (network_to_half, backward, clip_master_grads, step) with SGD
    + momentum: the FP32 masters follow a hand-written FP32 SGD step fed the
    same half gradients, unscaled and clipped by hand."""
    torch.manual_seed(0)
    model = half_net()
    params = list(model.parameters())
    assert [p.dtype for p in params] == [f16, f16, f32, f32, f16, f16]  # BN_convert_float kept BN FP32
    lr, momentum, scale = 0.1, 0.9, 128.0
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=lr, momentum=momentum), static_loss_scale=scale, verbose=False)
    ref = [p.detach().float().clone() for p in params]
    bufs = [None] * len(ref)
    for i in range(4):
        opt.zero_grad()
        loss = loss_of(model, i) * 20  # big enough that clipping to 1.0 bites
        half_grads = torch.autograd.grad(loss.float() * scale, params, retain_graph=True)
        opt.backward(loss)
        norm = opt.clip_master_grads(1.0)
        opt.step()

        grads = [g.float() / scale for g in half_grads]
        total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).float()
        assert norm > 1.0
        torch.testing.assert_close(norm, total, rtol=1e-5, atol=0)
        coef = min(1.0, 1.0 / (total.item() + 1e-6))
        for j, g in enumerate(grads):
            g = g * coef
            bufs[j] = g.clone() if bufs[j] is None else bufs[j] * momentum + g
            ref[j] = ref[j] - lr * bufs[j]

        masters = [p for group in opt.param_groups for p in group["params"]]
        assert all(m.dtype == f32 for m in masters)
        for m, r in zip(masters, ref):
            torch.testing.assert_close(m.detach(), r, rtol=2e-6, atol=1e-7)
        for p, m in zip(params, masters):
            assert p.dtype in (f16, f32) and torch.equal(p.detach(), m.detach().to(p.dtype))
    assert [m.dtype for m in opt.fp32_from_fp16_groups[0]] == [f32] * 4
    # the FP32 batchnorm is its own master
    assert [id(p) for p in opt.fp32_from_fp32_groups[0]] == [id(p) for p in params[2:4]]
    assert not amp_patch.is_initialized()


def test_adam_trains_without_amp_patch_initialize():
    model = half_net()
    opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True, verbose=False)
    first = loss_of(model, 0).item()
    for _ in range(15):
        opt.zero_grad()
        opt.backward(loss_of(model, 0))
        opt.step()
    assert loss_of(model, 0).item() < 0.8 * first
    assert not amp_patch.is_initialized()


def test_several_losses_sum_as_one():
    """backward(l1); backward(l2) and the delayed form both give the gradient
    of l1 + l2, FP32 parameters included (their gradients are unscaled once)."""

    def master_grads(how):
        model = half_net()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0, verbose=False)
        opt.zero_grad()
        l1, l2 = loss_of(model, 0), loss_of(model, 1)
        if how == "one":
            opt.backward(l1 + l2)
        elif how == "each":
            opt.backward(l1)
            opt.backward(l2)
        else:
            opt.backward(l1, update_master_grads=False)
            opt.backward(l2, update_master_grads=False)
            opt.update_master_grads()
        return [g.clone() for g in opt.inspect_master_grad_data()[0]]

    one = master_grads("one")
    for how in ("each", "delayed"):
        for a, b in zip(master_grads(how), one):
            torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-5)


def test_model_zero_grad_between_steps_is_enough():
    """Apex's examples clear gradients with model.zero_grad(), which cannot reach
    the masters: a step uses their gradients up, so the next backward starts anew."""

    def run(clear):
        model = half_net()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=32.0, verbose=False)
        for i in range(3):
            (model if clear == "model" else opt).zero_grad()
            opt.backward(loss_of(model, i))
            opt.step()
        return [p.detach().clone() for p in opt.param_groups[0]["params"]]

    for a, b in zip(run("model"), run("optimizer")):
        assert torch.equal(a, b)


def test_closure_step_repeats_an_overflowing_evaluation(caplog):
    model = half_net()
    inf = Inf()
    model[1][3].weight.register_hook(inf)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 1024.0}, verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    calls = []

    def closure():
        inf.on = not calls  # the first evaluation overflows
        calls.append(opt.loss_scale)
        opt.zero_grad()
        loss = loss_of(model, 0)
        opt.backward(loss)
        return loss

    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        loss = opt.step(closure)
    assert calls == [1024.0, 512.0] and isinstance(loss, torch.Tensor)
    assert "OVERFLOW within closure! Skipping step, reducing loss scale to 512.0" in caplog.text
    assert not torch.equal(before[-2], model[1][3].weight.detach())  # stepped
    for p, m in zip(model.parameters(), opt.param_groups[0]["params"]):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
    assert opt.first_closure_call_this_step


# ------------------------------------------------------------------ loss scaling


def apex_amp_scales(init, window, overflow_at, steps, ceiling):
    """The scale each step uses under apex.amp's scaler, which FP16_Optimizer used
    from 2019 on: halve on overflow (step skipped), double after ``window`` clean
    updates, never above ``ceiling``."""
    scale, unskipped, out = min(init, ceiling), 0, []
    for i in range(steps):
        out.append(scale)
        if i in overflow_at:
            scale, unskipped = scale / 2, 0
            continue
        unskipped += 1
        if unskipped == window:
            scale, unskipped = min(ceiling, scale * 2), 0
    return out


# scales stay small: a real FP16 overflow would add skips the test did not choose
@pytest.mark.parametrize("init, window, overflow_at, ceiling", [
    (2.0**10, 3, {1, 2, 7}, None),
    (2.0**9, 2, {5}, 2.0**11),  # grows into the ceiling and stays there
    (2.0**32, 4, {0}, 2.0**11),  # an old DynamicLossScaler init_scale is clamped to the ceiling first
])
def test_dynamic_scale_follows_apex_and_overflow_skips_the_step(init, window, overflow_at, ceiling, caplog):
    model = half_net()
    inf = Inf()
    model[1][3].weight.register_hook(inf)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": init, "scale_window": window, "max_loss_scale": ceiling},
                         verbose=False)
    steps = 12
    used = []
    for i in range(steps):
        inf.on = i in overflow_at
        masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
        halves = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        used.append(opt.loss_scale)
        opt.backward(loss_of(model, i))
        assert opt.overflow == (i in overflow_at)
        norm = opt.clip_master_grads(1.0)
        with caplog.at_level(logging.WARNING, logger="amp_patch"):
            caplog.clear()
            opt.step()
        now = [p.detach() for g in opt.param_groups for p in g["params"]]
        same = all(torch.equal(a, b) for a, b in zip(masters, now))
        same_model = all(torch.equal(a, b.detach()) for a, b in zip(halves, model.parameters()))
        if i in overflow_at:
            assert norm == -1 and same and same_model
            assert f"Gradient overflow.  Skipping step, reducing loss scale to {opt.loss_scale}" in caplog.text
            with pytest.warns(amp_patch.AmpWarning, match="overflow state"):
                assert opt.inspect_master_grad_data() is None
        else:
            assert not same and not same_model and not caplog.text
    assert used == apex_amp_scales(init, window, overflow_at, steps, ceiling or 2.0**24)


def test_static_scale_scales_the_loss_and_never_skips():
    """The loss is multiplied by the static scale, the masters get the
    gradients divided by it, and (as in Apex) nothing is checked for overflow."""
    model = half_net()
    params = list(model.parameters())
    opt = FP16_Optimizer(torch.optim.SGD(params, lr=0.1), static_loss_scale=256.0, verbose=False)
    loss = loss_of(model, 0)
    expected = torch.autograd.grad(loss.float() * 256.0, params, retain_graph=True)
    opt.backward(loss, update_master_grads=False)
    for p, g in zip(params, expected):
        assert torch.equal(p.grad, g)  # the model holds the scaled gradients
    opt.update_master_grads()
    for m, g in zip(opt.inspect_master_grad_data()[0], expected):
        assert m.dtype == f32 and torch.equal(m, g.float() / 256.0)

    inf = Inf()
    model[1][3].weight.register_hook(inf)
    inf.on = True
    opt.zero_grad()
    opt.backward(loss_of(model, 1))
    assert not opt.overflow and opt.loss_scale == 256.0
    opt.step()
    assert not torch.isfinite(opt.fp32_from_fp16_groups[0][2]).all()  # stepped on the inf


def old_dynamic_scales(init, factor, window, overflows):
    """2018 Apex's DynamicLossScaler, by its documented rule: divide by ``factor``
    on overflow (floor 1), multiply every ``window``-th clean iteration since the
    last overflow."""
    scale, clean, out = init, 0, []
    for overflow in overflows:
        if overflow:
            scale, clean = max(scale / factor, 1), 0
        else:
            clean += 1
            if clean % window == 0:
                scale *= factor
        out.append(scale)
    return out


@pytest.mark.quick
def test_dynamic_loss_scaler_rules():
    assert DynamicLossScaler().loss_scale == 2**32
    overflows = [False] * 7 + [True, True] + [False] * 10 + [True] + [False] * 4
    for init, factor, window in ((2.0**32, 2.0, 3), (4.0, 4.0, 2), (2.0**5, 2.0, 1000)):
        scaler = DynamicLossScaler(init_scale=init, scale_factor=factor, scale_window=window)
        seen = []
        for overflow in overflows:
            scaler.update_scale(overflow)
            seen.append(scaler.loss_scale)
        assert seen == old_dynamic_scales(init, factor, window, overflows)
    floor = DynamicLossScaler(init_scale=4.0)
    for _ in range(5):
        floor.update_scale(True)
    assert floor.cur_scale == 1


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_loss_scalers_check_and_scale(bad):
    w = torch.ones(3, requires_grad=True)
    dynamic, static = DynamicLossScaler(init_scale=8.0), LossScaler(8.0)
    for scaler in (dynamic, static):
        w.grad = None
        scaler.backward((w * 2).sum())
        assert torch.equal(w.grad, torch.full((3,), 16.0))
        assert not scaler.has_overflow([w])
    w.grad[1] = bad
    assert dynamic.has_overflow([w]) and not static.has_overflow([w])
    static.update_scale(True)
    assert static.loss_scale == 8.0
    grads = static.scale_gradient(None, (torch.ones(2), None), ())
    assert torch.equal(grads[0], torch.full((2,), 8.0)) and grads[1] is None


def test_dynamic_loss_args_are_checked():
    model = half_net()
    with pytest.raises(TypeError, match=r"unknown keys \['window'\]"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"window": 10})
    with pytest.raises(TypeError, match="Wrapped parameters must be either FP32 or FP16"):
        FP16_Optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(2, dtype=torch.float64))], lr=0.1))


# ------------------------------------------------------------------ checkpoints


def test_state_dict_resumes_bit_for_bit():
    """Save after 3 steps, continue 5 (one overflowing, scale_window 2 so the
    scaler's counters matter); a fresh model and optimizer loaded from the
    checkpoint run the same 5 steps to the same bits."""
    args = {"init_scale": 2.0**12, "scale_window": 2}

    def make(seed):
        model = half_net(seed)
        inf = Inf()
        model[1][3].weight.register_hook(inf)
        opt = FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                             dynamic_loss_args=args, verbose=False)
        return model, opt, inf

    model, opt, inf = make(0)
    train(model, opt, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
    assert set(opt.state_dict()) == APEX_STATE_KEYS
    used = train(model, opt, 5, first=3, inf=inf, overflow_at={5})

    model2, opt2, inf2 = make(1)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    assert train(model2, opt2, 5, first=3, inf=inf2, overflow_at={5}) == used
    assert len(set(used)) > 1
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(opt.fp32_from_fp16_groups[0], opt2.fp32_from_fp16_groups[0]):
        assert torch.equal(a, b)
    for sa, sb in zip(opt.state.values(), opt2.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert opt.loss_scaler.state_dict() == opt2.loss_scaler.state_dict()


class ApexAmpLossScaler:
    """What a checkpoint of Apex's last FP16_Optimizer holds under 'loss_scaler':
    an apex.amp.scaler.LossScaler, whose fields are these."""

    def __init__(self, loss_scale, unskipped):
        self.dynamic = True
        self._loss_scale = loss_scale
        self._unskipped = unskipped
        self._max_loss_scale = 2.0**24
        self._min_loss_scale = None
        self._scale_seq_len = 2000
        self._has_overflow = False


def apex_checkpoint(model, loss_scaler):
    """An Apex-format FP16_Optimizer state dict for ``half_net``: masters a little
    off the model's values, and SGD momentum buffers."""
    masters = [p.detach().float() + 1e-4 for p in model.parameters() if p.dtype == f16]
    fp32 = [p for p in model.parameters() if p.dtype == f32]
    plain = torch.optim.SGD([masters[0], masters[1], *fp32, masters[2], masters[3]], lr=0.1, momentum=0.9)
    for i, p in enumerate(plain.param_groups[0]["params"]):
        plain.state[p]["momentum_buffer"] = torch.full_like(p, 0.01 * (i + 1))
    return {
        "loss_scaler": loss_scaler,
        "dynamic_loss_scale": True,
        "overflow": False,
        "first_closure_call_this_step": True,
        "optimizer_state_dict": plain.state_dict(),
        "fp32_from_fp16": [masters],
    }


def old_apex_scaler():
    """2018 Apex pickled its DynamicLossScaler, which unpickles into this package's class."""
    scaler = DynamicLossScaler(init_scale=2.0**11, scale_window=5)
    for overflow in [False] * 3 + [True] + [False] * 2:
        scaler.update_scale(overflow)
    return scaler


@pytest.mark.parametrize("saved, scale, steps_to_growth", [
    # window 5 with 3 clean updates behind it: it grows after the 2nd step
    (ApexAmpLossScaler(2.0**9, 3), 2.0**9, 2),
    # halved at iteration 3; iterations 6, 7, 8 use 2**10 and 8 - 3 = 5 grows it
    (old_apex_scaler(), 2.0**10, 3),
], ids=["apex.amp scaler", "2018 DynamicLossScaler"])
def test_loads_an_apex_format_state_dict(saved, scale, steps_to_growth):
    model = half_net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         dynamic_loss_args={"scale_window": 5}, verbose=False)
    ckpt = apex_checkpoint(model, saved)
    opt.load_state_dict(ckpt)
    saved_masters = ckpt["fp32_from_fp16"][0]
    for m, saved_m in zip(opt.fp32_from_fp16_groups[0], saved_masters):
        assert torch.equal(m, saved_m)
    halves = [p for p in model.parameters() if p.dtype == f16]
    for p, saved_m in zip(halves, saved_masters):
        assert torch.equal(p.detach(), saved_m.half())
    momenta = [opt.state[p]["momentum_buffer"].view(-1)[0].item() for p in opt.param_groups[0]["params"]]
    assert momenta == pytest.approx([0.01 * (i + 1) for i in range(6)])
    assert opt.loss_scale == scale
    used = train(model, opt, steps_to_growth + 1)
    assert used == [scale] * steps_to_growth + [2 * scale]


def test_a_pickled_2018_checkpoint_unpickles_into_this_package():
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.update_scale(True)
    buf = io.BytesIO()
    torch.save({"loss_scaler": scaler}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)["loss_scaler"]
    assert type(back) is DynamicLossScaler and vars(back) == vars(scaler)


def test_a_mismatched_checkpoint_is_refused_by_name():
    opt = FP16_Optimizer(torch.optim.SGD(half_net().parameters(), lr=0.1), verbose=False)
    other = FP16_Optimizer(torch.optim.SGD(network_to_half(mlp(6, 4, 3)).parameters(), lr=0.1), verbose=False)
    with pytest.raises(ValueError, match="do not match this optimizer's"):
        opt.load_state_dict(other.state_dict())


# ------------------------------------------------------------------ the helpers


@pytest.mark.parametrize("flat_master", [False, True])
def test_master_param_helpers_round_trip(flat_master):
    model = half_net()
    model[1][0].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model, flat_master=flat_master)
    assert model_params == [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        assert len(masters) == 1 and masters[0].numel() == sum(p.numel() for p in model_params)
        assert masters[0].dtype == f32 and torch.equal(masters[0].grad, torch.zeros_like(masters[0]))
        flat = torch.cat([p.detach().float().reshape(-1) for p in model_params])
        assert torch.equal(masters[0].detach(), flat)
    else:
        assert all(m.dtype == f32 and m.requires_grad and m.is_leaf for m in masters)
        assert all(torch.equal(m, p.detach().float()) for m, p in zip(masters, model_params))

    for i, p in enumerate(model_params):
        p.grad = torch.full_like(p, i + 0.5)
    model_params[1].grad = None
    model_grads_to_master_grads(model_params, masters, flat_master=flat_master)
    if flat_master:
        expected = torch.cat([torch.full((p.numel(),), 0.0 if i == 1 else i + 0.5) for i, p in enumerate(model_params)])
        assert torch.equal(masters[0].grad, expected)
    else:
        assert masters[1].grad is None
        for i, (m, p) in enumerate(zip(masters, model_params)):
            if i != 1:
                assert m.grad.dtype == f32 and torch.equal(m.grad, p.grad.float())

    with torch.no_grad():
        for m in masters:
            m.add_(1.0 / 3.0)
    master_params_to_model_params(model_params, masters, flat_master=flat_master)
    values = masters[0].detach().split([p.numel() for p in model_params]) if flat_master else masters
    for p, m in zip(model_params, values):
        assert torch.equal(p.detach(), m.detach().reshape(p.shape).to(p.dtype))


@pytest.mark.quick
def test_conversion_helpers_dtypes():
    assert tofp16()(torch.ones(2, dtype=torch.float64)).dtype == f16
    ids = torch.tensor([1, 2, 3])
    assert tofp16()(ids) is ids  # token ids pass unchanged
    lm = network_to_half(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)))
    assert lm(ids).dtype == f16

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    half = network_to_half(net)
    assert isinstance(half, nn.Sequential) and isinstance(half[0], tofp16) and half[1] is net
    dtypes = {k: v.dtype for k, v in half.state_dict().items() if v.is_floating_point()}
    assert all(k.startswith("1.") for k in half.state_dict())
    assert {k for k, d in dtypes.items() if d == f32} == {
        "1.1.weight", "1.1.bias", "1.1.running_mean", "1.1.running_var"}
    assert half.state_dict()["1.1.num_batches_tracked"].dtype == torch.int64
    assert half(torch.randn(5, 3)).dtype == f16
    assert BN_convert_float(nn.BatchNorm2d(2).half()).weight.dtype == f32

    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4, affine=False))
    convert_network(net, f16)
    assert (net[0].weight.dtype, net[1].weight.dtype, net[1].running_mean.dtype, net[2].running_mean.dtype) == (
        f16, f32, f32, f16)
    outer = nn.Sequential(nn.Linear(2, 2))
    outer.register_parameter("own", nn.Parameter(torch.zeros(1)))
    convert_module(outer, f16)
    assert outer.own.dtype == f16 and outer[0].weight.dtype == f32

    emb = FP16Model(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)))
    assert emb(ids).dtype == f16
    assert FP16Model(nn.Linear(3, 2))(torch.randn(2, 3)).dtype == f16

    module = FP16_Module(nn.Linear(3, 2))
    assert module.module.weight.dtype == f16
    out = module(torch.randn(2, 3))
    assert out.dtype == f32


def test_to_python_float():
    assert to_python_float(torch.tensor(2.5)) == 2.5 and isinstance(to_python_float(torch.tensor([3.0])), float)
    assert to_python_float([4.0]) == 4.0


def test_a_real_apex_checkpoint_with_a_pickled_amp_scaler_loads_through_the_alias(tmp_path, monkeypatch):
    """Apex's last FP16_Optimizer pickled an apex.amp.scaler.LossScaler: saved where
    that Apex was installed, the checkpoint loads where only amp_patch is."""
    fake = tmp_path / "apex"
    (fake / "amp").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "amp" / "__init__.py").write_text("")
    (fake / "amp" / "scaler.py").write_text(
        "class LossScaler:\n"
        "    def __init__(self):\n"
        "        self.dynamic, self._loss_scale, self._unskipped = True, 512.0, 3\n"
        "        self._max_loss_scale, self._min_loss_scale, self._scale_seq_len, self._has_overflow = 2.0**24, None, 2000, False\n"
    )
    model = half_net()
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import apex.amp.scaler as real_scaler

    path = tmp_path / "ckpt.pt"
    torch.save(apex_checkpoint(model, real_scaler.LossScaler()), path)

    def forget_apex():  # the fake Apex before, the alias's stand-ins after: neither may outlive the test
        for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
            del sys.modules[name]

    forget_apex()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    importlib.invalidate_caches()
    assert amp_patch.install_apex_alias()
    try:
        ckpt = torch.load(path, weights_only=False)
    finally:
        alias.remove_apex_alias()
        forget_apex()
    assert type(ckpt["loss_scaler"]) is Served and ckpt["loss_scaler"].loss_scale() == 512.0
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), dynamic_loss_scale=True,
                         verbose=False)
    opt.load_state_dict(ckpt)
    assert opt.loss_scale == 512.0
