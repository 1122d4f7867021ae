"""torch.compile, torch.jit.trace, activation checkpointing, double backward,
DataParallel, no_grad / inference_mode evaluation and train/eval switches,
under the opt levels that patch functions (O1/O4) and those that convert the
model (O2/O3/O5).

Each test runs the same work in separate amp sessions (initialize, work,
deinitialize) on copies of one FP32 model and compares the results.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import amp_patch
from amp_patch import amp
from helpers import mlp

# FP16 on the CPU is deliberate here; amp_patch's advice to use BF16 there is
# not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")

f16, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
MODEL_LEVELS = [("O2", f16), ("O2", bf16), ("O3", f16), ("O3", bf16), ("O5", bf16)]


def _id(case):
    return f"{case[0]}-{str(case[1]).split('.')[-1]}"


def _net():
    return mlp(16, 32, 32, 4, norm=["batch", "layer"], act=[nn.ReLU, nn.GELU])


def _data(n=3, batch=8):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 16, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(n)]


def _params(model):
    """FP32 copies of the model's weights as a checkpoint holds them."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _session(level, half, model, fn, make_opt=_sgd, **kw):
    """initialize, ``fn(model, optimizer)``, always deinitialize."""
    opt = make_opt(model)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=half, **kw)
    try:
        return fn(model, opt)
    finally:
        amp_patch.deinitialize()


def _train(model, opt, data, forward=None, record=None):
    forward = forward or model
    for x, t in data:
        opt.zero_grad()
        out = forward(x)
        if record is not None:
            record.append(out.detach().float().clone())
        F.mse_loss(out.float(), t).backward()
        opt.step()


def _max_rel(a, b):
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-6)).item() for k in b)


# --------------------------------------------------------------- torch.compile


def _eager_and_compiled(level, half, base, dtypes=None):
    """Train two copies of ``base`` in a session each, one eagerly and one
    through ``torch.compile`` (aot_eager); return both runs' final weights and
    per-step outputs. ``dtypes``, if given, collects the compiled run's
    last-layer output dtypes."""
    data = _data()
    eager_out, compiled_out = [], []
    eager = _session(level, half, copy.deepcopy(base), lambda m, o: (_train(m, o, data, record=eager_out), _params(m))[1])

    def compiled(m, o):
        cm = torch.compile(m, backend="aot_eager")
        if dtypes is not None:
            m[-1].register_forward_hook(lambda mod, i, out: dtypes.append(out.dtype))
        _train(m, o, data, forward=cm, record=compiled_out)
        return _params(m)

    got = _session(level, half, copy.deepcopy(base), compiled)
    return eager, got, eager_out, compiled_out


@pytest.fixture
def dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.parametrize("case", MODEL_LEVELS, ids=_id)
def test_compiled_model_level_matches_eager(dynamo, case):
    level, half = case
    base = _net()
    eager, got, eager_out, compiled_out = _eager_and_compiled(level, half, base)
    # The hooks that cast inputs and outputs were traced into one graph.
    assert dict(dynamo["graph_break"]) == {}
    assert dynamo["stats"]["unique_graphs"] >= 1
    tol = 1e-2 if half is bf16 else 2e-3
    for a, b in zip(compiled_out, eager_out):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert _max_rel(got, eager) < tol
    assert _max_rel(got, _params(base)) > 1e-3  # it trained


@pytest.mark.parametrize("case", [("O1", f16), ("O1", bf16), ("O4", bf16)], ids=_id)
def test_compiled_function_patching_level_matches_eager_without_graph_breaks(dynamo, case):
    level, half = case
    dtypes = []
    eager, got, eager_out, compiled_out = _eager_and_compiled(level, half, _net(), dtypes)
    # The wrappers are traced through: the casts are in the graph, no break.
    assert dict(dynamo["graph_break"]) == {}
    assert set(dtypes) == {half}
    for a, b in zip(compiled_out, eager_out):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert _max_rel(got, eager) < 1e-3


def test_compiled_code_recompiles_after_deinitialize(dynamo):
    model = _net().eval()
    x = torch.randn(4, 16)
    cm = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        fp32 = model(x)
        amp_patch.initialize(model, None, "O4")
        try:
            low = cm(x)
        finally:
            amp_patch.deinitialize()
        after = cm(x)
    assert low.dtype == bf16
    # Dynamo guards on the patched functions: deinitialize brings FP32 back.
    assert after.dtype == f32 and torch.allclose(after, fp32, rtol=1e-5, atol=1e-6)


