"""The one-pass O2/O5 step in C (``amp_patch/precision/_onepass.c``, driven by
``amp_patch.precision.onepass``): the default step where the kernel is built.

It must compute what the plain step computes: the FP32 masters and the
optimizer state bit for bit as torch's own optimizer leaves them, over several
steps, for every covered optimizer setting, gradient dtype, half dtype and
instruction set this CPU has; the half weights exactly the masters rounded.
Everything it does not cover must take the plain step (and still train the
same), and without the built module amp_patch must run as before.
"""
from __future__ import annotations

import collections
import functools
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.optim.optimizer import register_optimizer_step_pre_hook

import amp_patch
from amp_patch.precision import onepass
from helpers import HAS_C_COMPILER, amp, batch, mlp

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
C = onepass.native
needs_kernel = pytest.mark.skipif(C is None, reason=f"the step kernel is not built here ({onepass.UNAVAILABLE})")

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.05)),
    "sgd_momentum_wd_dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-2, dampening=0.1)),
    "sgd_nesterov_maximize": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    "sgd_wd_maximize_no_momentum": (torch.optim.SGD, dict(lr=0.05, weight_decay=0.1, maximize=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_wd_maximize": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-2, maximize=True)),
    "adam_amsgrad_large_lerp_weight": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, betas=(0.3, 0.9))),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_amsgrad": (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, eps=1e-6)),
}
def _available_isas():
    if C is None:
        return []
    saved = C.isa()
    out = []
    for isa in ("scalar", "avx2", "avx512"):
        try:
            C.isa(isa)
            out.append(isa)
        except ValueError:
            pass
    C.isa(saved)
    return out


ISAS = _available_isas()
# sizes: a single element, a vector tail, and several chunks (threads, chunk edges, tails)
SIZES = [1, 19, 1000, 2 * (C.CHUNK if C else 16384) + 37]


def bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def _items(params, grads, opt, halfs):
    """What OnePassStep.plan hands the kernel, for plain tensors."""
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    out = []
    for p, g, h in zip(params, grads, halfs):
        s = opt.state[p]
        if isinstance(opt, torch.optim.SGD):
            a, b, c, st = s.get("momentum_buffer"), None, None, None
        else:
            a, b, c, st = s["exp_avg"], s["exp_avg_sq"], s.get("max_exp_avg_sq"), s["step"]
        out.append((p.data_ptr(), g.data_ptr(), onepass.KINDS[g.dtype], ptr(a), ptr(b), ptr(c), ptr(h),
                    onepass.KINDS[h.dtype] if h is not None else 0, p.numel(), ptr(st), 0))
    return out


def _kernel_step(opt, params, grads, halfs, inv, threads):
    group = opt.param_groups[0]
    items = _items(params, grads, opt, halfs)
    if isinstance(opt, torch.optim.SGD):
        return C.sgd(items, threads, inv, group["maximize"], group["weight_decay"], group["momentum"],
                     group["dampening"], group["nesterov"], group["lr"])
    b1, b2 = group["betas"]
    return C.adam(items, threads, inv, group["maximize"], group["weight_decay"], group["decoupled_weight_decay"],
                  group["lr"], b1, b2, group["eps"], group["amsgrad"])


@needs_kernel
def test_sqrt_is_torchs_here():
    # Adam's bit equality rests on the square root: torch's (MKL's, not always correctly
    # rounded) where the kernel found it, else the CPU's where torch.sqrt gives exactly that
    assert onepass.sqrt_mode() in ("torch", "ieee"), onepass.sqrt_mode()


def test_the_step_kernel_is_built_where_a_compiler_is():
    if not HAS_C_COMPILER:
        pytest.skip("no C compiler on this machine: O2 takes the plain step")
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        # built, and set aside on purpose: torch's kernels without AVX2 round differently
        assert C is None and "DEFAULT" in onepass.UNAVAILABLE, onepass.UNAVAILABLE
        return
    assert C is not None, f"a C compiler is here but the step kernel is not importable ({onepass.UNAVAILABLE}); " \
                          f"reinstall with `pip install -e .` (or `python setup.py build_ext --inplace`)"


#: steps of the bit-for-bit test: the first (which creates the optimizer state) is torch's, the rest the kernel's
STEPS = 4


def _inv(gdt):
    return 2.0**-10 if gdt == f16 else 1.0


