"""FP32 outputs for every outermost module call on the zero-code routes.

A script run by the launcher (or ``amp_patch.auto``) was written for FP32, so
what its models return must look FP32 to the code around them
(``logits.detach().cpu().numpy()`` has no BF16). The models the launcher or
the script's ``initialize`` know get a ``CastOutputs`` hook; this covers the
rest: a model built after ``initialize`` (Hugging Face's ``from_pretrained``
for evaluation), a second network nobody paired, under O1's patched
functions. Only the outermost call is cast: a module called inside another
one returns what it computed, so the model's inner layers keep their half
activations. A module called inside a backward (activation checkpointing's
recompute) is never an outermost call.

A global forward pre-hook notes which module call is outermost in this
thread; a global forward hook (always called, so an exception cannot leave
the thread "inside") casts that call's floating half outputs to FP32 when it
ends. Both are global, so no module holds anything of amp_patch's: the
script's ``torch.save(model)`` pickles what it pickles without amp_patch, and
``torch.load`` (``weights_only=True``, torch's default) and a process without
amp_patch read it back. Global forward hooks run before a module's own, so
a hook the script put on its model sees the FP32 outputs too.

An outermost call is also where the running session's weight-cast cache is
emptied on these routes (``patching/cast.py``): the models of a zero-code run
are not known to amp_patch, and a write through ``.data`` between two forwards
(an EMA swap for evaluation, pruning) bumps no version counter the cache
could see. With ``--outputs half`` the guard runs for that alone (``cast=False``).
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..base import running
from ..patching.cast import cast

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from ..precision.model import CastInputs
    from ..run.session import Session

_in_backward = torch._C._current_graph_task_id  # -1 outside the autograd engine
_compiling = torch.compiler.is_compiling
_state = threading.local()  # .module: the outermost module being called; .depth: its own nesting
_active: Optional["OutermostOutputs"] = None


def _pre(module: torch.nn.Module, args: tuple) -> Optional[tuple]:
    guard = _active
    if guard is None or _compiling():
        # a compiled module's call: its eager wrapper's own call is the outermost one
        # (tracing the bookkeeping into the graph would store the module from inside it)
        return None
    outer = getattr(_state, "module", None)
    if outer is None:
        if isinstance(module, torch.jit.ScriptModule):
            return  # compiled code: it takes no hooks, calls no Python module, and runs uncast
        if _in_backward() != -1:
            # activation checkpointing recomputes a layer inside the backward, calling
            # its inner modules with no outer call around them: their outputs are the
            # layer's own, in the dtype the layer computes in (an O2 model's half)
            return
        _state.module, _state.depth = module, 1
        amp = running.session()
        if amp is not None:
            amp.cache.clear()  # half weight copies from before this call may be stale
            edge = guard.edge(module, amp)
            if edge is not None:
                cast = edge(module, args, {})
                if cast is not None:
                    return cast[0]
    elif outer is module:
        _state.depth += 1


def _end(module: torch.nn.Module, args: tuple, output: object) -> object:
    if _compiling() or getattr(_state, "module", None) is not module:
        return None
    _state.depth -= 1
    if _state.depth:
        return None
    _state.module = None
    if _active is None or not _active.cast or running.session() is None:
        return None
    return cast(output, torch.float32, None)  # the same object back when nothing is half


class OutermostOutputs:
    """Cast the floating half outputs of every outermost module call to FP32 while
    installed (``cast=False``: leave them as computed), and empty the running
    session's weight-cast cache when such a call starts.

    Example::

        guard = OutermostOutputs()
        guard.install()
        try:
            run_the_script()
        finally:
            guard.uninstall()
    """

    def __init__(self, cast: bool = True) -> None:
        self.cast = cast
        self.handles: List["RemovableHandle"] = []
        #: module -> the input cast of the converted model it is inside (None: none),
        #: for the conversion records ``_edges_of`` (the list itself, and its length)
        self._edges: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[CastInputs]]" = weakref.WeakKeyDictionary()
        self._edges_of: Tuple[Optional[list], int] = (None, 0)

    def edge(self, module: torch.nn.Module, amp: "Session") -> Optional["CastInputs"]:
        """The input cast for an outermost call of ``module``: that of the O2/O3/O5
        model it is a submodule of. PyTorch Lightning's ``training_step`` calls
        ``self.net(x)``, not the LightningModule the launcher converted, so without
        it an FP32 batch would meet half weights. Found once per module and
        conversion; a model's own call has its own hook."""
        records = amp.precision.records
        if records is not self._edges_of[0] or len(records) != self._edges_of[1]:
            self._edges.clear()
            self._edges_of = (records, len(records))
        try:
            return self._edges[module]
        except KeyError:
            pass
        found = next((rec.edge for rec in records if rec.edge is not None and rec.model is not module
                      and any(m is module for m in rec.model.modules())), None)
        self._edges[module] = found
        return found

    def install(self) -> None:
        global _active
        _active = self
        _state.module = None
        self.handles = [register_module_forward_pre_hook(_pre), register_module_forward_hook(_end, always_call=True)]

    def uninstall(self) -> None:
        global _active
        for h in self.handles:
            h.remove()
        self.handles = []
        self._edges.clear()
        self._edges_of = (None, 0)
        if _active is self:
            _active = None
        _state.module = None
