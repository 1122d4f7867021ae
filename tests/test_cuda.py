"""CUDA checks. Marked `cuda`: skipped with a reason on machines without a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from helpers import mlp

pytestmark = pytest.mark.cuda


def test_default_half_dtype_on_cuda_is_fp16():
    m = nn.Linear(16, 16).cuda()
    amp_patch.initialize(m, None, "O1")
    try:
        assert m(torch.randn(4, 16, device="cuda")).dtype == torch.float16
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize(
    "call",
    [
        lambda x: F.linear(x, x),
        lambda x: torch.mm(x, x),
        lambda x: F.softmax(x, -1),
        lambda x: F.layer_norm(x, x.shape[-1:]),
        lambda x: torch.exp(x),
        lambda x: torch.sum(x),
        lambda x: torch.cumsum(x, 0),
        lambda x: torch.addcmul(x, x.half(), x),
        lambda x: torch.cdist(x, x),
        lambda x: F.mse_loss(x, x),
    ],
    ids=["linear", "mm", "softmax", "layer_norm", "exp", "sum", "cumsum", "addcmul", "cdist", "mse_loss"],
)
def test_fp16_policy_matches_cuda_autocast(call):
    x = torch.randn(8, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        expected = call(x).dtype
    amp_patch.initialize(None, None, "O1", half_dtype="float16")
    try:
        assert call(x).dtype == expected
    finally:
        amp_patch.deinitialize()


def test_o2_trains_on_cuda_with_dynamic_scaling():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp_patch.initialize(model, opt, "O2")
    try:
        x, y = torch.randn(256, 64, device="cuda"), torch.randn(256, 1, device="cuda")
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert model[0].weight.dtype == torch.float16
        assert losses[-1] < losses[0]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_fused_update_on_cuda_matches_the_plain_step(opt_name):
    def train(fused):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt_name == "sgd" else \
            torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = amp_patch.initialize(model, opt, "O5", fused_update=fused, verbosity=0)
        try:
            g = torch.Generator(device="cuda").manual_seed(1)
            x = torch.randn(32, 64, device="cuda", generator=g)
            y = torch.randn(32, 8, device="cuda", generator=g)
            for _ in range(2):  # the first step creates the optimizer state, the second is fused
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            return [m.detach().clone() for m in amp_patch.master_params(opt)], amp_patch.counters()
        finally:
            amp_patch.deinitialize()

    plain, _ = train(False)
    got, c = train(True)
    assert c["optimizers"][0]["fused"] == 1
    for a, b in zip(plain, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_cached_weight_and_inplace_rules_on_cuda():
    """The C cache hit serves a CUDA weight's FP16 copy until the weight changes;
    an in-place FP32-policy op refuses an FP16 CUDA tensor."""
    w = nn.Parameter(torch.randn(8, 8, device="cuda"))
    x = torch.randn(8, 8, device="cuda")
    amp_patch.initialize(None, None, "O1", half_dtype="float16", verbosity=0)
    try:
        from amp_patch.base import running

        cache = running.session().cache
        a, b = torch.mm(x, w), torch.mm(x, w)
        assert (cache.misses, cache.hits) == (1, 1) and torch.equal(a, b)
        with torch.no_grad():
            w.mul_(2)
        c = torch.mm(x, w)
        assert cache.misses == 2
        with amp_patch.disable_casts():
            assert torch.equal(c, torch.mm(x.half(), w.half()))
        h = torch.rand(4, device="cuda", dtype=torch.float16)
        with pytest.raises(amp_patch.CastError, match="torch.Tensor.exp_"):
            h.exp_()
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gradients_after_a_scaled_backward_are_true_on_cuda(level):
    import copy

    model = mlp(32, 64, 8).cuda()
    ref = copy.deepcopy(model)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 32, device="cuda", generator=g)
    y = torch.randn(16, 8, device="cuda", generator=g)
    F.mse_loss(ref(x), y).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype="float16", verbosity=0)
    try:
        F.mse_loss(model(x), y).backward()
        got = list(model.parameters()) if level == "O1" else list(amp_patch.master_params(opt))
        for p, r in zip(got, ref.parameters()):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=2e-3)
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_backward_never_syncs_and_the_step_syncs_once_on_cuda(level):
    import warnings

    model = mlp(32, 64, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype="float16", verbosity=0)
    try:
        x = torch.randn(16, 32, device="cuda")
        y = torch.randn(16, 8, device="cuda")
        for _ in range(2):  # the first step makes the flags and buffers
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        torch.cuda.synchronize()
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()  # unscales and checks on the device: no host sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert sum("synchroniz" in str(w.message) for w in seen) == 1, [str(w.message) for w in seen]
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("opt_name", ["adam_fused", "sgd_fused"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_a_whole_step_makes_no_host_sync_on_cuda(level, opt_name):
    # sync-free steps: the loss scale and the verdict stay on the GPU, and torch's fused
    # updates take the verdict as found_inf; an overflow is forced on one step
    def train(sync_free):
        torch.manual_seed(0)
        model = mlp(32, 64, 8).cuda()
        opt = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if opt_name == "adam_fused"
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True))
        half = "bfloat16" if level == "O5" else "float16"
        model, opt = amp_patch.initialize(model, opt, level, half_dtype=half, verbosity=0, sync_free=sync_free)
        g = torch.Generator(device="cuda").manual_seed(1)
        try:
            for i in range(6):
                x = torch.randn(16, 32, device="cuda", generator=g)
                y = torch.randn(16, 8, device="cuda", generator=g)
                if sync_free and i >= 1:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    loss = F.mse_loss(model(x).float(), y)
                    if i == 3 and level != "O5":
                        loss = loss * float("inf")
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            c = amp_patch.counters()
            return [p.detach().clone() for p in model.parameters()], c
        finally:
            amp_patch.deinitialize()

    got, c_got = train(True)
    want, c_want = train(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert c_got == c_want
    assert c_got["skipped"] == (0 if level == "O5" else 1)
