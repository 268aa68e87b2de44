"""Ahead-of-time builds: `flexgen build VARIANTS.py --arch sm_80,sm_90a -j N`.

VARIANTS.py is plain Python, in one of two forms:

    # 1. a list of variants; every key but score_mod/mask_mod/kinds/head_dim(s)/dtype(s)/name
    #    is a make_spec option (block_n=32, grad_buffers=("bias",), fast_math=True, ...)
    VARIANTS = [
        dict(name="alibi", score_mod=alibi, mask_mod=causal, head_dim=128, dtype="bf16", kinds=("fwd", "bwd")),
        dict(mask_mod="q_idx >= kv_idx", head_dims=(64, 128), dtypes=("bf16", "fp16")),
    ]

    # 2. or module-level `score_mod` and/or `mask_mod` (plus optional HEAD_DIMS, DTYPES, KINDS)

score_mod / mask_mod may be Mods, IR Nodes, Python functions or DSL text. Every
variant is compiled for every arch, all in parallel through ONE build.ninja, and
installed into the same cache (same keys) that JIT compilation uses.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import jit, ninja, nvcc, paths, store
from .lock import FileLock

def _is_decorator(obj) -> bool:
    """`from flexgen import score_mod` at module level is the tracer, not a variant."""
    return getattr(obj, "__module__", "") == "flexgen.dsl.api"


def load_variants(path: str | Path) -> list[dict]:
    ns = runpy.run_path(str(path), run_name="flexgen_variants")
    if "VARIANTS" in ns:
        variants = [dict(v) for v in ns["VARIANTS"]]
    else:
        score = ns.get("score_mod") if not _is_decorator(ns.get("score_mod")) else None
        mask = ns.get("mask_mod") if not _is_decorator(ns.get("mask_mod")) else None
        if score is None and mask is None:
            raise ValueError(f"{path} defines neither VARIANTS nor a module-level score_mod / mask_mod")
        variants = [dict(score_mod=score, mask_mod=mask, head_dims=ns.get("HEAD_DIMS", (128,)),
                         dtypes=ns.get("DTYPES", ("bf16",)), kinds=ns.get("KINDS", ("fwd",)), name=Path(path).stem)]
    for i, v in enumerate(variants):
        v.setdefault("name", f"variant{i}")
    return variants


def _tuple(v) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def expand(variant: dict, archs: list[str]) -> list:
    """Every KernelSpec of one variant: kinds x head dims x dtypes x archs."""
    from ..codegen.api import make_spec

    v = dict(variant)
    score, mask = v.pop("score_mod", None), v.pop("mask_mod", None)
    kinds = _tuple(v.pop("kinds", ("fwd",)))
    head_dims = _tuple(v.pop("head_dims", None) or v.pop("head_dim", 128))
    v.pop("head_dim", None)
    dtypes = _tuple(v.pop("dtypes", None) or v.pop("dtype", "bf16"))
    v.pop("dtype", None)
    v.pop("name", None)
    return [make_spec(kind, score, mask, d, dt, arch, **dict(v))
            for arch in archs for kind in kinds for d in head_dims for dt in dtypes]


@dataclass
class BuildResult:
    built: list = field(default_factory=list)  # (spec, key)
    cached: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # (spec, key, FlexgenCompileError)

    @property
    def ok(self) -> bool:
        return not self.failed


def build(variants_file: str | Path, archs: list[str], jobs: int | None = None, compiler: str | None = None,
          template_dir: str | Path | None = None, log=print) -> BuildResult:
    be = jit.backend(compiler)
    specs = list(dict.fromkeys(s for v in load_variants(variants_file) for s in expand(v, archs)))
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
            _run(Path(tmp), todo, jobs, be, result)
    for spec, key, err in result.failed:
        log(f"FAILED: {err}")
    log(f"flexgen build: built {len(result.built)}, cached {len(result.cached)}, failed {len(result.failed)}; "
        f"cache: {paths.version_dir()}")
    return result


def _run(stage: Path, todo: dict, jobs, be, result: BuildResult) -> None:
    edges = [_edge(stage, spec, source, flags, key, be) for key, (spec, source, flags) in todo.items()]
    ninja.write(stage / "build.ninja", edges)
    proc = ninja.run(stage / "build.ninja", jobs=jobs)
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
