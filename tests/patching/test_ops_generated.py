"""Op tests generated from the default op lists.

For every op in ``lists/*.yaml`` (its namespace form and, where one exists,
its ``Tensor`` method form), under FP16 and under BF16:

* the patched op's result equals, bit for bit, the ORIGINAL op (captured
  before ``initialize``) called on inputs cast by hand as its policy says:
  ``half`` to the half dtype, ``float`` to FP32, ``promote`` to the widest
  input dtype, in-place ops to the receiver's dtype; ``banned`` raises
  ``BannedOpError`` under FP16 and runs in FP32 under BF16;
* every floating-point output has the dtype the policy runs the op in;
* an op whose entries are all for the other dtype is left unpatched.

Each op runs on three input sets built from its sample in
``tests/op_samples.py``: all FP32, all in the half dtype, and mixed (the first
floating tensor in the half dtype, the others FP32).

Agreement with PyTorch's autocast, for every op both cover:

* BF16: the output dtype equals the original op's under
  ``torch.autocast("cpu", dtype=torch.bfloat16)``;
* FP16: the output dtype equals what the CUDA autocast policy of torch 2.13
  (embedded below as ``CUDA_AUTOCAST``, checked against the installed torch's
  dispatcher) gives.

Promotion tables: promote ops over every pair of input dtypes, in-place
promote ops keeping the receiver's dtype, and in-place float ops refusing a
half receiver.
"""
from __future__ import annotations

import functools
import os
import re
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch

import amp_patch
import op_samples
from amp_patch import oplists
from amp_patch.patching import wrappers
from amp_patch.oplists import NAMESPACES

f16, bf16, f32, f64, i64 = torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64
CASTABLE = (f16, bf16, f32)
LOW = (f16, bf16)
HALF = {"float16": f16, "bfloat16": bf16}
DNAMES = list(HALF)
DNAME_OF = {v: k for k, v in HALF.items()}
VARIANTS = ("fp32", "half", "mixed")
FUNCTION_NAMESPACES = ("torch", "torch.nn.functional", "torch.linalg", "torch.special", "torch.fft")
INPLACE_DUNDERS = frozenset(
    f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")
)

pytestmark = [
    # Deprecated ops in the lists (chain_matmul, torch.cholesky, F.upsample*) warn on every call.
    pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning"),
    # Unlisted ops given mixed inputs run unfused, as they would without amp_patch.
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning"),
]

DEFAULTS = oplists.load()
ENTRIES = DEFAULTS.entries


@pytest.fixture(scope="module", autouse=True)
def default_lists_parsed_once():
    """Parse the shipped lists once for this module.

    ``initialize`` reads and validates the YAML on every call (about 0.15 s);
    these tests call it about a thousand times with the defaults and nothing
    else. Calls with ``lists=`` or ``$AMP_PATCH_LISTS`` still go through the
    real loader.
    """
    real = oplists.load

    def load(lists: Any = None) -> oplists.OpTable:
        if lists is None and not os.environ.get(oplists.ENV_VAR, "").strip():
            return DEFAULTS
        return real(lists)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oplists, "load", load)
        yield


@pytest.fixture(scope="module", autouse=True)
def warning_registries_exist():
    """Give the torch modules their ``__warningregistry__`` before any test.

    The first warning raised from a module's code (a deprecated op warns on
    every call) creates that dict in the module, which the autouse fixture
    of conftest.py would report as an attribute left on torch.
    """
    created = [
        m for m in NAMESPACES.values() if isinstance(m, types.ModuleType) and "__warningregistry__" not in vars(m)
    ]
    for mod in created:
        mod.__warningregistry__ = {}
    yield
    for mod in created:
        del mod.__warningregistry__


@pytest.fixture
def o1():
    """Start O1 in the given half dtype; always deinitialize.

    ``verbosity=0`` skips the set-up warnings, whose scan of every loaded
    module for captured torch functions would dominate these tests' time.
    """

    def start(half: torch.dtype, **kw: Any) -> None:
        amp_patch.initialize(None, None, "O1", half_dtype=half, verbosity=0, **kw)

    try:
        yield start
    finally:
        amp_patch.deinitialize()


# ------------------------------------------------------------------ forms


def split(form: str) -> Tuple[str, str]:
    ns, _, name = form.rpartition(".")
    return ns, name


def short(form: str) -> str:
    """A readable test id: F.linear, Tensor.__add__, linalg.det, torch.exp."""
    for long, abbrev in (("torch.nn.functional.", "F."), ("torch.Tensor.", "Tensor."), ("torch.linalg.", "linalg."),
                         ("torch.special.", "special."), ("torch.fft.", "fft."), ("torch._VF.", "_VF.")):
        if form.startswith(long):
            return abbrev + form[len(long):]
    return form


