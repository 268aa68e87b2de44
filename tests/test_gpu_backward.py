"""Backward pass on the GPU against float64 autograd through flexgen.reference_attention.

The bar for dq, dk and dv: the error norm against the float64 gradient is at most twice the
error of PyTorch's own low-precision math (QK^T, score_mod, softmax and PV in bf16/fp16 with
eager autograd) plus 1e-4. No NaN anywhere; fully masked rows give zero gradients;
deterministic mode is bitwise repeatable (buffer gradients included).

Gradients of score_mod buffers (a learnable ALiBi slope table, a relative-bias table) sum
dS * d score_mod / d buffer over every (q, kv). Like every FlashAttention-2 style backward
(PyTorch's FlexAttention included), dS = P * (dP - delta) uses delta = rowsum(dO * O) of the
*rounded* forward output, an error that is the same for a whole row and so does not average
out in those sums. Their bar is therefore twice the larger of PyTorch's low-precision error
and the error of that exact algorithm (float64, fed the output flexgen's forward produced),
plus 1e-4. The latter is float64 autograd of out and lse with grad_lse = -rowsum(dO * (O - O_exact)):
shifting delta by e shifts dS by -P * e, which is the gradient of -e * lse.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import pytest
import torch

import flexgen
from flexgen.dsl.mod import Mod
from lowp_math import masked_scores

gpu = pytest.mark.gpu
DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
EPS = 1e-4


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def doc_ids(length: int, n_docs: int = 5) -> torch.Tensor:
    n_docs = max(1, min(n_docs, length))
    cuts = torch.randperm(max(length - 1, 1))[: n_docs - 1] + 1
    ids = torch.zeros(length, dtype=torch.int32)
    ids[cuts[cuts < length]] = 1
    return torch.cumsum(ids, 0).to(torch.int32).to(DEV)


@dataclass
class Shape:
    B: int
    H: int  # query heads
    Lq: int
    Lkv: int


def _variant(name: str, s: Shape):
    """(score Mod, mask, mask uses b/h, names of learnable buffers)."""
    v = flexgen.variants
    L = max(s.Lq, s.Lkv)
    if name == "none":
        return None, None, False, ()
    if name == "causal":
        return None, v.causal, False, ()
    if name == "sliding_window":
        return None, v.sliding_window(97), False, ()
    if name == "document":
        return None, v.document(doc_ids(L)), False, ()
    if name == "alibi_causal":
        return v.alibi(v.alibi_slopes(s.H).to(DEV)), v.causal, False, ()
    if name == "alibi_causal_learnable":
        slopes = v.alibi_slopes(s.H).to(DEV).requires_grad_()
        return v.alibi(slopes), v.causal, False, ("alibi_slopes",)
    if name == "alibi":  # without a mask (80-row steps at D = 96 / 128)
        return v.alibi(v.alibi_slopes(s.H).to(DEV)), None, False, ()
    if name == "alibi_learnable":
        slopes = v.alibi_slopes(s.H).to(DEV).requires_grad_()
        return v.alibi(slopes), None, False, ("alibi_slopes",)
    if name == "softcap_causal":
        return v.softcap(1.5), v.causal, False, ()
    if name == "relative_bias_learnable":
        table = (0.5 * torch.randn(s.H, 2 * L - 1, device=DEV)).requires_grad_()
        return v.relative_bias(table), None, False, ("rel_bias",)
    if name == "per_head_mask":
        return None, (lambda b, h, q, kv: (q >= kv) & (q - kv < 48 * (h + 1))), True, ()
    if name == "rope_dot_causal":  # attention-gym's MLA RoPE term: a dot product of captured rows per score
        q_rope = 0.3 * torch.randn(s.B, s.H, s.Lq, 64, device=DEV)
        k_rope = 0.3 * torch.randn(s.B, 1, s.Lkv, 64, device=DEV)
        mod = flexgen.score_mod(lambda sc, b, h, q, kv: sc + 0.5 * torch.dot(q_rope[b, h, q], k_rope[b, h // s.H, kv]))
        return mod, v.causal, False, ()
    raise KeyError(name)


VARIANTS = ["none", "causal", "sliding_window", "document", "alibi_causal", "alibi_causal_learnable",
            "softcap_causal", "relative_bias_learnable", "per_head_mask"]
FP16_VARIANTS = ["none", "causal", "alibi_causal_learnable", "softcap_causal", "document"]
LENGTHS = [(1, 1), (17, 17), (1000, 1000), (1, 1000), (17, 1000), (1000, 17), (700, 1100)]
GQA_VARIANTS = ["none", "causal", "alibi_causal_learnable", "document"]
HEAD_DIMS = [32, 64, 96, 128, 256]
D0 = 64


# ---------------------------------------------------------------- the three computations


def _with_buffers(score: Mod | None, replace: dict) -> Mod | None:
    if score is None or not replace:
        return score
    return Mod(score.kind, score.expr, {**score.buffers, **replace}, score.params, name=score.name)


def _mask_fn(mask):
    if mask is None or isinstance(mask, Mod):
        return mask
    return flexgen.mask_mod(mask)


def lowp_grads(q, k, v, do, score, mask, scale, learn):
    """PyTorch's own low-precision math with eager autograd: every op in q.dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    bufs = {n: score.buffers[n].detach().clone().requires_grad_() for n in learn}
    score = _with_buffers(score, bufs)
    s, vv = masked_scores(q, k, v, score, mask, scale)
    dead = torch.isneginf(s).all(-1, keepdim=True)
    s = torch.where(dead, torch.zeros((), dtype=s.dtype, device=DEV), s)
    p = torch.softmax(s, dim=-1).masked_fill(dead, 0.0)
    torch.matmul(p, vv).backward(do)
    return [q.grad, k.grad, v.grad] + [bufs[n].grad for n in learn]


