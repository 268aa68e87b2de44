"""Attention dropout on the GPU: the kernels' keep mask is exactly flexgen.dropout's, forward and
backward agree with float64 math that applies that mask, and the randomness behaves.

Semantics (PyTorch SDPA's): P = softmax(scores) (lse is that of the un-dropped P),
O = (P * Z / (1 - p)) V with Z the Bernoulli(1 - p) keep mask of flexgen.dropout.dropout_keep_mask.
Error bars as in test_gpu_forward.py / test_gpu_backward.py: at most twice PyTorch's own
low-precision error (the same math in bf16 / fp16, the same mask) plus a small epsilon.

The kernels are called through forward_call / backward_call with an explicit philox=(seed, offset);
the last test uses the public flex_attention(dropout_p=...), which draws (seed, offset) from torch's
generator (it lands with the flex_attention dropout argument).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import flexgen
from flexgen.runtime.forward import forward_call
from flexgen.captures import traced
from flexgen.dropout import dropout_keep_mask
from lowp_math import masked_scores

gpu = pytest.mark.gpu
DEV = "cuda"
V = flexgen.variants


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def philox_pair() -> tuple[int, int]:
    return int.from_bytes(os.urandom(8), "little"), int.from_bytes(os.urandom(8), "little")


def _mods(name: str, heads: int, learnable: bool = False):
    """(score Mod, mask function) of a variant; learnable: the ALiBi slopes require grad."""
    if name == "none":
        return None, None
    if name == "causal":
        return None, V.causal
    if name == "alibi_causal":
        slopes = V.alibi_slopes(heads).to(DEV)
        return V.alibi(slopes.requires_grad_() if learnable else slopes), V.causal
    raise KeyError(name)


def _block_mask(mask, lq, lkv):
    if mask is None:
        return None, None
    bm = flexgen.create_block_mask(mask, None, None, lq, lkv, device=DEV)
    return bm, (traced(bm.mask_mod, "mask") if bm is not None and bm.mask_mod is not None else None)


def attention_math(q, k, v, score, mask, scale, keep=None, p=0.0):
    """(out, lse) with every op in q.dtype: float64 for the reference, bf16 / fp16 for PyTorch's
    own low-precision error. keep: the dropout mask, applied after the softmax."""
    s, v = masked_scores(q, k, v, score, mask, scale)
    lse = torch.logsumexp(s if q.dtype == torch.float64 else s.float(), dim=-1)
    prob = torch.softmax(s, dim=-1)
    if keep is not None:
        prob = prob * keep.to(prob.dtype) * (1.0 / (1.0 - p))
    return torch.matmul(prob, v), lse


# Each kernel test runs on the default family (on Hopper the sm90 one for head dims 64 and 128, sm80 otherwise and for
# buffer gradients) and on sm80 by request.
FAMILIES = [None, "sm80"]


def _options(family):
    return None if family is None else {"family": family}


def flexgen_forward(q, k, v, score, mask, p, philox, scale=None, family=None):
    bm, elem = _block_mask(mask, q.shape[2], k.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = forward_call(q, k, v, score, bm, elem, scale, _options(family), dropout_p=p, philox=philox)
    torch.cuda.synchronize()
    return out, lse


def flexgen_backward(q, k, v, out, lse, do, score, mask, p, philox, grad_buffers=(), family=None):
    from flexgen.runtime.backward import backward_call

    bm, elem = _block_mask(mask, q.shape[2], k.shape[2])
    dq, dk, dv, bufs = backward_call(q, k, v, out, lse, do, score, bm, elem, 1.0 / math.sqrt(q.shape[-1]), _options(family),
                                     (True, True, True), grad_buffers=grad_buffers, dropout_p=p, philox=philox)
    torch.cuda.synchronize()
    return [dq, dk, dv] + [bufs[n] for n in grad_buffers]


def _error_bar(got, ref, base, what, eps, algo=None):
    """||got - ref|| <= 2 x max(||base - ref||, ||algo - ref||) + eps."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"NaN in {what}"
    err = (got.double() - ref).norm().item()
    bar = (base.double() - ref).norm().item()
    if algo is not None:
        bar = max(bar, (algo.double() - ref).norm().item())
    assert err <= 2 * bar + eps, f"{what}: error {err:.3e} > 2 x {bar:.3e} + {eps}"


