"""Probe: does issuing a wgmma stall the issuing warp while the tensor cores run other products?

The sm90 backward lost time four times by issuing a product earlier (docs/backward.md, v24, v27, v28, v32). If a
wgmma's issue returns at once, an early product costs its issuing warp nothing; if the issue waits for room in the
tensor cores' queue, the warp stalls at the instruction and its other work (the dQ staging, the walk) waits too.
This measures it on one CTA (wgmma_issue_probe.cu beside this script): a filler warpgroup queues a number of
m64n128k16 products (about 64 cycles each), and a prober warpgroup then issues 16 groups of m64n64k16
products, with the SM clock read after each issue. Printed: when each of the filler's first 32 issues returned, when
its whole group was issued and done, and when each of the prober's groups was issued and done.

    python benchmarks/probes/wgmma_issue_probe.py                  # a few fillers and group sizes
    python benchmarks/probes/wgmma_issue_probe.py --compile-only   # no GPU needed: ptxas report
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flexgen.cache import nvrtc  # noqa: E402
from flexgen.codegen.render import environment  # noqa: E402

SM90 = ROOT / "flexgen" / "templates" / "sm90"
PROBE_SOURCE = Path(__file__).with_name("wgmma_issue_probe.cu")
FLAGS = ["--gpu-architecture=sm_90a", "-std=c++17", "-default-device", "--ptxas-options=-v"]
WRAPPERS = """{% import "sm90/wgmma_mma.j2" as wgmma %}
{{ wgmma.mma("probe_n128", 128, "bf16") }}
{{ wgmma.mma("probe_n64", 64, "bf16") }}
"""
STAMPS, GROUPS = 32, 16


CONFIGS = ((0, 8), (32, 0), (128, 0), (128, 1), (128, 8), (512, 8))  # (filler, per_group): one kernel each


def source() -> str:
    header = (SM90 / "wgmma.cuh").read_text().replace("#pragma once\n", "")
    entries = "".join(f"PROBE_ENTRY({filler}, {per_group})\n" for filler, per_group in CONFIGS)
    return header + "\n" + environment().from_string(WRAPPERS).render() + "\n" + PROBE_SOURCE.read_text() + entries


def compile_probe():
    """-> NVRTC's output (cubin and ptxas log) for every entry of CONFIGS."""
    return nvrtc.compile(source(), FLAGS, name="wgmma_issue_probe.cu")


def launch(cubin: bytes, filler: int, per_group: int) -> list[int]:
    import numpy as np
    import torch
    from cupy.cuda import function

    out = torch.zeros(128, dtype=torch.int32, device="cuda")
    module = function.Module()
    module.load(cubin)
    fn = module.get_function(f"wgmma_issue_probe_{filler}_{per_group}")
    for _ in range(2):  # the first launch warms the SM up; the second is read
        fn((1, 1, 1), (256, 1, 1), (np.uint64(out.data_ptr()),))
    torch.cuda.synchronize()
    return [int(x) & 0xFFFFFFFF for x in out.cpu().tolist()]


def report(v: list[int], filler: int, per_group: int) -> str:
    lines = [f"filler {filler} x m64n128k16, prober {GROUPS} groups of {per_group} x m64n64k16"]
    stamps = v[:min(filler, STAMPS)]
    lines.append("  filler's issues returned at " + " ".join(str(s) for s in stamps))
    lines.append(f"  filler: all issued at {v[STAMPS]}, done at {v[STAMPS + 1]}")
    lines.append(f"  prober: starts at {v[64]}; groups issued at " + " ".join(str(s) for s in v[65:65 + GROUPS]) +
                 f"; done at {v[65 + GROUPS]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compile-only", action="store_true")
    args = p.parse_args(argv)
    out = compile_probe()
    print("\n".join(line for line in out.log.splitlines() if "registers" in line or "spill" in line))
    if args.compile_only:
        return 0
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("no sm_90 GPU: compiled only", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name())
    for filler, per_group in CONFIGS:
        print(report(launch(out.cubin, filler, per_group), filler, per_group))
    return 0


if __name__ == "__main__":
    sys.exit(main())
