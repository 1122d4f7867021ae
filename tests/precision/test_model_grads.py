"""O2/O5: the gradients and weights a script reads and writes on the model.

The contract (docs/guide.md, "O2/O5: what the model's .grad and weights hold"):
inside a ``scale_loss`` block the half parameters hold the scaled gradients,
as under Apex, and an edit there is what the exit unscales; after a backward
each model parameter's ``.grad`` reads its true gradient in its own dtype; an
edit to it (in place or by assignment, ``module.zero_grad()`` included) is
what the step applies; a write to the half weights between steps reaches the
FP32 masters, and a write to a master reaches the model before its next
forward. ``model_grads=False`` keeps the model's ``.grad`` empty instead.
Each case runs in FP16 (loss scaling at work) and BF16.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from helpers import amp, batch, mlp, sgd

HALVES = [torch.float16, torch.bfloat16]


def net(seed=0):
    return mlp(6, 16, 3, seed=seed)


def data(i=0):
    return batch(i, 6, 3)


def masters(opt):
    return list(amp_patch.master_params(opt))


def run_o2(half, **kw):
    """``initialize`` at O2 with ``half`` (a static scale of 256 under FP16, so
    the scaled and the true gradients differ by a known factor)."""
    model = net()
    opt = sgd(model)
    scale = dict(loss_scale=256.0) if half == torch.float16 else {}
    return amp(model, opt, "O2", half_dtype=half, **scale, **kw)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("how", ["plain", "scale_loss"])
def test_after_a_backward_the_model_grad_is_the_true_gradient_in_the_half_dtype(half, how):
    with run_o2(half) as (model, opt):
        x, y = data()
        loss = F.mse_loss(model(x), y)
        if how == "plain":
            loss.backward()
        else:
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        for p, m in zip(model.parameters(), masters(opt)):
            assert p.grad is not None and p.grad.dtype == p.dtype == half
            assert torch.equal(p.grad, m.grad.to(half))  # the master's true FP32 gradient, rounded once
        # and the master's is the gradient of the half model's forward, unscaled
        ref = copy.deepcopy(model)
        amp_patch.deinitialize()
        F.mse_loss(ref(x), y).backward()
        for g_ref, p in zip([q.grad for q in ref.parameters()], model.parameters()):
            torch.testing.assert_close(p.grad.float(), g_ref.float(), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("half", HALVES)
def test_inside_scale_loss_the_half_grads_are_scaled_and_an_inf_there_skips_the_step(half):
    """Apex's multiple-models tests write an inf into a half gradient inside the block."""
    with run_o2(half) as (model, opt):
        before = [m.detach().clone() for m in masters(opt)]
        x, y = data()
        loss = F.mse_loss(model(x), y)
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
            grads = [p.grad.clone() for p in model.parameters()]
            assert all(g is not None and g.dtype == half for g in grads)
            model[0].weight.grad[0, 0] = float("inf")
        assert masters(opt)[0].grad[0, 0] == float("inf")  # the exit took the edit
        if half == torch.bfloat16:
            return  # no loss scale, no check: the step applies what the script wrote, as in FP32
        # the block's scale was applied inside it, and taken off at its exit
        torch.testing.assert_close(grads[2].float() / 256.0, model[2].weight.grad.float(), rtol=0, atol=0)
        opt.step()
        assert amp_patch.counters()["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(before, masters(opt)))


@pytest.mark.parametrize("half", HALVES)
def test_get_total_norm_over_the_model_then_clip_grads_with_norm_clips_as_fp32(half):
    model = net()
    ref = copy.deepcopy(model)
    x, y = data()
    (F.mse_loss(ref(x), y) * 50).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    opt = sgd(model)
    scale = dict(loss_scale=256.0) if half == torch.float16 else {}
    with amp(model, opt, "O2", half_dtype=half, **scale) as (model, opt):
        (F.mse_loss(model(x), y) * 50).backward()
        total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
        torch.testing.assert_close(total.float(), ref_norm, rtol=3e-2, atol=0)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.5, total)
        clipped = torch.nn.utils.get_total_norm([m.grad for m in masters(opt)])
        torch.testing.assert_close(clipped, torch.tensor(0.5), rtol=2e-2, atol=0)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("edit", ["clamp_", "mul_", "zero_", "nan_to_num_", "assign", "none"])