# Inductor runs in a fresh interpreter: what matters is that it is first
# imported while torch is patched (its extern kernels take torch.mm and
# torch.convolution at import), and that later sessions and plain FP32 code
# compiled after deinitialize still compute the right numbers.
INDUCTOR_SCRIPT = r"""
import copy, json, sys, traceback
import torch, torch.nn as nn, torch.nn.functional as F
import amp_patch
from torch._dynamo.utils import counters

torch.set_num_threads(1)
assert "torch._inductor.compile_fx" not in sys.modules
torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
g = torch.Generator().manual_seed(1)
data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(2)]

def train(level, half, compiled):
    m = copy.deepcopy(base)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    if level:
        amp_patch.initialize(m, opt, level, half_dtype=half)
    try:
        f = torch.compile(m) if compiled else m
        outs = []
        for x, t in data:
            opt.zero_grad()
            out = f(x)
            outs.append(out.detach().float())
            F.mse_loss(out.float(), t).backward()
            opt.step()
        return outs, [p.detach().float().clone() for p in m.parameters()], str(out.dtype)
    finally:
        amp_patch.deinitialize()

def diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))

result = {}
for name, level, half in [("O1-fp16", "O1", torch.float16), ("O2-bf16", "O2", torch.bfloat16),
                          ("fp32-after", None, None)]:
    try:
        torch._dynamo.reset()
        counters.clear()
        eo, ep, edt = train(level, half, False)
        co, cp, cdt = train(level, half, True)
        result[name] = dict(out=diff(co, eo), params=diff(cp, ep), dtypes=[edt, cdt],
                            breaks=sum(counters["graph_break"].values()))
    except Exception:
        result[name] = dict(error=traceback.format_exc())
print("RESULT" + json.dumps(result))
"""


@pytest.fixture(scope="module")
def inductor_run():
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", INDUCTOR_SCRIPT], capture_output=True, text=True,
                          timeout=540, env=env)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["O1-fp16", "O2-bf16", "fp32-after"])
def test_inductor_matches_eager_across_sessions(inductor_run, stage):
    # O1-fp16 imports inductor while patched; the stages after it prove no
    # wrapper of an ended session leaks into compiled code.
    r = inductor_run[stage]
    assert "error" not in r, r.get("error")
    tol = {"O1-fp16": 5e-3, "O2-bf16": 2e-2, "fp32-after": 1e-5}[stage]
    assert r["out"] <= tol and r["params"] <= tol, r
    assert r["dtypes"][0] == r["dtypes"][1], r
    assert r["breaks"] == 0


@pytest.mark.xfail(strict=True, reason=(
    "backend='eager' runs the graph's generated Python, which names a patched builtin by its "
    "home module (torch._C._nn.linear) and so calls the unpatched function: FP32 silently. "
    "The default (inductor) and aot_eager backends trace through the wrappers."
))
def test_eager_debug_backend_keeps_the_policy(dynamo):
    model = _net().eval()
    amp_patch.initialize(model, None, "O4")
    try:
        with torch.no_grad():
            out = torch.compile(model, backend="eager")(torch.randn(4, 16))
    finally:
        amp_patch.deinitialize()
    assert out.dtype == bf16


@pytest.mark.quick
def test_wrapper_kept_by_other_code_is_inert_after_deinitialize():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    p, t = torch.rand(4), torch.rand(4)
    amp_patch.initialize(None, None, "O1", half_dtype=f16)
    try:
        # What a module imported during the session would hold on to.
        kept_mm, kept_bce, kept_add = torch.mm, F.binary_cross_entropy, torch.Tensor.add_
        assert kept_mm(a, b).dtype == f16
        with pytest.raises(NotImplementedError):
            kept_bce(p, t)
    finally:
        amp_patch.deinitialize()
    assert kept_mm is not torch.mm
    assert kept_mm(a, b).dtype == f32 and torch.equal(kept_mm(a, b), torch.mm(a, b))
    assert torch.equal(kept_bce(p, t), F.binary_cross_entropy(p, t))
    h = torch.ones(2, dtype=f16)
    kept_add(h, torch.full((2,), 0.5))  # the original's type promotion rules, not a cast
    assert h.dtype == f16 and torch.equal(h, torch.full((2,), 1.5, dtype=f16))


@pytest.mark.parametrize("half", [f16, bf16], ids=["fp16", "bf16"])
def test_explicit_out_tensor_is_not_cast(half):
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    amp_patch.initialize(None, None, "O1", half_dtype=half)
    try:
        out32 = torch.empty(4, 4)
        torch.mm(a, b, out=out32)  # as autocast: a call with out= keeps its dtypes
        outh = torch.empty(4, 4, dtype=half)
        torch.mm(a.to(half), b.to(half), out=outh)
        cat = torch.empty(8, 4)
        torch.cat([a, b], out=cat)
        plain = torch.mm(a, b)
    finally:
        amp_patch.deinitialize()
    assert torch.equal(out32, torch.mm(a, b))
    assert torch.equal(outh, torch.mm(a.to(half), b.to(half)))
    assert torch.equal(cat, torch.cat([a, b]))
    assert plain.dtype == half


