"""O2/O5 (and O1's loss scaling) on models sharded by FSDP2's ``fully_shard``:
gloo, two CPU processes (four for two scenarios; one, for a resume into another world size).

The workers (this file run as a script) train each scenario and save what they
end with; the tests compare it with the same training run unsharded, in one
process, by amp_patch (``_reference``): each step runs one backward per rank's
batch, adds the gradients (in the FP32 masters) and halves them, which is
what FSDP's reduce-scatter of FP32 gradients computes (``ReduceOp.AVG`` over
two ranks: ``(a + b) / 2``, one rounding, the same for either order; the loss
scale is a power of two, so unscaling before or after the sum changes no
bit). So the gathered FP32 weights must equal the reference's bit for bit.
The forward is the same arithmetic: FSDP gathers each FP32 shard rounded to
the half dtype, which is what the unsharded O2 model holds, and amp_patch's
hooks cast the same tensors as there.

Scenarios:
  * O2 FP16 with dynamic loss scaling and an overflow on rank 1 only, on a
    model whose blocks hold BatchNorm (kept FP32: its parameters leave the
    block's half parameter group for an FP32 one), one parameter with a
    single row (rank 1's shard is empty) and one with three;
  * O5 (BF16) on a LayerNorm transformer with a floating buffer;
  * O2 FP16 with ``keep_fp32`` head and final norm, through ``scale_loss``;
  * O1 FP16: a plain ``loss.backward()`` is scaled (the backward reaches
    FSDP's unsharded parameters) and matches the unsharded run;
  * gradient accumulation under ``set_requires_gradient_sync(False)`` (each
    rank sums its micro-batches first: equal to FP32 rounding);
  * the first two again on four ranks (gloo's order of the four-way sum:
    equal to FP32 rounding), each rank holding a quarter of the masters;
  * an inf that lands in rank 1's shard only: rank 0 skips the step too;
  * a ``reduce_dtype`` given to ``fully_shard`` kept; ``initialize`` after an
    FP32 step; ``deinitialize`` gives FSDP its groups back; ``clip_grad_norm_``;
  * checkpoints: ``amp_patch.state_dict()`` with FSDP's full state dict, and
    a ``torch.distributed.checkpoint`` save, resumed in fresh processes (the
    DCP one also by one process), continue bit for bit;
  * what is refused, with a message that names the fix.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import Snapshot, case_results, run_workers, serve_cases

WORLD = 2
STEPS = 5
BAD_STEP = 2  # the step (0-based) at which rank 1's batch holds an inf
SAVE_AT = 2  # checkpoint after this many steps
CKPT_BAD = 3  # the overflow of the checkpoint scenario comes after the save
# FP16 runs: a small first scale that grows every 2 clean steps, so the resumed
# scaler's counters matter
SCALING = dict(init_scale=2.0 ** 12, growth_interval=2)

# ============================================================ models and data (both sides)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


class BNNet(nn.Module):
    """Blocks with a BatchNorm each; the root holds the input layer, a head with
    three rows (uneven shards) and a one-row score (rank 1's shard is empty)."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 3)
        self.score = nn.Linear(d, 1)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return torch.cat([self.head(x), self.score(x)], dim=-1)


class Tiny(nn.Module):
    """A LayerNorm transformer: input layer, two encoder layers, final norm, head."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
                                     for _ in range(2)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 4)
        self.register_buffer("pos", torch.randn(6, d) * 0.1)  # a floating buffer: cast to half as unsharded

    def forward(self, x):
        h = self.inp(x) + self.pos
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class Probe(nn.Module):
    """The head's input is detached, so an inf in its output's gradient stays in the head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x).detach())


MODELS = {"bn": BNNet, "tiny": Tiny, "probe": Probe}


def build(kind, seed=0):
    torch.manual_seed(seed)
    return MODELS[kind]()


def units(model):
    """The modules each scenario shards by itself, before the root."""
    if isinstance(model, BNNet):
        return list(model.blocks)
    if isinstance(model, Tiny):
        return list(model.layers)
    return [model.body]


