"""Score_mods the sm90 forward computes by terms of its own (templates/sm90/fwd.cu.j2, ScoreTerms) instead of
calling them per score: affine in the indices (ALiBi and kin: score + kv_coef kv + q_coef q + bias, per row and
column) and soft caps (outer * tanh(inner * score)). Which forwards take them (on the CPU), and on a Hopper that
they match the float64 reference as the generic path does, at offsets where the index terms are large and with
caps of either sign."""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen import variants as V
from flexgen.codegen.api import make_spec
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.render import render
from sm90_cases import SM90, hopper

gpu = pytest.mark.gpu


def affine_mods(heads: int, device: str = "cpu") -> dict:
    """Affine score_mods written the ways users write them; each a (score_mod, what it is) pair."""
    slopes = torch.rand(heads, device=device) * 0.5 + 0.01
    return {
        "alibi_buffer": V.alibi(heads),
        "alibi_exp2": flexgen.score_mod(lambda s, b, h, q, kv: s + torch.exp2(-8.0 * (h + 1) / heads) * (kv - q)),
        "alibi_negated": flexgen.score_mod(lambda s, b, h, q, kv: s - slopes[h] * (q - kv).float()),
        "alibi_divided": flexgen.score_mod(lambda s, b, h, q, kv: (kv - q) * slopes[h] / 3.0 + s),
        "kv_ramp_and_bias": flexgen.score_mod(lambda s, b, h, q, kv: s + 0.002 * kv + slopes[h]),
        "q_ramp": flexgen.score_mod(lambda s, b, h, q, kv: s + 0.003 * q - 1.5),
    }


def softcap_mods(heads: int, device: str = "cpu") -> dict:
    caps = torch.rand(heads, device=device) * 20 + 2
    return {
        "softcap_variant": V.softcap(1.5),
        "softcap_python": flexgen.score_mod(lambda s, b, h, q, kv: 3.0 * torch.tanh(s / 3.0)),
        "softcap_negative": flexgen.score_mod(lambda s, b, h, q, kv: -2.0 * torch.tanh(s * 0.5)),
        "softcap_per_head": flexgen.score_mod(lambda s, b, h, q, kv: caps[h] * torch.tanh(s / caps[h])),
        "softcap_zero": flexgen.score_mod(lambda s, b, h, q, kv: 0.0 * torch.tanh(s)),
    }


def _rendered(score, mask=None, **options) -> str:
    spec = make_spec("fwd", score, mask, head_dim=128, dtype="bf16", arch="sm_90a",
                     mask_block=(128, 128) if mask is not None else None, **SM90, **options)
    return render(spec)


@pytest.mark.parametrize("name", list(affine_mods(4)))
def test_affine_score_mods_take_the_row_and_column_path(name):
    source = _rendered(affine_mods(4)[name], V.causal)
    assert "constexpr bool AFFINE_SCORE = true;" in source and "constexpr bool SOFTCAP_SCORE = false;" in source
    assert "void score_mod_affine(int b, int h" in source


@pytest.mark.parametrize("name", list(softcap_mods(4)))
def test_soft_caps_take_the_tanh_path(name):
    source = _rendered(softcap_mods(4)[name], V.causal)
    assert "constexpr bool SOFTCAP_SCORE = true;" in source and "constexpr bool AFFINE_SCORE = false;" in source
    assert "void score_mod_softcap(int b, int h" in source
    assert "x = fg_tanh(x * terms.step);" in source


@pytest.mark.parametrize("score", [V.relative_bias(torch.randn(4, 63)), None,
                                   flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh((s + 0.1 * (kv - q)) / 30.0))],
                         ids=["relative_bias", "none", "capped_alibi"])
def test_other_score_mods_keep_the_per_score_call(score):
    source = _rendered(score, V.causal)
    assert "constexpr bool AFFINE_SCORE = false;" in source and "constexpr bool SOFTCAP_SCORE = false;" in source
    assert "score_mod_affine" not in source and "score_mod_softcap" not in source


def test_the_coefficients_are_lowered_once_per_head():
    spec = make_spec("fwd", V.alibi(4), V.causal, head_dim=128, dtype="bf16", arch="sm_90a", mask_block=(128, 128), **SM90)
    fn = lower_mods(spec).score_affine_fn
    assert "// score_mod, affine in the indices: score + alibi_slopes[h] * float32(kv_idx - q_idx)" in fn
    body = fn.split("{", 1)[1]
    assert "kv_coef = " in body and "q_coef = " in body and "bias = 0.0f;" in body
    assert body.count("args.alibi_slopes[") == 1  # one read per (b, h), shared by both coefficients
    assert "kv_idx" not in body and "q_idx" not in body and "score" not in body
    bwd = make_spec("bwd", V.alibi(4), V.causal, head_dim=128, dtype="bf16", arch="sm_90a", mask_block=(128, 128), **SM90)
    assert lower_mods(bwd).score_affine_fn == fn  # the backward's terms come from the same coefficients


def test_the_soft_cap_factors_are_lowered_once_per_head():
    spec = make_spec("fwd", V.softcap(30.0), V.causal, head_dim=128, dtype="bf16", arch="sm_90a",
                     mask_block=(128, 128), **SM90)
    fn = lower_mods(spec).score_softcap_fn
    assert "// score_mod, a soft cap: cap * tanh(score / cap)" in fn
    assert "outer = args.cap;" in fn and "inner = fg_div(1.0f, args.cap);" in fn


