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
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_a_whole_step_makes_no_host_sync_on_cuda(level, opt_name):
    # sync-free steps: the loss scale and the verdict stay on the GPU, and torch's fused
    # updates take the verdict as found_inf; an overflow is forced on one step where the
    # loss is scaled (FP16 at O1/O2; O3's static scale of 1 checks nothing, as Apex's)
    scaled = level in ("O1", "O2")

    def train(sync_free):
        torch.manual_seed(0)
        model = mlp(32, 64, 8).cuda()
        opt = (torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if opt_name == "adam_fused"
               else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True))
        half = "bfloat16" if level in ("O4", "O5") else "float16"
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
                    if i == 3 and scaled:
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
    assert c_got["skipped"] == (1 if scaled else 0)


# ---------------------------------------------------------------- Apex's stand-ins on a GPU
# Each is checked against Apex's own formulas on the CPU (tests/apex_standins); here it
# must compute on CUDA tensors what it computes on CPU ones, from the same values.


def _standin_optimizers():
    from amp_patch.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

    return {
        "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
        "FusedAdam_l2": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, adam_w_mode=False),
        "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
        "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, nesterov=True),
        "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
        "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    }


def _train_standin(make, device, level=None):
    torch.manual_seed(0)
    model = mlp(16, 32, 4).to(device)
    opt = make(model.parameters())
    if level is not None:
        model, opt = amp_patch.initialize(model, opt, level, half_dtype="float16", verbosity=0)
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(5):
            x, y = torch.randn(8, 16, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().float().cpu() for p in model.parameters()]
    finally:
        if level is not None:
            amp_patch.deinitialize()


@pytest.mark.parametrize("name", ["FusedAdam", "FusedAdam_l2", "FusedLAMB", "FusedSGD", "FusedNovoGrad", "FusedAdagrad"])
def test_apex_optimizer_standins_step_on_cuda_as_on_the_cpu(name):
    make = _standin_optimizers()[name]
    for got, want in zip(_train_standin(make, "cuda"), _train_standin(make, "cpu")):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_fused_adam_trains_under_fp16_on_cuda(level):
    from amp_patch.apex.optimizers import FusedAdam

    fp32 = _train_standin(lambda ps: FusedAdam(ps, lr=1e-2), "cuda")
    got = _train_standin(lambda ps: FusedAdam(ps, lr=1e-2), "cuda", level)
    for a, b in zip(got, fp32):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # FP16's precision over five steps


@pytest.mark.parametrize("kind", ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"])
def test_apex_fused_norms_on_cuda_as_on_the_cpu(kind):
    from amp_patch.apex import normalization as N

    torch.manual_seed(0)
    cpu = getattr(N, kind)(8)
    with torch.no_grad():
        cpu.weight.uniform_(0.5, 1.5)
        if getattr(cpu, "bias", None) is not None:
            cpu.bias.uniform_(-0.5, 0.5)
    gpu = __import__("copy").deepcopy(cpu).cuda()
    dtype = torch.float16 if kind.startswith("Mixed") else torch.float32  # Mixed*: half input, FP32 weights
    x = torch.randn(4, 8).to(dtype)
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    yc, yg = cpu(xc), gpu(xg)
    assert yg.dtype == yc.dtype
    torch.testing.assert_close(yg.cpu(), yc, rtol=1e-3, atol=1e-3)
    yc.float().square().sum().backward()
    yg.float().square().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gpu.weight.grad.cpu(), cpu.weight.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("half_to_float", [False, True])
def test_apex_xentropy_on_cuda_as_on_the_cpu(half_to_float):
    from amp_patch.apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    torch.manual_seed(0)
    x = torch.randn(6, 10).half()
    labels = torch.tensor([0, 3, 9, 1, 0, 5])
    xc, xg = x.clone().requires_grad_(), x.cuda().requires_grad_()
    lc = SoftmaxCrossEntropyLoss.apply(xc, labels, 0.1, 0, half_to_float)
    lg = SoftmaxCrossEntropyLoss.apply(xg, labels.cuda(), 0.1, 0, half_to_float)
    assert lg.dtype == lc.dtype
    torch.testing.assert_close(lg.cpu(), lc, rtol=1e-3, atol=1e-3)
    lc.float().sum().backward()
    lg.float().sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-3, atol=1e-3)


def test_amp_c_kernels_on_cuda_as_on_the_cpu():
    from amp_patch.apex import amp_C

    torch.manual_seed(0)
    xs = [torch.randn(n) for n in (5, 300, 7)]
    ys = [torch.randn(n) for n in (5, 300, 7)]

    def run(device):
        flag = torch.zeros(1, dtype=torch.int, device=device)
        x = [t.to(device) for t in xs]
        y = [t.to(device) for t in ys]
        scaled = [torch.empty_like(t) for t in x]
        amp_C.multi_tensor_scale(65536, flag, [x, scaled], 0.25)
        out = [torch.empty_like(t) for t in x]
        amp_C.multi_tensor_axpby(65536, flag, [x, y, out], 0.5, 2.0, -1)
        total, per = amp_C.multi_tensor_l2norm(65536, flag, [x], True)
        g, p, m, v = ([t.clone() for t in y], [t.clone() for t in x], [torch.zeros_like(t) for t in x],
                      [torch.zeros_like(t) for t in x])
        amp_C.multi_tensor_adam(65536, flag, [g, p, m, v], 1e-2, 0.9, 0.999, 1e-8, 1, 1, 1, 0.1)
        return [t.cpu() for t in scaled + out + [total, per] + p + m + v + [flag]]

    for got, want in zip(run("cuda"), run("cpu")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_step_in_a_cuda_graph_capture_is_refused_and_the_forward_alone_captures():
    # amp_patch's backward and step keep host state a replay would not update: refused
    # with what works; the forward alone (inference here) captures and replays as eager
    from amp_patch.base.errors import StateError

    torch.manual_seed(0)
    model = mlp(32, 64, 8).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=True)
    model, opt = amp_patch.initialize(model, opt, "O2", verbosity=0)
    try:
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's docs capture
            for _ in range(2):
                F.mse_loss(model(x).float(), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        with pytest.raises(StateError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                F.mse_loss(model(x).float(), y).backward()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            with torch.cuda.graph(graph):
                captured = model(x)
            x.copy_(torch.randn(16, 32, device="cuda"))
            graph.replay()
            assert torch.equal(captured, model(x))
        F.mse_loss(model(x).float(), y).backward()  # and training goes on outside the graph
        opt.step()
    finally:
        amp_patch.deinitialize()
