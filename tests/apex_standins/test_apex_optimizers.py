"""The apex.optimizers, apex.multi_tensor_apply and amp_C stand-ins against
what the Apex code they replace computes: torch's own optimizers where Apex's
kernel is torch's algorithm, hand-written per-parameter references (from the
papers and Apex's kernels) where torch has none."""
from __future__ import annotations

import copy
import ctypes
import math
import warnings

import pytest
import torch
from torch import nn

import amp_patch
from amp_patch.apex import amp_C
from amp_patch.apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier
from amp_patch.apex.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad,
                                       FusedSGD)
from helpers import amp

SHAPES = [(4, 3), (3,), (2, 3)]


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def grads_at(step, dtype=torch.float32, scale=1.0):
    """The gradients of step ``step``: seeded, the same for every run that asks."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


def train(opt, params, steps=4, dtype=None, scale=1.0):
    for i in range(steps):
        for p, g in zip(params, grads_at(i, dtype or params[0].dtype, scale)):
            p.grad = g
        opt.step()
    return params


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def close(a, b, **tol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, **tol)


def train_beside(opt, a, ref, b, steps, start=0, scale=1.0):
    """Step ``opt`` on ``a`` and ``ref`` on ``b`` with the gradients of steps
    ``start`` on (drawn in ``a``'s dtype, then given to each parameter in its
    own dtype and on its device)."""
    for i in range(start, start + steps):
        for p, q, g in zip(a, b, grads_at(i, a[0].dtype, scale)):
            p.grad, q.grad = g.to(p.device), g.to(q.device, q.dtype, copy=True)
        opt.step()
        ref.step()


def assert_masters_are(opt, a, b):
    """``opt``'s FP32 masters of ``a`` are ``b`` exactly, and ``a`` holds them rounded."""
    masters = [opt.state[p]["master_param"] for p in a]
    assert same(masters, [q.detach() for q in b])
    assert same([p.detach() for p in a], [m.to(a[0].dtype) for m in masters])


# ------------------------------------------------------------------ references from the algorithms


def ref_adam(p, g, st, *, lr, beta1, beta2, eps, wd, step, w_mode, bias_correction=True):
    """Apex's Adam kernel on one FP32 tensor: L2 decay in the gradient, or AdamW's in the step."""
    if not w_mode:
        g = g + wd * p
    st["m"] = beta1 * st["m"] + (1 - beta1) * g
    st["v"] = beta2 * st["v"] + (1 - beta2) * g * g
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    u = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + eps)
    if w_mode:
        u = u + wd * p
    return p - lr * u


def ref_lamb(ps, gs, states, step, *, lr, beta1, beta2, eps, wd, w_mode, grad_averaging, bias_correction,
             max_grad_norm, nvlamb):
    """LAMB (You et al. 2019) as Apex's kernel computes it: global-norm clipping,
    Adam direction, per-tensor trust ratio ||p|| / ||u|| (1 where a norm is 0)."""
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs))
    clip = norm / max_grad_norm if norm > max_grad_norm else 1.0
    beta3 = 1 - beta1 if grad_averaging else 1.0
    bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if bias_correction else (1.0, 1.0)
    out = []
    for p, g, st in zip(ps, gs, states):
        g = g / clip
        if not w_mode:
            g = g + wd * p
        st["m"] = beta1 * st["m"] + beta3 * g
        st["v"] = beta2 * st["v"] + (1 - beta2) * g * g
        u = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + eps)
        if w_mode:
            u = u + wd * p
        ratio = 1.0
        if nvlamb or wd != 0:
            pn, un = float(p.norm()), float(u.norm())
            ratio = pn / un if pn != 0 and un != 0 else 1.0
        out.append(p - lr * ratio * u)
    return out


def ref_novograd(ps, gs, states, step, *, lr, beta1, beta2, eps, wd, grad_averaging, norm_type, init_zero,
                 reg_inside_moment, bias_correction=True):
    """NovoGrad (Ginsburg et al. 2019) as Apex's kernel computes it: a per-layer
    second moment that is a running norm of the layer's gradient."""
    beta3 = 1 - beta1 if grad_averaging else 1.0
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = math.sqrt(1 - beta2 ** step) if bias_correction else 1.0
    out = []
    for p, g, st in zip(ps, gs, states):
        n = float(g.norm()) if norm_type == 2 else float(g.abs().max())
        if "v" not in st:
            st["v"] = 0.0 if init_zero else n
        if norm_type == 2:
            st["v"] = math.sqrt(beta2 * st["v"] ** 2 + (1 - beta2) * n * n)
        else:
            st["v"] = beta2 * st["v"] + (1 - beta2) * n
        denom = st["v"] / bc2 + eps
        if reg_inside_moment:
            st["m"] = beta1 * st["m"] + beta3 * (g / denom + wd * p)
            out.append(p - lr * st["m"] / bc1)
        else:
            st["m"] = beta1 * st["m"] + beta3 * g
            out.append(p - lr * (st["m"] / bc1 / denom + wd * p))
    return out


