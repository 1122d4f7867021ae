"""Threads: patched ops, ``disable_casts`` and backward from several Python threads.

The patches are process-wide, the ``disable_casts`` switch and the loss
scaling rule are per thread, and the weight-cast cache is shared: every
thread must see its own policy and get bit-for-bit the results a single
thread gets.
"""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.patching import wrappers

HALVES = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]
N_THREADS = 4
TIMEOUT = 60

# FP16 on the CPU is deliberate here (it is the CUDA default); amp_patch's
# advice to use BF16 there is not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")


def _run_threads(target, n=N_THREADS):
    """Run ``target(i)`` in ``n`` threads started together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors = []

    def body(i):
        try:
            barrier.wait(TIMEOUT)
            target(i)
        except BaseException as e:  # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


@pytest.fixture
def o1():
    def start(half, models=None, optimizers=None, **kw):
        return amp_patch.initialize(models, optimizers, "O1", half_dtype=half, **kw)

    yield start
    amp_patch.deinitialize()


@pytest.mark.parametrize("half", HALVES, ids=IDS)
def test_patched_ops_from_many_threads_match_single_thread_hand_casts(o1, half):
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)  # shared: its weight cast goes through the shared cache
    xs = [torch.randn(5, 16) for _ in range(N_THREADS)]
    ys = [torch.randn(16, 3) for _ in range(N_THREADS)]
    # What each thread must get, computed by hand before anything is patched.
    ref = []
    for x, y in zip(xs, ys):
        h = F.linear(x.to(half), lin.weight.to(half), lin.bias.to(half))
        ref.append((h, x.to(half).matmul(y.to(half)), torch.cat([h.float(), x[:, :8]])))
    o1(half, lin)

    def work(i):
        for _ in range(30):
            h = lin(xs[i])
            mm = xs[i].matmul(ys[i])  # a Tensor method: the receiver is cast too
            cat = torch.cat([h, xs[i][:, :8]])  # promote: mixed inputs run in FP32
            assert (h.dtype, mm.dtype, cat.dtype) == (half, half, torch.float32)
            assert torch.equal(h, ref[i][0]) and torch.equal(mm, ref[i][1]) and torch.equal(cat, ref[i][2])

    _run_threads(work)


@pytest.mark.quick
def test_disable_casts_in_one_thread_does_not_reach_the_others(o1):
    o1(torch.float16)
    x = torch.randn(4, 4)
    n_off = 2
    entered = threading.Barrier(N_THREADS)  # all threads are inside (or not) their block
    checked = threading.Barrier(N_THREADS)  # nobody leaves before everyone has checked
    seen = {}

    def work(i):
        if i < n_off:
            with amp_patch.disable_casts():
                with amp_patch.disable_casts():  # nested: still off after the inner exit
                    entered.wait(TIMEOUT)
                inner = (x @ x).dtype
                checked.wait(TIMEOUT)
            seen[i] = (inner, (x @ x).dtype)
        else:
            entered.wait(TIMEOUT)
            inner = (x @ x).dtype
            checked.wait(TIMEOUT)
            seen[i] = (inner, (x @ x).dtype)

    _run_threads(work)
    assert seen == {
        0: (torch.float32, torch.float16),
        1: (torch.float32, torch.float16),
        2: (torch.float16, torch.float16),
        3: (torch.float16, torch.float16),
    }
    assert (x @ x).dtype == torch.float16  # the main thread was never disabled
    from amp_patch.patching import wrappers

    assert not wrappers.disabled  # every thread's depth was popped


def _mlp():
    return nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.LayerNorm(24), nn.Linear(24, 3))


@pytest.mark.parametrize("half", HALVES, ids=IDS)
def test_backward_in_several_threads_matches_one_thread(half):
    torch.manual_seed(1)
    base = _mlp()
    xs = [torch.randn(6, 12) for _ in range(N_THREADS)]
    ts = [torch.randn(6, 3) for _ in range(N_THREADS)]
    models = [copy.deepcopy(base) for _ in range(N_THREADS)]
    amp_patch.initialize(models, None, "O1", half_dtype=half, loss_scale=1.0)
    try:
        # The reference: the same forward and backward, one thread, one after the other.
        ref = []
        for x, t in zip(xs, ts):
            m = copy.deepcopy(base)
            out = m(x)
            assert out.dtype == half
            F.mse_loss(out.float(), t).backward()
            ref.append([p.grad.clone() for p in m.parameters()])

        def work(i):
            m = models[i]
            for _ in range(3):
                m.zero_grad()
                F.mse_loss(m(xs[i]).float(), ts[i]).backward()
                for p, g in zip(m.parameters(), ref[i]):
                    assert p.grad.dtype == torch.float32
                    assert torch.equal(p.grad, g)

        _run_threads(work)
    finally:
        amp_patch.deinitialize()


class _RecordingMatmul(torch.autograd.Function):
    """y = x @ w, whose backward calls patched ops and records their dtype."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.float() @ w.float()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.float()
        gx = torch.mm(g, w.t())  # patched: half unless this thread disabled casting
        _RecordingMatmul.seen[threading.get_ident()] = gx.dtype
        return gx.float(), torch.mm(x.t(), g).float()


