"""The zero-code launcher, in process: settings, the optimizer hook, model
discovery, running a script as __main__, and stepping aside for the script's
own initialize. End-to-end runs in subprocesses are in test_cli.py."""
from __future__ import annotations

import importlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch import ConfigError, ListError, frontend
from amp_patch.base import running
from amp_patch.frontends import launcher
from amp_patch.frontends.launcher import Launch, OptimizerHook, Settings, owning_model
from helpers import Snapshot, destroy_process_group, write

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture
def adopted(monkeypatch):
    """Record the optimizers the launcher hands to the loss scaler."""
    seen = []
    monkeypatch.setattr(frontend, "adopt_optimizer", seen.append)
    return seen


def optimizer_vars():
    classes, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    return Snapshot({f"{cls.__module__}.{cls.__qualname__}": cls for cls in classes})


# ------------------------------------------------------------------ settings


def test_settings_default_is_o1_with_nothing_else():
    assert Settings.resolve() == Settings("O1", None, None, ())


@pytest.mark.quick
def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("AMP_PATCH_OPT_LEVEL", "o4")
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "bf16")
    monkeypatch.setenv("AMP_PATCH_LOSS_SCALE", "128")
    assert Settings.resolve() == Settings("O4", torch.bfloat16, 128.0, ())


def test_explicit_values_beat_the_environment(monkeypatch):
    monkeypatch.setenv("AMP_PATCH_OPT_LEVEL", "O8")  # would be an error if read
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "bfloat16")
    s = Settings.resolve(opt_level="O1", half_dtype="float16", loss_scale="dynamic")
    assert s == Settings("O1", torch.float16, "dynamic", ())


@pytest.mark.parametrize(
    "var,value,message",
    [
        ("AMP_PATCH_OPT_LEVEL", "O8", "AMP_PATCH_OPT_LEVEL='O8' is not an opt level"),
        ("AMP_PATCH_OPT_LEVEL", "01", "the letter O, not zero"),
        ("AMP_PATCH_HALF_DTYPE", "float64", "AMP_PATCH_HALF_DTYPE='float64' is not supported"),
        ("AMP_PATCH_LOSS_SCALE", "-4", "AMP_PATCH_LOSS_SCALE='-4' is not a loss scale"),
        ("AMP_PATCH_LOSS_SCALE", "inf", "AMP_PATCH_LOSS_SCALE='inf' is not a loss scale"),
        ("AMP_PATCH_LOSS_SCALE", "big", "AMP_PATCH_LOSS_SCALE='big' is not a loss scale"),
    ],
)
def test_bad_environment_values_name_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.resolve()


def test_bad_explicit_value_is_named_as_given():
    with pytest.raises(ConfigError, match="--opt-level='O9' is not an opt level"):
        Settings.resolve(opt_level="O9", names={"opt_level": "--opt-level"})


def test_bad_lists_are_reported_before_anything_starts(tmp_path, monkeypatch):
    bad = write(tmp_path, "bad.yaml", "torch.nn.functional:\n  float: [sofmax]\n")
    with pytest.raises(ListError, match=r"bad.yaml:2: .*did you mean 'softmax'"):
        Settings.resolve(lists=[str(bad)])
    monkeypatch.setenv("AMP_PATCH_LISTS", str(tmp_path / "missing.yaml"))
    with pytest.raises(ListError, match="missing.yaml: no such op-list file"):
        Settings.resolve()


# ------------------------------------------------------------ optimizer hook


@pytest.mark.quick
def test_hook_fires_once_per_optimizer_after_the_whole_constructor():
    built = []

    class Tagged(torch.optim.SGD):  # defined before the hook is installed
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            self.tag = "set after super().__init__"

    hook = OptimizerHook(lambda opt: built.append((type(opt).__name__, getattr(opt, "tag", None))))
    p = [nn.Parameter(torch.zeros(2))]
    for cls in (torch.optim.SGD, torch.optim.Adam, Tagged):
        cls(p) if cls is Tagged else cls(p, lr=0.1)  # torch hooks a class's step on first use
    before = optimizer_vars()
    hook.install()
    try:

        class Later(torch.optim.Adam):  # defined after install: wrapped via __init_subclass__
            def __init__(self, params):
                super().__init__(params, lr=1e-3)
                self.tag = "later"

        torch.optim.SGD(p, lr=0.1)
        Tagged(p)
        Later(p)
    finally:
        hook.uninstall()
    assert built == [("SGD", None), ("Tagged", "set after super().__init__"), ("Later", "later")]
    assert before.changed() == []
    assert "__init_subclass__" not in vars(torch.optim.Optimizer)
    assert not hasattr(vars(Later)["__init__"], "__wrapped__")  # restored on the later class too


