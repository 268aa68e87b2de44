import math

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen.blockmask import BlockMask
from flexgen.dsl import ir, reference
from flexgen.dsl.errors import FlexgenTraceError
from flexgen.dsl.ir import BufferSpec, DType
from flexgen.dsl.mod import Mod
from flexgen.dsl.reference import reference_attention


def rand(*shape, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def qkv(B=2, Hq=4, Hkv=4, Lq=7, Lkv=9, D=8, Dv=8, dtype=torch.float64):
    return rand(B, Hq, Lq, D, dtype=dtype, seed=1), rand(B, Hkv, Lkv, D, dtype=dtype, seed=2), rand(B, Hkv, Lkv, Dv, dtype=dtype, seed=3)


def dense(q, k, v, score_mod=None, mask_mod=None, scale=None):
    """The textbook version: everything at once, GQA by repeating kv heads."""
    B, Hq, Lq, D = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    k = k.double().repeat_interleave(Hq // Hkv, dim=1)
    v = v.double().repeat_interleave(Hq // Hkv, dim=1)
    scale = 1 / math.sqrt(D) if scale is None else scale
    s = q.double() @ k.transpose(-1, -2) * scale
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(Hq)[None, :, None, None]
    qi = torch.arange(Lq)[None, None, :, None]
    ki = torch.arange(Lkv)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki).expand(s.shape).double()
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki).expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).to(q.dtype), lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def alibi_like(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.1 * (q_idx - kv_idx).abs() + b * 0.5


# ---------------------------------------------------------------- against the dense version


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("Lq,Lkv", [(7, 9), (9, 7), (1, 5)])
def test_matches_dense(Hq, Hkv, Lq, Lkv):
    q, k, v = qkv(Hq=Hq, Hkv=Hkv, Lq=Lq, Lkv=Lkv, Dv=5)
    window = lambda b, h, qi, ki: (qi - ki).abs() <= 3
    out, lse = reference_attention(q, k, v, alibi_like, window, enable_gqa=Hq != Hkv, return_lse=True)
    want, want_lse = dense(q, k, v, alibi_like, window)
    assert out.shape == (2, Hq, Lq, 5) and lse.shape == (2, Hq, Lq)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_chunking_is_invisible(monkeypatch):
    q, k, v = qkv(Hq=6, Hkv=3, Lq=13, Lkv=11)
    want, want_lse = reference_attention(q, k, v, alibi_like, causal, enable_gqa=True, return_lse=True)
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 40)  # a few rows, one head at a time
    out, lse = reference_attention(q, k, v, alibi_like, causal, enable_gqa=True, return_lse=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse)


def _counting_chunks(monkeypatch):
    calls = []
    real = reference._chunk
    monkeypatch.setattr(reference, "_chunk", lambda *a: calls.append(a[0].shape) or real(*a))
    return calls


