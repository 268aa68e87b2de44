"""Forward pass on the GPU against the float64 ground truth (flexgen.reference_attention).

The bar for every case: ||out - ref|| of flexgen is at most twice the error of PyTorch's
own low-precision math on the same inputs (QK^T, score_mod, softmax and PV in bf16/fp16,
as eager PyTorch computes them), plus 1e-5. The same holds for lse on rows with a visible
key; rows with none must give out = 0 and lse = -inf, exactly where the reference says so.

Inputs are fresh random draws in every test (the seed is printed on failure). Kernels
are compiled once per (variant, dtype, head dim, tile config); a module fixture compiles
all of them up front in parallel threads, on tiny inputs, so the suite is bounded by
run time rather than by NVRTC.
"""
from __future__ import annotations

import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

import flexgen
from flexgen import and_masks, or_masks, score_mod as make_score_mod
from lowp_math import masked_scores

gpu = pytest.mark.gpu
DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------- inputs


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def randn(*shape, dtype, layout="bhld"):
    """(B, H, L, D) tensors; layout "blhd" gives the transpose of a (B, L, H, D) tensor,
    "bhdl" one whose last dimension is strided."""
    B, H, L, D = shape
    if layout == "bhld":
        return torch.randn(B, H, L, D, device=DEV, dtype=dtype)
    if layout == "blhd":
        return torch.randn(B, L, H, D, device=DEV, dtype=dtype).transpose(1, 2)
    if layout == "bhdl":
        return torch.randn(B, H, D, L, device=DEV, dtype=dtype).transpose(2, 3)
    if layout == "offset":  # a view into a larger buffer, starting a few rows in
        return torch.randn(B, H, L + 3, D, device=DEV, dtype=dtype)[:, :, 3:]
    raise ValueError(layout)


def doc_ids(length: int, n_docs: int = 5, device=None) -> torch.Tensor:
    n_docs = max(1, min(n_docs, length))
    cuts = torch.randperm(max(length - 1, 1))[: n_docs - 1] + 1
    ids = torch.zeros(length, dtype=torch.int32)
    ids[cuts[cuts < length]] = 1
    return torch.cumsum(ids, 0).to(torch.int32).to(device or DEV)


# ---------------------------------------------------------------- variants


@dataclass
class Shape:
    B: int
    H: int  # query heads
    Lq: int
    Lkv: int


