"""Before a device call: what a kernel change did to the sm90 kernels' spills and to their per-step loop, on several
flexgen trees, compiled here with nvcc (no GPU needed).

    python3 benchmarks/static_ab.py --tree base=.gpu/ab_base --tree new=. [--kind fwd] [--only d128_causal,...]

For each tree a child process with that tree's flexgen on its path renders the kernels of CASES (the variants
kernel_ab.py measures); nvcc compiles them to sm_90a cubins with ptxas's report. The table gives per kernel and tree
the bytes spilled and, with nvdisasm (pip's nvidia-cuda-nvdisasm, `--nvdisasm`), the instructions of the step loop:
the innermost loop that issues at least MIN_PRODUCTS wgmma (`HGMMA`) and MIN_EXPONENTIALS `MUFU`, counted statically
(every branch of it: the dispatch over partial and ragged tiles included). Later
trees are shown against the first. Spills and a loop that grew are what a device call would otherwise find first.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MIN_PRODUCTS, MIN_EXPONENTIALS = 8, 32  # a step: its products, and the exponentials of P (64 or 128 rows x its keys)

# name: (kind, head dim, score_mod, mask_mod, make_spec keywords); expressions over flexgen.variants as V
CASES = {
    "fwd_d128_full": ("fwd", 128, "None", "None", {}),
    "fwd_d128_causal": ("fwd", 128, "None", "V.causal", {}),
    "fwd_d128_alibi_causal": ("fwd", 128, "V.alibi(16)", "V.causal", {}),
    "fwd_d128_softcap_causal": ("fwd", 128, "V.softcap(30.0)", "V.causal", {}),
    "fwd_d128_document": ("fwd", 128, "None", "V.document(torch.zeros(64, dtype=torch.int32))", {}),
    "fwd_d64_full": ("fwd", 64, "None", "None", {}),
    "fwd_d64_causal": ("fwd", 64, "None", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d64_alibi_causal": ("fwd", 64, "V.alibi(16)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d64_softcap_causal": ("fwd", 64, "V.softcap(30.0)", "V.causal", {"mask_block": (128, 128)}),
    "fwd_d256_causal": ("fwd", 256, "None", "V.causal", {}),
    "bwd_d128_full": ("bwd", 128, "None", "None", {}),
    "bwd_d128_causal": ("bwd", 128, "None", "V.causal", {}),
    "bwd_d128_alibi_causal": ("bwd", 128, "V.alibi(16)", "V.causal", {}),
    "bwd_d64_full": ("bwd", 64, "None", "None", {}),
    "bwd_d64_causal": ("bwd", 64, "None", "V.causal", {}),
}

# Runs in the child, with a tree's flexgen first on sys.path: writes each case's CUDA source into the folder given.
RENDER = """
import json, sys, torch
from flexgen import variants as V
from flexgen.codegen.api import emit
cases, out = json.loads(sys.argv[1]), sys.argv[2]
for name, (kind, head_dim, score, mask, options) in cases.items():
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    source = emit(kind, eval(score), eval(mask), head_dim=head_dim, dtype="bf16", arch="sm_90a", **options)
    open(f"{out}/{name}.cu", "w").write(source)
"""


def opcode(text: str) -> str:
    words = text.split()
    return words[1] if words[0].startswith("@") else words[0]


def parse_sass(sass: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm -c output as (instruction texts, label -> index of the instruction that follows it)."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        ins = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?)\s*;", line)
        if ins:
            instructions.append(ins.group(1))
    return instructions, labels


def step_loop(sass: str) -> collections.Counter | None:
    """Opcode counts of the innermost loop (a backward branch's span) with a step's products and exponentials."""
    instructions, labels = parse_sass(sass)
    best = None
    for end, text in enumerate(instructions):
        if not opcode(text).startswith("BRA"):
            continue
        target = re.search(r"(\.L_x_\d+)", text)
        start = labels.get(target.group(1)) if target else None
        if start is None or start > end:
            continue
        body = collections.Counter(opcode(t).split(".")[0] for t in instructions[start:end + 1])
        step = body["HGMMA"] >= MIN_PRODUCTS and body["MUFU"] >= MIN_EXPONENTIALS
        if step and (best is None or sum(body.values()) < sum(best.values())):
            best = body
    return best


def compile_case(cu: Path, nvdisasm: str | None) -> dict:
    cubin = cu.with_suffix(".cubin")
    run = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-std=c++17", "-O3", "-Xptxas", "-v", "-o", str(cubin),
                          str(cu)], capture_output=True, text=True)
    log = run.stdout + run.stderr
    if run.returncode != 0:
        return {"error": log[-400:]}
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    out = {"spill": int(spill.group(1)) if spill else -1, "serialized": "serialized" in log}
    if nvdisasm:
        loop = step_loop(subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                                        check=True).stdout)
        out["loop"] = sum(loop.values()) if loop else None
    return out


def measure(tree: Path, cases: dict, nvdisasm: str | None, jobs: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-c", RENDER, json.dumps(cases), tmp], check=True, cwd=tree,
                       env={**os.environ, "PYTHONPATH": str(tree.resolve())})
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = pool.map(lambda name: compile_case(Path(tmp) / f"{name}.cu", nvdisasm), cases)
            return dict(zip(cases, results))


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
