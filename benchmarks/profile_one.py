"""One flexgen forward + backward, for a profiler to attach to (ncu, nsys, compute-sanitizer).

    ncu --kernel-name regex:flexgen_bwd --launch-skip 1 --launch-count 1 --set detailed \
        python benchmarks/profile_one.py --variant causal --seqlen 4096 --head-dim 128

Runs the pair twice (the first call compiles and warms up), then synchronizes. `--impl fa4` runs FlashAttention-4's
`flash_attn_func` instead (full, causal or sliding<W>; benchmarks/fa4_setup.sh installs it), for profiling it beside
flexgen: its kernels' names come from CuTe DSL (list them with `nsys profile --stats=true` or ncu without a name
filter).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import flexgen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variant", default="full",
                   help="a bench_attention.py variant (full, causal, sliding1024, alibi-causal, alibi-slopes-causal, "
                        "softcap30-causal, document-causal, prefix-lm, ...); 'none' is full")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kernel-options", default=None, help="JSON dict passed to flex_attention")
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--impl", default="flexgen", choices=("flexgen", "fa4"))
    args = p.parse_args()
    if args.impl == "fa4":
        return run_fa4(args)
    opts = json.loads(args.kernel_options) if args.kernel_options else None
    n, d = args.seqlen, args.head_dim
    q, k, v = (torch.randn(args.batch, args.heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    # The benchmark's own variants, so that a profile is of the case results.md reports.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import build_variant

    variant = build_variant("full" if args.variant == "none" else args.variant, n, args.heads, torch.device("cuda"))
    score = variant.score
    bm = None if variant.mask is None else flexgen.create_block_mask(variant.mask, None, None, n, n)
    for _ in range(2):
        out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, kernel_options=opts)
        if not args.fwd_only:
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print("ok", tuple(out.shape))


def fa4_options(variant: str) -> dict:
    """FA4's built-in options for a bench_attention.py variant it takes without a CuTe-DSL mod (as that script
    runs it): full, causal, sliding<W> (causal within a window of W keys)."""
    if variant in ("none", "full"):
        return {"causal": False}
    if variant == "causal":
        return {"causal": True}
    if variant.startswith("sliding") and (variant[len("sliding"):] or "1024").isdigit():
        window = int(variant[len("sliding"):] or 1024)
        return {"causal": True, "window_size": (window - 1, 0)}
    raise SystemExit(f"--impl fa4 runs full, causal or sliding<W> attention, not {variant!r}")


def run_fa4(args) -> None:
    options = fa4_options(args.variant)
    from flash_attn.cute.interface import flash_attn_func

    shape = (args.batch, args.seqlen, args.heads, args.head_dim)  # FA4's layout (B, N, H, D)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for _ in range(2):
        out = flash_attn_func(q, k, v, **options)
        out = out[0] if isinstance(out, tuple) else out
        if not args.fwd_only:
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    print("ok", tuple(out.shape))


if __name__ == "__main__":
    main()