def _variant(name: str, s: Shape):
    """(score_mod, mask_mod, mask uses b/h) for a variant at a shape. Lengths, caps and tables
    are run-time values, so one variant is one compiled kernel at every shape."""
    v = flexgen.variants
    L = max(s.Lq, s.Lkv)
    if name == "none":
        return None, None, False
    if name == "causal":
        return None, v.causal, False
    if name == "sliding_window":
        return None, v.sliding_window(97), False
    if name == "prefix_lm":
        return None, v.prefix_lm(150), False
    if name == "document":
        return None, v.document(doc_ids(L)), False
    if name == "document_bidir":
        return None, v.document(doc_ids(L), causal=False), False
    if name == "alibi":
        return v.alibi(s.H), None, False
    if name == "alibi_causal":
        return v.alibi(s.H), v.causal, False
    if name == "softcap":
        return v.softcap(1.5), None, False
    if name == "softcap_causal":
        return v.softcap(1.5), v.causal, False
    if name == "relative_bias":
        table = torch.randn(s.H, 2 * L - 1, device=DEV, dtype=torch.float32)
        return v.relative_bias(table), None, False
    if name == "and_masks":  # bidirectional local attention inside each document
        return None, and_masks(v.document(doc_ids(L), causal=False), lambda b, h, q, kv: torch.abs(q - kv) < 200), False
    if name == "or_masks":  # attention sinks plus a sliding window (StreamingLLM)
        return None, or_masks(v.sliding_window(64), lambda b, h, q, kv: kv < 4), False
    if name == "softcap_alibi_causal":  # Mods called inside a user function splice in
        alibi, cap = v.alibi(s.H), v.softcap(2.0)
        return make_score_mod(lambda sc, b, h, q, kv: cap(alibi(sc, b, h, q, kv), b, h, q, kv)), v.causal, False
    if name == "user_fn":  # plain Python functions with a buffer, where() and a negative modulo
        head_scale = torch.rand(s.H, device=DEV) + 0.5

        def user_score(score, b, h, q_idx, kv_idx):
            return score * head_scale[h] + torch.where(q_idx >= kv_idx, 0.0, -0.75)

        def user_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx) % 5 != 4

        return user_score, user_mask, False
    if name == "per_head_mask":  # a mask that depends on the (query) head
        return None, (lambda b, h, q, kv: (q >= kv) & (q - kv < 48 * (h + 1))), True
    if name == "padding_mask":  # per-sequence lengths: rows past q_len[b] see nothing
        q_lens = torch.randint(1, s.Lq + 1, (s.B,), device=DEV, dtype=torch.int32)
        kv_lens = torch.randint(1, s.Lkv + 1, (s.B,), device=DEV, dtype=torch.int32)
        return None, (lambda b, h, q, kv: (q < q_lens[b]) & (kv < kv_lens[b])), True
    if name == "late_causal":  # rows 0..199 see nothing: query block 0 has no tile at all, block 1 is half dead
        return None, (lambda b, h, q, kv: (q >= 200) & (q >= kv)), False
    if name == "torch_doc":  # a plain function over a captured tensor, as a torch user writes it
        ids = doc_ids(L)

        def doc_causal(b, h, q_idx, kv_idx):
            return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

        return None, doc_causal, False
    if name == "nothing":
        return None, (lambda b, h, q, kv: q < 0), False
    raise KeyError(name)


