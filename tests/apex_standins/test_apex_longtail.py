"""The Apex long tail: every module path Apex had, the pre-2020 optimizer API,
amp_C's optimizer kernels, apex.contrib, the norms' autograd functions and
extensions, the scaler internals and apex.amp.lists, and the smaller modules,
each against a hand-written reference of the formula Apex's source computes."""
from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import amp
from amp_patch.base import running
from amp_patch.run.session import Provisional
from amp_patch.apex import amp_C, apex_C, fused_adam_cuda, fused_layer_norm_cuda, fused_weight_gradient_mlp_cuda
from amp_patch.apex import xentropy_cuda
from amp_patch.apex.contrib.clip_grad import clip_grad_norm_
from amp_patch.apex.contrib.group_norm import GroupNorm
from amp_patch.apex.contrib.layer_norm import FastLayerNorm, FastLayerNormFN
from amp_patch.apex.contrib.optimizers import FP16_Optimizer as ContribFP16_Optimizer
from amp_patch.apex.contrib.optimizers import FusedAdam as ContribFusedAdam
from amp_patch.apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
from amp_patch.apex.contrib.xentropy import SoftmaxCrossEntropyLoss
from amp_patch.apex.fused_dense import FusedDense, FusedDenseGeluDense
from amp_patch.apex.mlp import MLP, MlpFunction, mlp_function
from amp_patch.apex.normalization import fused_layer_norm as N
from amp_patch.apex.optimizers import FP16_Optimizer, FusedAdam
from amp_patch.apex.reparameterization import apply_weight_norm, remove_weight_norm
from amp_patch.frontends import scan
from helpers import amp as amp_patch_run
from helpers import case_results, mlp, run_workers, serve_cases

f32 = torch.float32