def test_hook_reports_only_the_outer_optimizer_of_a_nested_construction():
    built = []

    class Wrapper(torch.optim.Optimizer):
        def __init__(self, params):
            params = list(params)
            self.inner = torch.optim.SGD(params, lr=0.1)
            super().__init__(params, {})

    hook = OptimizerHook(built.append)
    hook.install()
    try:
        w = Wrapper([nn.Parameter(torch.zeros(2))])
    finally:
        hook.uninstall()
    assert built == [w]


def test_hook_skips_a_failed_constructor_and_keeps_working():
    built = []
    hook = OptimizerHook(built.append)
    hook.install()
    try:
        with pytest.raises(ValueError):
            torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=-1.0)
        ok = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    finally:
        hook.uninstall()
    assert built == [ok]


# ------------------------------------------------------------ model discovery


@pytest.mark.quick
def test_owning_model_is_the_top_level_module():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert owning_model(torch.optim.SGD(model.parameters(), lr=0.1)) is model
    # Only the head is trained: the model that holds it is still the one to cast.
    assert owning_model(torch.optim.SGD(model[2].parameters(), lr=0.1)) is model


def test_owning_model_refuses_parameters_of_two_models():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ConfigError, match="no single nn.Module holds all of its parameters.*amp_patch.initialize"):
        owning_model(opt)
    with pytest.raises(ConfigError, match="no single nn.Module"):
        owning_model(torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1))


def test_owning_model_refuses_two_candidates():
    shared = nn.Linear(2, 2)
    first, second = nn.Sequential(shared), nn.Sequential(shared)
    with pytest.raises(ConfigError, match=r"2 models hold its parameters \(Sequential, Sequential\)"):
        owning_model(torch.optim.SGD(shared.parameters(), lr=0.1))
    del first, second


