"""Loss scaling: scale_loss, the patched backward, skipped steps, accumulation,
several models/losses/optimizers, LR schedulers, state, messages, distributed.

Most tests use models made of elementwise ops that O1 leaves in FP32, so that
scaling by a power of two and unscaling is exact and results can be compared
bit for bit with plain FP32 training.
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch import scaling
from amp_patch.base import running
from amp_patch.base.errors import ConfigError, OverflowLoopError, StateError
from helpers import amp, batch, destroy_process_group

FP16 = dict(half_dtype=torch.float16, verbosity=0)


class Scale(nn.Module):
    """y = x * w + b: elementwise, so O1 keeps it in FP32."""

    def __init__(self, n=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(n, generator=g))
        self.b = nn.Parameter(torch.randn(n, generator=g))

    def forward(self, x):
        return x * self.w + self.b


def data(i, n=4):
    return batch(i, n, n)


def loss_of(model, i, poison=False):
    x, y = data(i, model.w.numel())
    loss = ((model(x) - y) ** 2).mean()
    return loss * float("inf") if poison else loss


def params(*models):
    return [p.detach().clone() for m in models for p in m.parameters()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------ scale_loss


@pytest.mark.quick
def test_scale_loss_yields_the_scaled_float_loss_and_true_gradients_follow():
    model, ref = Scale(), Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        loss = loss_of(model, 0)
        with amp_patch.scale_loss(loss, opt) as scaled:
            assert scaled.dtype == torch.float32
            assert torch.equal(scaled, loss.float() * 2.0**16)
            scaled.backward()
        grads = [p.grad.clone() for p in amp_patch.master_params(opt)]
    loss_of(ref, 0).backward()
    assert same(grads, [p.grad for p in ref.parameters()])


def test_plain_backward_is_scaled_exactly_like_scale_loss():
    a, b = Scale(), Scale()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    scales = []
    with amp([a, b], [oa, ob], "O1", **FP16):
        for i in range(6):
            poison = i in (1, 2)
            oa.zero_grad()
            loss_of(a, i, poison).backward()  # the plain loop: no code change
            oa.step()
            ob.zero_grad()
            with amp_patch.scale_loss(loss_of(b, i, poison), ob) as s:
                s.backward()
            ob.step()
            scales.append(amp_patch.counters()["loss_scale"][0])
        c = amp_patch.counters()
    assert same(params(a), params(b))
    # O1: no masters; plain SGD takes the one-pass step only to read the skip flag in C
    # (sync-free steps: torch's own step would need the decision on the host)
    one_pass = 4 if amp_patch.precision.onepass.native is not None else 0
    assert c["optimizers"] == [{"steps": 4, "skipped": 2, "fused": 0, "one_pass": one_pass}] * 2
    # one shared scaler (loss 0), updated at each step's verdict: both forms overflow
    # at iterations 1 and 2, so it halves twice in each
    assert scales[:3] == [2.0**16, 2.0**14, 2.0**12]


@pytest.mark.quick
def test_overflow_skips_the_step_and_matches_fp32_without_that_step():
    model, ref = Scale(), Scale()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    with amp(model, opt, "O1", **FP16):
        for i in range(5):
            opt.zero_grad()
            loss_of(model, i, poison=(i == 2)).backward()
            opt.step()
        c = amp_patch.counters()
    for i in range(5):
        if i == 2:
            continue
        ropt.zero_grad()
        loss_of(ref, i).backward()
        ropt.step()
    assert same(params(model), params(ref))
    assert (c["steps"], c["skipped"], c["loss_scale"]) == (4, 1, [2.0**15])


def test_loss_scale_decreases_by_half_per_overflow_down_to_the_minimum():
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    with amp(model, opt, "O1", init_scale=2.0**4, min_loss_scale=0.5, max_consecutive_skips=100, **FP16):
        for i in range(8):
            opt.zero_grad()
            loss_of(model, i, poison=True).backward()
            opt.step()
            seen.append(amp_patch.counters()["loss_scale"][0])
    assert seen == [8.0, 4.0, 2.0, 1.0, 0.5, 0.5, 0.5, 0.5]


def test_growth_interval_and_hysteresis_from_initialize():
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []
    with amp(model, opt, "O1", init_scale=8.0, growth_interval=2, hysteresis=2, **FP16):
        for i, poison in enumerate([False, False, True, True, True, False, False]):
            opt.zero_grad()
            loss_of(model, i, poison).backward()
            opt.step()
            seen.append(amp_patch.counters()["loss_scale"][0])
    # grow after 2 clean steps; the first overflow is tolerated (hysteresis 2)
    assert seen == [8.0, 16.0, 16.0, 8.0, 4.0, 4.0, 8.0]


def test_overflows_at_the_minimum_scale_end_in_an_error_that_says_what_to_do():
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O1", init_scale=2.0, max_consecutive_skips=3, **FP16):
        with pytest.raises(OverflowLoopError) as info:
            for i in range(10):
                opt.zero_grad()
                loss_of(model, i, poison=True).backward()
                opt.step()
        assert i == 3  # 2 -> 1, then the third skip at 1.0 raises
    msg = str(info.value)
    assert "minimum" in msg and "float" in msg and "bfloat16" in msg and "learning rate" in msg


@pytest.mark.parametrize(
    "option, value",
    [("growth_factor", 0.5), ("backoff_factor", 1.5), ("init_scale", -2.0), ("min_loss_scale", -1.0),
     ("growth_interval", 0), ("hysteresis", 0), ("num_losses", 0), ("max_consecutive_skips", 0)],
)
def test_bad_scaler_options_raise_value_error_and_change_nothing(option, value):
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=option):
        amp_patch.initialize(model, opt, "O1", **{option: value}, **FP16)
    assert not amp_patch.is_initialized()
    assert "step" not in vars(opt)


# ------------------------------------------------------------------ work done per step


@pytest.fixture
def count_checks(monkeypatch):
    calls = []
    real = torch._amp_foreach_non_finite_check_and_unscale_

    def counting(grads, found, inv):
        calls.append(len(grads))
        return real(grads, found, inv)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counting)
    return calls


@pytest.fixture
def count_syncs(monkeypatch):
    calls = []
    for name in ("item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counting(self, *a, _real=real, **k):
            calls.append(1)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


@pytest.mark.parametrize("sync_free", [True, False])
def test_fp16_does_one_fused_check_and_at_most_one_sync_per_step(sync_free, count_checks, count_syncs):
    models = [Scale(seed=s) for s in range(3)]
    opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    if sync_free and amp_patch.precision.onepass.native is None:
        pytest.skip("the one-pass step is not built here: plain SGD's step reads its skip flag on the host")
    with amp(models, opt, "O1", sync_free=sync_free, **FP16):
        for i in range(3):
            opt.zero_grad()
            loss = sum(loss_of(m, i) for m in models)
            count_syncs.clear()
            loss.backward()
            assert count_checks == [6], "the backward's end unscales and checks all six gradients in one fused call"
            assert count_syncs == [], "the backward does not sync with the host"
            opt.step()
            assert count_checks == [6], "the step checks nothing again"
            # sync-free: the one-pass step reads the device flag itself; else one host read
            assert len(count_syncs) == (0 if sync_free else 1), "host syncs for the skip decision"
            count_checks.clear()


@pytest.mark.parametrize("level", ["O4", "O5"])
def test_bf16_does_no_scaling_work(level, count_checks, count_syncs):
    model = nn.Linear(4, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with amp(model, opt, level, verbosity=0):
        opt.zero_grad()
        loss = model(x).float().sum()
        count_syncs.clear()
        loss.backward()
        opt.step()
        assert amp_patch.counters()["loss_scale"] == [1.0]
    assert count_checks == [] and count_syncs == []


# ------------------------------------------------------------------ what the patched backward leaves alone


@pytest.mark.parametrize("how", ["nonscalar", "explicit_gradient", "autograd_grad", "autograd_backward", "disable_casts"])
def test_patched_backward_leaves_other_calls_alone(how):
    model, ref = Scale(), Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(0)
    with amp(model, opt, "O1", **FP16):
        out = (model(x) - y) ** 2
        if how == "nonscalar":
            out.backward(torch.ones_like(out))
        elif how == "explicit_gradient":
            out.mean().backward(torch.tensor(1.0))
        elif how == "autograd_grad":
            gw, gb = torch.autograd.grad(out.mean(), [model.w, model.b])
            model.w.grad, model.b.grad = gw, gb
        elif how == "autograd_backward":
            torch.autograd.backward(out.mean())
        else:
            with amp_patch.disable_casts():
                out.mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        assert amp_patch.counters()["skipped"] == 0
    rout = (ref(x) - y) ** 2
    if how == "nonscalar":
        rout.backward(torch.ones_like(rout))
    else:
        rout.mean().backward()
    assert same(grads, [p.grad for p in ref.parameters()])


@pytest.mark.quick
def test_unscale_is_idempotent_and_the_step_does_not_unscale_again():
    model, ref = Scale(), Scale()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        loss_of(model, 0).backward()
        amp_patch.unscale_(opt)
        once = [p.grad.clone() for p in model.parameters()]
        amp_patch.unscale_(opt)
        assert same(once, [p.grad for p in model.parameters()])
        opt.step()
    loss_of(ref, 0).backward()
    assert same(once, [p.grad for p in ref.parameters()])
    ropt.step()
    assert same(params(model), params(ref))


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O2", torch.float16), ("O2", torch.bfloat16), ("O5", None)])
@pytest.mark.parametrize("which", ["master_params", "model_params"])
def test_clipping_sees_true_gradients_at_every_level(level, dtype, which):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    F.mse_loss(ref(x), y).backward()
    true_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = dict(verbosity=0) if dtype is None else dict(half_dtype=dtype, verbosity=0)
    with amp(model, opt, level, **kwargs):
        F.mse_loss(model(x).float(), y).backward()
        target = amp_patch.master_params(opt) if which == "master_params" else model.parameters()
        norm = torch.nn.utils.clip_grad_norm_(target, max_norm=1e-3)
        after = torch.nn.utils.get_total_norm([p.grad for p in amp_patch.master_params(opt)])
        opt.step()
    assert norm.item() == pytest.approx(true_norm.item(), rel=0.05)
    assert after.item() == pytest.approx(1e-3, rel=1e-3)


# ------------------------------------------------------------------ accumulation


@pytest.mark.parametrize("form", ["plain", "scale_loss", "delay_unscale"])
def test_accumulation_equals_fp32_and_an_overflow_in_any_micro_batch_skips(form):
    model, ref = Scale(), Scale()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        for step in range(3):
            opt.zero_grad()
            for k in range(3):
                loss = loss_of(model, 3 * step + k, poison=(step == 1 and k == 1))
                if form == "plain":
                    loss.backward()
                else:
                    with amp_patch.scale_loss(loss, opt, delay_unscale=(form == "delay_unscale" and k < 2)) as s:
                        s.backward()
            opt.step()
        c = amp_patch.counters()
    for step in (0, 2):
        ropt.zero_grad()
        for k in range(3):
            loss_of(ref, 3 * step + k).backward()
        ropt.step()
    assert (c["steps"], c["skipped"]) == (2, 1)
    assert same(params(model), params(ref))


def test_two_losses_into_one_optimizer_keep_their_own_scales():
    model, ref = Scale(), Scale()
    opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with amp(model, opt, "O1", num_losses=2, **FP16):
        amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**10, "unskipped": 0},
                                   "loss_scaler1": {"loss_scale": 2.0**3, "unskipped": 0}})
        for i in range(3):
            opt.zero_grad()
            with amp_patch.scale_loss(loss_of(model, i), opt, loss_id=0) as s:
                s.backward()
            with amp_patch.scale_loss(loss_of(model, i + 10), opt, loss_id=1) as s:
                s.backward()
            opt.step()
    for i in range(3):
        ropt.zero_grad()
        loss_of(ref, i).backward()
        loss_of(ref, i + 10).backward()
        ropt.step()
    assert same(params(model), params(ref))


# ------------------------------------------------------------------ several models, losses, optimizers (Apex's tests)


def _reference_run(n_models, plan, skips, iters, lr=0.1):
    """FP32: the same updates, with the given (iteration, optimizer) steps left out."""
    models = [Scale(seed=s) for s in range(n_models)]
    opts = [torch.optim.SGD([p for j in js for p in models[j].parameters()], lr=lr, momentum=0.5) for js in plan["opt_models"]]
    for i in range(iters):
        for o in opts:
            o.zero_grad()
        for l, js in enumerate(plan["loss_models"]):
            sum(loss_of(models[j], 10 * i + l) for j in js).backward()
        for k, o in enumerate(opts):
            if (i, k) not in skips:
                o.step()
    return models


PLANS = {
    # two models, two losses, two optimizers: loss l feeds model l / optimizer l
    "2m_2l_2o": dict(n=2, opt_models=[[0], [1]], loss_models=[[0], [1]], loss_opts=[[0], [1]]),
    # two models, two losses, one optimizer over both
    "2m_2l_1o": dict(n=2, opt_models=[[0, 1]], loss_models=[[0], [1]], loss_opts=[[0], [0]]),
    # three models, two losses, two optimizers: loss 0 feeds models 0 and 1
    "3m_2l_2o": dict(n=3, opt_models=[[0, 1], [2]], loss_models=[[0, 1], [2]], loss_opts=[[0], [1]]),
    # two models, one loss over both, two optimizers
    "2m_1l_2o": dict(n=2, opt_models=[[0], [1]], loss_models=[[0, 1]], loss_opts=[[0, 1]]),
}


CASES = [(name, (it, l)) for name in sorted(PLANS) for it, l in [(1, 0), (2, 1)] if l < len(PLANS[name]["loss_models"])]


@pytest.mark.parametrize("plan_name, inject", CASES)
def test_an_inf_in_one_loss_skips_exactly_the_optimizers_it_fed(plan_name, inject):
    plan = PLANS[plan_name]
    inject_iter, inject_loss = inject
    n_losses = len(plan["loss_models"])
    iters = 4
    models = [Scale(seed=s) for s in range(plan["n"])]
    opts = [torch.optim.SGD([p for j in js for p in models[j].parameters()], lr=0.1, momentum=0.5) for js in plan["opt_models"]]
    with amp(models, opts, "O1", num_losses=n_losses, **FP16):
        for i in range(iters):
            for o in opts:
                o.zero_grad()
            for l, js in enumerate(plan["loss_models"]):
                loss = sum(loss_of(models[j], 10 * i + l) for j in js)
                if (i, l) == inject:
                    loss = loss * float("inf")
                with amp_patch.scale_loss(loss, [opts[k] for k in plan["loss_opts"][l]], loss_id=l) as s:
                    s.backward()
            for o in opts:
                o.step()
        c = amp_patch.counters()
    skipped_opts = set(plan["loss_opts"][inject_loss])
    skips = {(inject_iter, k) for k in skipped_opts}
    ref = _reference_run(plan["n"], plan, skips, iters)
    assert same(params(*models), params(*ref))
    assert [o["skipped"] for o in c["optimizers"]] == [int(k in skipped_opts) for k in range(len(opts))]
    assert c["loss_scale"] == [2.0**15 if l == inject_loss else 2.0**16 for l in range(n_losses)]


# ------------------------------------------------------------------ LR schedulers


@pytest.mark.parametrize("order", ["scheduler_first", "initialize_first"])
def test_lr_scheduler_after_a_skipped_step_neither_warns_nor_stalls(order):
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if order == "scheduler_first":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with amp(model, opt, "O1", **FP16):
        if order == "initialize_first":
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for i in range(3):
                opt.zero_grad()
                loss_of(model, i, poison=(i == 0)).backward()
                opt.step()
                sched.step()
        assert amp_patch.counters()["skipped"] == 1
    # as with torch.amp.GradScaler, the schedule advances on a skipped step too
    assert opt.param_groups[0]["lr"] == 0.125


# ------------------------------------------------------------------ FP16 on CPU, end to end


def test_fp16_training_on_cpu_needs_loss_scaling_and_gets_it():
    """A regression whose gradients underflow FP16: without scaling O2 does not
    learn; with the dynamic scaler it reaches FP32's loss."""
    tiny = 2.0**-24  # a loss this small makes every FP16 gradient underflow

    def train(level_kwargs):
        torch.manual_seed(0)
        model = nn.Linear(8, 1)
        x = torch.randn(64, 8)
        y = x @ torch.arange(1.0, 9.0).unsqueeze(1) / 8
        opt = torch.optim.SGD(model.parameters(), lr=0.1 / tiny)
        ctx = amp(model, opt, **level_kwargs) if level_kwargs else contextlib.nullcontext()
        with ctx:
            for _ in range(40):
                opt.zero_grad()
                (F.mse_loss(model(x).float(), y) * tiny).backward()
                opt.step()
        return F.mse_loss(model(x).float(), y).item()

    fp32 = train(None)
    scaled = train(dict(opt_level="O2", **FP16))
    unscaled = train(dict(opt_level="O2", loss_scale=1.0, **FP16))
    assert fp32 < 0.05
    assert scaled == pytest.approx(fp32, rel=0.1, abs=5e-3)
    assert unscaled > 10 * max(fp32, 1e-3)