# ---------------------------------------------------------------- the mask itself, exactly


@gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("q_len", [64, 77, 1, 200])
@pytest.mark.parametrize("p", [0.5, 0.1, 0.9])
def test_forward_keep_pattern_is_the_reference_mask(q_len, p, family):
    """Q = K = 0 makes P = 1 / KV_LEN; V = identity (KV_LEN = D = 64) makes O[b, h, i, j] the
    dropped-and-rescaled P[i, j]: O * KV_LEN * (1 - p) is the keep mask."""
    B, H, L = 2, 3, 64
    q = torch.zeros(B, H, q_len, L, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(B, H, L, L, device=DEV, dtype=torch.bfloat16)
    v = torch.eye(L, device=DEV, dtype=torch.bfloat16).expand(B, H, L, L).contiguous()
    seed, offset = philox_pair()
    out, lse = flexgen_forward(q, k, v, None, None, p, (seed, offset), family=family)
    keep = dropout_keep_mask(seed, offset, B, H, q_len, L, p, device=DEV)
    tag = f"seed={seed} offset={offset} p={p} q_len={q_len} family={family}"
    assert torch.equal(out != 0, keep), f"{int((( out != 0) != keep).sum())} elements differ from the mask: {tag}"
    assert torch.equal(torch.round(out.double() * L * (1 - p)), keep.double()), tag
    if p == 0.5:  # 1 / (1 - p) = 2 and 1 / 64 are exact in bf16
        assert torch.equal(out.double() * L * (1 - p), keep.double()), tag
    assert torch.allclose(lse, torch.full_like(lse, math.log(L))), f"lse must ignore dropout: {tag}"


@gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("q_len", [64, 37])
def test_backward_keep_pattern_is_the_reference_mask(q_len, family):
    """Same inputs, dO = identity: dV[kv, j] = sum_q P_dropped[q, kv] dO[q, j] = P_dropped[j, kv]
    for j < q_len: the backward regenerates the forward's mask, transposed tiles and all."""
    B, H, L, p = 2, 3, 64, 0.5
    q = torch.zeros(B, H, q_len, L, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(B, H, L, L, device=DEV, dtype=torch.bfloat16)
    v = torch.eye(L, device=DEV, dtype=torch.bfloat16).expand(B, H, L, L).contiguous()
    do = torch.eye(q_len, L, device=DEV, dtype=torch.bfloat16).expand(B, H, q_len, L).contiguous()
    seed, offset = philox_pair()
    out, lse = flexgen_forward(q, k, v, None, None, p, (seed, offset), family=family)
    _, _, dv = flexgen_backward(q, k, v, out, lse, do, None, None, p, (seed, offset), family=family)
    keep = dropout_keep_mask(seed, offset, B, H, q_len, L, p, device=DEV)
    want = torch.zeros(B, H, L, L, dtype=torch.float64, device=DEV)
    want[:, :, :, :q_len] = keep.transpose(-1, -2).double()
    assert torch.equal(torch.round(dv.double() * L * (1 - p)), want), f"seed={seed} offset={offset} family={family}"


# ---------------------------------------------------------------- forward and backward against float64

CASES = [  # name, B, H, H_kv, Lq, Lkv, D, dtype, p
    ("none", 2, 4, 4, 1000, 1000, 64, torch.bfloat16, 0.1),
    ("causal", 2, 4, 4, 1000, 1000, 64, torch.bfloat16, 0.3),
    ("alibi_causal", 2, 4, 4, 1000, 1000, 64, torch.bfloat16, 0.1),
    ("causal", 1, 4, 4, 333, 555, 128, torch.bfloat16, 0.2),
    ("alibi_causal", 1, 2, 2, 555, 333, 128, torch.bfloat16, 0.1),
    ("none", 1, 2, 2, 700, 700, 128, torch.float16, 0.5),
    ("causal", 1, 8, 2, 513, 513, 64, torch.bfloat16, 0.1),  # GQA
    ("causal", 1, 4, 4, 777, 777, 96, torch.bfloat16, 0.2),
    ("alibi_causal", 1, 2, 2, 333, 555, 256, torch.bfloat16, 0.1),
]


def _case_id(c):
    return f"{c[0]}-B{c[1]}H{c[2]}kv{c[3]}-{c[4]}x{c[5]}-D{c[6]}-{str(c[7])[6:]}-p{c[8]}"


def _inputs(B, H, Hkv, Lq, Lkv, D, dtype):
    return (torch.randn(B, H, Lq, D, device=DEV, dtype=dtype), torch.randn(B, Hkv, Lkv, D, device=DEV, dtype=dtype),
            torch.randn(B, Hkv, Lkv, D, device=DEV, dtype=dtype))


def _forward_case(case, learnable=False, family=None):
    """Fresh inputs for a case, and flexgen's forward with dropout on them."""
    name, B, H, Hkv, Lq, Lkv, D, dtype, p = case
    tag = f"{_case_id(case)} family={family} (seed {fresh_seed()})"
    q, k, v = _inputs(B, H, Hkv, Lq, Lkv, D, dtype)
    score, mask = _mods(name, H, learnable)
    philox = philox_pair()
    out, lse = flexgen_forward(q, k, v, score, mask, p, philox, family=family)
    keep = dropout_keep_mask(*philox, B, H, Lq, Lkv, p, device=DEV)
    return tag, (q, k, v), score, mask, philox, (out, lse), keep


@gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_matches_float64(case, family):
    tag, (q, k, v), score, mask, _, (out, lse), keep = _forward_case(case, family=family)
    p, scale = case[-1], 1.0 / math.sqrt(q.shape[-1])
    ref, ref_lse = attention_math(q.double(), k.double(), v.double(), score, mask, scale, keep, p)
    base, base_lse = attention_math(q, k, v, score, mask, scale, keep, p)
    _error_bar(out, ref, base, f"out {tag}", 1e-5)
    _error_bar(lse, ref_lse, base_lse, f"lse {tag}", 1e-5)


@gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_matches_float64(case, family):
    """On sm80 the ALiBi slopes are learnable (buffer gradients, which only that backward computes); on the default
    family they are fixed, so that the sm90 backward runs them."""
    learnable = family == "sm80"
    tag, (q, k, v), score, mask, philox, (out, lse), keep = _forward_case(case, learnable=learnable, family=family)
    p, scale, dtype = case[-1], 1.0 / math.sqrt(q.shape[-1]), q.dtype
    do = torch.randn_like(q)
    learn = ("alibi_slopes",) if score is not None and learnable else ()
    got = flexgen_backward(q, k, v, out, lse, do, score, mask, p, philox, grad_buffers=learn, family=family)

    def grads(dtype_, out_used=None):
        """Autograd of attention_math in dtype_. out_used: instead, the buffer gradients of the
        exact FlashAttention backward fed that (rounded) output: delta = rowsum(dO * out_used)."""
        leaves = [t.detach().to(dtype_).requires_grad_() for t in (q, k, v)]
        slopes = [score.buffers[n].detach().to(dtype_ if dtype_ == torch.float64 else torch.float32).requires_grad_()
                  for n in learn]
        mod = V.alibi(slopes[0]) if learn else score
        o, l = attention_math(*leaves, mod, mask, scale, keep, p)
        if out_used is None:
            o.backward(do.to(dtype_))
        else:
            e = (do.double() * (out_used.double() - o.detach())).sum(-1)
            torch.autograd.backward([o, l], [do.double(), -e])
        return [t.grad for t in leaves + slopes]

    ref = grads(torch.float64)
    base = grads(dtype)
    algo = grads(torch.float64, out_used=out) if learn else []
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learn]
    for i, (n, g, r, bl) in enumerate(zip(names, got, ref, base)):
        _error_bar(g, r, bl, f"{n} {tag}", 1e-4, algo[i] if i >= 3 else None)


# ---------------------------------------------------------------- randomness


@gpu
def test_same_stream_same_bits_other_stream_other_mask():
    tag = f"seed {fresh_seed()}"
    B, H, L, D, p = 2, 4, 500, 64, 0.2
    q, k, v = _inputs(B, H, H, L, L, D, torch.bfloat16)
    do = torch.randn_like(q)
    score, mask = _mods("alibi_causal", H)
    philox = philox_pair()
    runs = []
    for _ in range(3):
        out, lse = flexgen_forward(q, k, v, score, mask, p, philox)
        runs.append([out, lse] + flexgen_backward(q, k, v, out, lse, do, score, mask, p, philox)[:3])
    for again in runs[1:]:
        # out, lse, dk, dv: bitwise. dq is summed over KV tiles by atomics, in no fixed order:
        # equal up to that rounding (a different mask would move it by far more).
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], again):
            if name == "dq":
                assert (a.float() - b.float()).abs().max() <= 1e-2 * a.float().abs().max(), f"dq moved: {tag}"
            else:
                assert torch.equal(a, b), f"same (seed, offset), different {name}: {tag}"
    seed, offset = philox
    ones = torch.ones(B, H, L, L, dtype=torch.bool, device=DEV)
    base = dropout_keep_mask(seed, offset, B, H, L, L, p, device=DEV)
    for other in ((seed, offset + 1), ((seed + 1) % 2**64, offset)):
        out2, _ = flexgen_forward(q, k, v, score, mask, p, other)
        assert not torch.equal(out2, runs[0][0]), f"{other} gave the output of {philox}: {tag}"
        assert 0.25 < (dropout_keep_mask(*other, B, H, L, L, p, device=DEV) != base).float().mean() < 0.4
    assert not torch.equal(base, ones)


