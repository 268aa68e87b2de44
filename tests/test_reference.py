import math

import pytest
import torch
import torch.nn.functional as F

from flexgen.dsl import ir, reference
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
    return (p @ v).to(q.dtype), lse.float()


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


def test_index_tensors_are_int32_and_broadcastable():
    seen = {}

    def probe(score, b, h, q_idx, kv_idx):
        seen.update(b=b, h=h, q=q_idx, kv=kv_idx, score=score)
        return score

    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=3, Lkv=4)
    reference_attention(q, k, v, probe)
    assert all(seen[n].dtype == torch.int32 for n in ("b", "h", "q", "kv"))
    assert seen["b"].shape == (1, 1, 1, 1) and seen["h"].shape == (1, 2, 1, 1)
    assert seen["q"].shape == (1, 1, 3, 1) and seen["kv"].shape == (1, 1, 1, 4)
    assert seen["score"].dtype == torch.float64 and seen["score"].shape == (1, 2, 3, 4)


# ---------------------------------------------------------------- against torch SDPA


def test_matches_sdpa_causal():
    q, k, v = qkv(Lq=16, Lkv=16)
    out, lse = reference_attention(q, k, v, mask_mod=causal, return_lse=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1).float())


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
