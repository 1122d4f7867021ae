"""No scaled gradient outlives the backward that made it.

Under FP16 every scaled backward (a plain ``loss.backward()``, the exit of
``scale_loss``) ends with true gradients in ``.grad`` (the FP32 masters' under
O2), so whatever user code does with them before the step (read, clip by
value, clip by a norm it computes itself, add a gradient of its own) computes
what it computes in FP32. Each test is written the way the code that hits it
is written, and compares with the same loop run in FP32 without amp_patch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import amp as apex_amp
from helpers import amp, batch, mlp, sgd

f16 = torch.float16
FP16 = dict(half_dtype=f16)
# FP16 rounding of the forward and backward; the loss scale itself is exact
TOL = dict(rtol=2e-2, atol=2e-3)


def net(seed=0):
    return mlp(6, 16, 3, seed=seed)


def data(i=0):
    return batch(i, 6, 3)


def fp32_grads(model, *batches):
    """The FP32 gradients of ``model`` summed over ``batches`` (a copy; ``model`` untouched)."""
    ref = copy.deepcopy(model)
    for x, y in batches:
        F.mse_loss(ref(x), y).backward()
    return [p.grad for p in ref.parameters()]


# ---------------------------------------------------------------- reading .grad


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("how", ["plain", "scale_loss", "apex"])
def test_gradients_after_a_scaled_backward_are_true(level, how):
    model = net()
    ref = fp32_grads(model, data())
    opt = sgd(model)
    with amp(model, opt, level, loss_scale=1024.0, **FP16) as (model, opt):
        x, y = data()
        loss = F.mse_loss(model(x), y)
        if how == "plain":
            loss.backward()
        else:
            with (amp_patch if how == "scale_loss" else apex_amp).scale_loss(loss, opt) as scaled:
                scaled.backward()
        got = [p.grad for p in (model.parameters() if level == "O1" else amp_patch.master_params(opt))]
        assert all(g.dtype == torch.float32 for g in got)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, **TOL)


def test_apex_test_cache_pattern_a_poked_loss_scale_leaves_true_gradients():
    """Apex's tests/L0/run_amp/test_cache.py: the scale set through
    ``_amp_state.loss_scalers[0]._loss_scale``, gradients compared after the block."""
    model = net()
    ref = fp32_grads(model, data())
    opt = sgd(model)
    model, opt = apex_amp.initialize(model, opt, opt_level="O1", half_dtype=f16, verbosity=0)
    try:
        apex_amp._amp_state.loss_scalers[0]._loss_scale = 4.0
        x, y = data()
        with apex_amp.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.grad, r, **TOL)
    finally:
        amp_patch.deinitialize()


def test_an_inf_written_inside_the_block_is_caught_at_its_exit():
    """Apex's multiple-models test writes an inf into a gradient between the
    backward and the block's exit: the exit's check sees it and the step is skipped."""
    model = net()
    opt = sgd(model)
    with amp(model, opt, "O1", loss_scale="dynamic", **FP16) as (model, opt):
        before = [p.detach().clone() for p in model.parameters()]
        x, y = data()
        with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
            scaled.backward()
            model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        assert amp_patch.counters()["skipped"] == 1
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---------------------------------------------------------------- user code between backward and step


def _clamp_run(amp_level):
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx = amp(model, opt, amp_level, loss_scale=128.0, **FP16) if amp_level else None
    if ctx is not None:
        model, opt = ctx.__enter__()
    try:
        start = model[0].weight.detach().clone()
        for i in range(3):
            x, y = data(i)
            opt.zero_grad()
            (F.mse_loss(model(x), y) * 100).backward()
            for param in model.parameters():  # the DQN tutorial's clipping
                param.grad.data.clamp_(-1, 1)
            opt.step()
        return (model[0].weight.detach().float() - start).abs().max().item(), model[0].weight.detach().float().clone()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def test_clipping_gradients_by_value_after_backward_clips_true_gradients():
    moved32, w32 = _clamp_run(None)
    moved16, w16 = _clamp_run("O1")
    assert moved32 > 0.01
    assert abs(moved16 - moved32) < 1e-3 * max(1.0, moved32) + 1e-4
    torch.testing.assert_close(w16, w32, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_get_total_norm_then_clip_grads_with_norm(level):
    """torch documents ``clip_grad_norm_`` as these two calls; neither may see scaled gradients."""
    model = net()
    ref = fp32_grads(model, data())
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref]))
    opt = sgd(model)
    with amp(model, opt, level, loss_scale=65536.0, **FP16) as (model, opt):
        x, y = data()
        F.mse_loss(model(x), y).backward()
        params = list(model.parameters()) if level == "O1" else list(amp_patch.master_params(opt))
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads)
        torch.testing.assert_close(total, ref_norm, **TOL)
        torch.nn.utils.clip_grads_with_norm_(params, 1e-3, total)
        clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        torch.testing.assert_close(clipped, torch.tensor(1e-3), rtol=1e-3, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("order", ["scaled-first", "untouched-first"])
@pytest.mark.parametrize("untouched", ["gradient", "autograd"])
def test_a_scaled_and_an_untouched_backward_add_up_in_either_order(level, order, untouched):
    model = net()
    (x0, y0), (x1, y1) = data(0), data(1)
    ref = fp32_grads(model, (x0, y0), (x1, y1))
    opt = sgd(model)
    with amp(model, opt, level, loss_scale=4096.0, **FP16) as (model, opt):
        def scaled():
            F.mse_loss(model(x0), y0).backward()

        def other():
            loss = F.mse_loss(model(x1), y1)
            if untouched == "gradient":
                loss.backward(gradient=torch.ones_like(loss))  # explicit gradient: amp_patch leaves it alone
            else:
                torch.autograd.backward([loss])

        for f in ((scaled, other) if order == "scaled-first" else (other, scaled)):
            f()
        got = [p.grad for p in (model.parameters() if level == "O1" else amp_patch.master_params(opt))]
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.float(), r, **TOL)


def test_a_parameter_two_optimizers_share_is_unscaled_once():
    model = net()
    ref = fp32_grads(model, data())
    shared = model[0].weight
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD([shared] + list(model[2].parameters()), lr=0.1)
    with amp(model, [opt_a, opt_b], "O1", loss_scale=65536.0, **FP16) as (model, _):
        x, y = data()
        F.mse_loss(model(x), y).backward()
        torch.testing.assert_close(shared.grad, ref[0], **TOL)
        torch.testing.assert_close(model[2].weight.grad, ref[2], **TOL)


# ---------------------------------------------------------------- accumulation


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulating_four_micro_batches_with_one_overflow(level):
    model = net()
    ref_model = copy.deepcopy(model)
    ref_opt = sgd(ref_model, lr=0.05)
    opt = sgd(model, lr=0.05)
    with amp(model, opt, level, loss_scale="dynamic", **FP16) as (model, opt):
        for step in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            for k in range(4):
                x, y = data(4 * step + k)
                if step == 1 and k == 2:
                    x = x.clone()
                    x[0, 0] = float("inf")
                F.mse_loss(model(x), y).backward()
                if step != 1:
                    F.mse_loss(ref_model(x), y).backward()
                    got = [p.grad for p in (model.parameters() if level == "O1" else amp_patch.master_params(opt))]
                    for g, r in zip(got, (p.grad for p in ref_model.parameters())):
                        torch.testing.assert_close(g, r, **TOL)  # the running sum is true after each one
            scale = amp_patch.counters()["loss_scale"][0]
            opt.step()
            if step != 1:
                ref_opt.step()
            c = amp_patch.counters()
            assert c["skipped"] == (1 if step >= 1 else 0)
            assert (c["loss_scale"][0] < scale) == (step == 1)
            for p, r in zip(model.parameters(), ref_model.parameters()):
                assert torch.isfinite(p).all()
                torch.testing.assert_close(p.float(), r, rtol=1e-2, atol=1e-3)


def test_delay_unscale_accumulates_scaled_and_the_last_exit_unscales_once():
    model = net()
    ref = fp32_grads(model, data(0), data(1))
    opt = sgd(model)
    with amp(model, opt, "O1", loss_scale=256.0, **FP16) as (model, opt):
        x, y = data(0)
        with amp_patch.scale_loss(F.mse_loss(model(x), y), opt, delay_unscale=True) as s:
            s.backward()
        assert model[0].weight.grad.abs().max() > 10 * ref[0].abs().max()  # still scaled, as in Apex
        x, y = data(1)
        with amp_patch.scale_loss(F.mse_loss(model(x), y), opt) as s:
            s.backward()
        for p, r in zip(model.parameters(), ref):
            torch.testing.assert_close(p.grad, r, **TOL)


# ---------------------------------------------------------------- what read them before keeps working


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_unscale_master_params_and_clip_do_not_unscale_twice(level):
    model = net()
    ref = fp32_grads(model, data())
    opt = sgd(model)
    with amp(model, opt, level, loss_scale=1024.0, **FP16) as (model, opt):
        x, y = data()
        F.mse_loss(model(x), y).backward()
        amp_patch.unscale_(opt)
        amp_patch.unscale_(opt)
        params = list(amp_patch.master_params(opt))
        total = torch.nn.utils.clip_grad_norm_(params, 1e9)
        ref_total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref]))
        torch.testing.assert_close(total, ref_total, **TOL)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r, **TOL)


def test_larc_reads_true_gradients():
    from amp_patch.apex.parallel.LARC import LARC

    def run(use_amp):
        model = net()
        opt = LARC(torch.optim.SGD(model.parameters(), lr=0.1), trust_coefficient=0.02)
        if use_amp:
            model, opt = apex_amp.initialize(model, opt, opt_level="O1", half_dtype=f16, loss_scale=512.0, verbosity=0)
        try:
            x, y = data()
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            if use_amp:
                with apex_amp.scale_loss(loss, opt) as s:
                    s.backward()
            else:
                loss.backward()
            opt.step()
            return [p.detach().float().clone() for p in model.parameters()]
        finally:
            if use_amp:
                amp_patch.deinitialize()

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# ---------------------------------------------------------------- the half dtype from the environment


@pytest.mark.parametrize("entry", ["initialize", "apex.initialize", "amp.init"])
def test_every_entry_point_takes_the_half_dtype_from_the_environment(entry, monkeypatch):
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "float16")
    model = net()
    opt = sgd(model)
    if entry == "initialize":
        amp_patch.initialize(model, opt, "O1", verbosity=0)
    elif entry == "apex.initialize":
        apex_amp.initialize(model, opt, opt_level="O1", verbosity=0)
    else:
        apex_amp.init(enabled=True)
    try:
        x, _ = data()
        assert torch.mm(x, x.t()).dtype == f16
        assert amp_patch.counters()["loss_scale"][0] == 65536.0 or entry == "amp.init"
    finally:
        amp_patch.deinitialize()


def test_an_explicit_half_dtype_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "float16")
    with amp(None, None, "O1", half_dtype="bfloat16"):
        x, _ = data()
        assert torch.mm(x, x.t()).dtype == torch.bfloat16


def test_a_bad_half_dtype_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "float8")
    with pytest.raises(amp_patch.ConfigError, match="AMP_PATCH_HALF_DTYPE"):
        amp_patch.initialize(None, None, "O1")
    assert not amp_patch.is_initialized()


# ---------------------------------------------------------------- a load followed by a save


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_a_load_followed_by_a_save_returns_what_was_loaded(level):
    """Apex's test_checkpointing.py::test_restoring: ``restored.load_state_dict(sd)``
    then ``restored.state_dict()`` gives ``sd`` back, bit for bit, at every level."""
    source = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    sd = {k: v.clone() + 1e-4 * torch.randn_like(v) if v.is_floating_point() else v.clone()
          for k, v in source.state_dict().items()}
    restored = copy.deepcopy(source)
    opt = sgd(restored)
    with amp(restored, opt, level, **FP16) as (restored, opt):
        restored.load_state_dict(sd)
        back = restored.state_dict()
        assert back.keys() == sd.keys()
        for k in sd:
            assert back[k].dtype == sd[k].dtype, k
            assert torch.equal(back[k], sd[k]), k


# ---------------------------------------------------------------- what Apex's multiple-models test checks


def test_an_overflow_skips_only_the_optimizers_its_backward_fed():
    """Two optimizers sharing one loss scaler (Apex's ``num_losses=1`` with two
    ``scale_loss`` calls): an inf in the first backward skips the first
    optimizer's step only, as Apex decided per ``scale_loss`` exit."""
    m0, m1 = net(0), net(1)
    o0, o1 = sgd(m0), sgd(m1)
    (m0, m1), (o0, o1) = apex_amp.initialize([m0, m1], [o0, o1], opt_level="O1", half_dtype=f16, verbosity=0)
    try:
        before0 = [p.detach().clone() for p in m0.parameters()]
        before1 = [p.detach().clone() for p in m1.parameters()]
        x, y = data()
        with apex_amp.scale_loss(F.mse_loss(m0(x), y), o0) as s:
            s.backward()
            m0[0].weight.grad[0, 0] = float("inf")
        with apex_amp.scale_loss(F.mse_loss(m1(x), y), o1) as s:
            s.backward()
        o0.step()
        o1.step()
        assert all(torch.equal(a, b) for a, b in zip(before0, m0.parameters()))
        assert not torch.equal(before1[0], m1[0].weight)
        c = amp_patch.counters()
        assert [o["skipped"] for o in c["optimizers"]] == [1, 0]
    finally:
        amp_patch.deinitialize()


