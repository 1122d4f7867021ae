"""TorchScript and amp_patch: scripted code compiles, and runs the original ops.

Apex left TorchScript alone: code scripted while its patches were on called
torch's kernels directly, uncast. Two things of amp_patch's would otherwise
reach a ``torch.jit.script`` made while a session (or the launcher) runs, and
make it fail:

* **Patched functions.** TorchScript resolves a torch function it meets in
  scripted code through ``torch.jit._builtins``' table, ``{id(function):
  "aten::name"}``. A wrapper is not in it, so TorchScript would call it as an
  opaque Python function: ``F.conv2d(x, w, stride=2)`` fails to compile
  ("Keyword argument stride unknown"), ``torch.cat([a, b])`` too, and what does
  compile would cast inside scripted code. So while an attribute is patched,
  the registry (``registry.Patcher``, ``registry.builtin_table``) enters its
  wrapper in that table under the original's name and takes the entry out with
  the patch.
  Python-defined functions (``F.relu``, ``F.softmax``, ``F.layer_norm``) need
  nothing: TorchScript compiles them from their source, which a wrapper passes
  on (``__code__``, ``__globals__``, and wrapt's hash and equality, which
  TorchScript's ``boolean_dispatch`` and overload tables key on).
* **Hooks on a model.** ``torch.jit.script(module)`` compiles every forward hook
  and pre-hook of every submodule. amp_patch's own (the forward tracking of a
  model given to ``initialize``, the output casts, the launcher's outermost
  call hook) are Python objects TorchScript cannot compile. While a session
  holds models, or the launcher runs, ``torch.jit._recursive.create_script_module``
  is patched (``hide_hooks``) to take them off for the compilation and put them
  back, in their order, after it: the scripted module carries none of them, as
  a copy of the model carries none (``precision.copies``), and runs uncast. (A
  model converted at O2/O3/O5 scripts as the half model it is, without input
  casts; ``copy.deepcopy(model)`` is the plain FP32 model to script.)
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, List, Tuple

import torch

from .registry import Patcher

if TYPE_CHECKING:
    from ..base.undo import Owned

#: the function of ``torch.jit._recursive`` that builds a ScriptModule from an
#: ``nn.Module``, for ``torch.jit.script`` (and ``torch.jit.trace`` of a module
#: with exported methods)
_CREATE = "create_script_module"
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")


def is_ours(hook: object) -> bool:
    """A hook amp_patch installed: a function or an object of a class defined in amp_patch."""
    module = getattr(hook, "__module__", None)
    if not isinstance(module, str):
        module = getattr(type(hook), "__module__", "")
    return module == "amp_patch" or module.startswith("amp_patch.")


def _take_ours(root: torch.nn.Module) -> List[Tuple[dict, List[Tuple[Any, Any]], List[Any]]]:
    """Take amp_patch's hooks off every module under ``root``; what ``_put_back`` needs."""
    taken = []
    for m in root.modules():
        if isinstance(m, torch.jit.ScriptModule):
            continue
        for attr in _HOOK_DICTS:
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            ours = [k for k, h in hooks.items() if is_ours(h)]
            if ours:
                order = list(hooks.items())
                for k in ours:
                    del hooks[k]
                taken.append((hooks, order, ours))
    return taken


def _put_back(taken: List[Tuple[dict, List[Tuple[Any, Any]], List[Any]]]) -> None:
    for hooks, order, ours in reversed(taken):
        ours_set = set(ours)
        kept = [(k, h) for k, h in order if k in ours_set or k in hooks]
        known = {k for k, _ in order}
        added = [(k, h) for k, h in hooks.items() if k not in known]  # registered meanwhile
        hooks.clear()
        hooks.update(kept)
        hooks.update(added)


def hide_hooks(original: Callable[..., Any]) -> Callable[..., Any]:
    """``create_script_module`` with amp_patch's hooks off the module tree while it compiles."""

    @functools.wraps(original)
    def create_script_module(nn_module: Any, *args: Any, **kwargs: Any) -> Any:
        taken = _take_ours(nn_module) if isinstance(nn_module, torch.nn.Module) else []
        try:
            return original(nn_module, *args, **kwargs)
        finally:
            _put_back(taken)

    create_script_module.__amp_patch_hides_hooks__ = True  # type: ignore[attr-defined]
    return create_script_module


def hide_hooks_from_script(undo: "Owned") -> None:
    """Patch ``torch.jit._recursive.create_script_module`` with ``hide_hooks``,
    unless it hides amp_patch's hooks already (the launcher's patch serves the
    sessions it starts); the undo joins ``undo``'s owner's, as kind "jit" (not a
    function patch: Apex's ``handle._deactivate()`` leaves it, since the hooks stay)."""
    try:
        import torch.jit._recursive as recursive
    except ImportError:  # pragma: no cover - a torch without TorchScript
        return
    current = getattr(recursive, _CREATE, None)
    if not callable(current) or getattr(current, "__amp_patch_hides_hooks__", False):
        return
    patcher = Patcher(undo)
    patcher.KIND = "jit"
    patcher.apply([(recursive, _CREATE, hide_hooks)])
