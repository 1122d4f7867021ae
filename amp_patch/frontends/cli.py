"""The ``amp-patch`` command (also ``python -m amp_patch``).

Subcommands:

* ``run``   - run a training script with AMP on, unmodified (see ``launcher``).
* ``lists`` - print the effective op policy after overrides.
* ``check`` - validate op-list override files.
* ``demo``  - train a small network in FP32, O1 and O2 and compare.
* ``compare`` - run a training script at several opt levels and compare its
  loss step by step (see ``compare``).
* ``check-script`` - list the Apex names a script uses and whether amp_patch
  serves each, without running it (see ``scan``).

``amp-patch --version`` prints the versions of amp_patch, torch and Python and
whether the C fast path is in use.

Exit codes: 0 success; 1 problems found (``check``), Apex names amp_patch
does not serve (``check-script``) or the script's
uncaught exception (``run``, with its traceback printed as Python prints
it); 2 bad command-line input, nothing run. Under ``run`` the script's own
``sys.exit`` code passes through unchanged.
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
from typing import List, Optional, Sequence

import torch

from .. import __version__
from ..base.errors import AmpError
from ..oplists import view
from ..patching import wrappers
from ..config import OPT_LEVELS, PRESETS, parse_dtype
from . import compare, launcher, scan
from .compare import Parser as _Parser
from .compare import split_script_args
from .compare import UsageExit as _UsageExit

PROG = "amp-patch"
HALF_CHOICES = "float16|bfloat16"

# The globals of the script ``run`` ran, held until the interpreter exits, as
# ``python script.py`` holds its ``__main__``. Dropping them as soon as the
# script returns would run its objects' destructors right after its last line:
# a DDP model then destroys its gloo process group while gloo's worker thread
# may still be finishing the last collective and waiting for the GIL, which
# torch's ~ProcessGroupGloo deadlocks on (one torchrun run in ten hung so).
_script_globals: List[dict] = []


def _run_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=f"{PROG} run",
        usage=f"{PROG} run [options] script.py [script args ...]",
        description="Run an unmodified training script with automatic mixed precision. Everything after "
        "the script path is passed to the script. Each option defaults to its environment variable.",
        allow_abbrev=False,
    )
    levels = "; ".join(_level_help(lv) for lv in PRESETS)
    p.add_argument("--opt-level", metavar=f"{OPT_LEVELS[0]}..{OPT_LEVELS[-1]}",
                   help=f"opt level ({levels}; default $AMP_PATCH_OPT_LEVEL, else O1)")
    p.add_argument("--half-dtype", metavar=HALF_CHOICES, help="low-precision dtype (default $AMP_PATCH_HALF_DTYPE, else FP16 on CUDA, BF16 on CPU)")
    p.add_argument("--lists", metavar="FILE.yaml", action="append", default=[], help="op-list override; repeatable (added to $AMP_PATCH_LISTS)")
    p.add_argument("--loss-scale", metavar="dynamic|FLOAT", help="loss scale (default $AMP_PATCH_LOSS_SCALE, else the opt level's)")
    p.add_argument("--outputs", metavar="float32|half", help="dtype of the models' outputs (default $AMP_PATCH_OUTPUTS, else float32: "
                   "code written for FP32, such as .numpy(), keeps working; half keeps what the model computed)")
    p.add_argument("--quiet", action="store_true", help="print nothing of the launcher's own: no line on what it turned "
                   "on before the script, no summary after it (both on stderr otherwise)")
    return p


def _level_help(level: str) -> str:
    """A few words on ``level`` for ``--help``: O4 and O5 are the BF16 forms of O1 and O2."""
    preset = PRESETS[level]
    if preset.bf16:
        twin = next((p.level for p in PRESETS.values() if not p.bf16 and p.does == preset.does
                     and p.cast_model_type == preset.cast_model_type), None)
        if twin is not None:
            return f"{level}: the BF16 form of {twin} ({preset.does}, in BF16)"
    return f"{level}: {preset.does}"


def _cmd_run(tokens: Sequence[str]) -> int:
    parser = _run_parser()
    options, rest = split_script_args(parser, tokens)
    ns = parser.parse_args(options)
    if not rest:
        parser.error("the script to run is missing (usage: amp-patch run [options] script.py [args ...])")
    script, args = rest[0], rest[1:]
    try:
        settings = launcher.Settings.resolve(
            ns.opt_level, ns.half_dtype, ns.loss_scale, ns.lists,
            names={"opt_level": "--opt-level", "half_dtype": "--half-dtype", "loss_scale": "--loss-scale", "outputs": "--outputs"},
            outputs=ns.outputs,
        )
        launcher.check_script(script)
    except AmpError as e:
        parser.error(str(e))
    path = os.path.abspath(script)
    # one rank speaks for all under torchrun (which sets RANK before the script starts)
    stream = None if ns.quiet or os.environ.get("RANK", "0") != "0" else sys.stderr
    try:
        _script_globals.append(launcher.run(script, args, settings, stream))
    except BaseException as e:
        tb = _script_traceback(e.__traceback__, path)
        if tb is not e.__traceback__:  # the script's module frame: keep its globals too
            _script_globals.append(tb.tb_frame.f_globals)
        if not isinstance(e, Exception):  # SystemExit and KeyboardInterrupt pass through untouched
            raise
        if tb is e.__traceback__ and isinstance(e, SyntaxError):
            tb = None  # the script did not compile: Python shows the line and the caret only
        # Print it as `python script.py` would: from the script's first frame.
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        return 1
    return 0


def _script_traceback(tb, path: str):
    """``tb`` without the launcher's own frames (cli, launcher, runpy)."""
    t = tb
    while t is not None:
        if os.path.abspath(t.tb_frame.f_code.co_filename) == path:
            return t
        t = t.tb_next
    return tb


