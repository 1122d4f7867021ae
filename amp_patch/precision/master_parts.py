"""What ``MasterWeights`` keeps besides its lists and the per-step collection of
gradients, one class per concern, each owned by one ``MasterWeights`` and reading
its index-aligned lists (``halfs``, ``masters``, ``grads``) through it: those lists
are replaced whole (``restore``, ``zero_model_grads``), so a copy would go stale.

- ``EarlyMoves``: half gradients moved into the masters as autograd finishes them;
- ``ModelGrads``: the model's ``.grad`` as a view of the masters' gradients
  (``model_grads=True``), and the script's edits to it;
- ``WeightWrites``: writes through the half weights or the masters between steps.

Each runs once per backward or step (a hook per parameter for ``EarlyMoves``),
as the code in ``MasterWeights`` did.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Set, Tuple, Union

import torch

from . import onepass, writes

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .master import MasterWeights

Tensor = torch.Tensor
f32 = torch.float32


class EarlyMoves:
    """Moves each half gradient into its master's FP32 gradient as autograd finishes
    it, while a backward is armed (``arm``), so the half and FP32 gradients of the
    whole model are never alive together. Owns the post-accumulate-grad hooks that do
    it, the scale and check of the armed backward, and which masters got a gradient
    this way (``absorbed``): ``MasterWeights.collect_grads`` takes what they left at
    the backward's end and clears it."""

    __slots__ = ("mw", "armed", "absorbed", "hooks")

    def __init__(self, mw: "MasterWeights"):
        self.mw = mw
        #: (inverse scale, address of the FP32 inf/NaN flag or 0) while a backward moves each half
        #: gradient into its master as autograd finishes it (``arm``); None otherwise
        self.armed: Optional[Tuple[Union[float, Tensor], int]] = None
        #: the masters the armed backward has given a gradient so far (``collect_grads`` takes them)
        self.absorbed: Set[int] = set()
        #: one post-accumulate-grad hook handle per half parameter (None: it needs no gradient)
        self.hooks: List[Optional["RemovableHandle"]] = []

    def can_arm(self) -> bool:
        """Whether a backward can move each half gradient into its master as it arrives:
        the one-pass C routine is built and the masters are on the CPU (a single process;
        the caller checks that)."""
        mw = self.mw
        return (not mw.model_view.on and onepass.native is not None and bool(mw.masters)
                and mw.masters[0].device.type == "cpu")

    def arm(self, inv: Union[float, Tensor], found: int) -> None:
        """From now until ``disarm``, each half gradient autograd finishes is moved into
        its master's FP32 gradient at once, multiplied by ``inv`` and checked for inf/NaN
        into the FP32 flag at address ``found`` (0: not checked), and the half gradient is
        dropped: the half and FP32 gradients of the whole model are never alive together.
        Only gradients whose FP32 memory exists already move early (a buffer kept through
        ``zero_grad``, a gradient to add to); the others wait for the backward's end.
        ``collect_grads`` at the backward's end takes what the hooks left (a gradient they
        cannot take) and does the bookkeeping."""
        hooks = self.hooks
        for h in self.mw.halfs[len(hooks):]:
            hooks.append(h.register_post_accumulate_grad_hook(self._hook(len(hooks))) if h.requires_grad else None)
        self.absorbed.clear()
        self.armed = (inv, found)

    def disarm(self) -> None:
        self.armed = None

    def remove(self) -> None:
        """Take the hooks off the half parameters (``MasterWeights.restore``)."""
        for hook in self.hooks:
            if hook is not None:
                hook.remove()
        self.hooks, self.armed = [], None
        self.absorbed.clear()

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        def absorb(half: Tensor) -> None:
            if self.armed is not None:
                self._absorb(i, half)

        return absorb

    def _absorb(self, i: int, half: Tensor) -> None:
        g = half.grad
        # what the C routine takes, of the half's dtype, and no other hook of this
        # parameter still wants to see it
        if g is None or g.dtype is not half.dtype or not onepass.absorbable(g) or len(half._post_accumulate_grad_hooks) != 1:
            return
        mw = self.mw
        m = mw.masters[i]
        # Only into memory that exists already: a buffer allocated here would be taken
        # while the backward's activations are still alive, raising the peak by more than
        # the half gradient frees. Buffers zero_grad released are made at the backward's end.
        if i in self.absorbed or mw.sum.partial:
            dst, mode = m.grad, onepass.ADD
            if dst is None:
                dst, mode = mw.grads[i], onepass.ZERO_ADD  # as adding into a zeroed buffer
        else:
            dst, mode = mw.grads[i], onepass.WRITE
        if dst is None or dst.dtype is not f32 or not onepass.dense(dst, m.numel()):
            return  # no buffer yet, or a gradient user code put there: collect_grads takes it
        onepass.absorb([(dst, g, mode)], *self.armed)  # type: ignore[misc]
        if mode != onepass.ADD:
            m.grad = dst
        half.grad = None
        self.absorbed.add(i)