def test_backward_runs_under_the_policy_of_the_thread_that_calls_it(o1):
    o1(torch.bfloat16)
    w = torch.randn(6, 2, requires_grad=True)
    xs = [torch.randn(3, 6, requires_grad=True) for _ in range(N_THREADS)]
    _RecordingMatmul.seen = {}
    expected = {}
    in_block = threading.Barrier(N_THREADS)

    def work(i):
        y = _RecordingMatmul.apply(xs[i], w)
        if i % 2:
            with amp_patch.disable_casts():
                in_block.wait(TIMEOUT)
                torch.autograd.grad(y.sum(), xs[i])
            expected[threading.get_ident()] = torch.float32
        else:
            in_block.wait(TIMEOUT)  # the odd threads are inside disable_casts now
            torch.autograd.grad(y.sum(), xs[i])
            expected[threading.get_ident()] = torch.bfloat16

    _run_threads(work)
    assert _RecordingMatmul.seen == expected
    assert sorted(map(str, expected.values())) == ["torch.bfloat16"] * 2 + ["torch.float32"] * 2


def test_inference_threads_while_the_main_thread_trains(o1):
    torch.manual_seed(2)
    frozen = _mlp().eval()
    trained = _mlp()
    opt = torch.optim.SGD(trained.parameters(), lr=0.05)
    xs = [torch.randn(4, 12) for _ in range(N_THREADS - 1)]
    o1(torch.bfloat16, [frozen, trained], opt)
    with torch.no_grad():
        ref = [frozen(x) for x in xs]  # one thread, before the others start
    data = torch.randn(8, 12)
    target = torch.randn(8, 3)
    losses = []

    def work(i):
        if i == N_THREADS - 1:
            for _ in range(20):
                opt.zero_grad()
                loss = F.mse_loss(trained(data).float(), target)
                loss.backward()
                opt.step()
                losses.append(loss.item())
        else:
            with torch.no_grad():
                for _ in range(40):
                    out = frozen(xs[i])
                    assert out.dtype == torch.bfloat16
                    assert torch.equal(out, ref[i])

    _run_threads(work)
    assert losses[-1] < losses[0]


