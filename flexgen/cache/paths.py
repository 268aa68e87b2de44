"""The one module that knows flexgen's filesystem locations and environment variables.

Environment variables:
  FLEXGEN_CACHE_DIR      root of the kernel cache (default ~/.cache/flexgen)
  FLEXGEN_NO_JIT=1       a cache miss is an error instead of a compile
  FLEXGEN_ARCH_LIST      comma list of targets, e.g. "sm_80,sm_90a" (builds; JIT without a GPU)
  FLEXGEN_COMPILER       "nvrtc" (default) or "nvcc"
  FLEXGEN_TEMPLATE_DIR   extra template folder searched before the packaged templates
  FLEXGEN_NVCC           path of nvcc (default: the one on PATH, then /usr/local/cuda/bin)

Layout: <root>/<flexgen version>/<arch>/<key>/{source.cu, kernel.cubin, meta.json}
        <root>/<flexgen version>/<arch>/.locks/<key>.lock
        <root>/<flexgen version>/failed/<key>/source.cu   (sources that did not compile)
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


def jinja_cache_dir() -> Path:
    """Compiled-template bytecode, so a fresh process renders without re-parsing templates."""
    return version_dir() / ".jinja"


def no_jit() -> bool:
    return _env("FLEXGEN_NO_JIT") not in ("", "0", "false", "False")


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