@functools.lru_cache(maxsize=4)
def _torch_steps(name, gdt):
    """torch's own optimizer ``name`` over ``STEPS`` steps from one start, on FP32
    gradients made as amp_patch makes them (half -> FP32, times 1/scale): the
    gradients of every step and the parameters and state after it. Computed once
    per optimizer and gradient dtype: every instruction set, thread count and
    half dtype is checked against the same run."""
    cls, kw = OPTIMIZERS[name]
    inv = _inv(gdt)
    torch.manual_seed(0)
    ref = [torch.randn(n) for n in SIZES]
    opt = cls(ref, **kw)
    grads, after = [], []
    for _ in range(STEPS):
        g = [(torch.randn(n) * 0.1 / inv).to(gdt) for n in SIZES]
        for r, gr in zip(ref, g):
            r.grad = gr.float() * torch.tensor(inv)
        opt.step()
        grads.append(g)
        after.append(([r.detach().clone() for r in ref], [{k: v.clone() for k, v in opt.state[r].items()} for r in ref]))
    return grads, after


@needs_kernel
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("gdt,hdt", [(f32, bf16), (bf16, bf16), (f16, f16), (f32, f16)])
def test_kernel_steps_masters_and_state_bit_for_bit_as_torch(name, gdt, hdt):
    """Four steps with state, from the same start, against torch's own optimizer
    on FP32 gradients made as amp_patch makes them (half -> FP32, times 1/scale):
    the first step is torch's (it creates the optimizer state), the other three the
    kernel's, on every instruction set, on one thread and on three (with streaming
    stores of the half weights)."""
    cls, kw = OPTIMIZERS[name]
    inv = _inv(gdt)
    grads, after = _torch_steps(name, gdt)
    onepass.sqrt_mode()
    saved, stream_min = C.isa(), C.stream_min()
    try:
        for isa, threads in itertools.product(ISAS, (1, 3)):
            C.isa(isa)
            C.stream_min(0 if threads == 3 else stream_min)  # streaming stores of the half weights too
            params, state = after[0]  # the state the plain first step created
            mine = [p.clone() for p in params]
            o_mine = cls(mine, **kw)
            for m, st in zip(mine, state):
                o_mine.state[m] = {k: v.clone() for k, v in st.items()}
            for step in range(1, STEPS):
                halfs = [torch.empty(n, dtype=hdt) for n in SIZES]
                assert _kernel_step(o_mine, mine, grads[step], halfs, inv, threads) is False
                where = f"{isa}, {threads} threads, step {step}"
                for r, st, m, h in zip(*after[step], mine, halfs):
                    assert same_bits(m, r), f"{where}: master differs at {(m != r).nonzero()[:5].tolist()}"
                    assert same_bits(h, m.to(hdt)), f"{where}: the half weight is not the master rounded"
                    for k, v in st.items():
                        assert same_bits(o_mine.state[m][k], v), f"{where}: state {k!r} differs"
    finally:
        C.isa(saved)
        C.stream_min(stream_min)


SPECIAL = [0.0, -0.0, 1.0, -1.5, 65504.0, 65519.99, 65520.0, 1e6, -1e6, 6.1e-5, 6.0e-5, 3e-8, 2.9802322e-08,
           5.96e-8, 1e-10, 1e-40, -1e-40, 3.3895314e38, 1.0000001, 1.0039062, 1.0039063, 1.0117188, float("inf"),
           float("-inf")]


@needs_kernel
@pytest.mark.parametrize("hdt", [bf16, f16])
def test_half_weights_round_as_torch_converts_them(hdt):
    """Ties, subnormals, overflow, infinities: through every instruction set's store
    (an SGD step with lr=0 writes the master unchanged into the half weight)."""
    g = torch.Generator().manual_seed(3)
    values = torch.tensor(SPECIAL * 3)
    # every bit pattern near the rounding point of both formats, and random magnitudes
    edges = torch.arange(-70000, 70000, dtype=torch.int32) * 97 + 0x3F800000
    master0 = torch.cat([values, edges.view(f32), torch.randn(5000, generator=g) * torch.logspace(-44, 38, 5000)])
    master0 = master0[torch.isfinite(master0) | torch.isinf(master0)]
    saved = C.isa()
    try:
        for isa in ISAS:
            C.isa(isa)
            master = master0.clone()
            opt = torch.optim.SGD([master], lr=0.0)
            half = torch.empty(master.numel(), dtype=hdt)
            grad = torch.zeros_like(master, dtype=hdt)
            _kernel_step(opt, [master], [grad], [half], 1.0, 2)
            assert same_bits(master, master0)
            assert same_bits(half, master0.to(hdt)), f"{isa}: {(half != master0.to(hdt)).nonzero()[:5].tolist()}"
    finally:
        C.isa(saved)
    # the portable scalar conversion, value by value
    kind = onepass.KINDS[hdt]
    for v, (code, back) in zip(SPECIAL, C.round_bits(SPECIAL, kind)):
        t = torch.tensor([v]).to(hdt)
        assert code == t.view(torch.int16).item() & 0xFFFF, v
        assert back == t.float().item() or back != back, v