ALL_VARIANTS = [
    "none", "causal", "sliding_window", "prefix_lm", "document", "document_bidir", "alibi", "alibi_causal",
    "softcap", "softcap_causal", "relative_bias", "and_masks", "or_masks", "softcap_alibi_causal", "user_fn",
    "per_head_mask", "padding_mask",
]
FP16_VARIANTS = ["none", "causal", "document", "alibi_causal", "softcap_causal", "relative_bias", "or_masks", "per_head_mask"]
LENGTH_VARIANTS = ["none", "causal", "sliding_window", "alibi_causal"]
LENGTHS = [(1, 1), (17, 17), (1000, 1000), (4097, 4097), (1, 4097), (17, 1000), (1000, 17), (4097, 1000)]
GQA_VARIANTS = ["none", "causal", "alibi_causal", "document", "per_head_mask"]
HEAD_DIMS = [32, 64, 96, 128, 256]
# (sm80 tiles: on Hopper, tile options without the family are PyTorch's Triton tuning and leave the sm90 kernels)
TILE_OPTIONS = [{"family": "sm80", **o} for o in ({"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_N": 128},
                                                   {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, {"num_stages": 1},
                                                   {"BLOCK_N": 32})]
D0 = 64  # head dim of the variant sweep


# ---------------------------------------------------------------- the three computations


def lowp_attention(q, k, v, score, mask, scale):
    """PyTorch's own low-precision math: every op in q.dtype, as eager code would run it."""
    s, v = masked_scores(q, k, v, score, mask, scale)
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    p = p.masked_fill(torch.isneginf(lse)[..., None], 0.0)
    return torch.matmul(p, v), lse


def reference(q, k, v, score, mask, scale, gqa):
    """float64 inputs, so that the reference output is float64 (it comes back in the inputs' dtype)."""
    out, lse = flexgen.reference_attention(
        q.double(), k.double(), v.double(), score_mod=score, mask_mod=mask, scale=scale, enable_gqa=gqa, return_lse=True
    )
    return out.to(device=q.device, dtype=torch.float64), lse.to(device=q.device, dtype=torch.float64)


def poison(*shapes_dtypes):
    """Leave NaN-filled blocks in the caching allocator, so unwritten outputs show up as NaN."""
    bufs = [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for shape, dtype in shapes_dtypes]
    del bufs


def block_mask_for(mask, uses_bh, s: Shape, **kwargs):
    if mask is None:
        return None
    B, H = (s.B, s.H) if uses_bh else (None, None)
    return flexgen.create_block_mask(mask, B, H, s.Lq, s.Lkv, device=DEV, **kwargs)


def run_flexgen(q, k, v, score, bm, scale=None, gqa=False, kernel_options=None):
    B, H, Lq, D = q.shape
    poison(((B, H, Lq, D), q.dtype), ((B, H, Lq), torch.float32))
    out, lse = flexgen.flex_attention(
        q, k, v, score_mod=score, block_mask=bm, scale=scale, enable_gqa=gqa, return_lse=True,
        kernel_options=kernel_options,
    )
    torch.cuda.synchronize()
    return out, lse


def assert_matches(out, lse, q, k, v, score, mask, scale=None, gqa=False, what="", seed=None):
    """flexgen's (out, lse) against the float64 reference, with PyTorch's low-precision error as the bar."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    tag = f"{what} (seed {seed})"
    assert out.shape == q.shape and out.dtype == q.dtype, tag
    assert lse.shape == q.shape[:3], tag
    assert not torch.isnan(out).any(), f"NaN in the output: {tag}"
    assert not torch.isnan(lse).any(), f"NaN in lse: {tag}"
    ref_out, ref_lse = reference(q, k, v, score, mask, scale, gqa)
    base_out, base_lse = lowp_attention(q, k, v, score, mask, scale)

    err = (out.double() - ref_out).norm().item()
    base = (base_out.double() - ref_out).norm().item()
    assert err <= 2 * base + 1e-5, f"output error {err:.3e} > 2 x PyTorch {q.dtype} error {base:.3e} + 1e-5: {tag}"

    dead = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), dead), (
        f"lse is -inf on {int(torch.isneginf(lse).sum())} rows, the reference on {int(dead.sum())}: {tag}"
    )
    if dead.any():
        assert (out[dead] == 0).all(), f"fully masked rows are not 0: {tag}"
    live = ~dead
    assert torch.isfinite(lse[live]).all(), f"non-finite lse on a row with visible keys: {tag}"
    lerr = (lse.double() - ref_lse)[live].norm().item()
    lbase = (base_lse.double() - ref_lse)[live].norm().item()
    assert lerr <= 2 * lbase + 1e-5, f"lse error {lerr:.3e} > 2 x PyTorch error {lbase:.3e} + 1e-5: {tag}"
    return err, base


def check_variant(name, s: Shape, D, dtype, gqa_kv_heads=None, layout="bhld", kernel_options=None, bm_kwargs=None):
    seed = fresh_seed()
    Hkv = gqa_kv_heads or s.H
    q = randn(s.B, s.H, s.Lq, D, dtype=dtype, layout=layout)
    k = randn(s.B, Hkv, s.Lkv, D, dtype=dtype, layout=layout)
    v = randn(s.B, Hkv, s.Lkv, D, dtype=dtype, layout=layout)
    score, mask, uses_bh = _variant(name, s)
    bm = block_mask_for(mask, uses_bh, s, **(bm_kwargs or {}))
    out, lse = run_flexgen(q, k, v, score, bm, gqa=gqa_kv_heads is not None, kernel_options=kernel_options)
    return assert_matches(out, lse, q, k, v, score, mask, gqa=gqa_kv_heads is not None, seed=seed,
                          what=f"{name} {s} D={D} {dtype} layout={layout} options={kernel_options}")


# ---------------------------------------------------------------- compile everything up front


def _planned_kernels():
    """(variant, dtype, head dim, kernel_options): every kernel this module runs."""
    plan = [(n, "bf16", D0, None) for n in ALL_VARIANTS]
    plan += [(n, "fp16", D0, None) for n in FP16_VARIANTS]
    plan += [("causal", dt, d, None) for dt in DTYPES for d in HEAD_DIMS]
    plan += [("causal", "bf16", D0, o) for o in TILE_OPTIONS]
    plan += [("sliding_window", "bf16", D0, {"family": "sm80", "BLOCK_M": 64, "BLOCK_N": 64})]
    plan += [(n, "bf16", D0, None) for n in ("late_causal", "nothing", "torch_doc")]
    seen, out = set(), []
    for n, dt, d, o in plan:
        key = (n, dt, d, repr(o))
        if key not in seen:
            seen.add(key)
            out.append((n, dt, d, o))
    return out


@pytest.fixture(scope="module", autouse=True)
def precompiled():
    """Compile every planned kernel in parallel (NVRTC runs outside the GIL) by a tiny call each.
    Tracing and block masks are built here, serially; threads only compile and launch.
    Failures are ignored: the test that needs the kernel reports them."""
    if not torch.cuda.is_available():
        yield
        return
    small = Shape(1, 1, 16, 16)
    jobs = []
    for name, dt, d, opts in _planned_kernels():
        try:
            score, mask, uses_bh = _variant(name, small)
            if score is not None and not isinstance(score, flexgen.Mod):
                score = make_score_mod(score)
            bm = block_mask_for(mask, uses_bh, small)
            jobs.append((score, bm, DTYPES[dt], d, opts))
        except Exception:
            continue

    def warm(job):
        score, bm, dtype, d, opts = job
        try:
            x = torch.randn(1, 1, 80, d, device=DEV, dtype=dtype)  # (longer than a decoding query: the usual kernels)
            flexgen.flex_attention(x, x, x, score_mod=score, block_mask=bm, kernel_options=opts)
        except Exception:
            pass

    with ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1))) as pool:
        list(pool.map(warm, jobs))
    torch.cuda.synchronize()
    yield


# ---------------------------------------------------------------- variants, dtypes


@gpu
@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_variant_bf16(name):
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.bfloat16)


@gpu
@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_variant_bf16_sm80_family(name):
    """The base family by request: on a Hopper GPU the default forward is the sm90 one, so the sm80
    kernels (every other GPU's) get their own run here."""
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.bfloat16, kernel_options={"family": "sm80"})


@gpu
@pytest.mark.parametrize("name", FP16_VARIANTS)
def test_variant_fp16(name):
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.float16)


