"""A quick GPU check of the backward against float64 autograd (causal, ALiBi learnable, GQA,
ragged lengths), run before longer sessions: exits 1 on a mismatch.

    python benchmarks/smoke_bwd.py
"""
from __future__ import annotations

import sys

import torch

import flexgen
from flexgen import variants as V


def main() -> int:
    torch.manual_seed(0)
    ok = True
    for d, n, heads_kv in ((128, 1000, 4), (64, 777, 2), (256, 300, 4)):
        q = torch.randn(2, 4, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(2, heads_kv, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        slopes = V.alibi_slopes(4).cuda().requires_grad_(True)
        bm = flexgen.create_block_mask(V.causal, None, None, n, n)
        out = flexgen.flex_attention(q, k, v, score_mod=V.alibi(slopes), block_mask=bm, enable_gqa=True)
        g = torch.randn_like(out)
        out.backward(g)
        got = [t.grad.double() for t in (q, k, v, slopes)]
        ref_in = [t.detach().double().requires_grad_(True) for t in (q, k, v, slopes)]
        qq, kk, vv, ss = ref_in
        ref = flexgen.reference_attention(qq, kk, vv, score_mod=V.alibi(ss), mask_mod=V.causal, enable_gqa=True)
        ref.backward(g.double())
        for name, a, r in zip(("dq", "dk", "dv", "dslopes"), got, [t.grad for t in ref_in]):
            err = (a - r).abs().max().item() / max(r.abs().max().item(), 1e-6)
            good = err < 3e-2 and not torch.isnan(a).any()
            ok &= good
            print(f"D={d} N={n} Hkv={heads_kv} {name}: max rel err {err:.2e} {'ok' if good else 'BAD'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
