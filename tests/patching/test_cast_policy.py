"""``cast_policy="auto"``: half-list matmuls too small for the half dtype to win stay FP32.

The threshold is measured at initialize (``costs.threshold``); these tests fix
it where they need a known one, so what they assert does not depend on the
machine's speed: a call under it runs the original op in FP32 (bit for bit
the unpatched op on the same inputs), a call over it casts exactly as the
default policy does, the ledger says which calls stayed FP32 and why, and the
default policy is untouched.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch.base.errors import ConfigError
from amp_patch.patching import costs, wrappers
from helpers import amp

bf16, f32 = torch.bfloat16, torch.float32


def _plain(fn, *args):
    """``fn`` as torch computes it, casts off (a module-level alias of the
    original would be a name bound before initialize, which amp_patch warns of)."""
    with amp_patch.disable_casts():
        return fn(*args)


@pytest.fixture
def fixed_threshold(monkeypatch):
    """A threshold of 1 MFLOP instead of the measured one."""
    monkeypatch.setattr(costs, "threshold", lambda half, device_type="cpu", threads=0: 1e6)
    return 1e6


def test_small_matmuls_stay_fp32_and_large_ones_cast_as_by_default(fixed_threshold, wrapper_path):
    g = torch.Generator().manual_seed(0)
    small_x, small_w = torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g)  # 4 kFLOP
    big_x, big_w = torch.randn(64, 128, generator=g), torch.randn(128, 128, generator=g)  # 2.1 MFLOP
    with amp(None, None, "O4", cast_policy="auto"):
        # the C fast path decides the common call itself where it is built
        assert (type(F.linear).__module__ == "amp_patch.patching._fastpath") is (wrapper_path == "c")
        small = F.linear(small_x, small_w)
        big = F.linear(big_x, big_w)
        small_mm = torch.mm(small_x, small_w)
        big_mm = big_x @ big_w
    assert small.dtype == f32 and torch.equal(small, _plain(F.linear, small_x, small_w))
    assert small_mm.dtype == f32 and torch.equal(small_mm, _plain(torch.mm, small_x, small_w))
    assert big.dtype == bf16 and torch.equal(big, _plain(F.linear, big_x.to(bf16), big_w.to(bf16)))
    assert big_mm.dtype == bf16 and torch.equal(big_mm, _plain(torch.mm, big_x.to(bf16), big_w.to(bf16)))


def test_a_small_matmul_on_a_half_input_runs_in_fp32(fixed_threshold, wrapper_path):
    x, w = torch.randn(4, 8).to(bf16), torch.randn(8, 8)
    h = torch.randn(8, 8).to(torch.float16)
    with amp(None, None, "O4", cast_policy="auto"):
        out = F.linear(x, w)
        both_half = torch.mm(x, x.t())  # nothing to cast: it runs as it is, in BF16
        other_half = torch.mm(h, w)  # an FP16 input under BF16: FP32 too
    assert out.dtype == f32 and torch.equal(out, _plain(F.linear, x.float(), w))
    assert both_half.dtype == bf16 and torch.equal(both_half, _plain(torch.mm, x, x.t()))
    assert other_half.dtype == f32 and torch.equal(other_half, _plain(torch.mm, h.float(), w))


@pytest.mark.parametrize("op,args", [
    ("conv2d", (torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3))),  # 2*25*54 = 2.7 kFLOP
    ("addmm", (torch.randn(4), torch.randn(3, 5), torch.randn(5, 4))),
    ("bmm", (torch.randn(2, 3, 5), torch.randn(2, 5, 4))),
])
def test_every_way_of_counting_keeps_a_small_call_fp32(op, args, fixed_threshold, wrapper_path):
    fn = getattr(torch, op)
    original = fn
    with amp(None, None, "O4", cast_policy="auto"):
        out = getattr(torch, op)(*args)
    assert out.dtype == f32 and torch.equal(out, original(*args))


def test_the_default_policy_casts_every_size():
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    with amp(None, None, "O4"):
        assert F.linear(x, w).dtype == bf16
        assert torch.mm(x, w).dtype == bf16
        # the default's common call keeps its check in C where that is built
        if wrappers.fast is not None:
            assert type(F.linear).__module__ == "amp_patch.patching._fastpath"


def test_a_model_trains_fp32_where_small_and_half_where_large(fixed_threshold):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append(o.dtype)) for m in model if isinstance(m, torch.nn.Linear)]
    x = torch.randn(32, 16)
    with amp(model, opt, "O4", cast_policy="auto", collect_stats=True) as (model, opt):
        model(x).float().sum().backward()
        opt.step()
        rep = amp_patch.report()
    for h in hooks:
        h.remove()
    # 16 kFLOP, 524 kFLOP: FP32; 16.8 MFLOP: half
    assert seen == [f32, f32, bf16]
    lin = rep.ops["torch.nn.functional.linear"]
    assert lin["calls"] == 3 and lin["kept_fp32"] == 2
    assert "16.4 kFLOP < 1 MFLOP" in lin["kept_why"] and "cast_policy='auto'" in lin["kept_why"]
    assert "kept in float32 by cast_policy='auto'" in str(rep)


def test_the_ledger_shows_no_kept_calls_by_default():
    x, w = torch.randn(2, 4), torch.randn(4, 4)
    with amp(None, None, "O4", collect_stats=True):
        F.linear(x, w)
        rep = amp_patch.report()
    assert rep.ops["torch.nn.functional.linear"]["kept_fp32"] == 0
    assert "kept in float32" not in str(rep)


@pytest.mark.parametrize("qualname,args,expected", [
    ("torch.nn.functional.linear", (torch.empty(8, 3, 16), torch.empty(32, 16)), 2 * 8 * 3 * 16 * 32),
    ("torch.mm", (torch.empty(5, 7), torch.empty(7, 9)), 2 * 5 * 7 * 9),
    ("torch.bmm", (torch.empty(2, 5, 7), torch.empty(2, 7, 9)), 2 * 2 * 5 * 7 * 9),
    ("torch.addmm", (torch.empty(9), torch.empty(5, 7), torch.empty(7, 9)), 2 * 5 * 7 * 9),
    ("torch.nn.functional.conv2d", (torch.empty(2, 3, 10, 10), torch.empty(4, 3, 3, 3)), 2 * 2 * 100 * 4 * 3 * 9),
])
def test_flops_from_shapes(qualname, args, expected):
    assert costs.flops(costs.FLOPS[qualname], args) == expected


def test_every_sized_op_is_on_the_half_list():
    from amp_patch import oplists
    half = {e.qualname for e in oplists.load().entries if e.policy == "half"}
    missing = sorted(q for q in costs.FLOPS if q not in half)
    assert not missing, f"costs.FLOPS names ops the half list does not have: {missing}"


def test_the_threshold_is_measured_once_per_process():
    costs.threshold.cache_clear()
    a = costs.threshold(bf16, "cpu", 1)
    b = costs.threshold(bf16, "cpu", 1)
    assert a == b and (a > 0 or math.isinf(a))
    assert costs.threshold.cache_info().misses == 1
    assert costs.threshold(bf16, "cuda", 1) == 0.0  # not measured: every call casts


def test_a_bad_cast_policy_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="cast_policy='fast' must be 'parity'.*or 'auto'"):
        amp_patch.initialize(None, None, "O4", cast_policy="fast")
    assert not amp_patch.is_initialized()


def test_cast_policy_belongs_to_the_session(fixed_threshold):
    with amp(None, None, "O4", cast_policy="auto"):
        with pytest.raises(ConfigError, match="cast_policy='parity'"):
            amp_patch.initialize(None, None, "O4", cast_policy="parity")
