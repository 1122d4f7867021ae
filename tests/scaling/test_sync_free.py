"""Sync-free steps: the loss scale and the overflow verdict stay on the device.

A training step (forward, backward, ``optimizer.step()``, ``zero_grad()``)
must not read a device value on the host where its optimizer's update can
take the verdict as a flag; and it must compute what the step decided on the
host (``sync_free=False``) computes, bit for bit, overflows included.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch.base import running
from amp_patch.base.errors import ConfigError, OverflowLoopError
from amp_patch.diagnostics import losses
from amp_patch.precision import onepass
from amp_patch.scaling.scaler import LossScaler

#: every way a tensor's value reaches the host
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu")
_PACKAGE = os.path.dirname(amp_patch.__file__) + os.sep

needs_kernel = pytest.mark.skipif(onepass.native is None, reason=f"the one-pass C step is not built here: {onepass.UNAVAILABLE}")


class HostReads:
    """Patch every read of a tensor's value: one made by amp_patch's own code raises
    (while ``strict``); every read, by anyone, is counted."""

    def __init__(self):
        self.count = 0
        self.strict = False

    @contextlib.contextmanager
    def patched(self):
        saved = {n: vars(torch.Tensor).get(n) for n in READS}
        originals = {n: getattr(torch.Tensor, n) for n in READS}

        def make(name):
            real = originals[name]

            def read(t, *a, **k):
                self.count += 1
                caller = sys._getframe(1).f_code.co_filename
                if self.strict and caller.startswith(_PACKAGE):
                    raise AssertionError(f"amp_patch read a tensor on the host with Tensor.{name} inside a step "
                                         f"({caller}:{sys._getframe(1).f_lineno})")
                return real(t, *a, **k)
            return read

        for n in READS:
            setattr(torch.Tensor, n, make(n))
        try:
            yield self
        finally:
            for n in READS:
                if saved[n] is None:
                    delattr(torch.Tensor, n)
                else:
                    setattr(torch.Tensor, n, saved[n])


def model_for(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-3, amsgrad=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}
#: an update with no found_inf argument, which the one-pass step does not cover
OTHERS = {"rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3)}

#: (level, options): FP16 at every level that scales, BF16 where nothing is scaled
LEVELS = {
    "O0": dict(opt_level="O0"),
    "O1_fp16": dict(opt_level="O1", half_dtype=torch.float16),
    "O2_fp16": dict(opt_level="O2", half_dtype=torch.float16),
    # half gradients move into the masters as autograd finishes them, the C routine
    # reading the scaler's inverse scale from its CPU tensor
    "O2_fp16_absorb": dict(opt_level="O2", half_dtype=torch.float16, model_grads=False),
    "O3_fp16_dynamic": dict(opt_level="O3", half_dtype=torch.float16, loss_scale="dynamic"),
    # Apex's O3: a static scale of 1, nothing scaled; torch's own step on the half parameters
    "O3_fp16": dict(opt_level="O3", half_dtype=torch.float16),
    "O1_fp16_static": dict(opt_level="O1", half_dtype=torch.float16, loss_scale=256.0),
    "O4": dict(opt_level="O4"),
    "O5": dict(opt_level="O5"),
}
#: the levels that scale nothing: no verdict to read, no overflow to skip
UNSCALED = ("O0", "O3_fp16", "O4", "O5")


def sync_free_here(level, opt):
    """Whether this combination makes no host read of amp_patch's: every update that
    takes a device flag (the one-pass C step on FP32 parameters; torch's fused steps)."""
    if level in UNSCALED:
        return True
    if opt.endswith("_fused"):
        return True
    return onepass.native is not None and level != "O3_fp16_dynamic"


def train(level, opt_name, sync_free, poison=(1, 4), steps=7, reads=None, form="plain"):
    """Train a few steps with inf forced into the loss at steps ``poison``; return
    everything a step leaves: parameters, optimizer state, scaler state, counters."""
    model = model_for()
    opt = {**OPTIMIZERS, **OTHERS}[opt_name](model.parameters())
    model, opt = amp_patch.initialize(model, opt, verbosity=0, sync_free=sync_free, **LEVELS[level])
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        if i in poison:
            loss = loss * float("inf")
        if reads is not None:
            reads.strict = True
        if form == "plain":
            loss.backward()
        else:
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()
        if reads is not None:
            reads.strict = False
    state = {k: v for k, v in opt.state_dict()["state"].items()}
    counters = amp_patch.counters()
    history = list(running.session().scaling.scalers[0].history)
    result = {
        "params": [p.detach().clone() for p in model.parameters()],
        "masters": [p.detach().clone() for p in amp_patch.master_params(opt)],
        "state": state,
        "amp": amp_patch.state_dict(),
        "counters": counters,
        "history": history,
        "losses": losses.log_of(running.session().diagnostics).rows(),
    }
    amp_patch.deinitialize()
    return result


def assert_same(a, b):
    assert len(a["params"]) == len(b["params"])
    for x, y in zip(a["params"] + a["masters"], b["params"] + b["masters"]):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys()
        for name in sa:
            va, vb = sa[name], sb[name]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, vb), (k, name)
            else:
                assert va == vb
    assert a["amp"] == b["amp"]
    # the one-pass step also takes plain SGD's step at O1 where it reads the flag in C
    ca, cb = dict(a["counters"]), dict(b["counters"])
    for c in (ca, cb):
        c["optimizers"] = [{k: v for k, v in o.items() if k != "one_pass"} for o in c["optimizers"]]
    assert ca == cb
    assert a["history"] == b["history"]
    assert str(a["losses"]) == str(b["losses"])  # nan-safe


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("level", list(LEVELS))
def test_a_step_makes_no_host_read_and_computes_what_a_synced_step_does(level, opt_name):
    if opt_name == "sgd_fused" and level.startswith("O3"):
        pytest.skip("torch's fused CPU SGD on FP16 parameters is not deterministic (its first momentum "
                    "buffer), with or without amp_patch: nothing to compare bit for bit")
    if level == "O3_fp16" and opt_name in ("adam", "adamw_amsgrad"):
        pytest.skip("torch's for-loop Adam on FP16 parameters divides by eps=1e-8, which is 0 in FP16: "
                    "a zero gradient makes 0/0, and every parameter ends NaN in both paths: nothing to compare")
    poison = () if level in UNSCALED else (1, 4)
    reads = HostReads()
    with reads.patched():
        got = train(level, opt_name, sync_free=True, poison=poison,
                    reads=reads if sync_free_here(level, opt_name) else None)
    want = train(level, opt_name, sync_free=False, poison=poison)
    assert_same(got, want)
    if level in ("O1_fp16", "O2_fp16", "O2_fp16_absorb", "O1_fp16_static"):
        # the forced overflows were skipped, and the counts say so once read
        assert got["counters"]["skipped"] == 2 and got["counters"]["steps"] == 5