def run_reference(ref, steps=4, **kw):
    ps = [p.detach().clone() for p in make_params()]
    states = [{"m": torch.zeros_like(p)} for p in ps]
    for i in range(steps):
        ps = ref(ps, grads_at(i), states, i + 1, **kw)
    return ps


# ------------------------------------------------------------------ FusedAdam


@pytest.mark.parametrize("w_mode, torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fused_adam_is_torch_adamw_or_adam(w_mode, torch_cls):
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    a = make_params()
    train(FusedAdam([{"params": a[:2]}, {"params": a[2:], "lr": 3e-2}], adam_w_mode=w_mode, **kw), a)
    b = make_params()
    train(torch_cls([{"params": b[:2]}, {"params": b[2:], "lr": 3e-2}], fused=True, **kw), b)
    assert same(a, b)
    c = make_params()
    train(torch_cls(c, **kw), c)  # torch's default (single-tensor) kernel
    d = make_params()
    train(FusedAdam(d, adam_w_mode=w_mode, **kw), d)
    close(c, d, rtol=1e-5, atol=1e-6)
    assert not same(a, make_params())


@pytest.mark.parametrize("w_mode", [True, False])
def test_fused_adam_without_bias_correction_follows_the_kernel(w_mode):
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.05, w_mode=w_mode, bias_correction=False)
    a = make_params()
    opt = FusedAdam(a, lr=1e-2, eps=1e-8, weight_decay=0.05, adam_w_mode=w_mode, bias_correction=False)
    train(opt, a)
    ps = [p.detach().clone() for p in make_params()]
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ps]
    for i in range(4):
        ps = [ref_adam(p, g, st, step=i + 1, **kw) for p, g, st in zip(ps, grads_at(i), states)]
    close(a, ps, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["step"] == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_adam_updates_half_params_in_fp32_with_fp32_state(dtype):
    a = make_params(dtype)
    opt = FusedAdam(a, lr=1e-2, weight_decay=0.1)
    train(opt, a)
    assert all(p.dtype == dtype for p in a)
    assert all(s[k].dtype == torch.float32 for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    # the reference keeps FP32 moments and rounds the parameter once per step
    ps = [p.detach().clone() for p in make_params(dtype)]
    states = [{"m": torch.zeros(p.shape), "v": torch.zeros(p.shape)} for p in ps]
    for i in range(4):
        ps = [ref_adam(p.float(), g.float(), st, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.1, step=i + 1,
                       w_mode=True).to(dtype) for p, g, st in zip(ps, grads_at(i, dtype), states)]
    ulp = torch.finfo(dtype).eps
    for x, y in zip(a, ps):
        assert ((x.float() - y.float()).abs() <= ulp * y.float().abs() + 1e-6).all()


def test_fused_adam_master_weights_track_the_fp32_run():
    a = make_params(torch.bfloat16)
    opt = FusedAdam(a, lr=1e-2, weight_decay=0.1, capturable=True, master_weights=True)
    b = [nn.Parameter(p.detach().float()) for p in a]
    train_beside(opt, a, torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True), b, steps=4)
    assert_masters_are(opt, a, b)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and int(opt.param_groups[0]["step"]) == 4


def scaled_run(make, *, unscale=False, overflow_at=None, steps=4):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = make(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's note on scalers passing themselves to step
        for i in range(steps):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
            scaler.scale(model(x).pow(2).sum()).backward()
            if i == overflow_at:
                model.weight.grad[0, 0] = float("inf")
            if unscale:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return [p.detach() for p in model.parameters()], opt, scaler


@pytest.mark.parametrize("how", [{}, {"unscale": True}, {"overflow_at": 2}])
def test_capturable_fused_adam_takes_the_grad_scaler_like_torch(how):
    a, opt, scaler = scaled_run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, capturable=True), **how)
    # Capturable FusedAdam keeps lr as an FP32 tensor, as Apex's does (its kernel reads a float*), so
    # the reference takes the same FP32 lr. torch's fused kernel derives the step size
    # lr / (1 - beta1**t) in FP64 and rounds it to FP32: from 0.01 and from FP32's 0.01
    # (0.009999999776...) it rounds alike at t = 1, 2, 3 and one ulp apart at t = 4, so a float lr
    # matched only runs of three steps. With equal inputs both run the same kernel on the same
    # values, so they agree bit for bit on any CPU.
    b, _, ref_scaler = scaled_run(lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2, dtype=torch.float32),
                                                               weight_decay=0.1, fused=True), **how)
    assert same(a, b)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert opt._step_supports_amp_scaling
    # a skipped step is not counted
    assert int(opt.param_groups[0]["step"]) == (3 if how.get("overflow_at") is not None else 4)


