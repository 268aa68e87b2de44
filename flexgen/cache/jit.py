"""Spec -> CompiledKernel: memory cache, then disk cache, then (under a lock) compile.

    hot:  dict lookup keyed by the KernelSpec itself (hash = field hashes; Nodes hash
          their precomputed digest) -> no file I/O, no hashing of large strings
    warm: render the source, hash it into the key, read + checksum the entry
    cold: take the entry's file lock, look again (another process may have just built
          it), compile, write atomically; if the cache cannot be written (read-only, another
          user's, full), the kernel is kept in memory and a warning is given once per process
"""
from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

from .. import __version__
from . import nvcc, nvrtc, nvrtc_child, paths, store
from .errors import CompilerFailure, FlexgenCompileError, KernelNotCachedError
from .layout import LOG
from .kernel import CompiledKernel
from .lock import FileLock
from .ptxas import parse_resources

BACKENDS = {"nvrtc": nvrtc, "nvcc": nvcc}

_memory: dict[tuple, CompiledKernel] = {}
_memory_lock = threading.Lock()
_building: dict[tuple, threading.Lock] = {}  # kernels being loaded or compiled, and the lock each is built under


def backend(name: str | None = None):
    return BACKENDS[name or paths.compiler_name()]


def get_kernel(spec, template_dir: str | Path | None = None, compiler: str | None = None, *,
               child_process: bool = False) -> CompiledKernel:
    """The compiled kernel for `spec`, from memory, disk, or a fresh compile. child_process: an NVRTC
    compile runs in a child process (cache/nvrtc_child.py), for compiles started on worker threads."""
    k = (spec, template_dir, compiler)
    hit = _memory.get(k)
    if hit is not None:
        return hit
    with _memory_lock:  # one build per kernel in this process: a second thread waits for the first
        building = _building.setdefault(k, threading.Lock())
    with building:
        hit = _memory.get(k)
        if hit is not None:
            return hit
        be = backend(compiler)
        if child_process and be is nvrtc:
            be = nvrtc_child
        kernel = _load_or_build(spec, template_dir, be)
        with _memory_lock:
            _building.pop(k, None)
            return _memory.setdefault(k, kernel)


def clear_memory() -> None:
    _memory.clear()


def plan(spec, template_dir=None, be=None) -> tuple[str, list[str], str]:
    """(source, flags, key) of a spec: everything the cache key depends on."""
    from ..codegen.render import render

    be = be or backend()
    source = render(spec, template_dir)
    flags = be.flags(spec)
    key = store.cache_key(source, be.NAME, be.version(), flags, spec.arch, __version__)
    return source, flags, key


def summary(spec, key: str) -> str:
    d = spec.describe()
    text = ", ".join(f"{k}={d[k]}" for k in ("kind", "head_dim", "dtype", "arch"))
    return f"{text}, score_mod={d['score_mod'] or 'identity'}, mask_mod={d['mask_mod'] or 'none'}, key={key}"


def _load_or_build(spec, template_dir, be) -> CompiledKernel:
    source, flags, key = plan(spec, template_dir, be)
    entry = store.load(spec.arch, key, source)
    if entry is None:
        if paths.no_jit():
            raise KernelNotCachedError(
                f"FLEXGEN_NO_JIT is set and this kernel is not in the cache ({paths.version_dir()}): "
                f"{summary(spec, key)}. Build it ahead of time with `flexgen build`."
            )
        entry = _build(spec, source, flags, key, be)
    return CompiledKernel(spec, key, entry.path, source, entry.cubin, entry.meta, be)


def _build(spec, source: str, flags: list[str], key: str, be) -> store.Entry:
    """Compile under the entry's lock; without the lock, and without saving, if the cache cannot be written."""
    from . import events
    from .errors import CacheSafetyError, LockTimeoutError

    lock = FileLock(paths.lock_path(spec.arch, key), what=f"compiling {spec.kind} kernel {key[:16]}")
    try:
        lock.acquire()
    except LockTimeoutError:
        raise
    except (OSError, CacheSafetyError) as e:
        events.not_saved(e)
        return compile_and_store(spec, source, flags, key, be, save=False)
    try:
        entry = store.load(spec.arch, key, source)  # another process may have built it while we waited
        return entry if entry is not None else compile_and_store(spec, source, flags, key, be)
    finally:
        lock.release()


