"""``fused_update=True``: the compiled O2/O5 master update that reads the half
gradients and writes the half model in one pass.

Every case compares against the plain O2 step from the same start: the fused
update must give the same masters to float32 rounding (it is compiled, so not
bit for bit), leave the half model equal to its masters rounded, and fall back
to the plain step wherever it cannot apply.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.precision import compiled, onepass
from amp_patch.base.errors import ConfigError
import helpers
from helpers import amp, mlp

bf16, f32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def compiled_only(monkeypatch):
    """These tests are about the compiled update: the one-pass C step (which
    O2/O5 take first, tests/precision/test_onepass_step.py) is left out, as where it is not built."""
    monkeypatch.setattr(onepass, "native", None)


def net(seed=0):
    return mlp(16, 32, 4, seed=seed, norm="batch")


def batch(i):
    return helpers.batch(i, 16, 4)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3, dampening=0.1),
    "sgd_nesterov_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
}


def train_step(model, opt, i, inf=False):
    """One plain training step on batch ``i`` (its first input an inf when ``inf``); the loss."""
    x, y = batch(i)
    if inf:
        x[0, 0] = float("inf")
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    loss.backward()
    opt.step()
    return loss


def fused_steps():
    return amp_patch.counters()["optimizers"][0]["fused"]


FP16 = dict(opt_level="O2", half_dtype=torch.float16, init_scale=2.0**12, growth_interval=2)


def run(name, steps, fused_update, sched=False, config=None, inf_at=None, history=None):
    """Train ``steps`` steps (O5 unless ``config`` says otherwise); return (masters, half params, counters).

    ``inf_at``: a step whose input holds an inf (skipped under FP16);
    ``history``: a list that receives each step's masters and loss scale.
    """
    model = net()
    opt = OPTIMIZERS[name](model.parameters())
    config = config or dict(opt_level="O5")
    with amp(model, opt, fused_update=fused_update, **config) as (model, opt):
        sch = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.8) if sched else None
        for i in range(steps):
            train_step(model, opt, i, inf=i == inf_at)
            if sch is not None:
                sch.step()
            if history is not None:
                m = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
                history.append((m, amp_patch.counters()["loss_scale"][0]))
        masters = [m.detach().clone() for m in amp_patch.master_params(opt)]
        halfs = [p.detach().clone() for p in model.parameters()]
        return masters, halfs, amp_patch.counters()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_fused_step_equals_the_plain_step(name):
    # step 1 is plain where it creates optimizer state (all but SGD without momentum), step 2 fused
    plain, _, c0 = run(name, 2, False)
    got, halfs, c1 = run(name, 2, True)
    assert c0["optimizers"][0]["fused"] == 0 and c1["optimizers"][0]["fused"] == (2 if name == "sgd" else 1)
    for a, b in zip(plain, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    # the half model is its masters rounded, the kept-FP32 BatchNorm its own params
    for m, h in zip(got, halfs):
        assert torch.equal(h, m.to(h.dtype))
    assert {h.dtype for h in halfs} == {bf16, f32}


def test_sgd_stays_within_rounding_of_the_plain_step_over_a_schedule():
    plain, _, _ = run("sgd_momentum", 8, False, sched=True)
    got, _, c = run("sgd_momentum", 8, True, sched=True)
    assert c["optimizers"][0]["fused"] == 7  # a changing lr does not stop it
    for a, b in zip(plain, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd_momentum", "adamw_amsgrad"])
def test_fp16_with_dynamic_loss_scaling_skips_the_same_step_and_unscales_as_it_reads(name):
    plain_hist, fused_hist = [], []
    plain, _, c0 = run(name, 7, False, config=FP16, inf_at=3, history=plain_hist)
    got, halfs, c1 = run(name, 7, True, config=FP16, inf_at=3, history=fused_hist)
    assert c0["skipped"] == c1["skipped"] == 1
    assert c1["optimizers"][0]["fused"] == 5  # step 0 creates the state, step 3 is skipped
    # the same loss-scale history: backoff at the skipped step, growth every 2 good steps
    assert [s for _, s in fused_hist] == [s for _, s in plain_hist]
    assert fused_hist[2][1] > fused_hist[3][1]
    # the skipped step changed nothing
    assert all(torch.equal(a, b) for a, b in zip(fused_hist[2][0], fused_hist[3][0]))
    # Adam's normalised steps turn a last-bit difference into a flipped FP16
    # weight within a few steps (the plain step does the same to a 1e-7 nudge),
    # so for AdamW only its first fused step is compared this tightly
    tight = plain_hist if name.startswith("sgd") else plain_hist[:2]
    for (a, _), (b, _) in zip(tight, fused_hist):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-6)
    assert {h.dtype for h in halfs} == {torch.float16, f32}


def test_adamw_trains_on_the_true_gradients_the_backward_left_in_the_masters():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with amp(model, opt, "O5", fused_update=True) as (model, opt):
        losses = [train_step(model, opt, i % 2).item() for i in range(30)]
        mw = amp_patch.base.running.session().scaling.by_optimizer[id(opt)].masters
        assert all(m.grad is not None and m.grad.dtype == torch.float32 for m in mw.masters)
        # moved into the masters as the backward ended; the model's .grad reads them in BF16
        assert all(torch.equal(p.grad, m.grad.to(p.dtype)) for p, m in zip(mw.halfs, mw.masters))
        assert fused_steps() == 29
    assert losses[-1] < 0.5 * losses[0]


def test_accumulation_and_clipping_are_applied_by_the_fused_step():
    def train(fused_update):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with amp(model, opt, "O5", fused_update=fused_update) as (model, opt):
            def step(accumulate, clip):
                opt.zero_grad()
                for i in range(2 if accumulate else 1):
                    x, y = batch(i)
                    F.mse_loss(model(x), y).backward()
                if clip:
                    total = torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 1e-3)
                    assert total > 1e-3
                opt.step()

            step(False, False)  # plain: creates the momentum buffers
            step(True, False)  # two backwards: their FP32 sum is what the fused step reads
            step(False, True)  # the clipped master gradients are the ones applied
            step(True, True)
            assert amp_patch.counters()["steps"] == 4
            return [m.detach().clone() for m in amp_patch.master_params(opt)], fused_steps()

    plain, n_plain = train(False)
    got, n_fused = train(True)
    assert (n_plain, n_fused) == (0, 3)
    for a, b in zip(plain, got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_a_changed_momentum_stops_the_fused_update_for_good(caplog):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with amp(model, opt, "O5", fused_update=True) as (model, opt):
        with caplog.at_level(logging.INFO, logger="amp_patch"):
            for i in range(4):
                if i == 2:
                    opt.param_groups[0]["momentum"] = 0.5
                train_step(model, opt, i)
        assert fused_steps() == 1
        assert "a hyperparameter other than lr changed" in caplog.text


@pytest.mark.parametrize(
    "config, broken",
    [(None, ("sgd",)), (FP16, ("sgd", "check")), (FP16, ("sgd",))],
    ids=["bf16", "fp16-check-fails", "fp16-update-fails-after-the-check"],
)
def test_a_compile_failure_warns_once_and_the_plain_step_goes_on(monkeypatch, caplog, config, broken):
    def fails(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    real = compiled.CompiledUpdate._fn
    monkeypatch.setattr(compiled.CompiledUpdate, "_fn", lambda self, kind, device: fails if kind in broken else real(self, kind, device))
    inf_at = 2 if config else None  # a skipped step under FP16 (BF16 has none to skip)
    plain, _, c0 = run("sgd_momentum", 5, False, config=config, inf_at=inf_at)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        got, _, c = run("sgd_momentum", 5, True, config=config, inf_at=inf_at)
    assert c["optimizers"][0]["fused"] == 0
    assert caplog.text.count("torch.compile failed (RuntimeError: no C++ compiler)") == 1
    assert c["skipped"] == c0["skipped"] == (1 if config else 0)
    assert c["loss_scale"] == c0["loss_scale"]
    assert all(torch.equal(a, b) for a, b in zip(plain, got))


def test_deinitialize_after_fused_steps_gives_back_the_fp32_model():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with amp(model, opt, "O5", fused_update=True) as (m, o):
        for i in range(3):
            train_step(m, o, i)
        masters = [p.detach().clone() for p in amp_patch.master_params(o)]
    assert all(p.dtype == f32 for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), masters))
    assert all(p is q for p, q in zip(opt.param_groups[0]["params"], model.parameters()))


@pytest.mark.parametrize(
    "kwargs, opt_factory, match",
    [
        (dict(opt_level="O5", fused_update="yes"), None, r"fused_update='yes' must be True or False"),
        (dict(opt_level="O4", fused_update=True), None, r"opt_level='O4' has none; use it with O2 or O5"),
        (dict(opt_level="O5", fused_update=True), lambda ps: torch.optim.RMSprop(ps),
         r"optimizer 0: RMSprop is not one of torch.optim.SGD, Adam, AdamW"),
        (dict(opt_level="O5", fused_update=True), lambda ps: torch.optim.Adam(ps, differentiable=True),
         r"Adam\(differentiable=True\) runs its own kernel"),
    ],
)
def test_bad_fused_update_setups_are_refused_before_anything_changes(kwargs, opt_factory, match):
    model = net()
    opt = (opt_factory or (lambda ps: torch.optim.SGD(ps, lr=0.1)))(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=match):
        amp_patch.initialize(model, opt, verbosity=0, **kwargs)
    assert not amp_patch.is_initialized()
    assert all(p.dtype == f32 and torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_a_compile_failure_with_an_empty_first_param_group_runs_the_plain_step(monkeypatch, caplog):
    def fails(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled.CompiledUpdate, "_fn", lambda self, kind, device: fails)
    results = []
    for fused_update in (False, True):
        model = mlp(4, 8, 2)
        opt = torch.optim.SGD([{"params": []}, {"params": list(model.parameters())}], lr=0.1, momentum=0.9)
        with caplog.at_level(logging.WARNING, logger="amp_patch"), amp(model, opt, opt_level="O5", fused_update=fused_update):
            for i in range(3):
                x, y = helpers.batch(i, 4, 2)
                F.mse_loss(model(x), y).backward()
                opt.step()  # the fused update fails before any group stepped: the plain step runs
                opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    assert caplog.text.count("torch.compile failed (RuntimeError: no C++ compiler)") == 1
    assert all(torch.equal(a, b) for a, b in zip(*results))


#: run in a subprocess: the fused update against the plain step; prints the largest difference
ACROSS_CPUS = """
import torch, torch.nn.functional as F, amp_patch
from amp_patch.precision import onepass
onepass.native = None  # the compiled update, as where the C step is not built
out = []
for fused in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp_patch.initialize(model, opt, opt_level="O5", fused_update=fused, verbosity=0)
    torch.manual_seed(1)
    for i in range(3):
        F.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        opt.step()
        opt.zero_grad()
    assert amp_patch.counters()["optimizers"][0]["fused"] == (2 if fused else 0)
    out.append(torch.cat([m.detach().flatten() for m in amp_patch.master_params(opt)]))
    amp_patch.deinitialize()
print("DIFF", (out[0] - out[1]).abs().max().item())
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                    reason="needs a CPU whose torch kernels are AVX-512, to read its compile cache with narrower vectors")
def test_a_compile_cache_written_with_wider_vectors_does_not_change_the_update(tmp_path):
    # torch's graph cache does not key CPU graphs by vector width: the same cache
    # directory read under AVX2 compiled the AVX-512 graph's kernels for 8 lanes
    # and updated half of each tensor (differences of 0.1, silently)
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    for capability in ("avx512", "avx2"):
        env["ATEN_CPU_CAPABILITY"] = capability
        res = subprocess.run([sys.executable, "-c", ACROSS_CPUS], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        diff = float(res.stdout.split("DIFF")[-1])
        assert diff < 1e-6, (capability, diff)