class ModelGrads:
    """The model's view of the masters' gradients. With ``on`` (``model_grads=True``),
    after each backward the model's ``.grad`` reads each master's true gradient in the
    half dtype (``mirror``), and edits a script makes there reach the step (``take``);
    off, half gradients move into the masters and the model's ``.grad`` stays None.
    Owns ``mirrors``, which ``MasterWeights`` also reads to tell a mirrored gradient
    from one a backward just left; a record also says where a master's gradient is
    its half one cast up, so the step reads the half one (``step_grad``). Whatever
    drops or rewrites a record drops that with it."""

    __slots__ = ("mw", "on", "mirrors")

    def __init__(self, mw: "MasterWeights", on: bool):
        self.mw = mw
        self.on = on
        #: per parameter, None or (the half gradient ``mirror`` wrote, its version after the
        #: write, and the master gradient's version where that gradient is exactly the half
        #: one cast up (``mirror(exact=True)``), else None)
        self.mirrors: List[Optional[Tuple[Tensor, int, Optional[int]]]] = []

    @torch.no_grad()
    def mirror(self, viewed: Sequence[int] = (), exact: bool = False) -> None:
        """Make each half parameter's ``.grad`` read its master's true gradient, rounded
        to the half dtype (in place where autograd left a half gradient, so DDP's bucket
        views and references a script holds stay valid), and note each one's version,
        so ``take`` can tell which a script edited. ``viewed``: the parameters whose
        ``.grad`` holds that already (written by the pass that filled the master's);
        ``exact``: and their masters' gradients are those half ones cast up, unscaled."""
        halfs, mirrors, grads = self.mw.halfs, self.mirrors, self.mw.grads
        done = set(viewed)
        dst: List[Tensor] = []
        src: List[Tensor] = []
        copied: List[int] = []
        for i, (h, m) in enumerate(zip(halfs, self.mw.masters)):
            g = h.grad
            if i in done:  # written by the pass that filled the master: only noted
                mirrors[i] = (g, g._version, grads[i]._version if exact else None)  # type: ignore[union-attr]
                continue
            mg = m.grad
            if mg is None:
                if g is not None and mirrors[i] is not None:
                    h.grad = g = None  # the master's gradient went (a skipped step, zero_grad)
                mirrors[i] = None if g is None else (g, g._version, None)
                continue
            if mg.is_sparse:
                h.grad = mg.to(h.dtype)
                mirrors[i] = (h.grad, h.grad._version, None)
                continue
            if g is None or g.is_sparse or g.dtype is not h.dtype or g.shape != h.shape:
                g = h.grad = torch.empty_like(h, memory_format=torch.preserve_format)
            dst.append(g)
            src.append(mg)
            copied.append(i)
        if dst:
            torch._foreach_copy_(dst, src)
        for i, g in zip(copied, dst):
            mirrors[i] = (g, g._version, None)

    def step_grad(self, i: int) -> Optional[Tensor]:
        """The gradient a step of master ``i`` reads: the model's half gradient where the
        master's is exactly that one cast up and neither changed since (a BF16 backward,
        no edit, no clipping, nothing added: their identities and version counters say),
        so the step reads half the bytes and computes the same bits; the master's otherwise."""
        mw, rec = self.mw, self.mirrors[i]
        g = mw.masters[i].grad
        if rec is None or rec[2] is None or g is None or g is not mw.grads[i] or g._version != rec[2]:
            return g
        half = mw.halfs[i].grad
        if half is not rec[0] or half._version != rec[1]:
            return g
        return half

    @torch.no_grad()
    def take(self) -> None:
        """The edits a script made to the model's ``.grad`` since ``mirror`` (an in-place
        ``clamp_``/``mul_``/``zero_``, an assignment, ``module.zero_grad()``) reach the
        masters: an edited gradient replaces its master's (made FP32), a cleared one
        clears it. Version counters tell which changed."""
        mw, mirrors = self.mw, self.mirrors
        for i, h in enumerate(mw.halfs):
            rec = mirrors[i]
            if rec is None:
                continue
            g = h.grad
            if g is rec[0] and g._version == rec[1]:
                continue
            m = mw.masters[i]
            if g is None:
                m.grad = None
                mirrors[i] = None
                continue
            if g.is_sparse:
                m.grad = g.float()
            else:
                m.grad = mw.buffer(i).copy_(g)
            mirrors[i] = (g, g._version, None)

    def drop(self) -> None:
        """Before a backward amp_patch runs: the model's mirrored gradients go (the masters
        hold them, edits taken first), so the backward's own arrive alone, to be added to
        the masters' FP32 sum, not to a rounded copy of it."""
        if not self.on:
            return
        self.take()
        halfs, mirrors = self.mw.halfs, self.mirrors
        for i, rec in enumerate(mirrors):
            if rec is not None:
                halfs[i].grad = None
                mirrors[i] = None

    @torch.no_grad()
    def rescale(self, scale: Union[float, Tensor]) -> None:
        """Under DDP, before a backward: the model's mirrored gradients become the
        scaled running sum again (the masters' sum times ``scale``, exact: the master
        is that half sum unscaled by a power of two), in place, where DDP's next
        all-reduce adds to it; edits the script made are taken first."""
        if not self.on:
            return
        self.take()
        mw, mirrors = self.mw, self.mirrors
        dst, src = [], []
        for i, rec in enumerate(mirrors):
            if rec is None:
                continue
            mirrors[i] = None
            g, mg = mw.halfs[i].grad, mw.masters[i].grad
            if mg is None or g is None or g.is_sparse:
                continue
            dst.append(g)
            src.append(mg)
        if dst:
            # a tensor scale (sync-free steps) is never compared on the host
            torch._foreach_copy_(dst, torch._foreach_mul(src, scale) if isinstance(scale, Tensor) or scale != 1.0 else src)