def tensors(*shapes, seed=0, dtype=f32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


# ================================================================ every module path, every form

#: every module path of Apex that the alias serves (apex/ at e13873de, and the
#: pre-2020 apex.optimizers.fp16_optimizer and apex.reparameterization)
SERVED_PATHS = [
    "apex.amp", "apex.amp.lists", "apex.amp.lists.functional_overrides", "apex.amp.lists.torch_overrides",
    "apex.amp.lists.tensor_overrides", "apex.amp.frontend", "apex.amp.handle", "apex.amp.scaler",
    "apex.parallel", "apex.parallel.LARC", "apex.parallel.distributed", "apex.parallel.multiproc",
    "apex.parallel.sync_batchnorm", "apex.parallel.optimized_sync_batchnorm",
    "apex.fp16_utils", "apex.fp16_utils.fp16_optimizer", "apex.fp16_utils.fp16util", "apex.fp16_utils.loss_scaler",
    "apex.optimizers", "apex.optimizers.fused_adam", "apex.optimizers.fused_lamb", "apex.optimizers.fused_sgd",
    "apex.optimizers.fused_adagrad", "apex.optimizers.fused_novograd", "apex.optimizers.fused_mixed_precision_lamb",
    "apex.optimizers.fp16_optimizer",
    "apex.normalization", "apex.normalization.fused_layer_norm",
    "apex.multi_tensor_apply", "apex.multi_tensor_apply.multi_tensor_apply",
    "apex.contrib", "apex.contrib.clip_grad", "apex.contrib.clip_grad.clip_grad", "apex.contrib.xentropy",
    "apex.contrib.xentropy.softmax_xentropy", "apex.contrib.layer_norm", "apex.contrib.layer_norm.layer_norm",
    "apex.contrib.optimizers", "apex.contrib.optimizers.fp16_optimizer", "apex.contrib.optimizers.fused_adam",
    "apex.contrib.optimizers.fused_lamb", "apex.contrib.optimizers.fused_sgd",
    "apex.contrib.optimizers.distributed_fused_adam", "apex.contrib.group_norm", "apex.contrib.group_norm.group_norm",
    "apex.mlp", "apex.mlp.mlp", "apex.fused_dense", "apex.fused_dense.fused_dense", "apex.reparameterization",
    "amp_C", "apex_C", "fused_adam_cuda", "fused_layer_norm_cuda", "fused_weight_gradient_mlp_cuda", "xentropy_cuda",
]
#: Apex module paths not served, and a word of what the error must name instead
UNSERVED = {"apex.transformer": "tensor.parallel", "apex.transformer.tensor_parallel": "tensor.parallel",
            "apex.RNN": "nn.LSTM", "apex.contrib.fmha": "scaled_dot_product_attention",
            "apex.contrib.multihead_attn": "MultiheadAttention", "apex.contrib.sparsity": "torch.ao.pruning",
            "apex.amp.opt": "public API", "syncbn": "SyncBatchNorm", "fused_dense_cuda": "nn.Linear"}


@pytest.mark.parametrize("path", SERVED_PATHS)
def test_every_apex_module_path_imports_in_every_form(path, apex_alias):
    ns: dict = {}
    exec(f"import {path} as m", ns)  # the form that failed for apex.optimizers.fused_adam
    parent, _, last = path.rpartition(".")
    if parent:
        exec(f"from {parent} import {last} as n", ns)
    else:
        ns["n"] = ns["m"]
    exec(f"import {path}", ns)
    top = ns[path.split(".")[0]]
    via_attributes = top
    for part in path.split(".")[1:]:
        via_attributes = getattr(via_attributes, part)
    m = importlib.import_module(path)
    assert ns["m"] is ns["n"] is m is sys.modules[path]
    if path != "apex.amp._amp_state":
        assert via_attributes is m
    assert m.__name__.startswith("amp_patch")


#: run in a fresh interpreter: a bare `import apex`, then each served module path as attributes
_BARE_IMPORT = """
import json, sys
import amp_patch
amp_patch.install_apex_alias()
import apex
out = {}
for path in json.loads(sys.argv[1]):
    obj = apex
    try:
        for part in path.split(".")[1:]:
            obj = getattr(obj, part)
        out[path] = obj.__name__
    except AttributeError as e:
        out[path] = "AttributeError: " + str(e)
try:
    apex.contrib.nope
except AttributeError as e:
    out["apex.contrib.nope"] = "AttributeError: " + str(e)
out["FP16_Optimizer"] = apex.contrib.optimizers.FP16_Optimizer.__module__
print(json.dumps(out))
"""


def test_a_bare_import_apex_reaches_every_served_module_as_check_script_says():
    # Apex's `import apex` imported apex.amp, which imported apex.contrib.optimizers: a script
    # could use apex.contrib.optimizers.FP16_Optimizer with no other import, as check-script reports
    paths = [p for p in SERVED_PATHS if p.startswith("apex.")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(amp_patch.__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _BARE_IMPORT, json.dumps(paths)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert {p: n for p, n in got.items() if p in paths and not n.startswith("amp_patch")} == {}
    assert got["FP16_Optimizer"] == ContribFP16_Optimizer.__module__
    assert got["apex.contrib.nope"].startswith("AttributeError") and "nope" in got["apex.contrib.nope"]
    uses = {u.name: u for u in scan.scan("import apex\napex.contrib.optimizers.FP16_Optimizer(opt)\napex.contrib.nope\n")}
    assert uses["apex.contrib.optimizers.FP16_Optimizer()"].served_by
    assert not uses["apex.contrib.nope"].served_by


def test_apex_submodule_and_its_names_agree(apex_alias):
    import apex.optimizers.fused_adam as fused_adam
    import apex.optimizers.fused_lamb as fused_lamb
    from apex.normalization import fused_layer_norm
    from apex.optimizers import FusedAdam, FusedLAMB

    assert fused_adam.FusedAdam is FusedAdam and fused_lamb.FusedLAMB is FusedLAMB
    assert fused_layer_norm.FusedLayerNormAffineFunction is N.FusedLayerNormAffineFunction  # a module, as Apex's


@pytest.mark.parametrize("path,instead", sorted(UNSERVED.items()))
def test_unserved_apex_modules_name_their_replacement_in_every_form(path, instead, apex_alias):
    for form in (f"import {path}", f"import {path} as m", f"from {path} import something"):
        with pytest.raises(ImportError, match=instead):
            exec(form, {})
    with pytest.raises(ImportError, match=instead):
        importlib.import_module(path)
    parent, _, last = path.rpartition(".")
    if parent:  # from a served package: Python's own message, naming the module
        with pytest.raises(ImportError, match=f"{last}|{instead}"):
            exec(f"from {parent} import {last}", {})


# ================================================================ the first FusedAdam (fused_adam_cuda)


def ref_old_adam(p, g, m, v, *, lr, b1, b2, eps, scale, step, eps_inside, bias_correction, decay):
    """Apex's fused_adam_cuda kernel (csrc/fused_adam_cuda_kernel.cu), written out."""
    g = g.double() / scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v + eps).sqrt() if eps_inside else v.sqrt() + eps
    size = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step) if bias_correction else lr
    return p - size * (m / denom + decay * p), m, v


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bias_correction", [0, 1])
def test_fused_adam_cuda_adam_is_apex_kernel(mode, bias_correction):
    p, g = tensors((5, 3), (5, 3))
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    copy = torch.empty(5, 3, dtype=torch.float16)
    rp, rm, rv = p.double(), m.double(), v.double()
    for step in (1, 2, 3):
        gs = g * 128.0 * step
        fused_adam_cuda.adam(p, copy, m, v, gs.half(), 1e-2, 0.9, 0.999, 1e-8, 128.0, step, mode, bias_correction, 0.01)
        rp, rm, rv = ref_old_adam(rp, gs.half(), rm, rv, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, scale=128.0, step=step,
                                  eps_inside=mode == 0, bias_correction=bias_correction, decay=0.01)
    torch.testing.assert_close(p, rp.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, rv.float(), rtol=1e-5, atol=1e-12)
    assert torch.equal(copy, p.half())  # the FP16 copy of the updated weights
    with pytest.raises(RuntimeError, match="number of elements in m and p"):
        fused_adam_cuda.adam(p, copy, m[:2], v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)


def test_old_fused_adam_keywords_select_the_first_kernel_with_clipping():
    ps = [nn.Parameter(t) for t in tensors((4, 3), (3,))]
    opt = FusedAdam(ps, lr=1e-2, bias_correction=False, max_grad_norm=1.0, eps_inside_sqrt=True, weight_decay=0.1)
    ref = [p.detach().double() for p in ps]
    moments = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    for step in (1, 2):
        for p, g in zip(ps, tensors((4, 3), (3,), seed=step)):
            p.grad = g * 3  # a global norm above max_grad_norm: clipped
        opt.step()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ps))
        clip = (norm + 1e-6) / 1.0
        for i, p in enumerate(ps):
            ref[i], *moments[i] = ref_old_adam(ref[i], p.grad, *moments[i], lr=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                                               scale=clip, step=step, eps_inside=True, bias_correction=False,
                                               decay=0.1)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach(), r.float(), rtol=1e-5, atol=1e-6)
    assert all(opt.state[p]["step"] == 2 for p in ps)  # one count per parameter, as the first FusedAdam
    assert opt.param_groups[0]["max_grad_norm"] == 1.0


def _half_model():
    return mlp(4, 8, 2, act=nn.Tanh, dtype=torch.float16)


