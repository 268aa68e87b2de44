"""Cost of in-kernel dropout: flexgen fwd and fwd+bwd with dropout_p = 0 and 0.1 (and 0.1 on the sm80
family), and SDPA's
flash backend with the same dropout, bf16, B=2, H=16, N=8k, causal, D=128 (and 64).

    python benchmarks/bench_dropout.py [--dims 128,64]
"""
from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench

import flexgen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="128,64", help="head dims, comma-separated")
    for d in (int(x) for x in ap.parse_args().dims.split(",")):
        _bench(2, 16, 8192, d)


def _bench(b: int, h: int, n: int, d: int) -> None:
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, n, n)
    flops = 4 * d * (n * (n + 1) // 2) * b * h
    do = torch.randn_like(q)
    runs = {
        f"flexgen p={p}": (lambda p=p: flexgen.flex_attention(q, k, v, block_mask=bm, dropout_p=p)) for p in (0.0, 0.1)
    }
    # the Ampere-style family, which every GPU runs: what the Hopper kernels' dropout is worth
    runs["flexgen-sm80 p=0.1"] = lambda: flexgen.flex_attention(
        q, k, v, block_mask=bm, dropout_p=0.1, kernel_options={"family": "sm80"})
    for p in (0.0, 0.1):
        runs[f"sdpa-flash p={p}"] = lambda p=p: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=p)
    for name, fn in runs.items():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            fwd = do_bench(lambda: fn(), warmup=10, rep=40)
            both = do_bench(lambda: fn().backward(do), warmup=10, rep=40)
        print(f"D={d} {name:20s} fwd {fwd:7.3f} ms {flops / fwd / 1e9:6.1f} TF/s | fwd+bwd {both:7.3f} ms "
              f"{3.5 * flops / both / 1e9:6.1f} TF/s")


if __name__ == "__main__":
    main()