def test_amp_initialize_after_the_handle_was_deactivated_patches_again():
    """Apex's test_cache ends each case with ``_amp_state.handle._deactivate()``;
    the next ``amp.initialize`` casts again."""
    m = net()
    opt = sgd(m)
    apex_amp.initialize(m, opt, opt_level="O1", half_dtype=f16, verbosity=0)
    try:
        x, _ = data()
        apex_amp._amp_state.handle._deactivate()
        assert torch.mm(x, x.t()).dtype == torch.float32
        m2 = net(1)
        apex_amp.initialize(m2, sgd(m2), opt_level="O1", half_dtype=f16, verbosity=0)
        assert torch.mm(x, x.t()).dtype == f16
        assert apex_amp._amp_state.handle.is_active()
    finally:
        amp_patch.deinitialize()


# ---------------------------------------------------------------- copies of a model and its optimizer


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
def test_a_deep_copy_of_model_and_optimizer_at_o2_is_a_consistent_pair(order):
    """``copy.deepcopy((model, optimizer))`` gives the pair a deep copy made
    before initialize gives: stepping the copied optimizer trains the copied model."""
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = data()
    with amp(model, opt, "O2", **FP16) as (model, opt):
        F.mse_loss(model(x), y).backward()
        opt.step()  # momentum state exists
        ref_model = copy.deepcopy(model)  # a plain FP32 copy of the model's values
        if order == "model-first":
            m2, o2 = copy.deepcopy((model, opt))
        else:
            o2, m2 = copy.deepcopy((opt, model))
    # a reference pair built from the same values in plain torch
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(o2.state_dict()))  # load_state_dict would share the buffers
    held = {id(p) for g in o2.param_groups for p in g["params"]}
    assert held == {id(p) for p in m2.parameters()}, "the copied optimizer holds the copied model's parameters"
    assert all(p.dtype == torch.float32 for p in m2.parameters())
    for m, o in ((m2, o2), (ref_model, ref_opt)):
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    for a, b in zip(m2.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- a tie across the half/FP32 boundary


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.out = nn.Linear(8, 20, bias=False)
        self.out.weight = self.embed.weight  # tied, as language models do

    def forward(self, tokens):
        return self.out(torch.relu(self.body(self.embed(tokens))))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_keep_fp32_on_a_head_tied_to_the_embedding_keeps_both_fp32(level):
    model = TiedLM()
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 20, (4, 5))
    opt = sgd(model)
    with amp(model, opt, level, keep_fp32=["out"], **FP16) as (model, opt):
        assert model.out.weight is model.embed.weight
        assert model.embed.weight.dtype == torch.float32 and model.body.weight.dtype == f16
        out = model(tokens)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref(tokens), rtol=1e-2, atol=1e-2)
        F.cross_entropy(out.reshape(-1, 20), tokens.reshape(-1)).backward()
        opt.step()