@pytest.mark.quick
def test_fused_adam_state_and_groups_have_apex_layout():
    a = make_params()
    opt = FusedAdam(a)
    train(opt, a, steps=1)
    assert set(opt.param_groups[0]) == {"params", "lr", "bias_correction", "betas", "eps", "weight_decay", "step"}
    assert set(opt.state[a[0]]) == {"exp_avg", "exp_avg_sq"}
    assert opt.adam_w_mode == 1 and opt.set_grad_none is True
    # Apex's checkpoint layout: one step count per group, none per parameter
    sd = opt.state_dict()
    assert sd["param_groups"][0]["step"] == 1 and "step" not in sd["state"][0]


# ------------------------------------------------------------------ FusedSGD


@pytest.mark.parametrize("kw", [
    dict(momentum=0.0, weight_decay=0.0),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, dampening=0.1, weight_decay=1e-2),
    dict(momentum=0.9, nesterov=True, weight_decay=1e-2),
])
def test_fused_sgd_is_torch_sgd(kw):
    a = make_params()
    train(FusedSGD(a, lr=0.1, **kw), a)
    b = make_params()
    train(torch.optim.SGD(b, lr=0.1, foreach=True, **kw), b)
    assert same(a, b)
    assert not same(a, make_params())


@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_sgd_wd_after_momentum_follows_the_kernel(nesterov):
    lr, mom, wd = 0.1, 0.9, 0.05
    a = make_params()
    train(FusedSGD(a, lr=lr, momentum=mom, weight_decay=wd, nesterov=nesterov, wd_after_momentum=True), a)
    ps = [p.detach().clone() for p in make_params()]
    bufs = [None] * len(ps)
    for i in range(4):
        for j, g in enumerate(grads_at(i)):
            bufs[j] = g.clone() if bufs[j] is None else mom * bufs[j] + g  # first step: the buffer is the gradient
            d = g + mom * bufs[j] if nesterov else bufs[j]
            ps[j] = ps[j] - lr * (d + wd * ps[j])  # the decay after the momentum
    close(a, ps, rtol=1e-5, atol=1e-6)
    b = make_params()
    train(torch.optim.SGD(b, lr=lr, momentum=mom, weight_decay=wd, nesterov=nesterov), b)
    assert not all(torch.allclose(x, y) for x, y in zip(a, b))  # not the same as decay before momentum


