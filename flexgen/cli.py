"""Command line: `flexgen emit | compile | build | cache ...` (also `python -m flexgen`)."""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path


def _options(pairs: list[str] | None) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set and --param expect NAME=VALUE, got {pair!r}")
        try:
            out[key.replace("-", "_")] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key.replace("-", "_")] = value
    return out


def _variant_args(args) -> dict:
    """score_mod / mask_mod (and variant options) from --file and/or --score / --mask."""
    variant: dict = {}
    if args.file:
        from .cache.build import load_variants

        variants = load_variants(args.file)
        if args.variant is not None:
            chosen = [v for v in variants if v["name"] == args.variant]
            if not chosen:
                raise ValueError(f"{args.file} has no variant named {args.variant!r}; it has {[v['name'] for v in variants]}")
            variant = dict(chosen[0])
        else:
            variant = dict(variants[0])
        for k in ("kinds", "head_dims", "dtypes", "name", "head_dim", "dtype"):
            variant.pop(k, None)
    params = _options(args.param)
    if args.score or args.mask:
        from .dsl import api as dsl_api  # text needs its scalar names bound to know they are parameters

        def used_by(text: str) -> dict:  # each text gets only the names it mentions
            return {k: v for k, v in params.items() if re.search(rf"\b{re.escape(k)}\b", text)}

        if args.score:
            variant["score_mod"] = dsl_api.score_mod(args.score, **used_by(args.score))
        if args.mask:
            variant["mask_mod"] = dsl_api.mask_mod(args.mask, **used_by(args.mask))
    variant.update(_options(args.set))
    from .codegen.options import spec_options

    mods = {k: variant.pop(k) for k in ("score_mod", "mask_mod") if k in variant}
    return {**mods, **spec_options(variant, args.kind, templates_take_others=bool(args.template_dir))}


def _add_variant_arguments(p: argparse.ArgumentParser, arch_default) -> None:
    p.add_argument("--score", help="score_mod in the DSL's text form, e.g. \"score + (q_idx - kv_idx) * 0.1\"")
    p.add_argument("--mask", help="mask_mod in the DSL's text form, e.g. \"q_idx >= kv_idx\"")
    p.add_argument("--file", help="a .py file defining score_mod / mask_mod (or VARIANTS)")
    p.add_argument("--variant", help="name of the VARIANTS entry to use from --file (default: the first)")
    p.add_argument("--kind", default="fwd", help="kernel kind (fwd, bwd, ...)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--arch", default=arch_default, help="target, e.g. sm_80 or sm_90a")
    p.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="bind a scalar used by --score/--mask text, e.g. cap=30.0 (becomes a kernel argument)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="kernel option, e.g. BLOCK_N=32 (or block_n=32), num_warps=8, family=sm80, fast_math=True; "
                        "with --template-dir, other names reach the templates")
    p.add_argument("--template-dir", help="extra template folder searched first")


def cmd_emit(args) -> int:
    from .codegen.api import emit

    text = emit(args.kind, head_dim=args.head_dim, dtype=args.dtype, arch=args.arch,
                template_dir=args.template_dir, **_variant_args(args))
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({len(text.splitlines())} lines)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_compile(args) -> int:
    from .codegen.api import compile as compile_kernel

    k = compile_kernel(args.kind, head_dim=args.head_dim, dtype=args.dtype, arch=args.arch,
                       template_dir=args.template_dir, compiler=args.compiler, **_variant_args(args))
    print(json.dumps({"key": k.key, "path": str(k.path), "resources": k.resources,
                      "compile_seconds": k.meta.get("compile_seconds")}, indent=2))
    return 0


