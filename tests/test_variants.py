"""Built-in variants: their meaning, what is a parameter or a buffer, and argument checks."""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen import variants
from flexgen.dsl.ir import BufferSpec, DType
from flexgen.dsl.mod import Mod

N = 12
Q = torch.arange(N).view(N, 1)
KV = torch.arange(N).view(1, N)


def mask_of(mod: Mod, b=0, h=0) -> torch.Tensor:
    return mod.evaluate(b=b, h=h, q_idx=Q, kv_idx=KV).expand(N, N)


def test_causal():
    assert isinstance(variants.causal, Mod) and variants.causal.kind == "mask"
    assert torch.equal(mask_of(variants.causal), torch.ones(N, N, dtype=torch.bool).tril())


def test_sliding_window_is_causal_band_with_runtime_window():
    mod = variants.sliding_window(3)
    assert mod.params == {"window": 3} and mod.param_specs == {"window": DType.INT32}
    expected = torch.ones(N, N, dtype=torch.bool).tril() & ~torch.ones(N, N, dtype=torch.bool).tril(-3)
    assert torch.equal(mask_of(mod), expected)
    assert mask_of(mod)[5].nonzero().flatten().tolist() == [3, 4, 5]


def test_prefix_lm():
    mod = variants.prefix_lm(4)
    m = mask_of(mod)
    assert mod.params == {"prefix_length": 4}
    assert m[0, :4].all() and not m[0, 4:].any()  # the prefix is bidirectional
    assert torch.equal(m[6], torch.arange(N) <= 6)  # beyond it, causal


def test_document_causal_and_not():
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3])
    same = ids.view(N, 1) == ids.view(1, N)
    causal_doc = variants.document(ids)
    assert causal_doc.buffer_specs == [BufferSpec("doc_ids", "int64", 1)]
    assert causal_doc.buffers["doc_ids"] is ids
    assert torch.equal(mask_of(causal_doc), same & (Q >= KV))
    assert torch.equal(mask_of(variants.document(ids, causal=False)), same)


def test_alibi_slopes_from_head_count():
    mod = variants.alibi(8)
    slopes = mod.buffers["alibi_slopes"]
    assert slopes.dtype == torch.float32 and slopes.shape == (8,)
    torch.testing.assert_close(slopes, torch.tensor([2.0 ** (-(h + 1)) for h in range(8)]))
    score = torch.randn(N, N)
    out = mod.evaluate(score=score, b=0, h=2, q_idx=Q, kv_idx=KV)
    torch.testing.assert_close(out.float(), score + slopes[2] * (KV - Q))


def test_alibi_with_given_slopes():
    slopes = torch.tensor([0.5, 0.25, 0.125])
    mod = variants.alibi(slopes)
    assert mod.buffers["alibi_slopes"] is slopes
    with pytest.raises(ValueError):
        variants.alibi(torch.tensor([[1.0]]))


def test_softcap_param():
    mod = variants.softcap(20)
    assert mod.params == {"cap": 20.0} and mod.param_specs == {"cap": DType.FLOAT32}
    score = torch.tensor([-100.0, 0.0, 5.0, 1000.0])
    out = mod.evaluate(score=score, b=0, h=0, q_idx=0, kv_idx=0)
    torch.testing.assert_close(out.float(), 20.0 * torch.tanh(score / 20.0))
    for bad in (0, -1.0, "3", True):
        with pytest.raises(ValueError):
            variants.softcap(bad)


def test_relative_bias_centered_table():
    table = torch.randn(2, 2 * N - 1)
    mod = variants.relative_bias(table)
    assert mod.params == {"rel_bias_center": N - 1}
    score = torch.zeros(N, N)
    out = mod.evaluate(score=score, b=0, h=1, q_idx=Q, kv_idx=KV)
    torch.testing.assert_close(out.float(), table[1][(Q - KV + N - 1)])
    assert out[4, 4] == table[1, N - 1]  # distance 0 reads the center column
    with pytest.raises(ValueError):
        variants.relative_bias(torch.randn(5))


def test_length_arguments_are_checked():
    for bad in (1.5, "8", None, True):
        with pytest.raises(TypeError):
            variants.sliding_window(bad)
    with pytest.raises(ValueError):
        variants.prefix_lm(-1)
    with pytest.raises(ValueError):
        variants.document(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError):
        variants.document(torch.zeros(4))


def test_variants_compose():
    ids = torch.tensor([0] * 6 + [1] * 6)
    mod = flexgen.and_masks(variants.document(ids), variants.sliding_window(2))
    expected = (ids.view(N, 1) == ids.view(1, N)) & (Q >= KV) & (Q - KV < 2)
    assert torch.equal(mask_of(mod), expected)
    either = flexgen.or_masks(variants.sliding_window(1), variants.prefix_lm(2))
    assert torch.equal(mask_of(either), (Q == KV) | (Q >= KV) | (KV < 2))


def test_variants_are_plain_callables():
    # Where FlexAttention expects a function, a Mod works: called on index tensors.
    assert torch.equal(variants.sliding_window(2)(0, 0, Q, KV), (Q >= KV) & (Q - KV < 2))
    score = torch.randn(N, N)
    torch.testing.assert_close(variants.softcap(5.0)(score, 0, 0, Q, KV), 5.0 * torch.tanh(score / 5.0))
