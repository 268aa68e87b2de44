"""Before a device call: what a kernel change did to the sm90 kernels' spills and to their per-step loop, on several
flexgen trees, compiled here (no GPU needed).

    python3 benchmarks/static_ab.py --tree base=.gpu/ab_base --tree new=. [--kind fwd] [--only fwd_d128_causal,...]

For each tree a child process with that tree's flexgen on its path builds the kernels of CASES (the variants
kernel_ab.py measures) for sm_90a through flexgen's own compiler path, in a scratch kernel cache. The table gives per
kernel and tree the bytes ptxas spilled, whether it serialised the wgmmas, and, with nvdisasm (pip's
nvidia-cuda-nvdisasm, `--nvdisasm`), the instructions of the step loop: the innermost loop that issues at least
MIN_PRODUCTS wgmma (`HGMMA`) and MIN_EXPONENTIALS `MUFU`, counted statically (every branch of it: the dispatch over
partial and ragged tiles included). Later trees are shown against the first. Spills and a loop that grew are what a
device call would otherwise find first.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_side_by_side import bare_opcode, disassemble, instructions_and_labels  # noqa: E402

MIN_PRODUCTS, MIN_EXPONENTIALS = 8, 32  # a step: its products, and the exponentials of P (64 or 128 rows x its keys)

# name: (kind, head dim, score_mod, mask_mod, make_spec keywords); expressions over flexgen.variants as V
CASES = {
    "fwd_d128_full": ("fwd", 128, "None", "None", {}),
    "fwd_d128_causal": ("fwd", 128, "None", "V.causal", {}),
    "fwd_d128_causal_blocks": ("fwd", 128, "None", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d128_prefix_blocks": ("fwd", 128, "None", "V.prefix_lm(1024)", {"mask_block": (128, 128)}),
    "fwd_d128_sliding_blocks": ("fwd", 128, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "fwd_d128_alibi_causal": ("fwd", 128, "V.alibi(16)", "V.causal", {}),
    "fwd_d128_alibi_causal_blocks": ("fwd", 128, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d128_softcap_causal_blocks": ("fwd", 128, "V.softcap(30.0)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d128_softcap_causal": ("fwd", 128, "V.softcap(30.0)", "V.causal", {}),
    "fwd_d128_document": ("fwd", 128, "None", "V.document(torch.zeros(64, dtype=torch.int32))", {}),
    "fwd_d64_full": ("fwd", 64, "None", "None", {}),
    "fwd_d64_causal": ("fwd", 64, "None", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d64_alibi_causal": ("fwd", 64, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d64_softcap_causal": ("fwd", 64, "V.softcap(30.0)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d256_causal": ("fwd", 256, "None", "V.causal", {}),
    "fwd_d96_full": ("fwd", 96, "None", "None", {}),
    "fwd_d96_causal": ("fwd", 96, "None", "V.causal", {}),
    "fwd_d96_causal_blocks": ("fwd", 96, "None", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d96_alibi_causal_blocks": ("fwd", 96, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d96_softcap_causal_blocks": ("fwd", 96, "V.softcap(30.0)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d96_sliding_blocks": ("fwd", 96, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "fwd_d64_sliding_blocks": ("fwd", 64, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "fwd_d32_causal": ("fwd", 32, "None", "V.causal", {"mask_block": (128, 128)}),
    "bwd_d128_full": ("bwd", 128, "None", "None", {}),
    "bwd_d128_alibi": ("bwd", 128, "V.alibi(16)", "None", {}),
    "bwd_d128_causal": ("bwd", 128, "None", "V.causal", {}),
    "bwd_d128_alibi_causal": ("bwd", 128, "V.alibi(16)", "V.causal", {}),
    "bwd_d128_softcap_causal": ("bwd", 128, "V.softcap(30.0)", "V.causal", {}),
    "bwd_d128_causal_blocks": ("bwd", 128, "None", "V.causal", {"mask_block": (128, 128)}),
    "bwd_d128_alibi_causal_blocks": ("bwd", 128, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "bwd_d128_sliding_blocks": ("bwd", 128, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "bwd_d128_document_blocks": ("bwd", 128, "None", "V.document(torch.zeros(64, dtype=torch.int32))",
                                 {"mask_block": (128, 128)}),
    "bwd_d128_document": ("bwd", 128, "None", "V.document(torch.zeros(64, dtype=torch.int32))", {}),
    "bwd_d64_full": ("bwd", 64, "None", "None", {}),
    "bwd_d64_causal": ("bwd", 64, "None", "V.causal", {}),
    "bwd_d64_alibi_causal": ("bwd", 64, "V.alibi(16)", "V.causal", {}),
    "bwd_d64_softcap_causal": ("bwd", 64, "V.softcap(30.0)", "V.causal", {}),
    "bwd_d256_causal": ("bwd", 256, "None", "V.causal", {}),
    "bwd_d96_full": ("bwd", 96, "None", "None", {}),
    "bwd_d96_causal_blocks": ("bwd", 96, "None", "V.causal", {"mask_block": (128, 128)}),
    "bwd_d96_sliding_blocks": ("bwd", 96, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "bwd_d96_alibi_causal_blocks": ("bwd", 96, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "bwd_d64_sliding_blocks": ("bwd", 64, "None", "V.sliding_window(1024)", {"mask_block": (128, 128)}),
    "bwd_d32_causal": ("bwd", 32, "None", "V.causal", {}),
    "bwd_d128_dropout_alibi_causal": ("bwd", 128, "V.alibi(16)", "V.causal", {"dropout": True}),
    "bwd_d64_dropout_causal": ("bwd", 64, "None", "V.causal", {"dropout": True}),
}

# Runs in the child, with a tree's flexgen first on sys.path and a scratch kernel cache: builds each case, writes its
# cubin into the folder given, and prints what ptxas reported, as JSON.
BUILD = """
import concurrent.futures, json, sys, torch
from flexgen import variants as V
from flexgen.cache import jit
from flexgen.codegen.api import make_spec
cases, out, jobs = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def build(name):
    kind, head_dim, score, mask, options = cases[name]
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        spec = make_spec(kind, eval(score), eval(mask), head_dim=head_dim, dtype="bf16", arch="sm_90a", **options)
        kernel = jit.get_kernel(spec, child_process=True)
    except Exception as e:
        return {"error": str(e)[-400:]}
    open(f"{out}/{name}.cubin", "wb").write(kernel.cubin)
    return {"spill": kernel.resources.get("spill_stores_bytes", -1),
            "serialized": "serialized" in kernel.meta.get("compiler_log", "")}
