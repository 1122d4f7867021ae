"""Thin shim: the metadata lives in setup.cfg; this adds what a .cfg cannot say.

The packages are found, not listed: every folder of ``amp_patch/`` with an
``__init__.py`` ships, so a new subpackage cannot be left out of the wheel. The
op lists live in the top-level ``lists/`` folder and ship as
``amp_patch.lists``.

``amp_patch.patching._fastpath`` does a patched op's no-cast check in C, and
``amp_patch.precision._onepass`` is the one-pass O2/O5 optimizer step. Both
are optional: without a C compiler the build skips them and amp_patch runs its
pure-Python wrappers and the plain optimizer step, which compute the same,
only slower.
"""
from setuptools import Extension, find_packages, setup

PACKAGES = find_packages(include=["amp_patch", "amp_patch.*"]) + ["amp_patch.lists"]

# -ffp-contract=off: the step kernel fuses exactly the multiply-adds torch's own
# kernels fuse (it writes them as fma), so the compiler must add none.
STEP_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-pthread"]

setup(
    packages=PACKAGES,
    package_dir={"amp_patch": "amp_patch", "amp_patch.lists": "lists"},
    ext_modules=[
        Extension("amp_patch.patching._fastpath", ["amp_patch/patching/_fastpath.c"], optional=True),
        Extension("amp_patch.precision._onepass", ["amp_patch/precision/_onepass.c"], optional=True,
                  extra_compile_args=STEP_FLAGS, extra_link_args=["-pthread"]),
    ],
)
