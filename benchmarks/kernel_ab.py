"""Did a kernel change help? The forward's or the backward's kernel time under ncu at locked base clocks, per variant,
on several flexgen trees alternated in one device call: it resolves changes of 1-2%, where wall-clock timing on the
H200 moves the same kernel by up to 10% between rounds (benchmarks/ab_bench.sh, docs/forward-sm90.md).

    python3 benchmarks/kernel_ab.py run --kind bwd --tree base=.gpu/ab_base --tree this=. --rounds 3 --out $OUT
    python3 benchmarks/kernel_ab.py report $OUT            (anywhere: medians per case, and each tree against the first)
    ... run --kind fwd --only 64:document-causal,64:causal ...  (some cases only: HEAD_DIM:VARIANT, comma-separated)
    ... run --kind bwd_all ...   (the whole backward: preprocess, main kernel and postprocess, summed per call;
                                   the report adds each kernel's own medians)

`run` (on the GPU machine) starts, per round and tree (their order rotated from round to round: give as many
rounds as trees), one process under `ncu --clock-control base` that runs every
case (`cases`, below) with that tree's flexgen on PYTHONPATH and its own kernel cache, and keeps ncu's CSV as
ncu_<tree>_r<round>.csv. Each case launches the kernel LAUNCHES times; the first (which follows the compile) is
left out. Prepare other trees with `bash benchmarks/ab_bench.sh prepare REV DIR` and carry them in the call.
Where a change is expected to be small, give the baseline's tree a second time under another label
(`--tree base=. --tree same=.gpu/ab_main --tree new=...`): its column is the noise floor of each case in that call,
which a change must clear (at D = 256 the same kernel moved by up to 1.3% in two rounds).
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

LAUNCHES = 4
SEQLEN = 8192  # N of the cases, as in results.md's tables (--seqlen for others)
KERNEL = {"fwd": "^flexgen_fwd$", "bwd": "^flexgen_bwd$", "bwd_all": "^flexgen_bwd"}
CASES = {  # (head dim, bench_attention.py variant): H = 16, N = 8k (--seqlen) and 16k tokens per batch, bf16
    "fwd": [(128, "full"), (128, "softcap30"), (128, "causal"), (128, "sliding1024"), (128, "alibi-causal"),
            (128, "softcap30-causal"), (128, "document-causal"), (64, "full"), (64, "causal"), (64, "sliding1024"),
            (64, "alibi-causal"), (64, "softcap30-causal"), (64, "alibi-slopes-causal"), (64, "document-causal")],
    "bwd": [(128, "full"), (128, "causal"), (128, "alibi-causal"), (128, "softcap30-causal"), (128, "document-causal"),
            (128, "sliding1024"), (64, "full"), (64, "causal"), (64, "alibi-causal"), (64, "sliding1024")],
}
CASES["bwd_all"] = CASES["bwd"]


def selected(kind: str, only: str | None) -> list[tuple[int, str]]:
    """CASES[kind], or the cases named in `only` ("D:variant,...", any head dim and bench_attention.py variant), in
    CASES order and then in the order given."""
    if not only:
        return CASES[kind]
    wanted = [item.strip() for item in only.split(",") if item.strip()]
    bad = [item for item in wanted if not re.fullmatch(r"\d+:[\w-]+", item)]
    if bad:
        raise SystemExit(f"kernel_ab: --only {bad}: each case is HEAD_DIM:VARIANT, e.g. 128:causal")
    known = [(d, name) for d, name in CASES[kind] if f"{d}:{name}" in wanted]
    others = [(int(item.split(":")[0]), item.split(":")[1]) for item in wanted
              if (int(item.split(":")[0]), item.split(":")[1]) not in known]
    return known + others


def run_cases(kind: str, n: int = SEQLEN, heads: int = 16, tokens: int | None = None, device: str = "cuda",
              only: str | None = None) -> None:
    """The launches ncu measures, in CASES order, each case announced by a `CASE <D> <variant>` line; the variants
    are bench_attention.py's, so a change is measured on the cases results.md reports."""
    import torch

    import flexgen

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import TOKENS, build_variant

    batch = max(1, (tokens or TOKENS) // n)  # (as bench_attention.py: the same tokens per batch at every length)
    for d, name in selected(kind, only):
        variant = build_variant(name, n, heads, torch.device(device))
        q, k, v = (torch.randn(batch, heads, n, d, device=device, dtype=torch.bfloat16, requires_grad=kind != "fwd")
                   for _ in range(3))
        bm = flexgen.create_block_mask(variant.mask, None, None, n, n, device=device) if variant.mask is not None else None
        print(f"CASE {d} {name}" + ("" if n == SEQLEN else f" N={n}"), flush=True)
        if kind == "fwd":
            for _ in range(LAUNCHES):
                flexgen.flex_attention(q, k, v, score_mod=variant.score, block_mask=bm)
        else:
            out = flexgen.flex_attention(q, k, v, score_mod=variant.score, block_mask=bm)
            dout = torch.randn_like(out)
            for _ in range(LAUNCHES):
                q.grad = k.grad = v.grad = None
                out.backward(dout, retain_graph=True)
        if device == "cuda":
            torch.cuda.synchronize()


def rotated(trees: list, by: int) -> list:
    """The trees in round `by`'s order: the list rotated by one place per round, so that over as many rounds as
    trees each one runs in each place of the sequence once. (With a fixed order, the later trees of one call read
    0.9-1.2% above the first on a kernel identical to the first's: docs/backward.md, v37.)"""
    by %= len(trees)
    return trees[by:] + trees[:by]


def run(kind: str, trees: list[tuple[str, Path]], rounds: int, out: Path, timeout_s: float, n: int = SEQLEN,
        only: str | None = None) -> None:
    selected(kind, only)  # (a bad --only stops here, before any process starts)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trees.txt").write_text(" ".join(label for label, _ in trees) + "\n")
    script = Path(__file__).resolve()
    for r in range(1, rounds + 1):
        for label, tree in rotated(trees, r - 1):
            env = dict(os.environ, FLEXGEN_CACHE_DIR=f"/tmp/kernel_ab_cache_{label}",
                       PYTHONPATH=os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p))
            cmd = ["ncu", "--clock-control", "base", "--kernel-name", f"regex:{KERNEL[kind]}",
                   "--metrics", "gpu__time_duration.sum", "--csv", sys.executable, str(script), "cases", "--kind", kind,
                   "--seqlen", str(n)] + (["--only", only] if only else [])
            path = out / f"ncu_{label}_r{r}.csv"
            with open(path, "w") as f:
                rc = subprocess.run(cmd, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
            print(f"{label} round {r}: rc {rc} -> {path.name}", flush=True)


def launches(path: Path) -> dict[str, dict[str, list[float]]]:
    """{'<D> <variant>': {kernel name: [ns of each launch but the first]}} from one ncu CSV (the CASE lines give the
    order; bwd_all times the backward's three kernels per call, in launch order)."""
    lines = path.read_text().splitlines()
    cases = [line.split(None, 1)[1] for line in lines if line.startswith("CASE ")]
    rows = csv.DictReader(line for line in lines if line.startswith('"'))
    timed = {int(row["ID"]): (row["Kernel Name"], float(row["Metric Value"].replace(",", "")))
             for row in rows if row["Metric Name"] == "gpu__time_duration.sum"}
    ids = sorted(timed)
    if not cases or not ids or len(ids) % (LAUNCHES * len(cases)):
        raise ValueError(f"{path.name}: {len(ids)} kernel launches for {len(cases)} cases; expected {LAUNCHES} each")
    per_call = len(ids) // (LAUNCHES * len(cases))
    found: dict[str, dict[str, list[float]]] = {}
    for c, case in enumerate(cases):
        for call in range(LAUNCHES * c + 1, LAUNCHES * (c + 1)):
            for i in ids[call * per_call:(call + 1) * per_call]:
                name, ns = timed[i]
                found.setdefault(case, {}).setdefault(name, []).append(ns)
    return found


def _table(found: dict[str, dict[str, list[float]]], order: list[str]) -> list[str]:
    lines = ["| case | " + " | ".join(order) + " |", "|---" * (len(order) + 1) + "|"]
    for case, by_label in found.items():
        base = statistics.median(by_label[order[0]])
        cells = []
        for label in order:
            t = by_label.get(label)
            if not t:
                cells.append("-")
                continue
            med = statistics.median(t)
            cells.append(f"{med / 1e3:.1f} us ({med / base - 1:+.1%}, spread {(max(t) - min(t)) / med:.1%}, n={len(t)})")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def report(folder: Path) -> str:
    """A markdown table: per case, each tree's median microseconds over all rounds, its change against the baseline
    (the first tree `run` was given; else `base`), and the spread (max - min over the median). Where each call timed
    several kernels (bwd_all), a second table gives each kernel's own medians."""
    found: dict[str, dict[str, list[float]]] = {}
    by_kernel: dict[str, dict[str, list[float]]] = {}
    for path in sorted(folder.glob("ncu_*_r*.csv")):
        label = re.match(r"ncu_(.+)_r\d+\.csv$", path.name)[1]
        for case, kernels in launches(path).items():
            found.setdefault(case, {}).setdefault(label, []).extend(sum(t) for t in zip(*kernels.values()))
            if len(kernels) > 1:
                for name, times in kernels.items():
                    by_kernel.setdefault(f"{case}: {name}", {}).setdefault(label, []).extend(times)
    labels = sorted({label for by_label in found.values() for label in by_label})
    listed = folder / "trees.txt"  # (written by run: the trees in the order given, the baseline first)
    order = [t for t in listed.read_text().split() if t in labels] if listed.exists() else []
    order += [label for label in sorted(labels, key=lambda t: t != "base") if label not in order]
    lines = _table(found, order)
    if by_kernel:
        lines += ["", "By kernel:", ""] + _table(by_kernel, order)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cases", help="run the launches (under ncu)")
    c.add_argument("--kind", choices=sorted(KERNEL), required=True)
    c.add_argument("--seqlen", type=int, default=SEQLEN)
    c.add_argument("--only", default=None, help="HEAD_DIM:VARIANT,... (default: every case of the kind)")
    r = sub.add_parser("run", help="on the GPU machine: every tree under ncu, alternated")
    r.add_argument("--kind", choices=sorted(KERNEL), required=True)
    r.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR", help="first: the baseline")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--timeout", type=float, default=200.0, help="seconds per process")
    r.add_argument("--seqlen", type=int, default=SEQLEN, help="N of every case, at bench_attention.py's tokens per "
                   "batch (short N: the fixed costs per work tile weigh more)")
    r.add_argument("--only", default=None, help="HEAD_DIM:VARIANT,... (default: every case of the kind)")
    s = sub.add_parser("report", help="the table from a run's CSVs")
    s.add_argument("folder", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "cases":
        run_cases(args.kind, n=args.seqlen, only=args.only)
    elif args.cmd == "run":
        trees = []
        for item in args.tree:
            label, sep, folder = item.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z0-9-]+", label) or not (Path(folder) / "flexgen").is_dir():
                p.error(f"--tree {item!r}: expected LABEL=DIR (LABEL letters, digits, '-'), DIR holding a flexgen tree")
            trees.append((label, Path(folder).resolve()))
        run(args.kind, trees, args.rounds, args.out, args.timeout, n=args.seqlen, only=args.only)
        print(report(args.out))
    else:
        print(report(args.folder))


if __name__ == "__main__":
    main()