with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    print(json.dumps(dict(zip(cases, pool.map(build, cases)))))
"""


def step_loop(sass: str) -> collections.Counter | None:
    """Opcode counts of the innermost loop (a backward branch's span) with a step's products and exponentials."""
    instructions, labels = instructions_and_labels(sass)
    best = None
    for end, text in enumerate(instructions):
        if bare_opcode(text) != "BRA":
            continue
        target = re.search(r"(\.L_x_\d+)", text)
        start = labels.get(target.group(1)) if target else None
        if start is None or start > end:
            continue
        body = collections.Counter(bare_opcode(t) for t in instructions[start:end + 1])
        step = body["HGMMA"] >= MIN_PRODUCTS and body["MUFU"] >= MIN_EXPONENTIALS
        if step and (best is None or sum(body.values()) < sum(best.values())):
            best = body
    return best


def measure(tree: Path, cases: dict, nvdisasm: str | None, jobs: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "FLEXGEN_CACHE_DIR": f"{tmp}/cache"}
        built = subprocess.run([sys.executable, "-c", BUILD, json.dumps(cases), tmp, str(jobs)], check=True, cwd=tree,
                               env=env, capture_output=True, text=True)
        results = json.loads(built.stdout.strip().splitlines()[-1])
        for name, result in results.items():
            if nvdisasm and "error" not in result:
                loop = step_loop(disassemble((Path(tmp) / f"{name}.cubin").read_bytes(), nvdisasm, None, name))
                result["loop"] = sum(loop.values()) if loop else None
        return results


def cell(result: dict, first: dict | None) -> str:
    if "error" in result:
        return "compile failed"
    text = f"{result['spill']} B" + (" SERIALIZED" if result["serialized"] else "")
    if result.get("loop") is not None:
        text += f", loop {result['loop']}"
        if first is not None and first.get("loop"):
            text += f" ({result['loop'] - first['loop']:+d})"
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR", help="first: the baseline")
    p.add_argument("--kind", choices=["fwd", "bwd", "both"], default="both")
    p.add_argument("--only", help="comma-separated case names (default: every case of the kind)")
    p.add_argument("--nvdisasm", help="nvdisasm binary, for the step loop's size")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    trees = [(label, Path(path)) for label, path in (t.split("=", 1) for t in args.tree)]
    wanted = args.only.split(",") if args.only else [n for n in CASES if args.kind in ("both", CASES[n][0])]
    unknown = [n for n in wanted if n not in CASES]
    if unknown:
        raise SystemExit(f"static_ab: unknown cases {unknown}; known: {', '.join(CASES)}")
    cases = {n: CASES[n] for n in wanted}
    results = {label: measure(path, cases, args.nvdisasm, args.jobs) for label, path in trees}
    base = trees[0][0]
    print("| case | " + " | ".join(label for label, _ in trees) + " |")
    print("|---" * (len(trees) + 1) + "|")
    for name in cases:
        cells = [cell(results[label][name], None if label == base else results[base][name]) for label, _ in trees]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