@gpu
@pytest.mark.parametrize("name", ["causal", "prefix_lm", "document", "relative_bias", "padding_mask", "user_fn"])
def test_variant_q_len_differs(name):
    check_variant(name, Shape(2, 4, 700, 1100), D0, torch.bfloat16)
    check_variant(name, Shape(2, 4, 1100, 700), D0, torch.bfloat16)


# ---------------------------------------------------------------- lengths


@gpu
@pytest.mark.parametrize("lq,lkv", LENGTHS)
@pytest.mark.parametrize("name", LENGTH_VARIANTS)
def test_lengths(name, lq, lkv):
    check_variant(name, Shape(1, 2, lq, lkv), D0, torch.bfloat16)


# ---------------------------------------------------------------- GQA


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", GQA_VARIANTS)
def test_gqa(name, dtype):
    check_variant(name, Shape(2, 8, 1000, 1000), D0, DTYPES[dtype], gqa_kv_heads=2)


@gpu
def test_gqa_one_kv_head_odd_lengths():
    check_variant("causal", Shape(1, 8, 333, 1025), D0, torch.bfloat16, gqa_kv_heads=1)


# ---------------------------------------------------------------- head dims


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_head_dims(D, dtype):
    try:
        check_variant("causal", Shape(2, 2, 1000, 1000), D, DTYPES[dtype])
    except (ValueError, NotImplementedError) as e:
        if re.search(r"not supported|unsupported", str(e), re.I):
            pytest.skip(f"flexgen reports head dim {D} unsupported: {e}")
        raise


