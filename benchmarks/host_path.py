#!/usr/bin/env python3
"""The Python work per attention call, on a GPU: wall time per call for a call so small that the kernels
finish long before the host issues the next one, so the host path is what is timed.

    python3 benchmarks/host_path.py [--calls 2000] [--impls flexgen,flex,sdpa] [--profile]

For flexgen (forward alone, forward + backward; a decoding step), compiled FlexAttention and SDPA: the median over five
batches of `--calls` back-to-back calls of wall time per call (one synchronize per batch), and beside it
the GPU time of the same calls (CUDA events around the batch), so a figure that is host-bound shows as
wall >> GPU; then the latency of one call issued to an idle GPU (the median host time of `--calls` calls, each after
a synchronize), which no queue of earlier launches can lengthen. `--profile` prints cProfile's top entries for
flexgen's forward and for its forward + backward. FLEXGEN_TREE=DIR times the flexgen package under DIR (as
bench_attention.py does): hosts differ by a third from process to process, so an A/B of two trees alternates
processes and compares each tree's figures with SDPA's in the same process.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import flexgen_tree  # noqa: E402  (benchmarks/ is the script's own directory)

TREE = flexgen_tree.select("host_path")

import torch  # noqa: E402


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(median wall us per call, median GPU us per call) over five batches of `calls` calls."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    walls, gpus = [], []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / calls * 1e6)
        gpus.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(walls), statistics.median(gpus)


def latency_us(fn, calls: int) -> float:
    """Median host time of one call issued to an idle GPU (a synchronize before each)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--impls", default="flexgen,flex,sdpa",
                        help="comma-separated, of flexgen, flex (compiled FlexAttention), sdpa")
    args = parser.parse_args()

    import flexgen
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    b, h, n, d = 1, 2, 256, 64
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = flexgen.create_block_mask(causal, None, None, n, n, device="cuda")
    theirs = torch_block_mask(causal, None, None, n, n, device="cuda")
    compiled = torch.compile(torch_flex, dynamic=False)
    grad = torch.randn_like(q)

    def flexgen_fwd():
        with torch.no_grad():
            flexgen.flex_attention(q, k, v, block_mask=ours)

    def flexgen_step():
        qg.grad = kg.grad = vg.grad = None
        flexgen.flex_attention(qg, kg, vg, block_mask=ours).backward(grad)

    def flex_fwd():
        with torch.no_grad():
            compiled(q, k, v, block_mask=theirs)

    def flex_step():
        qg.grad = kg.grad = vg.grad = None
        compiled(qg, kg, vg, block_mask=theirs).backward(grad)

    def sdpa_fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    # A decoding step (one row per query head, GQA, a 4k cache): the split-key forward and its merge, two launches.
    qd = torch.randn(b, 8, 1, d, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(b, 2, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def flexgen_decode():
        with torch.no_grad():
            flexgen.flex_attention(qd, kd, vd, enable_gqa=True)

    def sdpa_decode():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)

    def sdpa_step():
        qg.grad = kg.grad = vg.grad = None
        torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(grad)

    print(f"host path on {torch.cuda.get_device_name()} (torch {torch.__version__}); B={b} H={h} N={n} D={d} "
          f"bf16 causal; us per call, wall / GPU, then the latency of one call on an idle GPU; flexgen from {TREE}")
    impls = args.impls.split(",")
    for name, fwd, step in (("flexgen", flexgen_fwd, flexgen_step), ("flex (compiled)", flex_fwd, flex_step),
                            ("sdpa", sdpa_fwd, sdpa_step)):
        if name.split()[0] not in impls:
            continue
        fw, fg = per_call_us(fwd, args.calls)
        sw, sg = per_call_us(step, max(args.calls // 4, 50))
        fl, sl = latency_us(fwd, args.calls), latency_us(step, max(args.calls // 4, 50))
        print(f"  {name:16s} forward {fw:7.1f} / {fg:6.1f}    forward+backward {sw:7.1f} / {sg:6.1f}    "
              f"latency {fl:6.1f} / {sl:6.1f}")
    print("decoding step (B=1, 8 query heads, 2 KV heads, 1 row, 4096 keys); us per call, wall / GPU")
    for name, fn in (("flexgen", flexgen_decode), ("sdpa", sdpa_decode)):
        wall, gpu = per_call_us(fn, args.calls)
        print(f"  {name:16s} forward {wall:7.1f} / {gpu:6.1f}")

    if args.profile:
        profiled = (("forward", flexgen_fwd, args.calls), ("forward+backward", flexgen_step, args.calls // 4),
                    ("decoding forward", flexgen_decode, args.calls))
        for name, fn, calls in profiled:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                fn()
            profiler.disable()
            torch.cuda.synchronize()
            print(f"== cProfile of flexgen's {name}, {calls} calls")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
