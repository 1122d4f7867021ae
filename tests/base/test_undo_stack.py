"""The process's one undo stack (``amp_patch.base.undo``): the patch registry,
the launcher's hooks and alias, and each session push onto it, each under
its own name, and each pops only its own entries."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amp_patch
from amp_patch import amp
from amp_patch.base import running
from amp_patch.base.undo import STACK, Owned, UndoStack
from amp_patch.frontends import launcher
from helpers import Snapshot


def test_each_owner_pops_only_its_own_entries_newest_first():
    stack, done = UndoStack(), []
    a, b = Owned("a", stack), Owned("b", stack)
    a.push(lambda: done.append("a1"))
    b.push(lambda: done.append("b1"))
    mark = a.mark()
    a.push(lambda: done.append("a2"), "patch")
    b.push(lambda: done.append("b2"))
    a.push(lambda: done.append("a3"))
    a.pop_to(mark)
    assert done == ["a3", "a2"] and len(a) == 1 and len(b) == 2
    b.pop_to(0)
    assert done == ["a3", "a2", "b2", "b1"] and len(b) == 0 and len(a) == 1


def test_popping_one_kind_leaves_the_rest():
    stack, done = UndoStack(), []
    a = Owned("a", stack)
    a.push(lambda: done.append("change"))
    a.push(lambda: done.append("patch1"), "patch")
    a.push(lambda: done.append("hook"))
    a.push(lambda: done.append("patch2"), "patch")
    a.pop_to(0, "patch")
    assert done == ["patch2", "patch1"] and a.count("patch") == 0 and len(a) == 2


def test_a_failing_undo_does_not_stop_the_others_and_its_error_comes_last():
    stack, done = UndoStack(), []
    a = Owned("a", stack)
    a.push(lambda: done.append(1))

    def boom():
        raise RuntimeError("undo failed")

    a.push(boom)
    a.push(lambda: done.append(3))
    with pytest.raises(RuntimeError, match="undo failed"):
        a.pop_to(0)
    assert done == [3, 1] and len(a) == 0


def test_a_session_and_a_launch_share_the_stack_and_end_separately():
    before = Snapshot()
    launch = launcher.Launch(launcher.Settings.resolve(opt_level="O1", half_dtype="bfloat16"))
    launch.start()
    try:
        session = running.session()
        assert session is not None and session is launch.amp
        mine, theirs = STACK.entries(launch), STACK.entries(session)
        assert mine and theirs and any(e.kind == "patch" for e in theirs)
        amp_patch.deinitialize()  # the script turns AMP off: the session's entries go, the launch's stay
        assert STACK.entries(session) == [] and STACK.entries(launch) == mine
        assert F.linear is before["torch.nn.functional"]["linear"]
    finally:
        launch.stop()
    assert STACK.entries(launch) == [] and before.changed() == []


def test_apex_deactivate_takes_off_only_the_sessions_function_patches():
    before = Snapshot()
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    try:
        session = running.session()
        kinds = {e.kind for e in STACK.entries(session)}
        assert "patch" in kinds and kinds - {"patch"}
        amp._amp_state.handle._deactivate()
        assert F.linear is before["torch.nn.functional"]["linear"]
        left = STACK.entries(session)
        assert left and all(e.kind != "patch" for e in left)
        assert running.session() is session and session.attached(opt)  # the rest of the run stays
    finally:
        amp_patch.deinitialize()
    assert STACK.entries(session) == [] and before.changed() == []