def test_owning_model_refuses_a_model_already_in_ddp(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # init_process_group replaces it for good
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(ConfigError, match="already wrapped in DistributedDataParallel.*before `DistributedDataParallel"):
            owning_model(torch.optim.SGD(ddp.parameters(), lr=0.1))
    finally:
        destroy_process_group()


# ------------------------------------------------------------------ run


PROBE = """
    import os, sys
    import probe_sibling                      # next to the script: needs sys.path[0]
    import apex
    from apex import amp
    import torch.nn.functional as F
    facts = dict(
        name=__name__, file=__file__, argv=list(sys.argv), path0=sys.path[0],
        sibling=probe_sibling.VALUE, amp_is_ours=amp.__name__ == "amp_patch.amp",
        linear=F.linear,
    )
    if __name__ == "__main__":
        ran_main = True
"""


@pytest.fixture
def probe(tmp_path):
    write(tmp_path, "probe_sibling.py", "VALUE = 42\n")
    return write(tmp_path, "probe.py", PROBE)


@pytest.mark.quick
def test_run_sets_up_main_like_python(probe, adopted):
    argv, path, original = list(sys.argv), list(sys.path), F.linear
    args = ["--opt-level", "O2", "--", "x y", "-h"]
    out = launcher.run(str(probe), args, Settings.resolve(opt_level="O0"))
    facts = out["facts"]
    assert facts["name"] == "__main__" and out["ran_main"]
    assert facts["file"] == str(probe.resolve())
    assert facts["argv"][1:] == args and os.path.abspath(facts["argv"][0]) == str(probe.resolve())
    assert facts["path0"] == str(probe.parent.resolve())
    assert facts["sibling"] == 42 and facts["amp_is_ours"]
    assert facts["linear"] is original  # O0: FP32, nothing patched
    assert sys.argv == argv and sys.path == path
    assert "apex" not in sys.modules and "apex.amp" not in sys.modules
    sys.modules.pop("probe_sibling", None)


def test_run_o1_patches_before_the_script_and_restores_after(probe, adopted):
    original = F.linear
    out = launcher.run(str(probe), [], Settings.resolve(opt_level="O1"))
    assert out["facts"]["linear"] is not original
    assert F.linear is original and not amp_patch.is_initialized()
    sys.modules.pop("probe_sibling", None)


def test_run_passes_exceptions_and_exit_codes_through_unchanged(tmp_path, adopted):
    boom = write(tmp_path, "boom.py", "class Boom(Exception):\n    pass\nraise Boom('from the script')\n")
    with pytest.raises(Exception, match="from the script") as info:
        launcher.run(str(boom), [], Settings.resolve(opt_level="O1"))
    assert type(info.value).__name__ == "Boom"
    assert not amp_patch.is_initialized() and "apex" not in sys.modules
    leave = write(tmp_path, "leave.py", "import sys\nsys.exit(3)\n")
    with pytest.raises(SystemExit) as info:
        launcher.run(str(leave), [], Settings.resolve(opt_level="O1"))
    assert info.value.code == 3
    assert not amp_patch.is_initialized()


def test_run_refuses_a_missing_script_before_starting(tmp_path):
    with pytest.raises(ConfigError, match="script 'nope.py' does not exist"):
        launcher.run("nope.py", [], Settings.resolve())
    assert not amp_patch.is_initialized()


def test_session_refuses_to_start_when_already_initialized():
    amp_patch.initialize(None, None, "O4", verbosity=0)
    try:
        with pytest.raises(ConfigError, match="already initialized"):
            Launch(Settings.resolve()).start()
    finally:
        amp_patch.deinitialize()


TRAIN = """
    import torch, torch.nn as nn, torch.nn.functional as F
    import amp_patch
    from amp_patch.base import running
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    launcher_state = running.session()
    launcher_patches = len(launcher_state.patcher) if launcher_state else 0
    {own}
    state = running.session()
    patches = len(state.patcher) if state else 0
    out = model(torch.randn(3, 4))
    loss = F.cross_entropy(out.float(), torch.tensor([0, 1, 0]))
    loss.backward()
    optimizer.step()
    later = torch.optim.Adam(model.parameters())
"""


def test_o1_adopts_every_optimizer_the_script_builds(tmp_path, adopted):
    script = write(tmp_path, "train.py", TRAIN.format(own=""))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1"))
    assert out["out"].dtype == torch.float32  # the model's outputs come back in FP32
    assert out["state"].config.half_dtype == torch.bfloat16  # CPU default half dtype
    assert adopted == [out["optimizer"], out["later"]]
    assert out["state"] is out["launcher_state"]


@pytest.mark.parametrize("level", ["O4", "O5"])
def test_a_launched_run_gets_the_set_up_warnings_too(tmp_path, adopted, monkeypatch, level):
    """Zero-code users see what initialize would tell them (here: BF16 emulated on
    this CPU), once, for the function levels and for the model levels alike."""
    from amp_patch import diagnostics

    monkeypatch.setattr(diagnostics.notices, "_warned", set())
    monkeypatch.setattr(diagnostics.setup_checks, "cpu_has_native_bf16", lambda: False)
    script = write(tmp_path, "train.py", TRAIN.format(own="").replace("later = torch.optim.Adam(", "later = ("))  # one optimizer
    with pytest.warns(amp_patch.AmpWarning, match=rf"{level} runs in bfloat16 on a CPU without native BF16") as rec:
        launcher.run(str(script), [], Settings.resolve(opt_level=level))
    assert len([w for w in rec if "without native BF16" in str(w.message)]) == 1


@pytest.mark.quick
def test_the_scripts_own_initialize_wins_without_double_patching(tmp_path, adopted):
    own = "model, optimizer = amp_patch.initialize(model, optimizer, opt_level='O1', verbosity=0)"
    script = write(tmp_path, "train.py", TRAIN.format(own=own))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="float16"))
    state = out["state"]
    assert state is not out["launcher_state"] and getattr(state, "provisional", None) is None
    assert state.config.half_dtype == torch.float16  # the launcher's flag carries over
    assert out["patches"] == out["launcher_patches"]  # replaced, not patched on top
    assert out["out"].dtype == torch.float32  # the launcher's --outputs default carries over too
    # The launcher stepped aside: the optimizer built after the script's call is the script's business.
    assert adopted == [out["optimizer"]]
    assert not amp_patch.is_initialized()