# ------------------------------------------------------------------ state


def test_state_dict_round_trip_mid_run_continues_identically():
    def run(split):
        model = Scale()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        scales = []
        state = None
        with amp(model, opt, "O1", growth_interval=2, **FP16):
            for i in range(6):
                if i == split:
                    state = (amp_patch.state_dict(), opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()})
                    break
                opt.zero_grad()
                loss_of(model, i, poison=(i == 1)).backward()
                opt.step()
                scales.append(amp_patch.counters()["loss_scale"][0])
        if state is None:
            return params(model), scales
        model2 = Scale()
        opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
        with amp(model2, opt2, "O1", growth_interval=2, **FP16):
            model2.load_state_dict(state[2])
            opt2.load_state_dict(state[1])
            amp_patch.load_state_dict(state[0])
            for i in range(split, 6):
                opt2.zero_grad()
                loss_of(model2, i, poison=(i == 1)).backward()
                opt2.step()
                scales.append(amp_patch.counters()["loss_scale"][0])
        return params(model2), scales

    whole = run(None)
    resumed = run(3)
    assert same(whole[0], resumed[0])
    assert whole[1] == resumed[1] == [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**16, 2.0**17]


def test_state_dict_is_apex_shaped_and_apex_checkpoints_load():
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", num_losses=2, **FP16):
        sd = amp_patch.state_dict()
        assert sd["loss_scaler0"]["loss_scale"] == 2.0**16 and sd["loss_scaler0"]["unskipped"] == 0
        assert sd["amp_patch"]["opt_level"] == "O2"
        amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3},
                                   "loss_scaler1": {"loss_scale": 4.0, "unskipped": 0}})
        assert amp_patch.counters()["loss_scale"] == [512.0, 4.0]
        assert amp_patch.state_dict()["loss_scaler0"]["unskipped"] == 3
        with pytest.raises(ConfigError, match="num_losses=1"):
            amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 8.0}})
        with pytest.raises(ConfigError, match="loss scaler 1"):
            amp_patch.load_state_dict({"loss_scaler0": {"loss_scale": 8.0}, "loss_scaler1": {"loss_scale": -1.0}})
        assert amp_patch.counters()["loss_scale"] == [512.0, 4.0], "all or nothing"
        with pytest.warns(UserWarning, match="opt_level='O1'"):
            amp_patch.load_state_dict(dict(amp_patch.state_dict(), amp_patch={"opt_level": "O1"}))


