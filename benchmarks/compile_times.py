"""Compile-time and cache-lookup benchmark.

    python benchmarks/compile_times.py [--arch sm_80] [--kinds fwd,bwd] [--variants alibi,softcap] [--head-dim 128]

Measures, in a scratch cache folder:
  cold    render + NVRTC compile of each built-in variant's kernels (target: fwd < 5 s on 2 cores)
  disk    first lookup in a fresh process whose imports are done (target: < 20 ms); reported with and
          without the one-time NVRTC library load (the cache key names the NVRTC version)
  hot     in-process lookup of an already loaded kernel (target: < 20 us), by spec and via flexgen.compile
"""
from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def builtin_variants() -> dict:
    """name -> (score Mod | None, mask Mod | None), from flexgen.variants when it is there."""
    import torch

    from flexgen.dsl import api

    causal = api.mask_mod("q_idx >= kv_idx", name="causal")
    out = {"causal": (None, causal)}
    try:
        from flexgen.dsl import variants as v
    except ImportError:
        return out
    out.update({
        "sliding_window": (None, v.sliding_window(256)),
        "prefix_lm": (None, v.prefix_lm(128)),
        "document": (None, v.document(torch.zeros(1024, dtype=torch.int32))),
        "alibi": (v.alibi(16), causal),
        "softcap": (v.softcap(30.0), causal),
        "relative_bias": (v.relative_bias(torch.zeros(16, 255)), causal),
    })
    return out


def _fresh_process_lookup(spec_file: str) -> dict:
    """Child: import everything, then time the first lookup (disk) of the pickled spec."""
    import torch  # noqa: F401  (a process that runs attention has these imported already;
    import flexgen.codegen.api  # noqa: F401   imports are not what we measure)
    import flexgen.dsl.derivative  # noqa: F401
    from flexgen.cache import jit, nvrtc
    from flexgen.codegen import render  # noqa: F401

    with open(spec_file, "rb") as f:
        spec = pickle.load(f)
    t0 = time.perf_counter()
    nvrtc.version()  # loads NVRTC (and cupy) once per process
    t1 = time.perf_counter()
    kernel = jit.get_kernel(spec)
    t2 = time.perf_counter()
    assert kernel.cubin
    return {"nvrtc_load_ms": (t1 - t0) * 1e3, "disk_hit_ms": (t2 - t1) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_80")
    ap.add_argument("--kinds", default="fwd,bwd")
    ap.add_argument("--variants", default=None, help="comma list (default: all built-in variants)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(repr(_fresh_process_lookup(args.child)))
        return

    cache = tempfile.mkdtemp(prefix="flexgen-bench-cache-")
    os.environ["FLEXGEN_CACHE_DIR"] = cache
    from flexgen.cache import jit
    from flexgen.cache.errors import FlexgenCompileError
    from flexgen.codegen.api import compile as flexgen_compile
    from flexgen.codegen.api import compile_spec, make_spec
    from flexgen.codegen.render import available_templates

    variants = builtin_variants()
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}
    have = {t.split("/")[1].removesuffix(".cu.j2") for t in available_templates()}
    kinds = [k for k in args.kinds.split(",") if k in have]
    print(f"cores: {os.cpu_count()}, arch {args.arch}, head_dim {args.head_dim}, cache {cache}")
    print(f"{'variant':16} {'kind':5} {'cold compile s':>15} {'regs':>5} {'spill B':>8} {'fresh-process disk hit ms':>26}")
    for name, (score, mask) in variants.items():
        for kind in kinds:
            spec = make_spec(kind, score, mask, head_dim=args.head_dim, arch=args.arch)
            t0 = time.perf_counter()
            try:
                kernel = compile_spec(spec)
            except (FlexgenCompileError, ImportError, ValueError) as e:
                print(f"{name:16} {kind:5} failed: {str(e).splitlines()[0][:80]}")
                continue
            cold = time.perf_counter() - t0
            res = kernel.resources
            with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
                pickle.dump(spec, f)
            env = dict(os.environ, PYTHONPATH=str(REPO))
            out = subprocess.run([sys.executable, __file__, "--child", f.name], capture_output=True, text=True, env=env)
            os.unlink(f.name)
            child = eval(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"disk_hit_ms": float("nan"), "nvrtc_load_ms": float("nan")}
            print(f"{name:16} {kind:5} {cold:15.2f} {res['registers']:5d} {res['spill_stores_bytes']:8d} "
                  f"{child['disk_hit_ms']:10.1f} (+{child['nvrtc_load_ms']:.0f} NVRTC load)")

    # hot lookups of the last kernel
    score, mask = next(iter(variants.values()))
    spec = make_spec("fwd", score, mask, head_dim=args.head_dim, arch=args.arch)
    compile_spec(spec)
    n = 100_000
    t0 = time.perf_counter()
    for _ in range(n):
        compile_spec(spec)
    by_spec = (time.perf_counter() - t0) / n * 1e6
    flexgen_compile("fwd", score, mask, head_dim=args.head_dim, arch=args.arch)
    t0 = time.perf_counter()
    for _ in range(n // 10):
        flexgen_compile("fwd", score, mask, head_dim=args.head_dim, arch=args.arch)
    by_args = (time.perf_counter() - t0) / (n // 10) * 1e6
    print(f"hot lookup: {by_spec:.2f} us by spec (compile_spec), {by_args:.2f} us via flexgen.compile(...)")
    jit.clear_memory()


if __name__ == "__main__":
    main()