def is_inplace(form: str) -> bool:
    ns, name = split(form)
    return name in INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def exists(form: str) -> bool:
    ns, name = split(form)
    return callable(getattr(NAMESPACES[ns], name, None))


LISTED = sorted({e.qualname for e in ENTRIES})


def _method_forms() -> Dict[str, List[str]]:
    """``Tensor.X`` -> the listed function ops ``X`` whose method form it is."""
    out: Dict[str, List[str]] = {}
    for q in LISTED:
        ns, name = split(q)
        if ns in FUNCTION_NAMESPACES and hasattr(torch.Tensor, name) and q not in op_samples.METHOD_FORM_EXCLUDED:
            out.setdefault(f"torch.Tensor.{name}", []).append(q)
    return out


METHOD_FORMS = _method_forms()
#: every form tested, and the listed op whose policy it follows
FORMS: Dict[str, str] = {q: q for q in LISTED}
for _m, _fns in METHOD_FORMS.items():
    FORMS.setdefault(_m, _fns[0])


_ENTRIES_BY_NAME: Dict[str, List[oplists.Entry]] = {}
for _e in ENTRIES:
    _ENTRIES_BY_NAME.setdefault(_e.qualname, []).append(_e)


def policy(qualname: str, dname: str) -> Tuple[Optional[str], Optional[oplists.Entry]]:
    """The policy the lists give ``qualname`` under ``dname`` on CPU, and its entry.

    Read from the entries directly (not through the engine's resolution):
    the entry whose ``when`` matches; ``banned`` runs in FP32 under BF16.
    """
    ctx = {"dtype": dname, "device": "cpu"}
    for e in _ENTRIES_BY_NAME.get(qualname, ()):
        if all(ctx[k] == v for k, v in e.when):
            if e.policy == "banned" and dname == "bfloat16":
                return "float", e
            return e.policy, e
    return None, None


