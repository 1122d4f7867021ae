"""amp_patch's own bookkeeping runs eagerly under ``torch.compile``, and is never
captured in a CUDA graph.

The patched ``backward``, ``optimizer.step``, ``zero_grad`` and the
``scale_loss`` context keep host state (stages, skip decisions, undo records,
the flight of each thread) that a graph cannot hold. Marked with
``torch.compiler.disable``, a compiled function that calls one breaks its
graph there and runs it eagerly, so it computes what the eager loop
computes; under ``fullgraph=True`` torch refuses the call and its error
carries ``REASON``, which names the way that works.

A CUDA graph replays kernels without running Python: a captured backward or
step would replay its device work while the host state (counters, the
loss-scale history, what the next step decides from) stayed where the capture
left it. Such a call, made while the current CUDA stream is capturing, is
refused with ``CAPTURE``, before it changes anything.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, List, TypeVar

import torch

from .errors import StateError

F = TypeVar("F", bound=Callable[..., Any])

REASON = (
    "amp_patch's loss scaling and FP32 master weights run eagerly (they decide on the host what a step "
    "does). Compile the model (torch.compile(model, fullgraph=True) works at every level) and call "
    "loss.backward(), amp_patch.scale_loss and optimizer.step() outside the compiled function, or compile "
    "without fullgraph=True so the graph breaks at them"
)

CAPTURE = (
    "amp_patch's backward, optimizer.step() and zero_grad() cannot be captured in a CUDA graph: they keep "
    "host state (the loss scaler's counters and history, what the next step decides from) that a replay "
    "would not update. Capture the forward alone, and call loss.backward() and optimizer.step() outside "
    "the graph"
)


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never where CUDA is not in use)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def eager(fn: F) -> F:
    """``fn`` run eagerly under ``torch.compile`` (see the module docstring).

    ``torch.compiler.disable`` imports ``torch._dynamo``, over a second of
    start-up: the disabled form is made at the first call once dynamo is
    loaded, and until then ``fn`` is called as it is (nothing can be
    compiling). A first call made while tracing breaks the graph with
    ``REASON`` (``fullgraph=True`` refuses it with that message). A call made
    while a CUDA graph is being captured raises ``StateError(CAPTURE)``.
    """
    made: List[Callable[..., Any]] = []

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling() and _capturing():  # (a traced call breaks the graph below)
            raise StateError(CAPTURE)
        if not made:
            dynamo = sys.modules.get("torch._dynamo")
            if dynamo is None:
                return fn(*args, **kwargs)
            if torch.compiler.is_compiling():
                dynamo.graph_break(msg=REASON)
            made.append(torch.compiler.disable(fn, reason=REASON))
        return made[0](*args, **kwargs)

    return run  # type: ignore[return-value]