def compile_and_store(spec, source: str, flags: list[str], key: str, be, save: bool = True) -> store.Entry:
    """Compile (the caller holds the entry's lock) and write the entry. A kernel that compiled but
    cannot be written is kept in memory (warned once per process), never an error."""
    from . import events
    from .errors import CacheSafetyError

    events.compiling(spec, key, be)
    try:
        out = be.compile(source, flags, name=f"{spec.entry_name}.cu")
    except CompilerFailure as e:
        raise compile_error(spec, key, source, e.log, be) from None
    events.compiled(spec, key, be, out.seconds)
    meta = describe(spec, flags, be, out.log, out.seconds)
    if save:
        try:
            return store.write(spec.arch, key, source, out.cubin, meta)
        except (OSError, CacheSafetyError) as e:
            events.not_saved(e)
    return store.unsaved(spec.arch, key, source, out.cubin, meta)


MESSAGE_LOG_LINES = 40  # of the compiler log in the error (the whole log is saved beside the source)


def compile_error(spec, key: str, source: str, log: str, be) -> FlexgenCompileError:
    saved = store.save_failed(key, source, log)
    lines = log.strip().splitlines()
    shown = "\n".join(lines[:MESSAGE_LOG_LINES])
    if len(lines) > MESSAGE_LOG_LINES:
        shown += f"\n... {len(lines) - MESSAGE_LOG_LINES} more lines in {saved.with_name(LOG)}"
    hint = ""
    if _has_inline_asm(spec):  # the user's own PTX: an error there is repeated at every place a mod is inlined
        hint = ("\nThe variant holds inline PTX (inline_asm_elementwise): ptxas errors point at it first; its text is "
                "in the source's fg_asm_* functions.")
    return FlexgenCompileError(
        f"{be.NAME} could not compile the generated {spec.kind} kernel "
        f"({summary(spec, key)}).{hint}\nSource saved to: {saved}\n--- compiler log ---\n{shown}",
        log=log, source_path=str(saved),
    )


def _has_inline_asm(spec) -> bool:
    from ..dsl.graph import postorder
    from ..dsl.inline_asm import OP

    return any(n.op == OP for expr in (spec.score_expr, spec.mask_expr) if expr is not None for n in postorder(expr))


def _resources_or_note(log: str, entry: str) -> dict:
    """The ptxas report, or a note that it is missing: a missing report (seen once, from NVRTC
    under concurrent compiles) must not stop a kernel that compiled from being used."""
    try:
        return parse_resources(log, entry)
    except ValueError:
        warnings.warn(f"flexgen: no ptxas resource report for {entry}; registers and spills unknown", stacklevel=3)
        return {"report_missing": True}


def describe(spec, flags, be, log: str, seconds: float) -> dict:
    """meta.json of a compiled kernel (store adds the key and the checksums)."""
    from ..dsl.printer import pretty

    return {
        "flexgen_version": __version__,
        "spec": spec.describe(),
        "variant": {
            "score_mod": pretty(spec.score_expr, 2000) if spec.score_expr is not None else None,
            "mask_mod": pretty(spec.mask_expr, 2000) if spec.mask_expr is not None else None,
        },
        "entry": spec.entry_name,
        "compiler": {"name": be.NAME, "version": be.version(), "flags": list(flags)},
        "compile_seconds": round(seconds, 4),
        "resources": _resources_or_note(log, spec.entry_name),
        "compiler_log": log,
        "created_unix": time.time(),  # informational only; never used for invalidation
    }


def install(spec, key, source, flags, be, cubin: bytes, log: str, seconds: float) -> store.Entry:
    """Write a kernel compiled elsewhere (by `flexgen build`) into the cache."""
    return store.write(spec.arch, key, source, cubin, describe(spec, flags, be, log, seconds))