def data(kind, rank, step, bad=None, micro=0):
    """Rank ``rank``'s batch at ``step`` (micro-batch ``micro``); ``bad`` (a step): an inf
    in rank 1's input there (its first micro-batch)."""
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    if kind == "tiny":
        x, t = torch.randn(4, 6, 16, generator=g), torch.randn(4, 6, 4, generator=g)
    else:
        x, t = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    if bad is not None and step == bad and rank == 1 and micro == 0:
        x = x.clone()
        x.view(-1)[0] = float("inf")
    return x, t


def optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_of(out, t):
    return F.mse_loss(out.float(), t)


SCENARIOS = {
    # name: (model, level, half dtype, optimizer, initialize's options, overflow step, scale_loss, micro-batches)
    "o2-fp16-bn": ("bn", "O2", "float16", "adamw", SCALING, BAD_STEP, False, 1),
    # at the default verbosity: initialize's own checks and messages run on the sharded model too
    "o5-bf16-tiny": ("tiny", "O5", "bfloat16", "adamw", dict(cast_policy="parity", verbosity=1), None, False, 1),
    "o2-fp16-keep": ("tiny", "O2", "float16", "sgd", dict(SCALING, cast_policy="parity", keep_fp32=["head", "norm"]),
                     BAD_STEP, True, 1),
    "o1-fp16-bn": ("bn", "O1", "float16", "adamw", SCALING, BAD_STEP, False, 1),
    # two micro-batches per step, the first under set_requires_gradient_sync(False)
    "o2-fp16-accum": ("bn", "O2", "float16", "adamw", SCALING, BAD_STEP, False, 2),
}

# ============================================================ the worker side


def _full(model, params_only=True):
    names = {n for n, _ in model.named_parameters()}
    out = {}
    for k, v in model.state_dict().items():
        if params_only and k not in names:
            continue
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _shard(model, **kw):
    from torch.distributed.fsdp import fully_shard

    for u in units(model):
        fully_shard(u, **kw)
    fully_shard(model, **kw)
    return model


def _policies(model):
    """Each unit's parameter groups: (param dtype, reduce dtype, parameter names)."""
    from amp_patch.precision import fsdp

    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for st in fsdp.states(model):
        for g in fsdp.groups(st):
            out.append((str(g.mp_policy.param_dtype), str(g.mp_policy.reduce_dtype),
                        sorted(names.get(id(fp.sharded_param), "?") for fp in g.fsdp_params)))
    return out


def _scenario(rank, name):
    import amp_patch
    from amp_patch.precision import fsdp

    kind, level, half, opt_kind, options, bad, use_scale_loss, micro = SCENARIOS[name]
    model = _shard(build(kind))
    opt = optimizer(model, opt_kind)
    before = _policies(model)
    model, opt = amp_patch.initialize(model, opt, level, half_dtype=getattr(torch, half), **{"verbosity": 0, **options})
    try:
        during = _policies(model)
        seen = {}  # module name -> (its output's dtype, its weight's dtype in the forward), first forward

        def note(m, inputs, out, name):
            seen.setdefault(name, (str(out.dtype), str(m.weight.dtype)))

        for n, m in model.named_modules():
            if n.endswith(("lin", "bn", "head", "linear1", "norm1")) or n == "norm":
                m.register_forward_hook(lambda m, i, o, n=n: note(m, i, o, n))
        states, scales, skipped, out_grads, true_grads = [], [], [], [], []
        for step in range(STEPS):
            opt.zero_grad()
            for k in range(micro):
                # gradient accumulation: FSDP reduces only at the last micro-batch
                model.set_requires_gradient_sync(k == micro - 1)
                x, t = data(kind, rank, step, bad, k)
                out = model(x)
                out_dtype = str(out.dtype)
                out.register_hook(lambda g: out_grads.append(g.detach().float().abs().max().item()))
                loss = loss_of(out, t)
                # the true gradient of the loss with respect to the output
                true_grads.append((2 * (out.detach().float() - t) / t.numel()).abs().max().item())
                if use_scale_loss:
                    with amp_patch.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
            opt.step()
            states.append(_full(model))
            c = amp_patch.counters()
            scales.append(c["loss_scale"][0])
            skipped.append(c["skipped"])
        mine, whole = fsdp.shard_bytes(amp_patch.master_params(opt))
        state_mine, state_whole = fsdp.shard_bytes(t for s in opt.state.values() for t in s.values()
                                                   if isinstance(t, torch.Tensor) and t.dim() > 0)
        return dict(states=states, scales=scales, skipped=skipped, seen=seen, out_dtype=out_dtype, out_grads=out_grads,
                    true_grads=true_grads, before=before, during=during, master_bytes=(mine, whole),
                    state_bytes=(state_mine, state_whole),
                    param_types=sorted({type(p).__name__ for p in amp_patch.master_params(opt)}),
                    one_pass=c["optimizers"][0]["one_pass"], one_pass_built=amp_patch.precision.onepass.native is not None,
                    sqrt_mode=amp_patch.precision.onepass.sqrt_mode())
    finally:
        amp_patch.deinitialize()