@needs_kernel
@pytest.mark.parametrize("gdt", [f32, bf16, f16])
def test_non_finite_check_finds_one_inf_or_nan_anywhere(gdt):
    n = 3 * 16 + 5
    saved = C.isa()
    try:
        for isa, at, bad in itertools.product(ISAS, (0, 17, n - 1), (float("inf"), float("-inf"), float("nan"))):
            C.isa(isa)
            g = torch.randn(n).to(gdt)
            item = [(0, g.data_ptr(), onepass.KINDS[gdt], 0, 0, 0, 0, 0, n, 0, 0)]
            assert C.non_finite(item, 2) is False
            g[at] = bad
            assert C.non_finite(item, 2) is True, (isa, at, bad)
    finally:
        C.isa(saved)


# ------------------------------------------------------------------ through amp_patch


def net(seed=0):
    # a kept-FP32 BatchNorm: parameters that are their own masters ride along
    return mlp(16, 37, 4, seed=seed, norm="batch")


def train(name, steps, config, use_kernel, monkeypatch=None, inf_at=None, accumulate=False, clip=False):
    """Train ``steps`` steps; (masters, half params, optimizer state, counters, loss scales)."""
    cls, kw = OPTIMIZERS[name]
    model = net()
    opt = cls(model.parameters(), **kw)
    saved = onepass.native
    onepass.native = onepass.native if use_kernel else None
    scales = []
    try:
        with amp(model, opt, **config) as (model, opt):
            for i in range(steps):
                x, y = batch(i, 16, 4)
                if i == inf_at:
                    x[0, 0] = float("inf")
                opt.zero_grad()
                F.mse_loss(model(x).float(), y).backward()
                if accumulate:
                    x, y = batch(i + 100, 16, 4)
                    F.mse_loss(model(x).float(), y).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 0.5)
                opt.step()
                scales.append(amp_patch.counters()["loss_scale"][0])
            masters = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
            halfs = [p.detach().clone() for p in model.parameters()]
            state = [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]
            return masters, halfs, state, amp_patch.counters(), scales
    finally:
        onepass.native = saved


CONFIGS = {
    "O5_bf16": dict(opt_level="O5"),
    "O2_fp16_dynamic": dict(opt_level="O2", half_dtype=torch.float16, init_scale=2.0**12, growth_interval=2),
}


def assert_same_training(a, b):
    ma, ha, sa, _, la = a
    mb, hb, sb, _, lb = b
    assert all(same_bits(x, y) for x, y in zip(ma, mb)), "masters differ"
    assert all(torch.equal(x, y) for x, y in zip(ha, hb)), "half weights differ"
    assert la == lb, "loss scale histories differ"
    for x, y in zip(sa, sb):
        assert x.keys() == y.keys()
        assert all(same_bits(x[k], y[k]) for k in x), "optimizer state differs"


@needs_kernel
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_default_o2_step_is_the_kernel_and_trains_bit_for_bit_as_the_plain_step(name, config):
    inf_at = 3 if "fp16" in config else None  # FP16: a skipped step on the way
    plain = train(name, 6, CONFIGS[config], False, inf_at=inf_at)
    got = train(name, 6, CONFIGS[config], True, inf_at=inf_at)
    assert_same_training(plain, got)
    c = got[3]["optimizers"][0]
    # every step, the first (which creates the optimizer state) included
    assert c["one_pass"] == 6 - (inf_at is not None) and c["fused"] == 0
    assert plain[3]["optimizers"][0]["one_pass"] == 0
    if inf_at is not None:
        assert got[3]["skipped"] == 1
    masters, halfs = got[0], got[1]
    for m, h in zip(masters, halfs):
        assert torch.equal(h, m.to(h.dtype)), "a half weight is not its master rounded"
    assert {h.dtype for h in halfs} == {CONFIGS[config].get("half_dtype", bf16), f32}


