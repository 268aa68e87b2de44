"""Listing and clearing the cache (`flexgen cache ls | info | size | clear`).

Only what matches flexgen's own layout (layout.py) is listed or removed, through folder descriptors
and without following links: a root that does not look like a flexgen cache is refused with
NotAFlexgenCacheError, and a folder that holds files flexgen did not write is left in place (and
reported) after flexgen's own files in it are removed.
"""
from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from . import paths, safefs
from .errors import NotAFlexgenCacheError
from .layout import (ARCH_NAME, ENTRY_FILES, FAILED, FAILED_FILES, JINJA_NAME, KEY_NAME, LEGACY_JINJA, LOCK_NAME,
                     LOCKS, META, is_own_file, open_root_readonly, open_sub, subdirs)
from .safefs import VERSION_NAME


@dataclass(frozen=True)
class EntryInfo:
    version: str
    arch: str
    key: str
    path: Path
    size: int
    meta: dict | None  # None: incomplete or unreadable


@dataclass
class ClearResult:
    entries: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)  # folders left in place, and why


def _files_size(fd: int) -> int:
    with os.scandir(fd) as it:
        return sum(e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False))


def _walk(root_fd: int, arch: str | None, all_versions: bool):
    """(version, arch, key, entry folder descriptor) of every folder laid out like an entry."""
    for version in subdirs(root_fd, VERSION_NAME) if all_versions else [__version__]:
        vfd = open_sub(root_fd, version)
        if vfd is None:
            continue
        try:
            for a in subdirs(vfd, ARCH_NAME):
                afd = open_sub(vfd, a) if arch in (None, a) else None
                if afd is None:
                    continue
                try:
                    for key in subdirs(afd, KEY_NAME):
                        efd = open_sub(afd, key)
                        if efd is not None:
                            try:
                                yield version, a, key, efd
                            finally:
                                os.close(efd)
                finally:
                    os.close(afd)
        finally:
            os.close(vfd)


def _meta(efd: int, path: Path) -> dict | None:
    """meta.json for display, or None if it is missing or not shaped like flexgen's."""
    try:
        meta = json.loads(safefs.read_file(efd, META, path / META, trusted=False).decode("utf-8"))
    except (OSError, ValueError):
        return None
    shaped = isinstance(meta, dict) and all(isinstance(meta.get(k, {}), dict) for k in ("spec", "compiler"))
    return meta if shaped else None


def entries(arch: str | None = None, all_versions: bool = True) -> list[EntryInfo]:
    root = paths.cache_root()
    fd = open_root_readonly(root)
    if fd is None:
        return []
    try:
        return [EntryInfo(v, a, k, root / v / a / k, _files_size(efd), _meta(efd, root / v / a / k))
                for v, a, k, efd in _walk(fd, arch, all_versions)]
    finally:
        os.close(fd)


def find(prefix: str) -> list[EntryInfo]:
    return [e for e in entries() if e.key.startswith(prefix)]


def total_size() -> int:
    total = 0
    for folder, _, files in os.walk(paths.cache_root()):  # os.walk does not descend into links
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_size
            except OSError:
                pass
    return total


def clear(arch: str | None = None) -> ClearResult:
    """Remove flexgen's entries (of one arch, if given; of every flexgen version), failed sources,
    locks and leftovers of earlier versions. Refuses a root that does not look like a flexgen cache."""
    root = paths.cache_root()
    result = ClearResult()
    fd = open_root_readonly(root)
    if fd is None:
        return result
    try:
        if not safefs.looks_like_cache(fd):
            if safefs.is_empty(fd):
                return result
            raise NotAFlexgenCacheError(
                f"{root} does not look like a flexgen kernel cache (it holds other files and no "
                f"{safefs.MARKER} written by flexgen); refusing to delete anything in it. Check FLEXGEN_CACHE_DIR.")
        for version in subdirs(fd, VERSION_NAME):
            _clear_version(fd, version, root / version, arch, result)
    finally:
        os.close(fd)
    return result


def _clear_version(root_fd: int, version: str, path: Path, arch: str | None, result: ClearResult) -> None:
    vfd = open_sub(root_fd, version)
    if vfd is None:
        return
    try:
        for a in subdirs(vfd, ARCH_NAME):
            if arch not in (None, a):
                continue
            afd = open_sub(vfd, a)
            if afd is None:
                continue
            try:
                for key in subdirs(afd, KEY_NAME):
                    if _clean(afd, key, path / a / key, lambda n: is_own_file(n, ENTRY_FILES), result):
                        result.entries += 1
                _clean(afd, LOCKS, path / a / LOCKS, LOCK_NAME.match, result)
            finally:
                os.close(afd)
            _rmdir(vfd, a, path / a, result, report=False)
        if arch is None:
            _clear_failed(vfd, path / FAILED, result)
            _clean(vfd, LEGACY_JINJA, path / LEGACY_JINJA, JINJA_NAME.match, result)
    finally:
        os.close(vfd)
    _rmdir(root_fd, version, path, result, report=False)


def _clear_failed(vfd: int, path: Path, result: ClearResult) -> None:
    ffd = open_sub(vfd, FAILED)
    if ffd is None:
        return
    try:
        for key in subdirs(ffd, KEY_NAME):
            _clean(ffd, key, path / key, lambda n: is_own_file(n, FAILED_FILES), result)
    finally:
        os.close(ffd)
    _rmdir(vfd, FAILED, path, result, report=False)


def _clean(parent_fd: int, name: str, path: Path, own, result: ClearResult) -> int:
    """Remove the regular files in the folder `name` that `own` recognises, then the folder if empty.
    Returns how many files it removed."""
    fd = open_sub(parent_fd, name)
    if fd is None:
        return 0
    removed = 0
    try:
        with os.scandir(fd) as it:
            mine = [(e.name, e.stat(follow_symlinks=False).st_size) for e in it
                    if e.is_file(follow_symlinks=False) and own(e.name)]
        for child, size in mine:
            try:
                os.unlink(child, dir_fd=fd)
                result.bytes += size
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:
                result.kept.append(f"{path / child} ({e.strerror})")
    finally:
        os.close(fd)
    _rmdir(parent_fd, name, path, result, report=True)
    return removed


def _rmdir(parent_fd: int, name: str, path: Path, result: ClearResult, report: bool) -> None:
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno == errno.ENOTEMPTY:
            if report:
                result.kept.append(f"{path} (holds files flexgen did not write)")
        else:
            result.kept.append(f"{path} ({e.strerror})")