def _deinit_case(rank):
    """initialize after FSDP ran (its lazy init done, its gathered parameters FP32) sets
    the policies all the same; deinitialize gives the units their groups and policies
    back, and training goes on in FP32."""
    import amp_patch

    model = _shard(build("bn"))
    opt = optimizer(model, "adamw")
    x, t = data("bn", rank, 0)
    loss_of(model(x), t).backward()  # an FP32 step first
    opt.step()
    opt.zero_grad()
    before = _policies(model)
    model, opt = amp_patch.initialize(model, opt, "O2", half_dtype=torch.float16, verbosity=0)
    seen = []
    hooks = [m.register_forward_hook(lambda m, i, o: seen.append((str(o.dtype), str(m.weight.dtype))))
             for m in (model.blocks[0].lin, model.blocks[0].bn)]
    loss_of(model(x), t).backward()
    for h in hooks:
        h.remove()
    # clipping the model's parameters clips the true FP32 gradient shards, with the global norm
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()
    full_norm = torch.sqrt(sum(p.grad.full_tensor().double().pow(2).sum() for p in model.parameters())).item()
    opt.step()
    during = _policies(model)
    amp_patch.deinitialize()
    after = _policies(model)
    dtypes = []
    h = model.blocks[0].lin.register_forward_hook(lambda m, i, o: dtypes.append((str(o.dtype), str(m.weight.dtype))))
    opt.zero_grad()
    out = model(x)
    loss_of(out, t).backward()
    opt.step()
    h.remove()
    return dict(before=before, during=during, after=after, dtypes=dtypes, out_dtype=str(out.dtype), norm=norm, seen=seen,
                full_norm=full_norm,
                finite=all(torch.isfinite(v).all().item() for v in _full(model).values()))


def _reduce_case(rank):
    """A reduce_dtype given to fully_shard is kept for the half groups; kept modules reduce in FP32."""
    import amp_patch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = _shard(build("bn"), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16))
    opt = optimizer(model, "adamw")
    model, opt = amp_patch.initialize(model, opt, "O5", verbosity=0)
    try:
        x, t = data("bn", rank, 0)
        loss_of(model(x), t).backward()
        grads = sorted({str(p.grad.dtype) for p in model.parameters()})
        opt.step()
        return dict(during=_policies(model), grads=grads, finite=all(torch.isfinite(v).all().item() for v in _full(model).values()))
    finally:
        amp_patch.deinitialize()


def _shard_inf_case(rank):
    """rank 1's target holds an inf in the head's last output: the inf reaches only the
    head's rows that rank 1 holds; rank 0 finds nothing in its own shards and skips too."""
    import amp_patch

    model = _shard(build("probe"))
    opt = optimizer(model, "sgd")
    model, opt = amp_patch.initialize(model, opt, "O2", half_dtype=torch.float16, verbosity=0)
    try:
        states, skipped, scales, local_bad = [_full(model)], [], [], []
        for step in range(3):
            opt.zero_grad()
            x, t = data("probe", rank, step)
            if step == 1 and rank == 1:
                t = t.clone()
                t[:, 3] = float("inf")
            loss_of(model(x), t).backward()
            local_bad.append(any(not torch.isfinite(p.grad.to_local()).all().item()
                                 for p in model.parameters() if p.grad is not None))
            opt.step()
            states.append(_full(model))
            c = amp_patch.counters()
            skipped.append(c["skipped"])
            scales.append(c["loss_scale"][0])
        return dict(states=states, skipped=skipped, scales=scales, local_bad=local_bad)
    finally:
        amp_patch.deinitialize()