#: O1/O4 keep the model's FP32 parameters; the kernel is their optimizer's update in one call
O1_CONFIGS = {
    "O4_bf16": dict(opt_level="O4"),
    "O1_fp16_dynamic": dict(opt_level="O1", half_dtype=torch.float16, init_scale=2.0**12, growth_interval=2),
    "O1_auto": dict(opt_level="O1", cast_policy="auto"),
}


#: cast_policy="auto" changes what the forward casts, not the step: two optimizers
#: (one of each kernel) stand for the rest there
O1_CASES = [(name, config) for config in sorted(O1_CONFIGS) for name in sorted(OPTIMIZERS)
            if config != "O1_auto" or name in ("adamw_amsgrad", "sgd_momentum_wd_dampening")]


@needs_kernel
@pytest.mark.parametrize("name, config", O1_CASES)
def test_o1_step_is_the_kernel_and_trains_bit_for_bit_as_the_plain_step(name, config):
    """At O1/O4 the kernel updates the model's own FP32 parameters (no masters, no half
    copy): parameters and optimizer state bit for bit what torch's step leaves, skipped
    FP16 steps included. Plain SGD (one ``add_`` per parameter in torch already) keeps
    torch's step, except under loss scaling, where the kernel takes it to read the
    skip flag in C (sync-free steps)."""
    inf_at = 3 if "fp16" in config else None
    plain = train(name, 6, O1_CONFIGS[config], False, inf_at=inf_at)
    got = train(name, 6, O1_CONFIGS[config], True, inf_at=inf_at)
    assert_same_training(plain, got)
    own_step = name == "sgd" and inf_at is None
    assert got[3]["optimizers"][0]["one_pass"] == (0 if own_step else 6 - (inf_at is not None))
    assert plain[3]["optimizers"][0]["one_pass"] == 0
    assert {p.dtype for p in got[1]} == {f32}  # the model's own parameters, still FP32


class _Recorder:
    """Stands in for the C module: records each call's thread count and, per routine,
    how many items of each gradient kind it read, then runs it."""

    def __init__(self, real):
        self.real, self.threads, self.kinds = real, [], collections.defaultdict(list)

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name not in ("sgd", "adam", "absorb"):
            return fn

        def call(items, threads, *rest):
            self.threads.append(threads)
            self.kinds[name].append(collections.Counter(it[2] for it in items))
            return fn(items, threads, *rest)
        return call


@needs_kernel
@pytest.mark.parametrize("level", ["O4", "O5"])
def test_the_kernel_starts_threads_only_for_work_worth_a_thread(level, monkeypatch):
    """Starting a thread costs what updating ~100 k elements does: a small model's step
    (and each small gradient moved into its master) runs on the calling thread at any
    thread count; a large step takes one thread per ``PER_THREAD`` elements, up to torch's count."""
    assert onepass.threads_for(onepass.PER_THREAD - 1) == 1
    rec = _Recorder(C)
    monkeypatch.setattr(onepass, "native", rec)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert onepass.threads_for(3 * onepass.PER_THREAD) == 2
        for sizes, want in (((64, 64), 1), ((1024, 1024), 2)):
            model = mlp(*sizes)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            rec.threads.clear()
            with amp(model, opt, level) as (model, opt):
                opt.zero_grad()
                model(torch.randn(4, sizes[0], dtype=next(model.parameters()).dtype)).float().sum().backward()
                opt.step()
                assert amp_patch.counters()["optimizers"][0]["one_pass"] == 1
            assert rec.threads and max(rec.threads) == want, (sizes, rec.threads)
    finally:
        torch.set_num_threads(threads)


def _mkl_max_threads():
    import ctypes
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                      mode=getattr(os, "RTLD_NOLOAD", 0))
    return lib.MKL_Get_Max_Threads()