def test_fused_sgd_half_params_keep_half_momentum():
    a = make_params(torch.float16)
    opt = FusedSGD(a, lr=0.1, momentum=0.9)
    train(opt, a)
    assert all(opt.state[p]["momentum_buffer"].dtype == torch.float16 for p in a)
    ps = [p.detach().float() for p in make_params(torch.float16)]
    bufs = [None] * len(ps)
    for i in range(4):
        for j, g in enumerate(grads_at(i, torch.float16)):
            g = g.float()
            bufs[j] = (g if bufs[j] is None else 0.9 * bufs[j].float() + g).half()
            ps[j] = (ps[j] - 0.1 * bufs[j].float()).half().float()
    close([p.float() for p in a], ps, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------ FusedAdagrad


@pytest.mark.quick
def test_fused_adagrad_is_torch_adagrad():
    a = make_params()
    opt = FusedAdagrad(a, lr=0.1, weight_decay=0.01, eps=1e-10)
    train(opt, a)
    b = make_params()
    train(torch.optim.Adagrad(b, lr=0.1, weight_decay=0.01, eps=1e-10, foreach=True), b)
    assert same(a, b)
    assert set(opt.state[a[0]]) == {"sum"}
    assert set(opt.param_groups[0]) == {"params", "lr", "eps", "weight_decay"}


def test_fused_adagrad_w_mode_follows_the_kernel():
    lr, wd, eps = 0.1, 0.05, 1e-10
    a = make_params()
    train(FusedAdagrad(a, lr=lr, weight_decay=wd, eps=eps, adagrad_w_mode=True), a)
    ps = [p.detach().clone() for p in make_params()]
    hs = [torch.zeros_like(p) for p in ps]
    for i in range(4):
        for j, g in enumerate(grads_at(i)):
            hs[j] = hs[j] + g * g
            ps[j] = ps[j] - lr * (g / (hs[j].sqrt() + eps) + wd * ps[j])
    close(a, ps, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ FusedLAMB


@pytest.mark.parametrize("kw", [
    dict(),                                                     # Apex's defaults: AdamW mode, wd 0.01
    dict(adam_w_mode=False, weight_decay=0.05),
    dict(grad_averaging=False, bias_correction=False),
    dict(weight_decay=0.0),                                     # no decay: no trust ratio
    dict(weight_decay=0.0, use_nvlamb=True),                    # nvlamb: the trust ratio anyway
    dict(max_grad_norm=100.0),                                  # no clipping
])
def test_fused_lamb_follows_the_algorithm(kw):
    a = make_params()
    opt = FusedLAMB(a, lr=1e-2, **kw)
    train(opt, a, scale=3.0)  # a global norm above Apex's default max_grad_norm=1
    ref_kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, wd=kw.get("weight_decay", 0.01),
                  w_mode=kw.get("adam_w_mode", True), grad_averaging=kw.get("grad_averaging", True),
                  bias_correction=kw.get("bias_correction", True), max_grad_norm=kw.get("max_grad_norm", 1.0),
                  nvlamb=kw.get("use_nvlamb", False))
    ps = [p.detach().clone() for p in make_params()]
    states = [{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ps]
    for i in range(4):
        ps = ref_lamb(ps, [g * 3.0 for g in grads_at(i)], states, i + 1, **ref_kw)
    close(a, ps, rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["step"] == 4
    assert set(opt.param_groups[0]) == {"params", "lr", "bias_correction", "betas", "eps", "weight_decay",
                                        "grad_averaging", "max_grad_norm", "step"}


def test_fused_lamb_trust_ratio_is_one_for_a_zero_parameter_and_grads_are_left_alone():
    p = nn.Parameter(torch.zeros(3))
    opt = FusedLAMB([p], lr=0.1, weight_decay=0.01, max_grad_norm=100.0)
    g = torch.tensor([1.0, -2.0, 0.5])
    p.grad = g.clone()
    opt.step()
    # first step, zero weight: the update is m_hat / (sqrt(v_hat) + eps) = sign(g) (almost)
    torch.testing.assert_close(p.detach(), -0.1 * g.sign(), rtol=1e-5, atol=1e-6)
    assert torch.equal(p.grad, g)


# ------------------------------------------------------------------ FusedNovoGrad


@pytest.mark.parametrize("kw", [
    dict(),
    dict(norm_type=0),
    dict(init_zero=True, weight_decay=0.01),
    dict(reg_inside_moment=True, weight_decay=0.01),
    dict(grad_averaging=False, betas=(0.95, 0.98)),
])
def test_fused_novograd_follows_the_algorithm(kw):
    a = make_params()
    opt = FusedNovoGrad(a, lr=1e-2, **kw)
    train(opt, a)
    beta1, beta2 = kw.get("betas", (0.9, 0.999))
    ps = run_reference(ref_novograd, lr=1e-2, beta1=beta1, beta2=beta2, eps=1e-8, wd=kw.get("weight_decay", 0.0),
                       grad_averaging=kw.get("grad_averaging", True), norm_type=kw.get("norm_type", 2),
                       init_zero=kw.get("init_zero", False), reg_inside_moment=kw.get("reg_inside_moment", False))
    close(a, ps, rtol=1e-5, atol=1e-6)
    group = opt.param_groups[0]
    # Apex's layout: per-layer norms in the group, [half params, FP32 params]
    assert [t.numel() for t in group["exp_avg_sq"]] == [0, 3] and group["step"] == 4
    assert set(opt.state[a[0]]) == {"exp_avg"}


def test_fused_novograd_refuses_a_changed_set_of_gradients():
    a = make_params()
    opt = FusedNovoGrad(a)
    train(opt, a, steps=1)
    a[0].grad = None
    with pytest.raises(RuntimeError, match="same at every step"):
        opt.step()


# ------------------------------------------------------------------ FusedMixedPrecisionLamb


def test_mixed_precision_lamb_masters_follow_fp32_lamb():
    a = make_params(torch.bfloat16)
    opt = FusedMixedPrecisionLamb(a, lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    b = [nn.Parameter(p.detach().float()) for p in a]
    train_beside(opt, a, FusedMixedPrecisionLamb(b, lr=1e-2), b, steps=3, scale=3.0)
    assert_masters_are(opt, a, b)  # the masters are the same optimizer's FP32 run, bit for bit
    # ... and FusedLAMB's, to rounding: Apex's two LAMB kernels take the bias corrections
    # 1 - beta**step in FP32 (multi_tensor_lamb_mp, from the step tensor) and in FP64 (FusedLAMB,
    # on the host), as the stand-ins do; 1 - 0.999**1 differs by 1.3e-5 relative between the two.
    # The trust ratio cancels most of it; what is left is an ulp or two, and whether it shows
    # depends on the CPU's vector width (ATEN_CPU_CAPABILITY=default differs after 3 steps)
    c = [nn.Parameter(p.float()) for p in make_params(torch.bfloat16)]
    ref = FusedLAMB(c, lr=1e-2)
    for i in range(3):
        for q, g in zip(c, grads_at(i, torch.bfloat16, scale=3.0)):
            q.grad = g.float()
        ref.step()
    close([opt.state[p]["master_param"] for p in a], [q.detach() for q in c])  # float32's default rtol, 1.3e-6
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in a)
    group = opt.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["step"].tolist() == [3]


def test_mixed_precision_lamb_under_grad_scaler_is_lamb_on_true_grads():
    a, opt, _ = scaled_run(lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2), overflow_at=1)
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = FusedLAMB(model.parameters(), lr=1e-2)
    for i in range(4):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).sum().backward()
        if i != 1:  # the overflowed step is skipped
            ref.step()
        ref.zero_grad()
    close(a, [p.detach() for p in model.parameters()], rtol=1e-5, atol=1e-6)
    assert opt.param_groups[0]["step"].tolist() == [3]


def test_mixed_precision_lamb_groups_get_their_own_tensors():
    a = make_params()
    opt = FusedMixedPrecisionLamb(a[:2], lr=1e-2)
    opt.add_param_group({"params": a[2:], "lr": 0.5})
    g0, g1 = opt.param_groups
    assert g0["step"] is not g1["step"] and g0["lr"] is not opt.defaults["lr"]
    assert float(g1["lr"]) == 0.5
    train(opt, a, steps=2)
    assert g0["step"].tolist() == [2] and g1["step"].tolist() == [2]


# ------------------------------------------------------------------ shared behaviour


CASES = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "FusedAdam-capturable": lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, reduced_precision_dtype=torch.float16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_state_dict_round_trip_resumes_bitwise(name, dtype):
    a = make_params(dtype)
    opt = CASES[name](a)
    train(opt, a, steps=3)
    saved = copy.deepcopy(opt.state_dict())
    b = [nn.Parameter(p.detach().clone()) for p in a]
    resumed = CASES[name](b)
    resumed.load_state_dict(saved)
    for key, value in opt.state[a[0]].items():  # state dtypes survive the load (Adam's FP32 moments of half params)
        if isinstance(value, torch.Tensor):
            assert resumed.state[b[0]][key].dtype == value.dtype, key
    train_beside(opt, a, resumed, b, steps=3, start=3)
    assert same([p.detach() for p in a], [q.detach() for q in b])
    assert not same([p.detach() for p in a], [p.detach() for p in make_params(dtype)])


@pytest.mark.parametrize("name, default", [("FusedAdam", True), ("FusedAdagrad", True), ("FusedSGD", False),
                                           ("FusedLAMB", True), ("FusedNovoGrad", True)])
def test_zero_grad_follows_set_grad_none(name, default):
    cls = globals()[name]
    for set_grad_none in (True, False):
        a = make_params()
        opt = cls(a, lr=0.1, set_grad_none=set_grad_none)
        train(opt, a, steps=1)
        opt.zero_grad()
        if set_grad_none:
            assert all(p.grad is None for p in a)
        else:
            assert all(p.grad is not None and not p.grad.any() for p in a)
        train(opt, a, steps=1)
        opt.zero_grad(set_to_none=not set_grad_none)  # torch's argument still decides when given
        assert all((p.grad is None) == (not set_grad_none) for p in a)
    assert cls(make_params(), lr=0.1).set_grad_none is default


def test_add_param_group_is_stepped():
    a = make_params()
    opt = FusedAdam(a[:2], lr=1e-2)
    opt.add_param_group({"params": a[2:], "weight_decay": 0.5})
    assert opt.param_groups[1]["weight_decay"] == 0.5 and opt.param_groups[1]["betas"] == (0.9, 0.999)
    before = a[2].detach().clone()
    train(opt, a, steps=1)
    assert not torch.equal(a[2].detach(), before) and opt.param_groups[1]["step"] == 1


def test_bad_arguments_raise_what_apex_raises():
    ps = make_params()
    for cls, name in ((FusedAdam, "FusedAdam"), (FusedLAMB, "FusedLAMB"), (FusedNovoGrad, "FusedNovoGrad"),
                      (FusedMixedPrecisionLamb, "FusedLAMB")):
        with pytest.raises(RuntimeError, match=f"{name} does not support the AMSGrad variant"):
            cls(ps, amsgrad=True)
    with pytest.raises(RuntimeError, match="only supported with the capturable version"):
        FusedAdam(ps, master_weights=True)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        FusedSGD(ps, lr=-1)
    with pytest.raises(ValueError, match="Invalid momentum value"):
        FusedSGD(ps, lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match="Invalid weight_decay value"):
        FusedSGD(ps, lr=0.1, weight_decay=-1)
    with pytest.raises(ValueError, match="Nesterov momentum requires a momentum and zero dampening"):
        FusedSGD(ps, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(ps)
    with pytest.raises(RuntimeError, match="capturable=True.*Apex's first FusedAdam"):
        FusedAdam(ps, capturable=True).step(scale=128.0)  # the old step form is the first FusedAdam's
    emb = nn.Embedding(5, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="FusedAdam does not support sparse gradients, please consider SparseAdam"):
        FusedAdam(emb.parameters()).step()
    with pytest.raises(RuntimeError, match="FusedAdagrad does not support sparse gradients"):
        FusedAdagrad(emb.parameters()).step()
    p = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    p.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="FusedLAMB only support fp16 and fp32"):
        FusedLAMB([p]).step()
    q = make_params()
    q[0].grad = torch.ones(SHAPES[0])
    with pytest.raises(RuntimeError, match="only support l2/inf norm"):
        FusedNovoGrad(q, norm_type=1).step()
    mixed = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, dtype=torch.float16))]
    with pytest.raises(RuntimeError, match="not of the identical type"):
        FusedMixedPrecisionLamb(mixed).step()