def _add_half(p: argparse.ArgumentParser) -> None:
    p.add_argument("--half-dtype", metavar=HALF_CHOICES, help="the dtype whose policy to show (default: FP16 on CUDA, BF16 on CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="the device whose policy to show (default: CUDA if present)")


def version() -> str:
    """What ``amp-patch --version`` prints: amp_patch's version and where it is
    imported from, torch's and Python's versions, and whether the C fast path is in use."""
    return (
        f"{PROG} {__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})\n"
        f"torch {torch.__version__}, Python {platform.python_version()}\n"
        f"{wrappers.fast}\n"
    )


def _main_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Automatic mixed precision for existing PyTorch code.", allow_abbrev=False)
    p.add_argument("--version", action="store_true",
                   help="print the versions of amp_patch, torch and Python, and whether the C fast path is in use")
    sub = p.add_subparsers(dest="command", metavar="{run,lists,check,check-script,demo,compare}")
    sub.add_parser("run", help="run a training script with AMP on, unmodified", add_help=False)
    lists = sub.add_parser(
        "lists", help="print the effective op policy after overrides", allow_abbrev=False,
        description="Print the op policy in force for a dtype and device after every override (--lists, "
        "$AMP_PATCH_LISTS): each listed op, its policy and the file and line that set it.")
    lists.add_argument("--lists", metavar="FILE.yaml", action="append", default=[], help="op-list override; repeatable (added to $AMP_PATCH_LISTS)")
    _add_half(lists)
    lists.add_argument("--format", choices=("table", "yaml"), default="table",
                       help="table: aligned columns for people (the default); yaml: the same policy as an op-list "
                       "override file, which `amp-patch check` accepts and --lists applies")
    lists.set_defaults(parser=lists)
    check = sub.add_parser(
        "check", help="validate op-list override files", allow_abbrev=False,
        description="Validate op-list override files against the shipped lists and this torch, before a long run: "
        "every problem is printed with its file, line and the nearest valid name. Exit code 0: valid; 1: problems "
        "found; 2: a file that does not exist.")
    check.add_argument("files", metavar="FILE.yaml", nargs="+", help="override files, as --lists and $AMP_PATCH_LISTS take them")
    check.set_defaults(parser=check)
    script = sub.add_parser(
        "check-script", help="list the Apex names a script uses and whether amp_patch serves each "
        "(reads the script, runs nothing)", allow_abbrev=False,
        description="Read a training script written for NVIDIA Apex, without running it, and list every Apex name it "
        "uses (apex.amp, apex.parallel, apex.optimizers, ...) with what amp_patch serves it with, or that it does "
        "not. Exit code 0: every name is served; 1: some are not; 2: the script cannot be read or parsed.")
    script.add_argument("script", metavar="SCRIPT.py", help="the script to read")
    script.set_defaults(parser=script)
    sub.add_parser("demo", help="train a small network in FP32, O1 and O2 and compare", add_help=False)
    sub.add_parser("compare", help="run a training script at FP32, O1 and O2 (or --levels) and compare its loss step by step",
                   add_help=False)
    return p


def _cmd_lists(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        half = None if ns.half_dtype is None else parse_dtype(ns.half_dtype, "--half-dtype")
        text = view.render(ns.lists, half, ns.device, ns.format)
    except AmpError as e:
        parser.error(str(e))
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `amp-patch lists | head`: the reader has all it wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _cmd_check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    missing = [f for f in ns.files if not os.path.exists(f)]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    problems = view.check(ns.files)
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found", file=sys.stderr)
        return 1
    print(f"{', '.join(ns.files)}: no problems")
    return 0


def _cmd_check_script(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        with open(ns.script, encoding="utf-8") as f:
            source = f.read()
    except OSError as e:
        parser.error(f"cannot read {ns.script}: {e.strerror}")
    try:
        uses = scan.scan(source, ns.script)
    except SyntaxError as e:
        parser.error(f"{ns.script} does not parse (line {e.lineno}: {e.msg}); python would refuse it too")
    text, rc = scan.report(uses, ns.script)
    sys.stdout.write(text)
    return rc


def _cmd_demo(tokens: Sequence[str]) -> int:
    try:
        demo = importlib.import_module("amp_patch.frontends.demo")
    except ModuleNotFoundError as e:
        if e.name != "amp_patch.frontends.demo":
            raise
        print(f"{PROG} demo: the demo is not part of this installation of amp_patch (amp_patch/frontends/demo.py is missing)", file=sys.stderr)
        return 2
    rc = demo.main(list(tokens))
    return 0 if rc is None else rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``amp-patch`` and ``python -m amp_patch``; returns the exit code.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).

    Example::

        amp-patch run --opt-level O1 train.py --epochs 1
        amp-patch lists --half-dtype float16 --format yaml
        amp-patch check my_lists.yaml
        amp-patch check-script train.py
        amp-patch compare --steps 200 train.py --epochs 1
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("run", "demo", "compare"):
        try:
            if argv[0] == "compare":
                return compare.main(argv[1:])
            return _cmd_run(argv[1:]) if argv[0] == "run" else _cmd_demo(argv[1:])
        except _UsageExit as e:
            return e.code
    parser = _main_parser()
    try:
        ns = parser.parse_args(argv)
        if ns.version:
            sys.stdout.write(version())
            return 0
        if ns.command is None:
            parser.print_help(sys.stderr)
            return 2
        if ns.command == "lists":
            return _cmd_lists(ns, ns.parser)
        if ns.command == "check-script":
            return _cmd_check_script(ns, ns.parser)
        return _cmd_check(ns, ns.parser)
    except _UsageExit as e:
        return e.code


