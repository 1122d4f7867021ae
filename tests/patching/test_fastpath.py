"""The C fast path (``amp_patch/patching/_fastpath.c``) decides exactly as the Python wrappers.

Each case runs twice, once with the C wrapper types and once with the pure-Python
ones (``wrappers.fast`` set to None, as when no compiler was there at install), and
both must give the original op's result on hand-cast inputs, bit for bit, and the
same errors. The generated op tests (test_ops_generated.py) run every listed op
on both paths too, and so do test_patching.py's O1 tests (receivers, promotion,
containers, in-place ops, disable_casts per thread, binding).
"""
from __future__ import annotations

import collections

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
import wrapt

import amp_patch
from amp_patch.base import running
from amp_patch.patching import wrappers
from helpers import HAS_C_COMPILER, amp, fast_path

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


@pytest.fixture
def o4(wrapper_path):
    """O4 (BF16) with the wrapper types of ``wrapper_path``; yields "c" or "python"."""
    amp_patch.initialize(None, None, "O4", verbosity=0)
    try:
        yield wrapper_path
    finally:
        amp_patch.deinitialize()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_the_c_fast_path_is_built_where_a_compiler_is():
    if not HAS_C_COMPILER:
        pytest.skip("no C compiler on this machine: amp_patch runs its pure-Python wrappers")
    assert wrappers.fast, (
        f"a C compiler is here but amp_patch.patching._fastpath is not importable ({wrappers.FAST_UNAVAILABLE}); "
        f"reinstall with `pip install -e .` to build it"
    )


@pytest.mark.quick
def test_printing_fast_says_in_words_which_wrappers_run(monkeypatch):
    if wrappers.fast:
        assert str(wrappers.fast) == (f"the C fast path is in use: patched ops make their common call in C "
                                      f"({wrappers.fast.__file__})")
        assert wrappers.fast.FastOpWrapper  # still the module
    off = wrappers.NoFastPath("AMP_PATCH_PURE_PYTHON is set")
    assert not off
    assert str(off) == ("the C fast path is not in use: patched ops run the pure-Python wrappers, slower per call "
                        "(AMP_PATCH_PURE_PYTHON is set)")
    monkeypatch.setattr(wrappers, "fast", off)
    with amp(None, None, "O4"):
        assert type(torch.mm).__name__ == "OpWrapper"  # initialize builds the Python wrappers


@pytest.mark.quick
def test_c_wrappers_are_wrapt_function_wrappers(o4):
    mm, add = torch.mm, vars(torch.Tensor)["__add__"]
    fast = o4 == "c"
    assert (type(mm).__module__ == "amp_patch.patching._fastpath") is fast
    assert (type(add).__name__ == "FastMethodWrapper") is fast
    for w in (mm, add, F.linear):
        assert isinstance(w, wrapt.FunctionWrapper)
    amp_patch.deinitialize()
    assert mm.__wrapped__ is torch.mm and add.__wrapped__ is torch._C.TensorBase.__add__
    assert mm.__name__ == "mm" and add.__name__ == "__add__"


# (description, call, the same call on hand-cast inputs with torch unpatched);
# the inputs are made once, unpatched, by make().
def make():
    g = torch.Generator().manual_seed(0)
    r = lambda *s, dtype=f32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return dict(
        x=r(4, 4), y=r(4, 4), xb=r(4, 4, dtype=bf16), yb=r(4, 4, dtype=bf16), xh=r(4, 4, dtype=f16),
        xd=r(4, 4, dtype=f64), b=r(4), i=torch.arange(16).reshape(4, 4), odd=r(3, 5),
    )


