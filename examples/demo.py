#!/usr/bin/env python3
"""flexgen, end to end, in one script (`make demo`).

Without a GPU: traces the built-in variants and a few user functions to IR, shows the
text form and structural hashes, builds block masks on the CPU, emits the generated
CUDA for one variant and, if NVRTC is installed, compiles it and prints the resource
report. With a GPU it also runs flex_attention on a few variants and checks each
against the float64 reference.

Each section reports its own failure and the script goes on; it exits nonzero at the
end if any section failed.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import flexgen  # noqa: E402

FAILED: list[str] = []
SECTIONS: list[tuple[str, str]] = []


def section(title: str):
    """Run the decorated function as a titled section; record a failure and go on."""

    def wrap(fn):
        print(f"\n{'=' * 78}\n{title}\n{'=' * 78}", flush=True)
        t0 = time.perf_counter()
        try:
            status = fn() or "ok"
        except Exception as e:  # keep going: the other sections still say something
            traceback.print_exc(limit=6)
            msg = str(e).splitlines()[0] if str(e) else ""
            print(f"\n!! section failed: {type(e).__name__}: {msg}")
            FAILED.append(title)
            status = "FAILED"
        SECTIONS.append((title, f"{status} ({time.perf_counter() - t0:.1f}s)"))
        return fn

    return wrap


def short_hash(mod) -> str:
    return mod.structural_hash[:16]


def show(label: str, mod) -> None:
    params = ", ".join(f"{k}={v}" for k, v in mod.params.items())
    buffers = ", ".join(f"{b.name}: {b.dtype}[{b.ndim}d]" for b in mod.buffer_specs)
    print(f"{label:<26} {mod.kind}_mod  hash {short_hash(mod)}")
    print(f"{'':<26} {mod.pretty()}")
    if params or buffers:
        print(f"{'':<26} params: {params or '-'}   buffers: {buffers or '-'}")


# ---------------------------------------------------------------- shared objects

v = flexgen.variants
HEADS = 8
DOC_IDS = torch.repeat_interleave(torch.arange(4), torch.tensor([300, 500, 200, 1048])).to(torch.int32)
REL_TABLE = torch.randn(HEADS, 2 * 2048 - 1)
BUILT_INS = {
    "causal": v.causal,
    "sliding_window(1024)": v.sliding_window(1024),
    "prefix_lm(256)": v.prefix_lm(256),
    "document(doc_ids)": v.document(DOC_IDS),
    "alibi(8)": v.alibi(HEADS),
    "softcap(30)": v.softcap(30.0),
    "relative_bias(table)": v.relative_bias(REL_TABLE),
}


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


GRID = 32  # a 32 x 32 image, flattened row-major


def natten(b, h, q_idx, kv_idx):
    """2-D neighbourhood attention: a 5 x 5 window around each pixel."""
    qy, qx = q_idx // GRID, q_idx % GRID
    ky, kx = kv_idx // GRID, kv_idx % GRID
    return (torch.abs(qy - ky) <= 2) & (torch.abs(qx - kx) <= 2)


HEAD_BIAS = torch.linspace(-1.0, 1.0, HEADS)


def per_head_bias(score, b, h, q_idx, kv_idx):
    return score + HEAD_BIAS[h] * torch.where(q_idx >= kv_idx, 1.0, 0.0)


def streaming(b, h, q_idx, kv_idx):
    """Attention sinks plus a causal window (StreamingLLM)."""
    return (kv_idx < 4) | ((q_idx >= kv_idx) & (q_idx - kv_idx < 256))


# ---------------------------------------------------------------- sections


@section("1. Built-in variants: traced IR and structural hashes")
def _builtins():
    for label, mod in BUILT_INS.items():
        show(label, mod)
    same = v.sliding_window(128).structural_hash == v.sliding_window(4096).structural_hash
    print(f"\nsliding_window(128) and sliding_window(4096) share one kernel (same hash): {same}")
    if not same:
        raise AssertionError("window sizes should be run-time parameters")


@section("2. User functions (FlexAttention style) and the text form")
def _user():
    user = {
        "tanh_softcap (function)": flexgen.score_mod(tanh_softcap),
        "natten 5x5 (function)": flexgen.mask_mod(natten),
        "per_head_bias (buffer)": flexgen.score_mod(per_head_bias),
        "streaming (function)": flexgen.mask_mod(streaming),
        "and_masks(causal, doc)": flexgen.and_masks(v.causal, v.document(DOC_IDS, causal=False)),
        "or_masks(sinks, window)": flexgen.or_masks(lambda b, h, q, kv: kv < 4, v.sliding_window(256)),
    }
    for label, mod in user.items():
        show(label, mod)
    # the text form and the function form of one variant give the same IR
    text = flexgen.score_mod("cap * tanh(score / cap)", cap=30.0)
    fn = flexgen.score_mod(lambda score, b, h, q_idx, kv_idx, *, cap: cap * torch.tanh(score / cap), cap=30.0)
    print()
    show("text form", text)
    show("function form", fn)
    print(f"text form == function form == softcap(30): "
          f"{text.structural_hash == fn.structural_hash == v.softcap(30.0).structural_hash}")
    # a traced Mod is still callable on tensors (what the CPU reference uses)
    q = torch.arange(6).view(-1, 1)
    kv = torch.arange(6).view(1, -1)
    print("\nstreaming-style mask evaluated on a 6 x 6 grid (mask_mod called on tensors):")
    small = flexgen.or_masks(lambda b, h, q, kv: kv < 1, v.sliding_window(2))(0, 0, q, kv)
    for row in small.tolist():
        print("   " + " ".join("x" if x else "." for x in row))
    # errors point at the user's line
    try:
        flexgen.mask_mod(lambda b, h, q_idx, kv_idx: q_idx > kv_idx if q_idx > 0 else True)
    except Exception as e:
        print(f"\ndata-dependent Python control flow is reported clearly:\n  {type(e).__name__}: {str(e).splitlines()[0]}")


@section("3. Block masks on the CPU (no N x N tensor)")
def _masks():
    n = 1024
    for label, mask, kwargs in [
        ("causal", v.causal, {}),
        ("sliding_window(256)", v.sliding_window(256), {}),
        ("document(doc_ids)", v.document(DOC_IDS[:n]), {}),
        ("natten 5x5 on 32x32", natten, {"BLOCK_SIZE": 64}),
    ]:
        t0 = time.perf_counter()
        bm = flexgen.create_block_mask(mask, None, None, n, n, device="cpu", **kwargs)
        print(f"\n{label}  ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
        print(repr(bm))
    t0 = time.perf_counter()
    big = flexgen.create_block_mask(v.causal, None, None, 131072, 131072, device="cpu")
    print(f"\ncausal at 128k x 128k: {(time.perf_counter() - t0):.2f} s, "
          f"{big.kv_indices.numel() * 4 / 2**20:.0f} MiB of indices, sparsity {big.sparsity():.1f}%")


EMITTED: dict = {}


@section("4. Generated CUDA for softcap(30) + causal (bf16, D=128, sm_90a)")
def _emit():
    src = flexgen.emit("fwd", v.softcap(30.0), v.causal, head_dim=128, dtype="bf16", arch="sm_90a")
    EMITTED["src"] = src
    lines = src.splitlines()
    print(f"{len(lines)} lines, {len(src)} characters. The variant's part:\n")
    start = next((i for i, line in enumerate(lines) if "struct ModArgs" in line), None)
    if start is None:
        print("\n".join(lines[:40]))
    else:
        end = start
        for i in range(start, min(len(lines), start + 40)):
            end = i
            if lines[i].startswith("__device__") and "mask_mod" in lines[i]:
                while end < len(lines) - 1 and lines[end].strip() != "}":
                    end += 1
                break
        print("\n".join("    " + line for line in lines[max(0, start - 2): end + 1]))
    entry = next((line.strip() for line in lines if 'extern "C"' in line), None)
    if entry:
        print(f"\nentry point: {entry}")


@section("5. Compile with NVRTC and read the resource report")
def _compile():
    try:
        from cupy_backends.cuda.libs import nvrtc

        major, minor = nvrtc.getVersion()
    except Exception as e:
        print(f"NVRTC is not available here ({type(e).__name__}); pip install 'flexgen-attention[cuda13]' to compile. Skipped.")
        return "skipped (no NVRTC)"
    print(f"NVRTC {major}.{minor}")
    t0 = time.perf_counter()
    kernel = flexgen.compile("fwd", v.softcap(30.0), v.causal, head_dim=128, dtype="bf16", arch="sm_90a")
    print(f"{kernel}  ({time.perf_counter() - t0:.2f} s, from the cache if it was built before)")
    r = kernel.resources
    print(f"registers {r['registers']}, static smem {r['shared_static_bytes']} B, stack frame {r['stack_frame_bytes']} B, "
          f"spill stores {r['spill_stores_bytes']} B, spill loads {r['spill_loads_bytes']} B, barriers {r['barriers']}")
    print(f"cubin {len(kernel.cubin)} bytes; flags: {' '.join(kernel.flags)}")
    if r["spill_stores_bytes"] or r["spill_loads_bytes"]:
        print("note: the kernel spills registers to local memory")


def _gpu_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


if _gpu_available():

    @section(f"6. On the GPU ({torch.cuda.get_device_name()}): flex_attention against reference_attention")
    def _gpu():
        torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
        B, H, L, D = 2, HEADS, 1000, 64
        doc = torch.randint(0, 4, (L,), device="cuda").sort().values.to(torch.int32)
        cases = [
            ("causal", None, v.causal),
            ("sliding_window(128)", None, v.sliding_window(128)),
            ("document", None, v.document(doc)),
            ("alibi + causal", v.alibi(H), v.causal),
            ("softcap(30) + causal", v.softcap(30.0), v.causal),
            ("user natten + tanh_softcap", tanh_softcap, natten),
        ]
        worst = 0.0
        for label, score, mask in cases:
            q, k, vv = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            bm = flexgen.create_block_mask(mask, None, None, L, L, device="cuda") if mask is not None else None
            t0 = time.perf_counter()
            out = flexgen.flex_attention(q, k, vv, score_mod=score, block_mask=bm)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            # float64 inputs: the reference returns its output in the inputs' dtype
            ref = flexgen.reference_attention(q.double(), k.double(), vv.double(), score_mod=score, mask_mod=mask)
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            nan = bool(torch.isnan(out).any())
            worst = max(worst, rel if not nan else float("inf"))
            print(f"{label:<28} ||out - ref|| / ||ref|| = {rel:.2e}{'  NaN!' if nan else ''}   (first call {first:.2f} s)")
        if not worst < 1e-2:
            raise AssertionError(f"relative error {worst:.2e} is above bf16's 1e-2")

else:
    print("\n(no CUDA GPU of sm_80 or newer here: the GPU section is skipped)")


# ---------------------------------------------------------------- summary

print(f"\n{'=' * 78}\nsummary")
for title, status in SECTIONS:
    print(f"  {status:<22} {title}")
if FAILED:
    print(f"\n{len(FAILED)} section(s) failed")
    sys.exit(1)
print("\nall sections ok")
