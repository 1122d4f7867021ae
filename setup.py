"""Thin shim: the metadata lives in setup.cfg; this adds the optional C parts.

``amp_patch.patching._fastpath`` does a patched op's no-cast check in C, and
``amp_patch.precision._fusedstep`` is the one-pass O2/O5 optimizer step. Both
are optional: without a C compiler the build skips them and amp_patch runs its
pure-Python wrappers and the plain optimizer step, which compute the same,
only slower.
"""
from setuptools import Extension, setup

# -ffp-contract=off: the step kernel fuses exactly the multiply-adds torch's own
# kernels fuse (it writes them as fma), so the compiler must add none.
STEP_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread"]

setup(ext_modules=[
    Extension("amp_patch.patching._fastpath", ["amp_patch/patching/_fastpath.c"], optional=True),
    Extension("amp_patch.precision._fusedstep", ["amp_patch/precision/_fusedstep.c"], optional=True,
              extra_compile_args=STEP_FLAGS, extra_link_args=["-pthread"]),
])