@needs_kernel
def test_adam_calls_mkl_sequentially_and_leaves_its_thread_setting_as_it_was():
    """Where Adam's square root is MKL's, the kernel's threads run it sequentially (after
    torch.set_num_threads(n) each call would otherwise start an OpenMP team of its own,
    3x slower on two cores), bit for bit as before, and the calling thread's MKL setting
    is what it was."""
    if onepass.sqrt_mode() != "torch":
        pytest.skip(f"Adam's square root here is not MKL's (sqrt_mode {onepass.sqrt_mode()!r})")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _mkl_max_threads()
        n = 2 * onepass.PER_THREAD + 37  # two kernel threads
        torch.manual_seed(0)
        ref = [torch.randn(n)]
        mine = [ref[0].clone()]
        o_ref, o_mine = torch.optim.AdamW(ref, lr=1e-2), torch.optim.AdamW(mine, lr=1e-2)
        for step in range(3):
            g = torch.randn(n)
            ref[0].grad, mine[0].grad = g.clone(), g.clone()
            o_ref.step()
            if step == 0:
                o_mine.step()  # the optimizer state, as the plain step makes it
                continue
            _kernel_step(o_mine, mine, [mine[0].grad], [None], 1.0, 2)
            assert same_bits(mine[0], ref[0]), f"step {step}"
        assert _mkl_max_threads() == before == 2
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_o1_adam_takes_the_plain_step_where_the_kernels_sqrt_is_not_torchs(monkeypatch):
    """Where the kernel's square root only approximates torch's, O2's masters accept the
    stated ulp bound, but O1's FP32 weights are the user's own: Adam takes torch's step
    there, SGD (no square root) still the kernel."""
    monkeypatch.setattr(onepass, "sqrt_mode", lambda: "approximate")
    assert train("adam", 2, O1_CONFIGS["O4_bf16"], True)[3]["optimizers"][0]["one_pass"] == 0
    assert train("sgd_momentum_wd_dampening", 2, O1_CONFIGS["O4_bf16"], True)[3]["optimizers"][0]["one_pass"] == 2
    assert train("adam", 2, CONFIGS["O5_bf16"], True)[3]["optimizers"][0]["one_pass"] == 2


@needs_kernel
@pytest.mark.parametrize("level", ["O0", "O3"])
def test_o0_and_o3_steps_are_torchs_own(level):
    """O0 is the FP32 reference run and O3's parameters are half: neither takes the kernel."""
    model = mlp(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with amp(model, opt, level) as (model, opt):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(2, 4, dtype=next(model.parameters()).dtype)).float().sum().backward()
            opt.step()
        c = amp_patch.counters()
    assert c["steps"] == 2 and c["optimizers"][0]["one_pass"] == 0


@needs_kernel
@pytest.mark.parametrize("name", ["sgd_momentum_wd_dampening", "adamw_amsgrad"])
def test_a_skipped_first_step_creates_no_state(name):
    """The kernel makes the optimizer state of a first step only once that step is taken."""
    cfg = CONFIGS["O2_fp16_dynamic"]
    plain = train(name, 3, cfg, False, inf_at=0)
    got = train(name, 3, cfg, True, inf_at=0)
    assert_same_training(plain, got)
    assert got[3]["skipped"] == 1 and got[3]["optimizers"][0]["one_pass"] == 2


@needs_kernel
@pytest.mark.parametrize("how", ["accumulate", "clip"])
@pytest.mark.parametrize("name", ["sgd_momentum_wd_dampening", "adamw_amsgrad"])
def test_gradients_already_in_the_masters_take_the_kernel_too(name, how):
    """Accumulation over two backwards, or clip_grad_norm_ on the masters, leave FP32
    unscaled gradients in the masters: the kernel reads those (FP32, no scale)."""
    cfg = CONFIGS["O2_fp16_dynamic"]
    plain = train(name, 4, cfg, False, accumulate=how == "accumulate", clip=how == "clip")
    got = train(name, 4, cfg, True, accumulate=how == "accumulate", clip=how == "clip")
    assert_same_training(plain, got)
    assert got[3]["optimizers"][0]["one_pass"] == 4


@needs_kernel
@pytest.mark.parametrize("case", ["untouched", "clip the masters", "edit the model grad", "model_grads=False",
                                  "fp16 scaled", "accumulate"])