def test_many_short_sequences_share_a_chunk(monkeypatch):
    """Batch rows join one chunk where a whole (heads, rows) slab is small: one chunk for 64 sequences, with what
    64 chunks of one sequence give, under a mask that depends on b (block lists per batch row and a mask_mod)."""
    B, H, L = 64, 2, 12
    q, k, v = rand(B, H, L, 8, seed=4), rand(B, H, L, 8, seed=5), rand(B, H, L, 8, seed=6)
    per_batch = lambda b, h, qi, ki: (qi >= ki) | ((b + h) % 3 == 0)  # noqa: E731
    bm = flexgen.create_block_mask(per_batch, B, H, L, L, device="cpu", BLOCK_SIZE=4)
    by_b = lambda s, b, h, qi, ki: s + 0.5 * b - 0.25 * h  # noqa: E731
    calls = _counting_chunks(monkeypatch)
    out, lse, top = reference.reference_outputs(q, k, v, by_b, None, None, False, bm)
    assert calls == [(B, H, L, 8)]
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", H * L * L)  # a chunk per batch row, as before batching
    calls.clear()
    want = reference.reference_outputs(q, k, v, by_b, None, None, False, bm)
    assert len(calls) == B
    for got, ref in zip((out, lse, top), want):
        assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_large_calls_recompute_their_chunks_in_the_backward(monkeypatch):
    """Past RECOMPUTE_ABOVE scores a chunk keeps only its inputs for the backward: the same gradients (of q, k, v and
    of a learnable bias), a fraction of the memory held between forward and backward; under torch.func (the
    compiled unfused path's backward) the chunks are kept, as its transforms take no saved-tensor hooks."""
    q, k, v = (rand(2, 3, 40, 8, seed=s).requires_grad_() for s in (7, 8, 9))
    bias = rand(40, seed=10).requires_grad_()
    mod = flexgen.score_mod(lambda s, b, h, qi, ki: s + bias[ki] * (h + 1))
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 2 * 3 * 10 * 40)  # four chunks

    def run(threshold):
        monkeypatch.setattr(reference, "RECOMPUTE_ABOVE", threshold)
        saved = {}

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, lse, _ = reference.reference_outputs(q, k, v, mod, causal)
        grads = torch.autograd.grad((out * out).sum() + lse[torch.isfinite(lse)].sum(), (q, k, v, bias))
        return grads, sum(saved.values())

    kept, kept_bytes = run(1 << 40)
    again, again_bytes = run(0)
    for a, b in zip(kept, again):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert again_bytes * 3 < kept_bytes

    def lse_sum(q):
        return reference.reference_outputs(q, k.detach(), v.detach(), mod, causal)[1].clamp(min=-1e9).sum()

    torch.testing.assert_close(torch.func.grad(lse_sum)(q.detach()), torch.autograd.grad(lse_sum(q), q)[0])


def elementwise(fn, B, H, Lq, Lkv, score=None):
    """fn called once per (b, h, q_idx, kv_idx) with 0-dim int32 tensors: what a mod means."""
    out = torch.empty(B, H, Lq, Lkv, dtype=torch.float64 if score is not None else torch.bool)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    for b in range(B):
        for h in range(H):
            for qi in range(Lq):
                for ki in range(Lkv):
                    args = (i32(b), i32(h), i32(qi), i32(ki))
                    out[b, h, qi, ki] = fn(score[b, h, qi, ki], *args) if score is not None else fn(*args)
    return out


