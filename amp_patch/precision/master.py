"""FP32 master weights for the optimizer of a half-precision model (O2/O5).

The model keeps its ``nn.Parameter`` objects, now holding half data; the
optimizer's ``param_groups`` hold FP32 *masters* in their place, and the
optimizer state moves with them. A master is built on the parameter's original
FP32 storage, so creating it copies nothing and loses nothing to rounding.

Gradients flow half model -> FP32 masters at the end of every scaled backward:
``collect_grads`` copies the model's half gradients into one persistent FP32
buffer per master (reused every step, so no allocation on the hot path), where
the loss scaler unscales and checks them in place, and drops the half
gradients so the next backward starts fresh (autograd then adopts its own
result instead of adding into an old buffer); a later backward's are added to
the masters' sum, so accumulation happens in FP32. Under ``torch.distributed``
the half gradients stay in the model, scaled, as the running sum DDP's
all-reduce reads, and the masters get an unscaled copy of it after every
backward (``keep_half``). A step consumes the
sum, so the next backward starts a new one
(``model.zero_grad()``, which cannot reach the masters, is enough between
steps). After the optimizer steps the masters, ``refresh`` copies
them into the half model. Both run as one multi-tensor (``torch._foreach_*``)
call, never as a Python loop of tensor ops per parameter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..patching.cast import LOW
from . import onepass
from .master_parts import EarlyMoves, ModelGrads, WeightWrites

if TYPE_CHECKING:
    from .conversions import Conversions

Tensor = torch.Tensor
f32 = torch.float32
#: a CPU master-gradient buffer this large outlives zero_grad(set_to_none=True) (see zero_model_grads)
KEEP_ON_CPU = 8 << 20
#: and so does every one of an optimizer whose CPU buffers come to at most this in all
KEEP_ALL_ON_CPU = 4 << 20


def _state_to(state: Dict[str, Any], dtype: torch.dtype) -> Dict[str, Any]:
    """Optimizer state of one parameter with its floating tensors in ``dtype``.

    ``step`` stays as it is, as ``Optimizer.load_state_dict`` leaves it.
    """
    out = {}
    for k, v in state.items():
        if k != "step" and isinstance(v, Tensor) and v.is_floating_point() and v.dtype != dtype:
            v = v.to(dtype)
        out[k] = v
    return out


class GradSum:
    """Where this step's gradient sum is, for the masters of one optimizer: the
    one state machine their gradients go through between two steps.

    Three facts, moved only by the three events below (nothing else writes them):

    - ``partial``: the masters' FP32 gradients hold part of this step's sum, so
      the next backward adds to them (gradient accumulation in FP32);
    - ``in_model``: under ``torch.distributed`` the model's half gradients hold
      the running (scaled) sum DDP's all-reduce reads, and each backward copies it
      whole into the masters, so nothing is added there;
    - ``zeroed``: the last ``zero_grad`` kept zeroed gradients (``set_to_none=False``):
      a master its next backward does not reach steps on zeros, as an FP32
      parameter would, instead of being skipped.

    ============================  ===========  ==========  ==================
    event                         partial      in_model    zeroed
    ============================  ===========  ==========  ==================
    start                         False        False       False
    ``backward()``                True         (kept)      (kept)
    ``backward(keep_half=True)``  False        True        (kept)
    ``zero_grad(set_to_none)``    False        (kept)      not set_to_none
    ``step()`` (taken or skipped) False        False       False
    ============================  ===========  ==========  ==================

    ``step`` answers whether the model still held the half sum, which the step then
    drops. Under one process ``backward`` always has the same ``keep_half``.
    """

    __slots__ = ("partial", "in_model", "zeroed")

    def __init__(self) -> None:
        self.partial = self.in_model = self.zeroed = False

    def backward(self, keep_half: bool) -> None:
        """A backward's gradients reached the masters (``collect_grads``)."""
        if keep_half:
            self.partial, self.in_model = False, True  # the masters copy the model's whole sum each time
        else:
            self.partial = True

    def zero_grad(self, set_to_none: bool) -> None:
        """The optimizer's ``zero_grad``: a new sum starts."""
        self.partial = False
        self.zeroed = not set_to_none

    def step(self) -> bool:
        """A step used up the sum: the next backward starts a new one even if only
        ``model.zero_grad()`` (which cannot reach the masters) ran, and an earlier
        ``zero_grad`` no longer counts. True when the model held the half sum."""
        held = self.in_model
        self.partial = self.in_model = self.zeroed = False
        return held