def _save_case(rank, out_dir):
    """Train SAVE_AT steps, save (FSDP's full state dict and a DCP checkpoint), train on."""
    import amp_patch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    model = _shard(build("bn"))
    opt = optimizer(model, "adamw")
    model, opt = amp_patch.initialize(model, opt, "O2", half_dtype=torch.float16, verbosity=0, **SCALING)
    try:
        for step in range(SAVE_AT):
            _step(model, opt, "bn", rank, step, CKPT_BAD)
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd = get_model_state_dict(model, options=full)
        osd = get_optimizer_state_dict(model, opt, options=full)
        amp_state = amp_patch.state_dict()
        if rank == 0:
            torch.save(dict(model=msd, optimizer=osd, amp=amp_state), os.path.join(out_dir, "full.pt"))
        dcp.save(dict(model=get_model_state_dict(model), optimizer=get_optimizer_state_dict(model, opt)),
                 checkpoint_id=os.path.join(out_dir, "dcp"))
        torch.save(amp_state, os.path.join(out_dir, f"amp{rank}.pt"))
        at_save = _full(model)
        for step in range(SAVE_AT, STEPS):
            _step(model, opt, "bn", rank, step, CKPT_BAD)
        return dict(at_save=at_save, final=_full(model), counters=amp_patch.counters(), amp=amp_state)
    finally:
        amp_patch.deinitialize()


def _step(model, opt, kind, rank, step, bad, micro=None):
    """One training step; ``micro``: this one process runs every rank's batch in turn
    (the gradients summed, then halved, as the two ranks' reduce-scatter averages them)."""
    opt.zero_grad()
    for r in ([rank] if micro is None else range(micro)):
        x, t = data(kind, r, step, bad)
        loss_of(model(x), t).backward()
    if micro is not None:
        import amp_patch

        for p in amp_patch.master_params(opt):
            if p.grad is not None:
                p.grad.div_(micro)
    opt.step()


def _load_case(rank, out_dir, how, world):
    """A fresh process group resumes from the checkpoint and trains to STEPS."""
    import amp_patch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    model = _shard(build("bn", seed=7))  # other initial weights: the load must replace them all
    opt = optimizer(model, "adamw")
    model, opt = amp_patch.initialize(model, opt, "O2", half_dtype=torch.float16, verbosity=0, **SCALING)
    try:
        if how == "full":
            ckpt = torch.load(os.path.join(out_dir, "full.pt"), weights_only=False)
            full = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, ckpt["model"], options=full)
            set_optimizer_state_dict(model, opt, ckpt["optimizer"], options=full)
            amp_patch.load_state_dict(ckpt["amp"])
        else:
            state = dict(model=get_model_state_dict(model), optimizer=get_optimizer_state_dict(model, opt))
            dcp.load(state, checkpoint_id=os.path.join(out_dir, "dcp"))
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optimizer"])
            amp_patch.load_state_dict(torch.load(os.path.join(out_dir, f"amp{rank % 2}.pt"), weights_only=False))
        at_load = _full(model)
        for step in range(SAVE_AT, STEPS):
            _step(model, opt, "bn", rank, step, CKPT_BAD, micro=None if world == WORLD else WORLD)
        return dict(at_load=at_load, final=_full(model), counters=amp_patch.counters())
    finally:
        amp_patch.deinitialize()