def test_functional_call_with_fp32_parameters_at_o2_computes_in_fp32():
    from torch.func import functional_call

    model = net()
    ref = copy.deepcopy(model)
    opt = sgd(model)
    x, _ = data()
    with amp(model, opt, "O2", **FP16) as (model, opt):
        fp32 = {k: v.detach().float() for k, v in ref.named_parameters()}
        out = functional_call(model, fp32, (x,))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref(x), rtol=1e-6, atol=1e-6)
        assert model(x).dtype == torch.float32  # the model's own call: half inside, FP32 out
        half = {k: v.detach().half() for k, v in ref.named_parameters()}
        torch.testing.assert_close(functional_call(model, half, (x,)), model(x))


# ---------------------------------------------------------------- O2: half gradients move as they arrive


from amp_patch.base import running  # noqa: E402
from amp_patch.precision import onepass as _kernel, master as _master, master_parts as _master_parts  # noqa: E402

needs_kernel = pytest.mark.skipif(_kernel.native is None, reason="the C step kernel is not built here")


class _Seen(torch.autograd.Function):
    """Identity whose backward runs last (it is applied to the input) and records, at
    that moment, the last layer's half gradient and its master's FP32 one."""

    @staticmethod
    def forward(ctx, x, probe):
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        half, master, seen = ctx.probe
        seen.append((half.grad, None if master.grad is None else master.grad.clone()))
        return g, None


