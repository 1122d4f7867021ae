"""What a patched op does with a call, decided once when its wrapper is built.

Two objects carry everything a casting wrapper needs, so neither the Python
wrappers nor the C fast path look anything up per call:

* ``Casting``: one per session, the inputs every wrapper of that session is
  built from (the half dtype, the weight-cast cache, the ``Live`` flag, the op
  ledger, the ``cast_policy="auto"`` threshold). ``run/`` makes it when the
  session starts; ``patching`` only reads it.
* ``OpSpec``: one per op, frozen, made by ``op_spec`` from the op's policy and
  the session's ``Casting``. The Python wrappers (``wrappers.py``) and the C fast
  path (``_fastpath.c``) read the same fields; C reads them by position, and
  checks the field names once when ``wrappers`` binds it, so a field added or
  moved here fails at import, not with a silent misread.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional, Tuple

import torch

from . import costs
from .cast import CASTABLE, CONVERT, CastCache

if TYPE_CHECKING:
    from .wrappers import Live

f32 = torch.float32

#: ``OpSpec.mode``: how a call's castable dtypes decide its cast
FIXED, PROMOTE, NATIVE = 0, 1, 2


class Casting:
    """The inputs a session's casting wrappers are built from (``make_wrapper``)."""

    __slots__ = ("half", "cache", "live", "ledger", "min_flops")

    def __init__(self, half: torch.dtype, live: "Live", cache: Optional[CastCache] = None,
                 ledger: Optional[object] = None, min_flops: float = 0.0) -> None:
        #: the low-precision dtype the ``half`` policy runs in
        self.half = half
        #: the session's ``Live`` flag: its wrappers call straight through once it is off
        self.live = live
        #: half copies of FP32 weights, shared by every wrapper of the session
        self.cache = cache if cache is not None else CastCache()
        #: the op ledger (``diagnostics.stats.Ledger``, a floor above: not imported
        #: here) when ``collect_stats=True``; None costs nothing
        self.ledger = ledger
        #: ``cast_policy="auto"``: a sized half-list op under this many FLOPs stays FP32 (0: all cast)
        self.min_flops = min_flops


class OpSpec(NamedTuple):
    """One op's casting decision inputs, shared by the Python and the C path.

    C (``_fastpath.c``, ``enum spec_field``) reads the first eight fields by
    position: keep their order, or change both together.
    """

    #: dtypes whose tensors make a call cast (FIXED) or are compared (PROMOTE)
    castable: Tuple[torch.dtype, ...]
    #: the dtype a FIXED cast goes to
    to: torch.dtype
    #: ``to``'s conversion (``cast.CONVERT``)
    convert: Callable
    #: the cache of half weight copies a cast to a half dtype reads; None: none
    weights: Optional[CastCache]
    #: the session's ``Live`` flag
    live: "Live"
    #: FIXED, PROMOTE or NATIVE (a kernel that promotes by itself: never cast)
    mode: int
    #: ``cast_policy="auto"``: a call under this many FLOPs is not cast to half (0: every call is)
    min_flops: float
    #: how the call's FLOPs follow from its arguments (``costs.FLOPS``; 0: not sized)
    flops: int
    #: the op's public name and policy, for the Python side's messages and ledger
    qualname: str
    policy: str


def op_spec(policy: str, qualname: str, casting: Casting, *, native: bool, sized: bool) -> OpSpec:
    """The frozen spec of one op under ``policy`` (``half``, ``float`` or a promote policy).

    ``native``: a promote op whose kernel promotes mixed inputs itself;
    ``sized``: a half op whose small calls stay FP32 (``cast_policy="auto"``).
    """
    promote = policy not in ("half", "float")
    to = casting.half if policy == "half" else f32
    mode = NATIVE if native else PROMOTE if promote else FIXED
    castable = tuple(CASTABLE if promote else CASTABLE - {to})
    # the cache keeps half copies of FP32 weights: a cast up to FP32 never reads it
    weights = casting.cache if to is not f32 else None
    return OpSpec(
        castable=castable, to=to, convert=CONVERT[to], weights=weights, live=casting.live, mode=mode,
        min_flops=casting.min_flops if sized else 0.0, flops=costs.FLOPS[qualname] if sized else 0,
        qualname=qualname, policy=policy,
    )