CASES = [
    ("half op, FP32 inputs", lambda t: torch.mm(t["x"], t["y"]), lambda t: torch.mm(t["x"].to(bf16), t["y"].to(bf16))),
    ("half op, half inputs", lambda t: torch.mm(t["xb"], t["yb"]), lambda t: torch.mm(t["xb"], t["yb"])),
    ("half op, mixed", lambda t: torch.mm(t["xb"], t["y"]), lambda t: torch.mm(t["xb"], t["y"].to(bf16))),
    ("half op, FP16 input", lambda t: torch.mm(t["xh"], t["yb"]), lambda t: torch.mm(t["xh"].to(bf16), t["yb"])),
    ("half op, float64 left alone", lambda t: torch.mm(t["xd"], t["xd"]), lambda t: torch.mm(t["xd"], t["xd"])),
    ("three arguments", lambda t: F.linear(t["x"], t["y"], t["b"]),
     lambda t: F.linear(t["x"].to(bf16), t["y"].to(bf16), t["b"].to(bf16))),
    ("keyword argument", lambda t: F.linear(t["x"], t["y"], bias=t["b"]),
     lambda t: F.linear(t["x"].to(bf16), t["y"].to(bf16), t["b"].to(bf16))),
    ("method", lambda t: t["x"].mm(t["y"]), lambda t: t["x"].to(bf16).mm(t["y"].to(bf16))),
    ("method through the class", lambda t: torch.Tensor.mm(t["x"], t["y"]),
     lambda t: torch.Tensor.mm(t["x"].to(bf16), t["y"].to(bf16))),
    ("bound method kept", lambda t: (lambda m: m(t["y"]))(t["x"].mm), lambda t: t["x"].to(bf16).mm(t["y"].to(bf16))),
    ("operator", lambda t: t["x"] @ t["y"], lambda t: t["x"].to(bf16) @ t["y"].to(bf16)),
    ("promote, mixed", lambda t: t["xb"] + t["y"], lambda t: t["xb"].float() + t["y"]),
    ("promote, one dtype", lambda t: t["xb"] + t["yb"], lambda t: t["xb"] + t["yb"]),
    ("promote, FP16 with BF16", lambda t: torch.add(t["xh"], t["xb"]), lambda t: torch.add(t["xh"].float(), t["xb"].float())),
    ("promote, scalar", lambda t: t["xb"] + 1.5, lambda t: t["xb"] + 1.5),
    ("promote, integer tensor", lambda t: t["xb"] * t["i"], lambda t: t["xb"] * t["i"]),
    ("sequence promote, list", lambda t: torch.cat([t["xb"], t["y"]]), lambda t: torch.cat([t["xb"].float(), t["y"]])),
    ("float op", lambda t: F.mse_loss(t["xb"], t["yb"]), lambda t: F.mse_loss(t["xb"].float(), t["yb"].float())),
    ("float op, keyword", lambda t: F.mse_loss(t["xb"], target=t["yb"]),
     lambda t: F.mse_loss(t["xb"].float(), target=t["yb"].float())),
]


@pytest.mark.parametrize("desc,call,reference", CASES, ids=[c[0] for c in CASES])
def test_result_equals_the_original_on_hand_cast_inputs(o4, desc, call, reference):
    amp_patch.deinitialize()
    want = reference(make())
    amp_patch.initialize(None, None, "O4", verbosity=0)
    got = call(make())
    assert same(got, want), f"{desc} ({o4}): {got.dtype} {got} != {want.dtype} {want}"


ERRORS = [
    ("shape mismatch, no cast", lambda t: torch.mm(t["xb"], t["odd"].to(bf16)), lambda t: torch.mm(t["xb"], t["odd"].to(bf16))),
    ("shape mismatch, cast", lambda t: torch.mm(t["x"], t["odd"]), lambda t: torch.mm(t["x"].to(bf16), t["odd"].to(bf16))),
    ("wrong argument type", lambda t: torch.mm(t["x"], 3), lambda t: torch.mm(t["x"].to(bf16), 3)),
    ("too many arguments", lambda t: torch.mm(t["x"], t["y"], t["y"]),
     lambda t: torch.mm(t["x"].to(bf16), t["y"].to(bf16), t["y"].to(bf16))),
]


@pytest.mark.parametrize("desc,call,reference", ERRORS, ids=[c[0] for c in ERRORS])
def test_errors_are_the_original_ops_errors(o4, desc, call, reference):
    amp_patch.deinitialize()
    with pytest.raises(Exception) as want:
        reference(make())
    amp_patch.initialize(None, None, "O4", verbosity=0)
    with pytest.raises(type(want.value)) as got:
        call(make())
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]


def test_disable_casts_and_a_finished_session_call_straight_through(o4):
    t = make()
    with amp_patch.disable_casts():
        assert torch.mm(t["x"], t["y"]).dtype == f32
        assert (t["xb"] + t["y"]).dtype == f32  # torch's own promotion
    assert torch.mm(t["x"], t["y"]).dtype == bf16
    kept, kept_add = torch.mm, vars(torch.Tensor)["__add__"]
    amp_patch.deinitialize()
    assert same(kept(t["x"], t["y"]), torch.mm(t["x"], t["y"]))
    assert same(kept_add(t["x"], t["y"]), t["x"] + t["y"])