# ---------------------------------------------------------------- lse and fully masked rows


@gpu
def test_return_lse_false_gives_the_same_output():
    fresh_seed()
    q, k, v = (randn(2, 4, 1000, D0, dtype=torch.bfloat16) for _ in range(3))
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, 1000, 1000, device=DEV)
    out = flexgen.flex_attention(q, k, v, block_mask=bm)
    assert isinstance(out, torch.Tensor)
    out2, lse = flexgen.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 1000)


@gpu
def test_fully_masked_rows_and_empty_query_blocks():
    """Rows 0..199 see nothing: query block 0 has no tile at all, block 1 is half dead."""
    seed = fresh_seed()
    s = Shape(2, 4, 1000, 1000)
    q, k, v = (randn(s.B, s.H, s.Lq, D0, dtype=torch.bfloat16) for _ in range(3))
    _, late_causal, _ = _variant("late_causal", s)
    bm = flexgen.create_block_mask(late_causal, None, None, s.Lq, s.Lkv, device=DEV)
    out, lse = run_flexgen(q, k, v, None, bm)
    assert (out[:, :, :200] == 0).all()
    assert torch.isneginf(lse[:, :, :200]).all()
    assert torch.isfinite(lse[:, :, 200:]).all()
    assert_matches(out, lse, q, k, v, None, late_causal, seed=seed, what="late_causal")


@gpu
def test_everything_masked():
    fresh_seed()
    q, k, v = (randn(1, 2, 300, D0, dtype=torch.bfloat16) for _ in range(3))
    _, nothing, _ = _variant("nothing", Shape(1, 2, 300, 300))
    bm = flexgen.create_block_mask(nothing, None, None, 300, 300, device=DEV)
    out, lse = run_flexgen(q, k, v, None, bm)
    assert (out == 0).all()
    assert torch.isneginf(lse).all()


@gpu
def test_lse_with_scale():
    """A non-default scale reaches both out and lse."""
    seed = fresh_seed()
    q, k, v = (randn(2, 4, 1000, D0, dtype=torch.bfloat16) for _ in range(3))
    mask = flexgen.variants.causal
    bm = flexgen.create_block_mask(mask, None, None, 1000, 1000, device=DEV)
    out, lse = run_flexgen(q, k, v, None, bm, scale=0.3)
    assert_matches(out, lse, q, k, v, None, mask, scale=0.3, seed=seed, what="causal scale=0.3")