@pytest.mark.parametrize("wrapper", ["flat", "contrib"])
def test_fused_era_fp16_optimizer_matches_its_formula(wrapper):
    model = _half_model()
    masters = [p.detach().double() for p in model.parameters()]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    if wrapper == "flat":
        opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2, bias_correction=False, max_grad_norm=1.0),
                             dynamic_loss_scale=True)
    else:
        opt = ContribFP16_Optimizer(ContribFusedAdam(model.parameters(), lr=1e-2, bias_correction=False,
                                                     max_grad_norm=1.0), dynamic_loss_scale=True)
    x, y = tensors((6, 4), (6, 2), dtype=torch.float16)
    cur_scale, steps, skips = 2.0**16, 0, 0
    for _ in range(6):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x).float(), y.float()))
        grads = [p.grad.double() for p in model.parameters()]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))  # of the scaled FP16 gradients
        opt.step()
        if not math.isfinite(norm):  # Apex's dynamic scale: skip the step, halve the scale
            cur_scale, skips = cur_scale / 2, skips + 1
            continue
        steps += 1
        clip = (norm / cur_scale + 1e-6) / 1.0
        scale = clip * cur_scale if clip > 1 else cur_scale
        for i, g in enumerate(grads):
            masters[i], *moments[i] = ref_old_adam(masters[i], g, *moments[i], lr=1e-2, b1=0.9, b2=0.999, eps=1e-8,
                                                   scale=scale, step=steps, eps_inside=False, bias_correction=False,
                                                   decay=0.0)
    assert steps >= 2
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.detach(), m.half(), rtol=2e-3, atol=1e-3)  # the FP16 model follows its masters
    assert opt.cur_scale == cur_scale and opt.cur_iter == 6


def test_fused_era_fp16_optimizer_skips_overflow_and_round_trips_its_state():
    model = _half_model()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2, max_grad_norm=1.0), dynamic_loss_scale=True)
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum() * 1e30)  # inf gradients
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and opt.cur_scale == 2.0**15
    opt.zero_grad()
    opt.backward(model(torch.ones(2, 4, dtype=torch.float16)).float().sum() * 1e-4)
    assert 0 < opt.clip_master_grads(1e-3) < float("inf")  # clipped to 1e-3 (of the unscaled gradients)
    opt.step()
    saved = opt.state_dict()
    model2 = _half_model()
    opt2 = FP16_Optimizer(FusedAdam(model2.parameters(), lr=1e-2, max_grad_norm=1.0), dynamic_loss_scale=True)
    opt2.load_state_dict(saved)
    assert torch.equal(opt2.fp32_groups_flat[0], opt.fp32_groups_flat[0]) and opt2.cur_scale == opt.cur_scale
    with pytest.raises(SystemError, match="dynamic loss scale args"):
        FP16_Optimizer(FusedAdam(_half_model().parameters(), max_grad_norm=1.0), dynamic_loss_scale=True,
                       dynamic_loss_args={"scale_window": 10})


def test_contrib_fused_sgd_under_its_fp16_optimizer_is_momentum_sgd_of_the_masters():
    from amp_patch.apex.contrib.optimizers import FusedSGD as ContribFusedSGD

    model = _half_model()
    masters = [p.detach().double() for p in model.parameters()]
    bufs = [None] * len(masters)
    opt = ContribFP16_Optimizer(ContribFusedSGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
                                static_loss_scale=128.0)
    x, y = tensors((6, 4), (6, 2), dtype=torch.float16)
    for _ in range(3):
        opt.zero_grad()
        opt.backward(F.mse_loss(model(x).float(), y.float()))
        grads = [p.grad.double() / 128.0 for p in model.parameters()]
        opt.step()
        for i, g in enumerate(grads):  # Apex's SGD kernel: decay, then momentum (the first run copies)
            g = g + 1e-3 * masters[i]
            bufs[i] = g.clone() if bufs[i] is None else 0.9 * bufs[i] + g
            masters[i] = masters[i] - 0.1 * bufs[i]
    for p, m, fp32 in zip(model.parameters(), masters, opt.fp32_groups[0]):
        torch.testing.assert_close(fp32.double(), m, rtol=1e-5, atol=1e-6)
        assert torch.equal(p.detach(), fp32.half())
    with pytest.raises(RuntimeError, match="must be wrapped"):
        ContribFusedSGD(_half_model().parameters(), lr=0.1).step()


# ================================================================ amp_C's optimizer kernels


def ref_adam(p, g, m, v, *, lr, b1, b2, eps, step, mode, bias_correction, decay):
    """Apex's csrc/multi_tensor_adam.cu, written out."""
    if mode == 0:
        g = g + decay * p
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    c1, c2 = (1 - b1 ** step, 1 - b2 ** step) if bias_correction else (1.0, 1.0)
    update = (m / c1) / ((v / c2).sqrt() + eps)
    if mode == 1:
        update = update + decay * p
    return p - lr * update, m, v


@pytest.mark.parametrize("mode", [0, 1])
def test_multi_tensor_adam_is_apex_kernel(mode):
    ps = tensors((4, 3), (3,))
    gs = tensors((4, 3), (3,), seed=1)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    ref = [(p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)) for p in ps]
    flag = torch.zeros(1, dtype=torch.int)
    for step in (1, 2):
        amp_C.multi_tensor_adam(65536, flag, [gs, ps, ms, vs], 1e-2, 0.9, 0.999, 1e-8, step, mode, 1, 0.1)
        ref = [ref_adam(p, g.double(), m, v, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, step=step, mode=mode,
                        bias_correction=1, decay=0.1) for (p, m, v), g in zip(ref, gs)]
    for p, (r, _, _) in zip(ps, ref):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov,wd_after", [(False, False), (True, False), (False, True)])