def test_the_scripts_own_opt_level_wins(tmp_path, adopted):
    own = "model, optimizer = amp_patch.initialize(model, optimizer, opt_level='O4', verbosity=0)"
    script = write(tmp_path, "train.py", TRAIN.format(own=own))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="float16"))
    assert out["state"].config.opt_level == "O4"


def test_apex_enabled_false_in_the_script_turns_the_launcher_off(tmp_path, adopted):
    own = "from apex import amp\n    model, optimizer = amp.initialize(model, optimizer, enabled=False)"
    script = write(tmp_path, "train.py", TRAIN.format(own=own))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1"))
    assert out["state"] is None and out["out"].dtype == torch.float32


@pytest.mark.quick
def test_o2_attaches_to_the_first_model_optimizer_pair(tmp_path, adopted):
    body = TRAIN.format(own="").replace("later = torch.optim.Adam(model.parameters())", "")
    script = write(tmp_path, "train2.py", body + "    weight_dtype = model[0].weight.dtype\n")
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O2"))
    assert out["state"] is out["launcher_state"] and out["state"].config.opt_level == "O2"
    assert out["weight_dtype"] == torch.bfloat16
    assert out["out"].dtype == torch.float32  # cast_model_outputs: FP32 out of the half model
    assert not amp_patch.is_initialized()
    assert adopted == []  # at O2 the pair goes through initialize, not adopt_optimizer


def test_o2_refuses_a_second_optimizer_over_the_same_model(tmp_path, adopted):
    script = write(tmp_path, "train.py", TRAIN.format(own=""))
    with pytest.raises(ConfigError, match=r"already paired Sequential with an earlier optimizer.*\[opt1, opt2\]"):
        launcher.run(str(script), [], Settings.resolve(opt_level="O2"))
    assert not amp_patch.is_initialized()


# ------------------------------------------------------------------ auto


def test_import_auto_enables_amp_from_the_environment(monkeypatch, adopted):
    monkeypatch.setenv("AMP_PATCH_OPT_LEVEL", "O4")
    monkeypatch.delitem(sys.modules, "amp_patch.auto", raising=False)
    auto = importlib.import_module("amp_patch.auto")
    try:
        state = running.session()
        assert state.config.opt_level == "O4" and state.config.half_dtype == torch.bfloat16
        assert F.linear(torch.randn(2, 3), torch.randn(4, 3)).dtype == torch.bfloat16
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        assert adopted == [opt]
    finally:
        auto.session.stop()
        sys.modules.pop("amp_patch.auto", None)


def test_import_auto_with_a_bad_variable_raises_naming_it(monkeypatch):
    monkeypatch.setenv("AMP_PATCH_HALF_DTYPE", "int8")
    monkeypatch.delitem(sys.modules, "amp_patch.auto", raising=False)
    with pytest.raises(ConfigError, match="AMP_PATCH_HALF_DTYPE='int8'"):
        importlib.import_module("amp_patch.auto")
    sys.modules.pop("amp_patch.auto", None)
    assert not amp_patch.is_initialized()


def test_a_scripts_bad_initialize_leaves_the_launchers_session_running(tmp_path, adopted):
    # Before, the launcher's session was torn down before the script's call was
    # checked, so the error left AMP off although it said nothing had changed.
    own = ("try:\n        amp_patch.initialize(model, None, opt_level='O9')\n"
           "    except amp_patch.ConfigError as e:\n        err = str(e)")
    script = write(tmp_path, "train.py", TRAIN.format(own=own))
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1"))
    assert "opt_level='O9' is not an opt level" in out["err"]
    assert out["state"] is out["launcher_state"] and out["state"].provisional is not None
    assert out["patches"] == out["launcher_patches"] > 0
    assert out["out"].dtype == torch.float32 and not amp_patch.is_initialized()


LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
_OWN_INIT = """
import torch, torch.nn as nn, torch.nn.functional as F
{imp}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = {init}(model, opt, opt_level="{level}")
first = model[0].weight.detach().float().clone()
for i in range(3):
    x, y = torch.randn(4, 8), torch.randn(4, 2)
    opt.zero_grad()
    loss = F.mse_loss(model(x).float(), y)
    {backward}
    opt.step()
param_dtype = model[0].weight.dtype
moved = not torch.equal(first, model[0].weight.detach().float())
"""