def _refused_case(rank, kind):
    """What initialize refuses on a sharded model, with torch and the model left as they were."""
    import amp_patch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    options, level = {}, "O2"
    model = build("bn")
    if kind == "unsharded-root":
        for u in units(model):
            fully_shard(u)
    elif kind == "half-shards":
        _shard(model.half())
    elif kind == "other-policy":
        _shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    else:
        _shard(model)
    opt_model = model
    if kind == "stale-optimizer":
        opt_model = build("bn")  # the optimizer was built over the model before fully_shard
    opt = optimizer(opt_model, "adamw")
    if kind == "O3":
        level = "O3"
    if kind == "fused":
        options["fused_update"] = True
    before = Snapshot()
    policies = _policies(model)
    try:
        amp_patch.initialize(model, opt, level, half_dtype=torch.float16, verbosity=0, **options)
    except Exception as e:
        error = (type(e).__name__, str(e))
    else:
        amp_patch.deinitialize()
        error = None
    return dict(error=error, changed=before.changed(), initialized=amp_patch.is_initialized(),
                same_policies=_policies(model) == policies)


def _late_shard_case(rank):
    """initialize at O2 first, fully_shard after: the first forward says which order works."""
    import amp_patch

    model = build("bn")
    opt = optimizer(model, "adamw")
    model, opt = amp_patch.initialize(model, opt, "O2", half_dtype=torch.float16, verbosity=0)
    try:
        _shard(model)
        x, t = data("bn", rank, 0)
        try:
            model(x)
        except Exception as e:
            return dict(error=(type(e).__name__, str(e)))
        return dict(error=None)
    finally:
        amp_patch.deinitialize()


def _worker(rank, port, out_dir, phase):
    world = {"resume1": 1, "train4": 4}.get(phase, WORLD)
    if phase == "train4":
        cases = [(name, lambda name=name: _scenario(rank, name)) for name in FOUR]
    elif phase == "train":
        cases = [(name, lambda name=name: _scenario(rank, name)) for name in SCENARIOS]
        cases += [("shard-inf", lambda: _shard_inf_case(rank)), ("deinit", lambda: _deinit_case(rank)),
                  ("reduce", lambda: _reduce_case(rank)),
                  ("save", lambda: _save_case(rank, out_dir))]
        cases += [(f"refused-{k}", lambda k=k: _refused_case(rank, k)) for k in REFUSED]
        cases += [("late-shard", lambda: _late_shard_case(rank))]
    elif phase == "resume":
        cases = [(f"load-{how}", lambda how=how: _load_case(rank, out_dir, how, world)) for how in ("full", "dcp")]
    else:
        cases = [("load-dcp-world1", lambda: _load_case(rank, out_dir, "dcp", world))]
    serve_cases(rank, port, out_dir, world, cases, timeout=120)


FOUR = ["o2-fp16-bn", "o5-bf16-tiny"]  # the scenarios also run on four ranks
REFUSED = ["O3", "fused", "unsharded-root", "half-shards", "other-policy", "stale-optimizer"]

# ============================================================ the test side

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def ranks(run_dir):
    """Train every scenario once in two processes; ``[rank0_results, rank1_results]``."""
    return run_workers(__file__, WORLD, run_dir, timeout=480, PYTHONWARNINGS="ignore", AMP_FSDP_PHASE="train")


@pytest.fixture(scope="module")
def four_ranks(run_dir):
    out = run_dir / "four"
    out.mkdir()
    return run_workers(__file__, 4, out, timeout=480, PYTHONWARNINGS="ignore", AMP_FSDP_PHASE="train4")


@pytest.fixture(scope="module")
def resumed(ranks, run_dir):
    out = run_dir / "resume"
    out.mkdir()
    _link(run_dir, out)
    return run_workers(__file__, WORLD, out, timeout=300, PYTHONWARNINGS="ignore", AMP_FSDP_PHASE="resume")


@pytest.fixture(scope="module")
def resumed_alone(ranks, run_dir):
    out = run_dir / "resume1"
    out.mkdir()
    _link(run_dir, out)
    return run_workers(__file__, 1, out, timeout=300, PYTHONWARNINGS="ignore", AMP_FSDP_PHASE="resume1")


def _link(src, dst):
    for name in ["full.pt", "dcp", "amp0.pt", "amp1.pt"]:
        os.symlink(src / name, dst / name)