def test_plain_functions_mean_one_element_at_a_time():
    # attention-gym's pattern: look up a row of a captured table, then index that row
    image_of = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2], dtype=torch.int64)  # kv position -> image
    intervals = torch.tensor([[0, 3], [2, 6], [5, 7]], dtype=torch.int32)  # image -> [first q, last q)

    def mask(b, h, q_idx, kv_idx):
        interval = intervals[image_of[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    q, k, v = qkv(Lq=7, Lkv=9)
    out, lse = reference_attention(q, k, v, mask_mod=mask, return_lse=True)
    allowed = elementwise(mask, 2, 4, 7, 9)
    assert allowed.any(-1).all() and not allowed.all()
    want, want_lse = dense(q, k, v, mask_mod=lambda b, h, qi, ki: allowed[b, h, qi, ki])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_index_arithmetic_wraps_like_int32():
    # q * kv * 2**20 leaves int32 for q * kv >= 2048; kernels and PyTorch's int32 indices wrap
    mask = lambda b, h, qi, ki: qi * ki * 1048576 >= 0  # noqa: E731
    q, k, v = qkv(B=1, Hq=1, Hkv=1, Lq=64, Lkv=64)
    qi, ki = torch.arange(64)[:, None], torch.arange(64)[None, :]
    wrapped = (qi * ki * 2**20 + 2**31) % 2**32 - 2**31  # exact int32 wrap-around, in int64
    assert (wrapped < 0).any()
    want = dense(q, k, v, mask_mod=lambda b, h, i, j: (wrapped >= 0)[i, j])[0]
    torch.testing.assert_close(reference_attention(q, k, v, mask_mod=mask), want, rtol=1e-12, atol=1e-12)


def test_functions_the_tracer_refuses_are_vmapped():
    table = torch.tensor([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], dtype=torch.float64)
    row = torch.tensor([2, 0, 1, 1, 0], dtype=torch.int64)

    def score_mod(score, b, h, q_idx, kv_idx):  # bessel_j0 is no flexgen op; the lookup is per element
        return score + torch.special.bessel_j0(table[row[kv_idx]][q_idx % 2])

    with pytest.raises(FlexgenTraceError):
        flexgen.score_mod(score_mod)
    q, k, v = qkv(Lq=4, Lkv=5)
    scores = q @ k.transpose(-1, -2) / math.sqrt(8)
    modified = elementwise(score_mod, 2, 4, 4, 5, score=scores)
    want = dense(q, k, v, score_mod=lambda s, b, h, qi, ki: modified)[0]
    torch.testing.assert_close(reference_attention(q, k, v, score_mod=score_mod), want, rtol=1e-12, atol=1e-12)


def test_lse_is_float64_for_float64_inputs():
    q, k, v = qkv(Lq=5, Lkv=6)
    _, lse = reference_attention(q, k, v, mask_mod=causal, return_lse=True)
    assert lse.dtype == torch.float64
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(5, 6, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-14, atol=1e-14)
    _, lse32 = reference_attention(q.float(), k.float(), v.float(), return_lse=True)
    assert lse32.dtype == torch.float32


@pytest.mark.parametrize("size", [1e16, 1e30, 1e300])
def test_huge_equal_scores_average_the_values(size):
    q, k, v = qkv(Lq=3, Lkv=6)
    out, lse = reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.0 + size, return_lse=True)
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand_as(out), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.full_like(lse, size) + math.log(6), rtol=1e-15, atol=0.0)


def test_huge_distinct_scores_pick_the_largest():
    q, k, v = qkv(Lq=5, Lkv=7)
    out = reference_attention(q, k, v, scale=1e17)
    want, _ = dense(q, k, v, scale=1e17)  # torch.softmax subtracts the maximum
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- against torch SDPA


def test_matches_sdpa_causal():
    q, k, v = qkv(Lq=16, Lkv=16)
    out, lse = reference_attention(q, k, v, mask_mod=causal, return_lse=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


def test_matches_sdpa_gqa_with_scale():
    q, k, v = qkv(Hq=8, Hkv=2, Lq=5, Lkv=12)
    out = reference_attention(q, k, v, scale=0.3, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, want)


def test_gradients_match_sdpa():
    q, k, v = (t.requires_grad_(True) for t in qkv(Lq=6, Lkv=6))
    g = rand(2, 4, 6, 8, seed=9)
    got = torch.autograd.grad((reference_attention(q, k, v, mask_mod=causal) * g).sum(), (q, k, v))
    want = torch.autograd.grad((F.scaled_dot_product_attention(q, k, v, is_causal=True) * g).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- fully masked rows, dtypes, Mods


def test_fully_masked_rows_give_zero_and_minus_inf():
    q, k, v = qkv(Lq=6, Lkv=6)
    mask = lambda b, h, qi, ki: (qi >= 2) & (ki <= qi)
    q.requires_grad_(True)
    out, lse = reference_attention(q, k, v, mask_mod=mask, return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, :, :2] == 0).all()
    assert (lse[:, :, :2] == -math.inf).all() and lse[:, :, 2:].isfinite().all()
    (gq,) = torch.autograd.grad(out.sum(), q)
    assert not gq.isnan().any()
    nothing = reference_attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi < 0)
    assert (nothing == 0).all()


