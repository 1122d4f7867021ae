"""Attention in FP32 where the half kernel is slower here (``patching.attention``).

The decision is measured per shape class; these tests fix it (``decided``)
where they need a known one, so what they assert does not depend on the
machine's speed: a chosen call equals torch's FP32 kernel on the inputs cast
up (bit for bit), sliced or not; its gradients are at least as accurate as
the half kernel's; it saves only half tensors; every call it cannot take, or
that was not chosen, is the original op bit for bit; O2/O5 default to it and
``cast_policy="parity"`` turns it off; under O4 ``cast_policy="auto"`` a
chosen call runs in FP32 and the ledger says why.
"""
from __future__ import annotations

import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.config import parse
from amp_patch.patching import attention
from helpers import Snapshot, amp

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
#: torch's own attention (kept out of the module namespace: a module-level alias of a
#: patched function is something amp_patch warns about)
TORCH = types.SimpleNamespace(sdpa=F.scaled_dot_product_attention)


@pytest.fixture
def decided(monkeypatch):
    """``decided(True)``: every shape class runs in FP32; ``decided(False)``: none does."""
    def set_to(fp32: bool):
        monkeypatch.setattr(attention, "_chosen", {})
        monkeypatch.setattr(attention, "_measure", lambda key, original: (fp32, 2.0, 1.0 if fp32 else 3.0))
    return set_to