def test_a_step_reads_the_half_gradient_only_while_it_is_exactly_the_masters(case, monkeypatch):
    """A BF16 backward's master gradient is its half gradient cast up, exactly, and
    the model keeps that half gradient (``model_grads=True``): the step then reads it,
    half the bytes, for the same bits. Anything that makes them differ (clipping or
    editing either, loss scaling, a second backward, no half gradient kept) makes the
    step read the master's FP32 gradient."""
    reads = _Recorder(C)
    monkeypatch.setattr(onepass, "native", reads)
    cfg = dict(opt_level="O5")
    if case == "model_grads=False":
        cfg["model_grads"] = False
    if case == "fp16 scaled":
        cfg = dict(opt_level="O2", half_dtype=f16, loss_scale=256.0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with amp(model, opt, **cfg) as (model, opt):
        n_half = sum(p.dtype != f32 for p in model.parameters())
        n_own = sum(p.dtype == f32 for p in model.parameters())  # the kept-FP32 BatchNorm's, their own masters
        for i in range(3):
            opt.zero_grad()
            F.mse_loss(model(batch(i, 16, 4)[0]).float(), batch(i, 16, 4)[1]).backward()
            if case == "accumulate":
                F.mse_loss(model(batch(i + 9, 16, 4)[0]).float(), batch(i + 9, 16, 4)[1]).backward()
            if case == "clip the masters":
                torch.nn.utils.clip_grad_norm_(amp_patch.master_params(opt), 1e-3)
            if case == "edit the model grad":
                model[0].weight.grad.mul_(0.5)
            opt.step()
    half, full = onepass.KINDS[cfg.get("half_dtype", bf16)], onepass.KINDS[f32]
    assert n_half and n_own
    want = {"untouched": {half: n_half, full: n_own},
            # the edited weight reads its master's FP32 gradient, which took the edit; the others their half one
            "edit the model grad": {half: n_half - 1, full: n_own + 1}}.get(case, {full: n_half + n_own})
    assert reads.kinds["sgd"] == [want] * 3


@needs_kernel
@pytest.mark.parametrize("how", ["plain", "accumulate", "clip"])
def test_bf16_steps_that_read_the_half_gradient_train_bit_for_bit_as_the_plain_step(how):
    plain = train("sgd_momentum_wd_dampening", 4, CONFIGS["O5_bf16"], False, accumulate=how == "accumulate", clip=how == "clip")
    got = train("sgd_momentum_wd_dampening", 4, CONFIGS["O5_bf16"], True, accumulate=how == "accumulate", clip=how == "clip")
    assert_same_training(plain, got)
    assert got[3]["optimizers"][0]["one_pass"] == 4


def _one_pass(build, steps=3, **cfg):
    """(one-pass steps, masters) of training ``build()``'s (model, optimizer) for ``steps`` steps at O5."""
    model, opt = build()
    with amp(model, opt, "O5", **cfg) as (model, opt):
        for i in range(steps):
            x, y = batch(i, 16, 4)
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
        return amp_patch.counters()["optimizers"][0]["one_pass"], [p.detach().clone() for p in amp_patch.master_params(opt)]


class MySGD(torch.optim.SGD):
    pass


def _with(factory, change=None):
    def build():
        model = net()
        opt = factory(model)
        if change is not None:
            change(model, opt)
        return model, opt
    return build


FALLBACKS = {
    "another optimizer": _with(lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3)),
    "a subclass": _with(lambda m: MySGD(m.parameters(), lr=0.1)),
    "foreach=True": _with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, foreach=True)),
    "a tensor lr": _with(lambda m: torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3))),
    "a step hook": _with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                         lambda m, o: o.register_step_post_hook(lambda *a: None)),
    "a global step hook": _with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1)),
    "a replaced step": _with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                             lambda m, o: setattr(o, "step", functools.partial(type(o).step, o))),
    "a non-contiguous weight": _with(lambda m: torch.optim.SGD(_transposed(m).parameters(), lr=0.1)),
}


def _transposed(model):
    """``model`` with its first weight a transposed view (same values): not contiguous."""
    w = model[0].weight.detach()
    model[0].weight = nn.Parameter(w.t().contiguous().t())
    return model


@needs_kernel
@pytest.mark.parametrize("what", sorted(FALLBACKS))
def test_what_the_kernel_does_not_cover_takes_the_plain_step(what, monkeypatch):
    build = FALLBACKS[what]
    seen = []
    handle = register_optimizer_step_pre_hook(lambda *a: seen.append(1)) \
        if what == "a global step hook" else None
    try:
        n, got = _one_pass(build)
        assert n == 0, f"{what}: the kernel stepped"
        monkeypatch.setattr(onepass, "native", None)
        _, plain = _one_pass(build)
    finally:
        if handle is not None:
            handle.remove()
    assert len(seen) == (6 if handle is not None else 0)  # the user's hook ran at every step
    assert all(torch.equal(a, b) for a, b in zip(got, plain))