class _Features(torch.utils.data.Dataset):
    """Normalised features computed with torch ops, as a transform would."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(64, 10, generator=g) * 3 + 1
        self.y = torch.randint(0, 4, (64,), generator=g)
        self.mean, self.std = self.x.mean(0), self.x.std(0)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return (self.x[i] - self.mean) / self.std, self.y[i]


@pytest.mark.filterwarnings("ignore:.*pin_memory:UserWarning")
@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "2-workers"])
def test_dataloader_with_workers_and_pin_memory_under_o1(o1, workers):
    ds = _Features()
    plain = [(x.clone(), y.clone()) for x, y in torch.utils.data.DataLoader(ds, batch_size=16)]
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    dtypes = []
    model[0].register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    o1(torch.bfloat16, model, opt)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=16, num_workers=workers, pin_memory=True, persistent_workers=workers > 0
    )
    first = last = None
    for epoch in range(6):
        total = 0.0
        for (x, y), (px, py) in zip(loader, plain):
            # The batches are the ones a plain loader makes, bit for bit, in their own dtypes.
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            assert torch.equal(x, px) and torch.equal(y, py)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            assert loss.dtype == torch.float32
            loss.backward()
            opt.step()
            total += loss.item()
        first = total if first is None else first
        last = total
    assert set(dtypes) == {torch.bfloat16}
    assert last < first


class _Projected(torch.utils.data.Dataset):
    """A transform that calls patched ops (a matmul, and a conv in its collate)."""

    def __init__(self, fail_at=None):
        self.proj = torch.randn(6, 6, generator=torch.Generator().manual_seed(5))
        self.fail_at = fail_at

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"bad sample {i}")
        return torch.matmul(self.proj, torch.full((6,), float(i)))


def _blur_collate(items):
    batch = torch.stack(items).unsqueeze(1)
    return F.conv1d(batch, torch.full((1, 1, 3), 1 / 3), padding=1).squeeze(1)


class _ProjectedStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        ds = _Projected()
        return (ds[i] for i in range(len(ds)))


LOADERS = {
    "in-process": dict(),
    "fork-workers": dict(num_workers=2, multiprocessing_context="fork"),
    "spawn-worker": dict(num_workers=1, multiprocessing_context="spawn"),
}


@pytest.mark.parametrize("stream", [False, True], ids=["map", "iterable"])
@pytest.mark.parametrize("kind", list(LOADERS))
def test_dataset_and_collate_code_under_a_dataloader_runs_uncast(o1, kind, stream):
    # As under torch.autocast, whose state stays with the training thread: a
    # DataLoader computes its samples in their own dtypes, in the training
    # process (num_workers=0) and in forked or spawned workers alike.
    ds = _ProjectedStream() if stream else _Projected()
    def load():
        return list(torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=_blur_collate, **LOADERS[kind]))

    plain = load()
    o1(torch.bfloat16)
    loaded = load()
    assert len(loaded) == len(plain) >= 2  # (each worker replays an iterable dataset)
    assert {b.dtype for b in loaded} == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(plain, loaded))
    # The training thread still casts, during and after loading.
    assert not wrappers.disabled
    proj = _Projected().proj
    assert torch.matmul(proj, proj).dtype == torch.bfloat16


def test_a_failing_sample_leaves_casting_on_in_the_training_thread(o1):
    o1(torch.bfloat16)
    with pytest.raises(ValueError, match="bad sample 5"):
        list(torch.utils.data.DataLoader(_Projected(fail_at=5), batch_size=4))
    assert not wrappers.disabled
    assert torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16


# ---------------------------------------------------------------- initialize / deinitialize across threads


class _Gate(nn.Module):
    """Identity whose forward or backward can be held in flight until released."""

    def __init__(self):
        super().__init__()
        self.hold = None  # "forward", "backward" or None
        self.reached = threading.Event()
        self.release = threading.Event()
        self.in_backward = None  # called inside the backward, in its thread

    def forward(self, x):
        if self.hold == "forward":
            self.reached.set()
            assert self.release.wait(TIMEOUT)
        return _GateFn.apply(x, self)


class _GateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate):
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        gate = ctx.gate
        if gate.in_backward is not None:
            gate.in_backward()
        if gate.hold == "backward":
            gate.reached.set()
            assert gate.release.wait(TIMEOUT)
        return g, None


def _gated(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), _Gate(), nn.Tanh(), nn.Linear(16, 1))


def _loss(model, x):
    return model(x).float().pow(2).mean()


def _reference(level, half, x, **kw):
    """Weights after the same sequence in one thread, nothing in the way: a
    scaled backward, ``deinitialize``, then torch's own step. The same step
    kernel as the test's, so equal on every CPU: amp_patch's own O2 step
    fuses the multiply-add as torch's AVX2/AVX-512 kernels do, but torch's
    kernels for x86-64 without AVX2 round the product first."""
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, level, half_dtype=half, verbosity=0, **kw)
    try:
        _loss(model, x).backward()
    finally:
        amp_patch.deinitialize()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _stepped_under_amp(level, half, x):
    """Weights after one step taken under amp_patch (its own step), one thread."""
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, level, half_dtype=half, verbosity=0)
    try:
        _loss(model, x).backward()
        opt.step()
    finally:
        amp_patch.deinitialize()
    return [p.detach().clone() for p in model.parameters()]


def _in_thread(fn):
    """Start ``fn`` in a thread; return (thread, errors)."""
    errors = []

    def body():
        try:
            fn()
        except BaseException as e:  # reported by the test
            errors.append(e)

    t = threading.Thread(target=body, name="trainer" if fn.__name__ != "deinitialize" else "closer")
    t.start()
    return t, errors


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_deinitialize_from_another_thread_waits_for_the_backward_in_flight(level):
    # deinitialize while another thread's scaled backward runs: it waits for the
    # backward to end, then unscales what it left, so torch's own step that
    # follows applies true gradients (before, the step applied them x65536).
    x = torch.randn(4, 8)
    want = _reference(level, torch.float16, x)
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, level, half_dtype=torch.float16, verbosity=0)
    loss = _loss(model, x)
    gate = model[1]
    gate.hold = "backward"
    trainer, errors = _in_thread(loss.backward)
    assert gate.reached.wait(TIMEOUT)
    closer, closer_errors = _in_thread(amp_patch.deinitialize)
    closer.join(0.3)
    assert closer.is_alive(), "deinitialize did not wait for the backward in flight"
    assert amp_patch.is_initialized()
    gate.release.set()
    trainer.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert not errors and not closer_errors, errors + closer_errors
    assert not amp_patch.is_initialized()
    opt.step()  # torch's own step now
    under_amp = _stepped_under_amp(level, torch.float16, x)
    for p, w, u in zip(model.parameters(), want, under_amp):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach(), w)
        # and the step under amp_patch to float32 rounding: true gradients, not x65536
        torch.testing.assert_close(p.detach(), u, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_deinitialize_drops_overflowed_gradients_so_the_plain_step_changes_nothing(level):
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    amp_patch.initialize(model, opt, level, half_dtype=torch.float16, verbosity=1)
    (_loss(model, torch.randn(4, 8)) * 1e38).backward()  # inf once scaled
    with pytest.warns(amp_patch.AmpWarning, match=r"inf/NaN gradients for SGD.*dropped") as rec:
        amp_patch.deinitialize()
    assert rec[0].filename == __file__
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


def test_deinitialize_from_inside_a_backward_is_refused_and_changes_nothing():
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, verbosity=0)
    refused = []

    def call():
        try:
            amp_patch.deinitialize()
        except amp_patch.StateError as e:
            refused.append(str(e))

    model[1].in_backward = call
    try:
        _loss(model, torch.randn(4, 8)).backward()
        assert len(refused) == 1
        assert "from inside a loss.backward() amp_patch scales in the same thread" in refused[0]
        assert "call it after the step" in refused[0]
        assert amp_patch.is_initialized()
        assert model[0].weight.grad.dtype == torch.float32
    finally:
        model[1].in_backward = None
        amp_patch.deinitialize()


def test_deinitialize_waits_for_a_forward_in_flight_so_it_ends_in_one_precision():
    model = _gated()
    amp_patch.initialize(model, None, "O1", half_dtype=torch.bfloat16, verbosity=0)
    gate = model[1]
    gate.hold = "forward"
    out = []
    trainer, errors = _in_thread(lambda: out.append(model(torch.randn(4, 8))))
    assert gate.reached.wait(TIMEOUT)
    closer, closer_errors = _in_thread(amp_patch.deinitialize)
    closer.join(0.3)
    assert closer.is_alive() and amp_patch.is_initialized()
    gate.release.set()
    trainer.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert not errors and not closer_errors, errors + closer_errors
    assert out[0].dtype == torch.bfloat16  # the whole forward ran under the session
    gate.hold = None
    assert model(torch.randn(4, 8)).dtype == torch.float32  # and the next one without it


def test_a_forward_that_starts_while_deinitialize_runs_waits_and_runs_unpatched(monkeypatch):
    from amp_patch.base import inflight

    model = _gated()
    amp_patch.initialize(model, None, "O1", half_dtype=torch.bfloat16, verbosity=0)
    flight = amp_patch.base.running.session().flight
    out = []
    with flight.hold("test"):
        trainer, errors = _in_thread(lambda: out.append(model(torch.randn(4, 8))))
        trainer.join(0.3)
        assert trainer.is_alive() and not out  # held at the model's forward pre-hook
        amp_patch.base.running.session().end()  # what deinitialize does inside its hold
    trainer.join(TIMEOUT)
    assert not errors, errors
    assert out[0].dtype == torch.float32
    assert not flight._work  # the forward that started after the end counted nothing
    assert inflight.WAIT_SECONDS > 0


def test_deinitialize_gives_up_naming_the_busy_thread_and_changes_nothing(monkeypatch):
    from amp_patch.base import inflight

    monkeypatch.setattr(inflight, "WAIT_SECONDS", 0.2)
    model = _gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, verbosity=0)
    gate = model[1]
    gate.hold = "backward"
    loss = _loss(model, torch.randn(4, 8))
    trainer, errors = _in_thread(loss.backward)
    try:
        assert gate.reached.wait(TIMEOUT)
        with pytest.raises(amp_patch.StateError, match=r"waited 0.2 s .*thread 'trainer' in a loss.backward\(\) amp_patch scales.*nothing was changed"):
            amp_patch.deinitialize()
        assert amp_patch.is_initialized()
        with pytest.raises(amp_patch.StateError, match=r"initialize\(\) waited"):
            amp_patch.initialize(nn.Linear(2, 2), None, "O1", half_dtype=torch.float16, verbosity=0)
    finally:
        gate.release.set()
        trainer.join(TIMEOUT)
    assert not errors, errors
    gate.hold = None
    opt.step()  # patched: unscales first
    assert all(torch.isfinite(p).all() and p.abs().max() < 10 for p in model.parameters())
    amp_patch.deinitialize()


def test_initialize_and_deinitialize_from_another_thread_while_one_trains():
    # The reported race: thread B toggles amp_patch while thread A trains. A
    # must never crash and never apply a scaled gradient.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    data = [(torch.randn(8, 8), torch.randn(8, 1)) for _ in range(60)]
    stop = threading.Event()

    def train():
        for x, y in data:
            opt.zero_grad()
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
        stop.set()

    def toggle():
        while not stop.is_set():
            # a static scale: no step is skipped, so A follows the FP32 run
            amp_patch.initialize(model, opt, "O1", half_dtype=torch.float16, loss_scale=128.0, verbosity=0)
            time.sleep(0.002)
            amp_patch.deinitialize()
            time.sleep(0.001)

    trainer, errors = _in_thread(train)
    toggler, toggle_errors = _in_thread(toggle)
    trainer.join(TIMEOUT)
    stop.set()
    toggler.join(TIMEOUT)
    assert not errors and not toggle_errors, errors + toggle_errors
    for x, y in data:
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32
        assert (p - r).abs().max() < 0.05, "a step applied a scaled or half-broken gradient"


def test_copies_of_an_o1_model_carry_no_tracking_hooks_and_deinitialize_removes_them():
    import pickle

    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh())  # (the gate's events do not pickle)
    amp_patch.initialize(model, None, "O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
        twin = copy.deepcopy(model)
        back = pickle.loads(pickle.dumps(model))
        for m in (twin, back):
            assert not m._forward_pre_hooks and not m._forward_hooks and not m._forward_hooks_always_called
            assert "__deepcopy__" not in vars(m)
            assert m(torch.randn(2, 8)).dtype == torch.bfloat16  # it runs, cast like any code under O1
    finally:
        amp_patch.deinitialize()
    assert not model._forward_pre_hooks and not model._forward_hooks and not model._forward_hooks_always_called
    assert "__deepcopy__" not in vars(model) and "__reduce_ex__" not in vars(model)
