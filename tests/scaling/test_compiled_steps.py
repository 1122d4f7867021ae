"""``torch.compile`` around amp_patch: compiled steps compute what eager ones compute,
and a compiled use that cannot be honoured is refused with the way that works."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch.base.errors import StateError

BACKEND = "aot_eager"  # torch's graphs without a code generator: the same float ops as eager


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def setup(level, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    half = torch.bfloat16 if level in ("O4", "O5") else torch.float16
    return amp_patch.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0)


def batches(n=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def eager_run(level, poison=()):
    m, opt = setup(level)
    for i, (x, y) in enumerate(batches()):
        loss = F.mse_loss(m(x).float(), y)
        (loss * float("inf") if i in poison else loss).backward()
        opt.step()
        opt.zero_grad()
    out = [p.detach().clone() for p in m.parameters()], amp_patch.counters()["skipped"]
    amp_patch.deinitialize()
    return out


def same(a, b):
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_a_model_compiled_with_fullgraph_trains_as_the_eager_one(level):
    m, opt = setup(level)
    compiled = torch.compile(m, fullgraph=True, backend=BACKEND)
    for x, y in batches():
        F.mse_loss(compiled(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    got = [p.detach().clone() for p in m.parameters()]
    amp_patch.deinitialize()
    assert same(got, eager_run(level)[0])


@pytest.mark.parametrize("form", ["backward", "scale_loss"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_compiled_training_function_breaks_its_graph_where_amp_patch_runs(level, form):
    # an overflow forced at step 1: the compiled function's backward is amp_patch's,
    # so the loss is scaled and the step is skipped as in the eager loop
    m, opt = setup(level)

    def train_step(x, y, poison):
        loss = F.mse_loss(m(x).float(), y)
        if poison:
            loss = loss * float("inf")
        if form == "backward":
            loss.backward()
        else:
            with amp_patch.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        opt.zero_grad()

    compiled = torch.compile(train_step, backend=BACKEND)
    for i, (x, y) in enumerate(batches()):
        compiled(x, y, i == 1)
    got, skipped = [p.detach().clone() for p in m.parameters()], amp_patch.counters()["skipped"]
    amp_patch.deinitialize()
    want, want_skipped = eager_run(level, poison=(1,))
    assert skipped == want_skipped == 1
    assert same(got, want)


@pytest.mark.parametrize("what", ["scale_loss", "step"])
def test_fullgraph_across_amp_patch_is_refused_naming_what_works(what):
    m, opt = setup("O2")
    x, y = batches(1)[0]

    def with_scale_loss(x, y):
        with amp_patch.scale_loss(F.mse_loss(m(x).float(), y), opt) as scaled:
            scaled.backward()

    try:
        if what == "step":
            F.mse_loss(m(x).float(), y).backward()
            fn, args = torch.compile(opt.step, fullgraph=True, backend=BACKEND), ()
        else:
            fn, args = torch.compile(with_scale_loss, fullgraph=True, backend=BACKEND), (x, y)
        with pytest.raises(Exception, match="amp_patch's loss scaling and FP32 master weights run eagerly") as info:
            fn(*args)
        assert "fullgraph=True" in str(info.value)
    finally:
        amp_patch.deinitialize()


def test_a_backward_traced_by_torch_compile_is_refused_at_the_step(monkeypatch):
    # with trace_autograd_ops, dynamo runs Tensor.backward itself, never amp_patch's:
    # the gradients are unscaled and unchecked, so the step refuses them
    monkeypatch.setattr(torch._dynamo.config, "trace_autograd_ops", True)
    m, opt = setup("O2")
    x, y = batches(1)[0]

    def fwd_bwd(x, y):
        F.mse_loss(m(x).float(), y).backward()

    try:
        torch.compile(fwd_bwd, backend=BACKEND)(x, y)
        before = [p.detach().clone() for p in amp_patch.master_params(opt)]
        with pytest.raises(StateError, match=r"trace_autograd_ops=True\), which bypasses amp_patch"):
            opt.step()
        assert same(before, [p.detach() for p in amp_patch.master_params(opt)]), "nothing was stepped"
    finally:
        amp_patch.deinitialize()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_backward_or_step_inside_a_cuda_graph_capture_is_refused_before_it_changes_anything(level, monkeypatch):
    """A CUDA graph replays kernels without the host state amp_patch keeps, so the patched
    backward, ``scale_loss``'s backward, ``optimizer.step()`` and ``zero_grad()`` refuse to
    be captured, naming what works; nothing changes, and the same calls work once the
    capture is over. (The capture is simulated: the test needs no GPU; tests/test_cuda.py
    captures for real.)"""
    from amp_patch.base import eager

    m, opt = setup(level)
    x, y = batches(1)[0]
    F.mse_loss(m(x).float(), y).backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in m.parameters()]
    state = amp_patch.state_dict()
    loss = F.mse_loss(m(x).float(), y)  # the forward alone may be captured
    monkeypatch.setattr(eager, "_capturing", lambda: True)
    for call in (loss.backward, opt.step, opt.zero_grad):
        with pytest.raises(StateError, match=r"cannot be captured in a CUDA graph.*Capture the forward alone"):
            call()
    with pytest.raises(StateError, match="CUDA graph"):
        with amp_patch.scale_loss(loss, opt) as scaled:
            scaled.backward()
    assert all(p.grad is None for p in m.parameters())
    assert same([p.detach() for p in m.parameters()], before) and amp_patch.state_dict() == state
    monkeypatch.undo()
    loss = F.mse_loss(m(x).float(), y)
    loss.backward()
    opt.step()
    assert not same([p.detach() for p in m.parameters()], before)
    amp_patch.deinitialize()