@pytest.mark.parametrize("form", ["plain", "scale_loss"])
@pytest.mark.parametrize("level", ["O1_fp16", "O2_fp16"])
@needs_kernel
def test_a_first_step_that_overflows_makes_no_state_a_later_step_differs_from(level, form):
    # the first step's state is made on the device whether or not it is taken (SGD's
    # momentum buffer zeroed, Adam's at step 0): the next taken step must give
    # what a first step gives
    for opt_name in ("sgd_momentum", "adam"):
        reads = HostReads()
        with reads.patched():
            got = train(level, opt_name, sync_free=True, poison=(0, 3), reads=reads, form=form)
        want = train(level, opt_name, sync_free=False, poison=(0, 3), form=form)
        assert_same(got, want)


#: the steps ``_amp_reads`` counts, after a first step outside the count
COUNTED = 3


def _amp_reads(level, opt_name, sync_free):
    reads = HostReads()
    with reads.patched():
        model = model_for()
        opt = {**OPTIMIZERS, **OTHERS}[opt_name](model.parameters())
        model, opt = amp_patch.initialize(model, opt, verbosity=0, sync_free=sync_free, **LEVELS[level])
        x, y = torch.randn(6, 8), torch.randn(6, 4)
        F.mse_loss(model(x).float(), y).backward()  # a first step, outside the count
        opt.step()
        opt.zero_grad()
        reads.count = 0
        for _ in range(COUNTED):
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        n = reads.count
        amp_patch.deinitialize()
    return n


def test_an_update_that_cannot_take_the_flag_reads_it_once_per_step():
    # RMSprop has no found_inf argument and the kernel does not cover it: one read a step
    assert _amp_reads("O1_fp16", "rmsprop", True) == COUNTED


def test_torch_own_reads_are_all_that_is_left():
    # torch's CPU Adam reads its own step counter (a CPU tensor on every device): amp_patch adds none
    model = model_for()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    reads = HostReads()
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with reads.patched():
        for i in range(1 + COUNTED):
            if i == 1:
                reads.count = 0
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    plain = reads.count
    # where the step kernel is not in use (no compiler at install, torch's DEFAULT
    # kernels), torch's for-loop Adam takes the step and has no found_inf: the host
    # decides, one read a step (the documented fallback), beside torch's own reads
    kernel = onepass.native is not None
    assert _amp_reads("O2_fp16", "adam", True) <= plain + (0 if kernel else COUNTED)
    assert _amp_reads("O2_fp16", "adam", False) == COUNTED + (0 if kernel else plain)