def _qkv(b=3, h=4, lq=32, lk=32, e=16, dtype=bf16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, e, generator=g).to(dtype).requires_grad_()
    k = torch.randn(b, h, lk, e, generator=g).to(dtype).requires_grad_()
    v = torch.randn(b, h, lk, e, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(b, h, lq, e, generator=g).to(dtype)
    return q, k, v, dout


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("dtype", [bf16, f16])
@pytest.mark.parametrize("form", ["plain", "causal", "mask", "bool mask", "2-d mask", "3-d mask", "scale", "gqa"])
def test_the_fp32_kernel_on_half_inputs_equals_torchs_fp32_attention_cast_back(dtype, form, decided):
    decided(True)
    q, k, v, dout = _qkv(dtype=dtype)
    if form == "gqa":  # 4 query heads share 2 key/value heads
        k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    g = torch.Generator().manual_seed(3)
    mask = {"mask": torch.randn(3, 1, 32, 32, generator=g), "bool mask": torch.rand(3, 1, 32, 32, generator=g) > 0.3,
            "2-d mask": torch.randn(32, 32, generator=g), "3-d mask": torch.randn(4, 32, 32, generator=g)}.get(form)
    kw = {"is_causal": form == "causal", "scale": 0.3 if form == "scale" else None, "attn_mask": mask}
    if form == "gqa":
        kw["enable_gqa"] = True
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", half_dtype=dtype):
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert type(out.grad_fn).__name__ == "Fp32AttentionBackward"
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    # a 3-d mask is (heads, query, key): the FP32 kernel takes it with a leading 1, as it broadcasts
    ref_kw = dict(kw, enable_gqa=False, attn_mask=mask.unsqueeze(0) if form == "3-d mask" else mask)
    k_ref, v_ref = (t.repeat_interleave(2, dim=1) for t in (k32, v32)) if form == "gqa" else (k32, v32)
    ref = TORCH.sdpa(q32, k_ref, v_ref, **ref_kw)  # torch's FP32 kernel on the inputs cast up
    assert out.dtype == dtype
    assert torch.equal(out, ref.to(dtype))
    # gradients: closer to FP32's than the half kernel's, in the half dtype
    got = _grads(out, (q, k, v), dout)
    want = _grads(ref, (q32, k32, v32), dout.float())
    half_kw = dict(kw, attn_mask=mask.to(dtype) if form in ("mask", "2-d mask", "3-d mask") else mask)
    half = _grads(TORCH.sdpa(q, k, v, **half_kw), (q, k, v), dout)
    for a, w, h in zip(got, want, half):
        assert a.dtype == dtype
        assert (a.float() - w).norm() <= (h.float() - w).norm() * 1.05 + 1e-6


def test_slicing_the_batch_changes_no_bit(monkeypatch):
    q, k, v, dout = _qkv(b=5)
    mask = torch.randn(5, 1, 32, 32)
    results = []
    for size in (1 << 30, q[0].numel() * 2):  # one call; slices of two samples
        monkeypatch.setattr(attention, "SLICE", size)
        for m in (None, mask):
            out = attention.Fp32Attention.apply(q, k, v, m, False, None)
            results.append((out, *_grads(out, (q, k, v), dout)))
    assert len(list(attention._slices(q, mask))) == 3
    for whole, sliced in zip(results[:2], results[2:]):
        assert all(torch.equal(a, b) for a, b in zip(whole, sliced))


def test_it_saves_only_the_half_tensors_and_the_fp32_log_sum_exp():
    q, k, v, _ = _qkv()
    out = attention.Fp32Attention.apply(q, k, v, None, False, None)
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert sorted(str(t.dtype) for t in saved) == sorted(["torch.bfloat16"] * 4 + ["torch.float32"])
    lse = [t for t in saved if t.dtype == f32][0]
    assert lse.shape == q.shape[:3]  # one number per query row, as the half kernel keeps


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        return self.norm(self.mha(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_o2_runs_chosen_attention_in_fp32_and_returns_the_half_dtype(decided, level):
    decided(True)
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 16, 32)
    q, k, v, _ = _qkv()
    with amp(model, opt, level, half_dtype=bf16) as (model, opt):
        assert F.scaled_dot_product_attention is not TORCH.sdpa
        out = F.scaled_dot_product_attention(q, k, v)
        y = model(x)
        y.float().sum().backward()
        opt.step()
    assert F.scaled_dot_product_attention is TORCH.sdpa
    assert out.dtype == bf16 and type(out.grad_fn).__name__ == "Fp32AttentionBackward"
    assert torch.equal(out, TORCH.sdpa(q.float(), k.float(), v.float()).to(bf16))
    assert [r["runs_in"] for r in attention.decisions()] == [f32, f32]  # the direct call's class and the model's


def test_o2_leaves_attention_half_where_it_is_not_faster_and_under_parity(decided):
    q, k, v, _ = _qkv()
    want = TORCH.sdpa(q, k, v)
    decided(False)
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2"):
        out = F.scaled_dot_product_attention(q, k, v)
    assert type(out.grad_fn).__name__ != "Fp32AttentionBackward" and torch.equal(out, want)
    decided(True)
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", cast_policy="parity"):
        assert F.scaled_dot_product_attention is TORCH.sdpa
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O3", cast_policy="parity"):
        assert F.scaled_dot_product_attention is TORCH.sdpa


def test_o3_runs_attention_in_fp32_where_faster_as_o2_does(decided):
    """O3 keeps no masters, so nothing should make it slower than O2: its half model
    takes the same attention decision, and only that function is patched."""
    q, k, v, _ = _qkv()
    decided(True)
    model = nn.Linear(4, 4)
    before = Snapshot()
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O3"):
        assert before.changed() == ["torch.nn.functional.scaled_dot_product_attention"]
        out = F.scaled_dot_product_attention(q, k, v)
        assert type(out.grad_fn).__name__ == "Fp32AttentionBackward" and out.dtype == q.dtype
        out.float().sum().backward()
    assert before.changed() == []
    assert torch.equal(out, TORCH.sdpa(q.detach().float(), k.detach().float(), v.detach().float()).to(q.dtype))


def test_the_levels_default_cast_policies():
    assert {lv: parse(lv, "cpu").cast_policy for lv in ("O0", "O1", "O2", "O3", "O4", "O5")} == {
        "O0": "parity", "O1": "parity", "O2": "auto", "O3": "auto", "O4": "parity", "O5": "auto"}
    assert parse("O2", "cpu", cast_policy="parity").cast_policy == "parity"
    assert parse("O1", "cpu", cast_policy="auto").cast_policy == "auto"


def _refuse(*args, **kwargs):
    raise RuntimeError("this form is not supported")


@pytest.mark.parametrize("call", ["dropout", "gqa off", "uneven gqa", "no grad", "fp32", "three dims", "mixed", "mask grad",
                                  "causal and mask", "int mask", "1-d mask", "refused"])
def test_calls_it_cannot_take_run_the_original(decided, call, monkeypatch):
    decided(True)
    q, k, v, _ = _qkv()
    args, kw = (q, k, v), {}
    if call == "dropout":
        kw = {"dropout_p": 0.5}
    elif call == "gqa off":
        args = (q, k[:, :2].detach(), v[:, :2].detach())
    elif call == "uneven gqa":
        args, kw = (q, k[:, :3].detach(), v[:, :3].detach()), {"enable_gqa": True}
    elif call == "int mask":
        kw = {"attn_mask": torch.ones(32, 32, dtype=torch.int32)}
    elif call == "1-d mask":
        kw = {"attn_mask": torch.zeros(32)}
    elif call == "refused":  # a form the FP32 kernel turns down at run time: torch's call runs instead
        monkeypatch.setattr(attention, "_flash", _refuse)
    elif call == "fp32":
        args = tuple(t.detach().float().requires_grad_() for t in args)
    elif call == "three dims":
        args = tuple(t[0] for t in args)
    elif call == "mixed":
        args = (q, k.detach().float(), v)
    elif call == "mask grad":
        kw = {"attn_mask": torch.zeros(32, 32, requires_grad=True)}
    elif call == "causal and mask":
        kw = {"attn_mask": torch.zeros(32, 32), "is_causal": True}
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2"):
        if call in ("mixed", "causal and mask", "gqa off", "uneven gqa", "int mask", "1-d mask"):  # whatever the original does
            try:
                want = TORCH.sdpa(*args, **kw)
            except (RuntimeError, IndexError) as e:
                with pytest.raises(type(e), match=re.escape(str(e)[:30])):
                    F.scaled_dot_product_attention(*args, **kw)
                return
        torch.manual_seed(1)
        if call == "no grad":
            with torch.no_grad():
                out = F.scaled_dot_product_attention(*args, **kw)
        else:
            out = F.scaled_dot_product_attention(*args, **kw)
    torch.manual_seed(1)
    with torch.no_grad() if call == "no grad" else torch.enable_grad():
        want = TORCH.sdpa(*args, **kw)
    assert out.dtype == want.dtype and torch.equal(out, want)
    assert out.grad_fn is None or type(out.grad_fn).__name__ != "Fp32AttentionBackward"
    assert attention.decisions() == [] or call == "refused"  # that one was measured, then turned down


def test_o4_auto_keeps_chosen_attention_in_fp32_and_says_why(decided):
    decided(True)
    q, k, v, _ = _qkv()
    x = tuple(t.detach().float().requires_grad_() for t in (q, k, v))
    with amp(None, None, "O4", cast_policy="auto", collect_stats=True):
        on_half = F.scaled_dot_product_attention(q, k, v)
        on_fp32 = F.scaled_dot_product_attention(*x)
        text = str(amp_patch.report())
    assert on_half.dtype == f32 and torch.equal(on_half, TORCH.sdpa(q.float(), k.float(), v.float()))
    assert on_fp32.dtype == f32 and torch.equal(on_fp32, TORCH.sdpa(*x))
    assert "attention measured faster in float32 here" in text
    decided(False)
    with amp(None, None, "O4", cast_policy="auto"):
        out = F.scaled_dot_product_attention(*x)
    assert out.dtype == bf16 and torch.equal(out, TORCH.sdpa(*(t.to(bf16) for t in x)))


def test_measuring_leaves_the_random_stream_and_records_the_decision(monkeypatch):
    monkeypatch.setattr(attention, "_chosen", {})
    state = torch.get_rng_state()
    q, k, v, _ = _qkv(b=1, h=1, lq=16, lk=16, e=8)
    chosen = attention.fp32_wins(16, 16, 8, False, False, bf16, TORCH.sdpa)
    assert torch.equal(torch.get_rng_state(), state)
    [row] = attention.decisions()
    assert row["query_len"] == 16 and row["head_size"] == 8 and row["runs_in"] == (f32 if chosen else bf16)
    assert row["half_ms"] > 0 and row["fp32_ms"] > 0
    assert chosen == (row["fp32_ms"] <= attention.MARGIN * row["half_ms"])
    # one measurement per class: 20, 30 and 17 tokens fall in the class of 32
    keys = []
    monkeypatch.setattr(attention, "_measure", lambda key, original: keys.append(key) or (True, 2.0, 1.0))
    assert attention.fp32_wins(20, 30, 8, False, False, bf16, TORCH.sdpa)
    assert attention.fp32_wins(30, 17, 8, False, False, bf16, TORCH.sdpa)
    assert attention.fp32_wins(16, 16, 8, False, False, bf16, TORCH.sdpa) == chosen
    assert [k[:2] for k in keys] == [(32, 32)] and len(attention.decisions()) == 2
    # a longer sequence takes the decision measured at LONGEST tokens
    assert attention.fp32_wins(4096, 3000, 8, False, False, bf16, TORCH.sdpa)
    assert [k[:2] for k in keys] == [(32, 32), (1024, 1024)]
    assert attention.fp32_wins(1000, 700, 8, False, False, bf16, TORCH.sdpa) and len(keys) == 2


def test_a_class_the_fp32_kernel_refuses_stays_half(monkeypatch):
    monkeypatch.setattr(attention, "_chosen", {})

    def refuse(*a, **k):
        raise RuntimeError("not supported")

    monkeypatch.setattr(attention, "_flash", refuse)
    assert attention.fp32_wins(16, 16, 8, False, False, bf16, TORCH.sdpa) is False
    [row] = attention.decisions()
    assert row["runs_in"] is None


def test_a_compiled_o2_model_traces_the_half_kernel_whole(decided):
    """Under ``torch.compile`` the wrapper steps aside: no graph break, the half kernel in the graph."""
    from torch._dynamo.utils import counters

    decided(True)
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 16, 32)
    try:
        with amp(model, opt, "O2") as (model, opt):
            eager = model(x)
            compiled = torch.compile(model, backend="aot_eager")(x)
            compiled.float().sum().backward()
            opt.step()
        assert dict(counters["graph_break"]) == {}
        assert compiled.dtype == eager.dtype
        torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    finally:
        torch._dynamo.reset()


def test_a_checkpoint_carries_the_choices_so_a_resumed_run_computes_the_same(monkeypatch, decided):
    decided(True)
    q, k, v, dout = _qkv()
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2"):
        first = F.scaled_dot_product_attention(q, k, v)
        state = amp_patch.state_dict()
    assert state["amp_patch"]["attention"] == [[32, 32, 16, False, False, "bfloat16", torch.get_num_threads(), True]]
    # a new process measures the other way; the checkpoint wins
    decided(False)
    model = nn.Linear(4, 4)
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2"):
        amp_patch.load_state_dict(state)
        again = F.scaled_dot_product_attention(q, k, v)
        text = str(amp_patch.report())
    assert torch.equal(again, first) and type(again.grad_fn).__name__ == "Fp32AttentionBackward"
    assert "from the checkpoint" in text
    # a malformed choice is refused before anything changes, and names the fix
    decided(False)
    bad = {**state, "amp_patch": {**state["amp_patch"], "attention": [[32, 32, 16, False, False, "int8", 1, True]]}}
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2"):
        with pytest.raises(amp_patch.ConfigError, match="attention choice 0 .*'bfloat16' or 'float16'"):
            amp_patch.load_state_dict(bad)
    assert attention.decisions() == []
    # parity runs save no choices
    with amp(model, torch.optim.SGD(model.parameters(), lr=0.1), "O2", cast_policy="parity"):
        assert "attention" not in amp_patch.state_dict()["amp_patch"]


def test_apex_amp_initialize_at_o2_takes_the_same_default(decided):
    from amp_patch import amp as apex_amp

    decided(True)
    model = nn.Linear(4, 4)
    try:
        model, opt = apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                         verbosity=0)
        assert F.scaled_dot_product_attention is not TORCH.sdpa
        q, k, v, _ = _qkv()
        assert type(F.scaled_dot_product_attention(q, k, v).grad_fn).__name__ == "Fp32AttentionBackward"
    finally:
        amp_patch.deinitialize()
    assert F.scaled_dot_product_attention is TORCH.sdpa
