"""The floor every other part of amp_patch stands on, importing nothing of it:
its exceptions (``errors``), the process's one undo stack (``undo``), which
session runs now (``running``) and whose code a stack frame runs (``frames``)."""
