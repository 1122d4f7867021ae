"""Apex-era scripts' use of apex.amp beyond its public API: ``_amp_state``, Apex's
re-initialize rule, Apex's error types, and the 2018 ``amp.init`` handle API."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import AmpWarning, CastError, ConfigError, StateError, amp
from amp_patch.base import running
from helpers import Snapshot, batch, mlp, sgd

f16 = torch.float16


@pytest.fixture(autouse=True)
def fresh_apex_flags():
    """Scripts set _amp_state's flags; every test starts from Apex's defaults."""
    state = amp._amp_state
    saved = (state.allow_incoming_model_not_fp32, state.hard_override, state.verbosity)
    yield state
    state.allow_incoming_model_not_fp32, state.hard_override, state.verbosity = saved


def fp16_o1(model, opt, **kw):
    return amp.initialize(model, opt, opt_level="O1", half_dtype=f16, verbosity=0, **kw)


# ---------------------------------------------------------------- _amp_state


def test_amp_state_has_no_run_until_initialize():
    # Apex's own check: hasattr(_amp_state, "opt_properties") is False before initialize
    for name in ("opt_properties", "loss_scalers", "handle"):
        assert not hasattr(amp._amp_state, name), name


@pytest.mark.quick
def test_loss_scalers_are_a_live_view_that_scripts_can_set():
    model = mlp(4, 8, 1)
    model, opt = fp16_o1(model, sgd(model))
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.loss_scale() == scaler._loss_scale == 2.0**16 and scaler.dynamic
    scaler._loss_scale = 2**12  # a script's own starting scale
    x, y = batch(0, 4, 1)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 2**12, rel=1e-6)
        scaled.backward()
    opt.step()
    assert running.session().scaling.scalers[0].scale == 2.0**12
    assert amp._amp_state.loss_scalers[0]._unskipped == 1  # one clean step towards growth
    amp._amp_state.loss_scalers[0]._unskipped = 0
    assert running.session().scaling.scalers[0].growth_tracker == 0
    with pytest.raises(ValueError, match="finite number > 0"):
        scaler._loss_scale = 0
    amp_patch.deinitialize()


def test_setting_a_scale_on_an_inactive_scaler_switches_scaling_on():
    model = mlp(4, 8, 1)
    model, opt = amp.initialize(model, sgd(model), opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 1.0 and not amp._amp_state.loss_scalers[0].dynamic
    amp._amp_state.loss_scalers[0]._loss_scale = 128.0
    x, y = batch(0, 4, 1)
    loss = F.mse_loss(model(x), y)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 128.0, rel=1e-6)
    amp_patch.deinitialize()


@pytest.mark.quick
def test_opt_properties_speak_apexs_names():
    model = mlp(4, 8, 1)
    amp.initialize(model, sgd(model), opt_level="O2", half_dtype=f16, verbosity=0)
    props = amp._amp_state.opt_properties
    assert (props.enabled, props.opt_level, props.cast_model_type, props.patch_torch_functions,
            props.keep_batchnorm_fp32, props.master_weights, props.loss_scale) == (
        True, "O2", f16, False, True, True, "dynamic")
    assert props.options["opt_level"] == "O2"
    with pytest.raises(AttributeError, match="pass loss_scale=1.0 to amp.initialize"):
        props.loss_scale = 1.0
    assert not hasattr(amp._amp_state, "handle")  # Apex makes the handle only at O1
    amp_patch.deinitialize()


def test_handle_deactivate_takes_the_function_patches_off():
    before = Snapshot()
    model = mlp(4, 8, 1)
    model, opt = fp16_o1(model, sgd(model))
    handle = amp._amp_state.handle
    assert handle.is_active() and before.changed()
    handle._deactivate()
    assert not handle.is_active() and not before.changed()
    x, _ = batch(0, 4, 1)
    assert model(x).dtype == torch.float32  # no casts left: the model runs as written
    amp_patch.deinitialize()


def test_a_model_already_in_fp16_is_refused_unless_the_script_allows_it():
    torch.manual_seed(0)
    model = mlp(8, 8, 1).half()
    ref = copy.deepcopy(model)
    opt, opt_ref = sgd(model), sgd(ref)
    with pytest.raises(ConfigError, match="is torch.float16"):
        fp16_o1(model, opt)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    model, opt = fp16_o1(model, opt)
    x, y = batch(0, 8, 1)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(F.mse_loss(model(x).float(), y), opt) as scaled:
            scaled.backward()
        opt.step()
    amp_patch.deinitialize()
    # as Apex trained it: FP16 gradients scaled by 2**16, unscaled in place, the FP16 weights stepped
    for _ in range(2):
        opt_ref.zero_grad()
        (F.mse_loss(ref(x.half()).float(), y) * 2.0**16).backward()
        for p in ref.parameters():
            p.grad.mul_(2.0**-16)
        opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == f16 and torch.equal(p, q)


def test_maybe_print_and_warn_or_err_behave_as_apexs(caplog):
    from amp_patch.apex import amp_state

    with pytest.raises(RuntimeError, match="odd"):
        amp_state.warn_or_err("odd")
    amp._amp_state.hard_override = True
    amp_state.warn_or_err("odd")  # a warning only
    assert "odd" in caplog.text


# ------------------------------------------------------- re-initialize rule


def test_o0_then_o1_then_o2_in_one_process_work_as_under_apex():
    m0, m1, m2 = mlp(4, 8, 1, seed=0), mlp(4, 8, 1, seed=1), mlp(4, 8, 1, seed=2)
    x, y = batch(0, 4, 1)
    m0, o0 = amp.initialize(m0, sgd(m0), opt_level="O0", verbosity=0)
    assert amp._amp_state.opt_properties.opt_level == "O0"
    with pytest.warns(AmpWarning, match=r"replaced the running O0 .*optimizer\(s\) are plain torch optimizers again"):
        m1, o1 = amp.initialize(m1, sgd(m1), opt_level="O1", half_dtype=f16, verbosity=0)
    assert amp._amp_state.opt_properties.opt_level == "O1"
    with pytest.warns(AmpWarning, match=r"replaced the running O1 .*no longer cast"):
        m2, o2 = amp.initialize(m2, sgd(m2), opt_level="O2", half_dtype=f16, verbosity=0)
    assert amp._amp_state.opt_properties.opt_level == "O2" and m2[0].weight.dtype == f16
    assert m1[0].weight.dtype == torch.float32 and m1(x).dtype == torch.float32  # the O1 model runs in FP32 now
    before = [p.detach().clone() for p in amp.master_params(o2)]
    with amp.scale_loss(F.mse_loss(m2(x), y), o2) as scaled:
        scaled.backward()
    o2.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, amp.master_params(o2)))
    amp_patch.deinitialize()


def test_a_later_call_with_more_losses_restarts_the_scalers_as_apex_did():
    ga, gb = mlp(4, 8, 1, seed=0), mlp(4, 8, 1, seed=1)
    ga, oa = fp16_o1(ga, sgd(ga))
    amp._amp_state.loss_scalers[0]._loss_scale = 2**10
    x, y = batch(0, 4, 1)
    with amp.scale_loss(F.mse_loss(ga(x), y), oa) as scaled:
        scaled.backward()
    oa.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same settings: the run goes on with no warning
        gb, ob = fp16_o1(gb, sgd(gb), num_losses=3)
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [2.0**16] * 3  # anew, as in Apex
    for loss_id in range(3):
        with amp.scale_loss(F.mse_loss(gb(x), y), ob, loss_id=loss_id) as scaled:
            scaled.backward()
    ob.step()
    # the earlier model and optimizer are still in the run
    with amp.scale_loss(F.mse_loss(ga(x), y), oa) as scaled:
        scaled.backward()
    oa.step()
    assert running.session().models == [ga, gb]
    amp_patch.deinitialize()


def test_passing_the_same_model_again_leaves_it_as_it_is():
    model = mlp(4, 8, 1)
    model, opt = amp.initialize(model, sgd(model), opt_level="O2", half_dtype=f16, verbosity=0)
    masters = list(amp.master_params(opt))
    again, opt_again = amp.initialize(model, opt, opt_level="O2", half_dtype=f16, verbosity=0)
    assert again is model and opt_again is opt and list(amp.master_params(opt)) == masters
    assert model[0].weight.dtype == f16
    amp_patch.deinitialize()
    assert model[0].weight.dtype == torch.float32


def test_a_bad_later_call_leaves_the_earlier_run_as_it_was():
    model = mlp(4, 8, 1)
    model, opt = fp16_o1(model, sgd(model))
    run = running.session()
    with pytest.raises(ConfigError, match="O9"):
        amp.initialize(mlp(4, 8, 1), None, opt_level="O9", verbosity=0)
    assert running.session() is run and run.config.opt_level == "O1"
    amp_patch.deinitialize()


def test_amp_patchs_own_initialize_refuses_more_losses_at_that_call():
    ma, mb = mlp(4, 8, 1, seed=0), mlp(4, 8, 1, seed=1)
    amp_patch.initialize(ma, sgd(ma), opt_level="O1", half_dtype=f16, verbosity=0)
    ob = sgd(mb)
    with pytest.raises(ConfigError, match=r"num_losses=3 \(running: 1\)"):
        amp_patch.initialize(mb, ob, opt_level="O1", half_dtype=f16, verbosity=0, num_losses=3)
    assert running.session().models == [ma] and len(running.session().scaling.scalers) == 1
    amp_patch.deinitialize()


# ------------------------------------------------------------- error types


def test_an_inplace_fp32_op_on_a_half_tensor_is_apexs_not_implemented_error():
    model = mlp(4, 8, 1)
    fp16_o1(model, sgd(model))
    h = torch.randn(3).half()
    with pytest.raises(NotImplementedError, match="exp_ runs in float32"):
        h.exp_()
    try:
        h.exp_()
    except RuntimeError as e:  # and still what amp_patch raised before
        assert isinstance(e, CastError)
    amp_patch.deinitialize()


# ------------------------------------------------------ the 2018 handle API


class Ext:
    """A user's own extension function, registered with amp before init."""

    @staticmethod
    def mix(a, b):
        return a @ b


