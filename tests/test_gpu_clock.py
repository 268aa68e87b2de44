"""benchmarks/gpu_clock.py: nvidia-smi's samples read back, unreadable lines skipped, windows summarised."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_clock  # noqa: E402


def test_samples_keep_time_clock_power_and_reasons(tmp_path):
    mhz, watts = random.randint(345, 1980), round(random.uniform(60, 700), 2)
    log = tmp_path / "smi.csv"
    log.write_text(f"2026/12/03 16:37:01.250, {mhz}, {watts}, 45, 0x0000000000000004\n"
                   "nvidia-smi: some warning\n"
                   "2026/12/03 16:37:01.270, [N/A], 690.00, 45, 0x0000000000000000\n"
                   f"2026/12/03 16:37:01.290, {mhz + 15}, {watts}, 46, 0x0000000000000000\n")
    samples, end = gpu_clock.read_samples(str(log))
    assert end == log.stat().st_size and gpu_clock.read_samples(str(log), end) == ([], end)
    assert [(s[1], s[2], s[3]) for s in samples] == [(mhz, watts, "0x0000000000000004"),
                                                     (mhz + 15, watts, "0x0000000000000000")]
    assert abs((samples[1][0] - samples[0][0]) - 0.04) < 1e-6  # the milliseconds are kept


def test_a_window_summarises_the_samples_inside_it(tmp_path, monkeypatch):
    log = tmp_path / "smi.csv"
    clocks = [random.choice([1980, 1755, 1665]) for _ in range(5)]
    log.write_text("".join(f"2026/12/03 16:37:0{i}.500, {mhz}, {300 + i}, 45, 0x{i % 2:016x}\n"
                           for i, mhz in enumerate(clocks)))
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)  # no nvidia-smi: nothing sampled
    sampler = gpu_clock.ClockSampler()
    assert sampler.window(0.0, 2e9) is None
    sampler.path = str(log)  # as if nvidia-smi had written these
    samples, _ = gpu_clock.read_samples(str(log))
    first = samples[0][0]  # the first sample's time
    got = sampler.window(first + 1.0, first + 3.0)  # samples 1, 2, 3
    assert got["samples"] == 3 and got["mhz"] == sorted(clocks[1:4])[1]
    assert (got["mhz_min"], got["mhz_max"]) == (min(clocks[1:4]), max(clocks[1:4]))
    assert got["watts"] == 302 and got["reasons"] == ["0x0000000000000000", "0x0000000000000001"]
    sampler.close()


def test_a_later_window_sees_lines_written_since_the_last_one(tmp_path, monkeypatch):
    log = tmp_path / "smi.csv"
    mhz = [random.randint(345, 1980) for _ in range(3)]
    log.write_text(f"2026/12/03 16:37:01.000, {mhz[0]}, 400, 45, 0x0\n2026/12/03 16:37:02.000, {mhz[1]}, 4")
    monkeypatch.setattr(gpu_clock.shutil, "which", lambda name: None)
    sampler = gpu_clock.ClockSampler()
    sampler.path = str(log)
    samples, _ = gpu_clock.read_samples(str(log))
    first = samples[0][0]  # the first sample's time
    assert sampler.window(first, first + 10)["samples"] == 1  # the half-written line waits
    with open(log, "a") as f:
        f.write(f"10, 45, 0x0\n2026/12/03 16:37:03.000, {mhz[2]}, 420, 45, 0x0\n")
    got = sampler.window(first + 0.5, first + 10)
    assert got["samples"] == 2 and (got["mhz_min"], got["mhz_max"]) == (min(mhz[1:]), max(mhz[1:]))
    assert got["watts"] == 415.0
    assert sampler.window(first, first + 10)["samples"] == 3  # earlier samples are kept for overlapping windows


def test_bench_attention_keeps_each_timing_beside_its_clock(monkeypatch):
    import torch

    import bench_attention

    seen = []

    class Sampler:
        def window(self, t0, t1):
            seen.append((t0, t1))
            return {"mhz": 1700.0}

    monkeypatch.setattr(bench_attention, "_CLOCK", Sampler())
    ms, clock = bench_attention.timed_ms(lambda: sum(range(1000)), torch.device("cpu"), 1.0, 2.0)
    assert ms > 0 and clock == {"mhz": 1700.0}
    assert len(seen) == 1 and seen[0][0] <= seen[0][1]
    records = [{"status": "ok", "id": "D128 full N8192", "impl": "flexgen", "fwd_mhz": 1665.4, "fb_mhz": None},
               {"status": "ok", "id": "D128 full N8192", "impl": "fa4", "fwd_mhz": None, "fb_mhz": None}]
    assert bench_attention.clock_lines(records)[2:] == ["| D128 full N8192 | flexgen | 1665 | - |"]
    monkeypatch.setattr(bench_attention, "_CLOCK", None)
    assert bench_attention.timed_ms(lambda: None, torch.device("cpu"), 1.0, 2.0)[1] is None


def test_bench_attention_rotates_which_implementation_is_timed_first():
    import bench_attention

    impls = ["flexgen", "sdpa-cudnn", "fa4", "flex"]
    firsts = [bench_attention.timing_order(impls, i, "rotate")[0] for i in range(4)]
    assert sorted(firsts) == sorted(impls)  # each goes first once in four cases
    for i in range(5):
        assert sorted(bench_attention.timing_order(impls, i, "rotate")) == sorted(impls)
    assert bench_attention.timing_order(impls, 3, "peers-first") == ["fa4", "flex", "sdpa-cudnn", "flexgen"]
    assert bench_attention.timing_order(impls, 3, "flexgen-first")[0] == "flexgen"
    with pytest.raises(ValueError, match="rotate, peers-first, flexgen-first"):
        bench_attention.timing_order(impls, 0, "random")


def test_bench_attention_idles_before_a_window_when_asked(monkeypatch):
    import torch

    import bench_attention

    slept = []
    monkeypatch.setattr(bench_attention.time, "sleep", slept.append)
    monkeypatch.setattr(bench_attention, "_CLOCK", None)
    bench_attention.timed_ms(lambda: None, torch.device("cpu"), 1.0, 2.0, cooldown_s=0.75)
    bench_attention.timed_ms(lambda: None, torch.device("cpu"), 1.0, 2.0)
    assert slept == [0.75]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads process states from /proc (Linux)")
def test_the_sampler_process_ends_with_the_process_that_started_it():
    """A worker killed by a timeout must not leave nvidia-smi sampling forever (`sleep` stands in for it)."""
    import subprocess
    import time

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    starter = (f"import sys, subprocess, time; sys.path.insert(0, {str(bench)!r}); import gpu_clock; "
               "p = subprocess.Popen(['sleep', '60'], preexec_fn=gpu_clock._die_with_parent); "
               "print(p.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    state = "alive"
    for _ in range(50):
        status = Path(f"/proc/{child}/status")
        if not status.exists():
            state = "gone"
            break
        state = next(line for line in status.read_text().splitlines() if line.startswith("State:"))
        if "Z" in state.split()[1]:
            break
        time.sleep(0.1)
    assert state == "gone" or "zombie" in state, state
