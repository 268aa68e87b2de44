"""Probe for the sm_90a wgmma building blocks (flexgen/templates/sm90/wgmma.cuh) and the
wgmma.mma_async wrappers the kernels emit (flexgen/templates/sm90/wgmma_mma.j2).

Compiles wgmma_probe.cu (beside this script) with NVRTC for sm_90a and, on a Hopper GPU,
runs C = A @ B.T (A, B: 64 x K bf16, C: 64 x 64 fp32) for each shared-memory layout,
C = P @ V with P from registers and V MN-major (the forward's O += P V), and C = A.T @ B with both read
MN-major from shared memory (the D = 256 backward's dV += P^T dO), and compares with torch. Checks at once: the matrix descriptors (start address, LBO, SBO, swizzle
bits), the 128-byte-swizzled and the non-swizzled operand layouts, the fence / commit / wait
sequence and the accumulator -> (row, col) mapping.

    python benchmarks/probes/wgmma_probe.py                 # every mode; exit 1 on a mismatch
    python benchmarks/probes/wgmma_probe.py --mode none     # only the non-swizzled descriptor
    python benchmarks/probes/wgmma_probe.py --compile-only  # no GPU needed: ptxas report

On a mismatch it also tries the descriptor with LBO and SBO swapped, and prints which 8 x 8
blocks of C are wrong (rows of blocks = 8-row groups of A, columns = 8-column groups of B).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flexgen.cache import nvrtc  # noqa: E402
from flexgen.cache.ptxas import parse_resources  # noqa: E402
from flexgen.codegen.render import environment  # noqa: E402

SM90 = ROOT / "flexgen" / "templates" / "sm90"
PROBE_SOURCE = Path(__file__).with_name("wgmma_probe.cu")
FLAGS = ["--gpu-architecture=sm_90a", "-std=c++17", "-default-device", "--ptxas-options=-v"]
TOLERANCE = 1e-2  # max |C - ref| / max |ref|; bf16 inputs are exact in fp32, so real errors are ~1e-6


@dataclass(frozen=True)
class Mode:
    entry: str
    k: int
    lbo: int  # bytes
    sbo: int  # bytes
    pv: bool = False  # C = A @ B (A from registers, B MN-major) instead of A @ B.T
    at: bool = False  # C = A.T @ B (A and B in shared memory, both MN-major)


MODES = {
    # 128-byte swizzle: SBO = 8 rows * 128 bytes; LBO is implied by the swizzle (16 by convention).
    "sw128": Mode("wgmma_probe_sw128_k64", 64, lbo=16, sbo=1024),
    # K = 128: two 64-column panels per tile, so the K steps cross a panel boundary.
    "sw128-k128": Mode("wgmma_probe_sw128_k128", 128, lbo=16, sbo=1024),
    # No swizzle, 8x8 core matrices with K blocks outer: LBO (along K) = 8 * 128, SBO (along M/N) = 128.
    "none": Mode("wgmma_probe_interleave_k64", 64, lbo=1024, sbo=128),
    # O += P V of the sm90 forward: A from registers, B = V (64 x 64, [k][n]) MN-major, 128-byte swizzle.
    # MN-major: SBO = next 8-row group along K (1024); LBO = next 64-column panel along N (unused at N = 64).
    "pv-mn-sw128": Mode("wgmma_probe_pv_sw128_n64", 64, lbo=8192, sbo=1024, pv=True),
    # dV += P^T dO of the D = 256 backward: A = P^T stored as P ([k][m], m contiguous) read MN-major (imm-trans-a),
    # B = dO ([k][n]) MN-major, both 128-byte swizzled; the MN-major LBO / SBO for both.
    "at-mn-sw128": Mode("wgmma_probe_at_sw128_n64", 64, lbo=8192, sbo=1024, at=True),
}


# The probe's products, from the kernels' own emitter: m64n64k16 bf16 with both operands in shared
# memory (K-major; the first k-step and the accumulating ones), A in registers with B MN-major, and both
# MN-major in shared memory.
WRAPPERS = """{% import "sm90/wgmma_mma.j2" as wgmma %}
{{ wgmma.mma("probe_mma_ss_first", 64, "bf16", first=true) }}
{{ wgmma.mma("probe_mma_ss", 64, "bf16") }}
{{ wgmma.mma("probe_mma_rs", 64, "bf16", a_in_registers=true, b_mn_major=true) }}
{{ wgmma.mma("probe_mma_tt", 64, "bf16", a_mn_major=true, b_mn_major=true) }}
"""


def source() -> str:
    header = (SM90 / "wgmma.cuh").read_text().replace("#pragma once\n", "")
    return header + "\n" + environment().from_string(WRAPPERS).render() + "\n" + PROBE_SOURCE.read_text()


def compile_probe():
    """-> (cubin, ptxas log, {entry: resources}); raises CompilerFailure with the log."""
    out = nvrtc.compile(source(), FLAGS, name="wgmma_probe.cu")
    # NVRTC 13.0 (the H200 image) sometimes returns no ptxas report at all: no resources then.
    report = "Compiling entry function" in out.log
    return out.cubin, out.log, {m.entry: parse_resources(out.log, m.entry) for m in MODES.values()} if report else {}


def ptx() -> str:
    return nvrtc.ptx(source(), FLAGS, name="wgmma_probe.cu")


def run(cubin: bytes, mode: Mode, lbo: int, sbo: int, seed: int = 0):
    """Launch one probe on the current GPU -> (C, reference)."""
    import numpy as np
    import torch
    from cupy.cuda import function

    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, mode.k, generator=g).to(torch.bfloat16).cuda()
    b = torch.randn(64, mode.k, generator=g).to(torch.bfloat16).cuda()
    c = torch.full((64, 64), float("nan"), device="cuda")
    module = function.Module()
    module.load(cubin)
    fn = module.get_function(mode.entry)
    torch.cuda.synchronize()
    fn((1, 1, 1), (128, 1, 1), (np.uint64(a.data_ptr()), np.uint64(b.data_ptr()), np.uint64(c.data_ptr()),
                                np.uint32(lbo), np.uint32(sbo)))
    torch.cuda.synchronize()
    a_ref, b_ref = a.float().cpu(), b.float().cpu()
    ref = a_ref.T @ b_ref if mode.at else a_ref @ (b_ref if mode.pv else b_ref.T)
    return c.cpu(), ref


def rel_error(c, ref) -> float:
    return float((c - ref).abs().nan_to_num(float("inf")).max() / ref.abs().max())


def bad_blocks(c, ref) -> str:
    """8 x 8 map of the 8x8 blocks of C: '.' right, 'X' wrong."""
    err = (c - ref).abs().nan_to_num(float("inf")) > TOLERANCE * ref.abs().max()
    blocks = err.reshape(8, 8, 8, 8).any(dim=3).any(dim=1)
    return "\n".join("    " + "".join("X" if x else "." for x in row) for row in blocks.tolist())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=[*MODES, "all"], default="all")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    cubin, _, resources = compile_probe()
    for entry, r in resources.items():
        print(f"{entry}: {r['registers']} registers, {r['shared_static_bytes']} bytes smem, "
              f"spills {r['spill_stores_bytes']}/{r['spill_loads_bytes']} bytes")
    if args.compile_only:
        return 0

    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("no sm_90 GPU: compiled only", file=sys.stderr)
        return 2

    failed = 0
    for name in MODES if args.mode == "all" else [args.mode]:
        mode = MODES[name]
        c, ref = run(cubin, mode, mode.lbo, mode.sbo, args.seed)
        err = rel_error(c, ref)
        ok = err <= TOLERANCE
        print(f"{name:11s} K={mode.k:3d} lbo={mode.lbo:4d} sbo={mode.sbo:4d}: max rel error {err:.3e}  "
              f"{'OK' if ok else 'MISMATCH'}")
        if not ok:
            failed += 1
            print(bad_blocks(c, ref))
            c2, _ = run(cubin, mode, mode.sbo, mode.lbo, args.seed)
            err2 = rel_error(c2, ref)
            print(f"    with LBO and SBO swapped (lbo={mode.sbo}, sbo={mode.lbo}): max rel error {err2:.3e}"
                  f"{'  <- these are right' if err2 <= TOLERANCE else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