def _o2_loop(half_dtype, monkeypatch, hooked, how="plain", zero="optimizer", backwards=3, steps=3, scale=1024.0,
             model_grads=False):
    """Masters' gradients after each backward, and the masters after the steps, of an
    O2 loop whose backwards move half gradients as they arrive (``hooked``, under
    ``model_grads=False``) or at their end (the model's .grad then mirrors them, under
    ``model_grads=True``)."""
    if not hooked:
        monkeypatch.setattr(_master_parts.EarlyMoves, "can_arm", lambda self: False)
    model = net()
    opt = sgd(model, lr=0.05)
    grads, extra = [], {} if half_dtype == torch.bfloat16 else dict(loss_scale=scale)
    with amp(model, opt, "O2", half_dtype=half_dtype, model_grads=model_grads, **extra) as (model, opt):
        masters = list(amp_patch.master_params(opt))
        for step in range(steps):
            # the optimizer's zero_grad releases these small FP32 buffers (their first
            # backward fills them at its end); the model's keeps them (filled as gradients arrive)
            (opt if zero == "optimizer" else model).zero_grad()
            for k in range(backwards):
                x, y = data(backwards * step + k)
                loss = F.mse_loss(model(x), y)
                if how == "plain":
                    loss.backward()
                else:
                    with amp_patch.scale_loss(loss, opt) as s:
                        s.backward()
                if model_grads:  # the model's .grad reads the masters' running sum
                    assert all(torch.equal(p.grad, m.grad.to(p.dtype)) for p, m in zip(model.parameters(), masters))
                else:
                    assert all(p.grad is None for p in model.parameters())  # no half gradient outlives the backward
                grads.append([m.grad.clone() for m in masters])
            opt.step()
        out = [m.detach().clone() for m in masters]
    monkeypatch.undo()
    return grads, out