@pytest.mark.parametrize("front", ["amp_patch", "apex"])
@pytest.mark.parametrize("script_level", LEVELS)
@pytest.mark.parametrize("launch_level", LEVELS)
def test_the_scripts_own_initialize_wins_at_every_pair_of_levels(tmp_path, launch_level, script_level, front):
    """docs/guide.md: the script's own initialize replaces the launcher's, whatever the two levels."""
    if front == "apex":
        imp, init = "from apex import amp", "amp.initialize"
        backward = "with amp.scale_loss(loss, opt) as s: s.backward()"
    else:
        imp, init, backward = "import amp_patch", "amp_patch.initialize", "loss.backward()"
    script = write(tmp_path, "own_init.py", _OWN_INIT.format(imp=imp, init=init, level=script_level, backward=backward))
    out = launcher.run(str(script), [], Settings.resolve(opt_level=launch_level, half_dtype="bfloat16"))
    casts_model = script_level in ("O2", "O3", "O5")
    assert out["param_dtype"] == (torch.bfloat16 if casts_model else torch.float32)
    assert out["moved"]
    assert not amp_patch.is_initialized()


_LATE_MODEL = """
import copy, pickle, torch, torch.nn as nn
from apex import amp
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = amp.initialize(model, opt, opt_level="O1")
seen = []
late = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))  # built after initialize, for evaluation
late[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
x = torch.randn(4, 8)
out = late(x)
as_numpy = out.detach().numpy()
copied = copy.deepcopy(late)(x).dtype
other = nn.Linear(8, 2)
other(x)
pickled = pickle.loads(pickle.dumps(other))(x).dtype
"""


@pytest.mark.parametrize("outputs", ["float32", "half"])
def test_a_model_built_after_initialize_returns_fp32_from_its_outermost_call(tmp_path, outputs):
    from torch.nn.modules import module as torch_module

    script = write(tmp_path, "late.py", _LATE_MODEL if outputs == "float32" else _LATE_MODEL.replace(
        "as_numpy = out.detach().numpy()", "as_numpy = None"))
    pre_hooks, hooks = dict(torch_module._global_forward_pre_hooks), dict(torch_module._global_forward_hooks)
    out = launcher.run(str(script), [], Settings.resolve(opt_level="O1", half_dtype="bfloat16", outputs=outputs))
    assert out["seen"][0] == torch.bfloat16, "inside the model the layers keep their half outputs"
    want = torch.float32 if outputs == "float32" else torch.bfloat16
    assert out["out"].dtype == want and out["copied"] == want
    if outputs == "float32":
        assert out["as_numpy"].shape == (4, 2)
    assert out["pickled"] == want, "a pickled model carries no hook of amp_patch's that cannot be pickled"
    assert dict(torch_module._global_forward_pre_hooks) == pre_hooks
    assert dict(torch_module._global_forward_hooks) == hooks
    assert not out["late"]._forward_hooks and not out["other"]._forward_hooks, "the launcher's hooks are gone"


_SAVES_THE_MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
{optimizer}
x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
for _ in range(3):
    loss = F.cross_entropy(model(x), y)
    model.zero_grad()
    loss.backward()
    {step}
