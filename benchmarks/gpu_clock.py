"""The GPU's SM clock, board power and throttle reasons over time, sampled by `nvidia-smi` in the background, so that
a timing can say at what clock it ran: under the H200's 700 W cap a kernel's clock moves by 15% within one 100 ms
do_bench window (docs/forward-sm90.md, "Under the power cap").

    sampler = ClockSampler()          # does nothing where nvidia-smi is missing
    t0 = time.time(); ...; t1 = time.time()
    sampler.window(t0, t1)            # {'mhz': median, 'mhz_min', 'mhz_max', 'watts', 'reasons', 'samples'} or None
    sampler.close()
"""
from __future__ import annotations

import atexit
import csv
import shutil
import statistics
import subprocess
import tempfile
import time


def parse_sample(line: str) -> tuple[float, float, float, str] | None:
    """(unix time, SM MHz, watts, throttle reasons) from one line of nvidia-smi's CSV; None for a line it left unfilled."""
    rec = next(csv.reader([line]), [])
    if len(rec) < 5:
        return None
    try:
        stamp, _, fraction = rec[0].strip().partition(".")
        seconds = time.mktime(time.strptime(stamp, "%Y/%m/%d %H:%M:%S"))
        return (seconds + (float("0." + fraction) if fraction else 0.0), float(rec[1]), float(rec[2]),
                rec[4].strip())
    except ValueError:
        return None


def read_samples(path: str, offset: int = 0) -> tuple[list[tuple[float, float, float, str]], int]:
    """The samples in the whole lines of nvidia-smi's CSV from byte `offset` on, skipping lines it could not fill, and
    the offset after the last whole line (a line nvidia-smi is still writing waits for the next read)."""
    samples = []
    with open(path, "rb") as f:
        f.seek(offset)
        for line in f:
            if not line.endswith(b"\n"):
                break
            offset += len(line)
            sample = parse_sample(line.decode(errors="replace"))
            if sample is not None:
                samples.append(sample)
    return samples, offset


try:  # bound here, so that the child runs no import between fork and exec
    import ctypes
    import signal

    _PRCTL, _SIGTERM = ctypes.CDLL(None).prctl, int(signal.SIGTERM)
except (OSError, AttributeError):
    _PRCTL = None


def _die_with_parent() -> None:
    """In the sampler's child: end when the process that started it ends, even by SIGKILL (a timed-out worker)."""
    if _PRCTL is not None:
        _PRCTL(1, _SIGTERM)  # PR_SET_PDEATHSIG (Linux)


class ClockSampler:
    def __init__(self, period_ms: int = 20):
        self.path = None
        self.proc = None
        self.samples = []  # parsed so far; the file grows by a line per period, so each window reads only the new ones
        self.offset = 0
        if shutil.which("nvidia-smi") is None:
            return
        reasons = "clocks_event_reasons.active"
        if subprocess.run(["nvidia-smi", f"--query-gpu={reasons}", "--format=csv"], capture_output=True).returncode:
            reasons = "clocks_throttle_reasons.active"  # the field's older name
        fields = f"timestamp,clocks.sm,power.draw,temperature.gpu,{reasons}"
        self.path = tempfile.mktemp(suffix=".csv", prefix="gpu_clock_")
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", str(period_ms)],
            stdout=open(self.path, "w"), stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        atexit.register(self.close)

    def window(self, t0: float, t1: float) -> dict | None:
        """The samples taken between unix times t0 and t1, summarised; None without a sampler or samples."""
        if self.path is None:
            return None
        new, self.offset = read_samples(self.path, self.offset)
        self.samples += new
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return None
        return {"mhz": statistics.median(s[1] for s in inside), "mhz_min": min(s[1] for s in inside),
                "mhz_max": max(s[1] for s in inside), "watts": statistics.median(s[2] for s in inside),
                "reasons": sorted({s[3] for s in inside}), "samples": len(inside)}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.proc = None