def _reference(name, steps=STEPS, world=WORLD):
    """The scenario trained unsharded by amp_patch in this process (one thread, as the
    workers): per step one backward per rank's batch, the gradients averaged."""
    import amp_patch

    kind, level, half, opt_kind, options, bad, use_scale_loss, micro = SCENARIOS[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(kind)
        opt = optimizer(model, opt_kind)
        model, opt = amp_patch.initialize(model, opt, level, half_dtype=getattr(torch, half), **{**options, "verbosity": 0})
        try:
            states, scales, skipped = [], [], []
            for step in range(steps):
                opt.zero_grad()
                for r, k in [(r, k) for r in range(world) for k in range(micro)]:
                    x, t = data(kind, r, step, bad, k)
                    loss = loss_of(model(x), t)
                    if use_scale_loss:
                        with amp_patch.scale_loss(loss, opt) as scaled:
                            scaled.backward()
                    else:
                        loss.backward()
                for p in amp_patch.master_params(opt):
                    if p.grad is not None:
                        p.grad.div_(world)
                opt.step()
                states.append({k: v.detach().clone() for k, v in model.state_dict().items()
                               if k in dict(model.named_parameters())})
                c = amp_patch.counters()
                scales.append(c["loss_scale"][0])
                skipped.append(c["skipped"])
            return dict(states=states, scales=scales, skipped=skipped)
        finally:
            amp_patch.deinitialize()
    finally:
        torch.set_num_threads(threads)


def _assert_equal(got, want, what, tol=None):
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float32, f"{what}: {k}"
        diff = (got[k] - want[k]).abs().max().item()
        if tol is None:
            assert torch.equal(got[k], want[k]), f"{what}: {k} differs (max abs difference {diff:g})"
        else:
            torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m: f"{what}: {k}: {m}")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharded_training_equals_the_unsharded_run_in_one_process(ranks, name):
    """Bit for bit with one micro-batch per step. With two, each rank sums its own
    two first (in FSDP's FP32 accumulation buffer) and the reduce-scatter then adds
    the ranks' sums, where the reference adds the four gradients in turn: the same
    terms, associated differently, so the weights agree to FP32 rounding only."""
    r0, r1 = case_results(ranks, name)
    ref = _reference(name)
    tol = None if SCENARIOS[name][7] == 1 else dict(rtol=1e-5, atol=1e-7)  # measured: 6e-8 at most
    for rank, r in enumerate((r0, r1)):
        for step in range(STEPS):
            _assert_equal(r["states"][step], ref["states"][step], f"rank {rank} after step {step}", tol)
        assert r["scales"] == ref["scales"] and r["skipped"] == ref["skipped"]
    bad = SCENARIOS[name][5]
    if bad is not None:
        # the overflow on rank 1 skipped that step on both ranks, and the scale backed off
        assert r0["skipped"][bad] == r0["skipped"][bad - 1] + 1
        _assert_equal(r0["states"][bad], r0["states"][bad - 1], "the skipped step")
        assert r0["scales"][bad] == r0["scales"][bad - 1] / 2
    assert r0["states"][-1].keys() == r1["states"][-1].keys()


@pytest.mark.parametrize("name", FOUR)
def test_four_ranks_equal_the_unsharded_run_and_hold_a_quarter_each(four_ranks, name):
    """On four ranks gloo's reduce-scatter adds four gradients in an order of its own
    (the reference adds them in turn), so the weights agree to FP32 rounding: a few
    ulps of the update after five steps. Skips, scales and shards are exact."""
    results = case_results(four_ranks, name)
    ref = _reference(name, world=4)
    for rank, r in enumerate(results):
        for step in range(STEPS):
            _assert_equal(r["states"][step], ref["states"][step], f"rank {rank} after step {step}",
                          dict(rtol=1e-5, atol=1e-7))  # measured: 6e-8 at most
        assert r["scales"] == ref["scales"] and r["skipped"] == ref["skipped"]
        mine, whole = r["master_bytes"]
        assert 0.2 * whole <= mine <= 0.3 * whole
    assert sum(r["master_bytes"][0] for r in results) == results[0]["master_bytes"][1]
    for r in results[1:]:
        _assert_equal(r["states"][-1], results[0]["states"][-1], "ranks")