def test_weights_are_cast_once_through_the_cache(o4):
    t = make()
    w = torch.nn.Parameter(t["y"])
    cache = running.session().cache
    hits, misses = cache.hits, cache.misses
    outs = [torch.mm(t["x"], w) for _ in range(3)]
    assert (cache.misses - misses, cache.hits - hits) == (1, 2)
    assert all(o.dtype == bf16 and o.requires_grad for o in outs)
    with torch.no_grad():
        w.mul_(2)  # bumps the version: the next use casts again
    out = torch.mm(t["x"], w)
    assert cache.misses - misses == 2
    amp_patch.deinitialize()
    assert same(out.detach(), torch.mm(t["x"].to(bf16), w.detach().to(bf16)))


def test_a_miss_on_the_c_path_keeps_the_copy_the_python_path_would(o4):
    """A weight the C path casts on a miss is stored as ``CastCache.cast`` stores it (a
    ``CacheEntry`` under the weight's id, in the map of the grad mode it was made in),
    so the Python wrappers' cache serves that very copy; a tensor subclass is cast but
    not kept, as in Python."""
    from amp_patch.patching.cast import CacheEntry

    t = make()
    w = torch.nn.Parameter(t["y"].clone())
    cache = running.session().cache
    misses = cache.misses
    out = torch.mm(t["x"], w)
    entry = cache._maps[1][id(w)]
    assert type(entry) is CacheEntry and cache.misses - misses == 1
    assert entry.tensor is w and entry.to is bf16 and entry.version == w._version and entry.data_ptr == w.data_ptr()
    assert cache.cast(w, bf16) is entry.copy and entry.copy.dtype == bf16
    assert same(out.detach(), torch.mm(t["x"].to(bf16), w.detach().to(bf16)))

    class Sub(torch.Tensor):
        pass

    sub = torch.Tensor._make_subclass(Sub, t["y"].clone(), True)  # a leaf that requires grad
    assert sub.is_leaf and sub.requires_grad
    misses = cache.misses
    assert torch.mm(t["x"], sub).dtype == bf16
    assert id(sub) not in cache._maps[1] and cache.misses == misses


def test_a_cached_weight_copy_is_served_only_while_it_is_valid(o4):
    """The cache's hit check (in C on the fast path) refuses a copy whose weight
    changed in place, got new storage, stopped requiring grad, or that was made
    in the other grad mode; every result equals the op on the weight cast now."""
    t = make()
    w = torch.nn.Parameter(t["y"].clone())
    cache = running.session().cache

    def check(expect_hit: bool) -> torch.Tensor:
        hits = cache.hits
        out = torch.mm(t["x"], w)
        assert cache.hits - hits == int(expect_hit)
        with amp_patch.disable_casts():
            assert same(out.detach(), torch.mm(t["x"].to(bf16), w.detach().to(bf16)))
        return out

    check(False)
    check(True)
    with torch.no_grad():
        w.add_(1.0)  # version counter
    check(False)
    w.data = torch.randn(4, 4)  # new storage, same version counter
    check(False)
    check(True)
    with torch.no_grad():  # a copy made without grad has no history ...
        check(False)
        check(True)
    assert check(True).grad_fn is not None  # ... and never serves a forward that needs it
    act = w * 1.0  # an activation (requires grad, not a leaf) is never the cache's
    counts = (cache.hits, cache.misses)
    out = torch.mm(t["x"], act)
    assert (cache.hits, cache.misses) == counts and out.grad_fn is not None
    with amp_patch.disable_casts():
        assert same(out.detach(), torch.mm(t["x"].to(bf16), act.detach().to(bf16)))
    w.requires_grad_(False)  # frozen: cast each time, not from the cache
    check(False)
    check(False)


def test_gradients_flow_to_the_fp32_weight(o4):
    t = make()
    w = torch.nn.Parameter(t["y"].clone())
    torch.mm(t["x"], w).float().sum().backward()
    assert w.grad is not None and w.grad.dtype == f32
    amp_patch.deinitialize()
    w2 = torch.nn.Parameter(t["y"].clone())
    torch.mm(t["x"].to(bf16), w2.to(bf16)).float().sum().backward()
    assert same(w.grad, w2.grad)


def test_many_arguments_and_a_user_class_method(wrapper_path):
    class Ext:
        def combine(self, *ts):
            return sum(ts[1:], ts[0])

    def combine(*ts):
        return sum(ts[1:], ts[0])

    mod = type(sys)("user_ext")
    mod.combine = combine
    amp_patch.register_half_function(mod, "combine")
    amp_patch.register_half_function(Ext, "combine")
    try:
        amp_patch.initialize(None, None, "O4", verbosity=0)
        ts = [torch.full((2,), float(i)) for i in range(11)]  # more than the C path's 8 on the stack
        for out in (mod.combine(*ts), Ext().combine(*ts)):
            assert out.dtype == bf16 and out.tolist() == [55.0, 55.0]
    finally:
        amp_patch.deinitialize()
        from amp_patch import frontend

        frontend._user_registrations.clear()


