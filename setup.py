"""Thin shim: the metadata lives in setup.cfg; this adds the optional C part.

``amp_patch.patching._fastpath`` does a patched op's no-cast check in C. It is
optional: without a C compiler the build skips it and amp_patch runs its
pure-Python wrappers, which behave the same, only slower per call.
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("amp_patch.patching._fastpath", ["amp_patch/patching/_fastpath.c"], optional=True)])
