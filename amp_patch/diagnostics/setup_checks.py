"""Warnings at initialize, and overflow provenance for skipped steps.

``warn_at_initialize`` looks once at what ``initialize`` was given and warns
(``AmpWarning``, each message once per process) about set-ups that run slower
than FP32 or not as the user thinks: BF16 on a CPU without native BF16, FP16 on
a CPU, FP16 over BF16 weights on a BF16-capable GPU, a model spread over
several devices, optimizer parameters outside the models, trainable
parameters of an O2/O5 model that no optimizer covers, an optimizer ``eps``
that is 0 in the half dtype with no FP32 masters (O3), and torch functions
a user module bound before ``initialize`` (which no patch can reach).
"""
from __future__ import annotations

import logging
import os
import sys
import sysconfig
import types
from typing import TYPE_CHECKING, List, Sequence, Set, Tuple

import torch

from ..base import frames
from ..patching.cast import LOW
from ..patching.wrappers import wrapt_has_c_extension
from .notices import warn_once
from .stats import dtype_name

if TYPE_CHECKING:
    from ..config import AmpConfig
    from ..patching.registry import Patcher
    from .state import Diagnostics

log = logging.getLogger("amp_patch")

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


def _uses_half(props: AmpConfig) -> bool:
    return props.patch_torch_functions or props.cast_model_type in LOW


def _model_label(i: int, m: torch.nn.Module) -> str:
    return f"model {i} ({type(m).__name__})"


def speed_warnings(props: AmpConfig, device_type: str, native_bf16: bool) -> List[str]:
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


def wrapper_warnings(props: AmpConfig, c_extension: bool) -> List[str]:
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


def bf16_weights_warnings(props: AmpConfig, device_type: str, gpu_bf16: bool, models: Sequence[torch.nn.Module]) -> List[str]:
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


def device_warnings(props: AmpConfig, models: Sequence[torch.nn.Module]) -> List[str]:
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


def optimizer_warnings(props: AmpConfig, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer]) -> List[str]:
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


def coverage_warnings(props: AmpConfig, models: Sequence[torch.nn.Module], optimizers: Sequence[torch.optim.Optimizer], covered: Set[int]) -> List[str]:
    """Trainable parameters of a model with FP32 masters (O2/O5) that no optimizer covers.

    Only the optimizers' parameters get masters; the others stay half, and no
    step given to ``initialize`` updates them. ``covered``: the ids of the
    model parameters the optimizers step (directly or through a master).
    """
    if not props.master_weights or props.cast_model_type not in LOW or not optimizers:
        return []
    out = []
    for i, m in enumerate(models):
        trainable = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
        left = [name for name, p in trainable if id(p) not in covered]
        if not left:
            continue
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        out.append(
            f"amp_patch: the optimizers given to initialize cover {len(trainable) - len(left)} of the "
            f"{len(trainable)} trainable parameters of {_model_label(i, m)}; {shown} "
            f"{'is' if len(left) == 1 else 'are'} in none of them, so at {props.opt_level} "
            f"{'it stays' if len(left) == 1 else 'they stay'} {dtype_name(props.cast_model_type)} with no FP32 master "
            f"and no step updates {'it' if len(left) == 1 else 'them'}. Pass every optimizer that trains the model "
            f"(initialize(model, [opt1, opt2], ...)), or set requires_grad=False on what you mean to freeze."
        )
    return out


def pure_half_warnings(props: AmpConfig, optimizers: Sequence[torch.optim.Optimizer]) -> List[str]:
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


def _is_user_module(mod: object, library: Tuple[str, ...]) -> bool:
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


def captured_functions(patcher: "Patcher") -> List[Tuple[str, str, str]]:
    """``(module, name, op)`` for each user-module global that holds an
    original torch function ``patcher`` (the running AMP's) patched."""
    originals = {}
    for owner, name, original in patcher.originals():
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


def captured_warnings(patcher: "Patcher") -> List[str]:
    out = []
    for mod, name, op in captured_functions(patcher):
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


def scripted_warnings(props: AmpConfig, models: Sequence[torch.nn.Module]) -> List[str]:
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


def warn_at_initialize(diag: "Diagnostics", models: Sequence[torch.nn.Module],
                       optimizers: Sequence[torch.optim.Optimizer], stepped: Set[int]) -> None:
    """Warn once about set-ups that run slower or otherwise than intended.

    Called by ``initialize`` after everything is in place; each message is
    given once per process (an ``AmpWarning``, filterable with ``warnings``).
    ``stepped``: the ids of the parameters ``optimizers`` step, their own and
    the half model parameters their FP32 masters stand in for (loss scaling
    holds the masters, a floor above: ``run`` reads them).
    """
    props, device = diag.config, diag.device_type
    gpu_bf16 = device == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    messages = (
        speed_warnings(props, device, cpu_has_native_bf16() if device == "cpu" else True)
        + wrapper_warnings(props, wrapt_has_c_extension())
        + bf16_weights_warnings(props, device, gpu_bf16, models)
        + device_warnings(props, models)
        + optimizer_warnings(props, models, optimizers)
        + coverage_warnings(props, models, optimizers, stepped)
        + pure_half_warnings(props, optimizers)
        + captured_warnings(diag.patcher)
        + scripted_warnings(props, models)
    )
    for m in messages:
        warn_once(m)