def test_multi_tensor_sgd_is_apex_kernel(nesterov, wd_after):
    ps = tensors((4, 3), (3,))
    gs = [g.half() for g in tensors((4, 3), (3,), seed=1)]
    bufs = [torch.zeros_like(p) for p in ps]
    copies = [torch.empty_like(p, dtype=torch.float16) for p in ps]
    ref = [p.double() for p in ps]
    rbufs = [None, None]
    flag = torch.zeros(1, dtype=torch.int)
    for first in (True, False):
        amp_C.multi_tensor_sgd(65536, flag, [gs, ps, bufs, copies], 1e-3, 0.9, 0.0, 0.1, nesterov, first, wd_after,
                               0.5)
        for i, g in enumerate(gs):
            g = g.double() * 0.5
            if not wd_after:
                g = g + 1e-3 * ref[i]
            rbufs[i] = g.clone() if first else 0.9 * rbufs[i] + g
            g = g + 0.9 * rbufs[i] if nesterov else rbufs[i]
            if wd_after:
                g = g + 1e-3 * ref[i]
            ref[i] = ref[i] - 0.1 * g
    for p, r, c in zip(ps, ref, copies):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)
        assert torch.equal(c, p.half())
    flag.fill_(1)  # an overflow found earlier: Apex's SGD kernel does nothing
    before = [p.clone() for p in ps]
    amp_C.multi_tensor_sgd(65536, flag, [gs, ps, bufs], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


def test_two_stage_lamb_is_apex_kernels():
    ps = tensors((4, 3), (3,))
    gs = tensors((4, 3), (3,), seed=1)
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    ups = [torch.empty_like(p) for p in ps]
    decay = torch.tensor([0.01, 0.0])
    norm = torch.tensor([3.0])  # above max_global_grad_norm: the gradients are divided by 3 / 1
    flag = torch.zeros(1, dtype=torch.int)
    refs = [p.double() for p in ps]
    amp_C.multi_tensor_lamb_stage1_cuda(65536, flag, [gs, ps, ms, vs, ups], decay, 0, 0.9, 0.999, 1e-6, norm, 1.0)
    ref_ups = []
    for p, g, d in zip(refs, gs, (0.01, 0.0)):
        g = g.double() / 3.0
        m, v = 0.1 * g, 0.001 * g * g
        ref_ups.append((m / (1 - 0.9)) / ((v / (1 - 0.999)).sqrt() + 1e-6) + d * p)  # bias corrections of step 0 + 1
    for u, r in zip(ups, ref_ups):
        torch.testing.assert_close(u, r.float(), rtol=1e-5, atol=1e-6)
    pn = torch.stack([p.norm() for p in ps])
    un = torch.stack([u.norm() for u in ups])
    amp_C.multi_tensor_lamb_stage2_cuda(65536, flag, [ps, ups], pn, un, 0.1, 0.01, False)
    # weight_decay != 0: every tensor takes lr * ||p|| / ||update||, as Apex's stage 2
    for p, r, u, w, n in zip(ps, refs, ref_ups, pn, un):
        torch.testing.assert_close(p, (r - 0.1 * float(w / n) * u).float(), rtol=1e-5, atol=1e-6)
    ps2 = tensors((3,))
    amp_C.multi_tensor_lamb_stage2_cuda(65536, flag, [ps2, [torch.ones(3)]], pn[1:], un[1:], 0.1, 0.0, False)
    torch.testing.assert_close(ps2[0], tensors((3,))[0] - 0.1)  # no decay, no nvlamb: the plain lr


@pytest.mark.parametrize("master", [False, True])
def test_multi_tensor_adam_capturable_unscales_and_skips_on_the_flag(master):
    ps = tensors((4, 3), (3,))
    gs = tensors((4, 3), (3,), seed=1)
    scaled = [g * 1024 for g in gs]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    half = [p.half() for p in ps]
    lists = [scaled, half, ms, vs, ps] if master else [scaled, ps, ms, vs]
    ref = [ref_adam(p.double(), g.double(), torch.zeros_like(p, dtype=torch.float64),
                    torch.zeros_like(p, dtype=torch.float64), lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, step=1, mode=1,
                    bias_correction=1, decay=0.01)[0] for p, g in zip(ps, gs)]
    kernel = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
    flag = torch.ones(1, dtype=torch.int)  # an overflow: nothing moves
    kernel(65536, flag, lists, torch.tensor(1e-2), 0.9, 0.999, 1e-8, torch.tensor([1]), 1, 1, 0.01,
           torch.tensor(1 / 1024))
    assert all(torch.equal(a, b) for a, b in zip(ps, tensors((4, 3), (3,))))
    flag.zero_()
    kernel(65536, flag, lists, torch.tensor(1e-2), 0.9, 0.999, 1e-8, torch.tensor([1]), 1, 1, 0.01,
           torch.tensor(1 / 1024))
    for p, r, s_, g in zip(ps, ref, scaled, gs):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s_, g)  # the gradients left unscaled, as Apex's kernel leaves them
    if master:
        assert all(torch.equal(h, p.half()) for h, p in zip(half, ps))


@pytest.mark.parametrize("mode", [0, 1])
def test_multi_tensor_adagrad_is_apex_kernel(mode):
    ps = tensors((4, 3), (3,))
    gs = tensors((4, 3), (3,), seed=1)
    hs = [torch.zeros_like(p) for p in ps]
    ref = [(p.double(), torch.zeros_like(p, dtype=torch.float64)) for p in ps]
    for _ in range(2):
        amp_C.multi_tensor_adagrad(65536, torch.zeros(1, dtype=torch.int), [gs, ps, hs], 1e-2, 1e-10, mode, 0.1)
        new = []
        for (p, h), g in zip(ref, gs):
            g = g.double() + (0.1 * p if mode == 0 else 0)
            h = h + g * g
            new.append((p - 1e-2 * (g / (h.sqrt() + 1e-10) + (0.1 * p if mode == 1 else 0)), h))
        ref = new
    for p, (r, _) in zip(ps, ref):
        torch.testing.assert_close(p, r.float(), rtol=1e-5, atol=1e-6)


def test_multi_tensor_l2norm_scale_and_apex_c():
    xs = tensors((4, 3), (5,))
    outs = [torch.empty_like(x) for x in xs]
    flag = torch.zeros(1, dtype=torch.int)
    total, each = amp_C.multi_tensor_l2norm_scale(65536, flag, [xs, outs], 0.5, True)
    torch.testing.assert_close(total, torch.cat([x.flatten() for x in xs]).norm().reshape(1))
    torch.testing.assert_close(each, torch.stack([x.norm() for x in xs]))
    assert all(torch.equal(o, x * 0.5) for o, x in zip(outs, xs)) and flag.item() == 0
    flat = apex_C.flatten(xs)
    assert torch.equal(flat, torch.cat([x.flatten() for x in xs]))
    back = apex_C.unflatten(flat, xs)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, xs))


