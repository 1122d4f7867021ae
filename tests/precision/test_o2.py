"""O2/O3/O5: model conversion, hooks, FP32 master weights, and undo."""
from __future__ import annotations

import contextlib
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_patch
import helpers
from amp_patch.base.errors import ConfigError
from helpers import amp, destroy_process_group

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32

# The first pickling of a tensor in a process caches copyreg's __slotnames__ on
# torch.Tensor; do it now so the leak check around each test does not see it.
pickle.dumps(nn.Parameter(torch.zeros(1)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class Tagger(nn.Module):
    """Embedding, a transformer encoder layer, an LSTM and a classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True), 1)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.classifier = nn.Linear(8, 3)

    def forward(self, tokens):
        h = self.encoder(self.embed(tokens))
        h, _ = self.lstm(h)
        return self.classifier(h)


class WithSpare(nn.Module):
    """An MLP plus a layer the forward pass never uses (its parameters get no gradient)."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.spare = nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


def mlp(seed=0, unused=False):
    m = helpers.mlp(6, 12, 2, seed=seed, act=nn.Tanh)
    return WithSpare(m) if unused else m


def batch(i=0):
    return helpers.batch(i, 6, 2, rows=16, seed=0)


def train_steps(model, opt, steps):
    """``steps`` plain training steps, on ``batch(0)`` to ``batch(steps - 1)``."""
    for i in range(steps):
        opt.zero_grad()
        x, y = batch(i)
        F.mse_loss(model(x), y).backward()
        opt.step()


def dtypes(model):
    return {n: t.dtype for n, t in list(model.named_parameters()) + list(model.named_buffers())}


# ------------------------------------------------------------------ conversion


def test_conv_bn_net_has_half_weights_and_fp32_batchnorm():
    model = ConvBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        d = dtypes(model)
        assert d == {
            "conv.weight": bf16, "conv.bias": bf16, "bn.weight": f32, "bn.bias": f32,
            "bn.running_mean": f32, "bn.running_var": f32, "bn.num_batches_tracked": torch.int64,
            "head.weight": bf16, "head.bias": bf16,
        }
        out = model(torch.randn(2, 3, 4, 4))  # FP32 input, half conv, BN in FP32 on half input
        assert out.dtype == f32
        out.sum().backward()
        opt.step()
    assert set(dtypes(model).values()) == {f32, torch.int64}


def test_o3_casts_batchnorm_too():
    model = ConvBN()
    with amp(model, None, "O3", half_dtype=f16):
        d = dtypes(model)
        assert d["bn.weight"] == d["bn.running_var"] == f16 and d["bn.num_batches_tracked"] == torch.int64
        assert model(torch.randn(2, 3, 4, 4)).dtype == f32


def test_transformer_and_lstm_are_converted_and_run():
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with amp(model, opt, "O2"):
        assert {dt for n, dt in dtypes(model).items()} == {bf16}
        out = model(torch.randint(0, 10, (2, 5)))
        assert out.dtype == f32 and out.shape == (2, 5, 3)
        out.float().sum().backward()
        opt.step()
        assert all(p.dtype == f32 for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("keep", [["classifier", "*.norm*"], "keep_callable"])
def test_keep_fp32_filters(keep):
    model = Tagger()
    if keep == "keep_callable":
        keep = lambda module, name: name == "classifier" or isinstance(module, nn.LayerNorm)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2", keep_fp32=keep):
        d = dtypes(model)
        kept = {n for n, dt in d.items() if dt == f32}
        assert kept == {"classifier.weight", "classifier.bias"} | {
            f"encoder.layers.0.norm{i}.{w}" for i in (1, 2) for w in ("weight", "bias")
        }
        assert d["embed.weight"] == d["lstm.weight_ih_l0"] == bf16
        out = model(torch.randint(0, 10, (2, 5)))
        assert out.dtype == f32
        out.sum().backward()
        assert model.classifier.weight.grad.dtype == f32
        opt.step()
        # a kept FP32 parameter is its own master: the optimizer holds it directly
        assert any(p is model.classifier.weight for g in opt.param_groups for p in g["params"])


def test_keep_fp32_class_name_pattern():
    model = ConvBN()
    with amp(model, None, "O3", keep_fp32=["Linear"]):
        assert model.head.weight.dtype == f32 and model.conv.weight.dtype == bf16
        assert model(torch.randn(2, 3, 4, 4)).dtype == f32


def test_bad_keep_fp32_is_refused_with_a_suggestion_and_nothing_changes():
    model = Tagger()
    with pytest.raises(ConfigError, match="did you mean 'classifier'"):
        amp_patch.initialize(model, None, "O2", keep_fp32=["clasifier"], verbosity=0)
    with pytest.raises(ConfigError, match="callable"):
        amp_patch.initialize(model, None, "O2", keep_fp32=3, verbosity=0)
    with pytest.raises(ConfigError, match="O2, O3 or O5"):
        amp_patch.initialize(model, None, "O1", keep_fp32=["classifier"], verbosity=0)
    assert not amp_patch.is_initialized()
    assert set(dtypes(model).values()) == {f32}


# ------------------------------------------------------------------ hooks


@pytest.mark.quick
def test_inputs_are_cast_and_outputs_come_back_fp32_or_as_asked():
    seen = {}
    model = mlp()
    model[0].register_forward_pre_hook(lambda m, args: seen.update({"in": args[0].dtype}))
    with amp(model, None, "O2"):
        assert model(torch.randn(3, 6)).dtype == f32
        assert seen["in"] == bf16
    seen.clear()
    with amp(model, None, "O2", cast_model_outputs=bf16):
        assert model(torch.randn(3, 6, dtype=f32)).dtype == bf16


def test_kwargs_and_containers_are_cast_and_float64_is_left_alone():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, pair, *, scale, exact):
            assert pair[0].dtype == pair[1].dtype == scale.dtype == bf16 and exact.dtype == torch.float64
            return {"y": self.lin(pair[0] + pair[1]) * scale, "exact": exact}

    model = Two()
    with amp(model, None, "O2"):
        out = model((torch.randn(1, 2), torch.randn(1, 2)), scale=torch.tensor(2.0), exact=torch.zeros(1, dtype=torch.float64))
        assert out["y"].dtype == f32 and out["exact"].dtype == torch.float64


def test_no_forward_closure_deepcopy_pickle_and_dataparallel_work():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        assert "forward" not in vars(model)
        x, y = batch()
        # a copy is a plain FP32 model holding the masters' values (copies.py)
        twin = copy.deepcopy(model)
        assert twin(x).dtype == f32
        torch.testing.assert_close(twin(x), model(x), rtol=2e-2, atol=2e-2)
        back = pickle.loads(pickle.dumps(model))
        assert torch.equal(back(x), twin(x))
        dp = nn.DataParallel(model)
        F.mse_loss(dp(x), y).backward()
        opt.step()
        assert all(v.dtype == f32 for v in twin.state_dict().values())
        assert all(p.dtype == f32 for p in twin.parameters())


def test_torch_compile_runs_the_converted_model():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        compiled = torch.compile(model, backend="eager")
        x, y = batch()
        out = compiled(x)
        assert out.dtype == f32 and torch.equal(out, model(x))
        F.mse_loss(out, y).backward()
        opt.step()
    torch._dynamo.reset()


# ------------------------------------------------------------------ masters


@pytest.mark.quick
def test_masters_hold_the_exact_fp32_values_and_the_model_keeps_its_parameters():
    model = mlp()
    before = [(p, p.detach().clone()) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        masters = list(amp_patch.master_params(opt))
        assert [p for p, _ in before] == list(model.parameters())  # identity kept
        for (p, value), m in zip(before, masters):
            assert m is not p and m.dtype == f32 and torch.equal(m, value)  # not rounded
            assert p.dtype == bf16 and torch.equal(p, value.to(bf16))


def _reference_o2(model, opt_factory, steps, unused=False):
    """O2 written out by hand: half model, FP32 copies stepped by a torch optimizer."""
    half = copy.deepcopy(model).to(bf16)
    masters = [p.detach().clone() for p in model.parameters()]
    for m in masters:
        m.requires_grad_(True)
    opt = opt_factory(masters)
    for i in range(steps):
        x, y = batch(i)
        for p in half.parameters():
            p.grad = None
        F.mse_loss(half(x.to(bf16)).float(), y).backward()
        for m, p in zip(masters, half.parameters()):
            m.grad = None if p.grad is None else p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, half.parameters()):
                p.copy_(m)
    return masters


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_any_optimizer_steps_the_masters_exactly_as_by_hand(name):
    model = mlp(unused=True)
    expected = _reference_o2(model, OPTIMIZERS[name], steps=4)
    spare = model.spare.weight.detach().clone()
    opt = OPTIMIZERS[name](model.parameters())
    with amp(model, opt, "O2"):
        train_steps(model, opt, 4)
        masters = list(amp_patch.master_params(opt))
        assert all(torch.equal(a, b) for a, b in zip(masters, expected))
        # the half model is refreshed from the masters after each step
        assert all(torch.equal(p, m.to(bf16)) for p, m in zip(model.parameters(), masters))
        # a parameter that never got a gradient is untouched
        assert torch.equal(masters[-2], spare) and masters[-2].grad is None


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_model_and_master_gradients(set_to_none):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        x, y = batch()
        F.mse_loss(model(x), y).backward()
        # the backward's end moved the gradients into the FP32 masters, where the optimizer reads
        # them, and the model's .grad shows each rounded to the half dtype
        assert all(m.grad is not None and m.grad.dtype == f32 for m in amp_patch.master_params(opt))
        assert all(torch.equal(p.grad, m.grad.to(p.dtype)) for p, m in zip(model.parameters(), amp_patch.master_params(opt)))
        first = [m.grad.clone() for m in amp_patch.master_params(opt)]
        opt.step()
        F.mse_loss(model(x), y).backward()  # gradients waiting for the next step
        opt.zero_grad(set_to_none=set_to_none)
        for t in list(model.parameters()) + list(amp_patch.master_params(opt)):
            assert t.grad is None if set_to_none else (t.grad is None or not t.grad.any())
        # after a zero_grad the next backward's gradients stand alone
        F.mse_loss(model(x), y).backward()
        fresh = [m.grad.clone() for m in amp_patch.master_params(opt)]
        opt.zero_grad(set_to_none=set_to_none)
        F.mse_loss(model(x), y).backward()
        assert all(torch.equal(m.grad, g) for m, g in zip(amp_patch.master_params(opt), fresh))
        assert not all(torch.equal(a, b) for a, b in zip(first, fresh)), "the step changed the weights"


ZERO_KEEPING_OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01)),
    (torch.optim.AdamW, dict(lr=0.01)),
]