@pytest.mark.parametrize("flag", ["foreach", "fused", "capturable", "differentiable"])
def test_optimizers_with_their_own_kernels_are_refused(flag):
    p = [nn.Parameter(torch.randn(3))]
    for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        opt = cls(p, lr=0.1)
        assert onepass.refused(opt) is None
        opt.param_groups[0][flag] = True
        assert onepass.refused(opt) == f"{cls.__name__}({flag}=True)"


@needs_kernel
def test_a_sparse_gradient_takes_the_plain_step():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    with amp(emb, opt, "O5") as (emb, opt):
        for _ in range(2):
            opt.zero_grad()
            emb(torch.tensor([1, 2, 2])).float().sum().backward()
            opt.step()
        assert amp_patch.counters()["optimizers"][0]["one_pass"] == 0
        assert amp_patch.counters()["steps"] == 2


@needs_kernel
def test_a_closure_takes_the_plain_step():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with amp(model, opt, "O5") as (model, opt):
        x, y = batch(0, 16, 4)
        for _ in range(3):
            def closure():
                opt.zero_grad()
                loss = F.mse_loss(model(x).float(), y)
                loss.backward()
                return loss
            opt.step(closure)
        assert amp_patch.counters()["optimizers"][0]["one_pass"] == 0


VERSIONED = {
    "O2's half weights": ("O5", lambda: mlp(4, 4), torch.optim.SGD),
    # a LayerNorm stays FP32 and its graph saves the weight itself: at O2 its own master,
    # at O1 the model's parameter
    "O2's kept-FP32 weights": ("O5", lambda: nn.Sequential(nn.LayerNorm(4)), torch.optim.SGD),
    "O1's FP32 weights": ("O4", lambda: nn.Sequential(nn.LayerNorm(4)), torch.optim.Adam),
}


@needs_kernel
@pytest.mark.parametrize("what", sorted(VERSIONED))
def test_the_kernel_bumps_the_version_of_every_weight_it_writes(what):
    """As torch's in-place update does: a graph that saved a weight before the step
    refuses to backward after it."""
    level, build, cls = VERSIONED[what]
    model = build()
    opt = cls(model.parameters(), lr=0.1, **({"momentum": 0.9} if cls is torch.optim.SGD else {}))
    with amp(model, opt, level) as (model, opt):
        for i in range(2):
            opt.zero_grad()
            model(torch.randn(2, 4)).float().sum().backward()
            if i == 1:
                out = model(torch.randn(2, 4, requires_grad=True)).float().sum()  # saves the weight
            opt.step()
        assert amp_patch.counters()["optimizers"][0]["one_pass"] == 2
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