@pytest.mark.parametrize("name", [n for n in SCENARIOS if SCENARIOS[n][1] != "O1"])
def test_o2_gives_fsdp_the_policy_tree_and_computes_in_half(ranks, name):
    kind, level, half, _, options, _, _, _ = SCENARIOS[name]
    r = case_results(ranks, name)[0]
    assert all(p[0] == "None" for p in r["before"])  # fully_shard's default policy: FP32 throughout
    kept = set(options.get("keep_fp32", ())) | ({"bn"} if kind == "bn" else set())
    for param_dtype, reduce_dtype, names in r["during"]:
        assert reduce_dtype == "torch.float32"
        leaf = {n.split(".")[-2] for n in names}
        if param_dtype == "None":  # an FP32 group holds exactly the kept modules' parameters
            assert leaf <= kept, names
        else:
            assert param_dtype == f"torch.{half}" and not leaf & kept, names
    # a unit holding kept and half modules became two groups; the others stayed one
    assert len(r["during"]) == len(r["before"]) + (2 if kind == "bn" else 1 if kept else 0)
    # the half layers compute in half from half weights; the kept ones in FP32 with half outputs
    for n, (out, weight) in r["seen"].items():
        leaf = n.split(".")[-1]
        if leaf in kept:
            assert (out, weight) == (f"torch.{half}", "torch.float32"), n
        else:
            assert (out, weight) == (f"torch.{half}",) * 2, n
    assert r["out_dtype"] == "torch.float32"  # the outermost module's outputs, as O2 promises
    assert r["param_types"] == ["DTensor"]  # the optimizer steps FSDP's sharded FP32 parameters


def test_a_reduce_dtype_given_to_fully_shard_is_kept_for_the_half_groups(ranks):
    for r in case_results(ranks, "reduce"):
        for param_dtype, reduce_dtype, names in r["during"]:
            if param_dtype == "None":
                assert reduce_dtype == "torch.float32" and all(".bn." in n for n in names)
            else:
                assert (param_dtype, reduce_dtype) == ("torch.bfloat16", "torch.bfloat16")
        assert r["grads"] == ["torch.float32"] and r["finite"]  # the shards' gradients are FP32 whatever the reduction


def test_each_rank_holds_about_half_of_the_fp32_masters(ranks):
    for name in ("o2-fp16-bn", "o5-bf16-tiny"):
        r0, r1 = case_results(ranks, name)
        for r in (r0, r1):
            mine, whole = r["master_bytes"]
            # one rank's shards: half of every parameter's rows, rounded up (uneven shards)
            assert 0.4 * whole <= mine <= 0.6 * whole, (name, mine, whole)
            smine, swhole = r["state_bytes"]  # AdamW's moments are sharded the same way
            assert swhole == 2 * whole and 0.4 * swhole <= smine <= 0.6 * swhole
        assert r0["master_bytes"][0] + r1["master_bytes"][0] == r0["master_bytes"][1]


def test_the_one_pass_step_runs_on_the_local_shards(ranks):
    for name in SCENARIOS:
        r = case_results(ranks, name)[0]
        level, bad = SCENARIOS[name][1], SCENARIOS[name][5]
        taken = STEPS - (bad is not None)
        if not r["one_pass_built"] or (level == "O1" and r["sqrt_mode"] == "approximate"):
            assert r["one_pass"] == 0
        else:
            assert r["one_pass"] == taken, name


def test_o1_plain_backward_is_scaled_under_fully_shard(ranks):
    """In a plain ``loss.backward()`` the output's gradient is the loss scale times the
    true one: the backward reaches FSDP's unsharded parameters, which amp_patch counts
    as the optimizer's, so the loss is scaled (and the step checked, above)."""
    for r in case_results(ranks, "o1-fp16-bn"):
        scales = [SCALING["init_scale"]] + r["scales"][:-1]  # the scale each backward ran with
        for step, (got, true, scale) in enumerate(zip(r["out_grads"], r["true_grads"], scales)):
            if step == BAD_STEP:
                continue  # rank 1's inf: the skipped step
            assert got == pytest.approx(scale * true, rel=2e-3), step