def cmd_build(args) -> int:
    from . import arch as archmod
    from .cache.build import build, terminal_progress

    archs = [archmod.normalize(a) for a in args.arch.split(",")] if args.arch else archmod.targets()
    result = build(args.variants, archs, jobs=args.jobs, compiler=args.compiler, template_dir=args.template_dir,
                   progress=terminal_progress())
    return 0 if result.ok else 1


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_cache(args) -> int:
    from .cache import paths, store

    if args.action == "ls":
        rows = store.entries(args.arch)
        for e in rows:
            s = (e.meta or {}).get("spec", {})
            what = (f"{s.get('kind')} d={s.get('head_dim')} {s.get('dtype')} score={s.get('score_mod') or 'identity'} "
                    f"mask={s.get('mask_mod') or 'none'}") if e.meta else "(incomplete)"
            compiler = ((e.meta or {}).get("compiler") or {}).get("name", "?")
            print(f"{e.key[:16]}  {e.version:8} {e.arch:7} {compiler:6} {_size(e.size):>9}  {what}")
        print(f"{len(rows)} kernel(s), {_size(sum(e.size for e in rows))} in entries; "
              f"cache {paths.cache_root()} totals {_size(store.total_size())}")
    elif args.action == "info":
        if not args.key:
            raise ValueError("cache info needs a KEY (or a unique prefix of one)")
        found = store.find(args.key)
        if len(found) != 1:
            raise LookupError(f"{len(found)} entries match {args.key!r}" + (": be more specific" if found else ""))
        e = found[0]
        meta = dict(e.meta or {})
        meta.pop("compiler_log", None)
        print(json.dumps({"path": str(e.path), "size_bytes": e.size, **meta}, indent=2, sort_keys=True))
    elif args.action == "clear":
        from .cache.errors import NotAFlexgenCacheError

        try:
            done = store.clear(args.arch)
        except NotAFlexgenCacheError as err:
            print(f"flexgen: {err}", file=sys.stderr)
            return 2
        print(f"removed {done.entries} kernel(s), {_size(done.bytes)}" + (f" for {args.arch}" if args.arch else ""))
        for kept in done.kept:
            print(f"kept {kept}", file=sys.stderr)
    elif args.action == "size":
        print(f"{_size(store.total_size())}  {paths.cache_root()}")
    elif args.action == "path":
        print(paths.cache_root())
    return 0


def parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="flexgen", description="Generate, compile and cache FlashAttention variants.")
    p.add_argument("--version", action="version", version=f"flexgen {__version__}")
    p.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("emit", help="print the CUDA source of one kernel")
    _add_variant_arguments(e, "sm_90a")
    e.add_argument("-o", "--output", help="write to this file instead of stdout")
    e.set_defaults(func=cmd_emit)

    c = sub.add_parser("compile", help="compile one kernel into the cache; print its key and resources")
    _add_variant_arguments(c, None)
    c.add_argument("--compiler", choices=["nvrtc", "nvcc"])
    c.set_defaults(func=cmd_compile)

    b = sub.add_parser("build", help="ahead-of-time compile every variant of a VARIANTS.py for every arch")
    b.add_argument("variants", help="VARIANTS.py (see flexgen.cache.build for the format)")
    b.add_argument("--arch", help="comma list, e.g. sm_80,sm_90a (default: FLEXGEN_ARCH_LIST or this GPU)")
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's choice)")
    b.add_argument("--compiler", choices=["nvrtc", "nvcc"])
    b.add_argument("--template-dir")
    b.set_defaults(func=cmd_build)

    k = sub.add_parser("cache", help="inspect or clear the kernel cache")
    k.add_argument("action", choices=["ls", "info", "clear", "size", "path"])
    k.add_argument("key", nargs="?", help="for info: a key or unique prefix")
    k.add_argument("--arch", help="for ls / clear: only this architecture")
    k.set_defaults(func=cmd_cache)
    return p


# Exit status 2: what was asked cannot be done as written (a DSL error, an unsupported head dim,
# an unknown option, a bad file); 1: a compile failed or nothing can compile (no NVRTC, FLEXGEN_NO_JIT).
USAGE, FAILED = 2, 1


def _status(err: BaseException) -> int | None:
    """The exit status for an error flexgen reports as a message, None for an internal error."""
    from .arch import UnsupportedArchError
    from .cache.errors import CompilerUnavailableError, FlexgenCompileError, KernelNotCachedError
    from .dsl.errors import FlexgenTraceError

    if isinstance(err, (FlexgenCompileError, KernelNotCachedError, CompilerUnavailableError)):
        return FAILED
    if isinstance(err, (FlexgenTraceError, UnsupportedArchError, ValueError, TypeError, LookupError, OSError)):
        return USAGE
    return None


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # a message, not a traceback (unless --debug)
        if args.debug:
            raise
        status = _status(err)
        if status is None:
            print(f"flexgen: internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
                  file=sys.stderr)
            return FAILED
        print(f"flexgen: {err}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
