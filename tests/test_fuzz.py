"""Property tests: random op-list overrides, and random sequences of
initialize / deinitialize / training steps.

Invariants checked after every example and every step:
  * a valid override applies exactly (each op under the policy it names, a
    removed op left unpatched); an invalid one raises ``ListError`` and
    changes nothing;
  * while initialized, every patched attribute is one of our wrappers around
    the *original* function (never a wrapper of a wrapper);
  * while not initialized, ``torch``, ``torch.nn.functional``, ``torch.Tensor``
    and the other namespaces hold exactly the objects they held at the start,
    and the model is FP32 with its own parameter objects in the optimizer.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import amp_patch
from helpers import Snapshot
from amp_patch import ConfigError, ListError, StateError, oplists
from amp_patch.oplists import NAMESPACES
from amp_patch.oplists.schema import POLICIES

# FP16 on the CPU is deliberate here; amp_patch's advice to use BF16 there is
# not what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::amp_patch.AmpWarning")

_DEFAULTS = oplists.load(None).entries
#: the ops the default lists name, per namespace (the pool valid overrides draw from)
POOL = {ns: sorted({e.name for e in _DEFAULTS if e.namespace == ns and oplists.op_exists(ns, e.name)}) for ns in NAMESPACES}
POOL = {ns: names for ns, names in POOL.items() if names}
#: what each of those attributes is before anything is patched
ORIGINAL = {(ns, n): getattr(NAMESPACES[ns], n) for ns, names in POOL.items() for n in names}
SNAPSHOT = Snapshot()
DEFAULT_TABLE = {half: oplists.OpTable(_DEFAULTS).resolve(half, "cpu") for half in (torch.float16, torch.bfloat16)}

#: a misspelling, a real torch module that amp_patch does not patch, a wrong case
BAD_NAMESPACES = ["torch.nn.functionl", "torch.sparse", "Torch"]
BAD_POLICIES = ["halff", "fp32", "Float"]
BAD_OPS = ["sofmax", "not_an_op", "__nope__"]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def overrides(draw):
    """A dict override and whether it is valid; about half are."""
    valid = True
    doc = {}
    for ns in draw(st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=3, unique=True)):
        if draw(st.integers(0, 19)) == 0:
            ns, valid = draw(st.sampled_from(BAD_NAMESPACES)), False
        body = doc.setdefault(ns, {})
        names = draw(st.lists(st.sampled_from(POOL.get(ns, BAD_OPS)), min_size=1, max_size=4, unique=True))
        for name in names:
            pol = draw(st.sampled_from(POLICIES + ("remove",)))
            if draw(st.integers(0, 19)) == 0:
                pol, valid = draw(st.sampled_from(BAD_POLICIES)), False
            if draw(st.integers(0, 19)) == 0:
                name, valid = draw(st.sampled_from(BAD_OPS)), False
            body.setdefault(pol, []).append(name)
        if draw(st.integers(0, 9)) == 0:
            # the same op under a second policy of the same override
            pols = [p for p in POLICIES if p in body]
            if pols:
                other = draw(st.sampled_from([p for p in POLICIES if p != pols[0]]))
                body.setdefault(other, []).append(body[pols[0]][0])
                valid = False
    return doc, valid


@settings(max_examples=60, **SETTINGS)
@given(case=overrides(), half=st.sampled_from([torch.float16, torch.bfloat16]))
def test_random_op_list_overrides(case, half):
    doc, valid = case
    from amp_patch.base import running

    if not valid:
        with pytest.raises(ListError):
            amp_patch.initialize(None, None, "O1", half_dtype=half, lists=doc)
        assert not amp_patch.is_initialized() and SNAPSHOT.changed() == []
        return
    amp_patch.initialize(None, None, "O1", half_dtype=half, lists=doc, verbosity=0)
    try:
        amp = running.session()
        for ns, body in doc.items():
            owner = NAMESPACES[ns]
            placed = {n: pol for pol, names in body.items() if pol != "remove" for n in names}
            for n in {n for names in body.values() for n in names}:
                if n in placed:
                    want = placed[n]
                    if want == "banned" and half == torch.bfloat16:
                        want = "float"  # BF16 runs banned ops in FP32
                    assert amp.table[(ns, n)].policy == want, (ns, n)
                    assert amp.patcher.is_patched(owner, n)
                    assert getattr(owner, n).__wrapped__ is ORIGINAL[(ns, n)]
                else:  # removed and not placed again: left alone
                    assert (ns, n) not in amp.table
                    assert getattr(owner, n) is ORIGINAL[(ns, n)]
        # Every op the override did not name keeps its default policy; an
        # implied in-place form follows its op (exp_ follows exp) instead.
        named = {(ns, n) for ns, body in doc.items() for names in body.values() for n in names}
        default = DEFAULT_TABLE[half]
        for key, entry in default.items():
            if key in named:
                continue
            base = (key[0], entry.derived_from)
            if entry.derived_from and base in named:
                placed_as = next((pol for pol, names in doc[key[0]].items() if entry.derived_from in names), None)
                want = placed_as if placed_as in ("half", "float", "promote") else None
                got = amp.table[key].policy if key in amp.table else None
                assert got == want, (key, placed_as)
            else:
                assert amp.table[key].policy == entry.policy, key
    finally:
        amp_patch.deinitialize()
    assert SNAPSHOT.changed() == []


@settings(max_examples=25, **SETTINGS)
@given(doc=st.dictionaries(st.text(max_size=8), st.dictionaries(st.text(max_size=6), st.lists(st.text(max_size=6), max_size=3), max_size=2), max_size=2))
def test_arbitrary_structures_never_patch_half_way(doc):
    try:
        amp_patch.initialize(None, None, "O1", lists=doc, verbosity=0)
    except ListError:
        assert not amp_patch.is_initialized() and SNAPSHOT.changed() == []
    else:
        amp_patch.deinitialize()
        assert SNAPSHOT.changed() == []


# ---------------------------------------------------------------- random call sequences


class Sessions(RuleBasedStateMachine):
    """One model and optimizer through random initialize/train/deinitialize calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        self.params = list(self.model.parameters())
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.level = None
        self.x, self.t = torch.randn(4, 6), torch.randn(4, 2)

    def _loss(self):
        return F.mse_loss(self.model(self.x).float(), self.t)

    @rule(level=st.sampled_from(["O0", "O1", "O2", "O3", "O4", "O5"]), half=st.sampled_from([torch.float16, torch.bfloat16]))
    def initialize(self, level, half):
        if self.level is None:
            self.model, self.opt = amp_patch.initialize(self.model, self.opt, level, half_dtype=half, verbosity=0)
            self.level = level
            return
        from amp_patch.base import running

        amp = running.session()
        n = len(amp.patcher)
        with pytest.raises(ConfigError, match="already (initialized|attached)"):
            amp_patch.initialize(self.model, self.opt, level, half_dtype=half, verbosity=0)
        assert len(amp.patcher) == n and running.session() is amp

    @rule()
    def deinitialize(self):
        amp_patch.deinitialize()
        self.level = None

    @rule()
    def plain_step(self):
        self.opt.zero_grad()
        self._loss().backward()
        self.opt.step()

    @rule()
    def scale_loss_step(self):
        self.opt.zero_grad()
        loss = self._loss()
        if self.level is None:
            with pytest.raises(StateError):
                with amp_patch.scale_loss(loss, self.opt):
                    pass
            return
        with amp_patch.scale_loss(loss, self.opt) as scaled:
            scaled.backward()
        self.opt.step()

    @rule()
    def exception_inside_the_step(self):
        self.opt.zero_grad()
        with pytest.raises(KeyError):
            with amp_patch.disable_casts():
                loss = self._loss()
                loss.backward()
                raise KeyError("user code failed")

    @rule()
    def evaluate(self):
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.x)
        self.model.train()
        assert out.dtype in (torch.float32, torch.float16, torch.bfloat16)

    @invariant()
    def torch_is_patched_once_or_not_at_all(self):
        from amp_patch.base import running

        amp = running.session()
        assert (amp is None) == (self.level is None)
        if amp is None:
            assert SNAPSHOT.changed() == []
            assert all(p.dtype == torch.float32 for p in self.model.parameters())
            assert [id(p) for p in self.model.parameters()] == [id(p) for p in self.params]
            assert [id(p) for p in self.opt.param_groups[0]["params"]] == [id(p) for p in self.params]
            return
        if amp.table:
            for (ns, n) in amp.table:
                current = getattr(NAMESPACES[ns], n)
                assert current is not ORIGINAL[(ns, n)] and current.__wrapped__ is ORIGINAL[(ns, n)], (ns, n)
        assert len({(id(r.owner), r.name) for r in amp.patcher._index.values()}) == len(amp.patcher)
        assert all(torch.isfinite(p).all() for p in self.model.parameters())

    def teardown(self):
        amp_patch.deinitialize()
        assert SNAPSHOT.changed() == []


Sessions.TestCase.settings = settings(max_examples=20, stateful_step_count=10, **SETTINGS)
test_random_call_sequences = Sessions.TestCase
