"""Warnings at initialize, and overflow provenance for skipped steps.

``warn_at_initialize`` looks once at what ``initialize`` was given and warns
(``AmpWarning``, each message once per process) about set-ups that run slower
than FP32 or not as the user thinks: BF16 on a CPU without native BF16, FP16 on
a CPU, FP16 over BF16 weights on a BF16-capable GPU, a model spread over
several devices, optimizer parameters outside the models, an optimizer ``eps``
that is 0 in the half dtype with no FP32 masters (O3), and torch functions
a user module bound before ``initialize`` (which no patch can reach).

Overflow provenance (``initialize(..., find_overflow=True)``, or
``find_overflow()`` for the next step) watches every torch call and every
module of the models: the first output, or gradient of an output, that holds
inf or NaN is remembered with its op, module and dtype. When the loss scaler
skips a step it calls ``on_skipped_step``, which names them in a warning and
suggests the YAML override that moves the op to FP32.

Its cost, only while armed: every torch call goes through a Python
``TorchFunctionMode``; each floating-point output is checked for inf/NaN with
one min/max pass (on CUDA a device synchronisation per op); the backward node
of each output that requires grad gets a hook that checks the gradients it
produces the same way. Measured on CPU: 1.7-2.5x the step time with
1024-wide layers, about 4x with 64-wide ones.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import sysconfig
import types
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import torch

from ..patching import modes

from .. import frames, session
from ..patching.cast import LOW
from ..errors import StateError
from ..oplists import NAMESPACES, OPERATOR_FORMS
from .stats import dtype_name
from ..patching.wrappers import _GLOBALS as wrappers_globals, _tensors as wrappers_tensors, wrapt_has_c_extension

log = logging.getLogger("amp_patch")


class AmpWarning(UserWarning):
    """A set-up amp_patch can run, but slower or otherwise than intended."""


_warned: set = set()


def _stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line: the first
    frame outside amp_patch, torch, wrapt and Python's frozen modules (the
    launcher's ``runpy``), so a warning raised from a patched call, an
    optimizer hook or the launcher names the script's own line."""
    return 1 + frames.first_outside_ours(sys._getframe(1))[1]


def _warn_once(message: str) -> None:
    if message in _warned:
        return
    _warned.add(message)
    warnings.warn(message, AmpWarning, stacklevel=_stacklevel())


def forget_warned(messages: Sequence[str]) -> None:
    """Let once-only warnings that were held back and dropped be given again."""
    _warned.difference_update(messages)


def warn_user(message: str, category: type = None) -> None:
    """Warn (``AmpWarning`` unless ``category`` says otherwise), pointing at the user's line."""
    warnings.warn(message, category or AmpWarning, stacklevel=_stacklevel())


# ------------------------------------------------------------ initialize


