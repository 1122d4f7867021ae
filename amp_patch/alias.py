"""The ``apex`` alias: ``import apex`` / ``from apex import amp`` resolve to amp_patch.

Apex's ``apex.amp`` is gone from current Apex releases, and many training
scripts still import it. ``install_apex_alias()`` makes those imports work
unchanged, but only when no real ``apex.amp`` can be imported: a real one is
always left in charge.

Two cases:

* no ``apex`` at all: a stand-in ``apex`` package is registered whose ``amp``
  is ``amp_patch.amp``; importing any other ``apex.*`` module (``apex.parallel``,
  ``apex.optimizers`` ...) fails with a message naming the torch replacement.
* an ``apex`` without ``amp`` (newer Apex, kept for its fused kernels): only
  ``apex.amp`` is added; the rest of the real package is untouched.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
import types
from typing import Optional

log = logging.getLogger("amp_patch")

#: what to use instead of the Apex modules the stand-in package does not have
REPLACEMENTS = {
    "apex.parallel": "torch.nn.parallel.DistributedDataParallel, and "
    "torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) for convert_syncbn_model",
    "apex.optimizers": "torch.optim.AdamW(..., fused=True) / torch.optim.Adam(..., fused=True) "
    "for FusedAdam, torch.optim.SGD(..., fused=True) for FusedSGD",
    "apex.normalization": "torch.nn.LayerNorm / torch.nn.RMSNorm (fused kernels on CUDA) for FusedLayerNorm",
    "apex.fp16_utils": "amp_patch.initialize(model, optimizer, opt_level='O2') for FP16_Optimizer and network_to_half",
    "apex.contrib": "the torch equivalents of the kernel you used (torch.nn.functional.scaled_dot_product_attention, fused optimizers)",
}

_lock = threading.Lock()
_installed: Optional[str] = None  # "package" (stand-in apex) or "submodule" (real apex, our amp)
_finder: Optional["_MissingApexFinder"] = None
_announced = False


class _MissingApexFinder(importlib.abc.MetaPathFinder):
    """Turns ``import apex.parallel`` (and friends) into an error that says what to use."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("apex.") or fullname == "apex.amp" or fullname.startswith("apex.amp."):
            return None
        top = ".".join(fullname.split(".")[:2])
        hint = REPLACEMENTS.get(top, "its torch equivalent")
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: Apex is not installed, and amp_patch's apex alias provides "
            f"only apex.amp. Use {hint}.",
            name=fullname,
        )


def _real_apex_amp_importable() -> bool:
    """True when an installed Apex has its own ``amp``; imports ``apex`` to ask."""
    if _installed is not None:
        return False
    try:
        if importlib.util.find_spec("apex") is None:
            return False
        return importlib.util.find_spec("apex.amp") is not None
    except (ImportError, ValueError):
        # A broken Apex install (e.g. missing compiled extensions) cannot serve
        # apex.amp either; the alias takes over and says so.
        return False


def install_apex_alias() -> bool:
    """Make ``import apex`` / ``from apex import amp`` resolve to amp_patch.

    Does nothing when a real ``apex.amp`` is importable. Otherwise registers
    ``amp_patch.amp`` as ``apex.amp`` (and a stand-in ``apex`` package if Apex
    is absent altogether) and says so once through the ``amp_patch`` logger.
    Calling it again is harmless. The launcher (``amp-patch run``) calls it
    for you.

    Returns:
        True when the alias is in place, False when the real ``apex.amp`` is used.

    Example::

        import amp_patch
        amp_patch.install_apex_alias()
        from apex import amp          # amp_patch.amp, with apex.amp's API
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    """
    global _installed, _finder
    with _lock:
        if _installed is not None:
            return True
        if _real_apex_amp_importable():
            log.info("amp_patch: a real apex.amp is installed; the apex alias is not needed and was not installed")
            return False
        from . import amp

        real = sys.modules.get("apex")
        if real is None and importlib.util.find_spec("apex") is not None:
            real = importlib.import_module("apex")
        if real is not None:
            real.amp = amp
            sys.modules["apex.amp"] = amp
            _installed = "submodule"
        else:
            pkg = types.ModuleType("apex", "Stand-in for NVIDIA Apex: only apex.amp, served by amp_patch.amp.")
            pkg.__path__ = []  # a package, so `import apex.amp` works
            pkg.__spec__ = importlib.machinery.ModuleSpec("apex", None, is_package=True)
            pkg.amp = amp
            sys.modules["apex"] = pkg
            sys.modules["apex.amp"] = amp
            _finder = _MissingApexFinder()
            sys.meta_path.insert(0, _finder)
            _installed = "package"
        _announce()
        return True


def _announce() -> None:
    global _announced
    if _announced:
        return
    _announced = True
    log.warning(
        "amp_patch: apex.amp is not installed; `apex.amp` now resolves to amp_patch.amp "
        "(see 'Migrating from apex.amp' in amp_patch's README)"
    )


def remove_apex_alias() -> None:
    """Undo ``install_apex_alias()``: ``apex`` is as it was before.

    Example::

        amp_patch.install_apex_alias()
        ...
        amp_patch.alias.remove_apex_alias()
    """
    global _installed, _finder
    with _lock:
        if _installed is None:
            return
        from . import amp

        if sys.modules.get("apex.amp") is amp:
            del sys.modules["apex.amp"]
        apex = sys.modules.get("apex")
        if _installed == "package":
            if apex is not None and getattr(apex, "amp", None) is amp:
                del sys.modules["apex"]
        elif apex is not None and vars(apex).get("amp") is amp:
            del apex.amp
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        _installed = None


def is_installed() -> bool:
    """True while the alias (not a real ``apex.amp``) serves ``apex.amp``."""
    return _installed is not None
