"""The demo: the tutorial's SimpleNet in FP32, O1 and O2, and its table."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import amp_patch
from amp_patch.frontends import demo

SMALL = ["--size", "32", "--batch-size", "8", "--batches", "2", "--steps", "4", "--rounds", "2", "--warmup", "1",
         "--no-progress"]


def _rows(out: str) -> dict:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("mode"))
    rows = {}
    for line in lines[head + 1:]:
        if not line.strip():
            break
        rows[line.split()[0]] = line
    return rows


def _fp32_reference_losses() -> tuple:
    """The FP32 loop, written out, on targets a fixed linear map of the inputs
    (the demo's data and seeds): the loss at the first and the last step."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(32, 32, generator=g) / 32 ** 0.5
    xs = [torch.randn(8, 32, generator=g) for _ in range(2)]
    data = [(x, x @ teacher) for x in xs]
    torch.manual_seed(0)
    model = demo.SimpleNet(32, 32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mse = nn.MSELoss()
    losses = []
    for i in range(1 + 4):
        x, y = data[i % 2]
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses[0], losses[-1]


def _o2_available() -> bool:
    model = demo.SimpleNet(4, 4)
    try:
        amp_patch.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    except amp_patch.ConfigError:
        return False
    amp_patch.deinitialize()
    return True


@pytest.mark.quick
def test_demo_prints_the_comparison_table(capsys):
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == ("amp_patch demo: SimpleNet (3 x Linear 32->32, ReLU), MSE loss, Adam; batch 8; steps per mode: "
                        "1 warm-up + 4 timed + 1 measuring peak memory; cpu (CPU half dtype: bfloat16)")
    assert lines[1] == f"Hardware: {demo.hardware(torch.device('cpu'))}"
    assert lines[2].startswith("Measured: each mode in its own process, 1 thread (--threads), timed by its CPU "
                               "time; modes interleaved in 2 rounds, medians ± spread over rounds")
    rows = _rows(out)
    assert list(rows) == ["FP32", "O1", "O2"]
    # the O2 row is the default O2, whose step is the one-pass kernel where it is built
    built = amp_patch.precision.onepass.native is not None
    for mode in ("O1", "O2"):  # the same count, labelled as the first line labels it
        assert (f"{mode}'s optimizer step (the default, no option): one pass in C per parameter for 6 of its 6 steps "
                "(1 warm-up + 4 timed + 1 measuring peak memory)" in out) is built

    f = re.match(r"FP32\s+[\d.]+ ms ±\d+%\s+1\.00x\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+linear x3 float32, relu x2 float32, loss float32$",
                 rows["FP32"])
    assert f, rows["FP32"]
    first, last = _fp32_reference_losses()
    assert float(f.group(1)) == pytest.approx(first, abs=1e-4) and float(f.group(2)) == pytest.approx(last, abs=1e-4)
    assert last < first  # the column shows the network learning

    m = re.match(r"O1\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+%\s+([\d.]+) -> ([\d.]+)\s+[\d.]+ MiB\s+(.*)$", rows["O1"])
    assert m, rows["O1"]
    assert m.group(3) == "linear x3 bfloat16, relu x2 bfloat16, loss float32"
    assert float(m.group(2)) == pytest.approx(last, rel=0.05)  # BF16 trains the same net
    assert float(m.group(2)) < float(m.group(1))

    if _o2_available():
        assert re.match(r"O2\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+%\s+[\d.]+ -> [\d.]+\s+[\d.]+ MiB\s+linear x3 bfloat16",
                        rows["O2"]), rows["O2"]
    else:
        assert re.match(r"O2\s+unavailable: .+", rows["O2"])
    assert not amp_patch.is_initialized()


def test_modes_flag_and_bad_arguments(capsys):
    assert demo.main(SMALL + ["--modes", "fp32"]) == 0
    assert list(_rows(capsys.readouterr().out)) == ["FP32"]
    assert demo.main(["--modes", "O7"]) == 2
    assert "--modes takes a comma-separated subset of FP32,O1,O2; got 'O7'" in capsys.readouterr().err
    assert demo.main(["--size", "0"]) == 2
    assert "--size must be at least 1" in capsys.readouterr().err
    assert demo.main(["--steps", "3", "--rounds", "5"]) == 2
    assert "--rounds 5 is more than --steps 3: each round needs a step per mode" in capsys.readouterr().err
    assert demo.main(["--warmup", "0"]) == 2
    assert "--warmup must be at least 1" in capsys.readouterr().err
    assert demo.main(["--help"]) == 0
    assert "--full" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_requested_without_cuda(capsys):
    assert demo.main(["--device", "cuda"]) == 2
    assert "no CUDA device is available; use --device cpu" in capsys.readouterr().err


def test_full_flag_selects_the_tutorials_sizes_and_steps():
    args, modes, _ = demo._settings(["--full"])
    assert (args.size, args.batch_size, args.batches, args.steps, args.rounds) == (4096, 512, 50, 250, 10)
    assert args.steps == 5 * args.batches  # the tutorial's 5 epochs
    assert args.progress and modes == ["FP32", "O1", "O2"] and args.threads == 1


def test_default_sizes_follow_the_device(monkeypatch):
    args, _, device = demo._settings(["--device", "cpu"])
    assert (device.type, args.size, args.batch_size, args.threads) == ("cpu", 1024, 256, 1)
    # a GPU gets the tutorial's sizes: at the CPU's, per-op overheads hide the speedup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args, _, device = demo._settings([])
    assert (device.type, args.size, args.batch_size) == ("cuda", 4096, 512)
    args, _, _ = demo._settings(["--size", "64"])
    assert (args.size, args.batch_size) == (64, 512)


def test_full_says_how_long_it_will_take_before_the_long_work_starts(capsys, monkeypatch):
    monkeypatch.setattr(demo, "FULL", dict(size=16, batch_size=8, batches=2, steps=4, rounds=2))
    seen = {}

    def measure(modes, args, device, quiet_bf16=False):  # the long part: data, warm-up, rounds
        seen["out"] = capsys.readouterr().out
        return _fake_measure({"FP32": [1.0, 1.0], "O1": [0.5, 0.5]})(modes, args, device)

    monkeypatch.setattr(demo, "measure", measure)
    assert demo.main(["--full", "--modes", "FP32,O1", "--warmup", "1"]) == 0
    line = next(l for l in seen["out"].splitlines() if l.startswith("This takes about"))
    assert re.fullmatch(r"This takes about \d+ s or more: 2 modes, each building 2 batches and training 6 steps "
                        r"\(from one matmul of this size timed just now; a second estimate follows the warm-up\)", line), line


def test_the_estimate_counts_every_step_and_batch_of_every_mode(monkeypatch):
    monkeypatch.setattr(demo, "_matmul_seconds", lambda rows, size, dtype, device, threads:
                        0.5 if dtype == torch.float32 else 0.25)
    args, _, device = demo._settings(["--size", "64", "--batches", "3", "--steps", "4", "--rounds", "2", "--warmup", "1"])
    # FP32: 3 batches + 6 steps of 8 matmuls at 0.5 s; O1: the batches in FP32, the steps at 0.25 s
    assert demo.estimate_seconds(["FP32", "O1"], args, device) == (3 * 0.5 + 6 * 8 * 0.5) + (3 * 0.5 + 6 * 8 * 0.25)


def test_full_says_how_long_it_will_take_and_shows_progress(capsys, monkeypatch):
    monkeypatch.setattr(demo, "FULL", dict(size=16, batch_size=8, batches=2, steps=4, rounds=2))
    assert demo.main(["--full", "--modes", "FP32,O1", "--warmup", "1"]) == 0
    captured = capsys.readouterr()
    estimate = next(line for line in captured.out.splitlines() if line.startswith("Timed part:"))
    assert re.fullmatch(r"Timed part: 4 steps per mode in 2 rounds, about \d+ s \(from the warm-up's step times: "
                        r"FP32 \d+ ms, O1 \d+ ms\)", estimate), estimate
    assert captured.out.index("Timed part:") < captured.out.index("\nmode ")  # up front, before the table
    rounds = captured.err.splitlines()
    assert re.fullmatch(r"round 1/2: FP32 [\d.]+ ms, O1 [\d.]+ ms; about \d+ s left", rounds[0]), rounds
    assert re.fullmatch(r"round 2/2: FP32 [\d.]+ ms, O1 [\d.]+ ms", rounds[1]), rounds


def test_peak_memory_counts_live_tensor_storage():
    base = {1: 100}  # a storage that exists before: counted, never freed by the step
    with demo._LiveTensors(base) as live:
        a = torch.empty(1000)  # 4000 B
        b = torch.empty(500)  # 2000 B
        v = b.view(20, 25)  # a view: no new storage
        del a
        c = torch.empty(2000)  # 8000 B
        del b, v
    assert live.peak == 100 + 2000 + 8000
    assert live.current == 100 + 8000
    del c


@pytest.mark.quick
def test_spread_is_half_the_interquartile_range_over_the_median():
    assert demo.spread([2.0]) == 0.0
    assert demo.spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert demo.spread([0.9, 1.0, 1.0, 1.1]) == pytest.approx((1.025 - 0.975) / 2)  # quartiles 0.975, 1.025
    assert demo.spread([1, 2, 3, 4, 5, 6, 7]) == pytest.approx((5.5 - 2.5) / 2 / 4)


#: a machine shared with other work: FP32's step time swings by 2x from round to round
SHARED_FP32 = [10.0, 14.0, 20.0, 11.0, 9.5, 17.0, 12.0]


@pytest.mark.quick
def test_noise_verdict_judges_the_speedup_within_each_round_not_the_times():
    # every mode slowed alike in each round: the times swing, the speedups hold within ±1%
    wobble = [1.0, 1.01, 0.99, 1.0, 1.005, 0.995, 1.0]
    shared = {"FP32": SHARED_FP32, "O1": [t / 1.5 / w for t, w in zip(SHARED_FP32, wobble)],
              "O2": [t / 2.0 for t in SHARED_FP32]}
    assert demo.spread(shared["FP32"]) > 0.2  # what judging the times would have called noise
    assert demo.round_speedups(shared)["O2"] == [2.0] * 7
    assert max(demo.spread(v) for v in demo.round_speedups(shared).values()) < 0.01
    assert demo.noise_verdict(shared) == []
    # the same times, but O1's ratio itself swings: that is noise, and said with the threshold
    swinging = dict(shared, O1=[t / r for t, r in zip(SHARED_FP32, [0.41, 3.09, 0.87, 0.88, 1.45, 1.0, 2.2])])
    s = demo.spread(demo.round_speedups(swinging)["O1"])
    assert s > 0.1
    assert demo.noise_verdict(swinging) == [f"O1's speedup varies ±{s:.0%} over 7 rounds (more than ±10%)"]
    assert demo.noise_verdict(shared, threshold=0.001)  # a stricter bar
    assert demo.noise_verdict({"O1": [1.0, 2.0]}) == [] and demo.round_speedups({"O1": [1.0]}) == {}  # no FP32


def _fake_measure(times, peaks=None):
    """A stand-in for ``measure``: made-up rows and per-round times, no workers."""
    def measure(modes, args, device, quiet_bf16=False):
        speedups = demo.round_speedups(times)
        rows = []
        for m in modes:
            r = demo.Result(m, ms_per_step=1.0, first_loss=1.0, final_loss=0.5, layers="linear x3 float32",
                            peak_bytes=(peaks or {}).get(m, 2**20))
            r.speedup = 1.0 if m == "FP32" else sum(speedups[m]) / len(speedups[m])
            rows.append(r)
        return rows, times
    return measure


def test_noise_verdict_is_printed_after_the_table_with_its_threshold(capsys, monkeypatch):
    monkeypatch.setattr(demo, "_load", lambda: 64.0)  # a loaded machine, whose ratios still hold
    steady = {"FP32": SHARED_FP32, "O1": [t / 1.5 for t in SHARED_FP32]}
    monkeypatch.setattr(demo, "measure", _fake_measure(steady))
    assert demo.main(SMALL + ["--modes", "FP32,O1"]) == 0
    out = capsys.readouterr().out
    assert "load average 64.0 on" in out.splitlines()[2]
    assert "Too noisy" not in out
    assert "\nSteady: every speedup within ±0% over 2 rounds (judged noisy above ±10%; each speedup is a ratio " \
           "within one round, so other work that slows every mode alike cancels out)." in out
    assert "The load average was 64.0 on" in out
    noisy = dict(steady, O1=[t / r for t, r in zip(SHARED_FP32, [0.4, 3.0, 0.9, 0.9, 1.5, 1.0, 2.2])])
    monkeypatch.setattr(demo, "measure", _fake_measure(noisy))
    assert demo.main(SMALL + ["--modes", "FP32,O1"]) == 0
    out = capsys.readouterr().out
    verdict = out[out.index("\nToo noisy to trust these figures: "):]
    assert "O1's speedup varies ±" in verdict and "(more than ±10%)" in verdict and "with more --rounds" in verdict


@pytest.mark.quick
def test_o2_peak_memory_above_fp32_is_explained():
    rows = [demo.Result("FP32", peak_bytes=59 * 2**20), demo.Result("O1", peak_bytes=50 * 2**20),
            demo.Result("O2", peak_bytes=63 * 2**20)]
    note = demo.memory_note(rows)
    assert note.startswith("O2's peak memory (63.0 MiB) is above FP32's (59.0 MiB) here: on a model this small its "
                           "FP32 master weights, the half copy of the weights and Adam's state outweigh")
    assert "O2 saves memory where activations dominate" in note
    rows[2].peak_bytes = 40 * 2**20
    assert demo.memory_note(rows) is None
    assert demo.memory_note(rows[:2]) is None  # no O2 row
    assert demo.memory_note([rows[0], demo.Result("O2", unavailable="no compiler")]) is None


def test_the_memory_note_is_printed_under_the_table(capsys, monkeypatch):
    times = {"FP32": [1.0, 1.0], "O1": [0.5, 0.5], "O2": [0.5, 0.5]}
    monkeypatch.setattr(demo, "measure", _fake_measure(times, {"FP32": 59 * 2**20, "O2": 63 * 2**20}))
    assert demo.main(SMALL) == 0
    out = capsys.readouterr().out
    assert out.index("\nO2's peak memory (63.0 MiB) is above FP32's (59.0 MiB) here") > out.index("\nmode ")


CPUINFO = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse2 avx2 {}\n\n"


@pytest.mark.parametrize("flags,says", [
    ("avx512f amx_tile amx_bf16 avx512_bf16", "BF16 matrix units: amx_bf16 (AMX tiles)"),
    ("avx512f avx512_bf16", "BF16: avx512_bf16, no amx_bf16: native BF16 dot products in vector registers, no matrix units"),
    ("avx512f", "BF16: none of amx_bf16, avx512_bf16: torch emulates BF16 here, slower than FP32"),
])
@pytest.mark.quick
def test_hardware_line_reads_the_bf16_flags(flags, says):
    info = CPUINFO.format(flags)
    assert demo.cpu_bf16_flags(info) == [f for f in ("amx_bf16", "avx512_bf16") if f in flags.split()]
    line = demo.hardware(torch.device("cpu"), info)
    assert line.startswith(f"Test CPU 9000, {os.cpu_count()} cores; ") and says in line


def test_unavailable_mode_is_a_row_not_a_crash(capsys, monkeypatch):
    real = demo.Trainer.__init__

    def refuse(self, mode, config, device):
        if mode == "O2":
            raise amp_patch.ConfigError("O2 needs something this machine lacks")
        real(self, mode, config, device)

    monkeypatch.setattr(demo.Trainer, "__init__", refuse)  # the forked workers inherit it
    assert demo.main(SMALL) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["O2"].split() == ["O2", "unavailable:", "O2", "needs", "something", "this", "machine", "lacks"]
    assert rows["O1"].startswith("O1 ")


@pytest.mark.slow
def test_demo_through_python_dash_m():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "amp_patch", "demo", "--size", "16", "--batch-size", "8", "--batches", "2",
         "--steps", "2", "--rounds", "2", "--warmup", "1", "--modes", "FP32,O1", "--no-progress"],
        cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"\nFP32\s+[\d.]+ ms ±\d+%\s+1\.00x .*linear x3 float32", proc.stdout)
    assert re.search(r"\nO1\s+[\d.]+ ms ±\d+%\s+[\d.]+x ±\d+% .*linear x3 bfloat16", proc.stdout)


@pytest.mark.parametrize("native", [True, False])
def test_demo_explains_a_cpu_without_bf16_instructions(native, capsys, monkeypatch):
    """Where BF16 is emulated the demo says, once, why O1/O2 are slower (its
    workers drop the per-mode warning); where it is native it says nothing of the kind."""
    monkeypatch.setattr(amp_patch.diagnostics.setup_checks, "cpu_has_native_bf16", lambda: native)
    assert demo.main(SMALL + ["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    if native:
        assert "no BF16 instructions" not in out
    else:
        lines = out.splitlines()
        assert lines[3].startswith("Note: This CPU has no BF16 instructions (AVX512_BF16, AMX or Arm BF16)")
        assert lines[3].endswith("Expect O1 and O2 to be slower than FP32 in this run.")
        assert "The speedup needs a CPU that has them" in out
        assert set(_rows(out)) == {"FP32", "O1", "O2"}
