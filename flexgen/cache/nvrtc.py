"""NVRTC backend (the default): in-process compile to cubin through cupy's NVRTC bindings.

Generated sources include no headers, so NVRTC needs no include path. Also runnable
as `python -m flexgen.cache.nvrtc JOB.json`: the build step that `flexgen build`
writes into build.ninja (JOB.json names the source, outputs, arch and flags).
"""
from __future__ import annotations

import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

from .errors import CUDA_EXTRA_HINT, CompilerFailure, CompilerUnavailableError

NAME = "nvrtc"


@dataclass(frozen=True)
class CompileOutput:
    cubin: bytes
    log: str
    seconds: float


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as e:
        raise CompilerUnavailableError(
            f"NVRTC is not available ({e}): {CUDA_EXTRA_HINT}, or use FLEXGEN_COMPILER=nvcc"
        ) from None
    return nvrtc


@lru_cache(maxsize=None)
def version() -> str:
    major, minor = _nvrtc().getVersion()
    return f"nvrtc-{major}.{minor}"


def flags(spec) -> list[str]:
    return [f"--gpu-architecture={spec.arch}", "-std=c++17", "-default-device", "--ptxas-options=-v"] + spec_options(spec)


def spec_options(spec) -> list[str]:
    """Flags both compilers spell the same way: fast math and the two debug levels."""
    out = []
    if spec.option("fast_math", False):
        out.append("--use_fast_math")
    if spec.debug:
        out.append("-lineinfo")
    if spec.option("device_debug", False):
        out.append("-G")
    return out


def _log_text(raw) -> str:
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    return raw.rstrip("\x00")


def _elf_extent(image: bytes) -> int:
    """Bytes an ELF64 image spans by its header: the end of its program and section header tables."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2:
        return len(image)
    ph_off, sh_off = struct.unpack_from("<QQ", image, 0x20)
    ph_size, ph_num, sh_size, sh_num = struct.unpack_from("<HHHH", image, 0x36)
    return max(len(image), ph_off + ph_size * ph_num, sh_off + sh_size * sh_num)


def whole_cubin(image: bytes) -> bytes:
    """The cubin NVRTC produced. cupy's getCUBIN drops the last byte, as if the image were a NUL-terminated
    string; that byte is the top byte of the last header table's last field, zero. The driver loads the short image
    (a bytes object is followed by a NUL), but cuobjdump, nvdisasm and readelf reject the file it is stored as."""
    missing = _elf_extent(image) - len(image)
    return image + b"\x00" * missing if 0 < missing <= 8 else image


def _run(source: str, options: list[str], name: str, want: str):
    nvrtc = _nvrtc()
    start = time.perf_counter()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            raise CompilerFailure(_log_text(nvrtc.getProgramLog(prog))) from None
        log = _log_text(nvrtc.getProgramLog(prog))
        result = nvrtc.getCUBIN(prog) if want == "cubin" else _log_text(nvrtc.getPTX(prog))
    finally:
        nvrtc.destroyProgram(prog)
    return result, log, time.perf_counter() - start


def compile(source: str, options: list[str], name: str = "kernel.cu") -> CompileOutput:
    """Source -> cubin; raises CompilerFailure (with the log) when NVRTC rejects it."""
    cubin, log, seconds = _run(source, options, name, "cubin")
    return CompileOutput(whole_cubin(bytes(cubin)), log, seconds)


def ptx(source: str, options: list[str], name: str = "kernel.cu") -> str:
    """PTX of the same source: compiled for the virtual architecture compute_XX."""
    opts = [o.replace("--gpu-architecture=sm_", "--gpu-architecture=compute_") for o in options
            if not o.startswith("--ptxas-options")]
    text, _, _ = _run(source, opts, name, "ptx")
    return text


def main(argv: list[str] | None = None) -> int:
    """Build-step entry: compile the job's source, write cubin and log; exit 1 on a compile error."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m flexgen.cache.nvrtc JOB.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    with open(job["source"]) as f:
        source = f.read()
    try:
        out = compile(source, job["flags"], name=job.get("name", "kernel.cu"))
    except CompilerFailure as e:
        with open(job["log"], "w") as f:
            f.write(e.log)
        print(f"{job['source']}: NVRTC compile failed\n{e.log}", file=sys.stderr)
        return 1
    with open(job["log"], "w") as f:
        f.write(out.log)
    with open(job["cubin"] + ".tmp", "wb") as f:
        f.write(out.cubin)
    os.replace(job["cubin"] + ".tmp", job["cubin"])  # ninja sees the output only when complete
    with open(job["cubin"] + ".time", "w") as f:
        f.write(f"{out.seconds:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
