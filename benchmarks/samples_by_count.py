"""Where a kernel's time goes by how often its code runs: ncu's stall samples per SASS instruction, grouped by the
instruction's executed count. In a persistent attention kernel the count tells the code apart: once per KV tile
or query step (the loop), once per work tile (its first step, last product, epilogue), once per CTA; so the share
of samples per group says what a work tile's own code costs against a step's (docs/forward-sm90.md used it).

    ncu -k flexgen_fwd --launch-skip 1 --launch-count 1 --section SourceCounters -o prof \\
        python benchmarks/profile_one.py --variant sliding1024 --seqlen 8192 --fwd-only
    ncu -i prof.ncu-rep --page source --csv --print-source sass > prof_sass.csv
    python benchmarks/samples_by_count.py prof_sass.csv --per 16384 --top 8 [--opcodes]

With `--kernel REGEX` the first kernel whose name matches is read (a CSV of several kernels, FA4's backward with
its pre- and postprocess say; default: the first). Prints the kernel's stall reasons and executed opcode mix, each
executed count with its instructions and share of all samples (largest first), then, for the counts
given with `--per`, the instructions holding the most samples with their two main stall reasons (and with
`--opcodes`, the count's instructions by opcode: what two kernels' steps differ by). Needs no GPU.
"""
from __future__ import annotations

import argparse
import csv
import io
import re
import sys
from dataclasses import dataclass, field


@dataclass
class Instruction:
    offset: int
    source: str
    samples: int
    executed: int
    stalls: dict[str, int] = field(default_factory=dict)


def _int(text: str) -> int:
    text = text.replace(",", "").strip()
    return int(float(text)) if text else 0