def test_without_the_built_kernel_o2_takes_the_plain_step(tmp_path):
    """As after an install with no C compiler: the import fails, nothing else does."""
    script = (
        "import sys; sys.modules['amp_patch.precision._onepass'] = None\n"
        "import torch, amp_patch\n"
        "from amp_patch.precision import onepass\n"
        "assert onepass.native is None and onepass.UNAVAILABLE, onepass.UNAVAILABLE\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(8, 8); o = torch.optim.AdamW(m.parameters(), lr=1e-2)\n"
        "m, o = amp_patch.initialize(m, o, 'O2', verbosity=0)\n"
        "for _ in range(3):\n"
        "    o.zero_grad(); m(torch.randn(4, 8).to(torch.bfloat16)).float().sum().backward(); o.step()\n"
        "c = amp_patch.counters()\n"
        "assert c['steps'] == 3 and c['optimizers'][0]['one_pass'] == 0, c\n"
        "assert torch.equal(m.weight, amp_patch.master_params(o).__next__().to(torch.bfloat16))\n"
        "print('plain ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "plain ok" in res.stdout


# ---------------------------------------------------------------- absorb: half gradient -> FP32 master gradient


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [bf16, f16])
@pytest.mark.parametrize("n", [1, 37, 40_000])  # one element, a vector tail, several chunks on two threads
def test_absorb_gives_torchs_copy_unscale_and_add_bit_for_bit(isa, dtype, n):
    """Every mode (write, add, zero then add) at every size, with plain and with streaming
    stores: ``stream_min(0)`` makes the writes stream at these sizes, as they do from
    ``stream_min()`` elements (2 M) by default, so no tensor of that size is needed."""
    g = torch.Generator().manual_seed(n)
    grad = (torch.randn(n, generator=g) * 300).to(dtype)
    grad[n // 3] = -0.0
    saved, stream_min = C.isa(), C.stream_min()
    try:
        C.isa(isa)
        for mode, streams, inv in itertools.product((0, 1, 2), (False, True), (1.0, 1 / 1024, 3.0)):
            C.stream_min(0 if streams else stream_min)
            dst = torch.randn(n, generator=g)
            assert dst.data_ptr() % 64 == 0  # where the write streams (mode 0), the destination is aligned
            before = dst.clone()
            found = torch.zeros(())
            bad = C.absorb([(dst.data_ptr(), grad.data_ptr(), onepass.KINDS[dtype], 0, 0, 0, 0, 0, n, 0, mode)],
                           2, inv, found.data_ptr())
            # what the end-of-backward path computes: a copy, torch's unscale-and-check, an add
            v = grad.float()
            ref_found = torch.zeros(())
            torch._amp_foreach_non_finite_check_and_unscale_([v], ref_found, torch.full((), inv))
            ref = v if mode == 0 else (before + v if mode == 1 else torch.zeros(n) + v)
            assert torch.equal(dst.view(torch.int32), ref.view(torch.int32)), (mode, streams, inv)
            assert not bad and found.item() == 0.0 == ref_found.item()
        for bad_value in (float("inf"), float("nan")):
            poisoned = grad.clone()
            poisoned[n - 1] = bad_value
            dst, found = torch.empty(n), torch.zeros(())
            assert C.absorb([(dst.data_ptr(), poisoned.data_ptr(), onepass.KINDS[dtype], 0, 0, 0, 0, 0, n, 0, 0)],
                            1, 0.5, found.data_ptr())
            assert found.item() == 1.0
    finally:
        C.isa(saved)
        C.stream_min(stream_min)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [bf16, f16])
@pytest.mark.parametrize("n", [37, 40_000])
def test_absorb_writes_the_rounded_sum_back_as_torchs_cast_does(isa, dtype, n):
    """The model's ``.grad`` as a view of the master's, written in the same pass: the
    new FP32 gradient rounded to the half dtype, bit for bit ``master.grad.to(dtype)``,
    into the half gradient itself or another buffer; where it is the half gradient and
    the write is unscaled, that gradient is left as it is (it is the rounding already).
    An inverse scale of 2^-20 takes FP16 values into subnormals and to zero."""
    g = torch.Generator().manual_seed(n)
    saved = C.isa()
    k = onepass.KINDS[dtype]
    try:
        C.isa(isa)
        for mode, inv, in_place in itertools.product((0, 1, 2), (1.0, 1 / 1024, 2.0 ** -20, 3.0), (True, False)):
            grad = (torch.randn(n, generator=g) * 300).to(dtype)
            grad[n // 2] = -0.0
            dst = torch.randn(n, generator=g)
            before, kept = dst.clone(), grad.clone()
            out = grad if in_place else torch.full((n,), 7.0, dtype=dtype)
            C.absorb([(dst.data_ptr(), grad.data_ptr(), k, 0, 0, 0, out.data_ptr(), k, n, 0, mode)], 2, inv, 0)
            v = kept.float()
            torch._amp_foreach_non_finite_check_and_unscale_([v], torch.zeros(()), torch.full((), inv))
            ref = v if mode == 0 else (before + v if mode == 1 else torch.zeros(n) + v)
            assert torch.equal(dst.view(torch.int32), ref.view(torch.int32)), (mode, inv, in_place)
            assert torch.equal(out.view(torch.int16), ref.to(dtype).view(torch.int16)), (mode, inv, in_place)
    finally:
        C.isa(saved)
    h32 = torch.empty(n)
    with pytest.raises(ValueError, match="gradient's kind only"):
        C.absorb([(dst.data_ptr(), grad.data_ptr(), k, 0, 0, 0, h32.data_ptr(), onepass.KINDS[torch.float32], n, 0, 0)],
                 1, 1.0, 0)
