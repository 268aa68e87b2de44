"""Where the backward's time goes: flexgen's backward with every input gradient, without dQ
(q.requires_grad = False: no dQ product, no dQ atomics) and without dK, dV, for full and causal
attention, bf16, B=2, H=16, N=8k, D=128 and 64. Times are backward only (fwd+bwd minus fwd).

    python benchmarks/bench_bwd_parts.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

import flexgen
from flexgen import variants as V


def main() -> None:
    b, h, n = 2, 16, 8192
    for d in (128, 64):
        base = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
        do = torch.randn_like(base[0])
        for name, bm in (("full", None), ("causal", flexgen.create_block_mask(V.causal, None, None, n, n))):
            pairs = n * n if bm is None else n * (n + 1) // 2
            flops = 2.5 * 4 * d * pairs * b * h
            fwd = do_bench(lambda: flexgen.flex_attention(*base, block_mask=bm), warmup=10, rep=40)
            for label, grads in (("dq dk dv", (True, True, True)), ("dk dv", (False, True, True)),
                                 ("dq", (True, False, False))):
                q, k, v = (t.detach().requires_grad_(g) for t, g in zip(base, grads))
                both = do_bench(lambda: flexgen.flex_attention(q, k, v, block_mask=bm).backward(do), warmup=10, rep=40)
                bwd = both - fwd
                print(f"D={d} {name:6s} {label:9s} bwd {bwd:7.3f} ms  ({flops / bwd / 1e9:6.1f} TF/s at full bwd FLOPs)",
                      flush=True)


if __name__ == "__main__":
    main()