def read_instructions(text: str) -> list[Instruction]:
    """The rows of `ncu --page source --csv --print-source sass`: a kernel-name line, the header, one row per
    instruction. Offsets are relative to the first instruction."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    header, body = rows[start], rows[start + 1:]
    col = {name: i for i, name in enumerate(header)}
    stall_cols = [n for n in header if n.startswith("stall_") and "(Not Issued)" not in n]
    out = []
    for row in body:
        if len(row) < len(header) or not row[col["Address"]].startswith("0x"):
            continue
        out.append(Instruction(
            offset=int(row[col["Address"]], 16), source=row[col["Source"]].strip(),
            samples=_int(row[col["Warp Stall Sampling (All Samples)"]]),
            executed=_int(row[col["Instructions Executed"]]),
            stalls={n: _int(row[col[n]]) for n in stall_cols},
        ))
    if out:
        base = out[0].offset
        for ins in out:
            ins.offset -= base
    return out


def kernel_sections(text: str) -> list[tuple[str, str]]:
    """(kernel name, its part of the CSV) per kernel: ncu writes one `"Kernel Name",...` line and one table per
    profiled kernel (FA4's backward, say, profiles as preprocess, main kernel and postprocess)."""
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines(keepends=True):
        if line.startswith('"Kernel Name"'):
            fields = next(csv.reader([line]))
            sections.append((fields[1] if len(fields) > 1 else "", [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            sections.append(("", [line]))
    return [(name, "".join(lines)) for name, lines in sections]


def pick_kernel(text: str, pattern: str | None) -> tuple[str, str]:
    """The first kernel whose name matches `pattern` (a regular expression; None: the first kernel)."""
    sections = kernel_sections(text)
    for name, part in sections:
        if pattern is None or re.search(pattern, name):
            return name, part
    names = ", ".join(name[:80] for name, _ in sections)
    raise SystemExit(f"samples_by_count: no kernel matches {pattern!r}; the CSV has: {names}")


def stall_shares(instructions: list[Instruction]) -> list[tuple[str, float]]:
    """Each stall reason's share of all samples, largest first."""
    total = sum(i.samples for i in instructions) or 1
    sums: dict[str, int] = {}
    for ins in instructions:
        for name, v in ins.stalls.items():
            sums[name] = sums.get(name, 0) + v
    return [(name[len("stall_"):], 100 * v / total) for name, v in sorted(sums.items(), key=lambda kv: -kv[1]) if v]


def executed_by_opcode(instructions: list[Instruction]) -> list[tuple[str, int]]:
    """Warp-level instructions executed per bare opcode (modifiers dropped), most first: the kernel's mix."""
    sums: dict[str, int] = {}
    for ins in instructions:
        op = opcode(ins.source).split(".")[0]
        sums[op] = sums.get(op, 0) + ins.executed
    return sorted(sums.items(), key=lambda kv: -kv[1])


def by_count(instructions: list[Instruction]) -> list[tuple[int, int, int]]:
    """(executed count, instructions, samples) per count, most samples first."""
    groups: dict[int, list[int]] = {}
    for ins in instructions:
        g = groups.setdefault(ins.executed, [0, 0])
        g[0] += 1
        g[1] += ins.samples
    return sorted(((count, n, s) for count, (n, s) in groups.items()), key=lambda t: -t[2])


def opcode(source: str) -> str:
    """The instruction's opcode with its modifiers, its predicate dropped: `@!P0 BRA 0x10` -> `BRA`."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else ""


def opcodes(instructions: list[Instruction], counts: set[int]) -> dict[str, tuple[int, int]]:
    """Per opcode, (instructions, samples) among those executed a number of times in `counts`, most first: what one
    path of the code (a step, the unmasked part of a step) is made of."""
    table: dict[str, list[int]] = {}
    for ins in instructions:
        if ins.executed in counts:
            entry = table.setdefault(opcode(ins.source), [0, 0])
            entry[0] += 1
            entry[1] += ins.samples
    return {op: (n, s) for op, (n, s) in sorted(table.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))}


def report(instructions: list[Instruction], per: list[int], top: int, groups: int, out=sys.stdout,
           with_opcodes: bool = False) -> None:
    total = sum(i.samples for i in instructions) or 1
    executed = sum(i.executed for i in instructions)
    print(f"{len(instructions)} instructions, {total} samples, {executed / 1e6:.1f} M warp instructions executed",
          file=out)
    print("stalls: " + ", ".join(f"{name} {share:.1f}%" for name, share in stall_shares(instructions)[:10]), file=out)
    print("executed: " + ", ".join(f"{op} {n / 1e6:.1f} M" for op, n in executed_by_opcode(instructions)[:16]),
          file=out)
    print("| executed | instructions | samples | share |", file=out)
    print("|---|---|---|---|", file=out)
    for count, n, s in by_count(instructions)[:groups]:
        print(f"| {count} | {n} | {s} | {100 * s / total:.1f}% |", file=out)
    for count in per:
        chosen = [i for i in instructions if i.executed == count]
        share = 100 * sum(i.samples for i in chosen) / total
        print(f"\nexecuted {count}: {len(chosen)} instructions, {share:.1f}% of the samples; the most sampled:", file=out)
        for ins in sorted(chosen, key=lambda i: -i.samples)[:top]:
            reasons = sorted(ins.stalls.items(), key=lambda t: -t[1])[:2]
            why = ", ".join(f"{name[len('stall_'):]} {v}" for name, v in reasons if v)
            print(f"  +{ins.offset:#07x} {ins.samples:6d} ({100 * ins.samples / total:.1f}%)  {why:30s}  {ins.source}",
                  file=out)
        if with_opcodes:
            ops = ", ".join(f"{op} {n} ({s})" for op, (n, s) in opcodes(instructions, {count}).items())
            print(f"  opcodes (instructions (samples)): {ops}", file=out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--kernel", default=None,
                   help="regular expression: the first kernel whose name matches (default: the CSV's first kernel)")
    p.add_argument("--per", default="", help="comma list of executed counts to list instruction by instruction")
    p.add_argument("--top", type=int, default=8, help="instructions listed per chosen count")
    p.add_argument("--groups", type=int, default=20, help="executed counts in the summary table")
    p.add_argument("--opcodes", action="store_true", help="for each --per count, its instructions by opcode")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        name, part = pick_kernel(f.read(), args.kernel)
    instructions = read_instructions(part)
    if not instructions:
        sys.exit(f"samples_by_count: no instruction rows in {args.csv} (expected ncu's source page as CSV)")
    print(f"kernel {name[:100]}")
    report(instructions, [int(c) for c in args.per.split(",") if c], args.top, args.groups, with_opcodes=args.opcodes)


if __name__ == "__main__":
    main()