def test_output_dtypes():
    q, k, v = qkv(dtype=torch.bfloat16)
    out, lse = reference_attention(q, k, v, mask_mod=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, _ = dense(q.double(), k.double(), v.double(), mask_mod=causal)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_mods_match_callables():
    s, b, h = ir.input_("score"), ir.input_("b"), ir.input_("h")
    qi, ki = ir.input_("q_idx"), ir.input_("kv_idx")
    bias = BufferSpec("bias", "float32", 1)
    # score + bias[kv] - 0.1 * (h + 1) * |q - kv|
    slope = ir.binary("mul", ir.const(0.1), ir.binary("add", h, ir.const(1)))
    expr = ir.binary(
        "sub", ir.binary("add", s, ir.load(bias, (ki,))), ir.binary("mul", slope, ir.unary("abs", ir.binary("sub", qi, ki)))
    )
    bias_t = rand(9, seed=5)
    score_mod = Mod("score", expr, buffers={"bias": bias_t}, name="alibi_bias")
    window = ir.binary("le", ir.binary("sub", qi, ki), ir.param("w", DType.INT32))
    mask_mod = Mod("mask", ir.binary("and", ir.binary("ge", qi, ki), window), params={"w": 2}, name="sliding")
    q, k, v = qkv(Hq=4, Hkv=2)
    out, lse = reference_attention(q, k, v, score_mod, mask_mod, enable_gqa=True, return_lse=True)
    fn_score = lambda sc, b_, h_, q_, k_: sc + bias_t[k_.long()] - 0.1 * (h_ + 1) * (q_ - k_).abs()
    fn_mask = lambda b_, h_, q_, k_: (q_ >= k_) & (q_ - k_ <= 2)
    want, want_lse = dense(q, k, v, fn_score, fn_mask)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    # a constant mask Mod reads no inputs at all
    out_all = reference_attention(q, k, v, mask_mod=Mod("mask", ir.const(True)), enable_gqa=True)
    torch.testing.assert_close(out_all, dense(q, k, v)[0])


# ---------------------------------------------------------------- validation


def test_validation_errors():
    q, k, v = qkv(Hq=4, Hkv=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        reference_attention(q, k, v)
    with pytest.raises(ValueError, match="4 dimensions"):
        reference_attention(q[0], k, v)
    q3, k3, v3 = qkv(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        reference_attention(q3, k3, v3, enable_gqa=True)
    with pytest.raises(ValueError, match="head dims"):
        reference_attention(q[..., :4], k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="heads and length"):
        reference_attention(q, k, v[:, :, :3], enable_gqa=True)
    with pytest.raises(ValueError, match="batch"):
        reference_attention(q[:1], k, v, enable_gqa=True)
    with pytest.raises(ValueError, match="score Mod"):
        reference_attention(q, k, v, score_mod=Mod("mask", ir.const(True)), enable_gqa=True)
    with pytest.raises(TypeError, match="floating"):
        reference_attention(q.long(), k, v, enable_gqa=True)


# ---------------------------------------------------------------- block masks


def block_layout_mask(partial, full, bq, bkv, mask, B, H, Lq, Lkv):
    """The dense mask a block mask stands for, position by position: full blocks visible,
    partial blocks where mask_mod holds, the rest hidden."""
    allowed = torch.zeros(B, H, Lq, Lkv, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            pb, ph = min(b, partial.shape[0] - 1), min(h, partial.shape[1] - 1)
            for qi in range(Lq):
                for ki in range(Lkv):
                    if full[pb, ph, qi // bq, ki // bkv]:
                        allowed[b, h, qi, ki] = True
                    elif partial[pb, ph, qi // bq, ki // bkv]:
                        allowed[b, h, qi, ki] = bool(mask(*(torch.tensor(x, dtype=torch.int32) for x in (b, h, qi, ki))))
    return allowed


@pytest.mark.parametrize("mb,mh", [(1, 1), (2, 1), (2, 4)])
def test_block_mask_is_blocks_and_mask_mod(mb, mh):
    g = torch.Generator().manual_seed(mb * 10 + mh)
    B, H, Lq, Lkv, bq, bkv = 2, 4, 37, 50, 16, 16
    nq, nkv = -(-Lq // bq), -(-Lkv // bkv)
    state = torch.randint(0, 3, (mb, mh, nq, nkv), generator=g)  # 0 skipped, 1 partial, 2 full
    partial, full = state == 1, state == 2
    # the mask is False in places inside full blocks too: there it must not apply
    mask = lambda b, h, qi, ki: (qi + 2 * ki + h) % 3 != 0  # noqa: E731
    order = lambda blocks: torch.sort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)  # noqa: E731
    bm = BlockMask.from_kv_blocks(
        partial.sum(-1, dtype=torch.int32), order(partial)[1].int(),
        full.sum(-1, dtype=torch.int32), order(full)[1].int(),
        BLOCK_SIZE=(bq, bkv), mask_mod=mask, seq_lengths=(Lq, Lkv),
    )
    allowed = block_layout_mask(partial, full, bq, bkv, mask, B, H, Lq, Lkv)
    q, k, v = qkv(B=B, Hq=H, Hkv=2, Lq=Lq, Lkv=Lkv)
    bias = lambda s, b, h, qi, ki: s - 0.5 * (qi - ki).abs() + 0.25 * h  # exact in float32 too  # noqa: E731
    out, lse = reference_attention(q, k, v, score_mod=bias, block_mask=bm, enable_gqa=True, return_lse=True)
    want, want_lse = dense(q, k, v, score_mod=bias, mask_mod=lambda b, h, qi, ki: allowed[b, h, qi, ki])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_block_mask_from_create_block_mask_and_from_pytorch():
    doc = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=64, Lkv=64)
    want = reference_attention(q, k, v, mask_mod=document_causal)
    ours = flexgen.create_block_mask(document_causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(reference_attention(q, k, v, block_mask=ours), want, rtol=1e-12, atol=1e-12)
    from torch.nn.attention.flex_attention import create_block_mask

    theirs = create_block_mask(document_causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    torch.testing.assert_close(reference_attention(q, k, v, block_mask=theirs), want, rtol=1e-12, atol=1e-12)


def test_block_mask_errors():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=32, Lkv=32)
    bm = flexgen.create_block_mask(causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="either mask_mod or block_mask"):
        reference_attention(q, k, v, mask_mod=causal, block_mask=bm)
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(32, 32\)"):
        reference_attention(q[:, :, :16], k, v, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask="):
        reference_attention(q, k, v, mask_mod=bm)
    wide = BlockMask.from_kv_blocks(torch.ones(3, 1, 2, dtype=torch.int32), torch.zeros(3, 1, 2, 2, dtype=torch.int32),
                                    BLOCK_SIZE=16, seq_lengths=(32, 32))
    first = BlockMask.from_kv_blocks(torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32),
                                     BLOCK_SIZE=16, seq_lengths=(32, 32))
    torch.testing.assert_close(reference_attention(q, k, v, block_mask=wide),  # (a larger batch's mask: its first)
                               reference_attention(q, k, v, block_mask=first), rtol=0, atol=0)
    with pytest.raises(ValueError, match="B=3"):
        reference_attention(*qkv(B=4, Hq=2, Hkv=2, Lq=32, Lkv=32), block_mask=wide)
    past_end = BlockMask.from_kv_blocks(torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32),
                                        BLOCK_SIZE=16, seq_lengths=(32, 32))
    past_end.kv_indices[..., 0, 0] = 5  # (changed after the checks; a block past the sequence holds no keys)
    without = BlockMask.from_kv_blocks(torch.tensor([[[0, 1]]], dtype=torch.int32),
                                       torch.zeros(1, 1, 2, 2, dtype=torch.int32), BLOCK_SIZE=16, seq_lengths=(32, 32))
    torch.testing.assert_close(reference_attention(q, k, v, block_mask=past_end),
                               reference_attention(q, k, v, block_mask=without), rtol=0, atol=0)
    past_end.kv_num_blocks[..., 0] = 3
    with pytest.raises(ValueError, match="counts outside"):
        reference_attention(q, k, v, block_mask=past_end)