@pytest.mark.parametrize("opt_cls,kw", ZERO_KEEPING_OPTIMIZERS, ids=[c.__name__ for c, _ in ZERO_KEEPING_OPTIMIZERS])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_parameter_the_backward_does_not_reach_steps_as_in_fp32(opt_cls, kw, set_to_none):
    """zero_grad(set_to_none=False) leaves FP32 parameters zero gradients, on which
    momentum, weight decay and Adam keep moving them; their masters do the same.
    With set_to_none=True such a parameter has no gradient and stays put."""
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 4), nn.Linear(4, 4)
    both = nn.ModuleList([used, unused])
    opt = opt_cls(both.parameters(), **kw)
    with amp(both, opt, "O2", half_dtype="float16"):
        x = torch.randn(3, 4, dtype=f16)
        opt.zero_grad(set_to_none=set_to_none)
        ((used(x) + unused(x)).float().mean() * 1e-2).backward()
        opt.step()
        master = list(amp_patch.master_params(opt))[2]  # unused.weight's
        after_first = master.detach().clone()
        ref = nn.Parameter(master.detach().clone())
        ref_opt = opt_cls([ref], **kw)
        ref_opt.state[ref] = copy.deepcopy(opt.state[master])
        for _ in range(3):
            opt.zero_grad(set_to_none=set_to_none)
            (used(x).float().mean() * 1e-2).backward()
            opt.step()
            ref.grad = None if set_to_none else torch.zeros_like(ref)
            ref_opt.step()
        assert torch.equal(master, ref)
        assert torch.equal(unused.weight, ref.detach().half())
        assert torch.equal(master, after_first) == set_to_none  # moved on zeros, or stayed put