@gpu
def test_mean_over_streams_is_the_undropped_attention():
    """E[Z / (1 - p)] = 1: averaging outputs over many offsets converges to plain attention."""
    tag = f"seed {fresh_seed()}"
    B, H, L, D, p = 1, 2, 128, 64, 0.2
    q, k, v = _inputs(B, H, H, L, L, D, torch.bfloat16)
    ref, _ = attention_math(q.double(), k.double(), v.double(), None, None, 1.0 / math.sqrt(D))
    seed = philox_pair()[0]
    total = torch.zeros_like(ref)
    rel = {}
    for n in range(1, 257):
        out, _ = flexgen_forward(q, k, v, None, None, p, (seed, n))
        total += out.double()
        if n in (1, 16, 256):
            rel[n] = ((total / n - ref).norm() / ref.norm()).item()
    # One draw is far off (std about p / (1 - p) / L per weight); 256 are 16 times closer.
    assert rel[1] > 0.2, f"dropout seems not applied: {rel} {tag}"
    assert rel[256] < 0.1 and rel[256] < rel[16] < rel[1], f"{rel} {tag}"
    plain, _ = flexgen_forward(q, k, v, None, None, 0.0, None)
    _error_bar(plain, ref, attention_math(q, k, v, None, None, 1.0 / math.sqrt(D))[0], f"p=0 {tag}", 1e-5)


@gpu
def test_zero_dropout_is_the_plain_kernel():
    fresh_seed()
    q, k, v = _inputs(1, 2, 2, 300, 300, 64, torch.bfloat16)
    a = flexgen_forward(q, k, v, None, V.causal, 0.0, (1, 2))
    b = flexgen_forward(q, k, v, None, V.causal, 0.0, None)
    c = flexgen.flex_attention(q, k, v, block_mask=_block_mask(V.causal, 300, 300)[0], return_lse=True)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


# ---------------------------------------------------------------- the public argument


@gpu
def test_flex_attention_dropout_p_follows_torch_manual_seed():
    """Needs flex_attention(dropout_p=...), which draws (seed, offset) from torch's CUDA generator."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))

    def run(seed):
        torch.manual_seed(seed)
        return flexgen.flex_attention(q, k, v, dropout_p=0.1)

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b), "same torch seed, different dropout"
    assert not torch.equal(a, c), "different torch seeds, same dropout"
    torch.manual_seed(1)
    first, second = flexgen.flex_attention(q, k, v, dropout_p=0.1), flexgen.flex_attention(q, k, v, dropout_p=0.1)
    assert not torch.equal(first, second), "two calls in a row drew the same mask"
