"""Symbolic tracing of Python functions: what becomes a constant, a parameter, a buffer."""
from __future__ import annotations

import functools

import torch

import flexgen
from flexgen import variants
from flexgen.dsl import ir
from flexgen.dsl.ir import DType
from flexgen.dsl.mod import Mod


S, B_, H_, Q, KV = (ir.input_(n) for n in ("score", "b", "h", "q_idx", "kv_idx"))


def test_closure_floats_are_constants():
    cap = 30.0
    mod = flexgen.score_mod(lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap))
    assert mod.expr == ir.binary("mul", ir.const(30.0), ir.unary("tanh", ir.binary("div", S, ir.const(30.0))))
    assert not mod.params and not mod.buffers


def test_argument_names_do_not_matter():
    a = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    c = flexgen.mask_mod(lambda batch, head, q, kv: q >= kv)
    assert a.structural_hash == c.structural_hash


def test_keyword_only_binding_becomes_param():
    def softcap(score, b, h, q_idx, kv_idx, *, cap):
        return cap * torch.tanh(score / cap)

    mod = flexgen.score_mod(softcap, cap=30.0)
    assert mod.params == {"cap": 30.0}
    assert mod.param_specs == {"cap": DType.FLOAT32}
    other = flexgen.score_mod(softcap, cap=50.0)
    assert other.structural_hash == mod.structural_hash
    baked = flexgen.score_mod(softcap, cap=30.0, specialize=True)
    assert not baked.params
    assert baked.structural_hash == flexgen.score_mod(lambda s, b, h, q, k: 30.0 * torch.tanh(s / 30.0)).structural_hash


def test_int_binding_is_int32_param():
    def window(b, h, q_idx, kv_idx, *, size):
        return q_idx - kv_idx < size

    mod = flexgen.mask_mod(window, size=128)
    assert mod.param_specs == {"size": DType.INT32}
    assert mod.expr == ir.binary("lt", ir.binary("sub", Q, KV), ir.param("size", DType.INT32))


def test_closure_tensor_named_after_variable_and_shared():
    doc_id = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    mod = flexgen.mask_mod(lambda b, h, q, kv: doc_id[q] == doc_id[kv])
    assert list(mod.buffers) == ["doc_id"]
    assert mod.buffers["doc_id"] is doc_id
    assert mod.buffer_specs == [ir.BufferSpec("doc_id", "int32", 1)]


def test_anonymous_tensors_named_in_first_use_order():
    tables = [torch.rand(4), torch.rand(4)]
    mod = flexgen.score_mod(lambda s, b, h, q, kv: s + tables[1][h] * tables[0][h] + tables[1][h])
    assert [spec.name for spec in mod.buffer_specs] == ["buf0", "buf1"]
    assert mod.buffers["buf0"] is tables[1]
    assert mod.buffers["buf1"] is tables[0]


def test_global_tensor_named():
    mod = flexgen.score_mod(_score_with_global)
    assert list(mod.buffers) == ["GLOBAL_BIAS"]


GLOBAL_BIAS = torch.rand(8)


def _score_with_global(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_BIAS[h]


def test_helper_function_and_nested_index():
    offsets = torch.tensor([0, 3, 7])
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])

    def logical(idx):
        return idx - offsets[doc[idx]]

    mod = flexgen.mask_mod(lambda b, h, q, kv: logical(q) >= logical(kv))
    assert sorted(mod.buffers) == ["doc", "offsets"]
    loads = [n for n in ir.postorder(mod.expr) if n.op == "load"]
    assert {n.attr.name for n in loads} == {"doc", "offsets"}
    # int64 buffers promote the arithmetic to int64
    assert any(n.dtype is DType.INT64 for n in ir.postorder(mod.expr) if n.op == "sub")


def test_multi_dim_and_chained_indexing_agree():
    bias = torch.randn(4, 9)
    a = flexgen.score_mod(lambda s, b, h, q, kv: s + bias[h, q - kv + 4])
    c = flexgen.score_mod(lambda s, b, h, q, kv: s + bias[h][q - kv + 4])
    assert a.expr == c.expr


def test_constant_index_and_zero_dim_tensor():
    table = torch.rand(3, 5)
    scale = torch.tensor(0.5)
    mod = flexgen.score_mod(lambda s, b, h, q, kv: s * scale + table[1, kv])
    specs = {spec.name: spec for spec in mod.buffer_specs}
    assert specs["scale"].ndim == 0
    assert specs["table"].ndim == 2