# ------------------------------------------------------------------ with amp_patch O2 / O5


def o2_run(make, opt_level, steps=5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 2))
    opt = make(model.parameters())
    losses = []
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 2, generator=g)
    with amp(model, opt, opt_level=opt_level) as (model, opt):
        for _ in range(steps):
            loss = (model(x).float() - y).pow(2).mean()
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        weights = [v.clone() for v in model.state_dict().values()]
        masters = [p for group in opt.param_groups for p in group["params"]]
    return weights, losses, masters


@pytest.mark.parametrize("opt_level", ["O5", "O2"])
def test_amp_o2_o5_fused_adam_matches_torch_adamw(opt_level):
    fused, losses, masters = o2_run(lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.1, adam_w_mode=True), opt_level)
    ref, ref_losses, _ = o2_run(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), opt_level)
    assert same(fused, ref) and losses == ref_losses
    assert losses[-1] < losses[0]
    assert all(m.dtype == torch.float32 for m in masters)  # the optimizer stepped FP32 masters


@pytest.mark.parametrize("make", [
    lambda ps: FusedLAMB(ps, lr=1e-2),
    lambda ps: FusedNovoGrad(ps, lr=1e-2),
    lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9),
    lambda ps: FusedAdagrad(ps, lr=0.05),
], ids=["FusedLAMB", "FusedNovoGrad", "FusedSGD", "FusedAdagrad"])
def test_amp_o5_trains_with_each_stand_in(make):
    _, losses, masters = o2_run(make, "O5", steps=8)
    assert losses[-1] < losses[0]
    assert all(m.dtype == torch.float32 for m in masters)


