"""The op ledger: what the patched ops did, while ``collect_stats=True``.

With ``initialize(..., collect_stats=True)`` every casting wrapper calls
``Ledger.record`` after its op ran (``wrappers._instrumented``); with it off
the wrappers hold no ledger and pay nothing. Per op the ledger keeps the
calls, the dtypes the op ran in (read from its output), the casts inserted and
the bytes they copied, and the first call site in user code.

It also watches the calls no list covers, through the watching mode of
``amp_patch.diagnostics.modes``: an op that ran in FP32 on inputs that could have been cast to the
half dtype is an "unlisted op seen", a candidate for a YAML override. Only
calls made while autograd records are counted (the forward pass): the
optimizer step and the loss scaler work in FP32 under ``no_grad`` by design,
and listing them would bury the ops worth moving.

Calls amp_patch makes itself (the loss scaler's arithmetic) are not counted:
the ledger describes the user's model. Calls made from inside torch's
gradient and parameter utilities (``torch.nn.utils.clip_grad_norm_``,
``clip_grad_value_``, ``get_total_norm``, ``parameters_to_vector``: the
modules in ``modes.UTILITY_MODULES``) are not the model's either: they are
counted under the utility's name (``utilities``), apart from the ops, and
never as unlisted ops. Cost when on: a short walk up the
stack, a lock and a few dict updates per patched call, and every torch call
(patched or not) goes through one Python-level ``TorchFunctionMode``.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from . import modes

from ..base import running
from ..patching.cast import needs_cast
from ..oplists.schema import is_inplace
from ..patching.wrappers import switch

if TYPE_CHECKING:
    from .state import Diagnostics

f32 = torch.float32

#: unlisted ops that move or reshape data rather than compute: FP32 in, FP32
#: out is their nature, not a missed cast.
DATA_MOVEMENT = frozenset(
    """to type float double half bfloat16 clone contiguous detach cpu cuda
    zeros_like ones_like empty_like full_like rand_like randn_like new_zeros
    new_ones new_empty new_full new_tensor __getitem__ __setitem__ __deepcopy__
    __reduce_ex__ __format__ __repr__ numpy tolist item""".split()
)


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    return "-" if dtype is None else str(dtype).replace("torch.", "")


def _dtype_of(out: object) -> Optional[torch.dtype]:
    """The dtype an op ran in, read from its (first tensor) output."""
    if isinstance(out, torch.Tensor):
        return out.dtype
    if isinstance(out, (tuple, list)):
        for x in out:
            if isinstance(x, torch.Tensor):
                return x.dtype
    return None


class OpStats:
    """What one patched op did."""

    __slots__ = ("policy", "calls", "dtypes", "casts", "bytes_cast", "site", "kept", "why")

    def __init__(self, policy: str, site: str):
        self.policy = policy
        self.calls = 0
        self.dtypes: Dict[Optional[torch.dtype], int] = {}
        self.casts = 0
        self.bytes_cast = 0
        self.site = site
        self.kept = 0  # calls cast_policy="auto" kept in FP32
        self.why = ""  # the first such call's reason

    def to_dict(self) -> Dict[str, Any]:
        return {
            "policy": self.policy,
            "calls": self.calls,
            "dtypes": {dtype_name(k): v for k, v in self.dtypes.items()},
            "casts": self.casts,
            "bytes_cast": self.bytes_cast,
            "first_call_site": self.site,
            "kept_fp32": self.kept,
            "kept_why": self.why,
        }


class Ledger:
    """Per-op statistics of one AMP run (``initialize(..., collect_stats=True)``).

    Thread-safe. Read it through ``amp_patch.report()``; clear it with
    ``amp_patch.reset_stats()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ops: Dict[str, OpStats] = {}
        self.unlisted: Dict[str, List[Any]] = {}  # qualname -> [calls, first site]
        self.utilities: Dict[str, List[Any]] = {}  # utility -> [op calls, {qualname: calls}, first site]
        self._here = threading.local()
        self._names: Optional[modes.OpNames] = None
        #: the diagnostics of the session it watches for (``start``): its settings name the half dtype
        self._diag: Optional["Diagnostics"] = None

    # -- called by the wrappers
    def record(self, qualname: str, policy: str, out: object, ncasts: int, nbytes: int, kept: str = "") -> None:
        """Count one call of a patched op (called by the casting wrapper); ``kept``:
        why ``cast_policy="auto"`` ran this call of a half-list op in FP32."""
        if not getattr(self._here, "watching", False):
            self._watch_here()
        frame, utility = modes.caller_and_utility()
        if modes.is_internal(frame):
            return  # the loss scaler's own arithmetic is not the user's model
        if utility is not None:  # clip_grad_norm_'s own arithmetic is not the model's either
            with self._lock:
                u = self.utilities.get(utility)
                if u is None:
                    u = self.utilities[utility] = [0, {}, modes.site(frame)]
                u[0] += 1
                u[1][qualname] = u[1].get(qualname, 0) + 1
            return
        dtype = _dtype_of(out)
        with self._lock:
            s = self.ops.get(qualname)
            if s is None:
                s = self.ops[qualname] = OpStats(policy, modes.site(frame))
            s.calls += 1
            s.casts += ncasts
            s.bytes_cast += nbytes
            s.dtypes[dtype] = s.dtypes.get(dtype, 0) + 1
            if kept:
                s.kept += 1
                s.why = s.why or kept

    def count(self, qualname: str, policy: str, dtype: torch.dtype, site: str = "") -> None:
        """Count one call that runs outside the patched functions: the forward of an
        FP8 layer at O6/O7 (``precision.fp8``), under its layer name and policy ``"fp8"``."""
        with self._lock:
            s = self.ops.get(qualname)
            if s is None:
                s = self.ops[qualname] = OpStats(policy, site)
            s.calls += 1
            s.dtypes[dtype] = s.dtypes.get(dtype, 0) + 1

    def start(self, diag: "Diagnostics") -> None:
        """Start watching for unlisted ops on this thread (idempotent).

        ``initialize`` may call it once everything is patched, so the first
        forward pass is seen whole; otherwise the first patched call on each
        thread starts it.
        """
        with self._lock:
            first = self._names is None
            if first:
                self._names = modes.OpNames(diag.patcher, diag.table)
                self._diag = diag
        if first:
            modes.add(self._observe)
            diag.undo.push(self.stop)
        else:
            modes.ensure_here()
        self._here.watching = True

    def _watch_here(self) -> None:
        # The mode stack is per thread, and the wrappers only exist (and call
        # this) once the AMP state is current.
        amp = running.session()
        if amp is not None:
            self.start(amp.diagnostics)

    def stop(self) -> None:
        """Stop watching unlisted ops (run at ``deinitialize``)."""
        modes.remove(self._observe)

    # -- called by the watching mode for every torch call
    def _observe(self, func: object, args: tuple, kwargs: dict, out: object) -> None:
        if not isinstance(out, torch.Tensor) or out.dtype is not f32 or switch.off or not torch.is_grad_enabled():
            return
        names = self._names.names(func) if self._names is not None else ()
        if not names or self._names.covered(names):
            return
        name = names[0][1]
        if name in DATA_MOVEMENT or is_inplace(name) or out._is_view():
            return
        half = self._diag.config.half_dtype
        if not (needs_cast(args, half) or needs_cast(kwargs, half)):
            return
        frame, utility = modes.caller_and_utility()
        if modes.is_internal(frame) or utility is not None:
            return
        q = modes.qualname(names[0])
        with self._lock:
            u = self.unlisted.get(q)
            if u is None:
                u = self.unlisted[q] = [0, modes.site(frame)]
            u[0] += 1

    # -- reading and clearing
    def to_dict(self) -> Dict[str, Any]:
        """``{"ops": {qualname: {...}}, "unlisted": {qualname: {...}}, "utilities":
        {utility: {"calls", "ops": {qualname: calls}, "first_call_site"}}}``, a copy."""
        with self._lock:
            return {
                "ops": {q: s.to_dict() for q, s in self.ops.items()},
                "unlisted": {q: {"calls": c, "first_call_site": site} for q, (c, site) in self.unlisted.items()},
                "utilities": {u: {"calls": c, "ops": dict(ops), "first_call_site": site}
                              for u, (c, ops, site) in self.utilities.items()},
            }

    def reset(self) -> None:
        """Forget everything recorded so far."""
        with self._lock:
            self.ops.clear()
            self.unlisted.clear()
            self.utilities.clear()
