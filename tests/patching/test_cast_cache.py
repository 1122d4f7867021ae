"""The weight-cast cache never serves a stale copy.

A write through ``.data`` (``p.data.mul_``, ``p.data.copy_``, ``p.data = new``:
EMA swaps for evaluation, pruning, re-initialisation) bumps no version counter,
so the cache lives for one forward, as ``torch.autocast``'s lives for one
region: every forward after such a write, with no backward in between, must
give what ``torch.autocast`` gives on the new weights. Each case runs on the C
fast path and on the pure-Python wrappers, with and without gradients.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch.base import running
from amp_patch.frontends import launcher
from amp_patch.frontends.launcher import Settings
from helpers import amp, write

bf16 = torch.bfloat16


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def autocast_reference(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What ``torch.autocast`` computes with ``m``'s weights as they are now
    (amp_patch's casts off, so autocast alone decides)."""
    with amp_patch.disable_casts(), torch.no_grad(), torch.autocast("cpu", dtype=bf16):
        return m(x)


def _mul(m: nn.Module, ema: list) -> None:
    m[0].weight.data.mul_(0.5)


def _copy(m: nn.Module, ema: list) -> None:
    for p, e in zip(m.parameters(), ema):
        p.data.copy_(e)


def _swap(m: nn.Module, ema: list) -> None:
    """The EMA swap for evaluation: each parameter takes the EMA tensor as its data."""
    for p, e in zip(m.parameters(), ema):
        p.data = e


WRITES = {"data.mul_": _mul, "data.copy_": _copy, "data = ema": _swap}


@pytest.mark.parametrize("grad", ["grad", "no_grad"])
@pytest.mark.parametrize("write_", list(WRITES))
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_write_through_data_between_two_forwards_is_seen(wrapper_path, level, write_, grad):
    m = model()
    ema = [p.detach().clone() * 0.9 + 0.01 for p in m.parameters()]
    x = torch.randn(5, 8)
    mode = torch.no_grad if grad == "no_grad" else contextlib.nullcontext
    with amp(m, None, level, half_dtype=bf16):
        cache = running.session().cache
        with mode():
            before = m(x)
            assert cache.misses > 0  # the weights went through the cache
            WRITES[write_](m, ema)
            after = m(x)  # no backward in between
            again = m(x)
        want = autocast_reference(m, x)
        assert not torch.equal(before.detach(), want), "the write changed what the model computes"
        assert after.dtype == want.dtype == bf16
        assert torch.equal(after.detach(), want) and torch.equal(again.detach(), want)


@pytest.mark.quick
def test_the_cache_serves_every_use_of_a_weight_inside_one_forward(wrapper_path):
    """Its benefit stays: a weight used several times in one forward is cast once."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            for _ in range(4):
                x = torch.relu(self.lin(x))
            return x

    m = Tied()
    x = torch.randn(3, 8)
    with amp(m, None, "O4"):
        cache = running.session().cache
        for _ in range(2):
            hits, misses = cache.hits, cache.misses
            out = m(x)
            assert (cache.misses - misses, cache.hits - hits) == (2, 6)  # weight and bias: 1 cast, 3 hits each
        with torch.no_grad():
            m.lin.weight.data.mul_(-1.0)
        assert torch.equal(m(x).detach(), autocast_reference(m, x))
        assert out.dtype == bf16


def test_a_forward_nested_in_another_keeps_the_outer_ones_copies(wrapper_path):
    """Only the outermost forward empties the cache: a model given to initialize
    that runs inside another one's forward does not throw the copies away."""
    inner = nn.Linear(8, 8)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(self.inner(x))

    outer = Outer()
    with amp([outer, inner], None, "O4"):
        cache = running.session().cache
        hits = cache.hits
        outer(torch.randn(2, 8))
        assert cache.hits - hits == 2  # the second call of inner: weight and bias from the cache


_EMA_EVAL = """
import copy, torch, torch.nn as nn
import amp_patch
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
ema = [p.detach().clone() * 0.5 for p in model.parameters()]
x = torch.randn(4, 8)

def reference():
    with amp_patch.disable_casts(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()

with torch.no_grad():
    live = model(x).float()
    for p, e in zip(model.parameters(), ema):      # swap the EMA weights in for evaluation
        p.data, e.data = e.data, p.data
    evaluated = model(x).float()
    want_ema = reference()
    for p, e in zip(model.parameters(), ema):      # and back
        p.data, e.data = e.data, p.data
    restored = model(x).float()
    model[0].weight.data.mul_(0.5)                  # prune, no backward since
    pruned = model(x).float()
    want_pruned = reference()
"""


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("outputs", ["float32", "half"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_the_launcher_sees_data_writes_in_a_model_it_does_not_know(tmp_path, level, outputs):
    """Under the launcher the script's model is not known (no initialize, no
    optimizer): each outermost module call starts with an empty cache."""
    script = write(tmp_path, "ema_eval.py", _EMA_EVAL)
    out = launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype="bfloat16", outputs=outputs))
    assert torch.equal(out["evaluated"], out["want_ema"]) and torch.equal(out["restored"], out["live"])
    assert torch.equal(out["pruned"], out["want_pruned"])
    assert not torch.equal(out["live"], out["evaluated"])
    assert not amp_patch.is_initialized()


def _per_sample_grads(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Per-sample gradients the way torch.func's tutorial (and Opacus) computes
    them: ``vmap(grad(loss))`` over ``functional_call``, whose parameters are
    torch.func's wrappers: Tensors with no storage, leaves that require grad."""
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(m, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out.float(), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_torch_func_transforms_cast_as_autocast_does_and_cache_nothing(wrapper_path, level):
    """``torch.func.grad``, ``jacrev`` and ``vmap`` run the function on wrappers
    with no storage: each is converted (its data pointer cannot key the cache)
    and nothing of theirs is kept, so the results are autocast's."""
    from torch.func import grad, jacrev

    m = model()
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    a, w = torch.randn(3, 8), torch.randn(8)
    with amp_patch.disable_casts(), torch.autocast("cpu", dtype=bf16):
        want_grad = grad(lambda v: (a @ v).sum())(w)
        want_jac = jacrev(lambda v: torch.tanh(a @ v))(w)
        want_ps = _per_sample_grads(m, x, y)
    with amp(m, None, level, half_dtype=bf16):
        cache = running.session().cache
        got_grad = grad(lambda v: (a @ v).sum())(w)
        got_jac = jacrev(lambda v: torch.tanh(a @ v))(w)
        got_ps = _per_sample_grads(m, x, y)
        assert len(cache) == 0 and cache.misses == 0  # no wrapper was kept
    assert got_grad.dtype == want_grad.dtype and torch.equal(got_grad, want_grad)
    assert got_jac.dtype == want_jac.dtype and torch.equal(got_jac, want_jac)
    assert not torch.equal(got_grad, grad(lambda v: (a @ v).sum())(w))  # FP32 differs: the casts happened
    for k, g in want_ps.items():
        assert got_ps[k].shape == (6,) + dict(m.named_parameters())[k].shape
        assert torch.equal(got_ps[k], g), k