# ------------------------------------------------------------------ amp_C and multi_tensor_applier


def flag():
    return torch.zeros(1, dtype=torch.int)


@pytest.mark.quick
def test_multi_tensor_applier_forwards_to_the_op():
    seen = []
    out = multi_tensor_applier(lambda *args: seen.append(args) or "result", flag(), [[1]], 2.0, "x")
    assert out == "result" and seen[0][0] == 2048 * 32 and seen[0][2:] == ([[1]], 2.0, "x")
    assert MultiTensorApply.available is True and MultiTensorApply.warned is False


@pytest.mark.parametrize("per_tensor", [False, True])
def test_multi_tensor_l2norm_is_the_fp32_norm(per_tensor):
    ts = [torch.randn(50, dtype=torch.float16) * 300, torch.randn(7), torch.randn(3, 3, dtype=torch.bfloat16)]
    f = flag()
    total, each = multi_tensor_applier(amp_C.multi_tensor_l2norm, f, [ts], per_tensor)
    want = torch.stack([t.float().norm() for t in ts])
    assert total.dtype == torch.float32 and total.shape == (1,)
    torch.testing.assert_close(total, want.norm().reshape(1))
    if per_tensor:
        torch.testing.assert_close(each, want)
    else:
        assert each.shape == (0,)
    assert f.item() == 0
    ts[1][3] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_l2norm, f, [ts], False)
    assert f.item() == 1


def test_multi_tensor_unscale_l2norm_leaves_the_tensors():
    ts = [torch.randn(10) * 64, torch.randn(4) * 64]
    before = [t.clone() for t in ts]
    total, each = amp_C.multi_tensor_unscale_l2norm(0, flag(), [ts], torch.tensor([1 / 64]), True)
    torch.testing.assert_close(each, torch.stack([(t / 64).norm() for t in ts]))
    torch.testing.assert_close(total, torch.cat([t / 64 for t in ts]).norm().reshape(1))
    assert same(ts, before)


