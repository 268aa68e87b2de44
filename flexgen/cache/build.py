"""Ahead-of-time builds: `flexgen build VARIANTS.py --arch sm_80,sm_90a -j N`.

VARIANTS.py is plain Python, in one of two forms:

    # 1. a list of variants; every key but score_mod/mask_mod/kinds/head_dim(s)/dtype(s)/name
    #    is a kernel option (BLOCK_N=32 or block_n=32, BLOCK_M1=64 for the backward, grad_buffers=("bias",),
    #    precise_math=True, ...): the names `flexgen emit --set` takes
    VARIANTS = [
        dict(name="alibi", score_mod=alibi, mask_mod=causal, head_dim=128, dtype="bf16", kinds=("fwd", "bwd")),
        dict(mask_mod="q_idx >= kv_idx", head_dims=(64, 128), dtypes=("bf16", "fp16")),
    ]

    # 2. or module-level `score_mod` and/or `mask_mod` (plus optional HEAD_DIMS, DTYPES, KINDS)

score_mod / mask_mod may be Mods, IR Nodes, Python functions or DSL text. A variant whose
kinds include "bwd" also gets the backward's pre- and post-processing kernels, so a cache
built ahead of time serves a training step with FLEXGEN_NO_JIT=1. Every variant is compiled
for every arch, all in parallel through ONE build.ninja, and installed into the same cache
(same keys) that JIT compilation uses.
"""
from __future__ import annotations

import itertools
import json
import os
import runpy
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from . import jit, ninja, nvcc, paths, store
from .lock import FileLock

# The keys of a variant that are not kernel options.
_VARIANT_KEYS = ("name", "score_mod", "mask_mod", "kinds", "head_dim", "head_dims", "dtype", "dtypes", "BLOCK_SIZE")


class BuildFileError(ValueError):
    """A variants file that does not run, or does not describe variants."""


def _is_decorator(obj) -> bool:
    """`from flexgen import score_mod` at module level is the tracer, not a variant."""
    return getattr(obj, "__module__", "") == "flexgen.dsl.api"


def _run_file(path: Path) -> dict:
    from ..dsl.errors import FlexgenTraceError

    if not path.is_file():
        raise BuildFileError(f"{path}: no such file")
    try:
        return runpy.run_path(str(path), run_name="flexgen_variants")
    except FlexgenTraceError:
        raise  # already says where in the user's code
    except Exception as err:
        line = getattr(err, "lineno", None) if isinstance(err, SyntaxError) else None
        for frame in traceback.extract_tb(err.__traceback__):
            if Path(frame.filename) == path:
                line = frame.lineno
        where = f"{path}, line {line}" if line else str(path)
        raise BuildFileError(f"{where}: {type(err).__name__}: {err}") from err


def load_variants(path: str | Path) -> list[dict]:
    path = Path(path)
    ns = _run_file(path)
    if "VARIANTS" in ns:
        listed = ns["VARIANTS"]
        if not isinstance(listed, (list, tuple)) or not all(isinstance(v, dict) for v in listed) or not listed:
            raise BuildFileError(f"{path}: VARIANTS must be a non-empty list of dicts, one per variant, "
                                 f"got {type(listed).__name__}")
        variants = [dict(v) for v in listed]
    else:
        score = ns.get("score_mod") if not _is_decorator(ns.get("score_mod")) else None
        mask = ns.get("mask_mod") if not _is_decorator(ns.get("mask_mod")) else None
        if score is None and mask is None:
            raise BuildFileError(f"{path} defines neither VARIANTS nor a module-level score_mod / mask_mod")
        variants = [dict(score_mod=score, mask_mod=mask, head_dims=ns.get("HEAD_DIMS", (128,)),
                         dtypes=ns.get("DTYPES", ("bf16",)), kinds=ns.get("KINDS", ("fwd",)), name=path.stem)]
    for i, v in enumerate(variants):
        v.setdefault("name", f"variant{i}")
    return variants


def _block_size(value) -> tuple[int, int]:
    """A variant's BLOCK_SIZE: the block mask's blocks it runs with (create_block_mask's default 128)."""
    from ..blockmask_validate import KERNEL_BLOCK_MULTIPLE, block_size

    return block_size(value, "a build file's BLOCK_SIZE", KERNEL_BLOCK_MULTIPLE)


def _tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def expand(variant: dict, archs: list[str], templates_take_others: bool = False) -> list:
    """Every KernelSpec of one variant: kinds x head dims x dtypes x archs, and for a backward
    its pre- and post-processing kernels (one pair per head dim, dtype and arch), for a forward with split_kv
    its merge."""
    from ..codegen.api import make_spec
    from ..codegen.options import spec_options
    from ..codegen.spec import with_dq_layout

    v = dict(variant)
    score, mask = v.get("score_mod"), v.get("mask_mod")
    kinds = _tuple(v.get("kinds", ("fwd",)))
    head_dims = _tuple(v.get("head_dims") or v.get("head_dim", 128))
    dtypes = _tuple(v.get("dtypes") or v.get("dtype", "bf16"))
    mask_block = _block_size(v["BLOCK_SIZE"]) if "BLOCK_SIZE" in v else (128, 128) if mask is not None else None
    options = {k: value for k, value in v.items() if k not in _VARIANT_KEYS}
    specs = []
    for arch, kind, d, dt in itertools.product(archs, kinds, head_dims, dtypes):
        chosen = spec_options(options, kind, kinds, templates_take_others)
        specs.append(make_spec(kind, score, mask, d, dt, arch, mask_block=mask_block if kind in ("fwd", "bwd") else None,
                               **chosen))
        if kind == "bwd":  # planned as flex_attention's backward plans them
            specs += [with_dq_layout(specs[-1], make_spec(k, None, None, d, dt, arch))
                      for k in ("bwd_preprocess", "bwd_postprocess")]
        elif kind == "fwd" and specs[-1].option("split_kv"):  # (split_kv=True: decoding calls' forward and merge)
            specs.append(make_spec("fwd_combine", None, None, d, dt, arch))
    return specs


