"""The op ledger (collect_stats), report(), reset_stats() and plot()."""
from __future__ import annotations

import json
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from helpers import batch
from amp_patch.base import running
from amp_patch.diagnostics import modes
from amp_patch import AmpWarning
from amp_patch.base.errors import StateError

B, D_IN, D_OUT = 4, 8, 4
HERE = __file__


def _line(marker: str) -> int:
    with open(HERE) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker) and "_line(" not in line:
                return i
    raise AssertionError(marker)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(D_IN, D_IN)
        self.l2 = nn.Linear(D_IN, D_OUT)

    def forward(self, x):
        x = torch.tanh(x)  # site: tanh
        h = torch.relu(self.l1(x))  # site: l1
        return self.l2(h)


def _step(model, opt, x, y):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)  # site: loss
    loss.backward()
    opt.step()
    return loss


@pytest.fixture
def amp_run():
    """An O1 BF16 run with the ledger on; always deinitialized."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", collect_stats=True, verbosity=0)
    try:
        yield model, opt
    finally:
        amp_patch.deinitialize()


def _data():
    return batch(0, D_IN, D_OUT, rows=B, seed=1)


@pytest.mark.quick
def test_ledger_counts_calls_dtypes_casts_and_bytes(amp_run):
    model, opt = amp_run
    x, y = _data()
    _step(model, opt, x, y)
    amp_patch.reset_stats()  # the watch on unlisted ops starts with the first patched call
    n = 3
    for _ in range(n):
        _step(model, opt, x, y)
    ops = amp_patch.report().to_dict()["ops"]

    lin = ops["torch.nn.functional.linear"]
    assert lin["policy"] == "half"
    assert lin["calls"] == 2 * n
    assert lin["dtypes"] == {"bfloat16": 2 * n}
    # l1 casts its FP32 input, weight and bias; l2 gets relu's BF16 output and
    # casts only its weight and bias. The sources are FP32: 4 bytes each.
    per_step_casts = 3 + 2
    per_step_bytes = 4 * (B * D_IN + D_IN * D_IN + D_IN) + 4 * (D_IN * D_OUT + D_OUT)
    assert lin["casts"] == n * per_step_casts
    assert lin["bytes_cast"] == n * per_step_bytes
    assert lin["first_call_site"] == f"{HERE}:{_line('# site: l1')}"

    mse = ops["torch.nn.functional.mse_loss"]
    assert mse["policy"] == "float"
    assert mse["calls"] == n  # a Python-level op is counted once, not once more per re-dispatch
    assert mse["dtypes"] == {"float32": n}
    assert mse["casts"] == n  # l2's BF16 output to FP32
    assert mse["bytes_cast"] == n * 2 * B * D_OUT
    assert mse["first_call_site"] == f"{HERE}:{_line('# site: loss')}"


def test_inplace_ops_are_recorded_with_the_receiver_dtype_and_their_casts(amp_run):
    acc = torch.zeros(2, 3)
    a, b = torch.rand(2, 4, dtype=torch.bfloat16), torch.rand(4, 3)
    acc.addmm_(a, b)  # site: addmm_
    acc.addmm_(a.float(), b)
    ops = amp_patch.report().to_dict()["ops"]
    rec = ops["torch.Tensor.addmm_"]
    assert (rec["policy"], rec["calls"], rec["dtypes"]) == ("half", 2, {"float32": 2})
    assert (rec["casts"], rec["bytes_cast"]) == (1, a.numel() * 2)  # the BF16 operand, once
    assert rec["first_call_site"] == f"{HERE}:{_line('# site: addmm_')}"


def test_operators_are_not_reported_as_unlisted_methods(amp_run):
    """``x * 2 + 1`` reaches torch as Tensor.mul and Tensor.add, but runs through
    __mul__ and __add__, which the lists cover (promote): neither is "unlisted"."""
    x = torch.randn(4, requires_grad=True)
    amp_patch.reset_stats()
    (x * 2 + 1).sum()
    report = amp_patch.report().to_dict()
    assert "torch.Tensor.mul" not in report["unlisted"] and "torch.Tensor.add" not in report["unlisted"]
    assert report["ops"]["torch.Tensor.__mul__"]["calls"] == 1 and report["ops"]["torch.Tensor.__add__"]["calls"] == 1
    torch.tanh(x)  # an op no list covers is still reported
    assert "torch.tanh" in amp_patch.report().to_dict()["unlisted"]


def test_unlisted_ops_are_fp32_ops_on_eligible_inputs_that_no_list_covers(amp_run):
    model, opt = amp_run
    x, y = _data()
    _step(model, opt, x, y)
    amp_patch.reset_stats()
    n = 2
    for _ in range(n):
        _step(model, opt, x, y)
    w = torch.randn(D_IN, requires_grad=True)
    torch.sigmoid(w).sum().backward()  # one more unlisted op, outside any module
    with torch.no_grad():
        torch.sigmoid(w)  # not counted: no_grad work (optimizer steps) is FP32 by design
    w.view(2, 4)  # views move no data
    unlisted = amp_patch.report().to_dict()["unlisted"]

    assert unlisted["torch.tanh"] == {"calls": n, "first_call_site": f"{HERE}:{_line('# site: tanh')}"}
    assert unlisted["torch.sigmoid"]["calls"] == 1
    # relu ran on l1's BF16 output, so it ran in BF16: not a missed cast.
    assert "torch.relu" not in unlisted
    # listed ops (linear, mse_loss, the optimizer's in-place updates) are never "unlisted".
    assert not any(q.endswith((".linear", ".mse_loss", "_")) for q in unlisted)
    assert not any(q.endswith(".view") for q in unlisted)


@pytest.mark.quick
def test_report_str_groups_by_policy_and_sorts_by_calls(amp_run):
    model, opt = amp_run
    x, y = _data()
    _step(model, opt, x, y)
    amp_patch.reset_stats()
    _step(model, opt, x, y)
    torch.matmul(x, x.t())  # half, called once: sorts after linear (2 calls)
    text = str(amp_patch.report())
    lines = text.splitlines()
    assert lines[0] == "amp_patch report: O1, half dtype bfloat16, cpu"

    def index(prefix):
        return next(i for i, line in enumerate(lines) if line.strip().startswith(prefix))

    assert index("policy half:") < index("torch.nn.functional.linear") < index("torch.matmul") < index("policy float:")
    assert index("policy float:") < index("torch.nn.functional.mse_loss")
    row = lines[index("torch.nn.functional.linear")].split()
    assert row[:3] == ["torch.nn.functional.linear", "2", "bfloat16"]
    assert "unlisted ops seen" in text and "torch.tanh" in text


def test_ops_inside_torchs_utilities_are_the_utilitys_not_the_models(amp_run):
    """clip_grad_norm_ between backward and step runs patched ops (stack, __mul__, ...)
    from inside torch.nn.utils: one line under the utility's name, not promote ops of
    the user's line."""
    model, opt = amp_run
    x, y = _data()
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # site: clip
        opt.step()
    rep = amp_patch.report()
    d = rep.to_dict()
    assert set(d["ops"]) == {"torch.tanh", "torch.nn.functional.linear", "torch.nn.functional.mse_loss"} & set(d["ops"])
    assert not any(q.startswith("torch.Tensor.__") or q == "torch.stack" for q in d["ops"]), sorted(d["ops"])
    clip = d["utilities"]["torch.nn.utils.clip_grad_norm_"]
    assert clip["first_call_site"] == f"{HERE}:{_line('# site: clip')}"
    assert {"torch.stack", "torch.Tensor.__mul__"} <= set(clip["ops"])
    assert clip["calls"] == sum(clip["ops"].values()) and clip["ops"]["torch.stack"] == 2
    assert list(d["utilities"]) == ["torch.nn.utils.clip_grad_norm_"]
    text = str(rep)
    assert "policy sequence_promote:" not in text
    assert "ops inside torch's utilities (their own arithmetic on your parameters and gradients; " \
           "not your model's ops, so not in the table above):" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("torch.nn.utils.clip_grad_norm_"))
    assert "stack 2" in row and row.endswith(f":{_line('# site: clip')}")
    # named after the utility the script called: get_total_norm on its own, too
    torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert "torch.nn.utils.get_total_norm" in amp_patch.report().to_dict()["utilities"]
    amp_patch.reset_stats()
    assert amp_patch.report().to_dict()["utilities"] == {}


