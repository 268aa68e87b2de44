#!/usr/bin/env python3
"""flexgen against PyTorch's attention kernels, on the same inputs, in one process.

Protocol (../shared/PEERS.md): 16k tokens per batch (B=8 at N=2k, 2 at 8k, 1 at 16k), H=16,
bf16, Q_LEN = KV_LEN = N; median of triton.testing.do_bench; TFLOP/s count only unmasked
(q, kv) pairs, counted exactly at element level (blockwise on the GPU, never N^2 memory):
fwd FLOPs = 4 * D * pairs * B * H, bwd FLOPs = 2.5 x fwd, bwd time = (fwd+bwd) - fwd.

Implementations:
  flexgen       flexgen.flex_attention with flexgen.create_block_mask(BLOCK_SIZE=128)
  flexgen[...]  the same with --kernel-options tile overrides (a sweep)
  sdpa-flash    F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION) (full, causal)
  sdpa-cudnn    the same under CUDNN_ATTENTION (full, causal)
  flex          torch.compile(flex_attention, dynamic=False), torch's create_block_mask(BLOCK_SIZE=128)
  fa4           FlashAttention-4 (flash_attn.cute.interface.flash_attn_func): built-in causal, window and
                softcap; ALiBi as a CuTe-DSL score_mod; document and prefix-LM masks as CuTe-DSL mask_mods
                with block sparsity from torch's create_block_mask(BLOCK_SIZE=128). Inputs copied once to
                its (B, N, H, D) layout outside the timed calls. In the default set when it imports
                (benchmarks/fa4_setup.sh installs it on the GPU machine); asked for and missing, it is
                recorded as "unavailable (reason)" and the run goes on.
  sdpa-effmask  SDPA's memory-efficient backend with a dense boolean mask (mask-only variants; opt-in)
  sdpa-math     SDPA's math backend (opt-in; the only one that also runs on a CPU)

Variants: full; causal; sliding1024 = causal and q-kv < 1024; alibi-causal = score +
2^(-8(h+1)/H) * (kv - q), causal (alibi: the same without the mask, opt-in); alibi-slopes-causal = the same with the slopes read from a captured
tensor (opt-in; FA4 not set up for it); softcap30-causal = 30 tanh(score/30), causal;
document-causal = packed documents of random lengths in [N/16, N/3), causal within each;
prefix-lm = the first N/4 keys visible to every query, causal otherwise.

Before timing each (variant, shape), every implementation's output is compared with a
float32 reference on a sample of query rows, and flexgen's with a peer's on the whole
output (max |diff| printed): a fast but wrong kernel shows up next to its speed.

Robustness: the measurements run in a worker subprocess; a failing implementation is
recorded as "error" and the run goes on; a crash that takes the CUDA context down ends
the worker, and a fresh one resumes after the failing implementation. Kernels are
compiled up front in a separate process (in parallel threads), so a bad kernel cannot
take the sweep down while compiling.

Outputs (in --out, default $OUT or benchmarks/results): bench_results.json, bench_results.md,
bench_plot.png (if matplotlib is present); the compact table is printed last.

    python3 benchmarks/bench_attention.py                      # the full PEERS protocol
    python3 benchmarks/bench_attention.py --quick              # D=128, N=8k, short timing
    python3 benchmarks/bench_attention.py --variants causal,document-causal --dims 128 --fwd-only
    python3 benchmarks/bench_attention.py --kernel-options '[{"family":"sm80","BLOCK_M":128,"BLOCK_N":64},{"family":"sm80","BLOCK_M":128,"BLOCK_N":128,"num_warps":8}]'
    python3 benchmarks/bench_attention.py --long --skip-sweep  # 64k tokens, one sequence, causal
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback

import flexgen_tree  # noqa: E402  (benchmarks/ is the script's own directory)

ROOT = flexgen_tree.CHECKOUT
TREE = flexgen_tree.select("bench_attention")  # FLEXGEN_TREE: another tree's flexgen, for an end-to-end A/B

DEFAULT_VARIANTS = ["full", "causal", "sliding1024", "alibi-causal", "softcap30-causal", "document-causal", "prefix-lm"]
# Also known (--variants): masks spelled with // and % or as other libraries write them
MORE_VARIANTS = ["sliding-hf1024", "chunked512-causal", "natten15", "softcap30", "alibi", "alibi-slopes-causal"]
NATTEN_WIDTH = 128  # the canvas of the natten<K> variants: 128 tokens wide, N / 128 rows
DEFAULT_IMPLS = ["flexgen", "sdpa-flash", "sdpa-cudnn", "flex"]  # and fa4, when it imports
DEFAULT_LONG_IMPLS = ["flexgen", "sdpa-flash", "flex", "sdpa-effmask"]  # likewise
KNOWN_IMPLS = DEFAULT_IMPLS + ["fa4", "sdpa-effmask", "sdpa-math"]
IMPL_ORDER = ["flexgen", "fa4", "sdpa-flash", "sdpa-cudnn", "flex", "sdpa-effmask", "sdpa-math"]
# the peer whose whole output flexgen's is compared with: the first of these that ran
PEER_PRIORITY = ("sdpa-flash", "sdpa-cudnn", "flex", "sdpa-effmask", "sdpa-math", "fa4")
TOKENS = 16384
HEADS = 16
STICKY_ERRORS = (
    "illegal memory access", "unspecified launch failure", "misaligned address", "illegal instruction",
    "device-side assert", "CUDA_ERROR_ILLEGAL", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_MISALIGNED",
    "hardware exception", "CUDA_ERROR_ASSERT", "launch timed out",
)
EXIT_STICKY = 3


class NotApplicable(Exception):
    """This implementation cannot express the variant (e.g. SDPA with a score_mod)."""


class Unavailable(Exception):
    """This implementation's package does not import here; the message says why."""


def short(e: BaseException, n: int = 220) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    first = next((line for line in text if line.strip()), type(e).__name__)
    return first if len(first) <= n else first[: n - 3] + "..."


