"""Importing this module turns mixed precision on for the rest of the process.

For places where a command line cannot be changed but an import can be
added: ``sitecustomize.py``, ``python -c "import amp_patch.auto; ..."``, a
notebook's first cell. It does what ``amp-patch run`` does, configured only
by the environment:

* ``AMP_PATCH_OPT_LEVEL``  - O0..O7 (default O1)
* ``AMP_PATCH_HALF_DTYPE`` - float16 | bfloat16 (default: FP16 on CUDA, BF16 on CPU)
* ``AMP_PATCH_LOSS_SCALE`` - dynamic | a number (default: the opt level's)
* ``AMP_PATCH_OUTPUTS``    - float32 | half: dtype of the models' outputs (default float32)
* ``AMP_PATCH_LISTS``      - op-list override files, separated by ``:``

A bad value raises ``ConfigError`` / ``ListError`` naming the variable, at
import. ``amp_patch.auto.session.stop()`` turns it off again.

Example::

    AMP_PATCH_OPT_LEVEL=O1 python -c "import amp_patch.auto, runpy; runpy.run_path('train.py', run_name='__main__')"
"""
from __future__ import annotations

from .frontends.launcher import Launch, Settings

#: the running session; ``session.stop()`` undoes what the import did
session = Launch(Settings.resolve())
session.start()
