"""O6/O7: FP8 nn.Linear layers through torchao's float8 training, on the CPU.

torch's ``_scaled_mm`` has a CPU kernel (slow, exact), so everything here runs
without a GPU at tiny shapes: which layers convert, that the forward and the
gradients equal torchao's own conversion bit for bit, training that follows
O5's loss, exact undo and resume, the report, and O7's smaller optimizer state.
Skipped, with the reason, where torchao is not installed (``pip install -e '.[fp8]'``).
"""
from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
from amp_patch import config as config_mod
from amp_patch.base.errors import ConfigError
from amp_patch.precision import fp8, lowstate
from helpers import amp

try:
    fp8.torchao()
except ConfigError as e:
    pytest.skip(f"torchao's float8 training is not importable here: {e}", allow_module_level=True)

from torchao.float8 import convert_to_float8_training  # noqa: E402
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

bf16, f32 = torch.bfloat16, torch.float32

# The first pickling of a tensor in a process caches copyreg's __slotnames__ on
# torch.Tensor; do it now so the leak check around each test does not see it.
torch.save(torch.zeros(1), io.BytesIO())


def mlp(seed=0):
    """First and last layers kept by the rule; "2" and "5" FP8 under fp8_layers="all"."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(),
                         nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 8))


def batch(i, rows=32):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 8, generator=g)


def torchao_reference(model, names, recipe):
    """``model`` as torchao converts it on its own: a BF16 copy, the ``names`` layers in FP8."""
    ref = copy.deepcopy(model).to(bf16)
    undo = fp8._InductorPatch()  # torchao's inductor patch stays out of the other tests
    try:
        convert_to_float8_training(ref, config=fp8.recipe_config(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn in names)
    finally:
        undo()
    return ref


def fp8_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


# ------------------------------------------------------------------ which layers


def _choices(model, **kw):
    return {c.name: c for c in fp8.select(model, config_mod.parse("O6", "cpu", **kw))}


def test_auto_converts_only_shapes_that_gain_and_keeps_the_first_and_last():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1040), nn.Linear(1040, 32), nn.Linear(32, 24),
                          nn.Linear(24, 32), nn.Linear(32, 16))
    auto = _choices(model)
    assert [n for n, c in auto.items() if c.fp8] == ["1"]  # N = 1040 > 1024 gains (tensorwise)
    assert "first" in auto["0"].why and "last" in auto["5"].why
    assert "too small" in auto["2"].why and "not (in_features <= 4096" in auto["2"].why
    assert "out_features 24 not a multiple of 16" in auto["3"].why and "in_features 24" in auto["4"].why
    assert [n for n, c in _choices(model, fp8_recipe="rowwise").items() if c.fp8] == []
    assert [n for n, c in _choices(model, fp8_layers="all").items() if c.fp8] == ["1", "2"]
    assert [n for n, c in _choices(model, fp8_layers=["0", "5"]).items() if c.fp8] == ["0", "5"]
    mine = _choices(model, fp8_layers=lambda m, n: m.in_features == 32 and m.out_features % 16 == 0)
    assert [n for n, c in mine.items() if c.fp8] == ["1", "5"] and mine["0"].why == "not selected by fp8_layers"


def test_the_shape_rule_is_torchaos():
    assert fp8.gain("tensorwise", 1024, 4096) is False and fp8.gain("tensorwise", 1040, 16) is True
    assert fp8.gain("tensorwise", 16, 4112) is True
    assert fp8.gain("rowwise", 4096, 4096) is True and fp8.gain("rowwise", 4096, 2048) is False
    assert fp8.gain("rowwise", 2048, 8192) is False and fp8.gain("rowwise", 8192, 1024) is False


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
        self.up = nn.Linear(32, 64)
        self.mid = nn.Linear(64, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x):
        return self.down(self.mid(self.up(self.attn(x, x, x)[0])))


def test_a_linear_subclass_and_kept_fp32_layers_stay_out_and_naming_them_is_refused():
    model = Attn()
    chosen = _choices(model, fp8_layers="all", keep_fp32=["mid"])
    assert "subclass" in chosen["attn.out_proj"].why and chosen["mid"].why == "kept in FP32 (keep_fp32)"
    assert [n for n, c in chosen.items() if c.fp8] == ["up"]  # out_proj is the first nn.Linear, down the last
    with pytest.raises(ConfigError, match="subclass of nn.Linear"):
        _choices(model, fp8_layers=["attn.out_proj"])
    with pytest.raises(ConfigError, match="keep_fp32 keeps it"):
        _choices(model, fp8_layers=["mid"], keep_fp32=["mid"])


def test_a_layer_shape_fp8_rejects_and_a_pattern_that_matches_nothing_are_refused_before_anything_changes():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"'7'.*out_features 8 not a multiple of 16"):
        amp_patch.initialize(model, opt, "O6", fp8_layers=["2", "7"], verbosity=0)
    with pytest.raises(ConfigError, match="did you mean"):
        amp_patch.initialize(model, opt, "O6", fp8_layers=["2", "51"], verbosity=0)
    assert not amp_patch.is_initialized()
    assert all(type(m) is not Float8Linear for m in model.modules()) and {p.dtype for p in model.parameters()} == {f32}


# ------------------------------------------------------------------ what a run computes


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_forward_and_gradients_equal_torchaos_own_conversion_bit_for_bit(recipe):
    model = mlp()
    ref = torchao_reference(model, {"2", "5"}, recipe)
    x, y = batch(0)
    out_ref = ref(x.to(bf16))
    F.mse_loss(out_ref.float(), y).backward()
    opt = torch.optim.AdamW(model.parameters())
    with amp(model, opt, "O6", fp8_layers="all", fp8_recipe=recipe):
        assert fp8_names(model) == ["2", "5"]
        out = model(x)
        assert out.dtype == f32 and torch.equal(out, out_ref.float())
        F.mse_loss(out, y).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == bf16 and torch.equal(p.grad, q.grad), name  # the true gradients, in BF16


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class TinyLM(nn.Module):
    """A two-block decoder: width 32, vocabulary 32, sequences of 16."""

    def __init__(self, vocab=32, d=32, blocks=2, heads=2, seq=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


#: a fixed Markov chain over 32 tokens: the best loss is its entropy rate, 1.41
CHAIN = torch.softmax(torch.randn(32, 32, generator=torch.Generator().manual_seed(1234)) * 3, 1)


def sequences(step, rows=8, seq=16):
    g = torch.Generator().manual_seed(step)
    s = [torch.randint(0, 32, (rows,), generator=g)]
    for _ in range(seq):
        s.append(torch.multinomial(CHAIN[s[-1]], 1, generator=g).squeeze(1))
    s = torch.stack(s, 1)
    return s[:, :-1], s[:, 1:]


@functools.lru_cache(maxsize=None)
def o5_losses(steps):
    return lm_losses("O5", steps)


def lm_losses(level, steps, **kw):
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    with amp(model, opt, level, **kw):
        if level != "O5":
            assert len(fp8_names(model)) == 7  # every block's four layers but the first (blocks.0.qkv); not the head
        for i in range(steps):
            x, y = sequences(i)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return sum(losses[:10]) / 10, sum(losses[-20:]) / 20


#: the mean loss of the last 20 of 200 steps may differ from O5's by this much (relative); measured: under 0.2%
LOSS_TOLERANCE = 0.02


@pytest.fixture
def one_thread():
    """Tiny ops run fastest on one thread (two threads contend on a loaded two-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("level,recipe", [("O6", "tensorwise"), ("O7", "rowwise")])
def test_training_a_small_transformer_follows_o5s_loss(level, recipe, one_thread):
    start5, end5 = o5_losses(200)
    start, end = lm_losses(level, 200, fp8_layers="all", fp8_recipe=recipe)
    assert end5 < 0.7 * start5  # 2.63 -> 1.60 (the chain's entropy rate is 1.41)
    assert start == pytest.approx(start5, rel=LOSS_TOLERANCE)
    assert end == pytest.approx(end5, rel=LOSS_TOLERANCE)


# ------------------------------------------------------------------ undo, copies, checkpoints


def test_deinitialize_restores_the_linear_modules_and_fp32_weights_exactly():
    from torch._inductor.codegen.triton import TritonOverrides

    model = mlp()
    before = list(model.modules())
    params = list(model.parameters())
    keys = {n: sorted(vars(m)) for n, m in model.named_modules()}
    seen = []
    model[2].register_forward_hook(lambda mod, a, out: seen.append(type(mod).__name__))
    codegen = {n: vars(TritonOverrides).get(n) for n in ("minimum", "maximum")}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with amp(model, opt, "O7", fp8_layers="all"):
        assert fp8_names(model) == ["2", "5"] and model[2].weight is params[2]
        for i in range(3):
            x, y = batch(i)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        masters = [m.detach().clone() for m in amp_patch.master_params(opt)]
        moments = [lowstate.unpack(opt.state[m]) for m in amp_patch.master_params(opt)]
        model.eval()
        model[5].register_forward_pre_hook(lambda mod, a: None)  # a hook added to the FP8 layer during the run
        assert seen == ["Float8Linear"] * 3
    assert list(model.modules()) == before and list(model.parameters()) == params == opt.param_groups[0]["params"]
    assert all(p.dtype == f32 and torch.equal(p, m) for p, m in zip(params, masters))
    assert all(torch.equal(opt.state[p]["exp_avg"], s["exp_avg"]) and opt.state[p]["exp_avg"].dtype == f32
               and "exp_avg_scale" not in opt.state[p] for p, s in zip(params, moments))
    assert {n: sorted(vars(m)) for n, m in model.named_modules()} == keys
    assert not model[2].training and len(model[5]._forward_pre_hooks) == 1 and len(model[2]._forward_hooks) == 1
    assert not model._forward_pre_hooks and not model._forward_hooks and not model[2]._state_dict_hooks
    assert {n: vars(TritonOverrides).get(n) for n in ("minimum", "maximum")} == codegen
    model(batch(0)[0])
    assert seen[-1] == "Linear"


def test_a_copy_of_an_fp8_model_is_a_plain_fp32_model_with_nn_linear_layers():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with amp(model, opt, "O6", fp8_layers="all"):
        x, y = batch(0)
        F.mse_loss(model(x), y).backward()
        opt.step()
        twin = copy.deepcopy(model)
        masters = list(amp_patch.master_params(opt))
        sd = model.state_dict()
    assert [type(m) for m in twin] == [type(m) for m in mlp()]
    assert all(p.dtype == f32 and torch.equal(p, m) for p, m in zip(twin.parameters(), masters))
    assert all(sd[k].dtype == f32 and torch.equal(sd[k], v) for k, v in twin.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks or m._state_dict_hooks for m in twin.modules())


def _train(model, opt, steps, start=0, device="cpu"):
    for i in range(start, start + steps):
        x, y = (t.to(device) for t in batch(i))
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("level,recipe", [("O6", "tensorwise"), ("O7", "tensorwise"), ("O7", "rowwise")])
def test_a_checkpoint_resumes_bit_for_bit(level, recipe):
    kw = dict(fp8_layers="all", fp8_recipe=recipe)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with amp(model, opt, level, **kw):
        _train(model, opt, 3)
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp_patch.state_dict()}, buf)
        _train(model, opt, 3, start=3)
        straight = [p.detach().clone() for p in amp_patch.master_params(opt)]
        state = opt.state_dict()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    moments = [s["exp_avg"] for s in ckpt["opt"]["state"].values()]
    assert moments and all(m.dtype == f32 for m in moments)  # a checkpoint holds FP32 moments at O7 too
    model2 = mlp(seed=1)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    with amp(model2, opt2, level, **kw):
        model2.load_state_dict(ckpt["model"])
        opt2.load_state_dict(ckpt["opt"])
        amp_patch.load_state_dict(ckpt["amp"])
        _train(model2, opt2, 3, start=3)
        resumed = list(amp_patch.master_params(opt2))
        state2 = opt2.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for s, s2 in zip(state["state"].values(), state2["state"].values()):
        assert all(torch.equal(s[k], s2[k]) for k in s)


