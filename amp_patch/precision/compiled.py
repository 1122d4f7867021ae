"""The fused master update of O2/O5: ``initialize(..., fused_update=True)``.

The plain O2 step runs the user's optimizer on the FP32 masters (a foreach
pass per state tensor) and then copies the masters into the half model, one
more pass over every parameter. The fused update does the same arithmetic in
one compiled (``torch.compile``) call per param group, a fused loop per
parameter: it reads the FP32 gradient, the master and the optimizer state
once, and writes the master, the state and the half weight once. The
gradients it reads are the masters' true ones, which every scaled backward
leaves there (unscaled and checked as it ends), so the skip decision and
everything user code did to them before the step (clipping, ``unscale_``)
are the plain step's.

Where the one-pass C step (``onepass.py``, the O2/O5 default where it is
built) can take a step it does, under ``fused_update=True`` too: it starts at
once and is faster. This compiled update is for the rest of what it covers
(CUDA or non-contiguous tensors, or no C compiler at install).

What it covers, and why the rest falls back to the plain step:

- ``torch.optim.SGD``, ``Adam`` and ``AdamW`` with their standard options
  (``fused``, ``capturable`` and ``differentiable`` excluded). Their update is
  rewritten here, with the learning rate as a tensor so a scheduler changing
  it every step does not recompile. The results match the plain step to
  float32 rounding, not bit for bit (the compiler orders the arithmetic its own
  way); a run is still bitwise reproducible, checkpoints and resume included.
- The first step, which creates the optimizer state, a step whose parameters
  sit on more than one device, a sparse gradient, and every step after the
  user changes a hyperparameter other than the learning rate (one recompile
  would cost more than it saves) are the plain step.
- No C++ compiler (or a compile error of any kind): a warning, then the plain
  step for the rest of the run.

Each distinct layout (parameter shapes, baked hyperparameters) compiles once;
past torch's recompile limit (``torch._dynamo.config.recompile_limit``, 8)
the same update runs uncompiled, correct but no faster than the plain step.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..base.errors import ConfigError
from ..config import AmpConfig

if TYPE_CHECKING:
    from .master import MasterWeights

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
f32 = torch.float32

#: optimizer class -> the group keys whose values the compiled update bakes in
SUPPORTED = {
    torch.optim.SGD: ("momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    torch.optim.Adam: ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
    torch.optim.AdamW: ("betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"),
}
_REFUSED_FLAGS = ("fused", "capturable", "differentiable")


def check(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why ``optimizer`` cannot take the fused update, or None when it can."""
    keys = SUPPORTED.get(type(optimizer))
    if keys is None:
        return f"{type(optimizer).__name__} is not one of torch.optim.SGD, Adam, AdamW"
    for group in optimizer.param_groups:
        for flag in _REFUSED_FLAGS:
            if group.get(flag):
                return f"{type(optimizer).__name__}({flag}=True) runs its own kernel"
    return None


def validate(config: AmpConfig, optimizers: List[torch.optim.Optimizer]) -> None:
    """Check ``config.fused_update`` against the opt level and optimizers before anything changes.

    Raises:
        ConfigError: naming what the fused update needs and the fix.
    """
    if not config.fused_update:
        return
    if not config.master_weights:
        raise ConfigError(
            f"fused_update=True fuses the update of FP32 master weights, but opt_level={config.opt_level!r} has "
            f"none; use it with O2 or O5 (or master_weights=True)"
        )
    for i, opt in enumerate(optimizers):
        why = check(opt)
        if why is not None:
            raise ConfigError(
                f"fused_update=True: optimizer {i}: {why}. Use torch.optim.SGD, Adam or AdamW without "
                f"fused/capturable/differentiable, or drop fused_update"
            )


def _float(g: Tensor, maximize: bool) -> Tensor:
    """The gradient in FP32, negated for ``maximize``."""
    g = g.to(f32)
    return -g if maximize else g