def cpu_has_native_bf16() -> bool:
    """True when this CPU has BF16 instructions (AVX512_BF16, AMX or Arm BF16)."""
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        try:
            c = caps()
            return any(c.get(k) for k in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
        except Exception:  # an unknown platform: fall back to oneDNN's answer
            pass
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def _uses_half(props: Any) -> bool:
    return props.patch_torch_functions or props.cast_model_type in LOW


def _model_label(i: int, m: torch.nn.Module) -> str:
    return f"model {i} ({type(m).__name__})"


def speed_warnings(props: Any, device_type: str, native_bf16: bool) -> List[str]:
    """Half dtypes that run slower than FP32 on this device."""
    if not _uses_half(props) or device_type != "cpu":
        return []
    if props.half_dtype == torch.bfloat16 and not native_bf16:
        return [
            f"amp_patch: {props.opt_level} runs in bfloat16 on a CPU without native BF16 instructions "
            f"(AVX512_BF16, AMX or Arm BF16), where BF16 math is emulated and slower than FP32. "
            f"Use opt_level='O0' on this machine, or run on hardware with native BF16."
        ]
    if props.half_dtype == torch.float16:
        return [
            f"amp_patch: {props.opt_level} runs in float16 on the CPU, where FP16 kernels are few and "
            f"slower than FP32. Use half_dtype=torch.bfloat16 on CPU (the default there), or move the "
            f"model to a GPU."
        ]
    return []


def wrapper_warnings(props: Any, c_extension: bool) -> List[str]:
    """Patched ops built on wrapt's pure-Python fallback, several µs slower per call."""
    if not props.patch_torch_functions or c_extension:
        return []
    why = "WRAPT_DISABLE_EXTENSIONS is set" if os.environ.get("WRAPT_DISABLE_EXTENSIONS") else (
        "wrapt was installed without it")
    return [
        f"amp_patch: wrapt's C extension is not in use ({why}), so every patched torch call pays several "
        f"microseconds in wrapt's pure-Python wrappers, and amp_patch's C fast path is off. Unset "
        f"WRAPT_DISABLE_EXTENSIONS, or reinstall wrapt from a wheel for this platform "
        f"(pip install --force-reinstall wrapt)."
    ]


def bf16_weights_warnings(props: Any, device_type: str, gpu_bf16: bool, models: Sequence[torch.nn.Module]) -> List[str]:
    """FP16 chosen over a model whose weights are already BF16, on a GPU that has BF16."""
    if device_type != "cuda" or props.half_dtype != torch.float16 or not gpu_bf16 or not _uses_half(props):
        return []
    return [
        f"amp_patch: half_dtype is float16, but {_model_label(i, m)} has bfloat16 weights and this GPU "
        f"supports BF16; casting them to FP16 loses range (FP16 overflows above 65504) for no gain. "
        f"Use half_dtype=torch.bfloat16 (or opt_level='O4' / 'O5')."
        for i, m in enumerate(models)
        if any(p.dtype == torch.bfloat16 for p in m.parameters())
    ]


def device_warnings(props: Any, models: Sequence[torch.nn.Module]) -> List[str]:
    """Models whose tensors live on more than one device."""
    out = []
    for i, m in enumerate(models):
        devices = sorted({str(t.device) for t in [*m.parameters(), *m.buffers()]})
        if len(devices) > 1:
            out.append(
                f"amp_patch: {_model_label(i, m)} has tensors on several devices ({', '.join(devices)}); "
                f"amp_patch chose {props.half_dtype} from the first of them and uses it on every device. "
                f"Keep each model on one device, or pass half_dtype= for the device that does the work."
            )
    return out


def optimizer_warnings(props: Any, models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> List[str]:
    """Optimizer parameters that are in none of the models (O0/O1/O4)."""
    if not models or props.cast_model_type in LOW:
        return []  # a cast model's own checks handle this at O2/O3/O5
    owned = {id(p) for m in models for p in m.parameters()}
    out = []
    for i, opt in enumerate(optimizers):
        stray = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in owned)
        if stray:
            out.append(
                f"amp_patch: optimizer {i} ({type(opt).__name__}) updates {stray} parameter(s) that are in none "
                f"of the models passed to initialize. Pass every model it trains: "
                f"amp_patch.initialize([model_a, model_b], optimizer, ...)."
            )
    return out


def pure_half_warnings(props: Any, optimizers: Sequence[Any]) -> List[str]:
    """Optimizer hyperparameters that are 0 in the half dtype, with no FP32 masters (O3).

    Without master weights the optimizer steps the half parameters itself, so
    an Adam-style ``eps`` is added in the half dtype: FP16 rounds 1e-8 to 0,
    and a parameter whose gradient is 0 (or below ~2e-4, whose square
    underflows) is divided by 0 and turns NaN or inf.
    """
    if props.master_weights or props.cast_model_type not in LOW:
        return []
    half = props.cast_model_type
    out = []
    for i, opt in enumerate(optimizers):
        vanishing = sorted({
            g["eps"] for g in opt.param_groups
            if isinstance(g.get("eps"), float) and g["eps"] > 0 and torch.tensor(g["eps"], dtype=half).item() == 0
        })
        if vanishing:
            out.append(
                f"amp_patch: {props.opt_level} keeps no FP32 master weights, so optimizer {i} "
                f"({type(opt).__name__}) steps {dtype_name(half)} parameters itself, and its eps="
                f"{', '.join(map(repr, vanishing))} is 0 in {dtype_name(half)}: where a gradient is 0 or its square "
                f"underflows (below about 2e-4), the update divides by 0 and the weight becomes inf or NaN. "
                f"Use opt_level='O2' (FP32 master weights), or give the optimizer eps=1e-4 or more."
            )
    return out


def _library_dirs() -> Tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


# {(module name, file): is it user code?}. Thousands of modules are loaded in
# a typical process; deciding once per module keeps initialize cheap.
_user_module_cache: dict = {}


def _is_user_module(mod: Any, library: Tuple[str, ...]) -> bool:
    path = getattr(mod, "__file__", None)
    name = getattr(mod, "__name__", None) or ""
    if not isinstance(path, str) or name.partition(".")[0] in (frames.PACKAGE, "torch", "wrapt"):
        return False
    key = (getattr(mod, "__name__", None), path)
    known = _user_module_cache.get(key)
    if known is None:
        path = os.path.abspath(path)
        parts = path.split(os.sep)
        known = not path.startswith(library) and "site-packages" not in parts and "dist-packages" not in parts
        _user_module_cache[key] = known
    return known


def captured_functions(amp: Any) -> List[Tuple[str, str, str]]:
    """``(module, name, op)`` for each user-module global that holds an
    original torch function the running AMP patched."""
    originals = {}
    for owner, name, original in amp.patcher.originals():
        # functions of modules (torch's namespaces, the clip functions); a class's
        # methods (Tensor's) are looked up at call time and cannot be captured
        if isinstance(owner, types.ModuleType) and callable(original):
            originals.setdefault(id(original), f"{owner.__name__}.{name}")
    if not originals:
        return []
    library = _library_dirs()
    found, seen = [], set()
    for modname, mod in list(sys.modules.items()):
        # __mp_main__ is __main__ again under multiprocessing: name it once
        if mod is None or id(mod) in seen or not _is_user_module(mod, library):
            continue
        seen.add(id(mod))
        for name, value in list(vars(mod).items()):
            op = originals.get(id(value))
            if op is not None:
                found.append((modname, name, op))
    return found


def captured_warnings(amp: Any) -> List[str]:
    out = []
    for mod, name, op in captured_functions(amp):
        if op.rpartition(".")[2].startswith("clip_grad"):
            what = (
                "so it clips the loss-scaled gradients of the model, not the true ones of the optimizer. "
                f"Clip amp_patch.master_params(optimizer), which are unscaled first, or call it through its "
                f"module at call time ({op}(...))"
            )
        else:
            what = f"so its calls are not cast. Call it through its module at call time ({op}(...))"
        out.append(
            f"amp_patch: {mod}.{name} is the original {op}, bound before amp_patch.initialize, {what}, "
            f"or call initialize before importing {mod}."
        )
    return out


def scripted_warnings(props: Any, models: Sequence[torch.nn.Module]) -> List[str]:
    """A ``torch.jit.script``-ed module runs its compiled code, which no Python patch reaches."""
    if not props.patch_torch_functions:
        return []
    out = []
    for i, m in enumerate(models):
        name = next((n for n, sub in m.named_modules() if isinstance(sub, torch.jit.ScriptModule)), None)
        if name is not None:
            what = f"its submodule {name!r}" if name else "it"
            out.append(
                f"amp_patch: {_model_label(i, m)}: {what} is torch.jit.script-ed; scripted code calls torch's "
                f"kernels directly, so amp_patch's casts never reach it and it runs wholly in FP32. Initialize "
                f"before scripting is pointless too (the script captures the original ops): use the eager "
                f"module, or torch.autocast inside the scripted code."
            )
    return out


def warn_at_initialize(amp: Any, models: Sequence[torch.nn.Module], optimizers: Sequence[Any]) -> None:
    """Warn once about set-ups that run slower or otherwise than intended.

    Called by ``initialize`` after everything is in place; each message is
    given once per process (an ``AmpWarning``, filterable with ``warnings``).
    """
    props, device = amp.props, amp.device_type
    gpu_bf16 = device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    messages = (
        speed_warnings(props, device, cpu_has_native_bf16() if device == "cpu" else True)
        + wrapper_warnings(props, wrapt_has_c_extension())
        + bf16_weights_warnings(props, device, gpu_bf16, models)
        + device_warnings(props, models)
        + optimizer_warnings(props, models, optimizers)
        + pure_half_warnings(props, optimizers)
        + captured_warnings(amp)
        + scripted_warnings(props, models)
    )
    for m in messages:
        _warn_once(m)


# ------------------------------------------------------------ overflow provenance


_tensors = wrappers_tensors  # every tensor in nested lists, tuples and dicts


def _finite(t: torch.Tensor) -> bool:
    # One min/max pass: inf shows at an end, NaN propagates. Several times
    # faster than isfinite(t).all(), which writes a boolean tensor first.
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _all_finite(obj: Any) -> bool:
    return all(_finite(t) for t in _tensors(obj) if t.is_floating_point())


def _first_non_finite(obj: Any) -> Optional[torch.Tensor]:
    return next((t for t in _tensors(obj) if t.is_floating_point() and not _finite(t)), None)


#: how _cast converts a tensor (``to``, or the dtype methods it calls through
#: ``cast.CONVERT``): an overflow there is the cast's, not the op's
_CAST_OPS = frozenset(("torch.Tensor", n) for n in ("to", "half", "bfloat16", "float"))


def _running_wrapper_op(names: modes.OpNames) -> Optional[str]:
    """The patched op whose casting wrapper is on the stack, if any.

    Walks frames, so only for the one call that found an inf/NaN. Every
    wrapper has wrapt's signature, so ``wrapped`` names the op it wraps.
    """
    f = sys._getframe(1)
    while f is not None:
        if f.f_globals is wrappers_globals and "wrapped" in f.f_code.co_varnames:
            wrapped = f.f_locals.get("wrapped")
            found = names.names(wrapped)
            return modes.qualname(found[0]) if found else getattr(wrapped, "__qualname__", None)
        f = f.f_back
    return None


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where the inf/NaN of a skipped step first appeared.

    Attributes:
        loss_id, step: the loss whose step was skipped, and that step.
        kind: ``"output"`` (an op's output in the forward pass), ``"cast"``
            (amp_patch's cast of an input of ``op`` overflowed), ``"gradient"``
            (the backward of ``op`` produced it), ``"cast_gradient"`` (the
            gradient of an input of ``op`` overflowed when cast back to the
            half dtype), or ``None`` when nothing watched was non-finite.
        op: the op's public name (``torch.nn.functional.linear``), or None
            when only a module output was seen.
        module: the module it ran in (``"encoder.fc2"``), or None.
        module_type: that module's class name.
        dtype: the dtype of the non-finite tensor (what the op ran in).
        inputs_finite: whether what the op received was finite (its inputs
            in the forward pass, its output's gradients in the backward).
    """

    loss_id: int
    step: Optional[int]
    kind: Optional[str] = None
    op: Optional[str] = None
    module: Optional[str] = None
    module_type: Optional[str] = None
    dtype: Optional[str] = None
    inputs_finite: Optional[bool] = None
    patching: bool = True  # the run patches torch functions (O1/O4), so op lists apply

    @property
    def yaml(self) -> Optional[str]:
        """The op-list override that runs ``op`` in FP32 (under O1/O4, where op lists
        apply), or None."""
        if self.op is None or self.dtype == "float32" or self.kind == "cast_gradient":
            return None
        for ns in sorted(NAMESPACES, key=len, reverse=True):
            if self.op.startswith(ns + "."):
                name = self.op[len(ns) + 1:]
                # ``a - b`` reaches the mode as Tensor.sub but is patched as __sub__
                names = [name] + list(OPERATOR_FORMS.get(name, ())) if ns == "torch.Tensor" else [name]
                return f"{ns}:\n  float: [{', '.join(names)}]\n"
        return None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["yaml"] = self.yaml
        return d

    def __str__(self) -> str:
        step = "a step" if self.step is None else f"step {self.step}"
        head = f"amp_patch: {step} of loss {self.loss_id} was skipped for inf/NaN gradients."
        if self.kind is None:
            return (
                f"{head} find_overflow saw no non-finite op output or gradient since it was armed; "
                f"arm it before the forward pass of the step to examine (amp_patch.find_overflow())."
            )
        what = self.op or "the output"
        where = f" in module '{self.module}' ({self.module_type})" if self.module else ""
        if self.kind == "output":
            src = "" if self.inputs_finite is None else (
                ", from finite inputs" if self.inputs_finite
                else ", from inputs that already held inf/NaN (check the data and the weights)"
            )
            text = f"{head} The first non-finite value was the output of {what}{where}, computed in {self.dtype}{src}."
        elif self.kind == "cast":
            text = (
                f"{head} The first non-finite value came from casting an input of {what}{where} to "
                f"{self.dtype}: the value is beyond {self.dtype}'s range."
            )
        elif self.kind == "gradient":
            src = "finite gradients" if self.inputs_finite else "gradients that already held inf/NaN"
            text = (
                f"{head} The first non-finite gradient came from the backward of {what}{where}, "
                f"in {self.dtype}, from {src}."
            )
        else:
            text = (
                f"{head} The first non-finite gradient came from casting the gradient of an input of "
                f"{what}{where} back to {self.dtype}: it is beyond {self.dtype}'s range. That is the "
                f"loss scale at work: a dynamic scale lowers itself and retries. If it keeps happening, "
                f"run the op that produces that input in float32."
            )
        body = "\n".join("  " + line for line in (self.yaml or "").splitlines())
        if self.yaml and self.patching:
            text += f"\nTo run it in float32, add to an op-list override (initialize(..., lists='amp_fp32.yaml')):\n{body}"
        elif self.yaml:
            keep = (
                f" initialize(..., keep_fp32=[{self.module!r}]) runs that module in float32 (its output "
                f"still returns to {self.dtype}, so this helps when the overflow is inside it);"
                if self.module else ""
            )
            text += (
                f"\nThis opt level runs the whole model in {self.dtype}; op lists do not apply to it.{keep} "
                f"half_dtype=torch.bfloat16 has float32's range; or opt_level='O1' runs only listed ops in "
                f"{self.dtype} and takes this override (lists='amp_fp32.yaml'):\n{body}"
            )
        elif self.dtype == "float32":
            text += " It already ran in float32: the values themselves overflow; check the inputs and the learning rate."
        return text


class _OverflowWatch:
    """The hooks and the mode observer that find the first inf/NaN."""

    def __init__(self, amp: Any, once: bool):
        self.amp = amp
        self.once = once
        self.names = modes.OpNames(amp)
        self.event: Optional[dict] = None
        self.stack: List[Tuple[str, str]] = []  # (module label, class name), innermost last
        self.handles: List[Any] = []
        self.marks: tuple = ()
        self.last: Optional[Provenance] = None
        self.armed = False

    def _marks(self) -> tuple:
        # The newest history entry of each scaler: it changes with every
        # step, and reading it is O(1) however long the history.
        return tuple(_last_entry(s) for s in getattr(self.amp, "scalers", None) or ())

    def arm(self) -> None:
        if self.armed:
            return
        self.marks = self._marks()
        self.event = None
        several = len(self.amp.models) > 1
        for i, model in enumerate(self.amp.models):
            for name, mod in model.named_modules():
                label = ".".join(x for x in (f"model{i}" if several else "", name) if x) or type(mod).__name__
                self.handles.append(mod.register_forward_pre_hook(self._enter_hook(label, type(mod).__name__, name == "")))
                self.handles.append(mod.register_forward_hook(self._leave_hook(label, type(mod).__name__), always_call=True))
        modes.add(self._observe)
        self.armed = True

    def disarm(self) -> None:
        if not self.armed:
            return
        self.armed = False
        for h in self.handles:
            h.remove()
        self.handles.clear()
        self.stack.clear()
        modes.remove(self._observe)

    # -- hooks
    def _enter_hook(self, label: str, typename: str, root: bool):
        def hook(module, args):
            if root:
                self.stack.clear()
                self._step_boundary()
                if not self.armed:
                    return
            self.stack.append((label, typename))

        return hook

    def _leave_hook(self, label: str, typename: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1][0] == label:
                self.stack.pop()
            if self.event is None:
                with torch._C.DisableTorchFunction():
                    bad = _first_non_finite(output)
                if bad is not None:
                    self.event = dict(kind="output", op=None, module=label, module_type=typename,
                                      dtype=dtype_name(bad.dtype), inputs_finite=None)

        return hook

    def _step_boundary(self) -> None:
        # A new step began since the last forward: whatever was seen belongs
        # to a step that was not skipped (on_skipped_step consumes the rest).
        marks = self._marks()
        if marks != self.marks:
            self.marks = marks
            self.event = None
            if self.once:
                self.disarm()

    # -- the mode observer (already inside DisableTorchFunction)
    def _observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        # Only computations of the forward pass: a getter (``p.grad``)
        # computes nothing, and under no_grad the optimizer and the loss
        # scaler handle gradients that may hold inf by design.
        if self.event is not None or not self.armed or not torch.is_grad_enabled():
            return
        if getattr(func, "__name__", None) == "__get__":
            return
        hooked = set()
        for t in _tensors(out):
            if not t.is_floating_point():
                continue
            if not _finite(t):
                op, cast = self._op(func)
                self.event = dict(kind="cast" if cast else "output", op=op, **self._where(),
                                  dtype=dtype_name(t.dtype), inputs_finite=_all_finite((args, kwargs)))
                return
            node = t.grad_fn
            if node is not None and id(node) not in hooked:
                hooked.add(id(node))
                op, cast = self._op(func)
                node.register_hook(self._backward_hook(op, cast, self._where()))

    def _op(self, func: Any) -> Tuple[str, bool]:
        """The op's public name, and whether it is amp_patch's own cast of an
        input of a patched op (then the name is that op's)."""
        names = self.names.names(func)
        if not names:
            return getattr(func, "__name__", repr(func)), False
        if names[0] in _CAST_OPS:
            outer = _running_wrapper_op(self.names)
            if outer is not None:
                return outer, True
        return modes.qualname(names[0]), False

    def _where(self) -> dict:
        if not self.stack:
            return dict(module=None, module_type=None)
        label, typename = self.stack[-1]
        return dict(module=label, module_type=typename)

    def _backward_hook(self, op: str, cast: bool, where: dict):
        # A node hook sees what the op's backward received (grad_outputs)
        # and produced (grad_inputs): the first node to produce inf/NaN is
        # where the gradient overflowed.
        def hook(grad_inputs, grad_outputs):
            if self.event is not None or not self.armed:
                return None
            with torch._C.DisableTorchFunction():
                bad = _first_non_finite(grad_inputs)
                if bad is not None:
                    self.event = dict(kind="cast_gradient" if cast else "gradient", op=op, **where, dtype=dtype_name(bad.dtype),
                                      inputs_finite=_all_finite(grad_outputs))
            return None

        return hook

    def provenance(self, loss_id: int, step: Optional[int]) -> Provenance:
        e = self.event or {}
        return Provenance(loss_id=loss_id, step=step, patching=bool(self.amp.props.patch_torch_functions), **e)


_watch: Optional[_OverflowWatch] = None


def _release(watch: _OverflowWatch) -> None:
    global _watch
    watch.disarm()
    if _watch is watch:
        _watch = None


def arm_find_overflow(amp: Any, once: bool = False) -> None:
    """Arm overflow provenance: for every step, or (``once``) for the next one.

    Called by ``initialize(..., find_overflow=True)``; ``find_overflow()``
    arms it once.
    """
    global _watch
    w = _watch if _watch is not None and _watch.amp is amp else None
    if w is None:
        w = _watch = _OverflowWatch(amp, once)
        amp.undo.push(lambda: _release(w))
    elif w.armed and not w.once:
        return  # already armed for every step
    else:
        w.once = once
    w.arm()


def _last_entry(scaler: Any) -> Any:
    from .report import history_entry

    rows = getattr(scaler, "history", None)
    try:
        return history_entry(rows[-1]) if rows else None
    except (TypeError, IndexError, KeyError):
        return None


def _scaler_step(scaler: Any) -> Optional[int]:
    last = _last_entry(scaler)
    if last is None:
        return None if getattr(scaler, "history", None) is None else 0
    # The scaler may record the skipped step before or after calling us.
    return last[0] if last[2] else last[0] + 1


def on_skipped_step(amp: Any, loss_id: int, scaler: Any) -> Optional[Provenance]:
    """Called by the loss scaler when it skips a step for inf/NaN gradients.

    With overflow provenance armed, warns (``AmpWarning``) naming the first
    module and op whose output or gradient became non-finite, with its dtype
    and the YAML override that moves the op to FP32, and returns it as a
    ``Provenance``; otherwise returns None.
    """
    w = _watch if _watch is not None and _watch.amp is amp and _watch.armed else None
    if w is None:
        log.debug("amp_patch: loss %s: step skipped for inf/NaN gradients; amp_patch.find_overflow() names the op", loss_id)
        return None
    prov = w.provenance(loss_id, _scaler_step(scaler))
    w.last = prov
    w.event = None
    w.marks = w._marks()
    if w.once:
        w.disarm()
    warnings.warn(str(prov), AmpWarning, stacklevel=_stacklevel())
    return prov


def last_overflow(amp: Any) -> Optional[Provenance]:
    """The provenance of the last skipped step found for ``amp``, or None."""
    w = _watch
    return w.last if w is not None and w.amp is amp else None


def find_overflow() -> None:
    """Name where the next skipped step's inf/NaN comes from.

    Arms overflow provenance for the next optimizer step: if the loss scaler
    skips it, an ``AmpWarning`` names the first module and op whose output or
    gradient held inf/NaN, the dtype it ran in, and the YAML override that
    runs that op in FP32 (``amp_patch.report()`` keeps it too). Call it before
    the forward pass of the step to examine. ``initialize(...,
    find_overflow=True)`` arms it for every step instead.

    Cost while armed: every torch call passes through a Python
    ``TorchFunctionMode`` and each floating-point output and gradient gets a
    min/max pass to find inf/NaN (a device synchronisation per op on CUDA):
    expect that step to take 2-4x as long. It disarms itself after the step.

    Raises:
        StateError: amp_patch is not initialized.

    Example::

        for step, (x, y) in enumerate(loader):
            if step == 100:
                amp_patch.find_overflow()   # look at this step closely
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
    """
    amp = session.current()
    if amp is None:
        raise StateError(
            "amp_patch.find_overflow() needs a running AMP: call amp_patch.initialize(...) first "
            "(or pass find_overflow=True to it to watch every step)"
        )
    arm_find_overflow(amp, once=True)