@dataclass
class BuildResult:
    built: list = field(default_factory=list)  # (spec, key)
    cached: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (spec, key, FlexgenCompileError)

    @property
    def ok(self) -> bool:
        return not self.failed


def build(variants_file: str | Path, archs: list[str], jobs: int | None = None, compiler: str | None = None,
          template_dir: str | Path | None = None, log=print, progress=None) -> BuildResult:
    """Compile what the cache lacks. `progress(done, total, what)` is told as kernels finish
    (terminal_progress() draws a bar)."""
    be = jit.backend(compiler)
    variants = load_variants(variants_file)
    specs = list(dict.fromkeys(s for v in variants for s in expand(v, archs, template_dir is not None)))
    result = BuildResult()
    todo: dict[str, tuple] = {}  # key -> (spec, source, flags); specs with the same source share a key
    for spec in specs:
        source, flags, key = jit.plan(spec, template_dir, be)
        if key in todo:
            continue
        if store.load(spec.arch, key) is not None:
            result.cached.append((spec, key))
        else:
            todo[key] = (spec, source, flags)
    log(f"flexgen build: {len(specs)} kernel(s), {len(result.cached)} already cached, {len(todo)} to compile "
        f"with {be.NAME} ({be.version()})")
    if todo:
        with tempfile.TemporaryDirectory(prefix="flexgen-build-") as tmp:
            _run(Path(tmp), todo, jobs, be, result, progress)
    for spec, key, err in result.failed:
        log(f"FAILED: {err}")
    log(f"flexgen build: built {len(result.built)}, cached {len(result.cached)}, failed {len(result.failed)}; "
        f"cache: {paths.version_dir()}")
    return result


def terminal_progress(stream=None):
    """A one-line progress bar on `stream` (stderr) where it is a terminal; None elsewhere, so logs
    and pipes get only build()'s summary lines."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, what: str) -> None:
        filled = 24 * done // max(total, 1)
        end = "\n" if done == total else ""
        stream.write(f"\r\x1b[K[{'#' * filled}{'.' * (24 - filled)}] {done}/{total} {what}"[:160] + end)
        stream.flush()

    return show


def _run(stage: Path, todo: dict, jobs, be, result: BuildResult, progress=None) -> None:
    edges = [_edge(stage, spec, source, flags, key, be) for key, (spec, source, flags) in todo.items()]
    ninja.write(stage / "build.ninja", edges)
    proc = ninja.run(stage / "build.ninja", jobs=jobs, on_progress=progress)
    for key, (spec, source, flags) in todo.items():
        cubin_file, log_file = stage / f"{key}.cubin", stage / f"{key}.log"
        if not cubin_file.exists():
            if log_file.exists():
                text = log_file.read_text()
            else:  # the step never ran (or died before writing its log): show what ninja said
                text = f"(no compiler log; ninja exited with {proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            result.failed.append((spec, key, jit.compile_error(spec, key, source, text, be)))
            continue
        text = log_file.read_text() if log_file.exists() else ""
        timing = stage / f"{key}.cubin.time"
        seconds = float(timing.read_text()) if timing.exists() else 0.0
        with FileLock(paths.lock_path(spec.arch, key)):
            if store.load(spec.arch, key) is None:  # a JIT in another process may have won
                jit.install(spec, key, source, flags, be, cubin_file.read_bytes(), text, seconds)
        result.built.append((spec, key))


def _edge(stage: Path, spec, source: str, flags: list[str], key: str, be) -> ninja.Edge:
    src = stage / f"{key}.cu"
    src.write_text(source)
    cubin, log = stage / f"{key}.cubin", stage / f"{key}.log"
    desc = f"{be.NAME} {spec.kind} d={spec.head_dim} {spec.dtype} {spec.arch} {key[:12]}"
    if be is nvcc:
        return ninja.Edge(str(cubin), nvcc.command(src, cubin, flags), str(log), (str(src),), desc)
    job = stage / f"{key}.json"
    job.write_text(json.dumps({"source": str(src), "cubin": str(cubin), "log": str(log), "flags": flags,
                               "name": f"{spec.entry_name}.cu"}))
    # The job's log is written by the worker itself; the rule's redirect keeps the worker's own output.
    pythonpath = os.pathsep.join(filter(None, [str(paths.PACKAGE_DIR.parent), os.environ.get("PYTHONPATH")]))
    command = ["env", f"PYTHONPATH={pythonpath}", sys.executable, "-m", "flexgen.cache.nvrtc", str(job)]
    return ninja.Edge(str(cubin), command, str(stage / f"{key}.out"), (str(job), str(src)), desc)