def test_to_dict_is_plain_json(amp_run):
    model, opt = amp_run
    _step(model, opt, *_data())
    d = amp_patch.report().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["opt_level"] == "O1" and d["half_dtype"] == "bfloat16" and d["collect_stats"] is True


def test_reset_stats_clears_the_ledger(amp_run):
    model, opt = amp_run
    _step(model, opt, *_data())
    assert amp_patch.report().ops
    amp_patch.reset_stats()
    d = amp_patch.report().to_dict()
    assert d["ops"] == {} and d["unlisted"] == {}


def test_records_from_another_thread(amp_run):
    x = torch.randn(3, 3)
    t = threading.Thread(target=lambda: [torch.matmul(x, x) for _ in range(5)])
    t.start()
    t.join()
    assert amp_patch.report().ops["torch.matmul"]["calls"] == 5


def test_stats_off_costs_nothing():
    model = Net()
    amp_patch.initialize(model, opt_level="O1", verbosity=0)
    try:
        assert running.session().diagnostics.ledger is None
        model(torch.randn(B, D_IN))
        # no watching mode, no observer: the patched ops run as without stats
        assert torch._C._len_torch_function_stack() == 0
        assert modes._observers == ()
        text = str(amp_patch.report())
        assert "ops: not recorded; initialize(..., collect_stats=True) records them" in text
        with pytest.raises(StateError, match="collect_stats=True"):
            amp_patch.reset_stats()
    finally:
        amp_patch.deinitialize()