def reference_grads(q, k, v, do, score, mask, scale, gqa, learn):
    """float64 autograd through flexgen.reference_attention."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    bufs = {n: score.buffers[n].detach().double().requires_grad_() for n in learn}
    out = flexgen.reference_attention(q, k, v, score_mod=_with_buffers(score, bufs), mask_mod=mask, scale=scale,
                                      enable_gqa=gqa)
    out.backward(do.double())
    return [q.grad, k.grad, v.grad] + [bufs[n].grad for n in learn]


def rounded_delta_grads(q, k, v, do, score, mask, scale, gqa, learn, out_used):
    """Buffer gradients of the exact FlashAttention-2 backward given the output it was fed."""
    if not learn:
        return []
    q, k, v = (t.detach().double() for t in (q, k, v))
    bufs = {n: score.buffers[n].detach().double().requires_grad_() for n in learn}
    out, lse = flexgen.reference_attention(q, k, v, score_mod=_with_buffers(score, bufs), mask_mod=mask, scale=scale,
                                           enable_gqa=gqa, return_lse=True)
    e = (do.double() * (out_used.double() - out.detach())).sum(-1)
    torch.autograd.backward([out, lse], [do.double(), (-e).to(lse.dtype)])
    return [bufs[n].grad for n in learn]


def block_mask_for(mask, uses_bh, s: Shape, **kwargs):
    if mask is None:
        return None
    B, H = (s.B, s.H) if uses_bh else (None, None)
    return flexgen.create_block_mask(mask, B, H, s.Lq, s.Lkv, device=DEV, **kwargs)


def flexgen_grads(q, k, v, do, score, bm, gqa, learn, kernel_options=None, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for n in learn:
        score.buffers[n].grad = None
    out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, scale=scale, enable_gqa=gqa,
                                 kernel_options=kernel_options)
    out.backward(do)
    torch.cuda.synchronize()
    flexgen_grads.last_out = out.detach()
    return [q.grad, k.grad, v.grad] + [score.buffers[n].grad for n in learn]


def assert_grads_match(got, ref, base, names, tag, algorithm=()):
    """got vs ref; the bar is 2 x (base's error) + EPS. `algorithm`: for the trailing entries
    (buffer gradients), the rounded-delta FlashAttention-2 gradients, whose error may set the bar."""
    algo = [None] * (len(names) - len(algorithm)) + list(algorithm)
    for name, g, r, bl, al in zip(names, got, ref, base, algo):
        assert g is not None, f"no gradient for {name}: {tag}"
        assert g.shape == r.shape, f"{name} has shape {tuple(g.shape)}, expected {tuple(r.shape)}: {tag}"
        assert not torch.isnan(g).any(), f"NaN in {name}: {tag}"
        err = (g.double() - r).norm().item()
        b = (bl.double() - r).norm().item()
        a = (al.double() - r).norm().item() if al is not None else 0.0
        assert err <= 2 * max(b, a) + EPS, (
            f"{name} error {err:.3e} > 2 x max(PyTorch low-precision error {b:.3e}, rounded-delta error {a:.3e}) + {EPS}: {tag}"
        )


def check_variant(name, s: Shape, D, dtype, gqa_kv_heads=None, kernel_options=None, bm_kwargs=None):
    seed = fresh_seed()
    Hkv = gqa_kv_heads or s.H
    gqa = gqa_kv_heads is not None
    q = torch.randn(s.B, s.H, s.Lq, D, device=DEV, dtype=dtype)
    k = torch.randn(s.B, Hkv, s.Lkv, D, device=DEV, dtype=dtype)
    v = torch.randn(s.B, Hkv, s.Lkv, D, device=DEV, dtype=dtype)
    do = torch.randn(s.B, s.H, s.Lq, D, device=DEV, dtype=dtype)
    score, mask, uses_bh, learn = _variant(name, s)
    mask = _mask_fn(mask)
    scale = 1.0 / math.sqrt(D)
    bm = block_mask_for(mask, uses_bh, s, **(bm_kwargs or {}))
    got = flexgen_grads(q, k, v, do, score, bm, gqa, learn, kernel_options)
    ref = reference_grads(q, k, v, do, score, mask, scale, gqa, learn)
    base = lowp_grads(q, k, v, do, score, mask, scale, learn)
    algo = rounded_delta_grads(q, k, v, do, score, mask, scale, gqa, learn, flexgen_grads.last_out)
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learn]
    tag = f"{name} {s} D={D} {dtype} gqa={gqa_kv_heads} options={kernel_options} (seed {seed})"
    assert_grads_match(got, ref, base, names, tag, algo)


# ---------------------------------------------------------------- variants, dtypes


@gpu
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_bf16(name):
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.bfloat16)


@gpu
@pytest.mark.parametrize("name", FP16_VARIANTS)
def test_variant_fp16(name):
    check_variant(name, Shape(2, 4, 1000, 1000), D0, torch.float16)


@gpu
@pytest.mark.parametrize("lq,lkv", LENGTHS)
@pytest.mark.parametrize("name", ["none", "causal", "alibi_causal_learnable"])
def test_lengths(name, lq, lkv):
    check_variant(name, Shape(1, 2, lq, lkv), D0, torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", GQA_VARIANTS)
def test_gqa(name, dtype):
    check_variant(name, Shape(2, 8, 1000, 1000), D0, DTYPES[dtype], gqa_kv_heads=2)


@gpu
def test_gqa_one_kv_head_odd_lengths():
    check_variant("causal", Shape(1, 8, 333, 1025), 128, torch.bfloat16, gqa_kv_heads=1)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_head_dims(D, dtype):
    try:
        check_variant("softcap_causal", Shape(2, 2, 1000, 1000), D, DTYPES[dtype])
    except (ValueError, NotImplementedError) as e:
        if re.search(r"not supported|unsupported", str(e), re.I):
            pytest.skip(f"flexgen reports head dim {D} unsupported: {e}")
        raise


@gpu
@pytest.mark.parametrize("name,gqa", [("alibi_causal_learnable", None), ("document", 1)])
def test_head_dim_256_odd_lengths(name, gqa):
    """D = 256: two warps share 16 key rows and swap P^T, dX^T through shared memory."""
    check_variant(name, Shape(1, 2, 333, 555), 256, torch.bfloat16, gqa_kv_heads=gqa)


@gpu
def test_small_mask_blocks():
    """BLOCK_SIZE 64: the backward picks tiles that divide the mask's blocks."""
    check_variant("sliding_window", Shape(1, 2, 600, 600), 128, torch.bfloat16, bm_kwargs={"BLOCK_SIZE": 64},
                  kernel_options={"family": "sm80", "BLOCK_M": 64, "BLOCK_N": 64})


@gpu
@pytest.mark.parametrize("opts", [{"BLOCK_N1": 64}, {"BLOCK_M1": 64, "BLOCK_N1": 64}, {"BLOCK_M1": 16, "BLOCK_N1": 128},
                                  {"BLOCK_M1": 64, "BLOCK_N1": 64, "num_warps1": 4}, {"BLOCK_M1": 128}],
                         ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("name", ["causal", "alibi_causal", "document"])
def test_backward_tile_options(name, opts):
    """kernel_options BLOCK_M1 / BLOCK_N1 (PyTorch's names) and num_warps1 pick the sm80 backward's tile."""
    check_variant(name, Shape(1, 2, 700, 650), 128, torch.bfloat16, kernel_options={"family": "sm80", **opts})


# ---------------------------------------------------------------- masked rows, partial grads, layouts


@gpu
def test_fully_masked_rows_give_zero_gradients():
    fresh_seed()
    q, k, v = (torch.randn(1, 2, 600, D0, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def late_causal(b, h, q_idx, kv_idx):
        return (q_idx >= 200) & (q_idx >= kv_idx)

    bm = flexgen.create_block_mask(late_causal, None, None, 600, 600, device=DEV)
    out = flexgen.flex_attention(q, k, v, block_mask=bm)
    out.backward(torch.randn_like(out))
    for t in (q, k, v):
        assert not torch.isnan(t.grad).any()
    assert (q.grad[:, :, :200] == 0).all()
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


@gpu
def test_everything_masked():
    q, k, v = (torch.randn(1, 2, 300, D0, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx < 0, None, None, 300, 300, device=DEV)
    out = flexgen.flex_attention(q, k, v, block_mask=bm)
    out.sum().backward()  # an expanded (stride-0) grad_out
    for t in (q, k, v):
        assert (t.grad == 0).all()


@gpu
@pytest.mark.parametrize("which", ["q", "kv", "v", "buffer_only"])
def test_only_some_inputs_require_grad(which):
    seed = fresh_seed()
    s = Shape(1, 4, 500, 500)
    q = torch.randn(s.B, s.H, s.Lq, D0, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, s.H, s.Lkv, D0, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    score, mask, _, learn = _variant("alibi_causal_learnable", s)
    bm = block_mask_for(mask, False, s)
    req = {"q": (True, False, False), "kv": (False, True, True), "v": (False, False, True), "buffer_only": (False,) * 3}[which]
    leaves = [t.clone().requires_grad_(r) for t, r in zip((q, k, v), req)]
    out = flexgen.flex_attention(*leaves, score_mod=score, block_mask=bm)
    out.backward(do)
    ref = reference_grads(q, k, v, do, score, mask, 1 / math.sqrt(D0), False, learn)
    base = lowp_grads(q, k, v, do, score, mask, 1 / math.sqrt(D0), learn)
    for t, r, rf, bl, name in zip(leaves, req, ref, base, ("dq", "dk", "dv")):
        if r:
            assert_grads_match([t.grad], [rf], [bl], [name], f"{which} (seed {seed})")
        else:
            assert t.grad is None
    slopes = score.buffers["alibi_slopes"]
    algo = rounded_delta_grads(q, k, v, do, score, mask, 1 / math.sqrt(D0), False, learn, out.detach())
    assert_grads_match([slopes.grad], ref[3:], base[3:], ["dalibi_slopes"], f"{which} (seed {seed})", algo)


@gpu
def test_strided_inputs_and_grad_out():
    """(B, L, H, D) tensors seen as (B, H, L, D), and a non-contiguous grad_out."""
    seed = fresh_seed()
    B, H, L, D = 2, 4, 500, D0
    q, k, v, do = (torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, L, L, device=DEV)
    got = flexgen_grads(q, k, v, do, None, bm, False, ())
    ref = reference_grads(q, k, v, do, None, flexgen.variants.causal, 1 / math.sqrt(D), False, ())
    base = lowp_grads(q, k, v, do, None, flexgen.variants.causal, 1 / math.sqrt(D), ())
    assert_grads_match(got, ref, base, ["dq", "dk", "dv"], f"strided (seed {seed})")


# ---------------------------------------------------------------- deterministic mode


@gpu
@pytest.mark.parametrize("name,gqa,D", [("none", None, D0), ("causal", 2, D0), ("document", None, D0), ("causal", None, 256)])
def test_deterministic_is_bitwise_repeatable(name, gqa, D):
    seed = fresh_seed()
    s = Shape(2, 4, 1000, 900)
    Hkv = gqa or s.H
    q = torch.randn(s.B, s.H, s.Lq, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, Hkv, s.Lkv, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    score, mask, uses_bh, learn = _variant(name, s)
    bm = block_mask_for(mask, uses_bh, s)
    opts = {"deterministic": True}
    first = flexgen_grads(q, k, v, do, score, bm, gqa is not None, learn, opts)
    for _ in range(3):
        again = flexgen_grads(q, k, v, do, score, bm, gqa is not None, learn, opts)
        for a, b in zip(first, again):
            assert torch.equal(a, b), f"deterministic gradients differ between runs (seed {seed})"
    ref = reference_grads(q, k, v, do, score, mask, 1 / math.sqrt(D), gqa is not None, learn)
    base = lowp_grads(q, k, v, do, score, mask, 1 / math.sqrt(D), learn)
    assert_grads_match(first, ref, base, ["dq", "dk", "dv"], f"deterministic {name} D={D} (seed {seed})")


def poison(*shapes_dtypes):
    """Leave NaN-filled blocks in the caching allocator, so unwritten outputs show up as NaN."""
    bufs = [torch.full(shape, float("nan"), dtype=dtype, device=DEV) for shape, dtype in shapes_dtypes]
    del bufs


def check_deterministic_buffer_grads(name, s: Shape, D, gqa_kv_heads=None, runs=3):
    """Deterministic mode with learnable buffers: `runs` backward passes on the same inputs give
    bitwise-equal dQ, dK, dV and buffer gradients, and the first matches float64 autograd."""
    seed = fresh_seed()
    Hkv = gqa_kv_heads or s.H
    gqa = gqa_kv_heads is not None
    q = torch.randn(s.B, s.H, s.Lq, D, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, Hkv, s.Lkv, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    score, mask, uses_bh, learn = _variant(name, s)
    bm = block_mask_for(mask, uses_bh, s)
    scale = 1 / math.sqrt(D)
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learn]
    tag = f"deterministic {name} {s} D={D} gqa={gqa_kv_heads} (seed {seed})"
    results = []
    for i in range(runs):
        poison(((s.B, s.H, s.Lq, D), q.dtype), ((s.B, Hkv, s.Lkv, D), q.dtype),
               *((score.buffers[n].shape, torch.float32) for n in learn))
        results.append(flexgen_grads(q, k, v, do, score, bm, gqa, learn, {"deterministic": True}))
        if i == 0:
            out_used = flexgen_grads.last_out
    first = results[0]
    for again in results[1:]:
        for n, a, b in zip(names, first, again):
            assert torch.equal(a, b), f"{n} differs between runs: {tag}"
    ref = reference_grads(q, k, v, do, score, mask, scale, gqa, learn)
    base = lowp_grads(q, k, v, do, score, mask, scale, learn)
    algo = rounded_delta_grads(q, k, v, do, score, mask, scale, gqa, learn, out_used)
    assert_grads_match(first, ref, base, names, tag, algo)


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["alibi_causal_learnable", "relative_bias_learnable"])
def test_deterministic_buffer_grads(name, D):
    check_deterministic_buffer_grads(name, Shape(2, 4, 1000, 900), D)


@gpu
@pytest.mark.parametrize("name", ["alibi_causal_learnable", "relative_bias_learnable"])
def test_deterministic_buffer_grads_gqa(name):
    check_deterministic_buffer_grads(name, Shape(2, 8, 700, 1100), D0, gqa_kv_heads=2)


@gpu
def test_deterministic_buffer_grads_memory_bound(monkeypatch):
    """Past DETERMINISTIC_GRAD_BYTES the backward takes fewer splits (here one per (b, h_kv): each
    CTA walks every KV tile) and stays exact and repeatable; past one split, a clear error."""
    from flexgen.arch import current_arch
    from flexgen.runtime import backward as bw
    from flexgen.runtime.plan import plan

    s = Shape(2, 4, 1000, 900)
    table_bytes = s.H * (2 * 1000 - 1) * 4
    warps = plan("bwd", current_arch(), D0, "bf16", grad_buffers=("rel_bias",)).num_warps
    chosen = []
    pick = bw.deterministic_grad_splits

    def spy(splits, copies_per_split, floats_per_copy, names):
        chosen.append(pick(splits, copies_per_split, floats_per_copy, names))
        return chosen[-1]

    monkeypatch.setattr(bw, "deterministic_grad_splits", spy)
    monkeypatch.setattr(bw, "DETERMINISTIC_GRAD_BYTES", s.B * s.H * warps * table_bytes)  # one split's copies
    check_deterministic_buffer_grads("relative_bias_learnable", s, D0, runs=2)
    assert chosen and set(chosen) == {1}
    monkeypatch.setattr(bw, "DETERMINISTIC_GRAD_BYTES", table_bytes)
    score, _, _, _ = _variant("relative_bias_learnable", s)
    q = torch.randn(s.B, s.H, s.Lq, D0, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s.B, s.H, s.Lkv, D0, device=DEV, dtype=torch.bfloat16)
    out = flexgen.flex_attention(q, k, k, score_mod=score, kernel_options={"deterministic": True})
    with pytest.raises(NotImplementedError, match="DETERMINISTIC_GRAD_BYTES"):
        out.sum().backward()


@gpu
@pytest.mark.parametrize("q_len,deterministic,D", [(200, False, D0), (128, False, D0), (1, True, D0), (200, False, 128)])
def test_preprocess_writes_padded_lse_and_delta(q_len, deterministic, D):
    """The preprocess kernel writes every element of the padded lse (in log2 units) and delta
    (runtime/backward.ROWS_ALIGN), 0 past q_len, lse * log2(e) bit for bit (+inf for -inf), delta = rowsum(dO * O) in fp32, and zeroes the dQ accumulator (each split's, or the fragment order's); the
    outputs start as NaN, so an element it skips shows."""
    from flexgen.runtime import backward as bw

    fresh_seed()
    B, H = 2, 3  # (D = 128 without a mask: the 80-row kernel's fragment-order accumulator)
    o = torch.randn(B, H, q_len, D, device=DEV, dtype=torch.bfloat16)
    do = torch.randn(B, H, q_len, D, device=DEV, dtype=torch.bfloat16)
    lse = torch.randn(B, H, q_len, device=DEV)
    lse[0, 1, 0] = float("-inf")  # a row that saw nothing
    kv = torch.randn(B, H, 1000, D, device=DEV, dtype=torch.bfloat16)  # (deterministic: several KV tiles, splits)
    launch = bw.prepare_backward(o, kv, kv, o, do, None, None, None, 0.1, {"deterministic": deterministic},
                                 (True, True, True))
    assert launch.splits > 1 or not deterministic
    padded = launch.q_len_padded  # (a multiple of ROWS_ALIGN, and of the 80-row steps' 80 where they run)
    assert padded == bw.padded_rows(q_len, launch.spec.block_m)
    delta = torch.full((B, H, padded), float("nan"), device=DEV)
    lse_log2 = torch.full_like(delta, float("nan"))
    dq_accum = launch.dq_accumulator(B, H, q_len, D).fill_(float("nan"))
    launch.preprocess(o, do, lse, delta, lse_log2, dq_accum, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert padded % 128 == 0 and padded >= q_len
    # lse * log2(e) as one fp32 multiply (what the kernels did per score before), +inf where lse is -inf
    want_log2 = torch.where(torch.isneginf(lse), float("inf"), lse * torch.tensor(math.log2(math.e), dtype=torch.float32))
    assert torch.equal(lse_log2[..., :q_len], want_log2) and torch.isposinf(lse_log2[0, 1, 0])
    assert torch.count_nonzero(lse_log2[..., q_len:]) == 0 and torch.count_nonzero(delta[..., q_len:]) == 0
    want = (o.float() * do.float()).sum(-1)
    torch.testing.assert_close(delta[..., :q_len], want, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(dq_accum) == 0