# ================================================================ apex.contrib


@pytest.mark.quick
def test_contrib_clip_grad_norm_is_the_total_norm_clip():
    ps = [nn.Parameter(t) for t in tensors((4, 3), (3,))]
    grads = tensors((4, 3), (3,), seed=1)
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    total = clip_grad_norm_(ps, 0.5)
    ref_total = torch.cat([g.flatten() for g in grads]).norm()
    torch.testing.assert_close(total, ref_total)
    coef = 0.5 / (float(ref_total) + 1e-6)
    for p, g in zip(ps, grads):
        torch.testing.assert_close(p.grad, g * coef)
    assert float(clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0)) == 0.0  # no gradients: 0, as Apex


def ref_xentropy(x, labels, smoothing):
    """Apex's xentropy kernel: (lse - mean(x)) * smoothing - (x[label] - lse) * (1 - smoothing)."""
    x = x.double()
    lse = x.logsumexp(1)
    return (lse - x.mean(1)) * smoothing - (x.gather(1, labels[:, None]).squeeze(1) - lse) * (1 - smoothing)


@pytest.mark.parametrize("dtype,half_to_float", [(f32, False), (torch.float16, True), (torch.float16, False)])
def test_contrib_softmax_xentropy_with_smoothing_and_padding(dtype, half_to_float):
    (x,) = tensors((5, 7), dtype=dtype)
    x.requires_grad_(True)
    labels = torch.tensor([1, 0, 3, 6, 0])
    losses = SoftmaxCrossEntropyLoss.apply(x, labels, 0.1, 0, half_to_float)
    assert losses.dtype == f32  # Apex's kernel writes FP32 losses
    ref = ref_xentropy(x.detach(), labels, 0.1).masked_fill(labels == 0, 0)
    torch.testing.assert_close(losses.double(), ref, rtol=1e-3 if dtype != f32 else 1e-6, atol=1e-5)
    losses.sum().backward()
    xr = x.detach().double().requires_grad_(True)
    ref_xentropy(xr, labels, 0.1).masked_fill(labels == 0, 0).sum().backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-2 if dtype != f32 else 1e-5, atol=1e-3)
    with pytest.raises(RuntimeError, match="Half type only"):
        xentropy_cuda.forward(x.detach().float(), labels, 0.0, True)


@pytest.mark.parametrize("dtype", [f32, torch.bfloat16])
def test_contrib_fast_layer_norm_returns_the_weights_dtype(dtype):
    ln = FastLayerNorm(8, eps=1e-5)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
    (x,) = tensors((3, 4, 8), dtype=dtype)
    x.requires_grad_(True)
    y = ln(x)
    assert y.dtype == f32  # the weight's dtype, as Apex's fast_layer_norm kernel
    ref = F.layer_norm(x.detach().float(), (8,), ln.weight.detach(), ln.bias.detach(), 1e-5)
    torch.testing.assert_close(y, ref)
    y.sum().backward()
    xr = x.detach().float().requires_grad_(True)
    F.layer_norm(xr, (8,), ln.weight.detach(), ln.bias.detach(), 1e-5).sum().backward()
    torch.testing.assert_close(x.grad.float(), xr.grad.to(dtype).float())
    assert ln.weight.grad is not None
    y2 = FastLayerNormFN.apply(x.detach(), ln.weight.detach(), ln.bias.detach(), 1e-5)
    torch.testing.assert_close(y2, ref)


def test_contrib_group_norm_with_silu_is_torch_group_norm():
    gn = GroupNorm(2, 4, act="silu")
    with torch.no_grad():
        gn.weight.uniform_(0.5, 1.5)
    (x,) = tensors((2, 4, 3, 3))
    x = x.to(memory_format=torch.channels_last)
    torch.testing.assert_close(gn(x), F.silu(F.group_norm(x, 2, gn.weight, gn.bias, 1e-5)))
    assert gn(x.half()).dtype == torch.float16  # computed in the weight's dtype, returned in the input's
    with pytest.raises(ValueError, match="divisible"):
        GroupNorm(3, 4)


def test_distributed_fused_adam_in_one_process_is_fused_adam():
    a = [nn.Parameter(t) for t in tensors((4, 3), (3,))]
    b = [nn.Parameter(t.detach().clone()) for t in a]
    da = DistributedFusedAdam(a, lr=1e-2, weight_decay=0.1, bucket_cap_mb=10, overlap_grad_sync=True)
    fb = FusedAdam(b, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        for p, q, g in zip(a, b, tensors((4, 3), (3,), seed=step)):
            p.grad, q.grad = g.clone() * 5, g.clone() * 5
        norm = da.clip_grad_norm(1.0)
        torch.nn.utils.clip_grad_norm_(b, 1.0)
        ref_norm = torch.cat([g.flatten() for g in tensors((4, 3), (3,), seed=step)]).norm() * 5
        torch.testing.assert_close(norm, ref_norm)
        da.step()
        fb.step()
        da.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    with pytest.raises(TypeError, match="unexpected keyword"):
        DistributedFusedAdam(a, no_such_option=True)


def _dfa_case(rank):
    ps = [nn.Parameter(t) for t in tensors((4, 3), (3,))]
    opt = DistributedFusedAdam(ps, lr=1e-2)
    for p, g in zip(ps, tensors((4, 3), (3,), seed=rank + 1)):
        p.grad = g
    opt.step()
    return [p.detach() for p in ps]


def _worker(rank, port, out_dir):
    serve_cases(rank, port, out_dir, 2, [("dfa", lambda: _dfa_case(rank))], timeout=60)


@pytest.mark.slow
def test_distributed_fused_adam_under_gloo_averages_the_gradients(tmp_path):
    ranks = run_workers(__file__, 2, tmp_path, timeout=240)
    r0, r1 = case_results(ranks, "dfa")
    ps = [nn.Parameter(t) for t in tensors((4, 3), (3,))]
    ref = FusedAdam(ps, lr=1e-2)
    for p, g0, g1 in zip(ps, tensors((4, 3), (3,), seed=1), tensors((4, 3), (3,), seed=2)):
        p.grad = (g0 + g1) / 2
    ref.step()
    for a, b, p in zip(r0, r1, ps):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, p.detach())