def test_disable_casts_applies_when_the_graph_is_compiled_inside_it(dynamo):
    model = _net().eval()
    x = torch.randn(4, 16)
    amp_patch.initialize(model, None, "O4")
    try:
        with torch.no_grad(), amp_patch.disable_casts():
            out = torch.compile(model, backend="aot_eager")(x)
    finally:
        amp_patch.deinitialize()
    assert out.dtype == f32


@pytest.mark.xfail(strict=True, reason=(
    "a compiled graph keeps the policy it was traced with: dynamo does not guard on "
    "disable_casts(), so a graph compiled outside the block still casts inside it"
))
def test_disable_casts_reaches_an_already_compiled_graph(dynamo):
    model = _net().eval()
    x = torch.randn(4, 16)
    amp_patch.initialize(model, None, "O4")
    try:
        cm = torch.compile(model, backend="aot_eager")
        with torch.no_grad():
            assert cm(x).dtype == bf16
            with amp_patch.disable_casts():
                out = cm(x)
    finally:
        amp_patch.deinitialize()
    assert out.dtype == f32


# --------------------------------------------------------------- torch.jit.trace


@pytest.mark.parametrize("half", [f16, bf16], ids=["fp16", "bf16"])
def test_jit_trace_of_o2_model_for_inference(half):
    model = _net()
    xs = [torch.randn(5, 16) for _ in range(3)]

    def work(m, o):
        m.eval()
        with torch.no_grad():
            traced = torch.jit.trace(m, xs[0])
            eager = [m(x) for x in xs]
            got = [traced(x) for x in xs]
        graph = str(traced.inlined_graph)
        return eager, got, graph, m[0].weight.dtype, m[1].weight.dtype

    eager, got, graph, lin_dtype, bn_dtype = _session("O2", half, model, work)
    assert (lin_dtype, bn_dtype) == (half, f32)
    for e, g in zip(eager, got):
        assert g.dtype == f32  # the output cast of the hooks is in the trace
        assert torch.equal(g, e)
    assert "aten::to" in graph or "aten::type_as" in graph


# --------------------------------------------------------------- checkpointing


class _Blocks(nn.Module):
    def __init__(self, use_checkpoint=None):
        super().__init__()
        torch.manual_seed(2)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(3)
        )
        self.head = nn.Linear(16, 4)
        self.use_checkpoint = use_checkpoint  # None, or use_reentrant True/False

    def forward(self, x):
        for b in self.blocks:
            if self.use_checkpoint is None:
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.use_checkpoint)
        return self.head(x)


@pytest.mark.parametrize("case", [("O1", f16), ("O1", bf16), ("O2", f16), ("O2", bf16)], ids=_id)
def test_activation_checkpointing_gives_the_same_training(case):
    level, half = case
    data = _data(n=3)
    # The input needs grad for the reentrant form to build a graph.
    data = [(x.requires_grad_(), t) for x, t in data]

    def run(m, o):
        _train(m, o, data)
        return _params(m)

    plain = _session(level, half, _Blocks(), run)
    for reentrant in (False, True):
        got = _session(level, half, _Blocks(use_checkpoint=reentrant), run)
        assert got.keys() == plain.keys()
        for k in plain:
            assert torch.equal(got[k], plain[k]), (reentrant, k)
    assert _max_rel(plain, _params(_Blocks())) > 1e-3


# --------------------------------------------------------------- double backward


def _plain_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _penalty_step(model, opt, data, scale_of):
    for x, t in data:
        opt.zero_grad()
        out = model(x)
        loss = F.mse_loss(out.float(), t)
        scale = scale_of()
        # The GradScaler recipe: differentiate the scaled loss, unscale the
        # gradients by hand, then build the penalty from the true gradients.
        grads = torch.autograd.grad(loss * scale, list(model.parameters()), create_graph=True)
        penalty = sum((g / scale).float().pow(2).sum() for g in grads)
        (loss + 0.1 * penalty).backward()
        opt.step()