def test_an_edit_to_a_model_grad_is_what_the_step_applies(half, edit):
    with run_o2(half) as (model, opt):
        x, y = data()
        F.mse_loss(model(x), y).backward()
        w = model[0].weight
        g = w.grad
        if edit == "clamp_":
            g.clamp_(-1e-3, 1e-3)
        elif edit == "mul_":
            g.mul_(4)
        elif edit == "zero_":
            g.zero_()
        elif edit == "nan_to_num_":
            g[0, 0] = float("nan")
            g.nan_to_num_(0.0)
        elif edit == "assign":
            w.grad = torch.full_like(w, 0.25)
        else:
            w.grad = None
        applied = None if w.grad is None else w.grad.float()
        untouched = model[2].weight.grad.float()
        m0, m2 = masters(opt)[0], masters(opt)[2]
        before0, before2 = m0.detach().clone(), m2.detach().clone()
        opt.step()
        if applied is None:
            assert torch.equal(m0.detach(), before0)  # no gradient: not stepped
        else:
            torch.testing.assert_close(m0.detach(), before0 - 0.1 * applied, rtol=0, atol=1e-6)
        # the parameter nobody edited steps on its master's FP32 gradient, which the model's rounds
        torch.testing.assert_close(m2.detach(), before2 - 0.1 * untouched, rtol=0, atol=1e-3 * untouched.abs().max().item() + 1e-7)


@pytest.mark.parametrize("half", HALVES)
def test_module_zero_grad_clears_what_a_backward_left_in_the_masters(half):
    """The DCGAN loop: G's backward runs through D, then ``netD.zero_grad()``;
    D's next step must not add G's gradient."""
    torch.manual_seed(0)
    netG, netD = mlp(4, 8, 6, seed=1), mlp(6, 8, 1, seed=2)
    ref_G, ref_D = copy.deepcopy(netG), copy.deepcopy(netD)
    optG = torch.optim.SGD(netG.parameters(), lr=0.1)
    optD = torch.optim.SGD(netD.parameters(), lr=0.1)
    scale = dict(loss_scale=256.0) if half == torch.float16 else {}
    z = torch.randn(8, 4)
    real = torch.randn(8, 6)

    def loop(G, D, oG, oD):
        for _ in range(2):
            D.zero_grad()
            d_loss = D(real).mean() - D(G(z).detach()).mean()
            d_loss.backward()
            oD.step()
            G.zero_grad()
            g_loss = D(G(z)).mean()
            g_loss.backward()  # reaches D's parameters too
            oG.step()

    loop(ref_G, ref_D, torch.optim.SGD(ref_G.parameters(), lr=0.1), torch.optim.SGD(ref_D.parameters(), lr=0.1))
    with amp([netG, netD], [optG, optD], "O2", half_dtype=half, **scale) as ((netG, netD), (optG, optD)):
        loop(netG, netD, optG, optD)
        got = [m.detach().clone() for m in masters(optD)]
    tol = 2e-2 if half == torch.bfloat16 else 2e-3
    for a, b in zip(got, ref_D.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=tol)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("how", ["data", "no_grad", "swap"])
def test_a_write_to_the_half_weights_between_steps_reaches_the_masters(half, how):
    with run_o2(half) as (model, opt):
        for i in range(2):
            opt.zero_grad()
            x, y = data(i)
            F.mse_loss(model(x), y).backward()
            opt.step()
            w = model[0].weight
            if how == "data":  # the original WGAN's critic clipping
                w.data.clamp_(-0.01, 0.01)
            elif how == "no_grad":
                with torch.no_grad():
                    w.clamp_(-0.01, 0.01)
            else:  # an EMA-style swap through .data, kept
                w.data = torch.full_like(w, 0.005)
            # the elements written take the half value; the others keep their FP32 master's
            expect = model.state_dict()["0.weight"].clone()
            assert torch.equal(expect.to(half), w.detach())
            assert expect.abs().max() <= (0.005 if how == "swap" else 0.01) * 1.01
        opt.zero_grad()
        x, y = data(5)
        F.mse_loss(model(x), y).backward()
        g = masters(opt)[0].grad.clone()
        opt.step()
        torch.testing.assert_close(masters(opt)[0].detach(), expect - 0.1 * g, rtol=0, atol=1e-7)
    assert model[0].weight.dtype == torch.float32