# ================================================================ norms: autograd functions and the extension


def _ln_inputs(dtype=f32):
    x, w, b = tensors((3, 5, 8), (8,), (8,), dtype=dtype)
    return x.requires_grad_(True), (w + 1).detach().requires_grad_(True), b.requires_grad_(True)


@pytest.mark.parametrize("kind", ["layer_affine", "layer", "rms_affine", "rms", "layer_mixed", "rms_mixed"])
def test_norm_autograd_functions_forward_and_backward(kind):
    x, w, b = _ln_inputs(torch.bfloat16 if kind.endswith("mixed") else f32)
    if kind.endswith("mixed"):
        w, b = (w.detach().float().requires_grad_(True), b.detach().float().requires_grad_(True))
    fn, args, ref = {
        "layer_affine": (N.FusedLayerNormAffineFunction, (x, w, b, (8,), 1e-5),
                         lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5)),
        "layer": (N.FusedLayerNormFunction, (x, (8,), 1e-5), lambda x, w, b: F.layer_norm(x, (8,), None, None, 1e-5)),
        "rms_affine": (N.FusedRMSNormAffineFunction, (x, w, (8,), 1e-5),
                       lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w),
        "rms": (N.FusedRMSNormFunction, (x, (8,), 1e-5),
                lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)),
        "layer_mixed": (N.FusedLayerNormAffineMixedDtypesFunction, (x, w, b, (8,), 1e-5),
                        lambda x, w, b: F.layer_norm(x, (8,), w, b, 1e-5)),
        "rms_mixed": (N.FusedRMSNormAffineMixedDtypesFunction, (x, w, (8,), 1e-5),
                      lambda x, w, b: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w),
    }[kind]
    y = fn.apply(*args)
    assert y.dtype == (f32 if kind.endswith("mixed") else x.dtype)  # the mixed forms: the weight's dtype
    leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    yr = ref(*leaves)
    torch.testing.assert_close(y.double(), yr, rtol=2e-2 if kind.endswith("mixed") else 1e-5, atol=2e-2)
    g = torch.randn_like(yr)
    y.backward(g.to(y.dtype))
    yr.backward(g)
    for t, r in zip((x, w, b), leaves):
        if t.grad is not None:
            torch.testing.assert_close(t.grad.double(), r.grad, rtol=5e-2 if kind.endswith("mixed") else 1e-4,
                                       atol=5e-2 if kind.endswith("mixed") else 1e-5)


@pytest.mark.parametrize("memory_efficient", [False, True])
def test_fused_layer_norm_cuda_forward_and_backward(memory_efficient):
    x, w, b = (t.detach() for t in _ln_inputs())
    out, mean, invvar = fused_layer_norm_cuda.forward_affine(x, (8,), w, b, 1e-5)
    torch.testing.assert_close(out, F.layer_norm(x, (8,), w, b, 1e-5))
    torch.testing.assert_close(mean, x.reshape(-1, 8).mean(1))
    torch.testing.assert_close(invvar, torch.rsqrt(x.reshape(-1, 8).var(1, unbiased=False) + 1e-5))
    dy = torch.randn_like(out)
    xr, wr, br = (t.double().requires_grad_(True) for t in (x, w, b))
    F.layer_norm(xr, (8,), wr, br, 1e-5).backward(dy.double())
    dx, dw, db = fused_layer_norm_cuda.backward_affine(dy, None if memory_efficient else mean, invvar,
                                                       out if memory_efficient else x, (8,), w, b, 1e-5,
                                                       memory_efficient)
    for got, ref in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    h = x.half()
    out_h, mean_h, _ = fused_layer_norm_cuda.forward_affine(h, (8,), w, b, 1e-5)
    assert out_h.dtype == torch.float16 and mean_h.dtype == f32  # statistics in FP32 for half inputs
    assert fused_layer_norm_cuda.forward_affine_mixed_dtypes(h, (8,), w, b, 1e-5)[0].dtype == f32
    out_r, inv_r = fused_layer_norm_cuda.rms_forward_affine(x, (8,), w, 1e-5)
    xr = x.double().requires_grad_(True)
    (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()).backward(dy.double())
    dxr, _ = fused_layer_norm_cuda.rms_backward_affine(dy, inv_r, x, (8,), w, 1e-5)
    torch.testing.assert_close(dxr.double(), xr.grad, rtol=1e-4, atol=1e-5)


def test_fused_weight_gradient_accumulates_into_main_grad():
    x, dy = tensors((6, 4), (6, 3), dtype=torch.bfloat16)
    main = torch.ones(3, 4)
    fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main)
    torch.testing.assert_close(main, 1 + dy.float().t() @ x.float())
    with pytest.raises(RuntimeError, match="must be FP32"):
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main.half())
    with pytest.raises(RuntimeError, match="out_dim x in_dim"):
        fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, torch.zeros(4, 3))


# ================================================================ scaler internals and apex.amp.lists