def test_deinitialize_takes_the_watch_off():
    model = Net()
    amp_patch.initialize(model, opt_level="O1", collect_stats=True, verbosity=0)
    try:
        model(torch.randn(B, D_IN))
        assert torch._C._len_torch_function_stack() == 1
    finally:
        amp_patch.deinitialize()
    assert torch._C._len_torch_function_stack() == 0
    assert modes._observers == ()


def test_a_users_mode_entered_later_survives_deinitialize():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Mine(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    model = Net()
    amp_patch.initialize(model, opt_level="O1", collect_stats=True, verbosity=0)
    try:
        model(torch.randn(B, D_IN))  # the ledger's watch goes on the stack
        with Mine():
            amp_patch.deinitialize()  # takes ours off from under the user's mode
            assert torch._C._len_torch_function_stack() == 1
            torch.relu(torch.ones(1))
        assert torch.relu in seen
    finally:
        amp_patch.deinitialize()
    assert torch._C._len_torch_function_stack() == 0


def test_report_and_reset_need_initialize(monkeypatch):
    monkeypatch.setattr(running, "_ended", None)  # no run has ended in this process
    with pytest.raises(StateError, match=r"amp_patch.report\(\) has no run to report on yet: call it after "
                                         r"amp_patch.initialize"):
        amp_patch.report()
    with pytest.raises(StateError, match=r"amp_patch.counters needs amp_patch.initialize"):
        amp_patch.counters()
    with pytest.raises(StateError, match=r"amp_patch.plot\(\) has no run to draw yet"):
        amp_patch.plot("never.png")
    with pytest.raises(StateError, match=r"amp_patch.reset_stats\(\) needs a running AMP"):
        amp_patch.reset_stats()


# ------------------------------------------------------------ loss-scale history


class _Scaler:
    """Stands in for a loss scaler: only its ``history`` is read."""

    def __init__(self, history, loss_id=0):
        self.history = history
        self.loss_id = loss_id


def test_report_summarises_each_scalers_history(amp_run):
    amp = running.session()
    hist = [(0, 65536.0, True), (1, 32768.0, True), (2, 16384.0, False), (3, 16384.0, False)]
    amp.scaling.scalers.append(_Scaler(hist, loss_id=7))
    try:
        rep = amp_patch.report()
        s = next(s for s in rep.loss_scale if s["loss_id"] == 7)
        assert s["steps"] == 4 and s["skipped"] == 2 and s["skipped_steps"] == [0, 1]
        assert (s["scale"], s["min_scale"], s["max_scale"]) == (16384.0, 16384.0, 65536.0)
        assert s["history"] == [list(r) for r in hist]
        assert "loss 7: 4 steps, 2 skipped (step 0, 1); scale 16384 now (min 16384, max 65536)" in str(rep)
    finally:
        amp.scaling.scalers.pop()


def test_the_summary_range_includes_the_scale_after_the_last_step(amp_run):
    amp = running.session()
    scaler = _Scaler([(0, 65536.0, True)], loss_id=8)
    scaler.scale = 32768.0  # backed off by the skipped step
    amp.scaling.scalers.append(scaler)
    try:
        rep = amp_patch.report()
        s = next(s for s in rep.loss_scale if s["loss_id"] == 8)
        assert (s["scale"], s["min_scale"], s["max_scale"]) == (32768.0, 32768.0, 65536.0)
        assert "scale 32768 now (min 32768, max 65536)" in str(rep)
    finally:
        amp.scaling.scalers.pop()


def test_history_is_read_defensively(amp_run):
    amp = running.session()

    class Entry:
        step, scale, skipped = 5, 8.0, True

    amp.scaling.scalers.append(_Scaler([(0, 16.0, False), "junk", (1,), Entry()], loss_id=9))
    amp.scaling.scalers.append(object())  # a scaler with no history at all
    try:
        summaries = amp_patch.report().loss_scale
        s = next(s for s in summaries if s["loss_id"] == 9)
        assert s["history"] == [[0, 16.0, False], [5, 8.0, True]]
        assert any(x["steps"] == 0 for x in summaries)
    finally:
        del amp.scaling.scalers[-2:]


def test_plot_writes_a_png(amp_run, tmp_path):
    pytest.importorskip("matplotlib")
    amp = running.session()
    amp.scaling.scalers.append(_Scaler([(i, 2.0 ** (16 - (i < 3) * i), i < 3) for i in range(10)]))
    try:
        out = amp_patch.plot(tmp_path / "scale.png")
    finally:
        amp.scaling.scalers.pop()
    data = (tmp_path / "scale.png").read_bytes()
    assert out == str(tmp_path / "scale.png")
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (800, 500)


def test_plot_before_any_step_says_why_it_has_nothing_to_draw(amp_run, tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.warns(AmpWarning, match=r"amp_patch.plot\(\): nothing to draw in .*x.png: no optimizer step yet"):
        out = amp_patch.plot(tmp_path / "x.png")
    assert out == str(tmp_path / "x.png") and (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.quick
def test_plot_of_a_run_that_scales_no_loss_draws_its_steps(amp_run, tmp_path):
    pytest.importorskip("matplotlib")
    model, opt = amp_run  # BF16: no loss scaling
    x, y = _data()
    for _ in range(3):
        _step(model, opt, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # something to draw: no warning
        amp_patch.plot(tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"
    s = amp_patch.report().loss_scale[0]
    assert s["history"] == [[0, 1.0, False], [1, 1.0, False], [2, 1.0, False]]
    assert "loss 0: 3 steps, 0 skipped; scale 1 now (min 1, max 1) (static: no loss scaling, bfloat16 needs none)" in str(amp_patch.report())


def test_plot_without_matplotlib_names_the_extra(amp_run, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install -e '.\[plot\]' in a checkout of amp_patch, or pip install matplotlib"):
        amp_patch.plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_plot_from_a_real_scalers_history(tmp_path):
    pytest.importorskip("matplotlib")
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # FP16 with a scale so high the first steps overflow and back off.
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16,
                                      init_scale=2.0 ** 40, max_loss_scale=2.0 ** 40, verbosity=0)
    try:
        x, y = _data()
        for _ in range(4):
            _step(model, opt, x, y)
        s = amp_patch.report().loss_scale[0]
        assert s["steps"] == 4 and s["skipped"] >= 1 and s["history"][0][2] is True
        amp_patch.plot(tmp_path / "real.png")
    finally:
        amp_patch.deinitialize()
    assert (tmp_path / "real.png").read_bytes()[:4] == b"\x89PNG"


def _fp16_history(**options):
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(B, D_IN, generator=g) * 30, torch.randn(B, D_OUT, generator=g)) for _ in range(8)]
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp_patch.initialize(model, opt, opt_level="O1", half_dtype=torch.float16,
                                      init_scale=2.0 ** 24, verbosity=0, **options)
    try:
        for x, y in data:
            _step(model, opt, x, y)
        rep = amp_patch.report()
        return rep.loss_scale[0]["history"], rep.ops, [p.detach().clone() for p in model.parameters()]
    finally:
        amp_patch.deinitialize()


def test_watching_does_not_change_training_and_skips_amp_patchs_own_calls():
    plain, _, plain_weights = _fp16_history()
    assert any(skipped for _, _, skipped in plain)  # the scale backs off at least once
    for options in (dict(collect_stats=True), dict(find_overflow=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # find_overflow explains each skipped step
            history, ops, weights = _fp16_history(**options)
        assert history == plain, options
        assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights)), options
        if options.get("collect_stats"):
            # only the model's ops: the loss scaler's arithmetic is not counted
            assert sorted(ops) == ["torch.nn.functional.linear", "torch.nn.functional.mse_loss"]
