"""The default optimizer step of O1/O2/O4/O5: one pass per parameter, in C.

The plain O2 step runs the optimizer's update over the FP32 masters (a
multi-tensor pass per state tensor) and then copies the masters into the half
model, one more pass. ``_onepass.c`` does it in one pass: it reads each
gradient once, updates the FP32 master and the optimizer state, and writes the
half weight. It starts at once (no compiler at run time), is vectorized for
the CPU it finds, and uses up to torch's intra-op thread count (one thread
per ``PER_THREAD`` elements: a small step stays on one). It computes what the
plain step computes, bit for bit on the masters and the optimizer state: each
update is written with the float operations of torch's own CPU
implementation, in their order, and Adam's square root is taken by the
routine ``torch.sqrt`` runs (``sqrt_mode``).

The gradients it reads are the masters' own FP32 ones, already unscaled and
checked: every scaled backward leaves them there (``amp_patch.scaling``), so
what user code did to them before the step (clipping, accumulation) is what
is applied. The kernel replaces the optimizer's update and the copy into the
half model. It also takes half gradients and an inverse scale (the C entry
points' ``items`` and ``inv``), which its tests use.

At O1/O4 there are no masters: the parameters are the model's own FP32
ones, and the kernel is their optimizer's update with no half copy to write.
What it saves there is not memory traffic but calls: torch's CPU optimizers
step one parameter at a time, a few tensor operations each, and on a small
model (tens of small parameters) those calls cost more than the arithmetic.
One call per param group does the same float operations, and one pass over
memory where torch's momentum, weight decay and Adam make several. O1 takes
it only where it is bit for bit torch's step (Adam needs ``sqrt_mode()``
"torch" or "ieee") and saves work (not plain SGD, which torch already does in
one ``add_`` per parameter). O0 (the FP32 reference) and O3 (half parameters)
keep torch's step.

What it covers: ``torch.optim.SGD`` (momentum, dampening, nesterov,
weight_decay, maximize) and ``Adam``/``AdamW`` (amsgrad, weight_decay,
maximize), exactly those classes, with float hyperparameters, on dense,
contiguous FP32 CPU tensors; the first step makes the optimizer state as the
optimizer's own would (once the step is taken: a skipped first step makes
none). Everything else takes the plain step (or, under ``fused_update=True``,
the compiled one where that applies): other optimizers and subclasses,
``foreach``/``fused``/``capturable``/``differentiable`` set, a tensor
learning rate, sparse or complex gradients, CUDA or non-contiguous tensors,
tensor subclasses other than FSDP2's DTensor (whose local shard it steps: a
rank's shard is a plain tensor, and the step is elementwise, so stepping it is
stepping the DTensor; the optimizer state it makes is DTensors, as torch's
own step makes it), an optimizer whose ``step`` was replaced or that has step
hooks, a closure.
Without a C compiler at install the module is absent and every step is the
plain one.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch.optim.optimizer import _get_scalar_dtype, _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from ..base.counts import DeviceCount
from .fsdp import is_dtensor, local

if TYPE_CHECKING:
    from .master import MasterWeights

log = logging.getLogger("amp_patch")
Tensor = torch.Tensor
f32 = torch.float32

try:
    from . import _onepass as native
    UNAVAILABLE = ""
except ImportError as exc:  # no compiler at install: the plain step
    native = None  # type: ignore[assignment]
    UNAVAILABLE = str(exc)
    log.debug("amp_patch: the one-pass O2 step is not built (%s); the plain step runs", exc)
if native is not None and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
    # torch's kernels without AVX2 (an x86-64 CPU without it, a VM that hides it,
    # ATEN_CPU_CAPABILITY=default) round a multiply and an add separately where the
    # one-pass step fuses them, as torch's AVX2/AVX-512 kernels do: its result would
    # not be bit for bit torch's step, so the plain step runs there
    native = None  # type: ignore[assignment]
    UNAVAILABLE = "torch runs its DEFAULT CPU kernels (no AVX2), whose updates the one-pass step does not match bit for bit"

#: the gradient / half-weight dtypes the kernel reads and writes, and their codes in _onepass.c
KINDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_FLAGS = ("foreach", "fused", "capturable", "differentiable")
SGD, ADAM, ADAMW = torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW


def refused(optimizer: torch.optim.Optimizer, step: Optional[Callable[..., Any]] = None) -> Optional[str]:
    """Why the kernel cannot take this optimizer's step now, or None when it can
    (as far as the optimizer goes; the tensors are checked by ``OnePassStep.plan``).

    ``step`` is the callable the plain step would call (the optimizer's own
    ``step``): one that is not the class's, or any step hook, is the user's
    code, and only the plain step runs it.
    """
    cls = type(optimizer)
    if cls is not SGD and cls is not ADAM and cls is not ADAMW:
        return f"{cls.__name__} is not torch.optim.SGD, Adam or AdamW"
    for group in optimizer.param_groups:
        for flag in _FLAGS:
            if group.get(flag):
                return f"{cls.__name__}({flag}=True)"
        if isinstance(group["lr"], Tensor) or isinstance(group.get("weight_decay"), Tensor):
            return "a tensor learning rate or weight decay"
        if cls is not SGD and any(isinstance(b, Tensor) for b in group["betas"]):
            return "tensor betas"
    if step is not None:
        own = getattr(step, "__func__", None) or getattr(step, "__wrapped__", None)  # the LR scheduler's wrapper
        if own is not cls.step:
            return "optimizer.step was replaced"
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks or _global_optimizer_post_hooks:
        return "an optimizer step hook"
    if any(not getattr(getattr(h, "__self__", None), "amp_patch_internal", False) for h in _global_optimizer_pre_hooks.values()):
        return "an optimizer step hook"
    return None


def _mkl_addresses() -> Tuple[int, int]:
    """The addresses of the routine ``torch.sqrt`` runs on FP32 CPU tensors where torch is
    built with MKL (its ``vsSqrt``, exported by torch's own library) and of MKL's
    ``MKL_Set_Num_Threads_Local`` (the kernel's threads call the first sequentially), 0 where absent."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                          mode=getattr(os, "RTLD_NOLOAD", 0))
        sqrt = ctypes.cast(lib.vsSqrt, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0, 0
    try:  # the C entry point (the lower-case name is MKL's Fortran one, which takes a pointer)
        local = ctypes.cast(lib.MKL_Set_Num_Threads_Local, ctypes.c_void_p).value or 0
    except AttributeError:
        local = 0
    return sqrt, local


def _gives_torch_sqrt() -> bool:
    """Whether the kernel's square root gives ``torch.sqrt``'s bits on values of every magnitude."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4093, generator=g) * torch.logspace(-40, 38, 4093)
    x = torch.cat([x, torch.tensor([0.0, float("inf"), 1e-45, 1.0, 2.0, 3.0])])
    r = torch.empty_like(x)
    native.sqrt(x.data_ptr(), r.data_ptr(), x.numel())
    return torch.equal(r.view(torch.int32), x.sqrt().view(torch.int32))


@functools.lru_cache(maxsize=None)
def sqrt_mode() -> str:
    """How Adam's denominator takes its square root, chosen once per process.

    ``"torch"``: with torch's own routine (an MKL build, whose ``torch.sqrt``
    is within 1 ulp but not always correctly rounded), so Adam is bit for bit
    the plain step; ``"ieee"``: the CPU's correctly rounded one, which is what
    this torch's ``sqrt`` gives, bit for bit too; ``"approximate"``: neither
    matches, and Adam's masters stay within a few ulps of the plain step's
    (tests/precision/test_onepass_step.py states the bound). "" when the kernel is not built.
    """
    if native is None:
        return ""
    addr, local = _mkl_addresses()
    if addr:
        native.set_sqrt(addr, local)
        if _gives_torch_sqrt():
            return "torch"
    native.set_sqrt(0)
    return "ieee" if _gives_torch_sqrt() else "approximate"


class Entry(NamedTuple):
    """One parameter's part of a step: its tensors and, where the optimizer state does
    not exist yet (the first step), None for the state, which ``run`` creates.
    For a DTensor parameter (FSDP2) the tensors are its local shard's and ``key``
    is the parameter itself, which keys its optimizer state."""

    p: Tensor
    g: Tensor
    h: Optional[Tensor]
    state: Optional[Tuple[Optional[Tensor], ...]]  # (a, b, c, step): see _onepass.c's Item
    key: Optional[Tensor] = None  # the optimizer's parameter where ``p`` is its local shard


class Item(NamedTuple):
    """One tensor's work as ``_onepass.c`` reads it (a tuple: the C side parses it by
    position, ``parse_items``; the names say what each position holds). Addresses are
    ints, 0 where absent; kinds are ``KINDS``' codes."""

    p: int  # the FP32 parameter (a step) or FP32 destination gradient (``absorb``)
    g: int  # the gradient read
    gk: int  # its kind
    a: int  # exp_avg, or SGD's momentum buffer
    b: int  # exp_avg_sq
    c: int  # max_exp_avg_sq (amsgrad)
    h: int  # the half weight the step writes (O2/O5)
    hk: int  # its kind
    n: int  # elements
    step: int  # Adam's FP32 step count
    init: int  # a step: 1 where SGD's first momentum buffer is written (the gradient itself); ``absorb``: the mode


#: where an item holds its element count
_N = Item._fields.index("n")


class Work(NamedTuple):
    """One param group's part of a step."""

    items: List[tuple]  # the kernel's items (``Item``'s positions) of the parameters whose optimizer state exists
    pending: List[Entry]  # those whose state the step makes (the first), and empty local shards: ``_items``
    touched: List[Tensor]  # what the kernel writes in place (parameters, half weights, DTensor keys)


class Plan(NamedTuple):
    """One step's work: a ``Work`` per param group."""

    groups: List[Work]


_STRIDED = torch.strided
_NO_STATE = (None, None, None, None)
#: the tensor types whose ``data_ptr`` is their own storage; a subclass (FSDP2's
#: DTensor, a quantized parameter) may hold its values elsewhere
_PLAIN = (Tensor, torch.nn.Parameter)


def dense(t: Tensor, n: int) -> bool:
    """A plain, dense, contiguous CPU tensor of ``n`` elements: memory the kernel can read
    and write by address. (Read for every tensor of every parameter at every step and
    every gradient of a backward, so written as one expression: ``is_cpu`` costs a
    sixth of building ``t.device``, and a helper call as much as two of the checks.)"""
    return type(t) in _PLAIN and t.is_cpu and t.layout is _STRIDED and t.is_contiguous() and t.numel() == n


#: elements of work for each thread the kernel starts beyond the calling one: it
#: starts threads per call, and a start costs about what updating 50-100 k
#: elements does, so a small step (a small model's, at any thread count) runs
#: on the calling thread alone
PER_THREAD = 1 << 18


def threads_for(elements: int) -> int:
    """The threads the kernel uses for ``elements`` of work: torch's intra-op count at most."""
    return max(1, min(torch.get_num_threads(), elements // PER_THREAD))


def _item(p: Tensor, g: Tensor, h: Optional[Tensor], a: Optional[Tensor], b: Optional[Tensor],
          c: Optional[Tensor], step: Optional[Tensor], init: int) -> tuple:
    """One parameter's item for a step, positional as the C reads it (``Item``'s fields;
    a plain tuple: built for every parameter at every step)."""
    return (p.data_ptr(), g.data_ptr(), KINDS[g.dtype], 0 if a is None else a.data_ptr(),
            0 if b is None else b.data_ptr(), 0 if c is None else c.data_ptr(),
            0 if h is None else h.data_ptr(), 0 if h is None else KINDS[h.dtype], p.numel(),
            0 if step is None else step.data_ptr(), init)


#: ``absorb``'s modes (``_onepass.c``'s ``ABS_*``): the FP32 destination takes the
#: gradient (``WRITE``), adds it (``ADD``), or adds it to zero as a zeroed buffer
#: would (``ZERO_ADD``: -0 becomes +0)
WRITE, ADD, ZERO_ADD = 0, 1, 2


#: the half gradients' dtypes
_HALF = (torch.bfloat16, torch.float16)


def absorbable(g: Tensor) -> bool:
    """A half gradient ``absorb`` takes: dense, contiguous, on the CPU, out of any graph
    (``dense``'s checks but the size, written out for the same reason)."""
    return type(g) in _PLAIN and g.dtype in _HALF and not g.requires_grad and g.is_cpu \
        and g.layout is _STRIDED and g.is_contiguous()


def absorb(moves: List[Tuple[Tensor, Tensor, int]], inv: Union[float, Tensor], found: int, back: bool = False) -> None:
    """Move each ``(dst, g, mode)``'s half gradient ``g`` into its FP32 ``dst`` in one
    pass: check it for inf/NaN (into the FP32 flag at address ``found``; 0: not
    checked), multiply it by ``inv`` (a float, or a 0-d FP32 CPU tensor the C reads:
    the loss scale kept on the device) and write or add it (``mode``). Every ``g`` is
    ``absorbable`` and every ``dst`` a contiguous CPU FP32 tensor of its size.

    ``back``: each ``g`` then holds its ``dst`` rounded to ``g``'s dtype, written in the
    same pass (the model's ``.grad`` as a view of the master's, without reading the FP32
    gradient again); where that is ``g`` already (written unscaled) nothing is written."""
    items = []
    total = 0
    for dst, g, mode in moves:
        at, kind, n = g.data_ptr(), KINDS[g.dtype], dst.numel()
        total += n
        # positional, as the C reads it: Item's fields, the state slots empty, the h slot
        # the write-back and the last one the mode (one per parameter per backward)
        items.append((dst.data_ptr(), at, kind, 0, 0, 0, at if back else 0, kind if back else 0, n, 0, mode))
    threads = threads_for(total)
    if isinstance(inv, Tensor):
        native.absorb(items, threads, 1.0, found, inv.data_ptr())
    else:
        native.absorb(items, threads, inv, found)
    if back:  # written in place by address (or left as it was): as an in-place op would, for autograd's checks
        torch.autograd.graph.increment_version([g for _, g, _ in moves])


class OnePassStep:
    """The one-pass step of one optimizer (see the module docstring).

    With ``masters`` (O2/O5) it updates the FP32 masters and writes the half
    model. Without (O1/O4, whose parameters are the model's own FP32 ones) it
    is the optimizer's update in one call instead of a few tensor operations
    per parameter: on a small model, those calls' overhead is most of the step.
    There it runs only where it is bit for bit the plain step (``exact``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Optional[MasterWeights] = None):
        self.opt = optimizer
        self.mw = masters  # master.MasterWeights, or None for an FP32 model's own parameters
        self.runs = 0  # steps the kernel was called for
        self._skipped = DeviceCount()  # of those, skipped on a device flag (read when asked)
        self.adam = type(optimizer) is not SGD
        # Adam's square root matches torch's bit for bit unless sqrt_mode() is
        # "approximate"; O2's masters accept the stated ulp bound there, an FP32
        # model's own weights (O1) take the plain step instead
        self.exact = not self.adam or sqrt_mode() != "approximate"
        #: the optimizer's step as the plain step would call it (set when amp_patch patches the optimizer)
        self.original: Optional[Callable[..., Any]] = None

    def plan(self, flagged: bool = False) -> Optional[Plan]:
        """The work of this step, or None when the plain step must run. Changes nothing
        (optimizer state the first step needs is made by ``run``, once the step is taken).

        The gradients are the masters' FP32 ones (unscaled) and the FP32
        parameters' own. ``flagged``: the step comes with a device skip flag, which
        the plain step would have to read on the host; without masters the kernel
        then takes every step it computes exactly, worth it or not.

        The kernel's items are built here, in the pass that checks the tensors: this
        runs for every parameter at every step, so each tensor is read once.
        """
        mw, opt = self.mw, self.opt
        wanted = mw is not None or (self.exact if flagged else self._worth_it())
        if native is None or not wanted or torch.compiler.is_compiling() \
                or refused(opt, self.original) is not None:
            return None
        # bound once: read per parameter (without masters the index is empty, the rest unread)
        index, masters, half_of, step_grad = ({}, (), (), None) if mw is None else \
            (mw.index, mw.masters, mw.halfs, mw.model_view.step_grad)
        groups = []
        work = False
        state_of = opt.state
        for group in opt.param_groups:
            items: List[tuple] = []
            pending: List[Entry] = []
            touched: List[Tensor] = []
            stateless = not self.adam and group["momentum"] == 0  # plain SGD keeps no state
            for p in group["params"]:
                i = index.get(id(p))
                if i is not None and masters[i] is p:
                    h = half_of[i]
                    g = step_grad(i)  # type: ignore[misc]
                else:
                    h, g = None, p.grad
                if g is None:
                    continue
                key = None
                if type(p) not in _PLAIN:
                    # FSDP2's sharded parameter: its local shard, with the gradient's
                    if h is not None or not is_dtensor(p) or not is_dtensor(g) or g.placements != p.placements:
                        return None
                    key, p, g = p, local(p), local(g)
                n = p.numel()
                if p.dtype is not f32 or g.dtype not in KINDS or not dense(p, n) or not dense(g, n):
                    return None
                if h is not None and (h.dtype not in KINDS or not dense(h, n)):
                    return None
                state = _NO_STATE if stateless else self._state(state_of.get(p if key is None else key), group, n)
                if state is False:
                    return None
                touched.append(p)
                if h is not None:
                    touched.append(h)
                if key is not None:
                    touched.append(key)
                if state is None or n == 0:
                    pending.append(Entry(p, g, h, state, key))
                    continue
                items.append(_item(p, g, h, *state, 0))
            work = work or bool(touched)
            groups.append(Work(items, pending, touched))
        if not work:
            return None  # no gradient at all: the plain step has nothing to do either
        return Plan(groups)

    def _worth_it(self) -> bool:
        """Without masters (O1/O4): whether the kernel is exact here and saves work.
        Plain SGD (no momentum, no weight decay) is already one pass per parameter
        in torch (``param.add_``), which the kernel only matches (measured:
        ``benchmarks/o1_step.py``); it saves passes where torch makes several."""
        if not self.exact:
            return False
        return self.adam or any(g["momentum"] != 0 or g["weight_decay"] != 0 for g in self.opt.param_groups)

    def _state(self, s: Optional[Dict[str, Any]], group: Dict[str, Any], n: int) -> Union[Tuple[Optional[Tensor], ...], bool, None]:
        """``(a, b, c, step)`` from a parameter's optimizer state ``s`` (Adam's, or SGD's with
        momentum: without, there is none); None where the step creates it (the first); False
        where the kernel cannot take it (the plain step raises or copes). Read for every
        parameter at every step, so written out: no helper calls, no generators."""
        if not self.adam:
            a = s.get("momentum_buffer") if s else None
            if a is None:
                return None
            if type(a) not in _PLAIN:
                a = local(a)
            return (a, None, None, None) if a.dtype is f32 and dense(a, n) else False
        if not s:
            return None if _get_scalar_dtype() == f32 else False
        a, b, step = s.get("exp_avg"), s.get("exp_avg_sq"), s.get("step")
        c = s.get("max_exp_avg_sq") if group["amsgrad"] else None
        if a is None or b is None or step is None or (c is None and group["amsgrad"]):
            return False
        if not isinstance(step, Tensor) or step.dtype is not f32 or not dense(step, 1):
            return False
        # FSDP2: the DTensors' local shards
        if type(a) not in _PLAIN:
            a = local(a)
        if type(b) not in _PLAIN:
            b = local(b)
        if c is not None and type(c) not in _PLAIN:
            c = local(c)
        if a.dtype is not f32 or b.dtype is not f32 or not dense(a, n) or not dense(b, n):
            return False
        if c is not None and (c.dtype is not f32 or not dense(c, n)):
            return False
        return (a, b, c, step)

    def _items(self, group: Dict[str, Any], entries: List[Entry], skip: Optional[Tensor] = None) -> List[tuple]:
        """The kernel's items for ``entries`` (``Work.pending``), making the state a first step creates as
        the optimizer's own first step makes it (same tensors, same keys, same order).
        With a ``skip`` flag the state is made whether or not the step is taken, as
        torch's ``fused`` optimizers make it under ``GradScaler``: Adam's at step 0,
        SGD's momentum buffer zeroed (a skipped first step leaves it so, and the next
        step's ``momentum * 0 + g`` is torch's first buffer ``g``)."""
        state = self.opt.state
        items = []
        for e in entries:
            p, g, h, st, key = e
            owner = p if key is None else key  # the state's key, and what its tensors are made like
            init = 0
            if st is None:
                if self.adam:
                    s = state[owner]
                    s["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
                    s["exp_avg"] = torch.zeros_like(owner, memory_format=torch.preserve_format)
                    s["exp_avg_sq"] = torch.zeros_like(owner, memory_format=torch.preserve_format)
                    if group["amsgrad"]:
                        s["max_exp_avg_sq"] = torch.zeros_like(owner, memory_format=torch.preserve_format)
                    st = (local(s["exp_avg"]), local(s["exp_avg_sq"]),
                          local(s["max_exp_avg_sq"]) if group["amsgrad"] else None, s["step"])
                else:  # SGD's first momentum buffer is the gradient itself: the kernel writes it
                    make = torch.empty_like if skip is None else torch.zeros_like
                    buf = make(owner, memory_format=torch.preserve_format)
                    state[owner]["momentum_buffer"] = buf
                    st, init = (local(buf), None, None, None), 1
            a, b, c, step = st
            if p.numel() == 0:
                # an empty local shard (a parameter with fewer rows than ranks): nothing to
                # update, but Adam's step count advances as torch's step advances it
                if step is not None:
                    step += 1
                    if skip is not None:
                        step -= skip  # a device op: the count stays where a skipped step leaves it
                continue
            items.append(_item(p, g, h, a, b, c, step, init))
        return items

    def takes_flag(self, plan: Plan) -> bool:
        """Whether ``run(plan, skip=flag)`` computes what a step decided on the host
        computes: not where it would make SGD's first momentum buffer with dampening
        (torch's first buffer is the undamped gradient, which a zeroed one cannot give)."""
        if self.adam:
            return True
        return not any(e.state is None and g["dampening"] != 0
                       for g, work in zip(self.opt.param_groups, plan.groups) for e in work.pending)

    @torch.no_grad()
    def run(self, plan: Plan, skip: Optional[Tensor] = None) -> bool:
        """Update every param group of ``plan`` from its true gradients (the kernel's
        inverse scale is 1); write the half weights. Returns True (it cannot fail).

        ``skip``: a 0-d FP32 CPU flag (sync-free steps): when it is not 0 the kernel
        changes nothing (``takes_flag`` says where the first step allows it).
        Leaves the masters' gradients to the optimizer's ``zero_grad``, as the plain step does.
        """
        opt = self.opt
        inv = 1.0
        at = 0 if skip is None else skip.data_ptr()
        for group, (items, pending, touched) in zip(opt.param_groups, plan.groups):
            if not touched:
                continue
            if pending:
                items = items + self._items(group, pending, skip)
            threads = threads_for(sum(it[_N] for it in items))
            if not items:
                pass
            elif self.adam:
                b1, b2 = group["betas"]
                decoupled = bool(group.get("decoupled_weight_decay", type(opt) is ADAMW))
                native.adam(items, threads, inv, group["maximize"], group["weight_decay"], decoupled, group["lr"],
                            b1, b2, group["eps"], group["amsgrad"], at)
            else:
                native.sgd(items, threads, inv, group["maximize"], group["weight_decay"], group["momentum"],
                           group["dampening"], group["nesterov"], group["lr"], at)
            # the weights changed in place behind autograd's back (the half model's, and
            # FP32 parameters that are the model's own): a graph that saved them must say so
            torch.autograd.graph.increment_version(touched)
        self.runs += 1
        if skip is not None:
            self._skipped.add(skip)
        return True

    @property
    def steps(self) -> int:
        """Steps the kernel took (a count of skips kept on the device is read: a sync when asked)."""
        return self.runs - self._skipped.value

    def step(self) -> bool:
        """The plain step's work on the FP32 gradients (the masters' at O2/O5, already
        unscaled; the parameters' own at O1/O4): the optimizer's update and, with
        masters, the copy into the half model, in one pass.

        Returns False, with nothing done, when the plain step must run instead.
        """
        plan = self.plan()
        if plan is None:
            return False
        return self.run(plan)
