"""The one module that knows flexgen's filesystem locations and environment variables.

Environment variables:
  FLEXGEN_CACHE_DIR      root of the kernel cache (default ~/.cache/flexgen)
  FLEXGEN_NO_JIT=1       a cache miss is an error instead of a compile
  FLEXGEN_ARCH_LIST      comma list of targets, e.g. "sm_80,sm_90a" (builds; JIT without a GPU)
  FLEXGEN_COMPILER       "nvrtc" (default) or "nvcc"
  FLEXGEN_TEMPLATE_DIR   extra template folder searched before the packaged templates
  FLEXGEN_NVCC           path of nvcc (default: the one on PATH, then /usr/local/cuda/bin)
  FLEXGEN_LOCK_TIMEOUT   seconds to wait for another process's compile of the same kernel
                         (default 300; "inf" waits forever)
  FLEXGEN_BACKGROUND_COMPILE=1
                         compile the backward's kernels in child processes during the forward
                         before it (default: at the first backward; see docs/host-path.md)
  FLEXGEN_CACHE_TRUST_SHARED=1
                         load kernels from a cache that another user owns (a prebuilt, read-only
                         cache); see flexgen.cache.safefs for what is checked

Layout: <root>/CACHEDIR.TAG                          (marks a folder flexgen created as its cache)
        <root>/<flexgen version>/<arch>/<key>/{source.cu, kernel.cubin, meta.json[, kernel.ptx]}
        <root>/<flexgen version>/<arch>/.locks/<key>.lock
        <root>/<flexgen version>/failed/<key>/{source.cu, compile.log}   (sources that did not compile)
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import __version__

PACKAGE_DIR = Path(__file__).resolve().parent.parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def cache_root() -> Path:
    return Path(_env("FLEXGEN_CACHE_DIR") or Path.home() / ".cache" / "flexgen").expanduser()


def version_dir() -> Path:
    return cache_root() / __version__


def arch_dir(arch: str) -> Path:
    return version_dir() / arch


def entry_dir(arch: str, key: str) -> Path:
    return arch_dir(arch) / key


def lock_path(arch: str, key: str) -> Path:
    return arch_dir(arch) / ".locks" / f"{key}.lock"


def failed_dir(key: str) -> Path:
    return version_dir() / "failed" / key


def _flag(name: str) -> bool:
    return _env(name) not in ("", "0", "false", "False")


def no_jit() -> bool:
    return _flag("FLEXGEN_NO_JIT")


def background_compile() -> bool:
    """FLEXGEN_BACKGROUND_COMPILE=1 (default off): compile a call's backward kernels during its forward."""
    return _flag("FLEXGEN_BACKGROUND_COMPILE")


def trust_shared() -> bool:
    """FLEXGEN_CACHE_TRUST_SHARED: accept cache folders and files that another user owns."""
    return _flag("FLEXGEN_CACHE_TRUST_SHARED")


DEFAULT_LOCK_TIMEOUT = 300.0


def lock_timeout() -> float:
    """FLEXGEN_LOCK_TIMEOUT in seconds (default 300; "inf" waits forever)."""
    text = _env("FLEXGEN_LOCK_TIMEOUT")
    if not text:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also catches NaN
        raise ValueError(f"FLEXGEN_LOCK_TIMEOUT must be a number of seconds >= 0 (or 'inf'), got {text!r}")
    return seconds


def arch_list() -> list[str]:
    text = _env("FLEXGEN_ARCH_LIST")
    return [a.strip() for a in text.split(",") if a.strip()]


def compiler_name() -> str:
    name = _env("FLEXGEN_COMPILER") or "nvrtc"
    if name not in ("nvrtc", "nvcc"):
        raise ValueError(f"FLEXGEN_COMPILER must be 'nvrtc' or 'nvcc', got {name!r}")
    return name


def template_dirs() -> list[Path]:
    """Template search path: the user's folder (if any) first, then the packaged templates."""
    extra = _env("FLEXGEN_TEMPLATE_DIR")
    return ([Path(extra)] if extra else []) + [TEMPLATES_DIR]


def nvcc_path() -> str | None:
    explicit = _env("FLEXGEN_NVCC")
    if explicit:
        return explicit
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def ninja_path() -> str | None:
    try:
        import ninja  # the pip package ships a binary next to the interpreter

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    return shutil.which("ninja")