@pytest.mark.quick
def test_init_patches_and_its_handle_scales_unscales_and_skips():
    before = Snapshot()
    model = mlp(4, 8, 1)
    opt = sgd(model)
    handle = amp.init(loss_scale=128.0)
    assert handle.is_active() and before.changed()
    x, y = batch(0, 4, 1)
    loss = F.mse_loss(model(x), y)
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled.item() == pytest.approx(loss.item() * 128.0, rel=1e-6)
        scaled.backward()
    true = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    w = [p.detach().clone() for p in model.parameters()]
    opt.step()
    for p, w0, g in zip(model.parameters(), w, true):
        torch.testing.assert_close(p.detach(), w0 - 0.1 * g, rtol=0, atol=1e-6)
    with handle.disable_casts():
        assert torch.mm(x, torch.ones(4, 2)).dtype == torch.float32
    assert torch.mm(x, torch.ones(4, 2)).dtype == torch.bfloat16  # O1's casts, on CPU in BF16
    handle._deactivate()
    assert not handle.is_active() and not before.changed() and not amp_patch.is_initialized()


def test_wrap_optimizer_gives_each_loss_its_scale_and_skips_on_overflow():
    model = mlp(4, 8, 1)
    handle = amp.init(loss_scale=64.0)
    opt = handle.wrap_optimizer(sgd(model), num_loss=2)
    x, y = batch(0, 4, 1)
    with opt.scale_loss(F.mse_loss(model(x), y)) as scaled:
        scaled.backward()
    with opt.scale_loss(F.mse_loss(model(x), y) * float("inf")) as scaled:
        scaled.backward()
    w = [p.detach().clone() for p in model.parameters()]
    opt.step()  # loss 1 overflowed: skipped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), w))
    opt.zero_grad()
    for _ in range(2):
        with opt.scale_loss(F.mse_loss(model(x), y)) as scaled:
            scaled.backward()
    opt.step()
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), w))
    with pytest.raises(StateError, match="num_loss=2"):
        for _ in range(3):
            with opt.scale_loss(F.mse_loss(model(x), y)) as scaled:
                scaled.backward()
    with pytest.raises(StateError, match="wrapped optimizer"):
        with handle.scale_loss(F.mse_loss(model(x), y), opt._optimizer):
            pass
    handle._deactivate()