@pytest.mark.parametrize("case", [("O1", f16), ("O1", bf16), ("O2", bf16)], ids=_id)
def test_gradient_penalty_with_autograd_grad(case):
    level, half = case
    torch.manual_seed(3)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    data = _data(n=3)
    data = [(x[:, :8], t[:, :2]) for x, t in data]
    start = _params(base)

    ref_model = copy.deepcopy(base)
    _penalty_step(ref_model, _plain_sgd(ref_model), data, lambda: 1.0)
    ref = _params(ref_model)

    def scale_of():
        s = amp.state_dict()["loss_scaler0"]["loss_scale"]
        return float(s)

    scales = []

    def run(m, o):
        scales.append(scale_of())
        _penalty_step(m, o, data, scale_of)
        return _params(m)

    got = _session(level, half, copy.deepcopy(base), run, make_opt=_plain_sgd)
    if half is f16 and level == "O1":
        assert scales[0] > 1.0  # FP16 runs scale the loss: the recipe matters
    delta_ref = {k: ref[k] - start[k] for k in ref}
    delta_got = {k: got[k] - start[k] for k in got}
    assert all(torch.isfinite(v).all() for v in got.values())
    assert _max_rel(delta_got, delta_ref) < 0.05


# --------------------------------------------------------------- DataParallel


@pytest.mark.parametrize("case", [("O1", bf16), ("O2", f16), ("O2", bf16)], ids=_id)
@pytest.mark.parametrize("order", ["initialize-then-wrap", "wrap-then-initialize"])
def test_data_parallel_on_cpu(case, order):
    level, half = case
    base = _net()
    data = _data()

    def run(m, o):
        _train(m, o, data)
        return _params(m)

    plain = _session(level, half, copy.deepcopy(base), run)

    model = copy.deepcopy(base)
    opt = _sgd(model)
    if order == "wrap-then-initialize":
        dp, opt = amp_patch.initialize(nn.DataParallel(model), opt, level, half_dtype=half)
    else:
        model, opt = amp_patch.initialize(model, opt, level, half_dtype=half)
        dp = nn.DataParallel(model)
    try:
        dp.eval()
        with torch.no_grad():
            out = dp(data[0][0])
        dp.train()
        assert out.dtype == (half if level == "O1" else f32)
        _train(dp, opt, data)
        sd = dp.state_dict()
    finally:
        amp_patch.deinitialize()
    assert all(k.startswith("module.") for k in sd)
    assert all(v.dtype == f32 for v in sd.values() if v.is_floating_point())
    got = {k[len("module."):]: v.float() for k, v in sd.items() if v.is_floating_point()}
    for k in plain:
        assert torch.equal(got[k], plain[k]), k


# --------------------------------------------------------------- eval loops and mode switches


def _eval(model, x, mode):
    was = model.training
    model.eval()
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with ctx():
        out = model(x).float().clone()
    model.train(was)
    return out


@pytest.mark.parametrize("case", [("O1", f16), ("O1", bf16), ("O2", f16), ("O2", bf16), ("O5", bf16)], ids=_id)
def test_eval_loops_and_mode_switches_do_not_change_training(case):
    level, half = case
    base = _net()
    data = _data(n=4)
    probe = torch.randn(6, 16)

    def plain(m, o):
        _train(m, o, data)
        return _params(m)

    def with_evals(m, o):
        outs = []
        bn = m[1]
        for i, (x, t) in enumerate(data):
            stats = (bn.running_mean.clone(), bn.running_var.clone())
            # The same evaluation three ways, between every two steps.
            a, b = _eval(m, probe, "no_grad"), _eval(m, probe, "inference_mode")
            m.eval()
            c = m(probe).detach().float()
            m.train()
            assert torch.equal(a, b) and torch.equal(a, c)
            assert torch.equal(bn.running_mean, stats[0]) and torch.equal(bn.running_var, stats[1])
            outs.append(a)
            _train(m, o, [(x, t)])
            assert not torch.equal(bn.running_mean, stats[0])  # train mode again: stats move
        dtypes = {n: p.dtype for n, p in m.named_parameters()}
        return _params(m), outs, dtypes

    ref = _session(level, half, copy.deepcopy(base), plain)
    got, outs, dtypes = _session(level, half, copy.deepcopy(base), with_evals)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # Each evaluation saw the weights of its step, not a stale cast.
    assert not torch.equal(outs[0], outs[-1])
    model_half = level != "O1"
    assert dtypes["0.weight"] == (half if model_half else f32)
    assert dtypes["1.weight"] == f32  # batchnorm stays FP32 at O2/O5 (and O1's model is FP32)


def test_o1_eval_under_no_grad_uses_the_current_weights():
    torch.manual_seed(4)
    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    x = torch.randn(3, 8)
    amp_patch.initialize(lin, opt, "O4")
    try:
        for mode in ("no_grad", "inference_mode", "no_grad"):
            out = _eval(lin, x, mode)
            with amp_patch.disable_casts():
                expected = F.linear(x.bfloat16(), lin.weight.bfloat16(), lin.bias.bfloat16()).float()
            assert torch.equal(out, expected), mode
            opt.zero_grad()
            lin(x).float().pow(2).mean().backward()
            opt.step()
    finally:
        amp_patch.deinitialize()