@gpu
def test_row_max_growing_across_tiles():
    """Scores that keep growing along the keys, by steps above and below the kernel's rescale
    threshold (2^8 in probability), so the reference max moves on some tiles and not others."""
    seed = fresh_seed()
    L, D = 1500, 64
    q, k, v = (randn(2, 3, L, D, dtype=torch.float32) for _ in range(3))
    ramp = torch.linspace(0.2, 3.0, L, device=DEV) * (1 + (torch.arange(L, device=DEV) // 200 % 2))
    k = (k * ramp[:, None]).to(torch.bfloat16)
    q, v = q.to(torch.bfloat16), v.to(torch.bfloat16)
    for mask in (None, flexgen.variants.causal):
        bm = None if mask is None else flexgen.create_block_mask(mask, None, None, L, L, device=DEV)
        out, lse = run_flexgen(q, k, v, None, bm)
        assert_matches(out, lse, q, k, v, None, mask, seed=seed, what=f"growing scores mask={mask}")


@gpu
def test_negative_scale():
    seed = fresh_seed()
    q, k, v = (randn(1, 2, 300, D0, dtype=torch.bfloat16) for _ in range(3))
    for score in (None, flexgen.variants.softcap(5.0)):
        out, lse = run_flexgen(q, k, v, score, None, scale=-0.2)
        assert_matches(out, lse, q, k, v, score, None, scale=-0.2, seed=seed, what=f"scale=-0.2 score={score}")


# ---------------------------------------------------------------- layouts, options, torch masks


@gpu
@pytest.mark.parametrize("layout", ["blhd", "bhdl", "offset"])
@pytest.mark.parametrize("name", ["causal", "alibi_causal"])
def test_non_contiguous_inputs(name, layout):
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.bfloat16, layout=layout)


@gpu
def test_mixed_layouts():
    seed = fresh_seed()
    q = randn(2, 4, 777, D0, dtype=torch.bfloat16, layout="blhd")
    k = randn(2, 4, 777, D0, dtype=torch.bfloat16)
    v = randn(2, 4, 777, D0, dtype=torch.bfloat16, layout="offset")
    mask = flexgen.variants.causal
    bm = flexgen.create_block_mask(mask, None, None, 777, 777, device=DEV)
    out, lse = run_flexgen(q, k, v, None, bm)
    assert_matches(out, lse, q, k, v, None, mask, seed=seed, what="mixed layouts")


@gpu
@pytest.mark.parametrize("opts", TILE_OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_kernel_options_tiles(opts):
    check_variant("causal", Shape(2, 4, 1000, 1000), D0, torch.bfloat16, kernel_options=opts)


@gpu
def test_kernel_options_small_tiles_with_small_mask_blocks():
    """A (64, 64) block mask works once the tile is at most that size."""
    check_variant("sliding_window", Shape(2, 4, 1000, 1000), D0, torch.bfloat16,
                  kernel_options={"family": "sm80", "BLOCK_M": 64, "BLOCK_N": 64}, bm_kwargs={"BLOCK_SIZE": 64})


@gpu
def test_torch_block_mask_is_accepted():
    """A torch.nn.attention.flex_attention BlockMask (its mask_mod a plain function) works as it is."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    seed = fresh_seed()
    s = Shape(2, 4, 1000, 1000)
    _, doc_causal, _ = _variant("torch_doc", s)
    tbm = fa.create_block_mask(doc_causal, None, None, s.Lq, s.Lkv, device=DEV)
    q, k, v = (randn(s.B, s.H, s.Lq, D0, dtype=torch.bfloat16) for _ in range(3))
    out, lse = run_flexgen(q, k, v, None, tbm)
    assert_matches(out, lse, q, k, v, None, doc_causal, seed=seed, what="torch BlockMask")


@gpu
def test_repeatable():
    """Same inputs, same bits: a moving result is a race."""
    fresh_seed()
    s = Shape(2, 4, 1000, 1000)
    q, k, v = (randn(s.B, s.H, s.Lq, D0, dtype=torch.bfloat16) for _ in range(3))
    score, mask, _ = _variant("alibi_causal", s)
    bm = block_mask_for(mask, False, s)
    a = run_flexgen(q, k, v, score, bm)
    b = run_flexgen(q, k, v, score, bm)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------- errors


@gpu
def test_errors():
    q = torch.randn(1, 4, 128, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        flexgen.flex_attention(q, q.half(), q)
    with pytest.raises(TypeError, match="float16"):
        flexgen.flex_attention(q.int(), q.int(), q.int())
    kv6 = torch.randn(1, 3, 128, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        flexgen.flex_attention(q, kv6, kv6, enable_gqa=True)
    kv2 = torch.randn(1, 2, 128, 64, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="enable_gqa"):
        flexgen.flex_attention(q, kv2, kv2)
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, 256, 256, device=DEV)
    with pytest.raises(ValueError, match="Q_LEN"):
        flexgen.flex_attention(q, q, q, block_mask=bm)
    cpu_bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, 128, 128, device="cpu")
    with pytest.raises(ValueError, match="device"):
        flexgen.flex_attention(q, q, q, block_mask=cpu_bm)
    with pytest.raises(ValueError, match="kernel_options"):
        flexgen.flex_attention(q, q, q, kernel_options={"BLOCK_Q": 64})
    with pytest.raises(ValueError):
        flexgen.flex_attention(q[:, :, :0], q, q)
