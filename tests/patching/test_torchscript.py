"""TorchScript while amp_patch runs: scripted code compiles and runs the original ops.

The launcher patches before a script's imports, so a function scripted at import
(timm scripts some) meets amp_patch's wrappers. TorchScript must resolve each to
the original op: ``F.conv2d(x, w, stride=2)`` compiles, and scripted code runs
uncast (FP32, as under Apex), on every route and at every level. Whatever amp_patch
enters in TorchScript's tables goes with ``deinitialize``.
"""
from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.jit._builtins as jit_builtins
import torch.jit._recursive as jit_recursive
import torch.nn as nn
import torch.nn.functional as F

import amp_patch
from amp_patch.base.undo import Owned
from amp_patch.frontends import alias, launcher
from amp_patch.frontends.launcher import Settings
from amp_patch.patching.registry import Patcher
from helpers import Snapshot, write

LEVELS = ["O1", "O2", "O3", "O4", "O5"]
# torch.jit.script itself says it is deprecated; what it compiles is what these tests check
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


@pytest.fixture
def jit_tables():
    """TorchScript's tables amp_patch may touch, checked to be exactly as before at the end."""
    table = jit_builtins._get_builtin_table()
    before = dict(table)
    recursive = Snapshot({"torch.jit._recursive": jit_recursive})
    yield table
    assert not amp_patch.is_initialized()
    assert table == before, "TorchScript's builtin table left changed"
    assert not recursive.changed(), f"torch.jit._recursive left patched: {recursive.changed()}"


@pytest.fixture
def apex_amp(monkeypatch, caplog):
    """``apex.amp`` through the alias, with no apex module imported before or left after."""
    monkeypatch.setattr(alias, "_announced", False)
    caplog.set_level(logging.ERROR, logger="amp_patch")
    saved = list(sys.meta_path)
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.") or m in alias.EXTENSIONS]:
        monkeypatch.delitem(sys.modules, name)
    amp_patch.install_apex_alias()
    from apex import amp

    yield amp
    alias.remove_apex_alias()
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        del sys.modules[name]
    sys.meta_path[:] = saved


def start(route, level, model, amp_module=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if route == "apex":
        amp_module.initialize(model, opt, opt_level=level, verbosity=0)
    else:
        amp_patch.initialize(model, opt, level, verbosity=0)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 9, 9, generator=g), torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, 4, generator=g)


def _check_uncast(scripted, eager, *args):
    """``scripted`` holds no call back into Python and gives ``eager``'s FP32 result
    with amp_patch's casts off, on every run (the first ones profile)."""
    assert "prim::PythonOp" not in str(scripted.inlined_graph)
    with amp_patch.disable_casts():
        want = eager(*args)
    assert want.dtype == torch.float32
    for _ in range(3):
        got = scripted(*args)
        assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("route", ["initialize", "apex"])