@needs_kernel
@pytest.mark.parametrize("half_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["plain", "scale_loss"])
@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_o2_moving_each_half_gradient_as_it_arrives_gives_the_same_bits(half_dtype, how, zero, monkeypatch):
    # three backwards per step: the first writes the masters' gradients, the next two add to them
    # and the default, the model's .grad mirroring the masters, computes the same bits
    got_grads, got = _o2_loop(half_dtype, monkeypatch, hooked=True, how=how, zero=zero)
    ref_grads, ref = _o2_loop(half_dtype, monkeypatch, hooked=False, how=how, zero=zero)
    mirror_grads, mirror = _o2_loop(half_dtype, monkeypatch, hooked=True, how=how, zero=zero, model_grads=True)
    for other_grads, other in ((ref_grads, ref), (mirror_grads, mirror)):
        for gs, rs in zip(got_grads, other_grads):
            for g, r in zip(gs, rs):
                assert g.dtype == torch.float32
                assert torch.equal(g.view(torch.int32), r.view(torch.int32))
        for m, r in zip(got, other):
            assert torch.equal(m, r)


@needs_kernel
def test_o2_a_half_gradient_is_in_its_master_before_the_backward_ends():
    model = net()
    opt = sgd(model)
    with amp(model, opt, "O2", half_dtype=f16, loss_scale=1024.0, model_grads=False) as (model, opt):
        last = model[-1].weight
        master = _master.lookup(running.session().precision, last)
        x, y = data()
        F.mse_loss(model(x), y).backward()  # makes the FP32 buffers, which model.zero_grad() keeps
        opt.step()
        model.zero_grad()
        seen = []
        F.mse_loss(model(_Seen.apply(x.requires_grad_(), (last, master, seen))), y).backward()
        (half_grad, master_grad), = seen
        assert half_grad is None  # dropped as soon as its master had it
        assert master_grad is not None and master_grad.dtype == torch.float32
        ref_model = net()
        with torch.no_grad():
            for r, m in zip(ref_model.parameters(), amp_patch.master_params(opt)):
                r.copy_(m)
        ref = fp32_grads(ref_model, data())[-2]
        torch.testing.assert_close(master_grad, ref, **TOL)  # unscaled already
        torch.testing.assert_close(master.grad, master_grad)


@needs_kernel
def test_o2_an_overflow_found_as_gradients_arrive_skips_the_step():
    model = net()
    opt = sgd(model)
    with amp(model, opt, "O2", half_dtype=f16, loss_scale="dynamic", model_grads=False) as (model, opt):
        x, y = data()
        F.mse_loss(model(x), y).backward()  # makes the FP32 buffers, which model.zero_grad() keeps
        opt.step()
        model.zero_grad()
        before = [m.detach().clone() for m in amp_patch.master_params(opt)]
        scale = amp_patch.counters()["loss_scale"][0]
        x = x.clone()
        x[0, 0] = float("inf")
        F.mse_loss(model(x), y).backward()
        opt.step()
        c = amp_patch.counters()
        assert c["skipped"] == 1 and c["loss_scale"][0] == scale / 2
        for m, b in zip(amp_patch.master_params(opt), before):
            assert torch.equal(m.detach(), b)


@needs_kernel
def test_o2_a_parameter_reached_twice_in_one_backward_sums_both_in_fp32():
    # reentrant checkpointing runs a backward inside the backward: the shared layer's
    # gradient arrives twice, and the master holds the sum of both
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    ref_model = copy.deepcopy(model)
    x = torch.randn(4, 6)

    def run(m):
        h = checkpoint(m, x.requires_grad_(), use_reentrant=True)
        return m(h).square().mean()

    run(ref_model).backward()
    opt = sgd(model)
    with amp(model, opt, "O2", half_dtype=f16, loss_scale=1024.0, model_grads=False) as (model, opt):
        run(model).backward()
        assert all(p.grad is None for p in model.parameters())
        for m, r in zip(amp_patch.master_params(opt), ref_model.parameters()):
            assert m.grad.dtype == torch.float32
            torch.testing.assert_close(m.grad, r.grad, **TOL)


@needs_kernel
def test_o2_a_users_own_post_accumulate_hook_still_sees_the_half_gradient():
    model = net()
    opt = sgd(model)
    with amp(model, opt, "O2", half_dtype=torch.bfloat16, model_grads=False) as (model, opt):
        x, y = data()
        F.mse_loss(model(x), y).backward()  # amp_patch's hooks are in place first
        seen = []
        w = model[0].weight
        handle = w.register_post_accumulate_grad_hook(lambda p: seen.append(None if p.grad is None else p.grad.dtype))
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        handle.remove()
        assert seen == [torch.bfloat16]
        assert w.grad is None
        assert _master.lookup(running.session().precision, w).grad.dtype == torch.float32