@pytest.mark.parametrize("half", HALVES)
def test_a_write_through_master_params_reaches_the_model_before_its_next_forward(half):
    with run_o2(half) as (model, opt):
        x, _ = data()
        with torch.no_grad():
            for m in masters(opt):
                m.mul_(0.0)
        assert torch.equal(model(x), torch.zeros(8, 3))
        for m in masters(opt):
            m.data.fill_(0.5)
        out = model(x)
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in model.parameters()) and out.abs().sum() > 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_whose_gradients_were_thrown_away_does_not_skip_the_next_step(level):
    """A NaN loss, ``model.zero_grad()`` and no step: the next clean step is taken."""
    model = net()
    opt = sgd(model)
    with amp(model, opt, level, half_dtype=torch.float16) as (model, opt):
        x, y = data()
        (F.mse_loss(model(x), y) * float("nan")).backward()
        model.zero_grad()
        before = [m.detach().clone() for m in masters(opt)]
        F.mse_loss(model(x), y).backward()
        opt.step()
        c = amp_patch.counters()
        assert c["skipped"] == 0 and c["steps"] == 1
        assert not any(torch.equal(a, b) for a, b in zip(before, masters(opt)))


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
def test_lbfgs_closure_sees_each_trial_update(line_search):
    """LBFGS calls the closure again after each trial step of the masters, inside
    one ``step``: the model must run on those values, or the search sees its start
    point every time and stops early. (BF16: FP16's scaled loss refuses a closure.)"""
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = x @ torch.randn(6, 3) + 0.1

    def train(model, opt, seen):
        for _ in range(4):
            def closure():
                opt.zero_grad()
                seen.append(tuple(model.weight.detach().float().flatten().tolist()))
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
        return F.mse_loss(model(x).float(), y).item()

    ref = torch.nn.Linear(6, 3)
    model = copy.deepcopy(ref)
    start = F.mse_loss(ref(x), y).item()
    fp32_seen, seen = [], []
    fp32 = train(ref, torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=5, line_search_fn=line_search), fp32_seen)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, line_search_fn=line_search)
    with amp(model, opt, "O5") as (model, opt):
        got = train(model, opt, seen)
    calls = len(fp32_seen) // 4
    assert len(set(seen[:calls])) == len(set(fp32_seen[:calls])) == calls  # each call of the first step saw new weights
    # FP32 reaches ~1e-10; BF16 weights stop at their rounding, about 1e-4
    assert fp32 < 1e-6 * start and got < 1e-4 * start, (got, fp32, start)


@pytest.mark.parametrize("half", HALVES)
def test_add_param_group_after_state_dict_and_deinitialize_gives_fp32_back(half):
    torch.manual_seed(0)
    body, head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(body, torch.nn.ReLU(), head)
    opt = torch.optim.SGD(body.parameters(), lr=0.1)
    with amp(model, opt, "O2", half_dtype=half) as (model, opt):
        model.state_dict()
        opt.add_param_group({"params": list(head.parameters())})
        for i in range(3):
            opt.zero_grad()
            x, y = data(i)
            F.mse_loss(model(x), y).backward()
            opt.step()
        trained = [m.detach().clone() for m in masters(opt)]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    for p, m in zip(model.parameters(), trained):
        assert torch.equal(p.detach(), m)  # the masters' values, not rounded to half


