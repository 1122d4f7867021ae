"""FP8 matrix multiplies for O6 and O7: torchao's float8 training on O5's BF16 model.

O6 and O7 are O5 (a BF16 model, FP32 master weights in the optimizer, batch
norms kept in FP32) whose selected ``nn.Linear`` layers compute their three
GEMMs (the forward, the input gradient, the weight gradient) in FP8, through
torchao's float8 training (``torchao.float8.convert_to_float8_training``):
each selected layer becomes a ``Float8Linear`` that casts its operands to FP8
with dynamic scales at every call and multiplies them with
``torch._scaled_mm``. The weights stay the model's BF16 parameters (the same
``nn.Parameter`` objects), so the FP32 masters, the optimizer and checkpoints
see no difference. O7 also keeps Adam's moments in FP8 and BF16
(``amp_patch.precision.lowstate``).

**Which layers** (``fp8_layers``; the weight of a layer is ``N x K``, out x in):

- ``"auto"`` (the default): each ``nn.Linear`` whose shape gains from FP8 by
  torchao's measurements on an H100 (``SHAPE_RULE``): both dims multiples of
  16, which FP8 GEMM kernels need, and, with the tensorwise recipe, not
  (K <= 4096 and N <= 1024); with the rowwise recipe, N > 2048, K > 1024 and
  not (N <= 4096 and K <= 2048). The first and the last ``nn.Linear`` of the
  model (in ``named_modules()`` order) stay BF16, as torchao advises;
- ``"all"``: each ``nn.Linear`` with both dims multiples of 16, the first and
  the last kept in BF16;
- module-name patterns (``["blocks.*.mlp.*"]``) or a filter ``(module, name)
  -> bool``: exactly the layers they select, none kept for being first or
  last. A selected layer FP8 cannot take is refused, naming it.

Only layers of the class ``nn.Linear`` itself are converted: a subclass has
forward code of its own (``nn.MultiheadAttention``'s ``out_proj`` is never
called, its weight is read), so replacing it would change nothing or break
it. Layers inside a module ``keep_fp32`` keeps in FP32 stay there.

**Refused, before anything changes** (``ConfigError``): torchao missing or too
old (``pip install -e '.[fp8]'``), a device without FP8 matrix multiplies (a
CUDA GPU below compute capability 8.9, or any device where a small FP8 layer
fails to run forward and backward), a selected layer FP8 cannot take, a model
sharded with ``fully_shard``.

**Undo.** Every converted layer goes back to the very ``nn.Linear`` object it
was, holding the same parameters (FP32 again once the O5 conversion is
undone). The ``Float8Linear`` shares its original's hooks and attributes
while it stands in, so the O5 conversion's checkpoint hooks, a user's hooks
and a copy of the model (a plain FP32 model with ``nn.Linear`` layers,
``amp_patch.precision.copies``) work as at O5. ``convert_to_float8_training``
also patches inductor's Triton min/max code generation once per process (a
workaround torchao applies for compiled FP8 kernels); that is undone too.

torchao is imported only here, and only when an FP8 level is asked for.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..base.errors import ConfigError
from ..config import AmpConfig
from . import copies, fsdp
from . import model as model_side

if TYPE_CHECKING:
    from ..diagnostics.stats import Ledger
    from .conversions import Conversions

log = logging.getLogger("amp_patch")

#: the torchao release the FP8 levels are tested with (the ``fp8`` extra pins it)
TORCHAO = "0.18.0"
#: ``fp8_recipe``: torchao's dynamic scaling recipes
RECIPES = ("tensorwise", "rowwise")
#: the dims FP8 GEMM kernels (cuBLAS, CUTLASS) need a multiple of
MULTIPLE = 16
#: ``fp8_layers="auto"``: each recipe's rule, in words (``gain`` computes it)
SHAPE_RULE = {
    "tensorwise": "not (in_features <= 4096 and out_features <= 1024)",
    "rowwise": "out_features > 2048, in_features > 1024, not (out_features <= 4096 and in_features <= 2048)",
}
#: FP8 matrix multiplies on CUDA need Ada, Hopper or newer
CUDA_CAPABILITY = (8, 9)

Filter = Callable[[nn.Module, str], bool]


# ------------------------------------------------------------------ torchao


_tao: Optional[Any] = None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Importing torchao logs warnings that concern nothing of float8 training
    (its CUDA extensions that do not load with this torch build, Triton's
    absence on a CPU machine, a deprecation in torch's pytree): they are kept
    out of the script's output (torch's goes to amp_patch's debug log)."""

    class _Down(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            log.debug("amp_patch: importing torchao: %s", record.getMessage())
            return False

    down = _Down()
    tao, tree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    level = tao.level
    tao.setLevel(logging.ERROR)  # torchao's own loggers (torchao.kernel.intmm ...) inherit it
    tao.addFilter(down)
    tree.addFilter(down)
    try:
        yield
    finally:
        tree.removeFilter(down)
        tao.removeFilter(down)
        tao.setLevel(level)


def torchao(level: str = "O6") -> Any:
    """``torchao.float8``, imported on first use; ConfigError saying what is missing."""
    global _tao
    if _tao is not None and sys.modules.get("torchao.float8") is _tao:
        return _tao
    install = (f"Install it with: pip install -e '.[fp8]' (in a checkout of amp_patch), or pip install "
               f"torchao=={TORCHAO}")
    try:
        with _quiet():
            import torchao.float8 as tao
            importlib.import_module("torchao.float8.float8_linear")
    except ImportError as e:
        raise ConfigError(
            f"opt_level={level!r} computes nn.Linear layers in FP8 with torchao's float8 training, and torchao "
            f"is not installed ({e}). {install}. Without it, O5 is the same BF16 model without FP8."
        ) from None
    except Exception as e:  # torchao is there, built for another torch
        raise ConfigError(
            f"opt_level={level!r} needs torchao's float8 training, but importing torchao failed with torch "
            f"{torch.__version__}: {type(e).__name__}: {e}. amp_patch's FP8 levels are tested with torchao "
            f"{TORCHAO}; {install}."
        ) from None
    missing = [n for n in ("convert_to_float8_training", "Float8LinearConfig") if not hasattr(tao, n)]
    if missing or not hasattr(tao.Float8LinearConfig, "from_recipe_name"):
        version = getattr(sys.modules.get("torchao"), "__version__", "?")
        raise ConfigError(
            f"opt_level={level!r} needs torchao's float8 training (convert_to_float8_training and "
            f"Float8LinearConfig.from_recipe_name), which torchao {version} lacks. {install}."
        )
    _tao = tao
    return tao


def linear_class() -> type:
    """torchao's ``Float8Linear``."""
    torchao()
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def recipe_config(recipe: str) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (``RECIPES``)."""
    return torchao().Float8LinearConfig.from_recipe_name(recipe)


# ------------------------------------------------------------------ the device


#: (device, recipe) -> why FP8 cannot run there ("" when it can)
_probed: Dict[Tuple[str, str], str] = {}


def cuda_refusal(capability: Tuple[int, int], name: str) -> str:
    """Why a CUDA device of ``capability`` has no FP8 matrix multiplies, or ""."""
    if tuple(capability) >= CUDA_CAPABILITY:
        return ""
    return (f"{name} (compute capability {capability[0]}.{capability[1]}) has no FP8 matrix multiplies; they need "
            f"compute capability {CUDA_CAPABILITY[0]}.{CUDA_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)")


def _try_a_layer(device: torch.device, recipe: str) -> None:
    """One small FP8 layer forward and backward on ``device``, without drawing
    from any random number generator (the run's seeds stay as the script left them)."""
    Float8Linear = linear_class()
    with torch.device("meta"):
        lin = nn.Linear(32, 32, bias=False)
    lin.weight = nn.Parameter(torch.linspace(-1, 1, 32 * 32, device=device).reshape(32, 32).to(torch.bfloat16))
    layer = Float8Linear.from_float(lin, config=recipe_config(recipe))
    x = torch.linspace(-2, 2, 16 * 32, device=device).reshape(16, 32).to(torch.bfloat16).requires_grad_()
    with torch.enable_grad():
        layer(x).float().square().sum().backward()
    if x.grad is None or lin.weight.grad is None:
        raise RuntimeError("the FP8 layer's backward left no gradients")


def device_refusal(device: torch.device, recipe: str) -> str:
    """Why ``device`` cannot run torchao's FP8 layers with ``recipe``, or "" (checked once per process)."""
    key = (str(device), recipe)
    if key in _probed:
        return _probed[key]
    why = ""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        why = cuda_refusal(torch.cuda.get_device_capability(idx), torch.cuda.get_device_name(idx))
    if not why:
        try:
            _try_a_layer(device, recipe)
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            why = (f"a small FP8 layer with the {recipe} recipe fails on {device} "
                   f"(torch._scaled_mm, torch {torch.__version__}): {type(e).__name__}: {first[:300]}")
    _probed[key] = why
    return why


def _device_of(model: nn.Module) -> torch.device:
    for t in model.parameters():
        return t.device
    return torch.device("cpu")


# ------------------------------------------------------------------ which layers


@dataclasses.dataclass
class Choice:
    """One ``nn.Linear`` of a model and whether it computes in FP8 (``why`` not, if not)."""

    name: str
    out_features: int
    in_features: int
    fp8: bool
    why: str = ""
    #: the dtype its weight has (what a layer out of FP8 computes in)
    dtype: str = "bfloat16"


def shape_refusal(module: nn.Module) -> str:
    """Why FP8 GEMM kernels cannot take this layer's shape, or ""."""
    n, k = module.weight.shape
    bad = [f"{what} {v}" for what, v in (("in_features", k), ("out_features", n)) if v % MULTIPLE]
    return f"{' and '.join(bad)} not a multiple of {MULTIPLE} (FP8 GEMM kernels need it)" if bad else ""


def gain(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao's rule (``SHAPE_RULE``): does a layer of this shape run faster in FP8 with ``recipe``?"""
    n, k = out_features, in_features
    if recipe == "rowwise":
        return n > 2048 and k > 1024 and not (n <= 4096 and k <= 2048)
    return not (k <= 4096 and n <= 1024)


def _kept_fp32(model: nn.Module, config: AmpConfig) -> set:
    """``id`` of every module that stays FP32 under ``keep_fp32`` (and the modules inside)."""
    spec = config.keep_fp32
    keep = model_side._PatternFilter(tuple(spec)) if isinstance(spec, tuple) else spec
    kept = model_side._kept_modules(model, bool(config.keep_batchnorm_fp32), keep)
    return {id(m) for mod in model.modules() if id(mod) in kept for m in mod.modules()}


def _explicit(config: AmpConfig) -> Optional[Filter]:
    """``fp8_layers`` patterns or filter as a ``(module, name) -> bool``; None for "auto"/"all"."""
    spec = config.fp8_layers
    if callable(spec):
        return spec
    if isinstance(spec, str):
        return None
    return lambda module, name: any(fnmatch.fnmatchcase(name, p) for p in spec)


def _check_patterns(models: Sequence[nn.Module], config: AmpConfig) -> None:
    """Refuse an ``fp8_layers`` pattern that matches no ``nn.Linear`` of the models, naming the nearest."""
    spec = config.fp8_layers
    if callable(spec) or isinstance(spec, str):
        return
    names = [n for model in models for n, m in model.named_modules() if n and isinstance(m, nn.Linear)]
    for p in spec:
        if not any(fnmatch.fnmatchcase(n, p) for n in names):
            near = difflib.get_close_matches(p, names, 3)
            raise ConfigError(
                f"fp8_layers pattern {p!r} matches no nn.Linear of the model(s)"
                + (f"; did you mean {', '.join(repr(n) for n in near)}?" if near else
                   f"; their nn.Linear layers are {', '.join(names[:8]) or 'none'}" + (" ..." if len(names) > 8 else ""))
                + " (patterns are matched with fnmatch against dotted names like 'blocks.0.mlp.up')"
            )


def select(model: nn.Module, config: AmpConfig, index: int = 0) -> List[Choice]:
    """Every ``nn.Linear`` of ``model`` and whether it computes in FP8 under ``config``.

    Raises:
        ConfigError: a layer ``fp8_layers`` names explicitly that FP8 cannot take.
    """
    recipe = config.fp8_recipe
    chosen = _explicit(config)
    kept = _kept_fp32(model, config)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    first_last = {linears[0][0], linears[-1][0]} if linears else set()
    out: List[Choice] = []
    for pos, (name, mod) in enumerate(linears):
        n, k = mod.weight.shape
        c = Choice(name or "(the model)", n, k, False, dtype=str(mod.weight.dtype).replace("torch.", ""))
        out.append(c)
        if chosen is not None:
            if not chosen(mod, name):
                c.why = "not selected by fp8_layers"
                continue
            why = (
                "it is the model itself (FP8 replaces layers inside a model; wrap it in nn.Sequential)" if not name
                else f"it is a {type(mod).__name__}, a subclass of nn.Linear with code of its own" if type(mod) is not nn.Linear
                else "keep_fp32 keeps it in FP32" if id(mod) in kept
                else shape_refusal(mod)
            )
            if why:
                raise ConfigError(
                    f"fp8_layers selects {name or 'the model'!r} of model {index} ({type(model).__name__}, weight "
                    f"{n} x {k}), which FP8 cannot take: {why}. Leave it out of fp8_layers (fp8_layers='auto' "
                    f"selects only layers FP8 can take)."
                )
            c.fp8 = True
            continue
        if not name or type(mod) is not nn.Linear:
            c.why = "the model itself" if not name else f"a {type(mod).__name__} (a subclass of nn.Linear)"
        elif id(mod) in kept:
            c.why = "kept in FP32 (keep_fp32)"
        elif shape_refusal(mod):
            c.why = shape_refusal(mod)
        elif name in first_last:
            c.why = f"the {'first' if pos == 0 else 'last'} nn.Linear of the model (kept in BF16, as torchao advises)"
        elif config.fp8_layers == "auto" and not gain(recipe, n, k):
            c.why = f"too small to gain from FP8 ({recipe}: needs {SHAPE_RULE[recipe]})"
        else:
            c.fp8 = True
    return out


# ------------------------------------------------------------------ checks


def validate(models: Sequence[nn.Module], config: AmpConfig) -> None:
    """At O6/O7, check torchao, the devices and the layer choice; change nothing.

    Raises:
        ConfigError: naming what is missing or refused, and the fix.
    """
    if not config.fp8_level:
        return
    level = config.opt_level
    for i, m in enumerate(models):
        if fsdp.sharded(m):
            raise ConfigError(
                f"model {i} ({type(m).__name__}) is sharded with fully_shard; opt_level={level!r} does not combine "
                f"FP8 layers with FSDP2. Use O5 with FSDP2, or O6/O7 on an unsharded model."
            )
    torchao(level)
    for i, m in enumerate(models):
        device = _device_of(m)
        why = device_refusal(device, config.fp8_recipe)
        if why:
            raise ConfigError(
                f"opt_level={level!r} computes nn.Linear layers in FP8, but {why}. Use O5 here (the same BF16 model "
                f"and FP32 masters without FP8), or run on a GPU with FP8 (compute capability "
                f"{CUDA_CAPABILITY[0]}.{CUDA_CAPABILITY[1]}+)."
            )
    _check_patterns(models, config)
    for i, m in enumerate(models):
        select(m, config, i)


# ------------------------------------------------------------------ the swap


class Fp8Calls:
    """Forward hook of an FP8 layer while ``collect_stats=True``: counts its calls
    in the op ledger, under policy ``"fp8"``."""

    def __init__(self, ledger: "Ledger", name: str):
        self.ledger, self.name, self.calls = ledger, name, 0

    def __deepcopy__(self, memo: dict) -> "Fp8Calls":
        return self  # holds the session's ledger; the copy rule then drops the hook

    def __call__(self, module: nn.Module, args: tuple, output: object) -> None:
        self.calls += 1
        self.ledger.count(self.name, "fp8", torch.float8_e4m3fn)

    def __repr__(self) -> str:
        return f"amp_patch.Fp8Calls({self.name!r})"


copies.drop_on_copy(Fp8Calls)

#: what an ``nn.Linear`` holds that its ``Float8Linear`` keeps of its own
_OWN = ("_parameters", "_buffers", "_modules", "in_features", "out_features")


class Fp8Model:
    """The FP8 layers of one model: what was swapped, to report and to undo."""

    def __init__(self, model: nn.Module, index: int, recipe: str, choices: List[Choice]):
        self.model, self.index, self.recipe, self.choices = model, index, recipe, choices
        #: (parent module, attribute name, the original nn.Linear, layer name) of each selected layer
        self.swaps: List[Tuple[nn.Module, str, nn.Module, str]] = []
        #: layer name -> the Float8Linear standing in for it
        self.layers: Dict[str, nn.Module] = {}
        #: layer name -> the attribute names the Float8Linear has of its own (torchao's)
        self.own: Dict[str, Tuple[str, ...]] = {}
        self.counters: Dict[str, Fp8Calls] = {}
        self.handles: List[Any] = []

    def rows(self) -> List[Dict[str, Any]]:
        """One dict per ``nn.Linear``: the report's FP8 table."""
        out = []
        for c in self.choices:
            counter = self.counters.get(c.name)
            out.append({
                "model": self.index, "layer": c.name, "shape": [c.out_features, c.in_features],
                "runs_in": "float8" if c.fp8 else c.dtype, "recipe": self.recipe if c.fp8 else None,
                "why": c.why, "calls": counter.calls if counter is not None else None,
            })
        return out


def _graft(orig: nn.Module, new: nn.Module) -> Tuple[str, ...]:
    """Give ``new`` (torchao's ``Float8Linear``) ``orig``'s hooks and attributes, the
    same objects: hooks registered on either, before or during the run, are on both.
    Returns the attribute names ``new`` keeps of its own."""
    own = tuple(k for k in vars(new) if k not in vars(orig)) + _OWN
    for k, v in vars(orig).items():
        if k not in _OWN:
            vars(new)[k] = v
    return own


class _Unswap:
    """Undo of ``attach`` for one model: each original ``nn.Linear`` back in its
    place, with what the run changed on its stand-in (``train()``/``eval()``, an
    attribute set, a parameter replaced)."""

    def __init__(self, rec: Fp8Model):
        self.rec = rec

    def __call__(self) -> None:
        rec = self.rec
        for h in reversed(rec.handles):
            h.remove()
        rec.handles.clear()
        Float8Linear = sys.modules.get("torchao.float8.float8_linear")
        cls = getattr(Float8Linear, "Float8Linear", None)
        for parent, leaf, orig, name in reversed(rec.swaps):
            cur = parent._modules.get(leaf)
            if cur is orig or cur is None or (cur is not rec.layers.get(name) and not (cls and isinstance(cur, cls))):
                continue  # not swapped yet, or replaced by the script: left as the script has it
            own = rec.own.get(name, _OWN)
            for k, v in vars(cur).items():
                if k not in own:
                    vars(orig)[k] = v
            for k, p in cur._parameters.items():
                if orig._parameters.get(k) is not p:
                    orig._parameters[k] = p
            parent._modules[leaf] = orig
        rec.layers.clear()


class _InductorPatch:
    """``convert_to_float8_training`` patches inductor's Triton min/max code
    generation once per process (``torchao.float8._inductor_patch``); the undo
    puts torch's own back, and lets torchao patch again on its next conversion."""

    NAMES = ("minimum", "maximum")

    def __init__(self) -> None:
        self.cls: Optional[type] = None
        self.saved: Dict[str, Any] = {}
        self.flag: Optional[Any] = None
        try:
            patch = importlib.import_module("torchao.float8._inductor_patch")
        except Exception:
            return
        if getattr(patch, "_PATCHED", True):
            return  # patched before this run: it stays
        try:
            from torch._inductor.codegen.triton import TritonOverrides
        except Exception:
            return
        self.cls, self.flag = TritonOverrides, patch
        self.saved = {n: vars(TritonOverrides).get(n, _ABSENT) for n in self.NAMES}

    def __call__(self) -> None:
        if self.cls is None:
            return
        for n, v in self.saved.items():
            if v is _ABSENT:
                if n in vars(self.cls):
                    delattr(self.cls, n)
            else:
                setattr(self.cls, n, v)
        self.flag._PATCHED = False  # type: ignore[union-attr]


_ABSENT = object()


def _parent(model: nn.Module, name: str) -> Tuple[nn.Module, str]:
    head, _, leaf = name.rpartition(".")
    return (model.get_submodule(head) if head else model), leaf


def attach(conv: "Conversions", models: Sequence[nn.Module], config: AmpConfig,
           ledger: Optional["Ledger"] = None) -> None:
    """At O6/O7, swap each model's selected ``nn.Linear`` layers for torchao's
    ``Float8Linear`` (after the O5 conversion made them BF16), each change
    pushing its undo onto ``conv.undo`` as it is made. With a ``ledger``
    (``collect_stats=True``) each FP8 layer's calls are counted there."""
    if not config.fp8_level:
        return
    tao = torchao(config.opt_level)
    Float8Linear = linear_class()
    settings = recipe_config(config.fp8_recipe)
    inductor = False
    for m in models:
        index = len(conv.fp8)
        rec = Fp8Model(m, index, config.fp8_recipe, select(m, config, index))
        conv.add_fp8(rec)
        conv.undo.push(_Unswap(rec))
        names = [c.name for c in rec.choices if c.fp8]
        originals = {}
        for name in names:
            parent, leaf = _parent(m, name)
            orig = parent._modules[leaf]
            rec.swaps.append((parent, leaf, orig, name))
            originals[name] = orig
        if not names:
            continue
        if not inductor:
            conv.undo.push(_InductorPatch())  # before the conversion that patches it
            inductor = True
        tao.convert_to_float8_training(
            m, config=settings, module_filter_fn=lambda mod, fqn: originals.get(fqn) is mod)
        for parent, leaf, orig, name in rec.swaps:
            new = parent._modules[leaf]
            if not isinstance(new, Float8Linear) or new.weight is not orig.weight:
                raise RuntimeError(f"torchao did not convert {name!r} as asked (it holds a {type(new).__name__})")
            rec.own[name] = _graft(orig, new)
            rec.layers[name] = new
            if ledger is not None:
                counter = Fp8Calls(ledger, f"{name if index == 0 else f'model{index}.{name}'} (Float8Linear)")
                rec.counters[name] = counter
                rec.handles.append(new.register_forward_hook(counter))
        if conv.config.verbosity:
            log.info("amp_patch: %d of %d nn.Linear layers of %s compute in FP8 (%s)", len(names), len(rec.choices),
                     type(m).__name__, config.fp8_recipe)