class WeightWrites:
    """Writes a script makes between steps, through the half weights or the masters,
    reach the other side: a master written through a ``state_dict()`` view or
    ``master_params`` is copied into its half parameter before the next forward
    (``sync``), and a half weight written in place or through ``.data`` gives its
    master the elements that changed before the next step (``take``). Owns the version
    counters both sides had when the masters were last copied into the half model,
    and the ``.data`` accesses ``writes`` notes (``touched``), with ``watch`` set."""

    __slots__ = ("mw", "watch", "versions", "half_versions", "touched")

    def __init__(self, mw: "MasterWeights", watch: bool):
        self.mw = mw
        #: writes through the half parameters' ``.data`` are noted (``writes``): a session's
        #: masters, whose undo (``MasterWeights.restore``) takes the property off again
        self.watch = watch
        #: each master's version counter when it was last copied into the half model: a write
        #: through a ``state_dict()`` view or ``master_params`` reaches the model (``sync``)
        self.versions: List[int] = []
        #: each half parameter's version counter when the masters were last copied into it
        self.half_versions: List[int] = []
        #: ids of half parameters whose ``.data`` was read or replaced since the last look (``writes``)
        self.touched: Set[int] = set()

    def add(self, half: Tensor, master: Tensor) -> None:
        """Start following a new pair (``MasterWeights.adopt``)."""
        self.half_versions.append(half._version)
        self.versions.append(master._version)
        if self.watch:
            writes.watch(self, half)
            writes.watch(self, master)

    def release(self) -> None:
        """Stop following every pair (``MasterWeights.restore``, before it drops its lists)."""
        if self.watch:
            for h, m in zip(self.mw.halfs, self.mw.masters):
                writes.unwatch(h)
                writes.unwatch(m)
        self.versions, self.half_versions = [], []
        self.touched.clear()

    @torch.no_grad()
    def sync(self) -> None:
        """Copy every master written since the last look (a ``state_dict()`` view's
        ``copy_``, an edit through ``master_params``, its ``.data``) into its half
        parameter: run before each forward of a converted model."""
        versions, touched, halfs = self.versions, self.touched, self.mw.halfs
        for i, m in enumerate(self.mw.masters):
            v = m._version
            if v != versions[i] or (touched and id(m) in touched):
                h = halfs[i]
                h.copy_(m)
                versions[i] = v
                self.half_versions[i] = h._version
                touched.discard(id(m))

    def note(self) -> None:
        """The half model now holds the masters' values: what changes either from here is the script's."""
        self.half_versions = [h._version for h in self.mw.halfs]
        self.versions = [m._version for m in self.mw.masters]
        self.touched.clear()

    @torch.no_grad()
    def take(self) -> None:
        """Writes the script made to the half model since the masters were last copied
        into it (``.data`` writes, ``no_grad`` edits, see ``writes``) reach the masters:
        each element that differs from its master rounded to half takes the half value."""
        touched, versions, halfs = self.touched, self.half_versions, self.mw.halfs
        if not touched and all(h._version == v for h, v in zip(halfs, versions)):
            return
        for i, h in enumerate(halfs):
            if id(h) not in touched and h._version == versions[i]:
                continue
            m = self.mw.masters[i]
            if h.shape != m.shape:  # the script replaced the whole tensor
                m.data = h.detach().float()
                continue
            wrote = h.ne(m.to(h.dtype))
            if wrote.any():
                m.copy_(torch.where(wrote, h.float(), m))
        self.note()