def test_find_overflow_diverts_every_call_to_the_python_wrappers(o4):
    t = make()
    assert not wrappers.python_only
    amp_patch.find_overflow()
    try:
        assert wrappers.python_only
        assert torch.mm(t["x"], t["y"]).dtype == bf16
    finally:
        running.session().diagnostics.watch.disarm()
    assert not wrappers.python_only


def test_no_reference_is_leaked_per_call(o4):
    t = make()
    w = torch.nn.Parameter(t["y"])
    calls = [lambda: torch.mm(t["x"], w), lambda: torch.mm(t["xb"], t["yb"]), lambda: t["xb"] + t["y"],
             lambda: t["x"].mm(t["y"])]
    for call in calls:
        call()
    cached = running.session().cache._maps[True][id(w)][4]  # w's BF16 copy, returned by every cache hit
    watched = (t["x"], t["y"], t["xb"], t["yb"], w, cached, bf16, f32)
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(1000):
        for call in calls:
            call()
    after = [sys.getrefcount(o) for o in watched]
    assert after == before


def test_wrappers_are_freed_after_deinitialize(o4):
    ref = weakref.ref(torch.mm)
    amp_patch.deinitialize()
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_pure_python_environment_variable():
    code = (
        "import torch, amp_patch\n"
        "from amp_patch.patching import wrappers\n"
        "amp_patch.initialize(None, None, 'O4', verbosity=0)\n"
        "print(not wrappers.fast, type(torch.mm).__name__, torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype)\n"
    )
    env = dict(os.environ, AMP_PATCH_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "OpWrapper", "torch.bfloat16"]


def test_a_torch_function_kept_as_a_class_attribute_binds_as_unpatched(wrapper_path):
    """``act = torch.mm`` on a class: a builtin stays unbound, a Python function
    (F.mse_loss) binds its instance, with torch patched as without it."""

    def probe():
        class Holder:
            lin, mse, mm = F.linear, F.mse_loss, torch.mm

        h, x, w = Holder(), torch.ones(3, 4), torch.ones(5, 4)
        calls = (lambda: h.lin(x, w), lambda: Holder.lin(x, w), lambda: h.mse(x, x),
                 lambda: Holder.mse(x, x), lambda: h.mm(x, w.t()))
        out = []
        for call in calls:
            try:
                out.append(call().dtype)
            except AttributeError:  # the instance taken for the input, as unpatched
                out.append("binds")
        return out

    assert probe() == [f32, f32, "binds", f32, f32]
    amp_patch.initialize(None, None, "O4", verbosity=0)
    try:
        assert probe() == [bf16, bf16, "binds", f32, bf16]
    finally:
        amp_patch.deinitialize()


def test_wrapper_types_keep_their_reference_count_over_sessions():
    """Each C wrapper owns one reference to its type and gives it back when
    freed (wrapt's heap types release it themselves, its static ones do not)."""
    fast = fast_path()
    types = (fast.FastOpWrapper, fast.FastMethodWrapper)
    gc.collect()
    before = [sys.getrefcount(t) for t in types]
    for _ in range(5):
        amp_patch.initialize(None, None, "O4", verbosity=0)
        assert isinstance(torch.mm, types[0]) and isinstance(vars(torch.Tensor)["__add__"], types[1])
        amp_patch.deinitialize()
        gc.collect()
    assert [sys.getrefcount(t) for t in types] == before


@pytest.mark.slow
def test_wrapt_without_its_c_extension_still_patches_correctly_and_says_what_it_costs():
    """WRAPT_DISABLE_EXTENSIONS=1: wrapt's pure-Python wrappers carry the patches
    (results as with the C types), and initialize warns, naming the fix."""
    code = (
        "import torch, torch.nn.functional as F, amp_patch\n"
        "from amp_patch.patching import wrappers\n"
        "from amp_patch.oplists import NAMESPACES\n"
        "before = {n: dict(vars(o)) for n, o in NAMESPACES.items()}\n"
        "x, w = torch.randn(3, 4), torch.nn.Parameter(torch.randn(5, 4))\n"
        "want = F.linear(x.bfloat16(), w.bfloat16()), x.bfloat16() + w.t()[:3, :4]\n"
        "amp_patch.initialize(None, None, 'O4')\n"
        "got = F.linear(x, w), x.bfloat16() + w.t()[:3, :4]\n"
        "amp_patch.deinitialize()\n"
        "same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))\n"
        "left = [k for n, o in NAMESPACES.items() for k in set(vars(o)) | set(before[n]) if vars(o).get(k) is not before[n].get(k)]\n"
        "print(not wrappers.fast, same, left)\n"
    )
    env = dict(os.environ, WRAPT_DISABLE_EXTENSIONS="1")
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "[]"]
    assert "wrapt's C extension is not in use (WRAPT_DISABLE_EXTENSIONS is set)" in out.stderr
    assert "Unset WRAPT_DISABLE_EXTENSIONS" in out.stderr