@pytest.mark.parametrize("score", [V.alibi(4), V.softcap(30.0)], ids=["alibi", "softcap"])
def test_the_option_turns_the_paths_off(score):
    source = _rendered(score, V.causal, fold_score=False)
    assert "constexpr bool AFFINE_SCORE = false;" in source and "constexpr bool SOFTCAP_SCORE = false;" in source


# ---------------------------------------------------------------- on a Hopper GPU


def _check(score, mask_fn, B, H, Lq, Lkv, D, dtype, options, scale=None, gqa_kv_heads=None):
    from test_gpu_forward import assert_matches, fresh_seed, randn, run_flexgen

    seed = fresh_seed()
    Hkv = gqa_kv_heads or H
    q = randn(B, H, Lq, D, dtype=dtype)
    k, v = randn(B, Hkv, Lkv, D, dtype=dtype), randn(B, Hkv, Lkv, D, dtype=dtype)
    bm = None if mask_fn is None else flexgen.create_block_mask(mask_fn, None, None, Lq, Lkv, device="cuda")
    out, lse = run_flexgen(q, k, v, score, bm, scale=scale, gqa=gqa_kv_heads is not None, kernel_options=options)
    return assert_matches(out, lse, q, k, v, score, mask_fn, scale=scale, gqa=gqa_kv_heads is not None, seed=seed,
                          what=f"B={B} H={H} Lq={Lq} Lkv={Lkv} D={D} {dtype} options={options} scale={scale}")


def _causal(b, h, q, kv):
    return q >= kv


@gpu
@hopper
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", list(affine_mods(4)) + list(softcap_mods(4)))
def test_folded_score_mods_match_the_reference(name, D, fold):
    score = {**affine_mods(3, "cuda"), **softcap_mods(3, "cuda")}[name]
    _check(score, _causal, 2, 3, 1000, 1000, D, torch.bfloat16, {**SM90, "fold_score": fold})


@gpu
@hopper
@pytest.mark.parametrize("lq,lkv", [(1, 1), (300, 333), (4097, 2049)])
@pytest.mark.parametrize("mask", ["causal", "none"])
@pytest.mark.parametrize("D", [64, 128])
def test_softcap_lengths_and_masks(lq, lkv, mask, D):
    _check(V.softcap(1.5), _causal if mask == "causal" else None, 1, 2, lq, lkv, D, torch.bfloat16, SM90)


@gpu
@hopper
@pytest.mark.parametrize("lq,lkv", [(1, 1), (300, 333), (4097, 2049), (2049, 4097), (8192, 8192)])
@pytest.mark.parametrize("mask", ["causal", "none"])
def test_alibi_at_large_index_terms(lq, lkv, mask):
    """Steep slopes over long rows: index terms in the thousands, against scores of order one."""
    slopes = torch.tensor([1.0, 0.25], device="cuda")
    score = V.alibi(slopes)
    _check(score, _causal if mask == "causal" else None, 1, 2, lq, lkv, 128, torch.bfloat16, SM90)


@gpu
@hopper
@pytest.mark.parametrize("scale", [0.0, 0.03, 2.0, -0.5])
@pytest.mark.parametrize("score", ["alibi", "softcap"])
def test_explicit_scales(scale, score):
    mod = V.alibi(3) if score == "alibi" else V.softcap(1.5)
    _check(mod, _causal, 2, 3, 700, 900, 64, torch.bfloat16, SM90, scale=scale)


@gpu
@hopper
@pytest.mark.parametrize("score", ["alibi", "softcap"])
def test_fp16_gqa(score):
    mod = V.alibi(4) if score == "alibi" else V.softcap(1.5)
    _check(mod, _causal, 2, 4, 1000, 1000, 128, torch.float16, SM90, gqa_kv_heads=2)


@gpu
@hopper
@pytest.mark.parametrize("score", ["alibi", "softcap"])
def test_rows_that_see_nothing(score):
    """Rows that see nothing keep lse = -inf and O = 0 on the folded paths."""
    def late(b, h, q, kv):
        return (q >= 200) & (q >= kv)

    _check(V.alibi(2) if score == "alibi" else V.softcap(1.5), late, 1, 2, 600, 600, 128, torch.bfloat16, SM90)


@gpu
@hopper
@pytest.mark.parametrize("score", ["alibi", "softcap"])
def test_backward_after_a_folded_forward(score):
    """The backward recomputes P from the forward's lse: gradients agree with those after the generic forward."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 700, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = flexgen.create_block_mask(_causal, None, None, 700, 700, device="cuda")
    mod = V.alibi(2) if score == "alibi" else V.softcap(1.5)
    grads = []
    for fold in (True, False):
        out = flexgen.flex_attention(q, k, v, score_mod=mod, block_mask=bm, kernel_options={**SM90, "fold_score": fold})
        grads.append(torch.autograd.grad(out.float().square().sum(), (q, k, v)))
    for a, b in zip(*grads):
        assert not torch.isnan(a).any()
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm() + 1e-3