criterion = nn.CrossEntropyLoss()
criterion(model(x), y)
torch.save(model, {whole!r})
torch.save(criterion, {loss!r})
want = {{k: v.clone() for k, v in model.state_dict().items()}}
"""


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5", "O2-no-optimizer"])
def test_a_model_the_script_saves_whole_loads_with_torch_load_defaults(tmp_path, level):
    """``torch.save(model)`` in a launched script (the PyTorch examples' word
    language model saves its best model so, and reads it back with
    ``torch.load`` under ``safe_globals`` of its own classes) pickles nothing of
    amp_patch's: ``torch.load``'s default ``weights_only=True`` refuses any class
    it was not told of. Each model is the FP32 one, with no hook."""
    manual = level.endswith("no-optimizer")
    whole, loss = tmp_path / "model.pt", tmp_path / "loss.pt"
    script = write(tmp_path, "saves.py", _SAVES_THE_MODEL.format(
        optimizer="" if manual else "opt = torch.optim.SGD(model.parameters(), lr=0.1)",
        step="[p.data.add_(p.grad, alpha=-0.1) for p in model.parameters()]" if manual else "opt.step()",
        whole=str(whole), loss=str(loss)))
    out = launcher.run(str(script), [], Settings.resolve(opt_level=level.split("-")[0], half_dtype="bfloat16"))
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU, nn.CrossEntropyLoss]):
        model, criterion = torch.load(whole), torch.load(loss)
    for m in (*model.modules(), criterion):
        assert not (m._forward_hooks or m._forward_pre_hooks or m._state_dict_hooks), m
        assert not {"__deepcopy__", "__reduce_ex__"} & set(vars(m))
    got = model.state_dict()
    assert list(got) == list(out["want"])
    for k, v in out["want"].items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v.float()), k


_CHECKPOINTED = """
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        # the layer's own forward, not its call, is checkpointed (as Hugging Face's
        # layers do): in the recompute, up and down are the outermost module calls
        return checkpoint(self.inner, x, use_reentrant=REENTRANT) if CHECKPOINT else self.inner(x)

    def inner(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(8, 16, requires_grad=True), torch.randint(0, 4, (8,))
for _ in range(2):
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
final = {k: v.detach().clone() for k, v in model.state_dict().items()}
"""


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("level,half", [("O1", "bfloat16"), ("O2", "float16"), ("O5", "bfloat16")])
def test_activation_checkpointing_recomputes_what_the_forward_computed(tmp_path, level, half, reentrant):
    """A checkpointed layer is recomputed inside the backward, its inner modules
    called with no outer call around them: they are not outermost calls, so
    their outputs keep the layer's dtype (at O2, an FP32 output fed the next
    half Linear: "mat1 and mat2 must have the same dtype"). The run equals the
    one without checkpointing, bit for bit."""
    runs = {}
    for on in (True, False):
        script = write(tmp_path, f"ckpt_{on}.py", _CHECKPOINTED.replace(
            "from torch.utils.checkpoint import checkpoint", f"from torch.utils.checkpoint import checkpoint\nREENTRANT, CHECKPOINT = {reentrant}, {on}"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[on] = launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype=half))["final"]
    for k, v in runs[False].items():
        assert torch.equal(runs[True][k], v), k


_TRAINING_STEP = """
import torch, torch.nn as nn, torch.nn.functional as F


class Module(nn.Module):
    # PyTorch Lightning's shape: the optimizer is over the whole module, and its
    # training_step calls the network inside, never the module itself

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)

    def training_step(self, x, y):
        return F.cross_entropy(self.net(x) if DIRECT else self(x), y)


torch.manual_seed(0)
module = Module()
opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
for _ in range(3):
    def closure():
        opt.zero_grad()
        loss = module.training_step(x, y)
        loss.backward()
        return loss
    loss = opt.step(closure)