def test_multi_tensor_unscale_l2norm_has_apex_shapes_and_unscales_before_squaring():
    ts = [torch.randn(6, dtype=torch.float16), torch.full((5,), 1e20), torch.randn(3, 2)]
    inv = torch.tensor([1e-10])
    f = flag()
    total, each = amp_C.multi_tensor_unscale_l2norm(0, f, [ts], inv, True)
    # Apex's kernel multiplies each element by inv_scale before squaring it in FP32: 1e20's square
    # would overflow, (1e20 * 1e-10)'s does not
    want = torch.stack([(t.float() * 1e-10).norm() for t in ts])
    assert total.shape == (1,) and each.shape == (3,) and total.dtype == each.dtype == torch.float32
    torch.testing.assert_close(each, want)
    torch.testing.assert_close(total, want.norm().reshape(1))
    assert torch.isfinite(total).all() and f.item() == 0
    total, none = amp_C.multi_tensor_unscale_l2norm(0, f, [ts], inv, False)
    assert total.shape == (1,) and none.shape == (0,)
    for kernel in (amp_C.multi_tensor_l2norm, amp_C.multi_tensor_l2norm_mp):
        total, each = kernel(0, f, [ts[:1]], True)
        assert total.shape == (1,) and each.shape == (1,)
    total, each = amp_C.multi_tensor_l2norm_scale(0, f, [ts[:1], [torch.empty(6)]], 0.5, True)
    assert total.shape == (1,) and each.shape == (1,)
    ts[2][0, 0] = float("inf")
    amp_C.multi_tensor_unscale_l2norm(0, f, [ts], inv, False)
    assert f.item() == 1


def f32(x):
    """``x`` rounded to FP32, as C's double-to-float conversion rounds it."""
    return ctypes.c_float(x).value


def hysteresis_reference(calls, scale, growth_factor, backoff_factor, growth_interval, hysteresis):
    """Apex's update_scale_hysteresis kernel (csrc/update_scale_hysteresis.cu), one Python
    float per tensor; built with --use_fast_math, it reads and writes FP32 subnormals as 0."""
    tiny = torch.finfo(torch.float32).tiny
    ftz = lambda v: 0.0 if abs(v) < tiny else v  # noqa: E731
    scale, growth, hyst, out = f32(scale), 0, hysteresis, []
    for found in calls:
        found = ftz(found)
        if found > 0:
            hyst -= 1
            if hyst > 0:
                growth = 0
                out.append((scale, growth, hyst))
                continue
        if found != 0:  # NaN too: C reads any non-zero float as true
            scale = ftz(f32(ftz(scale) * backoff_factor))
            growth = 0
        elif growth + 1 == growth_interval:
            grown = ftz(f32(ftz(scale) * growth_factor))
            if math.isfinite(grown):
                scale = grown
            growth = 0
        else:
            growth += 1
        if found <= 0:
            hyst = hysteresis
        out.append((scale, growth, hyst))
    return out


@pytest.mark.parametrize("scale, growth_factor, backoff_factor, growth_interval, hysteresis", [
    (65536.0, 2.0, 0.5, 3, 2),
    (2.0 ** -120, 4.0, 0.25, 2, 1),  # backs off into FP32's subnormals: 0, as Apex's kernel gives
    (3.0e38, 4.0, 0.5, 1, 3),  # a growth past FP32's range is refused
    (1000.0, 1.5, 0.3, 4, 3),  # products that round
])
def test_update_scale_hysteresis_is_apex_kernel(scale, growth_factor, backoff_factor, growth_interval, hysteresis):
    g = torch.Generator().manual_seed(int(scale) % 97 + hysteresis)
    codes = torch.randint(0, 10, (200,), generator=g).tolist()
    # mostly clean steps and overflows, with runs of each, and the odd -1 and NaN
    calls = [float("nan") if c == 9 else -1.0 if c == 8 else 1.0 if c < 3 else 0.0 for c in codes]
    calls[20:40] = [1.0] * 20
    want = hysteresis_reference(calls, scale, growth_factor, backoff_factor, growth_interval, hysteresis)
    s = torch.tensor([scale])
    growth = torch.zeros(1, dtype=torch.int32)
    hyst = torch.tensor([hysteresis], dtype=torch.int32)
    found = torch.zeros(1)
    for i, (call, (w_scale, w_growth, w_hyst)) in enumerate(zip(calls, want)):
        found.fill_(call)
        out = amp_C.update_scale_hysteresis(s, growth, hyst, found, growth_factor, backoff_factor,
                                            growth_interval, hysteresis)
        assert out is s
        assert (s.item(), growth.item(), hyst.item()) == (w_scale, w_growth, w_hyst), f"call {i}"
    assert s.dtype == torch.float32 and growth.dtype == hyst.dtype == torch.int32