def test_weak_scalar_typing_matches_torch():
    m = flexgen.score_mod(lambda s, b, h, q, kv: s * 2)
    assert m.expr == ir.binary("mul", S, ir.const(2.0))
    m = flexgen.mask_mod(lambda b, h, q, kv: q * 2 > kv)
    assert m.expr == ir.binary("gt", ir.binary("mul", Q, ir.const(2)), KV)


def test_reflected_operators():
    m = flexgen.score_mod(lambda s, b, h, q, kv: 2 * s - 1 / (1 + s) + 3 % (kv + 1) + 2 ** s - (10 // (q + 1)))
    kinds = {n.op for n in ir.postorder(m.expr)}
    assert {"mul", "sub", "div", "add", "mod", "pow", "floordiv"} <= kinds


def test_torch_functions_and_methods_agree():
    f1 = lambda s, b, h, q, kv: torch.clamp(torch.abs(s), min=0.5, max=2.0).exp()
    f2 = lambda s, b, h, q, kv: s.abs().clamp(0.5, 2.0).exp()
    f3 = lambda s, b, h, q, kv: torch.exp(torch.minimum(torch.maximum(abs(s), torch.full_like(s, 0.5)), 2.0 + 0 * s))
    m1, m2 = flexgen.score_mod(f1), flexgen.score_mod(f2)
    assert m1.expr == m2.expr
    m3 = flexgen.score_mod(f3)
    score = torch.randn(2, 3, 4, 5)
    z = torch.zeros(1)
    torch.testing.assert_close(m1(score, z, z, z, z), m3(score, z, z, z, z).float())


def test_clamp_one_sided():
    m = flexgen.score_mod(lambda s, b, h, q, kv: s.clamp(min=0) + s.clamp_max(1.0) + torch.clamp(s, max=3))
    assert sum(n.op in ("min", "max") for n in ir.postorder(m.expr)) == 3


def test_casts():
    m = flexgen.score_mod(lambda s, b, h, q, kv: s + (q - kv).float() + q.to(torch.float32) + kv.long().to(dtype=torch.float32))
    casts = [n.attr for n in ir.postorder(m.expr) if n.op == "cast"]
    assert DType.INT64 in casts and DType.FLOAT32 in casts
    m = flexgen.mask_mod(lambda b, h, q, kv: (q - kv).bool())
    assert m.expr.op == "cast" and m.expr.dtype is DType.BOOL


def test_logical_functions_and_operators():
    a = flexgen.mask_mod(lambda b, h, q, kv: torch.logical_and(q >= kv, torch.logical_not(kv > 3)))
    c = flexgen.mask_mod(lambda b, h, q, kv: (q >= kv) & ~(kv > 3))
    assert a.expr == c.expr
    x = flexgen.mask_mod(lambda b, h, q, kv: (q > 1) ^ (kv > 1))
    assert x.expr.op == "xor"
    # torch.logical_* treat nonzero integers as True
    n = flexgen.mask_mod(lambda b, h, q, kv: torch.logical_or(q % 2, kv % 3))
    out = n.evaluate(b=0, h=0, q_idx=torch.arange(6).view(6, 1), kv_idx=torch.arange(6).view(1, 6))
    ref = torch.logical_or(torch.arange(6).view(6, 1) % 2, torch.arange(6).view(1, 6) % 3)
    assert torch.equal(out, ref)


def test_where_with_scalars_and_floor_divide():
    m = flexgen.score_mod(lambda s, b, h, q, kv: torch.where(q >= kv, s, -float("inf")))
    assert m.expr.op == "where" and m.expr.args[2] == ir.const(float("-inf"))
    m = flexgen.mask_mod(lambda b, h, q, kv: torch.floor_divide(q, 4) == torch.div(kv, 4, rounding_mode="floor"))
    assert m.expr.args[0] == ir.binary("floordiv", Q, ir.const(4))
    assert [n.op for n in ir.postorder(m.expr)].count("floordiv") == 2


def test_real_tensor_on_left_dispatches():
    slopes = torch.rand(4)
    a = flexgen.score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    c = flexgen.score_mod(lambda s, b, h, q, kv: (kv - q) * slopes[h] + s)
    assert a.buffer_specs == c.buffer_specs


def test_mod_inlined_when_called_during_trace():
    inner = variants.sliding_window(16)

    def outer(b, h, q_idx, kv_idx):
        return inner(b, h, q_idx, kv_idx) & (kv_idx >= 2)

    mod = flexgen.mask_mod(outer)
    assert mod.params == {"window": 16}
    assert mod.expr == ir.binary("and", inner.expr, ir.binary("ge", KV, ir.const(2)))


def test_mod_inlined_with_substituted_inputs_repromotes():
    offsets = torch.tensor([0, 4, 8])  # int64: substituted q/kv become int64

    def shifted(b, h, q, kv):
        return variants.causal(b, h, q - offsets[1], kv - offsets[1])

    mod = flexgen.mask_mod(shifted)
    ge = mod.expr
    assert ge.op == "ge" and ge.args[0].dtype is DType.INT64


def test_partial_and_bound_method_and_callable_object():
    def windowed(size, b, h, q, kv):
        return q - kv < size

    m = flexgen.mask_mod(functools.partial(windowed, 8))
    assert m.name == "windowed"

    class Bias(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("head_bias", torch.rand(4))

        def score(self, score, b, h, q, kv):
            return score + self.head_bias[h]

        def __call__(self, score, b, h, q, kv):
            return self.score(score, b, h, q, kv)

    module = Bias()
    assert list(flexgen.score_mod(module.score).buffers) == ["head_bias"]
    assert list(flexgen.score_mod(module).buffers) == ["head_bias"]


def test_noop_style_constant_returns():
    m = flexgen.mask_mod(lambda b, h, q, kv: True)
    assert m.expr == ir.const(True)
    m = flexgen.mask_mod(lambda b, h, q, kv: b.new_ones(size=(), dtype=torch.bool))
    assert m.expr == ir.const(True)
    s = flexgen.score_mod(lambda score, b, h, q, kv: q - kv)
    assert s.expr.dtype is DType.FLOAT32  # integer results of a score_mod are promoted


def test_mod_is_idempotent_and_renamable():
    m = variants.causal
    assert flexgen.mask_mod(m) is m
    renamed = flexgen.mask_mod(m, name="my_causal")
    assert renamed.name == "my_causal" and renamed.structural_hash == m.structural_hash


def test_trace_infers_kind():
    assert flexgen.trace(lambda b, h, q, kv: q >= kv).kind == "mask"
    assert flexgen.trace(lambda s, b, h, q, kv: s * 2).kind == "score"
    assert flexgen.trace("q_idx >= kv_idx").kind == "mask"
    assert flexgen.trace("score * 2").kind == "score"
    assert flexgen.trace(variants.softcap(3.0)).kind == "score"


def test_and_or_masks():
    a = flexgen.and_masks(variants.causal, lambda b, h, q, kv: kv % 2 == 0)
    assert a.expr.op == "and"
    o = flexgen.or_masks(variants.causal, "kv_idx < 4")
    assert o.expr.op == "or"
    assert flexgen.and_masks().expr == ir.const(True)
    assert flexgen.or_masks().expr == ir.const(False)
    assert isinstance(flexgen.and_masks(a, o), Mod)


def test_combined_masks_rename_clashing_params_and_buffers():
    ids_a = torch.tensor([0, 0, 1, 1])
    ids_b = torch.tensor([0, 1, 1, 1])
    m = flexgen.and_masks(variants.sliding_window(4), variants.sliding_window(8),
                          variants.document(ids_a), variants.document(ids_b))
    assert m.params == {"window": 4, "window_1": 8}
    assert m.buffers["doc_ids"] is ids_a and m.buffers["doc_ids_1"] is ids_b
    # the same tensor object stays one buffer; the same Mod stays one param set
    sw = variants.sliding_window(4)
    same = flexgen.and_masks(sw, sw, variants.document(ids_a), variants.document(ids_a))
    assert same.params == {"window": 4}
    assert list(same.buffers) == ["doc_ids"]
    # hashes ignore parameter values
    other = flexgen.and_masks(variants.sliding_window(100), variants.sliding_window(200),
                              variants.document(ids_b), variants.document(ids_a))
    assert other.structural_hash == m.structural_hash


def test_combined_mask_evaluates():
    m = flexgen.and_masks(variants.sliding_window(3), variants.prefix_lm(2))
    q = torch.arange(8).view(8, 1)
    kv = torch.arange(8).view(1, 8)
    ref = ((q >= kv) & (q - kv < 3)) & ((q >= kv) | (kv < 2))
    assert torch.equal(m(0, 0, q, kv), ref)