def _sgd(params: List[Tensor], grads: List[Tensor], bufs: List[Tensor], halfs: List[Tensor], lr: Tensor,
         momentum: float, dampening: float, weight_decay: float, nesterov: bool, maximize: bool) -> None:
    """``torch.optim.SGD``'s update; ``halfs[i]`` receives ``params[i]`` (the masters come first)."""
    for i, p in enumerate(params):
        g = _float(grads[i], maximize)
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            b = bufs[i]
            b.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g + momentum * b if nesterov else b
        p.sub_(lr * g)
        if i < len(halfs):
            halfs[i].copy_(p)


def _adam(params: List[Tensor], grads: List[Tensor], exp_avgs: List[Tensor], exp_avg_sqs: List[Tensor],
          max_sqs: List[Tensor], steps: List[Tensor], halfs: List[Tensor], lr: Tensor,
          beta1: float, beta2: float, eps: float, weight_decay: float, amsgrad: bool, maximize: bool,
          decoupled: bool) -> None:
    """``torch.optim.Adam``'s and ``AdamW``'s update (``decoupled`` weight decay for AdamW)."""
    for i, p in enumerate(params):
        g = _float(grads[i], maximize)
        step = steps[i]
        step.add_(1)
        if weight_decay != 0:
            if decoupled:
                p.mul_(1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
        m, v = exp_avgs[i], exp_avg_sqs[i]
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if amsgrad:
            v = max_sqs[i].copy_(torch.maximum(max_sqs[i], v))
        bias1 = 1 - beta1 ** step
        bias2_sqrt = (1 - beta2 ** step).sqrt()
        p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))
        if i < len(halfs):
            halfs[i].copy_(p)


_KERNELS = {"sgd": _sgd, "adam": _adam}


class Plan(NamedTuple):
    """What one fused step works on: per param group ``(params, grads, halfs)``
    (masters first, ``halfs[i]`` receiving ``params[i]``), their one device, and
    the hyperparameters it bakes in."""

    groups: List[Tuple[List[Tensor], List[Tensor], List[Tensor]]]
    device: torch.device
    hyper: List[Tuple[Any, ...]]


