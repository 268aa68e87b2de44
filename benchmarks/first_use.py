#!/usr/bin/env python3
"""First use of a new variant on a GPU: one training step (forward + backward) with a cold kernel cache.

    python3 benchmarks/first_use.py [--head-dim 128] [--repeats 2]

Each measurement runs in a fresh process with an empty cache folder, after torch, flexgen and CUDA are
initialised (so only flexgen's own first-use work is timed): wall time of the first forward, of the
first backward, and of the step, with the backward's kernels compiled one after the other (the default)
and, for comparison, in the background during the forward (FLEXGEN_BACKGROUND_COMPILE=1). A warm step of
the same call is printed beside them. One untimed process runs first, so that no row pays the machine's
cold disk reads of torch's, cupy's and NVRTC's libraries, and the two settings alternate.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
import flexgen
d = {d}
q, k, v = (torch.randn(2, 16, 2048, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()
mask = flexgen.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 2048, 2048, device="cuda")
softcap = lambda s, b, h, qi, kv: 30.0 * torch.tanh(s / 30.0)
def step():
    t0 = time.perf_counter()
    out = flexgen.flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.sum().backward()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1
fwd, bwd = step()
warm = sum(step())
print(json.dumps({{"forward_s": fwd, "backward_s": bwd, "step_s": fwd + bwd, "warm_step_s": warm}}))
"""


def measure(head_dim: int, background: bool) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FLEXGEN_CACHE_DIR=cache, FLEXGEN_BACKGROUND_COMPILE="1" if background else "0")
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, d=head_dim)], env=env,
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"cold first step, softcap 30 + causal, B=2 H=16 N=2048 D={args.head_dim} bf16 (seconds)")
    print(f"{'backward kernels':>22} {'forward':>8} {'backward':>9} {'step':>6} {'warm step':>10}")
    measure(args.head_dim, False)  # untimed: the libraries into the page cache
    for _ in range(args.repeats):
        for background in (False, True):
            r = measure(args.head_dim, background)
            label = "in background" if background else "after the forward"
            print(f"{label:>22} {r['forward_s']:8.2f} {r['backward_s']:9.2f} {r['step_s']:6.2f} {r['warm_step_s']:10.4f}")


if __name__ == "__main__":
    main()