def test_a_step_after_zero_grad_keeping_zeros_steps_as_in_fp32():
    """backward, zero_grad(set_to_none=False), step: FP32 steps on zero gradients
    (here with Adam state from before initialize); so do the masters."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()  # no gradient left at initialize
    ref = nn.Parameter(model.weight.detach().clone())
    ref_opt = torch.optim.Adam([ref], lr=0.1)
    ref_opt.state[ref] = copy.deepcopy(opt.state[model.weight])
    with amp(model, opt, "O2", half_dtype="float16"):
        model(torch.randn(2, 4, dtype=f16)).float().sum().backward()
        opt.zero_grad(set_to_none=False)
        opt.step()
        ref.grad = torch.zeros_like(ref)
        ref_opt.step()
        assert torch.equal(next(amp_patch.master_params(opt)), ref)


def test_module_zero_grad_also_works_between_steps():
    a, b = mlp(), mlp()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    with amp([a, b], [oa, ob], "O2"):
        for i in range(3):
            x, y = batch(i)
            oa.zero_grad()
            b.zero_grad()  # the model's, not the optimizer's
            F.mse_loss(a(x), y).backward()
            F.mse_loss(b(x), y).backward()
            oa.step()
            ob.step()
        assert all(torch.equal(p, q) for p, q in zip(amp_patch.master_params(oa), amp_patch.master_params(ob)))


@pytest.mark.quick
def test_accumulation_happens_in_fp32_masters():
    def micro_batches(keep_each):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with amp(model, opt, "O2"):
            singles = []
            for i in range(3):
                if keep_each:
                    opt.zero_grad()
                x, y = batch(i)
                F.mse_loss(model(x), y).backward()
                singles.append([m.grad.clone() for m in amp_patch.master_params(opt)])
            return singles, [m.grad.clone() for m in amp_patch.master_params(opt)]

    alone, _ = micro_batches(keep_each=True)
    running, accumulated = micro_batches(keep_each=False)
    total = [alone[0][k] + alone[1][k] + alone[2][k] for k in range(len(alone[0]))]
    assert all(torch.equal(m, t) for m, t in zip(accumulated, total)), "summed in FP32, in order"
    # after each backward the masters hold the running sum so far
    assert all(torch.equal(a, b) for a, b in zip(running[0], alone[0]))
    assert all(torch.equal(r, a + b) for r, a, b in zip(running[1], alone[0], alone[1]))


def test_add_param_group_after_initialize_gets_masters():
    model = mlp()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with amp(model, opt, "O2"):
        opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})
        masters = opt.param_groups[1]["params"]
        assert [m.dtype for m in masters] == [f32, f32]
        assert torch.equal(masters[0], model[2].weight.float())
        before = model[2].weight.detach().clone()
        x, y = batch()
        F.mse_loss(model(x), y).backward()
        opt.step()
        assert not torch.equal(model[2].weight, before) and model[2].weight.dtype == bf16
        with pytest.raises(ValueError, match="more than one parameter group"):
            opt.add_param_group({"params": [model[2].weight]})
    assert opt.param_groups[1]["params"] == list(model[2].parameters())
    assert "add_param_group" not in vars(opt)


def test_optimizer_state_from_before_initialize_moves_to_the_masters():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = batch()
    F.mse_loss(model(x), y).backward()
    opt.step()
    avg = opt.state[model[0].weight]["exp_avg"].clone()
    with amp(model, opt, "O2"):
        master = opt.param_groups[0]["params"][0]
        assert torch.equal(opt.state[master]["exp_avg"], avg) and model[0].weight not in opt.state
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], avg)


def test_models_already_holding_half_parameters_get_fp32_masters():
    model = mlp()
    model[2].to(f16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    exact = model[2].weight.detach().float().clone()
    with amp(model, opt, "O2"):
        master = opt.param_groups[0]["params"][2]
        assert master.dtype == f32 and torch.equal(master, exact)
    assert model[2].weight.dtype == f16, "a parameter goes back to the dtype it had"


@pytest.mark.quick
def test_deinitialize_brings_fp32_master_values_back_and_training_continues():
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with amp(model, opt, "O2"):
        train_steps(model, opt, 3)
        masters = [m.detach().clone() for m in amp_patch.master_params(opt)]
        bufs = [opt.state[m]["momentum_buffer"].clone() for m in amp_patch.master_params(opt)]
    assert list(model.parameters()) == params == opt.param_groups[0]["params"]
    assert all(p.dtype == f32 and torch.equal(p, m) for p, m in zip(params, masters))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], b) for p, b in zip(params, bufs))
    assert not model._forward_pre_hooks and not model._forward_hooks
    x, y = batch(9)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


# ------------------------------------------------------------------ refusals


def test_invalid_setups_are_refused_before_anything_changes():
    model = mlp()
    stray = nn.Parameter(torch.randn(2))
    with pytest.raises(ConfigError, match="not a parameter of the model"):
        amp_patch.initialize(model, torch.optim.SGD(list(model.parameters()) + [stray], lr=0.1), "O2", verbosity=0)
    shared = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model[0].parameters(), lr=0.1)]
    with pytest.raises(ConfigError, match="one optimizer only"):
        amp_patch.initialize(model, shared, "O2", verbosity=0)
    half = mlp().half()
    with pytest.raises(ConfigError, match="FP16 master weights"):
        amp_patch.initialize(half, torch.optim.SGD(half.parameters(), lr=0.1), "O1", verbosity=0)
    with pytest.raises(ConfigError, match="master_weights"):
        amp_patch.initialize(model, None, "O1", master_weights=True, verbosity=0)
    assert not amp_patch.is_initialized()
    assert set(dtypes(model).values()) == {f32}


def test_parity_with_fp32_after_200_steps():
    def train(level):
        model = mlp(seed=3)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 6, generator=g)
        y = torch.stack([x[:, :3].sum(1), torch.tanh(x[:, 3:]).prod(1)], 1)
        ctx = amp(model, opt, level) if level else contextlib.nullcontext()
        with ctx:
            for _ in range(200):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
            return F.mse_loss(model(x).float(), y).item()

    fp32, o2 = train(None), train("O2")
    assert fp32 < 0.1
    assert o2 == pytest.approx(fp32, rel=0.15, abs=0.01)  # BF16 forward, FP32 masters


def test_distributed_data_parallel_wraps_the_converted_model(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with amp(model, opt, "O2"):
            ddp = nn.parallel.DistributedDataParallel(model)
            before = [m.detach().clone() for m in amp_patch.master_params(opt)]
            for i in range(2):
                opt.zero_grad()
                x, y = batch(i)
                F.mse_loss(ddp(x), y).backward()
                opt.step()
            assert all(not torch.equal(a, b) for a, b in zip(before, amp_patch.master_params(opt)))
            # no_sync() accumulation: the half gradients stay in the model, where DDP
            # reduces the whole sum at the last backward; the step then takes that sum
            opt.zero_grad()
            with ddp.no_sync():
                F.mse_loss(ddp(batch(5)[0]), batch(5)[1]).backward()
            F.mse_loss(ddp(batch(6)[0]), batch(6)[1]).backward()
            summed = [p.grad.float() for p in model.parameters()]
            assert all(torch.equal(m.grad, g) for m, g in zip(amp_patch.master_params(opt), summed))
        wrapped = nn.parallel.DistributedDataParallel(mlp())
        with pytest.raises(ConfigError, match="initialize on the plain model first"):
            amp_patch.initialize(wrapped, None, "O2", verbosity=0)
    finally:
        destroy_process_group()


def test_a_closure_optimizer_runs_at_o2_in_bf16():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = batch()
    with amp(model, opt, "O2"):
        start = F.mse_loss(model(x), y).item()

        def closure():
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        for _ in range(3):
            opt.step(closure)
        assert F.mse_loss(model(x), y).item() < 0.9 * start


@pytest.mark.parametrize(
    "level,kw",
    [("O2", dict(cast_model_type=torch.float16)), ("O2", dict(cast_model_type="float16")),
     ("O5", dict(half_dtype="float16")), ("O4", dict(half_dtype=torch.float16))],
    ids=["O2-cast_model_type", "O2-cast_model_type-str", "O5-fp16", "O4-fp16"],
)
def test_an_fp16_run_always_gets_the_dynamic_loss_scale(level, kw):
    """Asked for FP16 in any form (Apex's cast_model_type, or half_dtype on the BF16
    levels), the run scales the loss dynamically from 2**16, on the CPU too."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with amp(model, opt, level, **kw):
        state = amp_patch.state_dict()
        assert state["loss_scaler0"]["loss_scale"] == 2.0 ** 16 and state["amp_patch"]["half_dtype"] == "float16"
        if level != "O4":
            assert model.weight.dtype == f16
        x = torch.randn(8, 4, dtype=model.weight.dtype)
        (model(x).float().sum() * 1e-8).backward()  # underflows in FP16 without the scale
        assert next(iter(amp_patch.master_params(opt))).grad.abs().max() > 0