# ------------------------------------------------------------ one spec, two paths


def test_the_c_path_checks_the_layouts_it_reads_by_position():
    """``bind`` refuses an ``OpSpec`` or ``CacheEntry`` whose fields moved, naming the
    fix, and leaves the module bound as it was; a constructor given anything but a
    spec is refused too."""
    from amp_patch.patching.cast import CacheEntry
    from amp_patch.patching.spec import OpSpec

    fast = fast_path()
    moved = (OpSpec._fields[1], OpSpec._fields[0]) + OpSpec._fields[2:]
    with pytest.raises(ImportError, match=r"spec\.OpSpec's fields are not the ones _fastpath\.c reads by position; rebuild"):
        fast.bind(wrappers.disabled, wrappers.python_only, moved, CacheEntry)
    short = collections.namedtuple("CacheEntry", CacheEntry._fields[:-1])
    with pytest.raises(ImportError, match=r"cast\.CacheEntry's fields"):
        fast.bind(wrappers.disabled, wrappers.python_only, OpSpec._fields, short)
    with pytest.raises(TypeError, match="spec is not an amp_patch.patching.spec.OpSpec"):
        fast.FastOpWrapper(torch.mm, wrappers._call_through, (f32, bf16))
    # still bound to the module's own switches: casting goes on, and disable_casts reaches C
    amp_patch.initialize(None, None, "O4", verbosity=0)
    try:
        assert type(torch.mm) is fast.FastOpWrapper
        x = torch.randn(4, 4)
        assert torch.mm(x, x).dtype == bf16
        with amp_patch.disable_casts():
            assert torch.mm(x, x).dtype == f32
    finally:
        amp_patch.deinitialize()


_SIZED = [
    ("torch.nn.functional.linear", F.linear, lambda g: (torch.randn(3, 5, 7, generator=g), torch.randn(6, 7, generator=g))),
    ("torch.mm", torch.mm, lambda g: (torch.randn(5, 7, generator=g), torch.randn(7, 9, generator=g))),
    ("torch.bmm", torch.bmm, lambda g: (torch.randn(2, 5, 7, generator=g), torch.randn(2, 7, 3, generator=g))),
    ("torch.addmm", torch.addmm, lambda g: (torch.randn(9, generator=g), torch.randn(5, 7, generator=g),
                                            torch.randn(7, 9, generator=g))),
    ("torch.nn.functional.conv2d", F.conv2d, lambda g: (torch.randn(2, 3, 6, 6, generator=g),
                                                       torch.randn(4, 3, 3, 3, generator=g))),
]


@pytest.mark.parametrize("qualname,op,make", _SIZED, ids=[s[0] for s in _SIZED])
def test_c_and_python_count_a_calls_flops_alike_at_the_threshold(qualname, op, make, monkeypatch):
    """Under ``cast_policy="auto"`` both paths read the op's FLOP formula from its
    spec: a call exactly at the threshold casts, one FLOP under it stays FP32, on
    either path (the C formula and ``costs.flops`` agree to the FLOP)."""
    from amp_patch.patching import costs
    from amp_patch.patching.spec import Casting

    fast = fast_path()
    args = make(torch.Generator().manual_seed(0))
    n = costs.flops(costs.FLOPS[qualname], args)
    assert n is not None and n > 0
    for min_flops, want in ((n, bf16), (n + 1, f32)):
        casting = Casting(bf16, wrappers.Live(), min_flops=min_flops)
        c = wrappers.make_wrapper("half", qualname, op, method=False, casting=casting)
        assert isinstance(c, fast.FastOpWrapper)
        monkeypatch.setattr(wrappers, "fast", None)
        py = wrappers.make_wrapper("half", qualname, op, method=False, casting=casting)
        monkeypatch.undo()
        assert not isinstance(py, fast.FastOpWrapper)
        for wrapper in (c, py):
            out = wrapper(*args)
            assert out.dtype == want, (type(wrapper).__name__, min_flops)
            assert torch.equal(out, op(*[a.to(want) for a in args]))