def test_calls_in_the_wrong_order_raise_state_errors(monkeypatch):
    monkeypatch.setattr(running, "_ended", None)  # before any run (after one, counters() gives its figures)
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for call in (lambda: amp_patch.state_dict(), lambda: amp_patch.load_state_dict({}),
                 lambda: amp_patch.unscale_(opt), lambda: amp_patch.counters(),
                 lambda: amp_patch.master_params(opt), lambda: amp_patch.adopt_optimizer(opt)):
        with pytest.raises(StateError, match="initialize"):
            call()
    with pytest.raises(StateError, match="initialize"):
        with amp_patch.scale_loss(loss_of(model, 0), opt):
            pass
    other = torch.optim.SGD(Scale().parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        with pytest.raises(StateError, match="adopt_optimizer"):
            with amp_patch.scale_loss(loss_of(model, 0), other):
                pass
        with pytest.raises(ConfigError, match="loss_id=1"):
            with amp_patch.scale_loss(loss_of(model, 0), opt, loss_id=1):
                pass
        lbfgs = torch.optim.LBFGS(model.parameters())
        amp_patch.adopt_optimizer(lbfgs)
        with pytest.raises(StateError, match=r"LBFGS.step\(closure\) is not supported while loss scaling is active"):
            lbfgs.step(lambda: loss_of(model, 0))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_a_closure_step_under_fp16_is_the_loop_written_out(level, cls):
    """``optimizer.step(closure)`` (PyTorch Lightning's automatic optimization
    calls it so) under FP16 loss scaling: the closure is called once, before the
    step, as torch's own optimizers call it, so its scaled backward is checked and
    unscaled, an overflow skips the step, and the step returns the closure's
    loss. Bit for bit the loop with ``loss.backward(); optimizer.step()``."""
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    runs = []
    for use_closure in (True, False):
        model = _mlp()
        opt = cls(model.parameters(), lr=0.01)
        with amp(model, opt, level, **FP16) as (model, opt):
            returned = []
            for step in range(4):
                def closure():
                    opt.zero_grad()
                    loss = F.mse_loss(model(x).float(), y) * (1e10 if step == 1 else 1.0)  # step 1 overflows
                    loss.backward()
                    return loss
                if use_closure:
                    returned.append(opt.step(closure))
                else:
                    returned.append(closure())
                    opt.step()
            c = amp_patch.counters()
            runs.append(([p.detach().float().clone() for p in model.parameters()], [r.item() for r in returned],
                         c["skipped"], c["loss_scale"]))
    (got, got_losses, skipped, scale), (want, want_losses, _, _) = runs
    assert skipped == 1 and scale == [32768.0]
    assert got_losses == want_losses
    assert same(got, want)


def test_deinitialize_leaves_true_gradients_and_the_optimizer_as_it_was():
    model, ref = Scale(), Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        loss_of(model, 0).backward()
    loss_of(ref, 0).backward()
    assert same([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
    assert "step" not in vars(opt) and "zero_grad" not in vars(opt)


# ------------------------------------------------------------------ adoption and model-less initialize


@pytest.mark.parametrize("models", [None, []])
def test_initialize_without_a_model_then_adopt_an_optimizer(models):
    with amp(models, None, "O1", **FP16) as out:
        assert out == models
        model = Scale()
        opt = amp_patch.adopt_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        assert amp_patch.adopt_optimizer(opt) is opt
        loss_of(model, 0, poison=True).backward()
        before = params(model)
        opt.step()
        assert same(before, params(model))
        assert amp_patch.counters()["skipped"] == 1
    assert "step" not in vars(opt)


def test_adopt_optimizer_refuses_fp16_weights_at_o1():
    with amp(None, None, "O1", **FP16):
        half = nn.Linear(2, 2).half()
        with pytest.raises(ConfigError, match="FP32 master weights|float16"):
            amp_patch.adopt_optimizer(torch.optim.SGD(half.parameters(), lr=0.1))


# ------------------------------------------------------------------ messages and torch.distributed


def _overflow_steps(n, caplog):
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        with amp(model, opt, "O1", half_dtype=torch.float16, max_consecutive_skips=None, verbosity=1):
            for i in range(n):
                opt.zero_grad()
                loss_of(model, i, poison=True).backward()
                opt.step()
    return [r for r in caplog.records if "inf/NaN gradients" in r.getMessage()]


@pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")
def test_overflow_messages_are_rate_limited(caplog, monkeypatch):
    records = _overflow_steps(5, caplog)
    assert len(records) == 1 and "65536 -> 32768" in records[0].getMessage()
    caplog.clear()
    monkeypatch.setattr(scaling.state._Notices, "interval", 0.0)
    assert len(_overflow_steps(5, caplog)) == 5


@pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")
def test_overflow_messages_come_from_rank_zero_only(caplog, monkeypatch):
    monkeypatch.setattr(scaling.state, "is_rank0", lambda: False)
    assert _overflow_steps(3, caplog) == []


@pytest.fixture
def gloo(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        destroy_process_group()


def test_found_inf_is_all_reduced_once_per_step_under_torch_distributed(gloo, monkeypatch):
    calls = []
    real = gloo.all_reduce

    def counting(tensor, *a, **k):
        calls.append(tensor.clone())
        return real(tensor, *a, **k)

    monkeypatch.setattr(gloo, "all_reduce", counting)
    model = Scale()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O1", **FP16):
        for i in range(3):
            opt.zero_grad()
            loss_of(model, i, poison=(i == 1)).backward()
            opt.step()
        assert amp_patch.counters()["skipped"] == 1
    assert [c.tolist() for c in calls] == [[0.0], [1.0], [0.0]]


@pytest.mark.quick
def test_each_optimizer_moves_through_the_documented_stages_and_an_illegal_move_is_refused():
    from amp_patch.scaling.state import Stage

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O1", half_dtype=torch.float16, loss_scale=128.0):
        h = amp_patch.base.running.session().scaling.by_optimizer[id(opt)]
        assert h.stage is Stage.READY
        x = torch.randn(3, 4)
        model(x).float().sum().backward()
        assert h.stage is Stage.UNSCALED, "a plain backward ends with true gradients"
        true = model.weight.grad.clone()
        opt.zero_grad()
        with amp_patch.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled_loss:
            scaled_loss.backward()
        assert h.stage is Stage.SCALED and h.loss == 0, "delay_unscale leaves them scaled, as in Apex"
        torch.testing.assert_close(model.weight.grad, true * 128.0, rtol=0, atol=0)
        amp_patch.unscale_(opt)
        assert h.stage is Stage.UNSCALED
        torch.testing.assert_close(model.weight.grad, true, rtol=0, atol=0)
        opt.step()
        assert h.stage is Stage.UNSCALED  # true gradients until zero_grad or the next backward
        opt.zero_grad()
        assert h.stage is Stage.READY and h.loss is None
        with pytest.raises(StateError, match=r"SGD's gradients cannot go from ready to unscaled; this is a bug"):
            h.move(Stage.UNSCALED)
        assert h.stage is Stage.READY


class _Bag(torch.nn.Module):
    """An embedding with sparse gradients, and a complex parameter beside it."""

    def __init__(self, sparse=True, complex_param=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4, sparse=sparse)
        self.head = torch.nn.Linear(8, 1)
        self.c = torch.nn.Parameter(torch.randn(3, dtype=torch.complex64)) if complex_param else None

    def forward(self, idx):
        out = self.head(self.emb(idx).flatten(1)).float().sum()
        return out + (self.c.abs() ** 2).sum() if self.c is not None else out


IDX = torch.tensor([[1, 2], [2, 3], [2, 7]])  # index 2 three times: duplicates in the sparse gradient


@pytest.mark.parametrize("level,half", [("O1", torch.float16), ("O2", torch.float16), ("O2", torch.bfloat16)])
def test_sparse_gradients_are_unscaled_checked_and_stepped_as_torch_would(level, half):
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, level, half_dtype=half, loss_scale=128.0 if half == torch.float16 else None):
        before = model.state_dict()["emb.weight"].clone()
        loss = model(IDX)
        (true,) = torch.autograd.grad(loss, [model.emb.weight], retain_graph=True)  # unscaled
        assert true.is_sparse
        loss.backward()
        opt.step()
        want = before - 0.1 * true.float().to_dense()
        torch.testing.assert_close(model.state_dict()["emb.weight"], want, rtol=0, atol=1e-6)
        assert model.emb.weight.dtype == (half if level == "O2" else torch.float32)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflow_in_a_sparse_gradient_skips_the_step(level):
    model = _Bag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, level, half_dtype=torch.float16):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        (model(IDX) * 1e38).backward()
        opt.step()
        assert amp_patch.counters()["optimizers"][0]["skipped"] == 1
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_complex_parameters_get_true_gradients_under_fp16_loss_scaling(level):
    model = _Bag(sparse=False, complex_param=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, level, half_dtype=torch.float16, loss_scale=128.0):
        c0 = model.c.detach().clone()
        loss = model(IDX)
        (true,) = torch.autograd.grad(loss, [model.c], retain_graph=True)
        loss.backward()
        opt.step()
        assert model.c.dtype == torch.complex64
        torch.testing.assert_close(model.c.detach(), c0 - 0.1 * true, rtol=0, atol=1e-6)
