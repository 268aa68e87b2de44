"""Forward (or forward + backward) time of flexgen and its peers beside the SM clock, board power and throttle reasons.

Run back to back, every attention kernel on the H200 meets the 700 W power cap, and the clock it gets there, not the
boost clock of an idle chip, sets its speed; a do_bench window (the protocol of results.md) starts at boost and
throttles inside, so its figure depends on how much of it ran at boost. This runs each implementation's forward
back to back for a few seconds per phase, alternating the implementations, while `nvidia-smi` samples the GPU; it
prints, per phase, milliseconds per call (CUDA events around the calls), the median clock and power, and MHz x ms
(the kernel's cycles at the clock it actually got, comparable across implementations). `--flush` zeroes a 256 MB
buffer before each call and times the calls alone, as do_bench does; `--bwd` times forward + backward;
`--do-bench MS` runs triton's do_bench (warm-up 25 ms, MS ms of repetitions, as bench_attention.py) after two idle
seconds instead of a phase of `--seconds`, to show the clocks that protocol's short windows get.

    python3 benchmarks/sustained_clock.py --impls flexgen,fa4 --variants full,causal --seconds 3 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attention as ba  # noqa: E402  (the harness's variants and implementations)
from gpu_clock import ClockSampler  # noqa: E402


def run_phase(fn, seconds: float, flush: torch.Tensor | None) -> tuple[float, float, float, int]:
    """(start, end, ms per call, calls): back to back; with `flush`, that buffer zeroed before each call (untimed)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0, total_ms, calls = time.time(), 0.0, 0
    while time.time() - t0 < seconds:
        events = []
        for _ in range(20):  # (then wait, so that the host stays within a few calls of the GPU)
            if flush is not None:
                flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        total_ms += sum(a.elapsed_time(b) for a, b in events)
        calls += len(events)
    return t0, time.time(), total_ms / calls, calls


def run_do_bench(fn, rep_ms: float) -> tuple[float, float, float, int]:
    """(start, end, median ms, 0): bench_attention.py's protocol (do_bench flushes L2 itself) after an idle pause."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    time.sleep(2.0)
    t0 = time.time()
    ms = float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    return t0, time.time(), ms, 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impls", default="flexgen,fa4")
    p.add_argument("--variants", default="full,causal")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--flush", action="store_true", help="zero 256 MB before each call, as do_bench does")
    p.add_argument("--bwd", action="store_true", help="time forward + backward")
    p.add_argument("--do-bench", type=float, default=None, metavar="MS", help="do_bench with this rep time instead")
    args = p.parse_args()
    dev = torch.device("cuda")
    n, d = args.seqlen, args.dim
    batch = max(1, args.tokens // n)
    q, k, v = (torch.randn(batch, args.heads, n, d, device=dev, dtype=torch.bfloat16, requires_grad=args.bwd)
               for _ in range(3))
    dout = torch.randn_like(q)

    def backward(out):
        for t in (q, k, v):
            t.grad = None  # (no accumulation kernel timed, as do_bench's grad_to_none)
        out.backward(dout)
    fns = {}
    for vname in args.variants.split(","):
        variant = ba.build_variant(vname, n, args.heads, dev)
        pairs = ba.count_pairs(variant.mask, n, n, dev) if variant.mask is not None else n * n
        for impl in args.impls.split(","):
            try:
                fn = ba.Impl(impl).setup(variant, q, k, v)
                fn(q, k, v)
            except Exception as e:  # an implementation without this variant
                print(f"{impl} {vname}: skipped ({ba.short(e)})", flush=True)
                continue
            call = (lambda fn=fn: backward(fn(q, k, v))) if args.bwd else (lambda fn=fn: fn(q, k, v))
            fns[(vname, impl)] = (call, (3.5 if args.bwd else 1.0) * 4.0 * batch * args.heads * pairs * d)
    torch.cuda.synchronize()
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device=dev) if args.flush else None
    sampler = ClockSampler()
    time.sleep(1.0)
    phases = []
    try:
        for r in range(args.rounds):
            for (vname, impl), (fn, flops) in fns.items():
                if args.do_bench is not None:
                    t0, t1, ms, calls = run_do_bench(fn, args.do_bench)
                else:
                    t0, t1, ms, calls = run_phase(fn, args.seconds, flush)
                phases.append((r, vname, impl, t0, t1, ms, calls, flops))
                time.sleep(1.0)  # let the clock recover, as between do_bench cases
        print("| round | variant | impl | ms/call | TFLOP/s | SM MHz (median; min-max) | W | MHz x ms | samples | reasons |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r, vname, impl, t0, t1, ms, calls, flops in phases:
            start = t0 if args.do_bench is not None else (t0 + t1) / 2  # (do_bench's window is short: all of it)
            c = sampler.window(start, t1) or {"mhz": float("nan"), "mhz_min": float("nan"), "mhz_max": float("nan"),
                                              "watts": float("nan"), "samples": 0, "reasons": []}
            print(f"| {r} | {vname} | {impl} | {ms:.3f} | {flops / ms / 1e9:.0f} | {c['mhz']:.0f}; "
                  f"{c['mhz_min']:.0f}-{c['mhz_max']:.0f} | {c['watts']:.0f} | {c['mhz'] * ms:.0f} | {c['samples']} | "
                  f"{' '.join(c['reasons'])} |", flush=True)
    finally:
        sampler.close()


if __name__ == "__main__":
    main()