# ------------------------------------------------------------------ tensors


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(x, fn) for x in obj)
    if isinstance(obj, list):
        return [map_tensors(x, fn) for x in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors(x)


def hand_cast(obj: Any, to: Optional[torch.dtype]) -> Any:
    """Cast every FP16/BF16/FP32 tensor to ``to``; float64, ints, bools stay."""
    if to is None:
        return obj
    return map_tensors(obj, lambda t: t.to(to) if t.dtype in CASTABLE else t)


def widest(dtypes: List[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype a promote op runs in: the promotion of the castable dtypes seen."""
    seen = [d for d in dtypes if d in CASTABLE]
    return functools.reduce(torch.promote_types, seen) if seen else None


def with_variant(sample: Tuple[tuple, dict], variant: str, half: torch.dtype) -> Optional[Tuple[tuple, dict]]:
    """The sample's FP32 tensors as ``variant`` asks; None when it adds nothing."""
    if variant == "fp32":
        return sample
    if variant == "half":
        return map_tensors(sample, lambda t: t.to(half) if t.dtype == f32 else t)
    n_float = sum(1 for t in tensors(sample) if t.dtype == f32)
    if n_float < 2:
        return None  # one floating input: "mixed" is the "half" set again
    first = [True]

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == f32 and first[0]:
            first[0] = False
            return t.to(half)
        return t

    return map_tensors(sample, one)


def require_sample(form: str) -> None:
    if op_samples.lookup(form) is None:
        hint = ""
        if form.startswith("torch.Tensor."):
            hint = " (or for its function form: a Tensor method uses that sample)"
        pytest.fail(f"{form} is in the op lists but tests/op_samples.py has no sample inputs for it; add one: "
                    f"@sample({form!r}) returning (args, kwargs) of small FP32 tensors{hint}")


def inputs_for(form: str, variant: str, half: torch.dtype) -> Optional[Tuple[tuple, dict]]:
    require_sample(form)
    return with_variant(op_samples.make(form), variant, half)


# ------------------------------------------------------------------ calling and comparing


class Outcome:
    """What a call did: its result and inputs afterwards, or the error it raised."""

    def __init__(self, value: Any = None, inputs: Any = None, error: Optional[BaseException] = None):
        self.value, self.inputs, self.error = value, inputs, error

    def dtypes(self) -> Any:
        if self.error is not None:
            return f"raises {type(self.error).__name__}"
        return map_tensors(self.value, lambda t: t.dtype)


def call_patched(form: str, args: tuple, kwargs: dict) -> Any:
    """Call the op as user code would: ``ns.X(...)`` or ``receiver.X(...)``."""
    ns, name = split(form)
    if ns == "torch.Tensor":
        return getattr(args[0], name)(*args[1:], **kwargs)
    return getattr(NAMESPACES[ns], name)(*args, **kwargs)


def run(fn: Callable[[], Any], inputs: Any) -> Outcome:
    try:
        return Outcome(fn(), inputs)
    except Exception as e:  # the error itself is compared
        return Outcome(error=e)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality where NaN equals NaN in the same place."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        na, nb = torch.isnan(a), torch.isnan(b)
        return torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
    return torch.equal(a, b)


def assert_same(got: Any, want: Any, where: str, strict: bool = True) -> None:
    """``got`` equals ``want`` bit for bit; ``strict=False`` accepts another tuple type."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype, (
            f"{where}: dtype {got.dtype}, the original on hand-cast inputs gives {want.dtype}"
        )
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
        assert same_tensor(got, want), f"{where}: values differ from the original on hand-cast inputs"
    elif isinstance(want, (tuple, list)):
        same_type = type(got) is type(want) if strict else isinstance(got, (tuple, list))
        assert same_type and len(got) == len(want), f"{where}: got {got!r}, want {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]", strict)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), f"{where}: got {got!r}, want {want!r}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    else:
        assert got == want, f"{where}: got {got!r}, want {want!r}"


def assert_same_outcome(got: Outcome, want: Outcome, where: str) -> None:
    if want.error is not None:
        assert got.error is not None, f"{where}: returned, but the original on hand-cast inputs raises {want.error!r}"
        assert type(got.error) is type(want.error), f"{where}: raised {got.error!r}, the original raises {want.error!r}"
        same_message = str(got.error).splitlines()[:1] == str(want.error).splitlines()[:1]
        assert same_message, f"{where}: {got.error} != {want.error}"
        return
    assert got.error is None, f"{where}: raised {got.error!r}; the original on hand-cast inputs returns"
    assert_same(got.value, want.value, f"{where} output")
    assert_same(got.inputs, want.inputs, f"{where} inputs after the call")


# ------------------------------------------------------------------ coverage of the samples


@pytest.mark.quick
def test_every_listed_op_has_a_sample():
    missing = [f for f in FORMS if op_samples.lookup(f) is None]
    assert not missing, (
        "no sample inputs for " + ", ".join(missing) + ": add a factory for each to tests/op_samples.py "
        "(@sample('torch.X') returning (args, kwargs) of small FP32 tensors)"
    )


def test_method_form_exclusions_are_real_methods():
    for q, why in op_samples.METHOD_FORM_EXCLUDED.items():
        ns, name = split(q)
        assert q in LISTED, (
            f"{q} is excluded from method forms but is not in the lists; drop it from METHOD_FORM_EXCLUDED"
        )
        assert hasattr(torch.Tensor, name), f"Tensor.{name} does not exist; drop {q} from METHOD_FORM_EXCLUDED ({why})"


METHOD_PAIRS = [(m, fn) for m, fns in METHOD_FORMS.items() for fn in fns]


@pytest.mark.parametrize("method,function", METHOD_PAIRS, ids=[f"{short(m)}~{short(f)}" for m, f in METHOD_PAIRS])
def test_method_form_is_the_same_op(method, function):
    """``x.X(*rest)`` computes what ``ns.X(x, *rest)`` does, unpatched."""
    require_sample(function)
    (args, kwargs), (margs, mkwargs) = op_samples.make(function), op_samples.make(function)
    want = getattr(NAMESPACES[split(function)[0]], split(function)[1])(*args, **kwargs)
    got = getattr(torch.Tensor, split(method)[1])(*margs, **mkwargs)
    assert_same(got, want, f"{short(method)} against {short(function)} (if they are different ops, "
                           f"add {function} to METHOD_FORM_EXCLUDED in tests/op_samples.py)", strict=False)


@pytest.mark.parametrize("dname", DNAMES)
@pytest.mark.parametrize("method,function", METHOD_PAIRS, ids=[f"{short(m)}~{short(f)}" for m, f in METHOD_PAIRS])
def test_method_form_has_the_function_policy(method, function, dname):
    mine, _ = policy(method, dname)
    theirs, _ = policy(function, dname)
    assert mine == theirs, (
        f"under {dname}, {function} is {theirs!r} but its method form {method} is {mine!r}: "
        f"list {split(method)[1]} under {theirs!r} in lists/torch.Tensor.yaml"
    )


# ------------------------------------------------------------------ the generated op test


def expected_outcome(form: str, pol: str, half: torch.dtype, original: Any,
                     args: tuple, kwargs: dict) -> Tuple[Outcome, Optional[torch.dtype], Optional[type]]:
    """(the original's outcome on hand-cast inputs, the dtype the op runs in, an amp_patch error expected)."""
    if pol == "banned":
        return Outcome(), None, amp_patch.BannedOpError
    if is_inplace(form):
        rd = args[0].dtype
        if pol == "float" and rd in LOW:
            return Outcome(), None, amp_patch.CastError
        to = rd if rd in CASTABLE else None
        cargs = (args[0],) + hand_cast(args[1:], to)
        ckwargs = hand_cast(kwargs, to)
        return run(lambda: original(*cargs, **ckwargs), (args, kwargs)), rd, None
    if pol == "half" and half is bf16 and form in wrappers.UNDER_CPU_AUTOCAST:
        # RNN kernels on CPU run under CPU autocast itself (its FP32 hidden state)
        def under_autocast():
            with torch.autocast("cpu", dtype=bf16):
                return original(*args, **kwargs)

        return run(under_autocast, (args, kwargs)), None, None
    if pol == "half":
        to = half
    elif pol == "float":
        to = f32
    else:  # promote, sequence_promote
        to = widest([t.dtype for t in tensors((args, kwargs))])
    cargs, ckwargs = hand_cast(args, to), hand_cast(kwargs, to)
    return run(lambda: original(*cargs, **ckwargs), (args, kwargs)), to, None


GENERATED = [(f, d) for f in FORMS for d in DNAMES if policy(FORMS[f], d)[0] is not None]
UNLISTED = {d: [f for f in FORMS if policy(FORMS[f], d)[0] is None] for d in DNAMES}


@pytest.mark.parametrize("dname", DNAMES)
def test_ops_without_an_entry_for_the_dtype_are_left_unpatched(dname, o1):
    """An op whose entries all have ``when`` for the other dtype keeps its original object."""
    assert UNLISTED[dname], f"no op is specific to the other dtype under {dname}; this test checks nothing"
    originals = {f: getattr(NAMESPACES[split(f)[0]], split(f)[1], None) for f in UNLISTED[dname]}
    o1(HALF[dname])
    patched = [f for f, orig in originals.items() if getattr(NAMESPACES[split(f)[0]], split(f)[1], None) is not orig]
    assert not patched, f"patched under {dname} without an entry for it: {patched}"


def _references(form: str, half: torch.dtype) -> Tuple[str, Any, Any, dict, dict]:
    """Policy, entry, original and, per input variant, the expected outcome and
    the inputs, all built with torch unpatched (the samples call torch ops): the
    references are the original op on inputs cast by hand."""
    pol, entry = policy(FORMS[form], DNAME_OF[half])
    ns, name = split(form)
    original = getattr(NAMESPACES[ns], name)
    expected, inputs = {}, {}
    for v in VARIANTS:
        ins = inputs_for(form, v, half)
        if ins is not None:
            expected[v] = expected_outcome(form, pol, half, original, *ins)
            inputs[v] = inputs_for(form, v, half)
    return pol, entry, original, expected, inputs


def _check_patched(form: str, half: torch.dtype, refs: tuple) -> None:
    """The patched ``form`` against its references (``_references``)."""
    pol, entry, original, expected, inputs = refs
    ns, name = split(form)
    assert getattr(NAMESPACES[ns], name) is not original, f"{form} is {pol!r} under {half} but was not patched"
    for v, (want, to, amp_error) in expected.items():
        where = f"{short(form)} ({pol}, {DNAME_OF[half]}, {v} inputs)"
        args, kwargs = inputs[v]
        if amp_error is not None:
            receiver = args[0].clone() if is_inplace(form) else None
            with pytest.raises(amp_error) as info:
                call_patched(form, args, kwargs)
            assert name in str(info.value), f"{where}: the error does not name the op: {info.value}"
            if amp_error is amp_patch.BannedOpError:
                assert isinstance(info.value, NotImplementedError)
                assert entry.fix and entry.fix in str(info.value), f"{where}: the error does not give the fix"
            else:
                assert same_tensor(args[0], receiver), f"{where}: the refused in-place op changed its receiver"
            continue
        got = run(lambda: call_patched(form, args, kwargs), (args, kwargs))
        assert_same_outcome(got, want, where)
        if got.error is None and to is not None:
            floating = {t.dtype for t in tensors(got.value) if t.is_floating_point()}
            assert floating <= {to}, f"{where}: outputs are {sorted(map(str, floating))}; the policy runs it in {to}"


@pytest.mark.parametrize("dname", DNAMES)
def test_patched_ops_match_originals_on_hand_cast_inputs(dname, wrapper_path, o1):
    """Every listed op under one O1 session per dtype and wrapper path: its
    outcome (values, dtypes, errors) is the original op's on hand-cast inputs.
    Each op's failure is collected, so one run names every op that fails."""
    half = HALF[dname]
    forms = [f for f, d in GENERATED if d == dname]
    missing = [f for f in forms if op_samples.lookup(f) is None]
    assert not missing, f"listed ops with no sample in tests/op_samples.py (add one with @sample): {missing}"
    refs = {f: _references(f, half) for f in forms if exists(f)}
    assert len(refs) > 100, "too few ops checked: the lists or the samples went missing"
    o1(half)
    failures = []
    for form, r in refs.items():
        try:
            _check_patched(form, half, r)
        except (Exception, pytest.fail.Exception) as e:
            failures.append(f"{form}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    assert not failures, f"{len(failures)} of {len(refs)} ops differ from the original on hand-cast inputs:\n" + "\n".join(failures)


# ------------------------------------------------------------------ agreement with autocast: aten names

#: forms whose aten op is not named after them (aliases, Python composites);
#: None: a Python composite of several ops that autocast has no policy for as a whole
ATEN_NAMES: Dict[str, Optional[str]] = {
    "torch.Tensor.__matmul__": "matmul",
    "torch.Tensor.__rmatmul__": "matmul",
    "torch.Tensor.__pow__": "pow",
    "torch.Tensor.__rpow__": "pow",
    "torch.Tensor.__add__": "add",
    "torch.Tensor.__radd__": "add",
    "torch.Tensor.__sub__": "sub",
    "torch.Tensor.__rsub__": "rsub",
    "torch.Tensor.__mul__": "mul",
    "torch.Tensor.__rmul__": "mul",
    "torch.Tensor.__truediv__": "div",
    # Tensor.__rtruediv__ is `self.reciprocal() * other` in Python.
    "torch.Tensor.__rtruediv__": "reciprocal",
    "torch.Tensor.__iadd__": "add_",
    "torch.Tensor.__isub__": "sub_",
    "torch.Tensor.__imul__": "mul_",
    "torch.Tensor.__itruediv__": "div_",
    "torch.Tensor.__ipow__": "pow_",
    "torch.Tensor.det": "linalg_det",
    "torch.Tensor.slogdet": "linalg_slogdet",
    "torch.Tensor.matrix_exp": "linalg_matrix_exp",
    # torch.lu is Python: it calls torch._lu_with_info.
    "torch.lu": "_lu_with_info",
    "torch.Tensor.lu": "_lu_with_info",
    # torch.norm / Tensor.norm with a number p and a dim call torch.linalg.vector_norm.
    "torch.norm": "linalg_vector_norm",
    "torch.Tensor.norm": "linalg_vector_norm",
    "torch.linalg.matmul": "matmul",
    "torch.concat": "cat",
    "torch.concatenate": "cat",
    "torch.hstack": "hstack",
    "torch.vstack": "vstack",
    "torch.dstack": "dstack",
    "torch.nn.functional.softmin": "softmax",
    "torch.nn.functional.normalize": "linalg_vector_norm",
    "torch.nn.functional.cross_entropy": "cross_entropy_loss",
    # Both autocasts have a grid_sampler kernel: promote on CUDA, FP32 on CPU
    # (as for the grid_sampler_2d/3d it calls).
    "torch.nn.functional.grid_sample": "grid_sampler",
    # The samples upsample 2-D inputs, bilinear for interpolate/upsample.
    "torch.nn.functional.interpolate": "upsample_bilinear2d",
    "torch.nn.functional.upsample": "upsample_bilinear2d",
    "torch.nn.functional.upsample_bilinear": "upsample_bilinear2d",
    "torch.nn.functional.upsample_nearest": "upsample_nearest2d",
    "torch.nn.functional.multilabel_soft_margin_loss": None,
    # The sample pads in 'reflect' mode on two dimensions.
    "torch.nn.functional.pad": "reflection_pad2d",
    # F.max_unpool1d unpools a 2-D view of its input.
    "torch.nn.functional.max_unpool1d": "max_unpool2d",
}
SPECIAL_ALIASES = {"expm1", "exp2", "log1p", "logsumexp", "softmax", "log_softmax", "erfinv"}


def aten_name(form: str) -> Optional[str]:
    """The aten op a form dispatches to first (overload stripped)."""
    if form in ATEN_NAMES:
        return ATEN_NAMES[form]
    ns, name = split(form)
    if ns == "torch.linalg":
        return f"linalg_{name}"
    if ns == "torch.special":
        return name if name in SPECIAL_ALIASES else f"special_{name}"
    if ns == "torch.fft":
        return f"fft_{name}"
    return name


@functools.lru_cache(maxsize=None)
def autocast_kernels(key: str) -> frozenset:
    """Every ``aten`` op (with overload) that has a kernel for dispatch key ``key``."""
    found = set()
    pattern = re.compile(rf"^{key}: registered at", re.M)
    for op in torch._C._dispatch_get_all_op_names():
        if op.startswith("aten::") and pattern.search(torch._C._dispatch_dump(op)):
            found.add(op[len("aten::"):])
    return frozenset(found)


def bases(names) -> frozenset:
    return frozenset(n.split(".")[0] for n in names)


def test_aten_names_exist():
    known = bases(op[len("aten::"):] for op in torch._C._dispatch_get_all_op_names() if op.startswith("aten::"))
    wrong = {f: aten_name(f) for f in FORMS if aten_name(f) is not None and aten_name(f) not in known}
    assert not wrong, f"aten names that torch does not have (fix ATEN_NAMES): {wrong}"


# ------------------------------------------------------------------ FP16: CUDA autocast's policy

#: CUDA autocast's policy in torch 2.13 (aten/src/ATen/autocast_mode.h and .cpp):
#: op (with overload) -> policy.
CUDA_AUTOCAST: Dict[str, str] = {
    **dict.fromkeys((
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
        "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
        "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
        "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
        "cudnn_convolution", "cudnn_convolution_transpose",
    ), "lower_precision_fp"),
    **dict.fromkeys((
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    ), "fp32"),
    **dict.fromkeys((
        "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
    ), "fp32_set_opt_dtype"),
    **dict.fromkeys(("norm.Scalar", "norm.ScalarOpt_dim"), "fp32_append_dtype"),
    **dict.fromkeys((
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
        "tensordot", "scatter_add",
    ), "promote"),
    "binary_cross_entropy": "banned",
}
CUDA_POLICY = {n.split(".")[0]: p for n, p in CUDA_AUTOCAST.items()}


def test_cuda_reference_table_matches_installed_torch():
    """The embedded policy names exactly the ops with an AutocastCUDA kernel."""
    live = autocast_kernels("AutocastCUDA")
    assert set(CUDA_AUTOCAST) == set(live), (
        f"CUDA autocast of torch {torch.__version__} differs from the embedded table: "
        f"only in torch: {sorted(set(live) - set(CUDA_AUTOCAST))}, "
        f"only in the table: {sorted(set(CUDA_AUTOCAST) - set(live))}"
    )


def cuda_dtype_for(pol: str, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    if pol == "lower_precision_fp":
        return f16
    if pol.startswith("fp32"):
        return f32
    return widest([t.dtype for t in tensors((args, kwargs))])  # promote


def by_namespace(forms: List[str]) -> Dict[str, List[str]]:
    groups: Dict[str, List[str]] = {}
    for f in forms:
        groups.setdefault(short(split(f)[0] + ".x")[:-2], []).append(f)
    return groups


CUDA_COVERED = [f for f in FORMS if not is_inplace(f) and aten_name(f) in CUDA_POLICY and exists(f)]
CUDA_GROUPS = by_namespace(CUDA_COVERED)


@pytest.mark.parametrize("group", sorted(CUDA_GROUPS))
def test_fp16_policy_matches_cuda_autocast(group, o1):
    """Under FP16, each covered op's output dtypes are those CUDA autocast's policy gives.

    One test per namespace (one initialize for all its ops); the message
    lists every op that disagrees.
    """
    expected, inputs = {}, {}
    for form in CUDA_GROUPS[group]:
        original = getattr(NAMESPACES[split(form)[0]], split(form)[1])
        ref_policy = CUDA_POLICY[aten_name(form)]
        for v in VARIANTS:
            ins = inputs_for(form, v, f16)
            if ins is None:
                continue
            inputs[form, v] = inputs_for(form, v, f16)
            if ref_policy == "banned":
                expected[form, v] = "raises BannedOpError"
                continue
            cargs, ckwargs = hand_cast(ins, cuda_dtype_for(ref_policy, *ins))
            expected[form, v] = run(lambda: original(*cargs, **ckwargs), None).dtypes()
    o1(f16)
    assert_patched_gives(expected, inputs,
                         lambda form: f"CUDA autocast ({CUDA_POLICY[aten_name(form)]} for aten::{aten_name(form)})")


def assert_patched_gives(expected, inputs, reference):
    """Each patched op's output dtypes on ``inputs[form, variant]`` are ``expected[form, variant]``;
    the message lists every op that disagrees with ``reference(form)`` (what the expectation came from)."""
    wrong = []
    for (form, v), want in expected.items():
        args, kwargs = inputs[form, v]
        got = run(lambda: call_patched(form, args, kwargs), None).dtypes()
        if got != want:
            wrong.append(f"{short(form)} ({v} inputs): amp_patch gives {got}, {reference(form)} gives {want}")
    assert not wrong, "fix these entries in lists/:\n  " + "\n  ".join(wrong)


# ------------------------------------------------------------------ BF16: CPU autocast itself

CPU_COVERED = [
    f for f in FORMS if not is_inplace(f) and aten_name(f) in bases(autocast_kernels("AutocastCPU")) and exists(f)
]
CPU_GROUPS = by_namespace(CPU_COVERED)


@pytest.mark.parametrize("group", sorted(CPU_GROUPS))
def test_bf16_policy_matches_cpu_autocast(group, o1):
    """Under BF16, each covered op's output dtypes are the original's under CPU autocast."""
    expected, inputs = {}, {}
    for form in CPU_GROUPS[group]:
        original = getattr(NAMESPACES[split(form)[0]], split(form)[1])
        for v in VARIANTS:
            ins = inputs_for(form, v, bf16)
            if ins is None:
                continue
            inputs[form, v] = inputs_for(form, v, bf16)
            args, kwargs = ins

            def under_autocast():
                with torch.autocast("cpu", dtype=bf16):
                    return original(*args, **kwargs)

            expected[form, v] = run(under_autocast, None).dtypes()
    o1(bf16)
    assert_patched_gives(expected, inputs, lambda form: "torch.autocast('cpu', bfloat16)")


#: forms CPU autocast has no kernel for but whose inner ops it casts (mm, bmm,
#: linear, mkldnn_rnn_layer), so their output dtype changes under it anyway.
#: They have no policy of their own there, so the agreement above skips them.
CPU_AUTOCAST_THROUGH_INNER_OPS = frozenset({
    "torch.einsum", "torch.chain_matmul", "torch.tensordot", "torch.linalg.multi_dot", "torch.linalg.pinv",
    "torch.lstm_cell", "torch.gru_cell", "torch.rnn_tanh_cell", "torch.rnn_relu_cell",
    "torch._VF.lstm", "torch._VF.gru", "torch._VF.rnn_tanh", "torch._VF.rnn_relu",
    "torch._VF.lstm_cell", "torch._VF.gru_cell", "torch._VF.rnn_tanh_cell", "torch._VF.rnn_relu_cell",
    "torch._transformer_encoder_layer_fwd",
})


def test_forms_outside_cpu_autocast_are_left_alone_by_it():
    """The forms the BF16 agreement skips really have no CPU autocast policy.

    For every other form, CPU autocast must leave the output dtypes as they
    are without it; otherwise its aten name (``ATEN_NAMES``) is wrong, or it
    belongs in ``CPU_AUTOCAST_THROUGH_INNER_OPS``.
    """
    changed = set()
    for form in FORMS:
        if form in CPU_COVERED or is_inplace(form) or not exists(form):
            continue
        original = getattr(NAMESPACES[split(form)[0]], split(form)[1])
        for v in VARIANTS:
            ins = inputs_for(form, v, bf16)
            if ins is None:
                continue
            args, kwargs = ins
            plain = run(lambda: original(*args, **kwargs), None).dtypes()
            args, kwargs = inputs_for(form, v, bf16)

            def under_autocast():
                with torch.autocast("cpu", dtype=bf16):
                    return original(*args, **kwargs)

            if run(under_autocast, None).dtypes() != plain:
                changed.add(form)
    assert changed == CPU_AUTOCAST_THROUGH_INNER_OPS, (
        f"CPU autocast changes dtypes of {sorted(changed - CPU_AUTOCAST_THROUGH_INNER_OPS)} (map them in ATEN_NAMES "
        f"or list them in CPU_AUTOCAST_THROUGH_INNER_OPS) and no longer of "
        f"{sorted(CPU_AUTOCAST_THROUGH_INNER_OPS - changed)}"
    )


# ------------------------------------------------------------------ promotion tables

PAIR_DTYPES = (f16, bf16, f32, f64, i64)
PAIRS = [(a, b) for a in PAIR_DTYPES for b in PAIR_DTYPES]
#: ops whose result dtype is torch's ordinary type promotion of their inputs
ORDINARY_PROMOTION = {
    "torch.Tensor.__add__", "torch.Tensor.__radd__", "torch.Tensor.__sub__", "torch.Tensor.__rsub__",
    "torch.Tensor.__mul__", "torch.Tensor.__rmul__", "torch.cat", "torch.concat", "torch.concatenate",
    "torch.stack", "torch.hstack", "torch.vstack", "torch.dstack", "torch.addcmul", "torch.Tensor.addcmul",
}


def promote_forms(inplace: bool) -> List[Tuple[str, str]]:
    out = []
    for f in FORMS:
        for d in DNAMES:
            if policy(FORMS[f], d)[0] in ("promote", "sequence_promote") and is_inplace(f) == inplace:
                out.append((f, d))
    return out


def pair_inputs(form: str, a: torch.dtype, b: torch.dtype) -> Tuple[tuple, dict]:
    """The sample with its first floating tensor in ``a`` and the others in ``b``."""
    require_sample(form)
    first = [True]

    def conv(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != f32:
            return t
        if first[0]:
            first[0] = False
            return t.to(a)
        return t.to(b)

    return map_tensors(op_samples.make(form), conv)


def pair_outcomes(form: str, hand_cast_pair: Callable) -> Tuple[dict, dict]:
    """For every dtype pair ``(a, b)``: the original's outcome on the pair's
    inputs as ``hand_cast_pair(args, kwargs, a)`` casts them, and a fresh copy
    of the inputs for the patched call."""
    ns, name = split(form)
    original = getattr(NAMESPACES[ns], name)
    expected, inputs = {}, {}
    for a, b in PAIRS:
        args, kwargs = pair_inputs(form, a, b)
        cargs, ckwargs = hand_cast_pair(args, kwargs, a)
        expected[a, b] = run(lambda: original(*cargs, **ckwargs), (args, kwargs))
        inputs[a, b] = pair_inputs(form, a, b)
    return expected, inputs


def ordinary_result(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """amp_patch's rule, then torch's: mixed FP16/BF16/FP32 run in FP32, float64 and ints are left alone."""
    mixed = len({a, b} & set(CASTABLE)) > 1
    a, b = (f32 if mixed and d in CASTABLE else d for d in (a, b))
    return torch.promote_types(a, b)


OUT_OF_PLACE_PROMOTE = promote_forms(inplace=False)


@pytest.mark.parametrize("form,dname", OUT_OF_PLACE_PROMOTE, ids=[f"{short(f)}-{d}" for f, d in OUT_OF_PLACE_PROMOTE])
def test_promotion_table(form, dname, o1):
    """Every pair of input dtypes gives the original's result on inputs cast to the widest."""

    def to_widest(args, kwargs, a):
        return hand_cast((args, kwargs), widest([t.dtype for t in tensors((args, kwargs))]))

    expected, inputs = pair_outcomes(form, to_widest)
    o1(HALF[dname])
    for (a, b), want in expected.items():
        where = f"{short(form)} ({dname}) on {a} and {b}"
        args, kwargs = inputs[a, b]
        got = run(lambda: call_patched(form, args, kwargs), (args, kwargs))
        assert_same_outcome(got, want, where)
        if form in ORDINARY_PROMOTION:
            assert got.error is None, f"{where}: raised {got.error!r}"
            assert got.value.dtype == ordinary_result(a, b), f"{where}: result is {got.value.dtype}"


@pytest.mark.quick
def test_promotion_tables_cover_the_ordinary_ops():
    # The spec check above runs only for forms in ORDINARY_PROMOTION; make sure they are tested.
    tested = {f for f, _ in OUT_OF_PLACE_PROMOTE}
    assert ORDINARY_PROMOTION <= tested, sorted(ORDINARY_PROMOTION - tested)


INPLACE_PROMOTE = promote_forms(inplace=True)


@pytest.mark.parametrize("form,dname", INPLACE_PROMOTE, ids=[f"{short(f)}-{d}" for f, d in INPLACE_PROMOTE])
def test_inplace_promote_keeps_the_receiver_dtype(form, dname, o1):
    """An in-place promote op casts its other inputs to the receiver, which keeps its dtype."""

    def to_receiver(args, kwargs, a):
        to = a if a in CASTABLE else None
        return (args[0],) + hand_cast(args[1:], to), hand_cast(kwargs, to)

    expected, inputs = pair_outcomes(form, to_receiver)
    assert any(w.error is None for w in expected.values()), f"{form}: no dtype pair runs at all"
    o1(HALF[dname])
    for (a, b), want in expected.items():
        where = f"{short(form)} ({dname}) on a {a} receiver and {b} inputs"
        args, kwargs = inputs[a, b]
        receiver = args[0]
        got = run(lambda: call_patched(form, args, kwargs), (args, kwargs))
        assert_same_outcome(got, want, where)
        if got.error is None:
            assert got.value is receiver, f"{where}: did not return its receiver"
            assert receiver.dtype == a, f"{where}: receiver became {receiver.dtype}"


INPLACE_FLOAT_OVERRIDE = {"torch.Tensor": {"float": ["exp_", "add_"]}}


@pytest.mark.parametrize("dname", DNAMES)
def test_inplace_float_op_refuses_a_half_receiver(dname, o1):
    """An in-place op moved under ``float`` cannot make a half tensor FP32: CastError.

    On an FP32 or float64 receiver it runs as the original does.
    """
    cases = [(name, receiver) for name in ("exp_", "add_") for receiver in (f16, bf16, f32, f64)]

    def make(name: str, receiver: torch.dtype) -> Tuple[torch.Tensor, tuple]:
        r = op_samples.Rand()
        x = r.randn(3, 4).to(receiver)
        return x, ((r.randn(3, 4),) if name == "add_" else ())

    originals = {name: getattr(torch.Tensor, name) for name, _ in cases}
    expected, inputs = {}, {}
    for name, receiver in cases:
        x, rest = make(name, receiver)
        expected[name, receiver] = originals[name](x, *(t.to(receiver) for t in rest))
        inputs[name, receiver] = make(name, receiver)
    o1(HALF[dname], lists=INPLACE_FLOAT_OVERRIDE)
    for name, receiver in cases:
        where = f"Tensor.{name} on a {receiver} receiver ({dname})"
        assert getattr(torch.Tensor, name) is not originals[name]
        x, rest = inputs[name, receiver]
        before = x.clone()
        if receiver in LOW:
            with pytest.raises(amp_patch.CastError, match=rf"Tensor\.{name}") as info:
                getattr(x, name)(*rest)
            assert "float32" in str(info.value), where
            assert same_tensor(x, before), f"{where}: the refused op changed its receiver"
        else:
            out = getattr(x, name)(*rest)
            assert out is x and x.dtype == receiver, where
            assert same_tensor(x, expected[name, receiver]), where