def test_an_inf_in_one_ranks_shard_only_skips_the_step_on_every_rank(ranks):
    r0, r1 = case_results(ranks, "shard-inf")
    assert r0["local_bad"] == [False, False, False]  # rank 0's own shards never held the inf
    assert r1["local_bad"] == [False, True, False]
    for r in (r0, r1):
        assert r["skipped"] == [0, 1, 1]
        _assert_equal(r["states"][2], r["states"][1], "the skipped step")
        assert r["scales"][1] == r["scales"][0] / 2
    assert r0["scales"] == r1["scales"]


def test_initialize_after_a_step_and_deinitialize_set_and_give_back_fsdps_groups(ranks):
    for r in case_results(ranks, "deinit"):
        assert r["after"] == r["before"] and r["during"] != r["before"]
        # set after FSDP's lazy init: its gathered parameters were rebuilt in the new dtypes
        assert r["seen"] == [("torch.float16", "torch.float16"), ("torch.float16", "torch.float32")]
        assert r["dtypes"] == [("torch.float32", "torch.float32")] and r["out_dtype"] == "torch.float32"
        assert r["finite"]
        # the gradients clip_grad_norm_ saw were the true ones (not scaled by 2**16), and it took the global norm
        assert 0 < r["norm"] < 100 and r["norm"] == pytest.approx(r["full_norm"], rel=1e-5)


def test_resume_from_fsdp_full_state_dict_continues_bit_for_bit(ranks, resumed):
    saved = case_results(ranks, "save")
    for rank, r in enumerate(case_results(resumed, "load-full")):
        _assert_equal(r["at_load"], saved[rank]["at_save"], f"rank {rank} loaded")
        _assert_equal(r["final"], saved[rank]["final"], f"rank {rank} resumed")
        assert r["counters"]["loss_scale"] == saved[rank]["counters"]["loss_scale"]
        assert r["counters"]["skipped"] == saved[rank]["counters"]["skipped"] == 1


def test_resume_from_a_dcp_checkpoint_continues_bit_for_bit(ranks, resumed):
    saved = case_results(ranks, "save")
    for rank, r in enumerate(case_results(resumed, "load-dcp")):
        _assert_equal(r["at_load"], saved[rank]["at_save"], f"rank {rank} loaded")
        _assert_equal(r["final"], saved[rank]["final"], f"rank {rank} resumed")
        assert r["counters"]["loss_scale"] == saved[rank]["counters"]["loss_scale"]


def test_a_dcp_checkpoint_of_two_ranks_resumes_in_one_process_bit_for_bit(ranks, resumed_alone):
    """DCP reshards the two ranks' shards into one; the process runs both ranks'
    batches per step (summed, halved: what the two ranks' reduce-scatter averages)."""
    saved = case_results(ranks, "save")[0]
    (r,) = case_results(resumed_alone, "load-dcp-world1")
    _assert_equal(r["at_load"], saved["at_save"], "loaded")
    _assert_equal(r["final"], saved["final"], "resumed")
    assert r["counters"]["loss_scale"] == saved["counters"]["loss_scale"]


@pytest.mark.parametrize("kind", REFUSED)
def test_what_o2_cannot_do_on_a_sharded_model_is_refused_naming_the_fix(ranks, kind):
    wanted = {
        "O3": ["opt_level='O2'", "O3"],
        "fused": ["fused_update"],
        "unsharded-root": ["fully_shard(model)", "inp.weight"],
        "half-shards": ["FP32", "before fully_shard"],
        "other-policy": ["mp_policy", "bfloat16", "half_dtype="],
        "stale-optimizer": ["build the optimizer after sharding"],
    }[kind]
    for r in case_results(ranks, f"refused-{kind}"):
        assert r["error"] is not None, f"initialize accepted {kind}"
        cls, msg = r["error"]
        assert cls == "ConfigError"
        for w in wanted:
            assert w in msg, (w, msg)
        assert r["changed"] == [] and not r["initialized"] and r["same_policies"]


def test_fully_shard_after_initialize_is_refused_at_the_first_forward_naming_the_order(ranks):
    for r in case_results(ranks, "late-shard"):
        cls, msg = r["error"]
        assert cls == "StateError"
        assert "fully_shard" in msg and "then call amp_patch.initialize" in msg and "build the optimizer" in msg


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], os.environ.get("AMP_FSDP_PHASE", "train"))
