"""NVRTC in a child process: the same compile as the nvrtc backend (same name, version and flags, so
the same cache key), run as `python -m flexgen.cache.nvrtc JOB.json` so that compiles started on
worker threads (runtime/prefetch.py) run beside the calling thread's own compile, whatever NVRTC
and the GIL allow within one process. Starting the child costs about 0.4 s."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import nvrtc
from .errors import CompilerFailure
from .nvrtc import CompileOutput

NAME = nvrtc.NAME
version = nvrtc.version
flags = nvrtc.flags
ptx = nvrtc.ptx


def compile(source: str, options: list[str], name: str = "kernel.cu") -> CompileOutput:
    """Source -> cubin through a child process; raises CompilerFailure with NVRTC's log."""
    with tempfile.TemporaryDirectory(prefix="flexgen-nvrtc-") as tmp:
        d = Path(tmp)
        (d / "kernel.cu").write_text(source)
        job = {"source": str(d / "kernel.cu"), "flags": options, "name": name, "log": str(d / "log"),
               "cubin": str(d / "kernel.cubin")}
        (d / "job.json").write_text(json.dumps(job))
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
        proc = subprocess.run([sys.executable, "-m", "flexgen.cache.nvrtc", str(d / "job.json")], env=env,
                              capture_output=True, text=True)
        log = (d / "log").read_text() if (d / "log").exists() else ""
        if proc.returncode != 0 or not (d / "kernel.cubin").exists():
            raise CompilerFailure(log or proc.stderr[-4000:] or f"the NVRTC child exited with {proc.returncode}")
        seconds = float((d / "kernel.cubin.time").read_text())
        return CompileOutput((d / "kernel.cubin").read_bytes(), log, seconds)
