"""How evenly a grid of persistent CTAs finishes, for the bench's masks: a model, no GPU needed.

A work tile (one query tile of one (batch, head)) costs its KV tiles plus one (its fixed part); each of 132 CTAs
takes tiles by one of three policies, and the table gives the last CTA's finish over the mean:
  static   CTA c takes tiles c, c + 132, ... in the order given
  dynamic  the next idle CTA takes the next tile in that order (a shared counter)
Orders: the kernel's before session 6 (heads one after another, later query tiles first) and heaviest first within
chunks of (batch, head) pairs (templates/sm90/work_order.cuh).

    python benchmarks/schedule_sim.py
"""
from __future__ import annotations

import heapq
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_attention import document_ids  # noqa: E402

N, B, H, CTAS, TILE = 8192, 2, 16, 132, 128


def kv_tiles_per_query_tile(kind: str) -> list[int]:
    n_m = N // TILE
    if kind == "causal":
        return [m + 1 for m in range(n_m)]
    if kind == "sliding1024":
        return [min(m + 1, 1024 // TILE + 1) for m in range(n_m)]
    doc = document_ids(N, "cpu")
    counts = []
    for m in range(n_m):
        first_doc = int(doc[m * TILE])
        start = int((doc == first_doc).nonzero()[0])
        counts.append(m - start // TILE + 1)
    return counts


def finish_over_mean(costs: list[float], dynamic: bool) -> float:
    mean = sum(costs) / CTAS
    if dynamic:
        heap = [0.0] * CTAS
        for c in costs:
            heapq.heapreplace(heap, heap[0] + c)
        return max(heap) / mean
    loads = [0.0] * CTAS
    for w, c in enumerate(costs):
        loads[w % CTAS] += c
    return max(loads) / mean


def main() -> None:
    print("| mask | order | static | dynamic |\n|---|---|---|---|")
    for kind in ("causal", "sliding1024", "document-causal"):
        counts = kv_tiles_per_query_tile(kind)
        n_m = len(counts)
        old = [1 + counts[n_m - 1 - w % n_m] for w in range(n_m * B * H)]
        ranked = sorted(range(n_m), key=lambda m: -counts[m])
        for chunk in (4, B * H):
            new = []
            for first in range(0, B * H, chunk):
                pairs = min(chunk, B * H - first)
                new += [1 + counts[m] for m in ranked for _ in range(pairs)]
            label = f"heaviest first, chunks of {chunk}"
            print(f"| {kind} | {label} | {finish_over_mean(new, False):.3f} | {finish_over_mean(new, True):.3f} |")
        print(f"| {kind} | session 5 | {finish_over_mean(old, False):.3f} | {finish_over_mean(old, True):.3f} |")


if __name__ == "__main__":
    main()
