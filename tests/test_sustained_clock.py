"""benchmarks/sustained_clock.py: nvidia-smi's samples read back, unreadable lines skipped."""
from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sustained_clock  # noqa: E402


def test_samples_keep_time_clock_power_and_reasons(tmp_path):
    mhz, watts = random.randint(345, 1980), round(random.uniform(60, 700), 2)
    log = tmp_path / "smi.csv"
    log.write_text(f"2026/12/03 16:37:01.250, {mhz}, {watts}, 45, 0x0000000000000004\n"
                   "nvidia-smi: some warning\n"
                   "2026/12/03 16:37:01.270, [N/A], 690.00, 45, 0x0000000000000000\n"
                   f"2026/12/03 16:37:01.290, {mhz + 15}, {watts}, 46, 0x0000000000000000\n")
    samples = sustained_clock.read_samples(str(log))
    assert [(s[1], s[2], s[3]) for s in samples] == [(mhz, watts, "0x0000000000000004"),
                                                     (mhz + 15, watts, "0x0000000000000000")]
    assert abs((samples[1][0] - samples[0][0]) - 0.04) < 1e-6  # the milliseconds are kept
