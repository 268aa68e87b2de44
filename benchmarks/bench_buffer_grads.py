"""Cost of learnable score_mod buffers: fwd+bwd of ALiBi + causal with fixed slopes against
learnable ones (their gradient accumulated by the backward kernel), and a learnable relative
position bias table, against FlexAttention (torch.compile'd) on the same inputs.
bf16, B=2, H=16, N=8k, D=128 (and 64).

    python benchmarks/bench_buffer_grads.py
"""
from __future__ import annotations

import torch
from triton.testing import do_bench

import flexgen
from flexgen import variants as V


def _flex(q, k, v, score_mod, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)(q, k, v, score_mod=score_mod, block_mask=block_mask)


def main() -> None:
    b, h, n = 2, 16, 8192
    for d in (128, 64):
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
        try:
            from torch.nn.attention.flex_attention import create_block_mask

            fbm = create_block_mask(lambda b_, h_, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n)

            def alibi_learn(score, b_, h_, q_idx, kv_idx):
                return score + learn[h_] * (kv_idx - q_idx)

            runs["flex alibi learnable"] = lambda: _flex(q, k, v, alibi_learn, fbm)
            runs["flex relbias learnable"] = lambda: _flex(q, k, v, rel_bias, fbm)
        except Exception as e:  # noqa: BLE001 - a missing peer is reported, not fatal
            print(f"FlexAttention unavailable: {e}")
        for name, fn in runs.items():
            try:
                ms = do_bench(lambda: fn().backward(do), warmup=10, rep=40)
            except Exception as e:  # noqa: BLE001
                print(f"D={d} {name:28s} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"D={d} {name:28s} fwd+bwd {ms:7.3f} ms {flops / ms / 1e9:6.1f} TF/s", flush=True)


if __name__ == "__main__":
    main()