def test_a_function_scripted_after_patching_compiles_and_runs_uncast(jit_tables, route, level, request):
    amp_module = request.getfixturevalue("apex_amp") if route == "apex" else None
    start(route, level, Net(), amp_module)
    try:
        x, w, y = _inputs()
        if level in ("O1", "O4"):
            assert F.conv2d(x, w).dtype != torch.float32  # the eager call is cast

        def body(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = F.relu(F.conv2d(x, w, stride=2))  # a keyword: no opaque Python call takes it
            h = torch.cat([h, h.flip(1)], dim=1)
            z = F.layer_norm(torch.matmul(y, y.t()).softmax(-1) @ y, [4])  # compiled from F's source
            return h.mean(dim=(2, 3)).sum(dim=1) + F.linear(z, y, bias=y[0]).sum() + torch.mm(y, y).norm()

        scripted = torch.jit.script(body)
        _check_uncast(scripted, body, x, w, y)
    finally:
        amp_patch.deinitialize()


@pytest.mark.quick
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_the_builtin_table_holds_the_wrappers_exactly_while_patched(jit_tables, level):
    table = jit_tables
    original = F.conv2d
    amp_patch.initialize(None, None, level, verbosity=0)
    try:
        wrapper, mm = F.conv2d, torch.mm
        assert wrapper is not original
        assert jit_builtins._find_builtin(wrapper) == "aten::conv2d"
        assert jit_builtins._find_builtin(mm) == "aten::mm"
        assert jit_builtins._find_builtin(F.linear) == "aten::linear"
    finally:
        amp_patch.deinitialize()
    # the wrappers are alive still: their ids must not name an op any more
    assert id(wrapper) not in table and id(mm) not in table
    assert jit_builtins._find_builtin(F.conv2d) == "aten::conv2d"


def test_a_patch_batch_that_fails_half_way_takes_its_builtin_entries_back(jit_tables):
    table, original, made = jit_tables, torch.mm, []

    def wrap(old):
        made.append(lambda *args: old(*args))
        return made[-1]

    def boom(old):
        assert jit_builtins._find_builtin(made[0]) == "aten::mm"  # entered with its patch
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        Patcher(Owned(object())).apply([(torch, "mm", wrap), (torch, "bmm", boom)])
    assert torch.mm is original and id(made[0]) not in table


@pytest.mark.parametrize("given", ["fresh", "given", "given, run first"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_conv_model_scripted_while_patched_runs_in_fp32(jit_tables, level, given):
    """``torch.jit.script(module)``: of a model built after initialize, and of one
    given to it (which carries amp_patch's forward hooks: the scripted copy
    compiles without them, and the model keeps them, in their order)."""
    model = Net().eval()
    x = _inputs()[0]
    with torch.no_grad():
        want = model(x)
    amp_patch.initialize(model if given != "fresh" else None, None, level, verbosity=0)
    try:
        if given == "given, run first":
            assert model(x).dtype != torch.float32  # cast eagerly
        hooks = (list(model._forward_pre_hooks.items()), list(model._forward_hooks.items()))
        if given != "fresh":
            assert hooks != ([], [])
        scripted = torch.jit.script(model)
        assert (list(model._forward_pre_hooks.items()), list(model._forward_hooks.items())) == hooks
        assert not scripted._forward_hooks and not scripted._forward_pre_hooks
        assert "prim::PythonOp" not in str(scripted.inlined_graph)
        with torch.no_grad():
            for _ in range(3):
                got = scripted(x)
                assert got.dtype == torch.float32 and torch.equal(got, want)
    finally:
        amp_patch.deinitialize()
    assert not model._forward_hooks and not model._forward_pre_hooks


_HELPER = """
import torch
import torch.nn.functional as F


@torch.jit.script
def stem(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:   # scripted at import, as timm's
    return F.relu(F.conv2d(x, w, stride=2)).mean(dim=(2, 3))
"""

_SCRIPT = """
import torch, torch.nn as nn, torch.nn.functional as F
import scripted_helper                              # scripts a function at import
{imp}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean((2, 3)))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
{own}
x, w = torch.randn(2, 3, 9, 9), torch.randn(4, 3, 3, 3)
features = scripted_helper.stem(x, w)
eager_dtype = F.conv2d(x, w).dtype
loss = model(x).float().sum()
loss.backward()
opt.step()
exported = torch.jit.script(model)                  # export after training
with torch.no_grad():
    exported_out = exported(x)
    exported_again = exported(x)
with amp_patch.disable_casts():
    want_features = F.relu(F.conv2d(x, w, stride=2)).mean(dim=(2, 3))
    with torch.no_grad():
        want_out = model(x)
"""


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize("front", ["plain", "amp_patch", "apex"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_script_that_scripts_at_import_runs_under_the_launcher(tmp_path, jit_tables, level, front):
    """timm's case: a module the script imports scripts a function at import,
    after the launcher patched; the script then trains and exports its model
    with ``torch.jit.script``. Bare, and with its own (or Apex's) initialize."""
    call = f"(model, opt, opt_level={level!r}, verbosity=0)"
    imp, own = {
        "plain": ("import amp_patch", ""),
        "amp_patch": ("import amp_patch", "model, opt = amp_patch.initialize" + call),
        "apex": ("import amp_patch\nfrom apex import amp", "model, opt = amp.initialize" + call),
    }[front]
    write(tmp_path, "scripted_helper.py", _HELPER)
    script = write(tmp_path, "train.py", _SCRIPT.format(imp=imp, own=own))
    try:
        out = launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype="bfloat16"))
    finally:
        sys.modules.pop("scripted_helper", None)
    assert out["eager_dtype"] == torch.bfloat16  # the launcher's patches were on
    assert out["features"].dtype == torch.float32 and torch.equal(out["features"], out["want_features"])
    for got in (out["exported_out"], out["exported_again"]):
        assert got.dtype == torch.float32 and torch.equal(got, out["want_out"])
    assert not out["model"]._forward_hooks and not out["model"]._forward_pre_hooks
