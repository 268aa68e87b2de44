"""attention-gym style functions under torch.compile(fullgraph=True): each score_mod, and each mask_mod's block mask
(built outside), through the compiled flexgen ops equals the eager call, in float64 on the CPU, where both run
flexgen's unfused path."""
from __future__ import annotations

import warnings

import pytest
import torch

import flexgen
from test_gym_functions import MASKS, NEWER_MASKS, NEWER_SCORES, SCORES

B, H, D = 2, 4, 8
ALL_MASKS = {**MASKS, **NEWER_MASKS}
ALL_SCORES = {**SCORES, **NEWER_SCORES}


def _inputs(q_len: int, kv_len: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, q_len, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, H, kv_len, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _compiled_equals_eager(score_mod, block_mask, q_len: int, kv_len: int):
    torch._dynamo.reset()
    attend = torch.compile(lambda q, k, v: flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask),
                           backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for seed in range(2):  # (the second call runs the graph compiled for the first)
            q, k, v = _inputs(q_len, kv_len, seed)
            got = attend(q, k, v)
            want = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
            assert not got.isnan().any()
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(ALL_SCORES))
def test_gym_score_compiled(name):
    fn, shape = ALL_SCORES[name]
    _compiled_equals_eager(fn, None, shape.get("q_len", 33), shape.get("kv_len", 41))


@pytest.mark.parametrize("name", sorted(ALL_MASKS))
def test_gym_mask_compiled(name):
    fn, shape = ALL_MASKS[name]
    q_len, kv_len = shape.get("q_len", 33), shape.get("kv_len", 41)
    mask = flexgen.create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=16)
    _compiled_equals_eager(None, mask, q_len, kv_len)
