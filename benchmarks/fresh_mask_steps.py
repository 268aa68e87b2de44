#!/usr/bin/env python3
"""Training steps whose block mask changes at every step (packed documents): wall time per step against the same
steps over a mask made once, so that what a fresh mask costs (its build, and any wait for the GPU on the way) shows
as the difference.

    python3 benchmarks/fresh_mask_steps.py [--layers 8] [--steps 20] [--dims 64,128]

A step builds the mask (flexgen's create_block_mask, or PyTorch's for the PyTorch column), then runs `--layers`
attention layers forward and backward over it (B = 2, H = 16, N = 8192, bf16; the layers share the mask as a
model's do). The steps run back to back with one synchronize after the last, as a training loop that reads its loss
only now and then: the host queues a step while the GPU runs the one before, unless something waits for the GPU.
Reported: the mean per step over `--steps` steps after two warm-up steps (three rounds, the median), and the median
host time of the mask's build (waits for the GPU included).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import flexgen  # noqa: E402


def document_mask(length: int, docs: int):
    ids = (torch.rand(length, device="cuda") < docs / length).cumsum(0)
    return lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)


def step_times(build, fresh: bool, layers: int, steps: int, shape) -> tuple[float, float]:
    """(ms per step, median ms of host time building the mask)."""
    B, H, L, D = shape
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fixed = None if fresh else build(document_mask(L, 8), B, None, L, L, device="cuda")

    def step(builds):
        t0 = time.perf_counter()
        bm = build(document_mask(L, 8), B, None, L, L, device="cuda") if fresh else fixed
        builds.append((time.perf_counter() - t0) * 1e3)
        x = q
        for _ in range(layers):
            x = flexgen.flex_attention(x, k, v, block_mask=bm)
        x.float().sum().backward()

    builds, rounds = [], []
    for _ in range(2):
        step([])
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(builds)
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) * 1e3 / steps)
    return statistics.median(rounds), statistics.median(builds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlen", type=int, default=8192)
    args = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.layers} layers, ms per step "
          f"(mask build's host ms)")
    print("| D | mask made once | fresh, flexgen's create_block_mask | fresh, PyTorch's create_block_mask |")
    print("|---|---|---|---|")
    for d in (int(x) for x in args.dims.split(",")):
        shape = (2, 16, args.seqlen, d)
        once, _ = step_times(flexgen.create_block_mask, False, args.layers, args.steps, shape)
        ours, ours_build = step_times(flexgen.create_block_mask, True, args.layers, args.steps, shape)
        theirs, theirs_build = step_times(torch_create_block_mask, True, args.layers, args.steps, shape)
        print(f"| {d} | {once:.2f} | {ours:.2f} ({ours_build:.2f}) | {theirs:.2f} ({theirs_build:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
