"""The sm90 kernels on small ragged shapes, forward and backward, against flexgen's own float64 path, with the
persistent grid cut to a few CTAs so that each walks several work tiles (and reuses its buffers): a case list small
enough to run under compute-sanitizer.

    python3 benchmarks/small_cases_check.py --ctas 2
    compute-sanitizer --tool memcheck python3 benchmarks/small_cases_check.py --ctas 2 --cases 128:causal,64:full

Each case: B = 1, H = 2, N tokens (default 1500: no tile size divides it), bf16 inputs, the float64 result computed
from the same bf16-rounded inputs; the output and dQ, dK, dV may differ from it by at most `--tolerance` of their
largest element, and contain no NaN. Without a GPU the float64 path alone runs (the harness's own check).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexgen  # noqa: E402
from bench_attention import build_variant  # noqa: E402

CASES = ("128:causal,128:sliding1024,128:alibi-causal,128:prefix-lm,128:full,128:document-causal,96:causal,96:full,"
         "64:full,64:causal,64:softcap30-causal,64:alibi-causal,64:document-causal,32:causal")


def cut_grid(ctas: int) -> None:
    """Every planner and launcher that sizes a persistent grid by the SM count sees `ctas` SMs."""
    import flexgen.runtime.backward as backward
    import flexgen.runtime.families as families
    import flexgen.runtime.plan as plan

    for module in (families, backward, plan):
        module.sm_count = lambda device: ctas


def run_case(head_dim: int, name: str, n: int, device: str) -> list[float] | None:
    """Relative max errors of (out, dq, dk, dv) in bf16 against float64, or None where only float64 runs."""
    torch.manual_seed(7 * head_dim + len(name))
    variant = build_variant(name, n, 2, torch.device(device))
    mask = None if variant.mask is None else flexgen.create_block_mask(variant.mask, None, None, n, n, device=device)
    q, k, v, grad_out = (torch.randn(1, 2, n, head_dim, device=device, dtype=torch.float64).to(torch.bfloat16)
                         for _ in range(4))
    results = []
    for dtype in ((torch.bfloat16, torch.float64) if device == "cuda" else (torch.float64,)):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
        out = flexgen.flex_attention(qq, kk, vv, score_mod=variant.score, block_mask=mask)
        out.backward(grad_out.to(dtype))
        results.append([t.double() for t in (out, qq.grad, kk.grad, vv.grad)])
    if len(results) == 1:
        return None
    got, want = results
    if any(torch.isnan(t).any().item() for t in got):
        return [float("nan")] * 4
    return [((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(got, want)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=CASES, help="comma list of HEAD_DIM:VARIANT (bench_attention.py's variants)")
    p.add_argument("--seqlen", type=int, default=1500)
    p.add_argument("--ctas", type=int, default=0, help="cut the persistent grids to this many CTAs (0: the SM count)")
    p.add_argument("--tolerance", type=float, default=3e-2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.ctas:
        cut_grid(args.ctas)
    failed = 0
    for item in args.cases.split(","):
        dim, name = item.strip().split(":")
        errors = run_case(int(dim), name, args.seqlen, args.device)
        if errors is None:
            print(f"D{dim} {name}: float64 path ran (no GPU to compare)", flush=True)
            continue
        bad = not all(e <= args.tolerance for e in errors)  # (NaN fails too)
        failed += bad
        print(f"{'FAIL' if bad else 'ok  '} D{dim} {name}: relative max error out / dq / dk / dv "
              + " / ".join(f"{e:.1e}" for e in errors), flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
