"""The SASS of flexgen's sm90 kernel and FlashAttention-4's for the same case, both built without a GPU, with each
basic block's instruction count, opcode mix and the spacing of its MUFU instructions: the comparison
docs/backward.md asks for, at no device time.

    python3 benchmarks/sass_side_by_side.py --kind bwd --variant causal --fa4-python /tmp/fa4venv/bin/python

flexgen's kernel comes from this tree (NVRTC, through flexgen's kernel cache). FA4's comes from its own CPU-only path
(FLASH_ATTENTION_ARCH=sm_90, CUTE_DSL_ARCH=sm_90a, fake CUDA tensors), run in `--fa4-python`: a Python with
flash-attn-4 and nvidia-cutlass-dsl installed (both have CPU wheels; for Python 3.11 take the cp311 ones of the
versions benchmarks/fa4_setup.sh names, plus triton). nvdisasm comes from pip's nvidia-cuda-nvdisasm
(`--nvdisasm`). Variants: full, causal and sliding1024 (causal within 1024 keys: flexgen's sliding_window(1024) over
128 x 128 mask blocks, FA4's window_size (1023, 0)). Blocks of fewer than `--min-block` instructions are left out of
the listing; `--out DIR` keeps both disassemblies.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # flexgen from this tree
sys.path.insert(0, str(Path(__file__).resolve().parent))
from samples_by_count import opcode  # noqa: E402

# Runs in FA4's Python: compiles one forward and one backward on fake CUDA tensors, keeping the cubins.
FA4_COMPILE = """
import sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
variant, d = sys.argv[1], int(sys.argv[2])
causal = variant != "full"
window = (int(variant[len("sliding"):]) - 1, 0) if variant.startswith("sliding") else (None, None)
with FakeTensorMode(allow_non_fake_inputs=True):
    q, k, v, do = (torch.empty(2, 8192, 16, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    out, lse = _flash_attn_fwd(q, k, v, causal=causal, window_size_left=window[0], window_size_right=window[1],
                               return_lse=True)[:2]
    _flash_attn_bwd(q, k, v, out, do, lse, causal=causal, window_size_left=window[0], window_size_right=window[1])
"""


def instructions_and_labels(sass: str) -> tuple[list[str], dict[str, int]]:
    """nvdisasm -c output as its instructions' texts (address and `;` dropped) and, per label, the index of the
    instruction that follows it."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        elif line.strip().startswith("/*") and "*/" in line and ";" in line:
            text = line.split("*/", 1)[1].split(";", 1)[0].strip()
            if text:
                instructions.append(text)
    return instructions, labels


def bare_opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers."""
    return opcode(text).split(".")[0]


def basic_blocks(sass: str) -> list[tuple[str, list[str]]]:
    """(label, opcodes) per basic block of nvdisasm's output; predicates dropped, modifiers kept off."""
    instructions, labels = instructions_and_labels(sass)
    starts = [("entry", 0)] + sorted(labels.items(), key=lambda item: item[1])
    ends = [start for _, start in starts[1:]] + [len(instructions)]
    return [(label, [bare_opcode(t) for t in instructions[start:end]]) for (label, start), end in zip(starts, ends)]


CLOSE_MUFU_GAP = 2  # instructions from one MUFU to the next, at most, for the pair to count as close


def mufu_spacing(ops: list[str]) -> tuple[int, int]:
    """(MUFU gaps, of them close) in one block: a warp's MUFU holds the quarter-rate unit for 8 cycles, so MUFUs one
    or two instructions apart issue at the unit's rate, not the scheduler's (docs/backward.md, "For the next
    backward")."""
    at = [i for i, op in enumerate(ops) if op == "MUFU"]
    gaps = [b - a for a, b in zip(at, at[1:])]
    return len(gaps), sum(g <= CLOSE_MUFU_GAP for g in gaps)


def report(name: str, sass: str, min_block: int) -> None:
    blocks = basic_blocks(sass)
    print(f"== {name}: {sum(len(ops) for _, ops in blocks)} instructions in {len(blocks)} blocks")
    for label, ops in blocks:
        if len(ops) >= min_block:
            mix = collections.Counter(ops).most_common(10)
            gaps, close = mufu_spacing(ops)
            spacing = f"  [MUFU gaps <= {CLOSE_MUFU_GAP}: {close} of {gaps}]" if gaps else ""
            print(f"  {label:10s} {len(ops):5d}  " + " ".join(f"{op}={n}" for op, n in mix) + spacing)


def flexgen_cubin(kind: str, variant: str, head_dim: int) -> bytes:
    from flexgen import variants as V
    from flexgen.cache import jit
    from flexgen.codegen.api import make_spec

    mask = {"full": None, "causal": V.causal, "sliding1024": V.sliding_window(1024)}[variant]
    spec = make_spec(kind, None, mask, head_dim=head_dim, dtype="bf16", arch="sm_90a",
                     mask_block=(128, 128) if mask is not None else None, family="sm90")
    return jit.get_kernel(spec).cubin


def fa4_cubin(kind: str, variant: str, head_dim: int, python: str, dump: Path) -> bytes:
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132",
               CUTE_DSL_KEEP_CUBIN="1", CUTE_DSL_DUMP_DIR=str(dump))
    subprocess.run([python, "-c", FA4_COMPILE, variant, str(head_dim)], env=env, cwd=dump, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    found = sorted(dump.glob(f"*flash_{kind}_sm90FlashAttention*.cubin"))
    if not found:
        sys.exit(f"FA4 wrote no {kind} cubin into {dump}")
    return found[-1].read_bytes()


def disassemble(cubin: bytes, nvdisasm: str, keep: Path | None, name: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], check=True, capture_output=True, text=True).stdout
    if keep is not None:
        (keep / f"{name}.sass").write_text(sass)
    return sass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("fwd", "bwd"), default="bwd")
    p.add_argument("--variant", choices=("full", "causal", "sliding1024"), default="causal")
    p.add_argument("--head-dim", type=int, choices=(64, 96, 128), default=128)
    p.add_argument("--fa4-python", required=True, help="a Python with flash-attn-4 and nvidia-cutlass-dsl")
    p.add_argument("--nvdisasm", default="nvdisasm")
    p.add_argument("--min-block", type=int, default=25)
    p.add_argument("--out", type=Path, default=None, help="keep both disassemblies here")
    args = p.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    ours = flexgen_cubin(args.kind, args.variant, args.head_dim)
    with tempfile.TemporaryDirectory() as dump:
        theirs = fa4_cubin(args.kind, args.variant, args.head_dim, args.fa4_python, Path(dump))
    case = f"{args.kind} {args.variant} D={args.head_dim}"
    report(f"flexgen {case}", disassemble(ours, args.nvdisasm, args.out, "flexgen"), args.min_block)
    report(f"FA4 {case}", disassemble(theirs, args.nvdisasm, args.out, "fa4"), args.min_block)


if __name__ == "__main__":
    main()