class MasterWeights:
    """The FP32 masters of one optimizer and the half parameters they back.

    Lists are index-aligned: ``halfs[i]`` is the model's parameter,
    ``masters[i]`` its FP32 master in the optimizer, ``grads[i]`` the master's
    persistent gradient buffer (allocated on first use).

    Three collaborators keep what goes on around those lists between steps, each
    reading them through this object: ``early_moves`` (half gradients moved into the
    masters while a backward runs), ``model_view`` (the model's ``.grad`` as a view of
    the masters' gradients) and ``weight_writes`` (writes through the half weights or
    the masters between steps).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model_grads: bool = False, watch_writes: bool = False):
        self.optimizer = optimizer
        self.halfs: List[Tensor] = []
        self.masters: List[Tensor] = []
        self.grads: List[Optional[Tensor]] = []
        self.dtypes: List[torch.dtype] = []  # each half parameter's dtype before initialize
        self.index: Dict[int, int] = {}  # id(half or master) -> i
        #: where this step's gradient sum is (the masters', the model's, zeroed buffers)
        self.sum = GradSum()
        #: moves each half gradient into its master as autograd finishes it (``arm``)
        self.early_moves = EarlyMoves(self)
        #: with ``model_grads``, after each backward the model's ``.grad`` reads each master's
        #: true gradient, in the half dtype, and edits made there reach the step; without it
        #: half gradients move into the masters and the model's ``.grad`` stays None
        self.model_view = ModelGrads(self, model_grads)
        #: with ``watch_writes``, writes through the half parameters' ``.data`` are noted
        #: (``writes``): a session's masters, whose undo (``restore``) takes the property off again
        self.weight_writes = WeightWrites(self, watch_writes)

    def __len__(self) -> int:
        return len(self.halfs)

    # ------------------------------------------------------------ building

    def adopt(self, group: Dict[str, Any], originals: Dict[int, Tuple[Tensor, Optional[Tensor], torch.dtype]],
              dtypes: Optional[Dict[int, torch.dtype]] = None) -> None:
        """Put masters in place of the half parameters of one param group (``dtypes``:
        the dtype before ``initialize`` of a parameter ``originals`` lacks, by id)."""
        opt = self.optimizer
        mirrors, ww = self.model_view.mirrors, self.weight_writes
        params = group["params"]
        for j, p in enumerate(params):
            if p.dtype not in LOW:
                continue  # an FP32 parameter (kept batchnorm, keep_fp32) is its own master
            orig = originals.get(id(p))
            if orig is not None:  # converted just now: build on the values from before the cast
                data, grad, dtype = orig
                data = data if data.dtype == f32 else data.float()
            else:  # half before initialize, or added after it: upcast (exact)
                data, grad, dtype = p.detach().float(), None, (dtypes or {}).get(id(p), p.dtype)
            master = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            if grad is not None:
                master.grad = grad if grad.dtype == f32 else grad.float()
            if p in opt.state:
                opt.state[master] = _state_to(opt.state.pop(p), f32)
            params[j] = master
            i = len(self.halfs)
            self.halfs.append(p)
            self.masters.append(master)
            self.grads.append(master.grad)
            self.dtypes.append(dtype)
            mirrors.append(None)
            ww.add(p, master)
            self.index[id(p)] = i
            self.index[id(master)] = i

    def master_of(self, param: Tensor) -> Optional[Tensor]:
        i = self.index.get(id(param))
        if i is not None and self.halfs[i] is param:
            return self.masters[i]
        return None

    def is_master(self, param: Tensor) -> bool:
        i = self.index.get(id(param))
        return i is not None and self.masters[i] is param

    # ------------------------------------------------------------ per step

    def collect_grads(self, unscale: Optional[Callable[[List[Tensor]], None]], keep_half: bool = False) -> None:
        """Move the half gradients into the masters' FP32 gradients.

        ``unscale(tensors)`` unscales and checks FP32 tensors in place (the
        loss scaler's fused op); ``None`` when the loss is not scaled.
        ``keep_half`` (under DDP): the half gradients stay in the model as the
        running sum DDP's all-reduce reads, and the masters get an unscaled
        copy of the whole sum; the step drops them (``consumed``).
        """
        halfs, masters, view = self.halfs, self.masters, self.model_view
        absorbed = self.early_moves.absorbed  # the masters an armed backward's hooks gave their gradient already
        view.take()
        mirrors = view.mirrors
        # a gradient mirror() wrote is the master's already (take() took any edit)
        idx = [i for i, h in enumerate(halfs) if h.grad is not None and (mirrors[i] is None or mirrors[i][0] is not h.grad)]
        if not idx and not absorbed:
            return
        if keep_half:
            self.sum.backward(keep_half=True)
        sparse = {i for i in idx if halfs[i].grad.is_sparse}
        if sparse:
            idx = [i for i in idx if i not in sparse]
        viewed: List[int] = []  # the half gradients that hold their master's, rounded, already
        if not self.sum.partial:
            fresh = [i for i in idx if i not in absorbed] if absorbed else idx
            if fresh:
                bufs = [self.buffer(i) for i in fresh]
                done = self._absorb_all(fresh, bufs, unscale, view.on)
                if done is not None:
                    viewed = fresh if done else []
                else:
                    torch._foreach_copy_(bufs, [halfs[i].grad for i in fresh])
                    if unscale is not None:
                        unscale(bufs)
            has = set(idx) | absorbed | sparse
            for i, m in enumerate(masters):
                if i in has:
                    if i not in absorbed and i not in sparse:
                        m.grad = self.grads[i]
                elif mirrors[i] is not None:
                    pass  # the master holds what the model's .grad shows
                elif not self.sum.zeroed:
                    # a master whose half got no gradient this step must not step on
                    # the last step's (model.zero_grad() cannot reach the masters)
                    m.grad = None
            added = [i for i in idx if i in absorbed] if absorbed else []
        else:
            added = idx
        if added:
            incoming = [halfs[i].grad for i in added]
            if unscale is not None:
                incoming = [g.float() for g in incoming]
                unscale(incoming)
            for i in added:
                if masters[i].grad is None:
                    masters[i].grad = self.buffer(i).zero_()
            torch._foreach_add_([masters[i].grad for i in added], incoming)
        absorbed.clear()
        if sparse:
            self._collect_sparse(sorted(sparse), unscale)
        if keep_half:
            if view.on:
                # the scaled sum comes back before the next backward (ModelGrads.rescale)
                view.mirror(viewed, exact=unscale is None)
            return
        self.sum.backward(keep_half=False)
        if view.on:
            view.mirror(viewed, exact=unscale is None)
            return
        for i in idx:
            halfs[i].grad = None
        for i in sparse:
            halfs[i].grad = None

    def _absorb_all(self, idx: List[int], bufs: List[Tensor], unscale: Optional[Callable[[List[Tensor]], None]],
                    back: bool = False) -> Optional[bool]:
        """Copy (and unscale and check) the half gradients of ``idx`` into ``bufs`` in one
        C pass, instead of a copy and then an unscale; with ``back``, and where every
        half gradient has its parameter's dtype and shape, write each sum, rounded, back
        into it (the model's view of it). Returns whether it wrote them back; None, with
        nothing done, where the C routine cannot take them all (not built, CUDA, an odd
        layout)."""
        if onepass.native is None:
            return None
        if unscale is None:
            inv, found = 1.0, 0
        else:
            cpu_args = getattr(unscale, "cpu_args", None)
            if cpu_args is None:
                return None
            inv, found = cpu_args()
        moves = []
        halfs, dense, absorbable, write = self.halfs, onepass.dense, onepass.absorbable, onepass.WRITE
        for i, b in zip(idx, bufs):
            h = halfs[i]
            g = h.grad
            if not (absorbable(g) and dense(b, g.numel())):
                return None
            # (a .grad whose .data a script replaced may differ from its parameter)
            back = back and g.dtype is h.dtype and g.shape == h.shape
            moves.append((b, g, write))
        onepass.absorb(moves, inv, found, back)
        return back

    def absorb_true_grads(self) -> None:
        """Half gradients a backward amp_patch did not scale left in the model
        (``torch.autograd.backward``, ``backward(gradient=...)``) join the
        masters' sum as they are."""
        view = self.model_view
        view.take()
        mirrors = view.mirrors
        if any(h.grad is not None and (mirrors[i] is None or mirrors[i][0] is not h.grad)
               for i, h in enumerate(self.halfs)):
            self.collect_grads(None)

    def _collect_sparse(self, idx: List[int], unscale: Optional[Callable[[List[Tensor]], None]]) -> None:
        """Sparse half gradients (``nn.Embedding(sparse=True)``) become sparse FP32
        master gradients: made FP32 before duplicates are summed, so the sum
        cannot overflow, then unscaled and checked like the dense ones."""
        for i in idx:
            g = self.halfs[i].grad.float().coalesce()
            if unscale is not None:
                unscale([g])
            m = self.masters[i]
            m.grad = g if not self.sum.partial or m.grad is None else (m.grad + g).coalesce()

    def buffer(self, i: int) -> Tensor:
        """Master ``i``'s persistent FP32 gradient buffer, allocated on first use."""
        buf = self.grads[i]
        if buf is None:
            buf = self.grads[i] = torch.empty_like(self.masters[i], memory_format=torch.preserve_format)
        return buf

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the half model after a step (one multi-tensor copy)."""
        if self.halfs:
            torch._foreach_copy_(self.halfs, self.masters)
            self.weight_writes.note()

    def consumed(self) -> None:
        """A step (taken or skipped) used up the masters' gradients (``GradSum.step``);
        the half sum DDP kept in the model goes with it."""
        self.early_moves.absorbed.clear()
        if self.sum.step():
            for h in self.halfs:
                h.grad = None

    def zero_model_grads(self, set_to_none: bool) -> None:
        """Clear the half parameters' gradients (the optimizer clears the masters').

        With ``set_to_none=False`` a parameter that had a gradient keeps a zero
        one, as in FP32: its master gets a zero gradient too (if the half's was
        never moved there), so a step before the next backward, or one whose
        backward does not reach it, updates it as FP32 would (momentum,
        weight decay, Adam's moments).
        """
        mirrors, on = self.model_view.mirrors, self.model_view.on
        for i, h in enumerate(self.halfs):
            mirrors[i] = None
            if h.grad is not None:
                if set_to_none:
                    h.grad = None
                else:  # as Optimizer.zero_grad does it
                    g = h.grad
                    if g.grad_fn is not None:
                        g.detach_()
                    else:
                        g.requires_grad_(False)
                    g.zero_()
                    if self.masters[i].grad is None:
                        self.masters[i].grad = self.buffer(i).zero_()
                    if on:
                        mirrors[i] = (g, g._version, None)
        self.early_moves.absorbed.clear()
        self.sum.zero_grad(set_to_none)
        if set_to_none and self.masters:
            # The FP32 gradient buffers go with the gradients, so they are not held
            # through the next backward beside its activations (the peak); at the
            # backward's end the allocator hands the memory back: CUDA's caching
            # allocator for free, a CPU's heap for buffers below KEEP_ON_CPU. A
            # larger CPU buffer stays: the C allocator would map it fresh each
            # step and page-fault every byte of it in again. So do all of a small
            # model's (KEEP_ALL_ON_CPU): the memory is too little to matter, and
            # making each again would cost an allocation per parameter per step.
            if self.masters[0].is_cuda:
                self.grads = [None] * len(self.grads)
            else:
                sizes = [0 if b is None else b.numel() * b.element_size() for b in self.grads]
                small = sum(sizes) <= KEEP_ALL_ON_CPU
                self.grads = [b if b is not None and (small or size >= KEEP_ON_CPU) else None
                              for b, size in zip(self.grads, sizes)]

    def add_group(self, group: Dict[str, Any], dtypes: Optional[Dict[int, torch.dtype]] = None) -> Dict[str, Any]:
        """A param group for ``add_param_group`` with masters for its half parameters
        (``dtypes``: each model parameter's dtype before ``initialize`` converted it, by id,
        which ``restore`` gives back)."""
        entries = group["params"]
        entries = [entries] if isinstance(entries, Tensor) else list(entries)
        named = bool(entries) and isinstance(entries[0], tuple)  # [(name, param), ...]
        tensors = {"params": [e[1] for e in entries] if named else entries}
        for p in tensors["params"]:
            if self.master_of(p) is not None:
                raise ValueError(
                    "some parameters appear in more than one parameter group: a parameter of "
                    "add_param_group already has an FP32 master in this optimizer"
                )
        self.adopt(tensors, {}, dtypes)
        params = [(e[0], t) for e, t in zip(entries, tensors["params"])] if named else tensors["params"]
        return dict(group, params=params)

    # ------------------------------------------------------------ undo

    @torch.no_grad()
    def restore(self) -> None:
        """Give the model's parameters back to the optimizer, holding the masters' values."""
        opt = self.optimizer
        self.model_view.take()
        self.weight_writes.take()
        self.early_moves.remove()
        where = {id(p): (g, j) for g in opt.param_groups for j, p in enumerate(g["params"])}
        for h, m, dtype in zip(self.halfs, self.masters, self.dtypes):
            h.grad = None
            h.data = m.data if dtype == f32 else m.data.to(dtype)
            if m.grad is not None:
                h.grad = m.grad if dtype == f32 else m.grad.to(dtype)
            loc = where.get(id(m))
            if loc is not None:
                loc[0]["params"][loc[1]] = h
            if m in opt.state:
                opt.state[h] = _state_to(opt.state.pop(m), dtype)
        self.weight_writes.release()
        self.halfs, self.masters, self.grads, self.dtypes, self.model_view.mirrors, self.index = [], [], [], [], [], {}


def lookup(conv: Optional["Conversions"], param: Tensor) -> Optional[Tensor]:
    """The FP32 master of a model parameter in the running session's ``conv``, or None."""
    return None if conv is None else conv.master_of(param)


def params_of(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every parameter the optimizer steps, in ``param_groups`` order."""
    for group in optimizer.param_groups:
        yield from group["params"]