def test_loss_scaler_overflow_buf_update_scale_and_scale_seq_len():
    model = nn.Linear(3, 2)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", half_dtype=torch.float16,
                   verbosity=0)
    try:
        scaler = amp._amp_state.loss_scalers[0]
        scaler._scale_seq_len = 2
        assert scaler._scale_seq_len == 2
        # Apex's LossScaler.update_scale, by hand: halve on overflow (unskipped back to 0), double after 2 clean
        ref_scale, unskipped = scaler.loss_scale(), 0
        for overflow in (False, True, False, False, False):
            own = torch.tensor([int(overflow)], dtype=torch.int)
            scaler._overflow_buf = own  # a script's own flag, as BERT's all-reduce step sets it
            skipped = scaler.update_scale()
            if overflow:
                ref_scale, unskipped = ref_scale / 2, 0
            else:
                unskipped += 1
                if unskipped == 2:
                    ref_scale, unskipped = ref_scale * 2, 0
            assert skipped is overflow and scaler.loss_scale() == ref_scale and scaler._unskipped == unskipped
            assert own.item() == 0  # cleared for the next step
        with pytest.raises(ValueError, match="_scale_seq_len"):
            scaler._scale_seq_len = 0
    finally:
        amp_patch.deinitialize()


def _table():
    return {k: e.policy for k, e in running.session().table.items()}


def test_edits_of_apex_lists_are_the_yaml_override(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    yaml_file = tmp_path / "o.yaml"
    yaml_file.write_text("torch.nn.functional:\n  half: [softmax]\n  remove: [softplus]\n")
    amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, lists=str(yaml_file), verbosity=0)
    try:
        by_yaml = _table()
        y_yaml = F.softplus(torch.randn(4)).dtype
    finally:
        amp_patch.deinitialize()
    fo = amp.lists.functional_overrides
    try:
        fo.FP32_FUNCS.remove("softmax")   # as Tacotron2 moves an op between Apex's lists
        fo.FP16_FUNCS.append("softmax")
        fo.FP32_FUNCS.remove("softplus")  # and takes one off every list
        assert amp.lists.override() == {"torch.nn.functional": {"half": ["softmax"], "remove": ["softplus"]}}
        amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0)
        try:
            assert _table() == by_yaml and by_yaml[("torch.nn.functional", "softmax")] == "half"
            assert ("torch.nn.functional", "softplus") not in by_yaml
            assert F.softplus(torch.randn(4)).dtype == y_yaml == f32
        finally:
            amp_patch.deinitialize()
    finally:
        amp.lists.reset()
    assert amp.lists.override() is None and "softmax" in fo.FP32_FUNCS


def test_edits_of_apex_lists_come_after_the_launchers_lists(tmp_path):
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launcher_lists = tmp_path / "launcher.yaml"
    launcher_lists.write_text("torch.nn.functional:\n  half: [softplus]\n")
    amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, lists=str(launcher_lists),
                         verbosity=0)
    running.session().provisional = Provisional(torch.float16, str(launcher_lists), None)  # as the launcher
    fo = amp.lists.functional_overrides
    try:
        fo.FP32_FUNCS.remove("softmax")
        fo.FP16_FUNCS.append("softmax")
        amp.initialize(model, opt, opt_level="O1", verbosity=0)  # the script's own call replaces the launcher's
        table = _table()
        assert table[("torch.nn.functional", "softplus")] == "half"  # the launcher's list kept
        assert table[("torch.nn.functional", "softmax")] == "half"  # and the script's edit on top
    finally:
        amp.lists.reset()
        amp_patch.deinitialize()


# ================================================================ smaller modules


@pytest.mark.quick
def test_apex_mlp_is_linear_layers_each_followed_by_the_activation():
    mlp = MLP([5, 4, 3])
    (x,) = tensors((2, 5))
    ref = F.relu(F.linear(F.relu(F.linear(x, mlp.weight_0, mlp.bias_0)), mlp.weight_1, mlp.bias_1))
    torch.testing.assert_close(mlp(x), ref)  # the last layer too, as Apex's kernel
    assert [n for n, _ in mlp.named_parameters()] == ["weight_0", "bias_0", "weight_1", "bias_1"]
    with pytest.raises(TypeError, match="relu or none"):
        MLP([2, 2], activation="tanh")


def mlp_tensors(bias, sizes=(5, 4, 3), batch=6, dtype=f32, seed=0):
    """An input and an MLP's weights and biases, each a leaf that requires grad."""
    shapes = [(batch, sizes[0])] + [(o, i) for i, o in zip(sizes, sizes[1:])]
    if bias:
        shapes += [(o,) for o in sizes[1:]]
    return [t.requires_grad_() for t in tensors(*shapes, seed=seed, dtype=dtype)]


def torch_mlp(activation, x, weights, biases):
    """A plain torch MLP: each layer F.linear, then the activation (the last layer too)."""
    act = {0: lambda y: y, 1: F.relu, 2: torch.sigmoid}[activation]
    for w, b in zip(weights, biases):
        x = act(F.linear(x, w, b))
    return x


def split(bias, args):
    n = (len(args) - 1) // 2 if bias else len(args) - 1
    return args[0], args[1:n + 1], args[n + 1:] if bias else [None] * n


@pytest.mark.parametrize("bias", [1, 0])
@pytest.mark.parametrize("activation", [0, 1, 2])
def test_mlp_function_is_a_torch_mlp_forward_and_backward(activation, bias):
    args = mlp_tensors(bias)
    ref_args = [t.detach().clone().requires_grad_() for t in args]
    y = MlpFunction.apply(bias, activation, *args)
    ref = torch_mlp(activation, *split(bias, ref_args))
    torch.testing.assert_close(y, ref)
    g = tensors(tuple(ref.shape), seed=1)[0]
    y.backward(g)
    ref.backward(g)
    for t, r in zip(args, ref_args):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        torch.testing.assert_close(t.grad, r.grad)


class _ByHand(torch.autograd.Function):
    """What DLRM does: an autograd function of its own around MlpFunction's static methods."""

    @staticmethod
    def forward(ctx, bias, activation, *args):
        return MlpFunction.forward(ctx, bias, activation, *args)

    @staticmethod
    def backward(ctx, grad):
        return MlpFunction.backward(ctx, grad)