out_dtype = module.net(x).dtype
final = {k: v.detach().clone() for k, v in module.state_dict().items()}
"""


@pytest.mark.parametrize("level,half", [("O2", "float16"), ("O5", "bfloat16")])
def test_a_submodule_called_from_outside_the_model_gets_its_inputs_cast(tmp_path, level, half):
    """O2 converts the module that holds the optimizer's parameters; a script that
    calls a submodule of it directly (Lightning's training_step: ``self.net(x)``)
    has its FP32 batch cast at that call, as the model's own forward would, so
    the run equals the one through the model's forward, bit for bit. Without
    it the FP32 batch met half weights: "mat1 and mat2 must have the same dtype"."""
    runs = {}
    for direct in (True, False):
        script = write(tmp_path, f"step_{direct}.py", _TRAINING_STEP.replace("torch.manual_seed(0)", f"DIRECT = {direct}\ntorch.manual_seed(0)"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[direct] = launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype=half))
    assert runs[True]["out_dtype"] == torch.float32  # the outermost call's output, as every launched model's
    assert runs[True]["module"].net[0].weight.dtype == torch.float32  # back after the run
    for k, v in runs[False]["final"].items():
        assert torch.equal(runs[True]["final"][k], v), k


_NATIVE_AMP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", enabled=ENABLED)
x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
for _ in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=ENABLED):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
final = {k: v.detach().clone() for k, v in model.state_dict().items()}
"""


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_script_with_its_own_grad_scaler_runs_as_written(tmp_path, level):
    """A native-AMP script (``torch.amp.GradScaler`` and ``autocast``) scales its
    own loss: under the launcher's FP16 scaler too, every gradient of a loss
    scaled twice overflowed and no step was ever taken, silently. The launcher
    now turns its AMP off when the script builds an enabled GradScaler, says
    why, and the run is the script's own, bit for bit. A disabled one (the
    script's AMP flag off) leaves the launcher on."""
    from amp_patch.base import running as running_state

    script = write(tmp_path, "native.py", _NATIVE_AMP.replace("torch.manual_seed(0)", "ENABLED = True\ntorch.manual_seed(0)"))
    alone = runpy_run(script)
    launch = launcher.Launch(Settings.resolve(opt_level=level, half_dtype="float16"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        launch.start()
        try:
            out = runpy_run(script)
        finally:
            launch.stop()
    assert launch.summary().endswith(
        "no mixed-precision run (the script runs its own mixed precision (torch.amp.GradScaler), so the launcher "
        "turned its AMP off)")
    for k, v in alone["final"].items():
        assert torch.equal(out["final"][k], v), k
    off = write(tmp_path, "native_off.py", _NATIVE_AMP.replace("torch.manual_seed(0)", "ENABLED = False\ntorch.manual_seed(0)"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        launcher.run(str(off), [], Settings.resolve(opt_level=level, half_dtype="float16"))
    assert running_state.last_ended().counters["steps"] + running_state.last_ended().counters["skipped"] == 4


def runpy_run(path):
    import runpy
    return runpy.run_path(str(path), run_name="__main__")


_COMPILED = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.body(x))


model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
run = torch.compile(model) if COMPILE else model
x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
losses = []
for _ in range(3):
    opt.zero_grad()
    out = run(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""


@pytest.mark.slow
@pytest.mark.parametrize("level", ["O1", "O5"])
def test_a_model_the_script_compiles_trains_under_the_launcher(tmp_path, level):
    """``torch.compile(model)`` in a launched script (Hugging Face's
    ``torch_compile=True`` does it too): dynamo traced the launcher's global
    outermost-call hooks into the graph and failed ("UnspecializedNNModuleVariable
    is already tracked for mutation"). The compiled module's eager wrapper makes
    the outermost call; the compiled run follows the eager one."""
    runs = {}
    for on in (True, False):
        script = write(tmp_path, f"compiled_{on}.py", _COMPILED.replace("torch.manual_seed(0)", f"COMPILE = {on}\ntorch.manual_seed(0)"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs[on] = launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype="bfloat16"))
    assert runs[True]["out"].dtype == torch.float32  # the outermost call's output, cast as in eager
    torch.testing.assert_close(runs[True]["losses"], runs[False]["losses"], rtol=2e-2, atol=0)


_FP16_ON_CPU = """
import torch, torch.nn as nn
{imp}
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{own}
out = model(torch.randn(4, 8))
"""


@pytest.mark.parametrize("front", ["amp_patch", "apex", None])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fp16_on_the_cpu_is_warned_once_whoever_initializes(tmp_path, monkeypatch, level, front):
    """``--half-dtype float16`` on the CPU: the warning initialize gives comes once,
    pointing at the script, when the launcher's level runs and when the script's
    own initialize takes that same level (it replaces the launcher's session,
    whose held warning must not swallow the script's)."""
    from amp_patch import diagnostics

    if torch.cuda.is_available():
        pytest.skip("the launcher's own level would pick the GPU")
    monkeypatch.setattr(diagnostics.notices, "_warned", set())
    imp, own = {
        "amp_patch": ("import amp_patch", f"model, opt = amp_patch.initialize(model, opt, opt_level={level!r})"),
        "apex": ("from apex import amp", f"model, opt = amp.initialize(model, opt, opt_level={level!r})"),
        None: ("", ""),
    }[front]
    script = write(tmp_path, "fp16.py", _FP16_ON_CPU.format(imp=imp, own=own))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype="float16"))
    said = [w for w in caught if issubclass(w.category, amp_patch.AmpWarning) and "float16 on the CPU" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in said]
    assert f"{level} runs in float16 on the CPU" in str(said[0].message)
    lines = script.read_text().splitlines()
    where = next(i for i, line in enumerate(lines, 1) if (own and own in line) or (not own and "out = model(" in line))
    assert (said[0].filename, said[0].lineno) == (str(script), where)
    assert not amp_patch.is_initialized()