def fmt_n(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# ====================================================================== variants


class Variant:
    """score / mask: FlexAttention-style functions; params: the constants they capture (for peers,
    such as fa4, that rebuild the variant in their own terms)."""

    def __init__(self, name, score=None, mask=None, sdpa=None, note="", params=None):
        self.name, self.score, self.mask, self.sdpa, self.note = name, score, mask, sdpa, note
        self.params = params or {}


def document_ids(n: int, device, seed: int = 0):
    """Packed documents of random lengths in [n/16, n/3), the last one cut at n."""
    import torch

    g = torch.Generator().manual_seed(seed + n)
    lo, hi = max(1, n // 16), max(2, n // 3)
    lengths, total = [], 0
    while total < n:
        ell = int(torch.randint(lo, hi, (1,), generator=g))
        lengths.append(ell)
        total += ell
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]
    return ids.to(torch.int32).to(device)


def build_variant(name: str, n: int, heads: int, device) -> Variant:
    """Plain FlexAttention-style functions: flexgen traces them, torch compiles them."""
    import torch

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    if name == "full":
        return Variant(name, sdpa="full")
    if name == "causal":
        return Variant(name, mask=causal, sdpa="causal")
    if name.startswith("sliding-hf"):
        window = int(name[len("sliding-hf"):] or 1024)

        def sliding_window_overlay(b, h, q_idx, kv_idx):  # transformers' spelling of the same window
            return (kv_idx <= q_idx) & (kv_idx > q_idx - window)

        return Variant(name, mask=sliding_window_overlay, note=f"window {window}", params={"window": window})
    if name.startswith("sliding"):
        window = int(name[len("sliding"):] or 1024)

        def sliding_window(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

        return Variant(name, mask=sliding_window, note=f"window {window}", params={"window": window})
    if name.startswith("chunked") and name.endswith("-causal"):
        chunk = int(name[len("chunked"):-len("-causal")])

        def chunked_causal(b, h, q_idx, kv_idx):  # Llama 4's local layers: causal within chunks of `chunk` tokens
            return (q_idx // chunk == kv_idx // chunk) & (q_idx >= kv_idx)

        return Variant(name, mask=chunked_causal, note=f"chunks of {chunk}", params={"chunk": chunk})
    if name.startswith("natten"):
        kernel, width = int(name[len("natten"):] or 15), NATTEN_WIDTH
        rows, half = max(1, n // width), kernel // 2

        def natten(b, h, q_idx, kv_idx):  # a 2-D neighbourhood on a canvas `width` tokens wide, clamped at its edges
            centre_x = (q_idx % width).clamp(half, width - 1 - half)
            centre_y = (q_idx // width).clamp(half, rows - 1 - half)
            return ((kv_idx % width - centre_x).abs() <= half) & ((kv_idx // width - centre_y).abs() <= half)

        return Variant(name, mask=natten, note=f"{kernel} x {kernel} on {rows} x {width}", params={"kernel": kernel})
    if name in ("alibi", "alibi-causal"):
        def alibi(score, b, h, q_idx, kv_idx):
            return score + torch.exp2(-8.0 * (h + 1) / heads) * (kv_idx - q_idx)

        return Variant(name, score=alibi, mask=causal if name == "alibi-causal" else None, params={"heads": heads})
    if name == "alibi-slopes-causal":
        slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)

        def alibi_slopes(score, b, h, q_idx, kv_idx):  # the slopes as a captured tensor, as attention-gym has them
            return score + slopes[h] * (kv_idx - q_idx)

        return Variant(name, score=alibi_slopes, mask=causal, params={"heads": heads})
    if name.startswith("softcap"):
        cap = float(name[len("softcap"):].split("-")[0] or 30)

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        return Variant(name, score=softcap, mask=causal if name.endswith("-causal") else None, params={"cap": cap})
    if name == "document-causal":
        doc = document_ids(n, device)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

        return Variant(name, mask=document_causal, note=f"{int(doc.max()) + 1} documents", params={"doc": doc})
    if name == "prefix-lm":
        prefix = n // 4

        def prefix_lm(b, h, q_idx, kv_idx):
            return (kv_idx < prefix) | (q_idx >= kv_idx)

        return Variant(name, mask=prefix_lm, note=f"prefix {prefix}", params={"prefix": prefix})
    raise KeyError(f"unknown variant {name!r}; known: {', '.join(DEFAULT_VARIANTS + MORE_VARIANTS)}")


def count_pairs(mask, n_q: int, n_kv: int, device) -> int:
    """Unmasked (q, kv) pairs of one (b, h), evaluated at element level a slab of rows at a time."""
    import torch

    if mask is None:
        return n_q * n_kv
    rows = max(1, (1 << 26) // n_kv)
    kv = torch.arange(n_kv, device=device).view(1, n_kv)
    b = torch.zeros((), dtype=torch.int64, device=device)
    h = torch.zeros((), dtype=torch.int64, device=device)
    total = 0
    for start in range(0, n_q, rows):
        q = torch.arange(start, min(start + rows, n_q), device=device).view(-1, 1)
        m = torch.as_tensor(mask(b, h, q, kv)).to(torch.bool)
        total += int(m.expand(q.shape[0], n_kv).sum())
    return total


def dense_mask(mask, n_q: int, n_kv: int, device):
    import torch

    out = torch.empty(n_q, n_kv, dtype=torch.bool, device=device)
    rows = max(1, (1 << 26) // n_kv)
    kv = torch.arange(n_kv, device=device).view(1, n_kv)
    z = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, n_q, rows):
        q = torch.arange(start, min(start + rows, n_q), device=device).view(-1, 1)
        out[start : start + q.shape[0]] = torch.as_tensor(mask(z, z, q, kv)).to(torch.bool)
    return out


# ====================================================================== implementations


def flexgen_impl_name(opts: dict | None) -> str:
    if not opts:
        return "flexgen"
    return "flexgen[" + ",".join(f"{k}={v}" for k, v in opts.items()) + "]"


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


class Impl:
    """setup(variant, q, k, v) -> fn(q, k, v) -> out; may raise NotApplicable."""

    def __init__(self, name: str, kernel_options: dict | None = None):
        self.name = name
        self.kernel_options = kernel_options
        self.mask_build_s = None
        self.mask_peak_mib = None

    def setup(self, variant: Variant, q, k, v):
        import torch
        import torch.nn.functional as F

        n_q, n_kv = q.shape[2], k.shape[2]
        dev = q.device
        base = self.name.split("[")[0]
        if base == "flexgen":
            import flexgen

            opts = self.kernel_options
            bs = (_lcm(128, int((opts or {}).get("BLOCK_M", 128))), _lcm(128, int((opts or {}).get("BLOCK_N", 128))))
            bm = None
            if variant.mask is not None:
                bm = self._timed_mask(lambda: flexgen.create_block_mask(variant.mask, None, None, n_q, n_kv, device=dev, BLOCK_SIZE=bs), dev)
            score = variant.score
            return lambda q, k, v: flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, kernel_options=opts)
        if base == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            bm = None
            if variant.mask is not None:
                bm = self._timed_mask(lambda: create_block_mask(variant.mask, None, None, n_q, n_kv, device=dev, BLOCK_SIZE=128), dev)
            compiled = _compiled_flex()
            score = variant.score
            return lambda q, k, v: compiled(q, k, v, score_mod=score, block_mask=bm)
        if base in ("sdpa-flash", "sdpa-cudnn", "sdpa-math"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            if variant.sdpa is None:
                raise NotApplicable(f"{base} has no score_mod / mask_mod for {variant.name}")
            backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                       "sdpa-math": SDPBackend.MATH}[base]
            is_causal = variant.sdpa == "causal"

            def run(q, k, v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

            return run
        if base == "sdpa-effmask":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            if variant.score is not None:
                raise NotApplicable("sdpa-effmask takes a boolean mask only")
            m = None
            if variant.mask is not None:
                m = self._timed_mask(lambda: dense_mask(variant.mask, n_q, n_kv, dev), dev)

            def run(q, k, v):
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

            return run
        if base == "fa4":
            fa4_import()  # first, so that a missing FA4 says so on any device
            if dev.type != "cuda":
                raise NotApplicable("fa4 runs on CUDA only")
            return fa4_setup(self, variant, q, k, v)
        raise KeyError(f"unknown implementation {self.name!r}; known: {', '.join(KNOWN_IMPLS)}")

    def _timed_mask(self, build, dev):
        import torch

        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        out = build()
        if cuda:
            torch.cuda.synchronize()
            self.mask_peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        self.mask_build_s = time.perf_counter() - t0
        return out


_COMPILED_FLEX = None


def _compiled_flex():
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, 4096)
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


# ====================================================================== FlashAttention-4
#
# FA4 (flash_attn.cute) takes (B, N, H, D) tensors. Each case copies the harness's (B, H, N, D)
# inputs to that layout once, before any timed call, and hands FA4's output back as a (B, H, N, D)
# view (no copy), so the checks and the backward's dout work unchanged. Its user functions are
# CuTe-DSL functions: a score_mod gets (score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors) as
# vectors (score already scaled by 1/sqrt(D)), a score_mod_bwd gets the incoming gradient first,
# and a mask_mod gets (b, h, q_idx, kv_idx, seqlen_info, aux_tensors) as one-element vectors.

cute = cutlass = fa4_utils = None  # CuTe-DSL modules, bound by fa4_import(); the functions below use them
_FA4: dict = {}


def fa4_import() -> dict:
    """FA4's entry points, imported once per process; Unavailable("unavailable (reason)") otherwise."""
    global cute, cutlass, fa4_utils
    if "error" in _FA4:
        raise Unavailable(_FA4["error"])
    if "func" not in _FA4:
        try:
            import cutlass as cutlass_mod
            import cutlass.cute as cute_mod
            from flash_attn.cute import utils as utils_mod
            from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
            from flash_attn.cute.interface import flash_attn_func
        except Exception as e:  # a missing package, or one that fails on import
            _FA4["error"] = f"unavailable ({short(e, 160)})"
            raise Unavailable(_FA4["error"]) from e
        cute, cutlass, fa4_utils = cute_mod, cutlass_mod, utils_mod
        _FA4.update(func=flash_attn_func, sparse=BlockSparseTensorsTorch)
    return _FA4


def fa4_probe(timeout_s: float = 300.0) -> tuple[bool, str]:
    """(True, versions) when FA4 imports in a fresh interpreter of this environment, else (False, reason).
    Run by the driver, in a subprocess: a broken install must not take the driver down."""
    import importlib.util

    try:
        if importlib.util.find_spec("flash_attn") is None:
            return False, "flash_attn is not on sys.path"
    except (ImportError, ValueError) as e:
        return False, short(e)
    code = ("import importlib.metadata as m, flash_attn.cute.interface\n"
            "def v(d):\n"
            "    try: return m.version(d)\n"
            "    except m.PackageNotFoundError: return '(version unknown)'\n"
            "print('flash-attn-4', v('flash-attn-4'), 'nvidia-cutlass-dsl', v('nvidia-cutlass-dsl'))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, f"import took over {timeout_s:.0f}s"
    if r.returncode != 0:
        lines = [line for line in (r.stderr or r.stdout).strip().splitlines() if line.strip()]
        return False, (lines[-1] if lines else f"import exited {r.returncode}")[:200]
    return True, r.stdout.strip()


def fa4_alibi_mods(heads: int):
    """score + 2^(-8(h+1)/H) * (kv - q), and its gradient with respect to the score (the identity)."""
    neg_8_over_h = -8.0 / heads

    @cute.jit
    def fa4_alibi(score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        exponent = (h_idx + cute.full_like(h_idx, 1)).to(cutlass.Float32) * cute.full_like(score, neg_8_over_h)
        slope = cute.math.exp2(exponent)
        return score + slope * (kv_idx - q_idx).to(cutlass.Float32)

    @cute.jit
    def fa4_alibi_bwd(grad, score, b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad

    return fa4_alibi, fa4_alibi_bwd


def fa4_document_causal_mask():
    """Same document (ids in aux_tensors[0]) and causal."""

    @cute.jit
    def fa4_document_causal(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        doc = aux_tensors[0]
        q_doc = fa4_utils.scalar_to_ssa(doc[q_idx[0]], cutlass.Int32)
        kv_doc = fa4_utils.scalar_to_ssa(doc[kv_idx[0]], cutlass.Int32)
        return (q_doc == kv_doc) & (q_idx >= kv_idx)

    return fa4_document_causal


def fa4_prefix_lm_mask(prefix: int):
    """The first `prefix` keys visible to every query, causal otherwise."""

    @cute.jit
    def fa4_prefix_lm(b_idx, h_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        prefix_len = fa4_utils.scalar_to_ssa(prefix, cutlass.Int32)
        return (kv_idx < prefix_len) | (q_idx >= kv_idx)

    return fa4_prefix_lm


def fa4_options(impl: "Impl", variant: Variant, q, k) -> dict:
    """flash_attn_func keyword arguments for a variant; NotApplicable for one FA4 is not set up for here."""
    name, p = variant.name, variant.params
    if name == "full":
        return {}
    if name == "causal":
        return {"causal": True}
    if name.startswith("sliding"):
        # FA4's local window keeps q - window_size[0] <= kv <= q + window_size[1]
        return {"causal": True, "window_size": (p["window"] - 1, 0)}
    if name.startswith("softcap"):
        return {"causal": variant.mask is not None, "softcap": float(p["cap"])}
    if name in ("alibi", "alibi-causal"):
        score_mod, score_mod_bwd = fa4_alibi_mods(p["heads"])
        return {"causal": name == "alibi-causal", "score_mod": score_mod, "score_mod_bwd": score_mod_bwd}
    if name in ("document-causal", "prefix-lm"):
        from torch.nn.attention.flex_attention import create_block_mask

        n_q, n_kv, dev = q.shape[2], k.shape[2], q.device
        # Which blocks to visit, as PyTorch's FLASH backend passes them: KV blocks per query block for
        # the forward, query blocks per KV block for the backward; partial blocks run the mask_mod.
        bm = impl._timed_mask(lambda: create_block_mask(variant.mask, None, None, n_q, n_kv, device=dev, BLOCK_SIZE=128), dev)
        sparse = _FA4["sparse"]
        fwd = sparse(mask_block_cnt=bm.kv_num_blocks, mask_block_idx=bm.kv_indices, full_block_cnt=bm.full_kv_num_blocks,
                     full_block_idx=bm.full_kv_indices, block_size=tuple(bm.BLOCK_SIZE))
        bwd = sparse(mask_block_cnt=bm.q_num_blocks, mask_block_idx=bm.q_indices, full_block_cnt=bm.full_q_num_blocks,
                     full_block_idx=bm.full_q_indices, block_size=tuple(bm.BLOCK_SIZE))
        opts = {"block_sparse_tensors": fwd, "block_sparse_tensors_bwd": bwd}
        if name == "document-causal":
            opts.update(mask_mod=fa4_document_causal_mask(), aux_tensors=[p["doc"].contiguous()])  # int32 ids
        else:
            opts.update(mask_mod=fa4_prefix_lm_mask(int(p["prefix"])))
        return opts
    raise NotApplicable(f"fa4 is not set up for {name}")


def fa4_setup(impl: "Impl", variant: Variant, q, k, v):
    """fn(q, k, v) -> (B, H, N, D) output of FA4 on copies of q, k, v made here, in FA4's layout.
    When q requires grad (the harness's fwd+bwd timing), FA4 runs on leaf tensors of its own, whose
    gradients are cleared before each call, so no layout copy or gradient accumulation is timed."""
    func = fa4_import()["func"]
    opts = fa4_options(impl, variant, q, k)
    plain = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    leaves = [t.detach().requires_grad_(True) for t in plain]  # the same storage, as autograd leaves

    def run(q_in, k_in, v_in):
        args = plain
        if q_in.requires_grad:
            for t in leaves:
                t.grad = None
            args = leaves
        out = func(*args, **opts)
        out = out[0] if isinstance(out, tuple) else out  # flash_attn_func returns (out, lse)
        return out.transpose(1, 2)

    return run


# ====================================================================== timing


def sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, dev, warmup_ms: float, rep_ms: float, grad_to_none=None) -> float:
    """Median milliseconds: triton's do_bench on CUDA, else CUDA events, else the host clock."""
    import torch

    if dev.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))
    fn()
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    est = max(time.perf_counter() - t0, 1e-6) * 1e3
    n_warm = max(1, int(warmup_ms / est))
    n_rep = max(3, min(1000, int(rep_ms / est)))
    for _ in range(n_warm):
        fn()
    times = []
    for _ in range(n_rep):
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


_CLOCK = None  # the worker's gpu_clock.ClockSampler on CUDA: the SM clock of every timing window


def timing_order(impls: list[str], case_index: int, order: str) -> list[str]:
    """The order in which one case's implementations are timed. Back to back under the power cap, a window that comes
    after other windows starts at a lower clock than the first one, so a fixed order favours whoever goes first:
    "rotate" starts each case with the next implementation; "peers-first" and "flexgen-first" fix it."""
    peers_first = sorted(impls, key=lambda s: (s.startswith("flexgen"), s))
    if order == "peers-first":
        return peers_first
    if order == "flexgen-first":
        return sorted(impls, key=lambda s: (not s.startswith("flexgen"), s))
    if order == "rotate":
        shift = case_index % len(peers_first) if peers_first else 0
        return peers_first[shift:] + peers_first[:shift]
    raise ValueError(f"unknown timing order {order!r}; known: rotate, peers-first, flexgen-first")


def timed_ms(fn, dev, warmup_ms: float, rep_ms: float, grad_to_none=None,
             cooldown_s: float = 0.0) -> tuple[float, dict | None]:
    """bench_ms, and the SM clock nvidia-smi saw during it (None without samples): under the H200's power cap a
    100 ms window starts at boost clock and throttles inside, so a figure is read beside its clock. `cooldown_s` of
    idle before the window let each window start from the same power state, whatever ran before it."""
    if cooldown_s > 0:
        if dev.type == "cuda":
            sync(dev)
        time.sleep(cooldown_s)
    t0 = time.time()
    ms = bench_ms(fn, dev, warmup_ms, rep_ms, grad_to_none)
    return ms, (_CLOCK.window(t0, time.time()) if _CLOCK is not None else None)


def peak_of(fn, dev):
    """(peak MiB allocated while fn runs, of which MiB above what was allocated before)."""
    import torch

    if dev.type != "cuda":
        fn()
        return None, None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**20, (peak - base) / 2**20


def is_sticky(e: BaseException, dev) -> bool:
    import torch

    if any(s.lower() in str(e).lower() for s in STICKY_ERRORS):
        return True
    if dev.type == "cuda":
        try:
            torch.cuda.synchronize()
        except Exception:
            return True
    return False


# ====================================================================== the worker


class Events:
    """Progress and results, one JSON object a line, for the driver to read back."""

    # Testing hook for the crash recovery: FLEXGEN_BENCH_FAULT="impl:phase" makes the worker die
    # (as a faulting kernel would) when it begins that phase of that implementation.
    FAULT = os.environ.get("FLEXGEN_BENCH_FAULT", "")

    def __init__(self, path):
        self.f = open(path, "a", buffering=1)

    def emit(self, **rec):
        self.f.write(json.dumps(rec, default=str) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        if self.FAULT and rec.get("event") == "begin" and self.FAULT == f"{rec.get('impl')}:{rec.get('phase')}":
            print(f"FLEXGEN_BENCH_FAULT: dying in {self.FAULT}", flush=True)
            os._exit(EXIT_STICKY)


def rows_reference(q, k, v, variant: Variant, rows):
    """float32 attention for the given query rows (all batches and heads)."""
    import torch

    B, H, n_q, D = q.shape
    n_kv = k.shape[2]
    scale = 1.0 / math.sqrt(D)
    s = torch.matmul(q[:, :, rows].float(), k.float().transpose(-1, -2)) * scale
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    qi = rows.view(1, 1, -1, 1)
    ki = torch.arange(n_kv, device=q.device).view(1, 1, 1, n_kv)
    if variant.score is not None:
        s = torch.as_tensor(variant.score(s, b, h, qi, ki)).float().expand_as(s)
    if variant.mask is not None:
        s = s.masked_fill(~torch.as_tensor(variant.mask(b, h, qi, ki)).to(torch.bool), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v.float())


def sample_rows(n: int, count: int, device):
    import torch

    g = torch.Generator().manual_seed(n)
    edge = min(count // 4, n)
    picked = set(range(edge)) | set(range(max(0, n - edge), n))
    picked |= set(torch.randint(0, n, (count,), generator=g).tolist())
    return torch.tensor(sorted(picked), device=device)


def check_case(outputs: dict, q, k, v, variant, rows_count=256):
    """Max |diff| of each output against float32 rows, and of flexgen's against a peer's output."""
    import torch

    rows = sample_rows(q.shape[2], rows_count, q.device)
    ref = rows_reference(q, k, v, variant, rows)
    rep = {"rows": int(rows.numel()), "row_err": {}, "nan": {}}
    for name, out in outputs.items():
        rep["nan"][name] = bool(torch.isnan(out).any())
        rep["row_err"][name] = float((out[:, :, rows].float() - ref).abs().max())
    peers = [p for p in PEER_PRIORITY if p in outputs]
    rep["peer"] = peers[0] if peers else None
    rep["vs_peer"], rep["vs_fa4"] = {}, {}
    for name, out in outputs.items():
        if name.startswith("flexgen") and peers:
            rep["vs_peer"][name] = float((out.float() - outputs[peers[0]].float()).abs().max())
        if name.startswith("flexgen") and "fa4" in outputs and rep["peer"] != "fa4":
            rep["vs_fa4"][name] = float((out.float() - outputs["fa4"].float()).abs().max())
    peer_err = min((rep["row_err"][p] for p in peers), default=None)
    rep["peer_row_err"] = peer_err
    rep["verdict"] = {}
    for name in outputs:
        if name.startswith("flexgen"):
            base_err = peer_err
        elif name == "fa4":  # judged like flexgen, against the other peers
            base_err = min((rep["row_err"][p] for p in peers if p != "fa4"), default=None)
        else:
            continue
        err = rep["row_err"][name]
        bad = rep["nan"][name] or not math.isfinite(err) or err > max(3e-2, 4 * (base_err or 0.0))
        rep["verdict"][name] = "BAD" if bad else "ok"
    return rep


def run_case(case, args, ev: Events, dev):
    import torch

    D, name, N = case["D"], case["variant"], case["N"]
    B, H = case["B"], case["H"]
    cid = case["id"]
    long_mode = case.get("long", False)
    torch.manual_seed(1234 + N + D)
    q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    variant = build_variant(name, N, H, dev)
    t0 = time.perf_counter()
    pairs = count_pairs(variant.mask, N, N, dev)
    print(f"\n=== {cid}: B={B} H={H} N={N} D={D} pairs/(b,h)={pairs} ({100.0 * pairs / (N * N):.1f}% of N^2)"
          f"{' ' + variant.note if variant.note else ''} [count {time.perf_counter() - t0:.2f}s]", flush=True)
    fwd_flops = 4.0 * D * pairs * B * H
    common = {"id": cid, "D": D, "variant": name, "N": N, "B": B, "H": H, "pairs": pairs, "long": long_mode}

    order = sorted(case["impls"], key=lambda s: (s.startswith("flexgen"), s))  # peers first
    fns, outputs, impls = {}, {}, {}
    for impl_name in order:
        opts = case.get("kernel_options", {}).get(impl_name)
        impl = Impl(impl_name, opts)
        impls[impl_name] = impl
        ev.emit(event="begin", id=cid, impl=impl_name, phase="setup")
        try:
            fn = impl.setup(variant, q, k, v)
            t1 = time.perf_counter()
            out = fn(q, k, v)
            sync(dev)
            first = time.perf_counter() - t1
            fns[impl_name] = fn
            outputs[impl_name] = out
            ev.emit(event="note", id=cid, impl=impl_name, first_call_s=first,
                    mask_build_s=impl.mask_build_s, mask_peak_mib=impl.mask_peak_mib)
            mb = f", mask build {impl.mask_build_s:.2f}s/{impl.mask_peak_mib or 0:.0f}MiB" if impl.mask_build_s is not None else ""
            print(f"  {impl_name:<14} first call {first:6.2f}s{mb}", flush=True)
        except NotApplicable as e:
            ev.emit(event="result", **common, impl=impl_name, status="n/a", error=str(e))
        except Unavailable as e:
            print(f"  {impl_name:<14} {e}", flush=True)
            ev.emit(event="result", **common, impl=impl_name, status="unavailable", error=str(e))
        except Exception as e:
            print(f"  {impl_name:<14} ERROR in setup/first call: {short(e)}", flush=True)
            traceback.print_exc(limit=4)
            ev.emit(event="result", **common, impl=impl_name, status="error", error=short(e))
            if is_sticky(e, dev):
                sys.exit(EXIT_STICKY)

    check = None
    if outputs:
        blame = next((n for n in outputs if n.startswith("flexgen")), next(iter(outputs)))
        ev.emit(event="begin", id=cid, impl=blame, phase="check")
        try:
            check = check_case(outputs, q, k, v, variant, rows_count=128 if long_mode else 256)
            parts = [f"{n} {check['row_err'][n]:.1e}" for n in outputs]
            vs = "; ".join([f"{n} vs {check['peer']} max|diff| {d:.2e}" for n, d in check["vs_peer"].items()]
                           + [f"{n} vs fa4 max|diff| {d:.2e}" for n, d in check["vs_fa4"].items()])
            verdict = " ".join(f"{n}:{vv}" for n, vv in check["verdict"].items())
            print(f"  check: max err vs fp32 rows: {', '.join(parts)}" + (f"; {vs}" if vs else "") + (f"  [{verdict}]" if verdict else ""), flush=True)
            ev.emit(event="check", id=cid, **check)
        except Exception as e:
            print(f"  check failed: {short(e)}", flush=True)
            if is_sticky(e, dev):
                sys.exit(EXIT_STICKY)
    outputs.clear()

    for impl_name in timing_order(list(fns), case.get("index", 0), args.order):
        fn, impl = fns[impl_name], impls[impl_name]
        rec = dict(common, impl=impl_name, status="ok", mask_build_s=impl.mask_build_s, mask_peak_mib=impl.mask_peak_mib,
                   config=impl.kernel_options)
        try:
            ev.emit(event="begin", id=cid, impl=impl_name, phase="fwd")
            rec["fwd_peak_mib"], rec["fwd_extra_mib"] = peak_of(lambda: fn(q, k, v), dev)
            ms, clock = timed_ms(lambda: fn(q, k, v), dev, args.warmup, args.rep, cooldown_s=args.cooldown)
            rec["fwd_ms"], rec["fwd_tflops"] = ms, fwd_flops / (ms * 1e-3) / 1e12
            rec["fwd_mhz"] = clock["mhz"] if clock else None
        except Exception as e:
            print(f"  {impl_name:<14} ERROR timing fwd: {short(e)}", flush=True)
            rec.update(status="error", error=short(e))
            ev.emit(event="result", **rec)
            if is_sticky(e, dev):
                sys.exit(EXIT_STICKY)
            continue
        if not args.fwd_only:
            try:
                ev.emit(event="begin", id=cid, impl=impl_name, phase="bwd")
                qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                dout = torch.randn_like(q)

                def fwd_bwd():
                    fn(qg, kg, vg).backward(dout)

                t1 = time.perf_counter()
                fwd_bwd()
                sync(dev)
                rec["bwd_first_call_s"] = time.perf_counter() - t1
                for t in (qg, kg, vg):
                    t.grad = None
                rec["fb_peak_mib"], rec["fb_extra_mib"] = peak_of(fwd_bwd, dev)
                fb, clock = timed_ms(fwd_bwd, dev, args.warmup, args.rep, grad_to_none=[qg, kg, vg],
                                     cooldown_s=args.cooldown)
                rec["fb_ms"] = fb
                rec["fb_mhz"] = clock["mhz"] if clock else None
                rec["bwd_ms"] = fb - rec["fwd_ms"]
                rec["bwd_tflops"] = 2.5 * fwd_flops / (rec["bwd_ms"] * 1e-3) / 1e12 if rec["bwd_ms"] > 0 else None
                del qg, kg, vg, dout
            except Exception as e:
                print(f"  {impl_name:<14} ERROR in fwd+bwd: {short(e)}", flush=True)
                rec["bwd_error"] = short(e)
                if is_sticky(e, dev):
                    ev.emit(event="result", **rec)
                    sys.exit(EXIT_STICKY)
        line = f"  {impl_name:<14} fwd {rec['fwd_ms']:8.3f} ms {rec['fwd_tflops']:7.1f} TF/s"
        if rec.get("fwd_mhz") is not None:
            line += f" @ {rec['fwd_mhz']:.0f} MHz"
        if rec.get("fwd_peak_mib") is not None:
            line += f"  peak {rec['fwd_peak_mib']:8.0f} MiB"
        if rec.get("bwd_tflops") is not None:
            line += f" | bwd {rec['bwd_ms']:8.3f} ms {rec['bwd_tflops']:7.1f} TF/s  peak {rec.get('fb_peak_mib') or 0:8.0f} MiB"
            if rec.get("fb_mhz") is not None:
                line += f" (fwd+bwd @ {rec['fb_mhz']:.0f} MHz)"
        elif rec.get("bwd_error"):
            line += " | bwd error"
        print(line, flush=True)
        ev.emit(event="result", **rec)
    del q, k, v
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def worker_main(args):
    import torch

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    with open(args.work_file) as f:
        work = json.load(f)
    ev = Events(args.events_file)
    deadline = args.deadline
    global _CLOCK
    if dev.type == "cuda":
        from gpu_clock import ClockSampler

        _CLOCK = ClockSampler()
    try:
        return run_work(work, args, ev, dev, deadline)
    finally:
        if _CLOCK is not None:
            _CLOCK.close()


def run_work(work, args, ev, dev, deadline) -> int:
    import torch

    for case in work:
        if deadline and time.time() > deadline:
            print(f"time budget spent: skipping {case['id']}", flush=True)
            continue
        ev.emit(event="case", id=case["id"])
        try:
            run_case(case, args, ev, dev)
        except SystemExit:
            raise
        except Exception as e:  # inputs, pair counting, ...: the whole case fails, the sweep goes on
            print(f"  case {case['id']} failed: {short(e)}", flush=True)
            traceback.print_exc(limit=4)
            ev.emit(event="case_error", id=case["id"], error=short(e))
            if is_sticky(e, dev):
                sys.exit(EXIT_STICKY)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return 0


# ====================================================================== precompile


def precompile_main(args):
    """Compile flexgen's kernels for every (variant, head dim, config) in parallel threads, by tiny
    calls (forward, and backward unless --fwd-only). Tracing happens here, serially."""
    import torch
    from concurrent.futures import ThreadPoolExecutor

    import flexgen

    dev = torch.device("cuda")
    with open(args.work_file) as f:
        work = json.load(f)
    jobs, seen = [], set()
    n = 256
    for case in work:
        for impl_name in case["impls"]:
            if not impl_name.startswith("flexgen"):
                continue
            opts = case.get("kernel_options", {}).get(impl_name)
            # constants a mask or score captures (prefix length, head count) are baked into the
            # kernel, so the variant is built for the case's own N and H
            key = (case["variant"], case["D"], impl_name, case["N"], case["H"])
            if key in seen:
                continue
            seen.add(key)
            try:
                variant = build_variant(case["variant"], case["N"], case["H"], dev)
                score = flexgen.score_mod(variant.score) if variant.score is not None else None
                bs = (_lcm(128, int((opts or {}).get("BLOCK_M", 128))), _lcm(128, int((opts or {}).get("BLOCK_N", 128))))
                nn = max(n, bs[0], bs[1])
                bm = flexgen.create_block_mask(variant.mask, None, None, nn, nn, device=dev, BLOCK_SIZE=bs) if variant.mask is not None else None
                jobs.append((key, score, bm, case["D"], opts, nn))
            except Exception as e:
                print(f"precompile: cannot prepare {key}: {short(e)}", flush=True)

    def warm(job):
        key, score, bm, d, opts, nn = job
        t0 = time.perf_counter()
        try:
            x = [torch.randn(1, 2, nn, d, device=dev, dtype=torch.bfloat16, requires_grad=not args.fwd_only) for _ in range(3)]
            out = flexgen.flex_attention(*x, score_mod=score, block_mask=bm, kernel_options=opts)
            status = "fwd ok"
            if not args.fwd_only:
                try:
                    out.sum().backward()
                    status += ", bwd ok"
                except Exception as e:
                    status += f", bwd: {short(e, 120)}"
        except Exception as e:
            status = f"fwd: {short(e, 160)}"
        return key, status, time.perf_counter() - t0

    t0 = time.perf_counter()
    threads = max(1, min(16, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for key, status, sec in pool.map(warm, jobs):
            print(f"precompile {key[2]} D={key[1]} {key[0]} N={key[3]}: {status} ({sec:.1f}s)", flush=True)
    torch.cuda.synchronize()
    print(f"precompile: {len(jobs)} configurations in {time.perf_counter() - t0:.1f}s on {threads} threads", flush=True)
    return 0


# ====================================================================== driver


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", help=f"comma list (default: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--dims", help="comma list of head dims (default 128,64)")
    p.add_argument("--seqlens", help="comma list of N (default 2048,8192,16384); B = 16384 // N (at least 1)")
    p.add_argument("--impls", help=f"comma list (default: {','.join(DEFAULT_IMPLS)}, and fa4 when it imports; also: fa4, sdpa-effmask, sdpa-math)")
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per batch: B = tokens // N")
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--quick", action="store_true", help="D=128, N=8k, short timing (explicit options win)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--kernel-options", help="JSON dict or list of dicts (BLOCK_M, BLOCK_N, num_warps, num_stages): flexgen tile configs to sweep")
    p.add_argument("--no-default-flexgen", action="store_true", help="with --kernel-options: drop the default-config flexgen run")
    p.add_argument("--long", action="store_true", help="also run 64k tokens of one sequence, causal (flexgen, and the dense-mask paths for contrast)")
    p.add_argument("--long-seqlen", type=int, default=65536)
    p.add_argument("--long-impls", help=f"comma list (default: {','.join(DEFAULT_LONG_IMPLS)}, and fa4 when it imports)")
    p.add_argument("--skip-sweep", action="store_true", help="run only --long")
    p.add_argument("--warmup", type=float, default=None, help="do_bench warm-up, ms (default 25; 10 with --quick)")
    p.add_argument("--rep", type=float, default=None, help="do_bench repetition time, ms (default 100; 40 with --quick)")
    p.add_argument("--order", default="rotate", choices=("rotate", "peers-first", "flexgen-first"),
                   help="the order of one case's timing windows (default rotate: each case starts with the next "
                        "implementation, so that none always runs first, at the highest clock)")
    p.add_argument("--cooldown", type=float, default=1.0,
                   help="seconds of idle before each timing window, so that each starts from the same power state "
                        "(default 1; 0: back to back, as before)")
    p.add_argument("--time-budget", type=float, default=0.0, help="seconds; no new (variant, shape) starts after this (0: none)")
    p.add_argument("--no-precompile", action="store_true")
    p.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)  # harness check without a GPU
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--work-file", help=argparse.SUPPRESS)
    p.add_argument("--events-file", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = 10.0 if args.quick else 25.0
    if args.rep is None:
        args.rep = 40.0 if args.quick else 100.0
    return args


def _csv(text, default, conv=str):
    if not text:
        return list(default)
    return [conv(x.strip()) for x in text.split(",") if x.strip()]


def plan_work(args):
    variants = _csv(args.variants, DEFAULT_VARIANTS)
    dims = _csv(args.dims, [128] if args.quick else [128, 64], int)
    seqlens = _csv(args.seqlens, [8192] if args.quick else [2048, 8192, 16384], int)
    impls = _csv(args.impls, DEFAULT_IMPLS)
    for name in impls:
        if name not in KNOWN_IMPLS:
            raise SystemExit(f"unknown implementation {name!r}; known: {', '.join(KNOWN_IMPLS)}")
    configs = {}
    if args.kernel_options:
        parsed = json.loads(args.kernel_options)
        for opts in parsed if isinstance(parsed, list) else [parsed]:
            configs[flexgen_impl_name(opts)] = opts
        if args.no_default_flexgen and "flexgen" in impls:
            impls.remove("flexgen")
        impls += [n for n in configs if n not in impls]
    work = []
    if not args.skip_sweep:
        for D in dims:
            for name in variants:
                for N in seqlens:
                    work.append({"id": f"D{D}/{name}/N{fmt_n(N)}", "index": len(work), "D": D, "variant": name, "N": N,
                                 "B": max(1, args.tokens // N), "H": args.heads, "impls": list(impls), "kernel_options": configs})
    if args.long:
        N = args.long_seqlen
        long_impls = _csv(args.long_impls, DEFAULT_LONG_IMPLS)
        long_impls += [n for n in configs if n not in long_impls]
        work.append({"id": f"long/D128/causal/N{fmt_n(N)}", "D": 128, "variant": "causal", "N": N, "B": 1,
                     "H": args.heads, "impls": long_impls, "kernel_options": configs, "long": True})
    return work, impls


def read_events(path):
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def add_fa4_to_defaults(args, meta):
    """FA4 joins the default implementation lists when it imports here; an explicit --impls or
    --long-impls is left as given (fa4 named there and missing is recorded as unavailable)."""
    if args.cpu or (args.impls and (args.long_impls or not args.long)):
        return
    ok, text = fa4_probe()
    meta["fa4"] = text if ok else f"not importable: {text}"
    print(f"fa4: {text}" if ok else f"fa4: not importable ({text}); left out of the default implementations", flush=True)
    if ok:
        args.impls = args.impls or ",".join(DEFAULT_IMPLS + ["fa4"])
        args.long_impls = args.long_impls or ",".join(DEFAULT_LONG_IMPLS + ["fa4"])


def driver_main(args):
    t_start = time.time()
    meta = environment_meta(args)
    add_fa4_to_defaults(args, meta)
    work, impls = plan_work(args)
    os.makedirs(args.out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="flexgen-bench-")
    events_file = os.path.join(tmp, "events.jsonl")
    deadline = t_start + args.time_budget if args.time_budget else 0.0
    print("flexgen benchmark: " + json.dumps(meta), flush=True)
    print(f"{len(work)} (variant, shape) cases; implementations: {', '.join(impls)}", flush=True)

    script = os.path.abspath(__file__)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = TREE + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    common = ([f"--warmup={args.warmup}", f"--rep={args.rep}", f"--order={args.order}", f"--cooldown={args.cooldown}"]
              + (["--fwd-only"] if args.fwd_only else []) + (["--cpu"] if args.cpu else []))

    if not args.no_precompile and not args.cpu and any(i.startswith("flexgen") for c in work for i in c["impls"]):
        wf = os.path.join(tmp, "precompile.json")
        with open(wf, "w") as f:
            json.dump(work, f)
        t0 = time.time()
        try:
            rc = subprocess.run([sys.executable, script, "--precompile", "--work-file", wf] + common, env=env,
                                timeout=max(60.0, (deadline - time.time()) * 0.5) if deadline else 900).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"precompile finished ({rc}) in {time.time() - t0:.1f}s", flush=True)

    # per (case id, impl): final result record
    results: dict[tuple[str, str], dict] = {}
    checks: dict[str, dict] = {}
    attempts = 0
    while True:
        remaining = []
        for case in work:
            todo = [i for i in case["impls"] if (case["id"], i) not in results]
            if todo:
                remaining.append(dict(case, impls=todo))
        if not remaining or (deadline and time.time() > deadline):
            break
        attempts += 1
        if attempts > len(work) * max(1, len(impls)) + 2:
            print("too many worker restarts; giving up", flush=True)
            break
        wf = os.path.join(tmp, f"work{attempts}.json")
        with open(wf, "w") as f:
            json.dump(remaining, f)
        before = len(read_events(events_file))
        proc = subprocess.run([sys.executable, script, "--worker", "--work-file", wf, "--events-file", events_file,
                               f"--deadline={deadline}"] + common, env=env)
        events = read_events(events_file)
        new = events[before:]
        last_begin = None
        for e in new:
            if e["event"] == "result":
                results[(e["id"], e["impl"])] = e
                if last_begin and (last_begin["id"], last_begin["impl"]) == (e["id"], e["impl"]):
                    last_begin = None
            elif e["event"] == "check":
                checks[e["id"]] = e
            elif e["event"] == "case_error":
                case = next(c for c in work if c["id"] == e["id"])
                for impl in case["impls"]:
                    results.setdefault((case["id"], impl), {
                        "id": case["id"], "D": case["D"], "variant": case["variant"], "N": case["N"], "B": case["B"],
                        "H": case["H"], "impl": impl, "status": "error", "error": e["error"], "long": case.get("long", False)})
            elif e["event"] == "begin":
                last_begin = e
        if proc.returncode == 0:
            break
        # the worker died: blame the implementation it was running, then resume after it
        if last_begin is not None and (last_begin["id"], last_begin["impl"]) not in results:
            case = next(c for c in work if c["id"] == last_begin["id"])
            why = "CUDA context lost" if proc.returncode == EXIT_STICKY else f"worker died (exit {proc.returncode})"
            results[(case["id"], last_begin["impl"])] = {
                "id": case["id"], "D": case["D"], "variant": case["variant"], "N": case["N"], "B": case["B"], "H": case["H"],
                "impl": last_begin["impl"], "status": "error", "error": f"{why} during {last_begin['phase']}", "long": case.get("long", False),
            }
            print(f"!! worker ended ({proc.returncode}) in {last_begin['id']} {last_begin['impl']} ({last_begin['phase']}); resuming", flush=True)
        elif not any(e["event"] in ("result", "begin") for e in new):
            print(f"!! worker ended ({proc.returncode}) without progress; giving up", flush=True)
            break
        elif proc.returncode == EXIT_STICKY:
            print("!! worker lost its CUDA context; resuming in a fresh one", flush=True)

    for case in work:
        for impl in case["impls"]:
            if (case["id"], impl) not in results:
                results[(case["id"], impl)] = {"id": case["id"], "D": case["D"], "variant": case["variant"], "N": case["N"],
                                               "B": case["B"], "H": case["H"], "impl": impl, "status": "skipped",
                                               "long": case.get("long", False)}
    records = [results[(c["id"], i)] for c in work for i in c["impls"]]
    meta["wall_s"] = round(time.time() - t_start, 1)
    report = {"meta": meta, "results": records, "checks": checks}
    return finish(args, work, records, checks, report)


def environment_meta(args):
    meta = {"protocol": f"{args.tokens} tokens/batch, H={args.heads}, bf16, median do_bench",
            "warmup_ms": args.warmup, "rep_ms": args.rep, "fwd_only": args.fwd_only, "order": args.order,
            "cooldown_s": args.cooldown}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            meta["device"] = torch.cuda.get_device_name()
            meta["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    except Exception as e:  # pragma: no cover
        meta["torch"] = f"unavailable: {short(e)}"
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    try:
        import flexgen

        meta["flexgen"] = flexgen.__version__
        meta["flexgen_tree"] = os.path.dirname(os.path.dirname(os.path.abspath(flexgen.__file__)))
    except Exception as e:
        meta["flexgen"] = f"import failed: {short(e)}"
    try:  # which compiler built flexgen's kernels: ptxas versions differ in the code they make of one source
        from flexgen.cache import jit

        meta["compiler"] = jit.backend().version()
    except Exception as e:
        meta["compiler"] = f"unavailable: {short(e)}"
    try:
        meta["git"] = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        pass
    return meta


# ====================================================================== reporting


def _cell(rec, key):
    if rec is None:
        return "-"
    st = rec.get("status")
    if st == "n/a":
        return "n/a"
    if st == "unavailable":
        return "unavail"
    if st == "skipped":
        return "skip"
    if st == "error":
        return "err"
    if key == "bwd_tflops" and rec.get("bwd_error"):
        return "err"
    val = rec.get(key)
    if val is None:
        return "-"
    return f"{val:.0f}" if abs(val) >= 10 else f"{val:.2g}"


def _impl_key(name):
    base = name.split("[")[0]
    return (IMPL_ORDER.index(base) if base in IMPL_ORDER else 99, name)


def tflops_table(records, fwd_only):
    sweep = [r for r in records if not r.get("long")]
    if not sweep:
        return []
    seqlens = sorted({r["N"] for r in sweep})
    cols = [f"fwd {fmt_n(n)}" for n in seqlens] + ([] if fwd_only else [f"bwd {fmt_n(n)}" for n in seqlens])
    lines = ["| D | variant | impl | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    by = {(r["D"], r["variant"], r["impl"], r["N"]): r for r in sweep}
    dims = sorted({r["D"] for r in sweep}, reverse=True)
    variants = list(dict.fromkeys(r["variant"] for r in sweep))
    impls = sorted({r["impl"] for r in sweep}, key=_impl_key)
    for D in dims:
        for var in variants:
            for impl in impls:
                recs = [by.get((D, var, impl, n)) for n in seqlens]
                if all(r is None or r.get("status") in ("n/a", "unavailable") for r in recs):
                    continue
                cells = [_cell(r, "fwd_tflops") for r in recs]
                if not fwd_only:
                    cells += [_cell(r, "bwd_tflops") for r in recs]
                lines.append(f"| {D} | {var} | {impl} | " + " | ".join(cells) + " |")
    return lines


def ratio_lines(records, fwd_only):
    """flexgen (each config) over the best peer, per (D, variant, N)."""
    sweep = [r for r in records if not r.get("long") and r.get("status") == "ok"]
    out = []
    keys = list(dict.fromkeys((r["D"], r["variant"]) for r in sweep))
    for D, var in keys:
        rs = [r for r in sweep if r["D"] == D and r["variant"] == var]
        parts = []
        for n in sorted({r["N"] for r in rs}):
            at = [r for r in rs if r["N"] == n]
            fl = [r for r in at if r["impl"].startswith("flexgen")]
            peers = [r for r in at if not r["impl"].startswith("flexgen")]
            if not fl or not peers or not max(r.get("fwd_tflops") or 0 for r in peers):
                continue
            best_f = max(fl, key=lambda r: r.get("fwd_tflops") or 0)
            pf = max(peers, key=lambda r: r.get("fwd_tflops") or 0)
            txt = f"{fmt_n(n)} {best_f['fwd_tflops'] / pf['fwd_tflops']:.2f}x {pf['impl']}"
            if not fwd_only:
                fb = [r for r in fl if r.get("bwd_tflops")]
                pb = [r for r in peers if r.get("bwd_tflops")]
                if fb and pb:
                    bf, bp = max(fb, key=lambda r: r["bwd_tflops"]), max(pb, key=lambda r: r["bwd_tflops"])
                    txt += f" | bwd {bf['bwd_tflops'] / bp['bwd_tflops']:.2f}x {bp['impl']}"
            fa4 = next((r for r in peers if r["impl"] == "fa4"), None)
            if fa4 is not None and pf is not fa4 and fa4.get("fwd_tflops"):  # the reference peer
                txt += f" (vs fa4 {best_f['fwd_tflops'] / fa4['fwd_tflops']:.2f}x"
                fb4 = [r for r in fl if r.get("bwd_tflops")]
                if fb4 and fa4.get("bwd_tflops"):
                    txt += f", bwd {max(r['bwd_tflops'] for r in fb4) / fa4['bwd_tflops']:.2f}x"
                txt += ")"
            parts.append(txt)
        if parts:
            out.append(f"D{D} {var}: " + "; ".join(parts))
    return out


def check_lines(checks):
    out = []
    for cid, c in checks.items():
        judged = {n: e for n, e in c.get("row_err", {}).items() if n in c.get("verdict", {})}
        if not judged:
            continue
        parts = []
        for n, e in judged.items():
            vs = c.get("vs_peer", {}).get(n)
            vs_fa4 = c.get("vs_fa4", {}).get(n)
            parts.append(f"{n} rows {e:.1e}" + (f", vs {c['peer']} {vs:.1e}" if vs is not None else "")
                         + (f", vs fa4 {vs_fa4:.1e}" if vs_fa4 is not None else "") + f" [{c['verdict'][n]}]")
        peer = c.get("peer_row_err")
        out.append(f"{cid}: " + "; ".join(parts) + (f" (best peer rows {peer:.1e})" if peer is not None else ""))
    return out


def clock_lines(records):
    """The median SM clock of each timing window (nvidia-smi), where the worker could sample it."""
    rows = [r for r in records if r.get("status") == "ok" and (r.get("fwd_mhz") or r.get("fb_mhz"))]
    out = ["| case | impl | fwd MHz | fwd+bwd MHz |", "|---|---|---|---|"]
    for r in rows:
        fwd, fb = r.get("fwd_mhz"), r.get("fb_mhz")
        out.append(f"| {r['id']} | {r['impl']} | {'-' if fwd is None else f'{fwd:.0f}'} | {'-' if fb is None else f'{fb:.0f}'} |")
    return out if len(out) > 2 else []


def memory_lines(records):
    rows = [r for r in records if r.get("status") == "ok" and r.get("fwd_peak_mib") is not None]
    out = ["| case | impl | fwd peak MiB | fwd+bwd peak MiB | mask build s | mask MiB |", "|---|---|---|---|---|---|"]
    for r in rows:
        fb = r.get("fb_peak_mib")
        mb, mm = r.get("mask_build_s"), r.get("mask_peak_mib")
        out.append(f"| {r['id']} | {r['impl']} | {r['fwd_peak_mib']:.0f} | {'-' if fb is None else f'{fb:.0f}'} | "
                   f"{'-' if mb is None else f'{mb:.2f}'} | {'-' if mm is None else f'{mm:.0f}'} |")
    return out if len(out) > 2 else []


def long_lines(records):
    rows = [r for r in records if r.get("long")]
    out = []
    for r in rows:
        if r.get("status") != "ok":
            out.append(f"{r['id']} {r['impl']}: {r.get('status')} {r.get('error', '')}")
            continue
        txt = f"{r['id']} {r['impl']}: fwd {r['fwd_ms']:.1f} ms {r['fwd_tflops']:.0f} TF/s, peak {r.get('fwd_peak_mib') or 0:.0f} MiB"
        if r.get("bwd_tflops"):
            txt += f"; bwd {r['bwd_ms']:.1f} ms {r['bwd_tflops']:.0f} TF/s, peak {r.get('fb_peak_mib') or 0:.0f} MiB"
        if r.get("mask_build_s") is not None:
            txt += f"; mask build {r['mask_build_s']:.2f}s, {r.get('mask_peak_mib') or 0:.0f} MiB"
        out.append(txt)
    return out


def error_lines(records):
    out = []
    for r in records:
        if r.get("status") in ("error", "unavailable"):
            out.append(f"{r['id']} {r['impl']}: {r.get('error', '')}")
        elif r.get("bwd_error"):
            out.append(f"{r['id']} {r['impl']} (bwd): {r['bwd_error']}")
    # the same message for many cases: say it once
    seen, uniq = {}, []
    for line in out:
        key = line.split(": ", 1)[-1]
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= 2:
            uniq.append(line)
    hidden = sum(max(0, c - 2) for c in seen.values())
    return uniq + ([f"(+{hidden} more with the same messages; see bench_results.json)"] if hidden else [])


def plot(records, path, fwd_only):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    sweep = [r for r in records if not r.get("long") and r.get("status") == "ok"]
    if not sweep:
        return False
    dims = sorted({r["D"] for r in sweep}, reverse=True)
    dirs = ["fwd"] + ([] if fwd_only else ["bwd"])
    impls = sorted({r["impl"] for r in sweep}, key=_impl_key)
    fig, axes = plt.subplots(len(dims), len(dirs), figsize=(9 * len(dirs), 4.5 * len(dims)), squeeze=False)
    for i, D in enumerate(dims):
        groups = list(dict.fromkeys((r["variant"], r["N"]) for r in sweep if r["D"] == D))
        for j, d in enumerate(dirs):
            ax = axes[i][j]
            width = 0.8 / max(1, len(impls))
            for m, impl in enumerate(impls):
                ys = []
                for var, n in groups:
                    r = next((r for r in sweep if r["D"] == D and r["variant"] == var and r["N"] == n and r["impl"] == impl), None)
                    ys.append((r or {}).get(f"{d}_tflops") or 0)
                ax.bar([g + m * width for g in range(len(groups))], ys, width, label=impl)
            ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
            ax.set_xticklabels([f"{v}\n{fmt_n(n)}" for v, n in groups], fontsize=6, rotation=90)
            ax.set_ylabel("TFLOP/s (unmasked pairs)")
            ax.set_title(f"D={D} {d}")
            ax.grid(axis="y", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def finish(args, work, records, checks, report):
    out = args.out
    with open(os.path.join(out, "bench_results.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    table = tflops_table(records, args.fwd_only)
    ratios = ratio_lines(records, args.fwd_only)
    chk = check_lines(checks)
    mem = memory_lines(records)
    clocks = clock_lines(records)
    lng = long_lines(records)
    errs = error_lines(records)
    meta = report["meta"]
    head = (f"flexgen benchmark on {meta.get('device', '?')} (torch {meta.get('torch')}, triton {meta.get('triton')}, "
            f"flexgen's kernels by {meta.get('compiler')}), "
            f"{meta['protocol']}; TFLOP/s over unmasked pairs")
    md = [f"# {head}", "", f"wall time {meta.get('wall_s')} s; warmup {args.warmup} ms, rep {args.rep} ms; timing order "
          f"{args.order}, {args.cooldown} s idle before each window", ""]
    md += table + [""]
    if ratios:
        md += ["## flexgen / best peer (TFLOP/s ratio)", ""] + [f"- {line}" for line in ratios] + [""]
    if chk:
        md += ["## correctness (max |err| vs float32 on sampled rows; max |diff| vs a peer)", ""] + [f"- {line}" for line in chk] + [""]
    if lng:
        md += ["## long sequence", ""] + [f"- {line}" for line in lng] + [""]
    if mem:
        md += ["## peak memory (torch.cuda.max_memory_allocated, inputs included)", ""] + mem + [""]
    if clocks:
        md += ["## SM clock during each timing window (median of nvidia-smi's samples; the 700 W cap throttles "
               "within a window)", ""] + clocks + [""]
    if errs:
        md += ["## errors", ""] + [f"- {line}" for line in errs] + [""]
    with open(os.path.join(out, "bench_results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    plotted = plot(records, os.path.join(out, "bench_plot.png"), args.fwd_only)

    print("\n" + "=" * 100)
    print(head)
    print(f"wall {meta.get('wall_s')} s; files: {out}/bench_results.json, bench_results.md" + (", bench_plot.png" if plotted else ""))
    if errs:
        print("errors:")
        for line in errs[:12]:
            print("  " + line)
    if chk:
        bad = [line for line in chk if "[BAD]" in line]
        print(f"checks: {len(chk) - len(bad)} ok, {len(bad)} BAD" + (":" if bad else ""))
        for line in bad[:12]:
            print("  " + line)
    if lng:
        print("long sequence:")
        for line in lng:
            print("  " + line)
    if ratios:
        print("flexgen / best peer:")
        for line in ratios:
            print("  " + line)
    print("\n".join(table))
    n_ok = sum(r.get("status") == "ok" for r in records)
    print(f"{n_ok}/{len(records)} runs ok")
    return 0


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if args.precompile:
        return precompile_main(args)
    try:
        import torch

        if not torch.cuda.is_available() and not args.cpu:
            print("no CUDA device: this benchmark needs a GPU (--cpu runs the harness alone, for checking it)", flush=True)
            return 2
    except ImportError:
        print("torch is not installed", flush=True)
        return 2
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())