def test_mlp_function_forward_and_backward_called_by_hand():
    args = mlp_tensors(1)
    ref_args = [t.detach().clone().requires_grad_() for t in args]
    y = _ByHand.apply(1, 1, *args)
    ref = torch_mlp(1, *split(1, ref_args))
    y.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(y, ref)
    for t, r in zip(args, ref_args):
        torch.testing.assert_close(t.grad, r.grad)
    # and with a plain object as ctx, no autograd at all
    ctx = type("Ctx", (), {})()
    out = MlpFunction.forward(ctx, 1, 1, *[t.detach() for t in args])
    grads = MlpFunction.backward(ctx, torch.ones_like(out))
    assert grads[:2] == (None, None) and not hasattr(ctx, "outputs")  # backward frees the layer outputs
    for got, r in zip(grads[2:], ref_args):
        torch.testing.assert_close(got, r.grad)


def test_mlp_function_dtypes_casting_and_errors():
    # one dtype, the input's, as Apex's kernel; each gradient in its tensor's dtype
    args = mlp_tensors(1)
    half_x = args[0].detach().to(torch.bfloat16).requires_grad_()
    y = MlpFunction.apply(1, 2, half_x, *args[1:])
    assert y.dtype == torch.bfloat16
    ref = torch_mlp(2, *split(1, [half_x.detach()] + [t.detach().to(torch.bfloat16) for t in args[1:]]))
    torch.testing.assert_close(y, ref)
    y.float().sum().backward()
    assert half_x.grad.dtype == torch.bfloat16 and all(t.grad.dtype == f32 for t in args[1:])
    # mlp_function casts to the autocast dtype first, as Apex's
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp_function(1, 1, *args).dtype == torch.bfloat16
        assert MlpFunction.apply(1, 1, *args).dtype == f32  # the function itself runs as given
    # amp_patch's casting does not reach inside: it runs in FP32 like a kernel, with a matching backward
    model = nn.Linear(5, 4)
    with amp_patch_run(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1"):
        assert F.linear(args[0], args[1]).dtype != f32  # casting is on
        y = MlpFunction.apply(1, 1, *args)
        assert y.dtype == f32
        y.sum().backward()
    torch.testing.assert_close(y, torch_mlp(1, *split(1, [t.detach() for t in args])))
    with pytest.raises(ValueError, match="2-D"):
        MlpFunction.apply(1, 1, args[0].detach().unsqueeze(0), *args[1:])
    with pytest.raises(ValueError, match="activation must be 0"):
        MlpFunction.apply(1, 3, *args)
    with pytest.raises(ValueError, match="one weight and one bias per layer"):
        MlpFunction.apply(1, 1, *args[:-1])


@pytest.mark.quick
def test_fused_dense_layers():
    dense, ffn = FusedDense(5, 4), FusedDenseGeluDense(5, 6, 3)
    (x,) = tensors((2, 5))
    torch.testing.assert_close(dense(x), F.linear(x, dense.weight, dense.bias))
    ref = F.linear(F.gelu(F.linear(x, ffn.weight1, ffn.bias1)), ffn.weight2, ffn.bias2)
    torch.testing.assert_close(ffn(x), ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dense(x).dtype == torch.bfloat16


@pytest.mark.quick
def test_reparameterization_weight_norm():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    (x,) = tensors((3, 4))
    before = net(x)
    apply_weight_norm(net)  # every parameter of more than one dimension, as Apex
    assert net[0].weight_g.shape == (5, 1) and net[1].weight_v.shape == (2, 5)
    torch.testing.assert_close(net(x), before)
    remove_weight_norm(net)
    assert isinstance(net[0].weight, nn.Parameter) and not hasattr(net[0], "weight_g")
    m = apply_weight_norm(nn.Linear(20, 40), name="weight")
    assert m.weight_g.size() == (40, 1)


# ================================================================ check-script on the cases


def test_check_script_follows_chains_extensions_and_keywords():
    src = (
        "import importlib\nfrom apex import amp\nimport apex_C\n"
        "from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction\n"
        "from apex.optimizers import FusedAdam\n"
        "flc = importlib.import_module('fused_layer_norm_cuda')\n"
        "FusedLayerNormAffineFunction.apply(x, w, b, s, 1e-5)\n"
        "FusedLayerNormAffineFunction.nope\n"
        "amp._amp_state.loss_scalers[0]._overflow_buf\n"
        "amp._amp_state.loss_scalers[0]._nope\n"
        "amp._amp_state.loss_scalers[0].dynamic = False\n"
        "opt = FusedAdam(ps, max_grad_norm=1.0, eps_inside_sqrt=True, not_a_keyword=1)\n"
        "opt.step(grads=g, scale=128.0)\n"
        "apex_C.flatten(ts)\nflc.forward_affine(x, s, w, b, 1e-5)\n"
        "importlib.import_module('apex.contrib.fmha')\n"
    )
    uses = {u.name: u for u in scan.scan(src)}
    served = {n for n, u in uses.items() if u.served_by}
    assert {"apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction.apply()",
            "apex.amp._amp_state.loss_scalers[]._overflow_buf", "apex.optimizers.FusedAdam(max_grad_norm=)",
            "apex.optimizers.FusedAdam(eps_inside_sqrt=)", "apex.optimizers.FusedAdam().step(grads=)",
            "apex.optimizers.FusedAdam().step(scale=)", "apex_C.flatten()",
            "fused_layer_norm_cuda.forward_affine()"} <= served
    not_served = {n: u.hint for n, u in uses.items() if not u.served_by}
    assert set(not_served) == {"apex.normalization.fused_layer_norm.FusedLayerNormAffineFunction.nope",
                               "apex.amp._amp_state.loss_scalers[]._nope",
                               "apex.amp._amp_state.loss_scalers[].dynamic =",
                               "apex.optimizers.FusedAdam(not_a_keyword=)", "apex.contrib.fmha"}
    assert "read-only" in not_served["apex.amp._amp_state.loss_scalers[].dynamic ="]
    assert "scaled_dot_product_attention" in not_served["apex.contrib.fmha"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