def test_o7_keeps_adams_moments_in_fp8_and_bf16_in_under_half_of_o6s_memory():
    sizes = {}
    for level in ("O6", "O7"):
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with amp(model, opt, level, fp8_layers="all"):
            _train(model, opt, 2)
            sizes[level] = lowstate.state_bytes(opt)
            dtypes = {(k, v.dtype) for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")}
        if level == "O7":
            assert dtypes == {("exp_avg", torch.float8_e4m3fn), ("exp_avg_scale", f32), ("exp_avg_sq", bf16)}
    n = sum(p.numel() for p in mlp().parameters())
    assert sizes["O6"] >= 8 * n and sizes["O7"] < 0.45 * sizes["O6"]  # 3 bytes a parameter against 8, plus the counters


def test_an_fp16_overflow_skips_the_step_and_leaves_o7s_moments_as_they_were():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with amp(model, opt, "O7", half_dtype="float16", fp8_layers="all"):
        _train(model, opt, 2)
        before = [lowstate.unpack(s) for s in opt.state.values()]
        x, y = batch(2)
        opt.zero_grad()
        (F.mse_loss(model(x), y) * float("inf")).backward()
        opt.step()
        assert amp_patch.counters()["skipped"] == 1
        after = [lowstate.unpack(s) for s in opt.state.values()]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)
        _train(model, opt, 2, start=3)
        assert all(torch.isfinite(p).all() for p in amp_patch.master_params(opt))