def test_cast_model_type_and_half_dtype_that_disagree_are_refused():
    model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"cast_model_type=torch.bfloat16 and half_dtype=torch.float16 disagree"):
        amp_patch.initialize(model, opt_level="O2", cast_model_type=torch.bfloat16, half_dtype="float16")
    assert model.weight.dtype == f32 and not amp_patch.is_initialized()


def test_an_optimizer_initialize_never_saw_is_refused_at_its_first_step_with_the_fix():
    """Built after initialize(model) (or a second one over the model), an optimizer
    would update the half weights with no masters and no loss scaling: its step
    raises, naming initialize and adopt_optimizer; nothing else is affected."""
    from torch.optim import optimizer as optim_module

    hooks = len(optim_module._global_optimizer_pre_hooks)
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)  # a model amp_patch does not manage
    with amp(model, None, "O2", half_dtype="float16"):
        late = torch.optim.SGD(model.parameters(), lr=0.1)
        (model(torch.randn(2, 4, dtype=f16)).float().sum() * 1e-3).backward()  # scaled by 2**16: stays finite
        before = model.weight.detach().clone()
        with pytest.raises(amp_patch.StateError, match=r"SGD.step\(\) would update half-precision weights of a model "
                           r"amp_patch converted at O2, .*amp_patch.adopt_optimizer\(optimizer\)"):
            late.step()
        assert torch.equal(model.weight, before)
        other(torch.randn(2, 4)).sum().backward()
        other_opt.step()  # untouched by the guard
        late = amp_patch.adopt_optimizer(late)
        late.zero_grad()
        (model(torch.randn(2, 4, dtype=f16)).float().sum() * 1e-3).backward()  # scaled by 2**16: stays finite
        late.step()
        assert amp_patch.counters()["steps"] == 1 and not torch.equal(model.weight, before)
        second = torch.optim.Adam(model.parameters())
        (model(torch.randn(2, 4, dtype=f16)).float().sum() * 1e-3).backward()  # scaled by 2**16: stays finite
        with pytest.raises(amp_patch.StateError, match="Adam.step"):
            second.step()
    assert len(optim_module._global_optimizer_pre_hooks) == hooks  # the guard leaves with the run
    model(torch.randn(2, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # FP32 again, any optimizer


class _MaxOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)

    def forward(self, x):
        y = self.lin(x)
        return torch.max(y, dim=1), y.topk(2), torch.sort(y)


@pytest.mark.parametrize("level", ["O2", "O3", "O5"])
def test_structseq_results_keep_their_fields_through_the_output_cast(level):
    model = _MaxOut()
    x = torch.randn(3, 4)
    with helpers.amp(model, None, opt_level=level):
        top, k, srt = model(x)
    assert type(top) is torch.return_types.max and type(k) is torch.return_types.topk
    assert top.values.dtype == torch.float32 and top.indices.dtype == torch.int64
    assert k.values.shape == (3, 2) and srt.indices.dtype == torch.int64
    torch.testing.assert_close(top.values, model(x)[0].values, rtol=2e-2, atol=2e-2)
