"""Cost of learnable score_mod buffers: fwd+bwd of ALiBi + causal with fixed slopes against
learnable ones (their gradient accumulated by the backward kernel), and a learnable relative
position bias table, against FlexAttention (torch.compile'd) on the same inputs; and the same
three in deterministic mode (kernel_options={"deterministic": True}: bitwise-reproducible dQ and
buffer gradients). bf16, B=2, H=16, N=8k, D=128 (and 64).

    python benchmarks/bench_buffer_grads.py [--no-deterministic] [--no-flex] [--dims 128,64]
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flexgen
from flexgen import variants as V


def _flex(q, k, v, score_mod, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _add_flex(runs: dict, q, k, v, learn, rel_bias, n: int) -> None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        fbm = create_block_mask(lambda b_, h_, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n)

        def alibi_learn(score, b_, h_, q_idx, kv_idx):
            return score + learn[h_] * (kv_idx - q_idx)

        runs["flex alibi learnable"] = lambda: _flex(q, k, v, alibi_learn, fbm)
        runs["flex relbias learnable"] = lambda: _flex(q, k, v, rel_bias, fbm)
    except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
        print(f"FlexAttention unavailable: {e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-deterministic", action="store_true", help="skip the deterministic-mode cases")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its learnable ALiBi takes ~2 s a step)")
    ap.add_argument("--dims", default="128,64", help="head dims, comma-separated")
    args = ap.parse_args()
    b, h, n = 2, 16, 8192
    det = {"deterministic": True}
    for d in (int(x) for x in args.dims.split(",")):
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        flops = 3.5 * 4 * d * (n * (n + 1) // 2) * b * h
        bm = flexgen.create_block_mask(V.causal, None, None, n, n)
        slopes = V.alibi_slopes(h).cuda()
        learn = slopes.clone().requires_grad_(True)
        table = (0.1 * torch.randn(h, 2 * n - 1, device="cuda")).requires_grad_(True)

        def rel_bias(score, b_, h_, q_idx, kv_idx):
            return score + table[h_, q_idx - kv_idx + n - 1]

        runs = {
            "flexgen alibi fixed": lambda: flexgen.flex_attention(q, k, v, score_mod=V.alibi(slopes), block_mask=bm),
            "flexgen alibi learnable": lambda: flexgen.flex_attention(q, k, v, score_mod=V.alibi(learn), block_mask=bm),
            "flexgen relbias learnable": lambda: flexgen.flex_attention(q, k, v, score_mod=rel_bias, block_mask=bm),
        }
        if not args.no_deterministic:  # the fixed-slope case separates deterministic dQ's cost from the buffers'
            runs["flexgen alibi fixed det"] = lambda: flexgen.flex_attention(
                q, k, v, score_mod=V.alibi(slopes), block_mask=bm, kernel_options=det)
            runs["flexgen alibi learnable det"] = lambda: flexgen.flex_attention(
                q, k, v, score_mod=V.alibi(learn), block_mask=bm, kernel_options=det)
            runs["flexgen relbias learnable det"] = lambda: flexgen.flex_attention(
                q, k, v, score_mod=rel_bias, block_mask=bm, kernel_options=det)
        if not args.no_flex:
            _add_flex(runs, q, k, v, learn, rel_bias, n)
        for name, fn in runs.items():
            try:
                ms = do_bench(lambda: fn().backward(do), warmup=10, rep=40)
            except Exception as e:  # noqa: BLE001
                print(f"D={d} {name:30s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"D={d} {name:30s} fwd+bwd {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s", flush=True)


if __name__ == "__main__":
    main()