# ------------------------------------------------------------------ report and refusals


def test_the_report_and_the_op_ledger_name_the_layers_that_ran_in_fp8():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with amp(model, opt, "O6", fp8_layers="all", collect_stats=True):
        model(batch(0)[0])
        model(batch(1)[0])
        rep = amp_patch.report()
    rows = {r["layer"]: r for r in rep.to_dict()["fp8"]}
    assert [n for n, r in rows.items() if r["runs_in"] == "float8"] == ["2", "5"]
    assert rows["2"]["calls"] == 2 and rows["2"]["recipe"] == "tensorwise" and rows["0"]["runs_in"] == "bfloat16"
    ops = rep.to_dict()["ops"]
    assert ops["2 (Float8Linear)"]["policy"] == "fp8" and ops["2 (Float8Linear)"]["dtypes"] == {"float8_e4m3fn": 2}
    text = str(rep)
    assert "FP8 layers: 2 of 4 nn.Linear layers compute in float8 (torchao, tensorwise recipe)" in text
    assert "the first nn.Linear of the model" in text and "out_features 8 not a multiple of 16" in text


def test_a_device_without_fp8_matmuls_is_refused_with_what_is_missing(monkeypatch):
    def fails(device, recipe):
        raise RuntimeError("_scaled_mm is not supported on this device")

    monkeypatch.setattr(fp8, "_probed", {})
    monkeypatch.setattr(fp8, "_try_a_layer", fails)
    model = mlp()
    with pytest.raises(ConfigError, match=r"fails on cpu.*not supported on this device.*Use O5 here"):
        amp_patch.initialize(model, torch.optim.AdamW(model.parameters()), "O6", verbosity=0)
    assert not amp_patch.is_initialized() and {p.dtype for p in model.parameters()} == {f32}
    assert "compute capability 8.0" in fp8.cuda_refusal((8, 0), "NVIDIA A100") and fp8.cuda_refusal((9, 0), "H100") == ""


