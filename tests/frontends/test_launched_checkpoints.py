"""What a launched FP32 script checkpoints, and the optimizer wrappers trainers build.

Hugging Face's ``Trainer`` builds an AdamW, wraps it in Accelerate's
``AcceleratedOptimizer`` (an ``Optimizer`` subclass that holds the AdamW and
calls its ``step``), and checkpoints ``optimizer.state_dict()`` with the model.
``WRAPPER`` below is that wrapper's shape, so the tests need no Accelerate.
"""
from __future__ import annotations

import pytest
import torch

import amp_patch
from amp_patch.frontends import carry, launcher
from amp_patch.frontends.launcher import Settings
from helpers import write

f16 = "float16"
pytestmark = pytest.mark.filterwarnings("ignore:amp_patch. O.* runs in:amp_patch.AmpWarning")

WRAPPER = """
import torch, torch.nn as nn, torch.nn.functional as F


class Wrapped(torch.optim.Optimizer):
    '''Accelerate's AcceleratedOptimizer, in short: no Optimizer.__init__, the
    inner optimizer's groups and state, its state dict round-tripped once.'''

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.optimizer.load_state_dict(self.optimizer.state_dict())

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=None):
        self.optimizer.zero_grad()

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)
"""

TRAIN = WRAPPER + """
import os, sys
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
inner = torch.optim.Adam(model.parameters(), lr=1e-2)
optimizer = Wrapped(inner) if WRAP else inner
g = torch.Generator().manual_seed(1)
x, y = torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
start = 0
if RESUME:
    ckpt = torch.load(RESUME)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    start = ckpt["step"]
scales = []
for step in range(start, STEPS):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    if step == 2:
        loss = loss * 1e6  # its gradients overflow FP16 at the first scale: a skipped step, the scale halves
    loss.backward()
    optimizer.step()
    if step + 1 == SAVE:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, SAVE_TO)
final = {k: v.detach().clone() for k, v in model.state_dict().items()}
"""


def launch(tmp_path, level, half, wrap=True, steps=8, resume=None, save=None, save_to=None):
    script = write(tmp_path, "train.py", TRAIN.replace(
        "import os, sys", f"import os, sys\nWRAP, STEPS, RESUME, SAVE, SAVE_TO = {wrap!r}, {steps}, {resume!r}, {save!r}, {save_to!r}"))
    return launcher.run(str(script), [], Settings.resolve(opt_level=level, half_dtype=half))


@pytest.mark.parametrize("level,half", [("O1", f16), ("O2", f16), ("O5", "bfloat16")])
def test_a_wrapper_optimizer_around_an_attached_one_steps_it_once(tmp_path, level, half):
    """The launcher attaches the AdamW and leaves its wrapper alone: each step
    is counted once (the skipped one included), and the run is the one the
    bare AdamW gives. Attached too, the wrapper counted every step twice, and
    at O2 it was refused (its groups are the AdamW's FP32 masters, which no
    model holds)."""
    out = launch(tmp_path, level, half, wrap=True)
    ended = amp_patch.counters()  # the launched session's, after it ended
    bare = launch(tmp_path, level, half, wrap=False)
    skipped = 1 if half == f16 else 0
    assert (ended["steps"], ended["skipped"]) == (8 - skipped, skipped), ended
    for k, v in bare["final"].items():
        assert torch.equal(out["final"][k], v), k


def _scaler(tmp_path, **kw):
    out = launch(tmp_path, "O2", f16, **kw)
    return out, amp_patch.counters()


def test_a_resumed_fp16_run_continues_the_one_that_never_stopped(tmp_path):
    """The script checkpoints only ``model.state_dict()`` and
    ``optimizer.state_dict()``: the loss scaler's state (halved by the overflow
    at step 2) rides in the optimizer's, so the run resumed at step 5 ends bit
    for bit where the one that never stopped ends, with its loss scale."""
    path = str(tmp_path / "ckpt.pt")
    straight, straight_end = _scaler(tmp_path, steps=10)
    _scaler(tmp_path, steps=5, save=5, save_to=path)
    saved = torch.load(path)  # weights_only=True, torch's default: plain numbers
    assert saved["optimizer"][carry.KEY]["loss_scaler0"]["loss_scale"] == 32768.0
    resumed, resumed_end = _scaler(tmp_path, steps=10, resume=path)
    assert resumed_end["loss_scale"] == straight_end["loss_scale"] == [32768.0]
    for k, v in straight["final"].items():
        assert torch.equal(resumed["final"][k], v), k


def test_the_carried_state_costs_plain_torch_nothing_and_bf16_carries_none(tmp_path):
    """Loaded where amp_patch does not run, the optimizer's state dict is
    torch's own plus a key torch ignores; a BF16 run (no scaler at work) adds
    no key at all."""
    path16, path_bf16 = str(tmp_path / "fp16.pt"), str(tmp_path / "bf16.pt")
    launch(tmp_path, "O2", f16, steps=4, save=4, save_to=path16)
    launch(tmp_path, "O5", "bfloat16", steps=4, save=4, save_to=path_bf16)
    assert carry.KEY not in torch.load(path_bf16)["optimizer"]
    ckpt = torch.load(path16)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model.load_state_dict(ckpt["model"])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    optimizer.load_state_dict(ckpt["optimizer"])
    assert set(optimizer.state_dict()) == {"state", "param_groups"}
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3  # four steps, one skipped
    assert not optimizer._optimizer_state_dict_post_hooks and not optimizer._optimizer_load_state_dict_pre_hooks