def test_counters_are_read_when_asked_and_right(caplog):
    model = model_for()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp_patch.initialize(model, opt, opt_level="O2", half_dtype=torch.float16, verbosity=1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    with caplog.at_level(logging.WARNING, logger="amp_patch"):
        for i in range(5):
            loss = F.mse_loss(model(x).float(), y)
            (loss * float("inf") if i == 2 else loss).backward()
            opt.step()
            opt.zero_grad()
            if i == 2:
                # on the CPU the record of the update is in host memory at once:
                # the notice comes with the step that overflowed
                assert "skipping the step (loss scale 65536 -> 32768)" in caplog.text
    c = amp_patch.counters()
    assert (c["steps"], c["skipped"], c["loss_scale"]) == (4, 1, [32768.0])
    amp_patch.deinitialize()


@pytest.mark.parametrize("sync_free", [True, False])
def test_the_skip_limit_stops_at_the_same_step(sync_free):
    model = model_for()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0,
                                      sync_free=sync_free, init_scale=4.0, max_consecutive_skips=3)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    stopped = None
    for i in range(20):
        (F.mse_loss(model(x).float(), y) * float("nan")).backward()
        try:
            opt.step()
        except OverflowLoopError as e:
            stopped = (i, str(e))
            break
        opt.zero_grad()
    amp_patch.deinitialize()
    # 4 -> 2 -> 1 (the floor), then three skips at the floor
    assert stopped is not None and stopped[0] == 4
    assert "the last 3 steps all produced inf/NaN gradients" in stopped[1]


@pytest.mark.parametrize("hysteresis", [1, 3])
@pytest.mark.parametrize("static", [False, True])
def test_the_scaler_moves_on_the_device_as_on_the_host(hysteresis, static):
    kw = dict(growth_interval=3, hysteresis=hysteresis, min_loss_scale=0.25, max_loss_scale=64.0, init_scale=16.0)
    host = LossScaler(8.0 if static else "dynamic", **kw)
    dev = LossScaler(8.0 if static else "dynamic", **kw)
    dev.to_device(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    verdicts = (torch.rand(200, generator=g) < 0.3).tolist()
    verdicts[20:40] = [True] * 20  # down to the floor and stuck there
    verdicts[60:100] = [False] * 40  # up to the ceiling
    for bad in verdicts:
        host.update(bad)
        dev.update_device(torch.tensor(1.0 if bad else 0.0))
        dev.poll()
        assert (dev.seen("scale"), dev.seen("growth_tracker"), dev.seen("hysteresis_left")) == \
               (host.scale, host.growth_tracker, host.hysteresis_left)
    assert dev.state_dict() == host.state_dict()
    assert list(dev.history) == list(host.history)
    assert dev.scale_tensor(torch.device("cpu")).item() == host.scale
    assert dev.inv_tensor(torch.device("cpu")).item() == torch.tensor(1.0 / host.scale, dtype=torch.float32).item()


def test_a_host_write_reaches_the_device():
    s = LossScaler("dynamic")
    s.to_device(torch.device("cpu"))
    s.update_device(torch.tensor(1.0))
    s.scale = 1024.0  # Apex's scaler property, a checkpoint load
    assert s.scale_tensor(torch.device("cpu")).item() == 1024.0
    assert s.inv_tensor(torch.device("cpu")).item() == 1.0 / 1024
    assert s.skipped == 1 and s.steps == 1
    s.load_state_dict({"loss_scale": 256.0, "unskipped": 5})
    assert s.scale_tensor(torch.device("cpu")).item() == 256.0 and s.growth_tracker == 5


def test_sync_free_is_an_option_with_a_checked_value():
    model = model_for()
    with pytest.raises(ConfigError, match="sync_free='yes' must be True or False"):
        amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", sync_free="yes")


def test_the_loss_log_reaches_the_host_without_a_read(monkeypatch):
    # the log of true losses (plot(), report()) is copied to the host every CHUNK
    # backwards without blocking; reading it waits for what is in flight
    monkeypatch.setattr(losses, "CHUNK", 2)
    reads = HostReads()
    with reads.patched():
        got = train("O2_fp16", "adam", sync_free=True, reads=reads if onepass.native is not None else None, poison=(2,))
    rows = got["losses"]
    assert [step for _, step, _ in rows] == list(range(7))
    assert rows[2][2] == float("inf") and all(0 < v < float("inf") for i, (_, _, v) in enumerate(rows) if i != 2)


@pytest.mark.parametrize("level", ["O1_fp16", "O2_fp16"])
def test_an_optimizer_that_reads_a_grad_scaler_is_skipped_on_the_host(level):
    # Apex's capturable FusedAdam says it supports AMP scaling, but reads a GradScaler
    # passed to its step, not a found_inf attribute: the flag is decided on the host,
    # and the overflowed steps are skipped as in the synced run
    from amp_patch.apex.optimizers import FusedAdam

    OTHERS["apex_fused_adam"] = lambda ps: FusedAdam(ps, lr=1e-3, capturable=True)
    try:
        got = train(level, "apex_fused_adam", sync_free=True)
        want = train(level, "apex_fused_adam", sync_free=False)
    finally:
        del OTHERS["apex_fused_adam"]
    assert_same(got, want)
    assert got["counters"]["skipped"] == 2
    assert _amp_reads(level, "rmsprop", True) == COUNTED  # the host read of a step that cannot take the flag
