"""Helpers shared by several test modules (imported as a sibling module, as
``op_samples`` is)."""
from __future__ import annotations

import contextlib
import datetime
import inspect
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

import amp_patch
from amp_patch.oplists import NAMESPACES
from amp_patch.frontends import launcher
from amp_patch.patching import wrappers

#: this folder, ``tests/``: where this module, ``op_samples``, ``data/`` and ``scripts/`` are
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

#: every environment variable amp_patch reads
ENV = (launcher.ENV_OPT_LEVEL, launcher.ENV_HALF_DTYPE, launcher.ENV_LOSS_SCALE, launcher.ENV_LISTS, launcher.ENV_OUTPUTS)

#: a C compiler is here, so every install must build the C fast path
HAS_C_COMPILER = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is not None


def unannotated(fn) -> str:
    """``fn``'s signature as text, without annotations (to compare with Apex's)."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def fast_path():
    """The C fast path's module; fails the test when it is not built."""
    if not wrappers.fast:
        pytest.fail(f"the C fast path is not built: {wrappers.FAST_UNAVAILABLE}")
    return wrappers.fast


@contextlib.contextmanager
def amp(*args, **kwargs):
    """``initialize`` (quiet unless ``verbosity`` is given), always ``deinitialize``."""
    kwargs.setdefault("verbosity", 0)
    out = amp_patch.initialize(*args, **kwargs)
    try:
        yield out
    finally:
        amp_patch.deinitialize()


def destroy_process_group():
    """``dist.destroy_process_group()``, after letting gloo finish the last collective.

    gloo's worker thread frees a finished collective's tensors with the GIL;
    if the process group is destroyed (when the last DDP model holding it is
    freed) by a thread that holds the GIL meanwhile, torch deadlocks. Sleeping
    releases the GIL long enough for that thread to finish.
    """
    time.sleep(0.05)
    dist.destroy_process_group()


# ------------------------------------------------------------------ gloo workers


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script, world, out_dir, timeout, **env):
    """Run ``script`` as ``world`` worker processes at once (``serve_cases`` is
    their side) and return what each saved, rank 0's first.

    Rank ``r`` runs ``python script r PORT out_dir`` with ``OMP_NUM_THREADS=1``,
    ``tests/`` on ``PYTHONPATH`` (the script may be in a subfolder and import
    this module) and ``env`` added to the environment; all are killed after
    ``timeout`` seconds. A rank that saved nothing fails the test with every
    rank's output.
    """
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS_DIR, env.get("PYTHONPATH")]))
    procs = [
        subprocess.Popen([sys.executable, script, str(r), str(port), str(out_dir)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.pt"
        assert path.exists(), f"rank {r} saved nothing:\n" + "\n".join(x[-3000:] for x in logs)
        results.append(torch.load(path, weights_only=False))
    return results


def serve_cases(rank, port, out_dir, world, cases, timeout):
    """A worker of ``run_workers``: join the gloo group of ``world`` processes
    (collectives time out after ``timeout`` seconds), run each ``(name, run)``
    of ``cases`` in order and save ``{name: run()}`` to ``out_dir/rank{rank}.pt``.

    The results so far are saved after every case, so one that hangs leaves
    the earlier ones; one that raises saves ``{"exception": traceback}``.
    """
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout))
    results = {}
    for name, run in cases:
        try:
            results[name] = run()
        except Exception:
            results[name] = {"exception": traceback.format_exc()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    destroy_process_group()


def case_results(ranks, name):
    """Every rank's results of case ``name`` (``run_workers``' list), failing
    the test with a rank's traceback when the case raised or never ran there."""
    got = []
    for r, res in enumerate(ranks):
        assert name in res, f"rank {r} never finished {name} (an earlier scenario hung or crashed)"
        assert "exception" not in res[name], f"rank {r}:\n{res[name]['exception']}"
        got.append(res[name])
    return got


def write(tmp_path, name, body):
    """Write the dedented ``body`` to ``tmp_path / name``; return the path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


#: Python's own caches, which appear in a namespace on first use (the first
#: warning raised from torch code, the first pickling of a tensor): not patches
_CACHES = ("__warningregistry__", "__slotnames__")
_MISSING = object()


class Snapshot:
    """What the namespaces amp_patch patches (``oplists.NAMESPACES``, or the
    ``{name: object}`` given) hold now, to tell later what changed.

    ``snapshot[name]`` is ``dict(vars(object))`` as it was.
    """

    def __init__(self, objects=None):
        self.objects = dict(NAMESPACES if objects is None else objects)
        self.vars = {name: dict(vars(obj)) for name, obj in self.objects.items()}

    def __getitem__(self, name):
        return self.vars[name]

    def __iter__(self):
        return iter(self.vars)

    def changed(self):
        """``name.attr`` of every attribute that holds another object than then
        (by identity: a wrapt wrapper compares equal to what it wraps)."""
        out = []
        for name, obj in self.objects.items():
            old, now = self.vars[name], vars(obj)
            for key in sorted(set(old) | set(now)):
                if key not in _CACHES and old.get(key, _MISSING) is not now.get(key, _MISSING):
                    out.append(f"{name}.{key}")
        return out


# ------------------------------------------------------------------ models and data

_NORMS = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


def mlp(*sizes, seed=0, act=nn.ReLU, norm=None, dtype=None):
    """A seeded ``nn.Sequential`` of ``nn.Linear`` layers through ``sizes``,
    each but the last followed by ``norm`` (``"batch"``, ``"layer"``) and ``act``.

    ``norm`` and ``act`` are either one for every hidden layer or a list with
    one per hidden layer (a ``None`` norm: none after that layer); ``dtype``
    casts the model (FP32 where None)."""
    torch.manual_seed(seed)
    hidden = max(len(sizes) - 2, 0)
    norms = list(norm) if isinstance(norm, (list, tuple)) else [norm] * hidden
    acts = list(act) if isinstance(act, (list, tuple)) else [act] * hidden
    assert len(norms) == len(acts) == hidden, f"one norm and one act per hidden layer: {hidden}"
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < hidden:  # the last layer has neither norm nor activation
            layers += [_NORMS[norms[i]](b)] if norms[i] else []
            layers.append(acts[i]())
    model = nn.Sequential(*layers)
    return model if dtype is None else model.to(dtype)


def batch(i, n_in, n_out, rows=8, seed=100):
    """``(inputs, targets)`` number ``i``: seeded, so every test that asks gets the same."""
    g = torch.Generator().manual_seed(seed + i)
    return torch.randn(rows, n_in, generator=g), torch.randn(rows, n_out, generator=g)


def sgd(model, lr=0.1, **kwargs):
    """``torch.optim.SGD`` over ``model``'s parameters."""
    return torch.optim.SGD(model.parameters(), lr=lr, **kwargs)