def test_o7_refuses_an_optimizer_it_cannot_keep_in_fp8_and_fused_update():
    model = mlp()
    with pytest.raises(ConfigError, match="not torch.optim.Adam or AdamW. Use O6"):
        amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O7", verbosity=0)
    with pytest.raises(ConfigError, match="fused_update=True"):
        amp_patch.initialize(model, torch.optim.Adam(model.parameters()), "O7", fused_update=True, verbosity=0)
    assert not amp_patch.is_initialized()


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_on_a_gpu_o6_runs_fp8_where_it_can_and_is_refused_where_it_cannot(recipe):
    model = mlp().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    why = fp8.cuda_refusal(torch.cuda.get_device_capability(), torch.cuda.get_device_name())
    if why:
        with pytest.raises(ConfigError, match="compute capability"):
            amp_patch.initialize(model, opt, "O6", fp8_layers="all", fp8_recipe=recipe, verbosity=0)
        return
    ref = torchao_reference(model, {"2", "5"}, recipe)
    x, y = (t.cuda() for t in batch(0))
    with amp(model, opt, "O7", fp8_layers="all", fp8_recipe=recipe):
        assert fp8_names(model) == ["2", "5"]
        assert torch.equal(model(x), ref(x.to(bf16)).float())
        _train(model, opt, 3, device="cuda")
    assert all(type(m) is not Float8Linear for m in model.modules()) and {p.dtype for p in model.parameters()} == {f32}


def test_two_models_in_one_call_each_take_the_patterns_that_match_them():
    a, b = mlp(), Attn()
    opt = torch.optim.AdamW(list(a.parameters()) + list(b.parameters()))
    with amp([a, b], opt, "O6", fp8_layers=["2", "up"]):
        assert fp8_names(a) == ["2"] and fp8_names(b) == ["up"]
        b(a(batch(0)[0])[:, None].repeat(1, 2, 4))
        text = str(amp_patch.report())
    assert "model1.up" in text and "not selected by fp8_layers" in text
    assert fp8_names(a) == fp8_names(b) == []
