"""nvcc backend, driven by ninja: ahead-of-time builds and debug (-G / -lineinfo) builds.

Selected with FLEXGEN_COMPILER=nvcc (or `flexgen build --compiler nvcc`). Templates
must mark every device function `__device__`: nvcc has no `-default-device`.
"""
from __future__ import annotations

import re
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from . import ninja, paths
from .errors import CompilerFailure, CompilerUnavailableError
from .nvrtc import CompileOutput, spec_options

NAME = "nvcc"


def executable() -> str:
    exe = paths.nvcc_path()
    if exe is None:
        raise CompilerUnavailableError("nvcc was not found (set FLEXGEN_NVCC, or put nvcc on PATH); "
                                       "the default NVRTC backend needs no nvcc")
    return exe


@lru_cache(maxsize=None)
def version() -> str:
    out = subprocess.run([executable(), "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return f"nvcc-{m.group(1) if m else out.strip().splitlines()[-1]}"


def flags(spec) -> list[str]:
    return [f"-arch={spec.arch}", "-std=c++17", "-Xptxas=-v"] + spec_options(spec)


def command(source: Path, output: Path, options: list[str], mode: str = "-cubin") -> list[str]:
    return [executable(), mode, *options, "-o", str(output), str(source)]


def compile(source: str, options: list[str], name: str = "kernel.cu") -> CompileOutput:
    """Source -> cubin through a one-edge build.ninja in a scratch folder."""
    with tempfile.TemporaryDirectory(prefix="flexgen-nvcc-") as tmp:
        d = Path(tmp)
        (d / name).write_text(source)
        edge = ninja.Edge(str(d / "kernel.cubin"), command(d / name, d / "kernel.cubin", options),
                          str(d / "compile.log"), (str(d / name),))
        ninja.write(d / "build.ninja", [edge])
        start = time.perf_counter()
        ninja.run(d / "build.ninja", jobs=1)
        seconds = time.perf_counter() - start
        log = (d / "compile.log").read_text() if (d / "compile.log").exists() else ""
        cubin = d / "kernel.cubin"
        if not cubin.exists():
            raise CompilerFailure(log)
        return CompileOutput(cubin.read_bytes(), log, seconds)


def ptx(source: str, options: list[str], name: str = "kernel.cu") -> str:
    with tempfile.TemporaryDirectory(prefix="flexgen-nvcc-") as tmp:
        d = Path(tmp)
        (d / name).write_text(source)
        opts = [o for o in options if o != "-Xptxas=-v"]
        proc = subprocess.run(command(d / name, d / "kernel.ptx", opts, mode="-ptx"), capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompilerFailure(proc.stdout + proc.stderr)
        return (d / "kernel.ptx").read_text()
