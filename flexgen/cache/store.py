"""The on-disk kernel cache: content-addressed entries, atomic writes, checksum-verified reads.

An entry is <arch>/<key>/ with source.cu, kernel.cubin and meta.json (and kernel.ptx once asked
for). meta.json is written last and holds the sha256 of every other file, so an entry is complete
exactly when its meta.json exists and every file matches it; anything else (a missing field, a file
where a folder belongs, bytes that are not JSON) is a corrupted entry, rebuilt with a warning.
Every access goes through safefs (trusted owners only, no links followed; its docstring has the
security model). Nothing here looks at modification times.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..warnings_once import warn_once
from . import paths, safefs
from .errors import CacheSafetyError, UnsafeCacheError
from .layout import CUBIN, FAILED, LOG, META, PTX, SOURCE
from .lock import FileLock
from .maintenance import clear, entries, find, total_size  # noqa: F401 (listing and clearing, for the CLI)
from .safefs import write_atomic

# meta.json fields the loader relies on, with their types
_META_FIELDS = {"key": str, "arch": str, "entry": str, "cubin_sha256": str, "source_sha256": str,
                "compiler": dict, "resources": dict}



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


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _warn_once(text: str) -> None:
    warn_once(text, stacklevel=4)


def _corrupt(path: Path, why: str) -> None:
    _warn_once(f"flexgen: cache entry {path} is corrupted ({why}); rebuilding it")


def _refuse(why) -> None:
    """`why` names the folder or file at fault, so each is reported once, not once per kernel below it."""
    _warn_once(f"flexgen: kernel cache not used: {why}; compiling instead")


def _parts(arch: str, key: str) -> tuple[str, str, str]:
    return __version__, arch, key


def load(arch: str, key: str, source: str | None = None) -> Entry | None:
    """The entry if present, intact and trusted; None otherwise (warned once, except a plain miss or an
    entry still being written). With `source`, the entry must also hold exactly that source."""
    path = paths.entry_dir(arch, key)
    try:
        d = safefs.open_dirs(_parts(arch, key))
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        _corrupt(path, "a file stands where its folder belongs")
        return None
    except UnsafeCacheError as e:
        _refuse(e)
        return None
    except OSError as e:
        _refuse(f"cannot read {e.filename or path} ({e.strerror or e})")
        return None
    try:
        return _read(d, arch, key, path, source)
    except UnsafeCacheError as e:
        _refuse(e)
    except OSError as e:
        _corrupt(path, f"unreadable: {e.strerror or e}")
    finally:
        os.close(d)
    return None


def _read(d: int, arch: str, key: str, path: Path, source: str | None) -> Entry | None:
    try:
        raw = safefs.read_file(d, META, path / META)
    except FileNotFoundError:
        return None  # a writer has not finished (meta.json goes last): a plain miss
    meta, why = parse_meta(raw, arch, key)
    if meta is None:
        _corrupt(path, why)
        return None
    files = {}
    for name, field in ((CUBIN, "cubin_sha256"), (SOURCE, "source_sha256")):
        files[name] = safefs.read_file(d, name, path / name)
        if sha256(files[name]) != meta[field]:
            _corrupt(path, f"{name} does not match its checksum")
            return None
    if source is not None and sha256(source) != meta["source_sha256"]:
        _corrupt(path, "its source.cu is not the source of this kernel")
        return None
    return Entry(arch, key, path, meta, files[CUBIN])


def parse_meta(raw: bytes, arch: str, key: str) -> tuple[dict | None, str]:
    """(meta, "") for a meta.json of this entry with every field the loader needs; else (None, why)."""
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # also UnicodeDecodeError
        return None, f"meta.json is not UTF-8 JSON: {e}"
    if not isinstance(meta, dict):
        return None, f"meta.json holds {type(meta).__name__}, not an object"
    missing = [f for f, t in _META_FIELDS.items() if not isinstance(meta.get(f), t)]
    if "compiler" not in missing and not isinstance(meta["compiler"].get("flags"), list):
        missing.append("compiler.flags")
    if missing:
        return None, f"meta.json lacks {', '.join(missing)}"
    if meta["key"] != key or meta["arch"] != arch:
        return None, "meta.json describes another kernel"
    return meta, ""


def complete_meta(meta: dict, arch: str, key: str, source: str, cubin: bytes) -> dict:
    return dict(meta, key=key, arch=arch, cubin_sha256=sha256(cubin), cubin_bytes=len(cubin),
                source_sha256=sha256(source))


def unsaved(arch: str, key: str, source: str, cubin: bytes, meta: dict) -> Entry:
    """An entry kept in memory only, for when the cache cannot be written."""
    return Entry(arch, key, paths.entry_dir(arch, key), complete_meta(meta, arch, key, source, cubin), cubin)


def _remove(d: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=d)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        safefs.remove_tree(d, name)


def _dump(meta: dict) -> str:
    return json.dumps(meta, indent=2, sort_keys=True)


def write(arch: str, key: str, source: str, cubin: bytes, meta: dict) -> Entry:
    """Store an entry (callers hold the entry's lock). Raises OSError or CacheSafetyError when the
    cache cannot be written. meta.json goes first out and last in: it marks completion."""
    meta = complete_meta(meta, arch, key, source, cubin)
    d = safefs.open_dirs(_parts(arch, key), create=True, replace_leaf=True)
    try:
        _remove(d, META)  # readers of a rebuilt entry see it incomplete, not mismatched
        _remove(d, PTX)  # a kernel.ptx of an earlier build is not covered by the new meta.json
        write_atomic(d, SOURCE, source)
        write_atomic(d, CUBIN, cubin)
        write_atomic(d, META, _dump(meta))
    finally:
        os.close(d)
    return Entry(arch, key, paths.entry_dir(arch, key), meta, cubin)


def load_ptx(arch: str, key: str, meta: dict) -> str | None:
    """The kernel.ptx of an entry whose meta.json records its checksum, if intact and trusted."""
    want = meta.get("ptx_sha256")
    if not isinstance(want, str):
        return None
    path = paths.entry_dir(arch, key) / PTX
    try:
        d = safefs.open_dirs(_parts(arch, key))
        try:
            data = safefs.read_file(d, PTX, path)
        finally:
            os.close(d)
    except (OSError, CacheSafetyError):
        return None
    if sha256(data) != want:
        _corrupt(path, "kernel.ptx does not match its checksum")
        return None
    return data.decode(errors="replace")


def save_ptx(arch: str, key: str, meta: dict, ptx: str) -> dict:
    """Keep `ptx` next to the cubin and its checksum in meta.json, if the cache can be written.
    Returns the meta to use from now on."""
    try:
        with FileLock(paths.lock_path(arch, key), what="saving PTX"):
            current = load(arch, key)
            if current is None or current.meta["cubin_sha256"] != meta.get("cubin_sha256"):
                return meta  # not saved, or rebuilt meanwhile: the PTX is kept in memory only
            new = dict(current.meta, ptx_sha256=sha256(ptx))
            d = safefs.open_dirs(_parts(arch, key), create=True)
            try:
                write_atomic(d, PTX, ptx)
                write_atomic(d, META, _dump(new))
            finally:
                os.close(d)
            return new
    except (OSError, CacheSafetyError):
        return meta


def save_failed(key: str, source: str, log: str) -> Path:
    """Keep a source that did not compile (and its log) for the error message and for debugging:
    in the cache, or in a private temporary folder when the cache cannot be written."""
    try:
        d = safefs.open_dirs((__version__, FAILED, key), create=True, replace_leaf=True)
        try:
            write_atomic(d, SOURCE, source)
            write_atomic(d, LOG, log)
        finally:
            os.close(d)
        return paths.failed_dir(key) / SOURCE
    except (OSError, CacheSafetyError):
        folder = Path(tempfile.mkdtemp(prefix=f"flexgen-failed-{key[:16]}-"))
        (folder / SOURCE).write_text(source)
        (folder / LOG).write_text(log)
        return folder / SOURCE
