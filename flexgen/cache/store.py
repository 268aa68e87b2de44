"""The on-disk kernel cache: content-addressed entries, atomic writes, checksum-verified reads.

An entry is <arch>/<key>/ with source.cu, kernel.cubin and meta.json. meta.json is
written last and holds the cubin's sha256, so an entry is complete exactly when its
meta.json exists and the cubin matches it. Nothing here looks at modification times.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from . import paths

SOURCE = "source.cu"
CUBIN = "kernel.cubin"
META = "meta.json"
PTX = "kernel.ptx"

_warned: set[str] = set()


@dataclass(frozen=True)
class Entry:
    arch: str
    key: str
    path: Path
    meta: dict
    cubin: bytes


def cache_key(source: str, compiler: str, compiler_version: str, flags: list[str], arch: str, version: str) -> str:
    """sha256 over everything that determines the cubin."""
    blob = json.dumps([source, compiler, compiler_version, list(flags), arch, version], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write to a temporary file in the same folder, then rename over `path` (readers see old or new, never half)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _corrupt(path: Path, why: str) -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"flexgen: cache entry {path} is corrupted ({why}); rebuilding it", stacklevel=4)


def load(arch: str, key: str) -> Entry | None:
    """The entry if present and intact; None if absent, incomplete or corrupted (warned once)."""
    d = paths.entry_dir(arch, key)
    try:
        meta_text = (d / META).read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        meta = json.loads(meta_text)
        cubin = (d / CUBIN).read_bytes()
    except (ValueError, OSError) as e:
        _corrupt(d, f"unreadable: {e}")
        return None
    if meta.get("key") != key or meta.get("cubin_sha256") != sha256(cubin):
        _corrupt(d, "cubin checksum mismatch" if meta.get("key") == key else "key mismatch")
        return None
    return Entry(arch, key, d, meta, cubin)


def write(arch: str, key: str, source: str, cubin: bytes, meta: dict) -> Entry:
    """Store an entry (callers hold the entry's lock). meta.json goes last: it marks completion."""
    d = paths.entry_dir(arch, key)
    meta = dict(meta, key=key, arch=arch, cubin_sha256=sha256(cubin), cubin_bytes=len(cubin))
    write_atomic(d / SOURCE, source)
    write_atomic(d / CUBIN, cubin)
    write_atomic(d / META, json.dumps(meta, indent=2, sort_keys=True))
    return Entry(arch, key, d, meta, cubin)


def save_failed(key: str, source: str, log: str) -> Path:
    """Keep a source that did not compile (and its log) for the error message and for debugging."""
    d = paths.failed_dir(key)
    write_atomic(d / SOURCE, source)
    write_atomic(d / "compile.log", log)
    return d / SOURCE


# ---------------------------------------------------------------- listing / maintenance


@dataclass(frozen=True)
class EntryInfo:
    version: str
    arch: str
    key: str
    path: Path
    size: int
    meta: dict | None  # None: incomplete or unreadable


def _dir_size(d: Path) -> int:
    total = 0
    for root, _, files in os.walk(d):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def entries(arch: str | None = None, all_versions: bool = True) -> list[EntryInfo]:
    root = paths.cache_root()
    if not root.is_dir():
        return []
    versions = [p for p in root.iterdir() if p.is_dir()] if all_versions else [paths.version_dir()]
    out = []
    for vdir in sorted(versions):
        if not vdir.is_dir():
            continue
        for adir in sorted(p for p in vdir.iterdir() if p.is_dir() and p.name.startswith("sm_")):
            if arch is not None and adir.name != arch:
                continue
            for edir in sorted(p for p in adir.iterdir() if p.is_dir() and not p.name.startswith(".")):
                try:
                    meta = json.loads((edir / META).read_text())
                except (OSError, ValueError):
                    meta = None
                out.append(EntryInfo(vdir.name, adir.name, edir.name, edir, _dir_size(edir), meta))
    return out


def find(prefix: str) -> list[EntryInfo]:
    return [e for e in entries() if e.key.startswith(prefix)]


def total_size() -> int:
    root = paths.cache_root()
    return _dir_size(root) if root.is_dir() else 0


def clear(arch: str | None = None) -> tuple[int, int]:
    """Remove every entry (of one arch, if given) of every flexgen version; returns (entries, bytes)."""
    root = paths.cache_root()
    if not root.is_dir():
        return 0, 0
    count = len(entries(arch))
    size = 0
    for vdir in (p for p in root.iterdir() if p.is_dir()):
        targets = [vdir / arch] if arch else [vdir]
        for t in targets:
            if t.is_dir():
                size += _dir_size(t)
                shutil.rmtree(t, ignore_errors=True)
    return count, size