@pytest.mark.parametrize("half", HALVES)
def test_model_grads_false_keeps_the_model_grad_empty_and_steps_the_same(half):
    runs = []
    for model_grads in (True, False):
        with run_o2(half, model_grads=model_grads) as (model, opt):
            for i in range(3):
                opt.zero_grad()
                x, y = data(i)
                F.mse_loss(model(x), y).backward()
                if not model_grads:
                    assert all(p.grad is None for p in model.parameters())
                opt.step()
            runs.append([m.detach().clone() for m in masters(opt)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def _facts(s):
    return (s.partial, s.in_model, s.zeroed)


def test_the_masters_gradient_sum_moves_only_as_its_table_says():
    """``GradSum``: every row of its docstring's table, from every reachable state."""
    from amp_patch.precision.master import GradSum

    s = GradSum()
    assert _facts(s) == (False, False, False)
    s.zero_grad(set_to_none=False)
    assert _facts(s) == (False, False, True)
    s.backward(keep_half=False)
    assert _facts(s) == (True, False, True)  # zeroed kept: the step's unreached masters step on zeros
    s.backward(keep_half=False)
    assert _facts(s) == (True, False, True)
    assert s.step() is False  # the model held no half sum
    assert _facts(s) == (False, False, False)
    s.backward(keep_half=True)
    assert _facts(s) == (False, True, False)
    s.zero_grad(set_to_none=True)
    assert _facts(s) == (False, True, False)  # the model's half sum is dropped at the step, not here
    s.backward(keep_half=True)
    assert s.step() is True  # the step drops the model's half sum
    assert _facts(s) == (False, False, False)


def test_accumulated_backwards_sum_in_the_masters_and_a_step_starts_a_new_sum():
    """Two backwards before a step add in FP32 (``partial``); after the step one
    backward's gradient stands alone, with only ``model.zero_grad()`` between."""
    model = net()
    opt = sgd(model, lr=0.0)
    x, y = batch(0, 6, 3)
    with amp(model, opt, "O5", model_grads=False):
        masters = [p for g in opt.param_groups for p in g["params"]]
        F.mse_loss(model(x).float(), y).backward()
        one = [p.grad.clone() for p in masters]
        F.mse_loss(model(x).float(), y).backward()
        for a, p in zip(one, masters):
            assert p.dtype == torch.float32 and torch.equal(p.grad, a + a)
        opt.step()
        model.zero_grad()
        F.mse_loss(model(x).float(), y).backward()
        for a, p in zip(one, masters):
            assert torch.equal(p.grad, a)


@pytest.mark.parametrize("widths, kept", [((6, 16, 3), "all"), ((512,) * 6, "none")])
def test_zero_grad_releases_the_fp32_gradient_buffers_only_where_that_saves_memory(widths, kept):
    """``zero_grad(set_to_none=True)`` hands the masters' FP32 gradient buffers back, so
    they are not held through the next forward; a small model's (all of them at most
    ``KEEP_ALL_ON_CPU``) stay and are reused, instead of being made again for every
    parameter at every step. Either way the gradients the script sees are None."""
    from amp_patch.precision import master

    model = mlp(*widths, seed=0)
    opt = sgd(model)
    with amp(model, opt, "O5") as (model, opt):
        mw = amp_patch.base.running.session().scaling.by_optimizer[id(opt)].masters
        total = sum(m.numel() * 4 for m in mw.masters)
        assert (total <= master.KEEP_ALL_ON_CPU) == (kept == "all")
        assert all(m.numel() * 4 < master.KEEP_ON_CPU for m in mw.masters)
        x = torch.randn(4, widths[0])
        model(x).float().sum().backward()
        first = [m.grad for m in masters(opt)]
        assert all(g is not None and g.dtype == torch.float32 for g in first)
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert all(m.grad is None for m in masters(opt)) and all(p.grad is None for p in model.parameters())
        assert all((b is g) if kept == "all" else (b is None) for b, g in zip(mw.grads, first))
        model(x).float().sum().backward()
        again = [m.grad for m in masters(opt)]
        assert all((a is g) == (kept == "all") for a, g in zip(again, first))
        assert all(torch.equal(p.grad, m.grad.to(p.dtype)) for p, m in zip(model.parameters(), masters(opt)))