def test_registrations_before_init_are_honoured_and_disabled_init_does_nothing():
    before = Snapshot()
    noop = amp.init(enabled=False)
    assert not noop.is_active() and not amp_patch.is_initialized() and not before.changed()
    with noop.scale_loss(torch.ones(()), None) as same:
        assert same.item() == 1.0
    amp.register_half_function(Ext, "mix")
    try:
        handle = amp.init()
        a, b = torch.randn(2, 3), torch.randn(3, 2)
        assert Ext.mix(a, b).dtype == torch.bfloat16
        handle._deactivate()
        assert Ext.mix(a, b).dtype == torch.float32
    finally:
        amp_patch.frontend._user_registrations[:] = [
            r for r in amp_patch.frontend._user_registrations if r[0] is not Ext
        ]


def test_allow_banned_runs_banned_ops_in_fp32_instead_of_raising():
    p, t = torch.rand(4), torch.rand(4)
    amp._amp_state.verbosity = 0  # no word about FP16 on a CPU
    handle = amp.init(half_dtype=f16)
    with pytest.raises(NotImplementedError, match="binary_cross_entropy_with_logits"):
        F.binary_cross_entropy(p.half(), t)
    handle._deactivate()
    handle = amp.init(half_dtype=f16, allow_banned=True)
    out = F.binary_cross_entropy(p.half(), t)
    assert out.dtype == torch.float32
    assert torch.equal(out, F.binary_cross_entropy.__wrapped__(p.half().float(), t))
    handle._deactivate()