def test_update_scale_hysteresis_waits_then_backs_off_and_checks_dtypes():
    s, growth = torch.tensor([1024.0]), torch.tensor([5], dtype=torch.int32)
    hyst, inf = torch.tensor([2], dtype=torch.int32), torch.ones(1)
    amp_C.update_scale_hysteresis(s, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (s.item(), growth.item(), hyst.item()) == (1024.0, 0, 1)  # the first overflow is absorbed
    amp_C.update_scale_hysteresis(s, growth, hyst, inf, 2.0, 0.5, 10, 2)
    assert (s.item(), growth.item(), hyst.item()) == (512.0, 0, 0)
    amp_C.update_scale_hysteresis(s, growth, hyst, torch.zeros(1), 2.0, 0.5, 10, 2)
    assert (s.item(), growth.item(), hyst.item()) == (512.0, 1, 2)  # a clean step resets the hysteresis
    with pytest.raises(RuntimeError, match="growth_tracker must be a torch.int32"):
        amp_C.update_scale_hysteresis(s, growth.long(), hyst, inf, 2.0, 0.5, 10, 2)
    with pytest.raises(RuntimeError, match="current_scale must be a torch.float32"):
        amp_C.update_scale_hysteresis(s.double(), growth, hyst, inf, 2.0, 0.5, 10, 2)


@pytest.mark.quick
def test_multi_tensor_scale_writes_each_dst_dtype_and_flags_inf():
    srcs = [torch.randn(6, dtype=torch.float16), torch.randn(4)]
    dsts = [torch.empty(6), torch.empty(4, dtype=torch.bfloat16)]
    f = flag()
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [srcs, dsts], 0.25)
    assert torch.equal(dsts[0], srcs[0].float() * 0.25)
    assert torch.equal(dsts[1], (srcs[1] * 0.25).bfloat16())
    assert f.item() == 0
    srcs[0][2] = float("nan")
    multi_tensor_applier(amp_C.multi_tensor_scale, f, [srcs, srcs], 2.0)  # in place, as scripts unscale
    assert f.item() == 1 and torch.isnan(srcs[0][2])
    g = flag()
    out = [torch.empty(3)]
    amp_C.multi_tensor_scale(0, g, [[torch.full((3,), 1e38)], out], 10.0)
    assert torch.isinf(out[0]).all() and g.item() == 0  # Apex checks the inputs, not the products


@pytest.mark.parametrize("arg_to_check, flagged", [(0, False), (1, True), (-1, True)])
def test_multi_tensor_axpby_checks_the_arguments_apex_checks(arg_to_check, flagged):
    xs = [torch.randn(5, dtype=torch.float16), torch.randn(3)]
    ys = [torch.randn(5), torch.randn(3)]
    outs = [torch.empty(5), torch.empty(3, dtype=torch.float16)]
    f = flag()
    amp_C.multi_tensor_axpby(0, f, [xs, ys, outs], 0.5, 2.0, arg_to_check)
    assert torch.equal(outs[0], 0.5 * xs[0].float() + 2.0 * ys[0])
    torch.testing.assert_close(outs[1], (0.5 * xs[1] + 2.0 * ys[1]).half())
    assert f.item() == 0
    ys[1][0] = float("inf")
    amp_C.multi_tensor_axpby(0, f, [xs, ys, outs], 0.5, 2.0, arg_to_check)
    assert f.item() == int(flagged)
    with pytest.raises(ValueError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(0, f, [xs, ys, outs], 0.5, 2.0, 2)


def test_missing_amp_c_kernels_name_the_replacement():
    with pytest.raises(AttributeError, match="FusedNovoGrad"):
        amp_C.multi_tensor_novograd
    with pytest.raises(AttributeError, match="torch._foreach_"):
        amp_C.multi_tensor_something_else
    assert not hasattr(amp_C, "multi_tensor_lamb_mp")


@pytest.mark.cuda
def test_fused_adam_on_cuda_is_torch_adamw():
    a = [nn.Parameter(p.detach().cuda()) for p in make_params()]
    opt = FusedAdam(a, lr=1e-2, weight_decay=0.1)
    b = [nn.Parameter(p.detach().cuda()) for p in make_params()]
    train_beside(opt, a, torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True), b, steps=3)
    assert same(a, b)
    f = torch.zeros(1, dtype=torch.int, device="cuda")
    total, _ = amp_C.multi_tensor_l2norm(0, f, [[p.grad for p in a]], False)
    assert total.device.type == "cuda" and f.item() == 0


@pytest.mark.parametrize("level", ["O1", "O5"])
def test_zero_grad_under_amp_patch_still_follows_set_grad_none(level):
    # amp_patch's patched zero_grad must leave the optimizer's own default alone
    for set_grad_none in (True, False):
        model = nn.Linear(4, 4)
        opt = FusedSGD(model.parameters(), lr=0.1, set_grad_none=set_grad_none)
        with amp(model, opt, level):
            model(torch.randn(2, 4)).float().sum().backward()
            opt.step()
            opt.zero_grad()
            grads = [p.grad for group in opt.param_groups for p in group["params"]]
            if set_grad_none:
                assert all(g is None for g in grads)
            else:
                assert all(g is not None and not g.any() for g in grads)