class CompiledUpdate:
    """The fused update of one optimizer's FP32 masters (see the module docstring)."""

    #: one compiled function per kernel and device type, shared by every optimizer
    _compiled: Dict[Tuple[str, str], Callable[..., Any]] = {}

    def __init__(self, masters: MasterWeights):
        self.mw = masters  # master.MasterWeights
        opt = masters.optimizer
        self.kind = "sgd" if type(opt) is torch.optim.SGD else "adam"
        self.keys = SUPPORTED[type(opt)]
        self.decoupled = type(opt) is torch.optim.AdamW  # Adam's default when a group has no such key
        self.off: Optional[str] = None  # why the fused update stopped for good
        self.baked: Optional[List[Tuple[Any, ...]]] = None  # the hyperparameters it compiled with
        self.lr: Optional[Tensor] = None  # 0-d, refilled per group: a new lr is not a recompile
        self.steps = 0  # fused steps taken

    def _fn(self, kind: str, device: torch.device) -> Callable[..., Any]:
        key = (kind, device.type)
        fn = self._compiled.get(key)
        if fn is None:
            # torch's on-disk graph cache does not key a CPU graph by the vector
            # instructions it was generated for: read on a CPU with narrower vectors
            # (a cache directory another machine wrote, or ATEN_CPU_CAPABILITY
            # changed), its kernels update only part of each tensor, silently. A CPU
            # update's graph is generated afresh in each process (seconds, at its
            # first step); the C++ it compiles to stays cached, keyed by its flags.
            options = {"fx_graph_cache": False} if device.type == "cpu" else None
            fn = self._compiled[key] = torch.compile(_KERNELS[kind], dynamic=False, options=options)
        return fn

    def _lists(self, group: Dict[str, Any], device: Optional[torch.device]) -> Optional[Tuple[List[Tensor], ...]]:
        """``(params, grads, halfs)`` of a group, masters first; None if one of them cannot
        be fused (not FP32, a sparse gradient, or on another device than ``device``)."""
        mw = self.mw
        masters: List[Tensor] = []
        grads: List[Tensor] = []
        halfs: List[Tensor] = []
        own: List[Tensor] = []
        own_grads: List[Tensor] = []
        for p in group["params"]:
            i = mw.index.get(id(p))
            if i is not None and mw.masters[i] is p:
                g = p.grad
                if g is None:
                    continue
                masters.append(p)
                grads.append(g)
                halfs.append(mw.halfs[i])
            else:
                g = p.grad
                if g is None:
                    continue
                own.append(p)
                own_grads.append(g)
            if p.dtype != f32 or g.is_sparse or (device is not None and p.device != device):
                return None
            device = p.device
        return masters + own, grads + own_grads, halfs

    def _has_state(self, group: Dict[str, Any], params: List[Tensor]) -> bool:
        """Whether the optimizer state the update reads exists (the first plain step creates it)."""
        state = self.mw.optimizer.state
        if self.kind == "sgd":
            if group["momentum"] == 0:
                return True
            return all(state.get(p, {}).get("momentum_buffer") is not None for p in params)
        need = ("exp_avg", "exp_avg_sq", "step") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        return all(all(k in state.get(p, {}) for k in need) for p in params)

    def plan(self) -> Optional[Plan]:
        """The work of a fused step, or None when this step must be the plain one.

        Touches neither the model nor the optimizer; a changed hyperparameter
        turns the fused update off for good.
        """
        if self.off is not None or torch.compiler.is_compiling():
            return None
        param_groups = self.mw.optimizer.param_groups
        hyper = [tuple(g.get(k) for k in self.keys) for g in param_groups]
        if self.baked is not None and hyper != self.baked:
            self._stop(f"a hyperparameter other than lr changed ({', '.join(self.keys)})")
            return None
        groups = []
        device = None
        for group in param_groups:
            lists = self._lists(group, device)
            if lists is None or not self._has_state(group, lists[0]):
                return None
            if lists[0]:
                device = lists[0][0].device
            groups.append(lists)
        if device is None:
            return None  # no gradient at all: nothing to fuse
        return Plan(groups, device, hyper)

    def run(self, plan: Plan) -> bool:
        """The fused update of every param group, from the true FP32 gradients.

        Returns False, with nothing changed, when the compile fails (the fused
        update is then off for the rest of the run).
        """
        opt = self.mw.optimizer
        if self.lr is None or self.lr.device != plan.device:
            self.lr = torch.zeros((), dtype=f32, device=plan.device)
        lr = self.lr
        update = self._fn(self.kind, plan.device)
        stepped = False  # a group has been updated: the plain step must not repeat it
        try:
            with torch.no_grad():
                for group, (params, grads, halfs) in zip(opt.param_groups, plan.groups):
                    if not params:
                        continue
                    lr.fill_(group["lr"])
                    state = [opt.state.get(p) for p in params]  # .get: no empty entries (momentum-free SGD has none)
                    if self.kind == "sgd":
                        m = group["momentum"]
                        bufs = [s["momentum_buffer"] for s in state] if m != 0 else []
                        update(params, grads, bufs, halfs, lr, m, group["dampening"],
                               group["weight_decay"], group["nesterov"], group["maximize"])
                    else:
                        b1, b2 = group["betas"]
                        ams = group["amsgrad"]
                        update(params, grads, [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state],
                               [s["max_exp_avg_sq"] for s in state] if ams else [], [s["step"] for s in state],
                               halfs, lr, b1, b2, group["eps"], group["weight_decay"], ams, group["maximize"],
                               bool(group.get("decoupled_weight_decay", self.decoupled)))
                    stepped = True
        except Exception as e:  # no compiler, or a compiler error: the plain step is always there
            if stepped:  # groups before this one have stepped already: the plain step must not repeat them
                raise
            self._failed(e)
            return False
        self.baked = plan.hyper
        self.steps += 1
        return True

    def _failed(self, e: Exception) -> None:
        self._stop(f"torch.compile failed ({type(e).__name__}: {e})", warn=True)

    def _stop(self, why: str, warn: bool = False) -> None:
        self.off = why
        say = log.warning if warn else log.info
        say("amp_patch: fused_update off for the rest of this run: %s; the plain O2 step runs", why)
