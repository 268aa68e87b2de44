#!/usr/bin/env python3
"""Decoding-shaped calls (a few query rows, up to a prefill chunk, against a long key/value cache), flexgen
beside compiled FlexAttention (which switches to its split-KV decoding kernel below 128 query rows), SDPA and
FlashAttention-4 (where it imports), on the same inputs in one process; flexgen also with split_kv=False (its usual
forward).

    python3 benchmarks/bench_decode.py [--cases B:HQ:HKV:LQ:LKV:D,...] [--rep 100] [--impls flexgen,sdpa-flash,...]

Such calls are bound by memory, so besides the kernel time (median of triton's do_bench) the table gives the
bandwidth that time implies: the bytes of Q, K, V and O read or written once, over the time, and for flexgen each
kernel's device time (torch.profiler). Every output is checked against a float32 reference first (max |diff|
printed).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

DEFAULT_CASES = ("1:32:8:1:32768:128,8:32:8:1:8192:128,32:32:8:1:4096:128,1:32:32:1:32768:128,"
                 "4:32:8:4:16384:128,4:32:8:16:16384:128,1:32:8:32:16384:128,1:16:16:128:32768:128,"
                 "2:32:4:64:8192:128,4:32:4:64:8192:128,1:16:16:16:65536:64")


def parse_cases(text: str) -> list[tuple[int, ...]]:
    cases = []
    for item in text.split(","):
        parts = tuple(int(x) for x in item.split(":"))
        if len(parts) != 6:
            raise SystemExit(f"bench_decode: a case is B:HQ:HKV:LQ:LKV:D, got {item!r}")
        cases.append(parts)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    parser.add_argument("--impls", default="", help="comma-separated names to run (default: all)")
    args = parser.parse_args()
    only = {name for name in args.impls.split(",") if name}

    import triton.testing
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    import flexgen

    compiled_flex = torch.compile(torch_flex, dynamic=False)
    try:  # FlashAttention-4 where benchmarks/fa4_setup.sh installed it
        from flash_attn.cute.interface import flash_attn_func as fa4
    except Exception:
        fa4 = None
    # FA4's split-key heuristic (num_splits=0) where it has one: it refuses split keys on sm_90 ("SplitKV not
    # supported on SM 9.0"), so there it runs one part per query tile.
    fa4_splits = 0 if torch.cuda.get_device_capability()[0] >= 10 else 1
    rows = []
    for b, hq, hkv, lq, lkv, d in parse_cases(args.cases):
        torch.manual_seed(0)
        q = torch.randn(b, hq, lq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, hkv, lkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        gqa = hq != hkv
        kr, vr = (t.float().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
        ref = torch.softmax(q.float() @ kr.transpose(-1, -2) / d ** 0.5, dim=-1) @ vr
        impls = {
            "flexgen": lambda: flexgen.flex_attention(q, k, v, enable_gqa=gqa),
            "flexgen-unsplit": lambda: flexgen.flex_attention(q, k, v, enable_gqa=gqa,
                                                              kernel_options={"split_kv": False}),
            "flex": lambda: compiled_flex(q, k, v, enable_gqa=gqa),
            "sdpa-flash": lambda: _sdpa(F, sdpa_kernel, SDPBackend.FLASH_ATTENTION, q, k, v, gqa),
            "sdpa-cudnn": lambda: _sdpa(F, sdpa_kernel, SDPBackend.CUDNN_ATTENTION, q, k, v, gqa),
            "sdpa-efficient": lambda: _sdpa(F, sdpa_kernel, SDPBackend.EFFICIENT_ATTENTION, q, k, v, gqa),
        }
        if fa4 is not None:  # (B, L, H, D) copies made once, outside the timing
            qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
            impls["fa4"] = lambda: fa4(qt, kt, vt, num_splits=fa4_splits)[0].transpose(1, 2)
        moved = (q.numel() * 2 + k.numel() + v.numel()) * 2  # Q read, O written, K and V read (bf16)
        for name, fn in impls.items():
            if only and name not in only:
                continue
            try:
                out = fn()
                err = (out.float() - ref).abs().max().item()
                ms = triton.testing.do_bench(fn, warmup=25, rep=args.rep)
                rows.append((b, hq, hkv, lq, lkv, d, name, ms * 1e3, moved / (ms * 1e-3) / 1e9, err,
                             kernel_times(fn) if name.startswith("flexgen") else ""))
            except Exception as e:  # a peer without this shape is recorded, not fatal
                rows.append((b, hq, hkv, lq, lkv, d, name, float("nan"), float("nan"), f"{type(e).__name__}: {e}"[:80],
                             ""))
    print("| B | HQ | HKV | LQ | LKV | D | impl | us | GB/s | max abs err | flexgen's kernels, us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        err = r[9] if isinstance(r[9], str) else f"{r[9]:.2e}"
        print(f"| {' | '.join(str(x) for x in r[:7])} | {r[7]:.1f} | {r[8]:.0f} | {err} | {r[10]} |")


def kernel_times(fn, calls: int = 10) -> str:
    """Each kernel's mean device time per call under torch.profiler (the split forward and its merge apart), so
    that a call's time beyond its kernels (launch gaps, the host path) shows beside do_bench's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / calls
    return " + ".join(f"{name} {t:.1f}" for name, t in times.items())


def _sdpa(F, sdpa_kernel, backend, q, k, v, gqa):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


if __name__ == "__main__":
    main()
