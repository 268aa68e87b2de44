"""Fingerprints (PTX hashes) of a fixed set of kernels, to show that a template refactor changes no
generated code, on a machine without a GPU.

    python benchmarks/ptx_fingerprint.py before.json                       # record
    python benchmarks/ptx_fingerprint.py after.json --compare before.json  # exit 1 if any kernel changed

Covers both forward families, with and without dropout, at D=64 and 128 with a plain mask, a
buffer-reading mask with a score_mod, a per-element score load and a transcendental score_mod; the sm90
forward over three warpgroups with P through shared memory at D=96 and 128 (causal under a block mask); and
the backward with two of them: sm80 at D=64 with and without dropout, sm90 at D=64, 128 and 256 (its
own layout), with dropout at D=64 and 128 and in deterministic mode at D=128. Comments and the module-level copies of constants are dropped from the PTX before
hashing (renaming or moving a constexpr changes only those).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgen import variants as V  # noqa: E402
from flexgen.cache import nvrtc  # noqa: E402
from flexgen.codegen.api import make_spec  # noqa: E402
from flexgen.codegen.render import render  # noqa: E402

FLAGS = ["--gpu-architecture=sm_90a", "-std=c++17", "-default-device"]


def cases() -> dict:
    doc = torch.zeros(64, dtype=torch.int32)
    return {"causal": (None, V.causal), "alibi_document": (V.alibi(4), V.document(doc)),
            "relative_bias": (V.relative_bias(torch.randn(4, 63)), None), "softcap_causal": (V.softcap(30.0), V.causal)}


def fingerprints() -> dict[str, str]:
    out = {}
    for family in ("sm80", "sm90"):
        for head_dim in (64, 128):
            for name, (score, mask) in cases().items():
                for dropout in (False, True):
                    spec = make_spec("fwd", score, mask, head_dim=head_dim, dtype="bf16", arch="sm_90a",
                                     dropout=dropout, family=family)
                    out[f"{family}-D{head_dim}-{name}{'-dropout' if dropout else ''}"] = _hash(render(spec))
    # The sm90 forward over three warpgroups with P through shared memory (D = 96 and 128, no score_mod).
    for head_dim in (96, 128):
        spec = make_spec("fwd", None, V.causal, head_dim=head_dim, dtype="bf16", arch="sm_90a", family="sm90",
                         mask_block=(128, 128))
        assert spec.block_m == 192, "the case no longer plans the three-warpgroup forward"
        out[f"sm90-D{head_dim}-causal-p-in-smem"] = _hash(render(spec))
    # The backward: sm80 at D=64 with and without dropout; sm90 at D=64, 128 and 256, with dropout at D=64 and 128,
    # and in deterministic mode at D=128.
    bwd = [("sm80", 64, "")] + [("sm80", 64, "dropout")] + [("sm90", head_dim, "") for head_dim in (64, 128, 256)]
    bwd += [("sm90", 64, "dropout"), ("sm90", 128, "dropout"), ("sm90", 128, "deterministic")]
    for family, head_dim, mode in bwd:
        for name in ("causal", "alibi_document"):
            score, mask = cases()[name]
            spec = make_spec("bwd", score, mask, head_dim=head_dim, dtype="bf16", arch="sm_90a",
                             dropout=mode == "dropout", deterministic=mode == "deterministic", family=family)
            out[f"bwd-{family}-D{head_dim}-{name}{'-' + mode if mode else ''}"] = _hash(render(spec))
    return out


_CONSTANT_COPY = re.compile(r"\.global \.align \d+ \.[a-z]+\d+ \w+( = .*)?;$")


def _hash(source: str) -> str:
    ptx = nvrtc.ptx(source, FLAGS, name="k.cu")
    # Comments and the module-level copies of constexpr constants (".global .align 4 .u32 NAME = value;", or
    # without the initializer where the value is 0 or false; the code itself does not read them: it uses the
    # values inlined) are not code.
    code = "\n".join(line for line in ptx.splitlines()
                     if not line.startswith("//") and not _CONSTANT_COPY.match(line))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--compare", help="an earlier output: report the kernels whose PTX differs")
    args = p.parse_args()
    now = fingerprints()
    Path(args.out).write_text(json.dumps(now, indent=1) + "\n")
    if not args.compare:
        print(f"{len(now)} kernels")
        return 0
    before = json.loads(Path(args.compare).read_text())
    changed = sorted(k for k in now if before.get(k) != now[k])
    print(f"{len(now) - len(changed)} of {len(now)} kernels unchanged" + (f"; changed: {', '.join(changed)}" if changed else ""))
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
