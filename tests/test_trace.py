"""Symbolic tracing of Python functions: what becomes a constant, a parameter, a buffer."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen import variants
from flexgen.dsl import ir
from flexgen.dsl.errors import IndexingError
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


def test_a_combined_mask_takes_a_name_and_stays_immutable():
    """attention-gym names what or_masks returns (`mask.__name__ = ...`): a label, outside the IR and every key."""
    import dataclasses

    m = flexgen.or_masks(variants.sliding_window(3), variants.prefix_lm(2))
    token = m.token
    assert isinstance(m.__name__, str)
    m.__name__ = "global_sliding_window_3"
    assert m.__name__ == "global_sliding_window_3" and m.token == token
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.name = "other"
    with pytest.raises(TypeError, match="__name__ must be set to a string"):
        m.__name__ = 3


# ---------------------------------------------------------------- more torch functions, against torch itself

N_POINTS = 256


def _points(seed: int, score_dtype=torch.float64, specials=()):
    """Random inputs plus the values where functions have edges; b, h, q, kv as int32 like FlexAttention."""
    g = torch.Generator().manual_seed(seed)
    edges = [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.5, 1e-30, -1e-8, 1e30, -1e30, math.inf, -math.inf, math.nan, -1.0, -2.0]
    score = torch.cat([torch.tensor(edges + list(specials), dtype=torch.float64),
                       torch.randn(N_POINTS, generator=g, dtype=torch.float64) * 6])
    n = score.numel()
    ints = {name: torch.randint(0, hi, (n,), generator=g, dtype=torch.int32)
            for name, hi in (("b", 2), ("h", 4), ("q_idx", 200), ("kv_idx", 200))}
    return {"score": score.to(score_dtype), **ints}


def _against_torch(fn, exact: bool | float, seed: int = 0, score_dtype=torch.float64, specials=(), atol: float = 0.0):
    """The traced mod evaluated (float64, or float32 for float32 inputs) against torch running fn per element.
    `atol` admits a sum taken in another order: near cancellation its last bits differ relative to a small result."""
    pts = _points(seed, score_dtype, specials)
    mod = flexgen.score_mod(fn)
    got = mod.evaluate(score_dtype, **pts)
    # torch.vmap calls fn once per element, as FlexAttention does
    want = torch.vmap(fn)(pts["score"], pts["b"], pts["h"], pts["q_idx"], pts["kv_idx"]).to(score_dtype)
    rtol = 0.0 if exact is True else 1e-12 if exact is False else exact
    torch.testing.assert_close(got, want, rtol=rtol, atol=max(atol, 1e-300) if rtol else 0.0, equal_nan=True,
                               msg=lambda m: f"{mod.pretty()}: {m}")
    return mod


EXACT_FUNCTIONS = {
    "sign": lambda s, b, h, q, kv: torch.sign(s) + s.sgn() * 10,
    "floor_ceil_trunc": lambda s, b, h, q, kv: torch.floor(s) + 3 * s.ceil() + 9 * torch.trunc(s) + s.fix(),
    "round_half_even": lambda s, b, h, q, kv: torch.round(s) + s.round() * 0.5,
    "round_decimals": lambda s, b, h, q, kv: torch.round(s * 7.3, decimals=2) + s.round(decimals=-1),
    "fmod_float": lambda s, b, h, q, kv: torch.fmod(s, 1.5) + s.fmod(-2.0) * 3,
    "fmod_int": lambda s, b, h, q, kv: s + torch.fmod(q - kv, 7) + (kv - q).fmod(-3) * 100,
    "isnan": lambda s, b, h, q, kv: torch.where(torch.isnan(s), -1.0, s) + s.isnan().float(),
    "shift_left": lambda s, b, h, q, kv: s + ((q - kv) << 3) + ((q - kv) << 31) + ((q - kv) << 32) + (q << 0),
    "shift_right": lambda s, b, h, q, kv: s + ((q - kv) >> 2) + ((kv - q) >> 31) + ((q - kv) >> 40),
    "shift_int64": lambda s, b, h, q, kv: s + (((q - kv).long() << 40) >> 38) + ((q - kv).long() >> 63),
    "shift_functions": lambda s, b, h, q, kv: s + torch.bitwise_left_shift(q, 2) - torch.bitwise_right_shift(kv - q, 1),
}


@pytest.mark.parametrize("name", sorted(EXACT_FUNCTIONS))
def test_exact_functions_match_torch(name):
    _against_torch(EXACT_FUNCTIONS[name], exact=True, seed=len(name))


CLOSE_FUNCTIONS = {
    "log1p": lambda s, b, h, q, kv: torch.log1p(s) + s.log1p() + torch.special.log1p(s * 0.5),
    "atan": lambda s, b, h, q, kv: torch.atan(s) + s.arctan() * 2,
    "gelu": lambda s, b, h, q, kv: F.gelu(s),
    "gelu_tanh": lambda s, b, h, q, kv: F.gelu(s, approximate="tanh"),
    "silu": lambda s, b, h, q, kv: F.silu(s),
    "softplus": lambda s, b, h, q, kv: F.softplus(s),
    "softplus_beta_threshold": lambda s, b, h, q, kv: F.softplus(s, beta=2, threshold=5) + F.softplus(s, 0.5, 30.0),
}


@pytest.mark.parametrize("name", sorted(CLOSE_FUNCTIONS))
def test_transcendental_functions_match_torch(name):
    # torch's vectorised float64 libm differs between CPUs (AVX2, AVX-512) by a few ulp, more where a
    # function cancels (tanh-GELU far below zero): 1e-10 relative, still far inside float32's resolution
    _against_torch(CLOSE_FUNCTIONS[name], exact=1e-10, seed=len(name))


def test_new_functions_trace_to_their_ops():
    ops = lambda fn: {n.op for n in ir.postorder(flexgen.score_mod(fn).expr)}  # noqa: E731
    assert ops(lambda s, b, h, q, kv: torch.round(s)) >= {"round"}
    assert "fmod" in ops(lambda s, b, h, q, kv: torch.fmod(s, 2.0)) and "mod" not in ops(lambda s, b, h, q, kv: torch.fmod(s, 2.0))
    assert ops(lambda s, b, h, q, kv: F.softplus(s)) == {"input", "const", "exp", "log1p", "gt", "where"}  # beta 1: no scaling
    assert {"erf"} <= ops(lambda s, b, h, q, kv: F.gelu(s)) and "tanh" not in ops(lambda s, b, h, q, kv: F.gelu(s))
    # rounding an integer is the integer itself (torch returns it unchanged); isnan of an integer is False
    assert flexgen.mask_mod(lambda b, h, q, kv: torch.floor(q) >= kv).expr == ir.binary("ge", Q, KV)
    assert flexgen.mask_mod(lambda b, h, q, kv: torch.isnan(q) | (q >= kv)).expr == ir.binary("or", ir.const(False), ir.binary("ge", Q, KV))


# ---------------------------------------------------------------- precision casts round as torch does

# float16 / bfloat16 ties (to even), overflow to inf, subnormals
FP16_EDGES = (1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 ** -25, 3 * 2 ** -25, 65504.0, 65519.0, 65520.0, 65535.0, 1e5, -65520.0, 6e-8, 2 ** -14 - 2 ** -26)
BF16_EDGES = (1 + 2 ** -8, 1 + 3 * 2 ** -8, 3.3895313892515355e38, 3.4028234663852886e38, -3.4028234663852886e38, 1e-40)

CASTS = {
    "half": lambda s, b, h, q, kv: (s * 3.1).half(),
    "to_float16": lambda s, b, h, q, kv: s.to(torch.float16).float() * 3.1 + s,
    "to_dtype_keyword": lambda s, b, h, q, kv: s.to(dtype=torch.float16).to(torch.float32) - s.type(torch.bfloat16),
    "bfloat16": lambda s, b, h, q, kv: s.bfloat16().float() + s,
    "to_bfloat16": lambda s, b, h, q, kv: (s * 1.7).to(torch.bfloat16),
    "where_of_halves": lambda s, b, h, q, kv: torch.where(q >= kv, s.half(), s.bfloat16()),
    "full_like_half": lambda s, b, h, q, kv: torch.full_like(s, 0.1, dtype=torch.float16) + s,
    "int_to_half": lambda s, b, h, q, kv: s + (q * 37 - kv * 1001).half(),
    "float_is_a_noop": lambda s, b, h, q, kv: s.float() * 2,
}


@pytest.mark.parametrize("score_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASTS))
def test_precision_casts_round_like_torch(name, score_dtype):
    if name == "float_is_a_noop" and score_dtype is torch.float64:
        pytest.skip("flexgen's float is float32: .float() of a float64 ground truth keeps float64")
    # float64: torch's .float() then computes in float32, flexgen's ground truth in float64 (well below
    # the 2^-11 a missing rounding to float16 would leave)
    exact = True if score_dtype is torch.float32 else 1e-6
    mod = _against_torch(CASTS[name], exact=exact, seed=len(name), score_dtype=score_dtype, specials=FP16_EDGES + BF16_EDGES)
    if name not in ("float_is_a_noop", "full_like_half"):  # full_like: a constant, rounded at trace time
        assert {n.op for n in ir.postorder(mod.expr)} & set(ir.PRECISION_OPS)


# ---------------------------------------------------------------- rows of captured tensors (small arrays)


def test_shape_and_size_of_a_captured_row_are_constants():
    table = torch.randn(4, 3, 5)
    m = flexgen.score_mod(lambda s, b, h, q, kv: s + table[h].shape[1] + table[h].size(0) + table[h].size()[1]
                          + table[h, 2].size(-1) + table[h].dim() + table[h].ndim + table[h].numel() + len(table[h])
                          + table.shape[0] + table.size(2))
    assert not m.buffers and {n.op for n in ir.postorder(m.expr)} == {"input", "const", "add"}
    assert m.evaluate(score=torch.tensor(0.5), b=0, h=0, q_idx=0, kv_idx=0).item() == 0.5 + 5 + 3 + 5 + 5 + 2 + 2 + 15 + 3 + 4 + 5


ROW_REDUCTIONS = {
    "sum_with_captured_weights": lambda s, b, h, q, kv: s + (ROWS[h] * WEIGHTS).sum(-1),
    "torch_sum_dim_keyword": lambda s, b, h, q, kv: s + torch.sum(WEIGHTS * ROWS[h], dim=-1),
    "score_dependent_weights": lambda s, b, h, q, kv: (ROWS[h] * torch.tanh(s)).sum() + s,
    "mean_amax_amin": lambda s, b, h, q, kv: s + ROWS[h].mean() + ROWS[h].amax(-1) * 2 - ROWS[h].amin() + ROWS[h].max(),
    "dot_products": lambda s, b, h, q, kv: s + ROWS[h] @ WEIGHTS + torch.dot(WEIGHTS, ROWS[b]) + WEIGHTS @ ROWS[h],
    "two_rows_broadcast": lambda s, b, h, q, kv: s + (GRID[h] * ROWS[b]).sum(-1).sum(),
    "keepdim_and_index": lambda s, b, h, q, kv: s + (GRID[h] - s).amax(0, keepdim=True)[0, 2] + (GRID[h] * 2)[1].sum(),
    "any_all_counts": lambda s, b, h, q, kv: s + (ROWS[h] > s).any() * 1.0 - (ROWS[h] < 1).all().float() + (ROWS[h] > 0).sum(),
    "python_sum_over_row": lambda s, b, h, q, kv: s + sum(x * x for x in ROWS[h]),
    "positional_row": lambda s, b, h, q, kv: s + (POSITIONAL[q % 8] * WEIGHTS).sum(-1) * (kv % 3),
}
ROWS = torch.randn(4, 6, dtype=torch.float64)
WEIGHTS = torch.randn(6, dtype=torch.float64)
GRID = torch.randn(4, 3, 6, dtype=torch.float64)
POSITIONAL = torch.randn(8, 6, dtype=torch.float64)


@pytest.mark.parametrize("name", sorted(ROW_REDUCTIONS))
def test_reductions_over_a_captured_row_match_torch(name):
    # The IR sums a row as a balanced tree, torch left to right: a few ulps of the O(1) terms apart.
    mod = _against_torch(ROW_REDUCTIONS[name], exact=False, seed=len(name), atol=1e-13)
    assert all(n.op not in ("load",) or len(n.args) == n.attr.ndim for n in ir.postorder(mod.expr))


TOPK = torch.randint(0, 25, (2, 4, 5, 3), dtype=torch.int64)
ROW_SHAPES = {
    # attention-gym's VSA mask: is the key's tile among the query tile's top-k? (a score, so it runs under vmap too)
    "membership_by_unsqueeze": lambda s, b, h, q, kv: torch.where(
        (TOPK[b, h, q // 40] == (kv // 8).unsqueeze(-1)).any(dim=-1), s, s - 100.0),
    "scalar_unsqueeze_squeeze": lambda s, b, h, q, kv: s + (s.unsqueeze(0).unsqueeze(-1) * WEIGHTS).sum()
    + s.unsqueeze(0).squeeze() + torch.unsqueeze(q, 0).squeeze(0),
    "reshape_view_flatten": lambda s, b, h, q, kv: s + (GRID[h].reshape(6, 3)[2] * GRID[b].view(-1)[:3]).sum()
    + GRID[h].flatten()[7] + torch.reshape(ROWS[h], (2, 3))[1, 2],
    "permute_transpose_t": lambda s, b, h, q, kv: s + GRID[h].permute(1, 0)[5, 2] + GRID[h].transpose(0, 1)[4, 1]
    + GRID[h].t()[3, 0] * 2 + GRID[h].movedim(0, 1)[2, 1],
    "expand_broadcast_to": lambda s, b, h, q, kv: s + (ROWS[h].expand(3, 6) * GRID[b]).sum()
    + s.expand(4).sum() + torch.broadcast_to(WEIGHTS, (2, 6))[1, 3],
}


@pytest.mark.parametrize("name", sorted(ROW_SHAPES))
def test_shape_methods_on_traced_values_match_torch(name):
    """unsqueeze, squeeze, reshape, view, flatten, permute, transpose, t, movedim, expand and broadcast_to on traced
    scores, indices and captured rows do what torch does per element."""
    _against_torch(ROW_SHAPES[name], exact=False, seed=len(name), atol=1e-13)


def test_shape_methods_say_what_is_wrong():
    with pytest.raises(IndexingError, match=r"reshape\(\) of an array of shape \(6,\)"):
        flexgen.score_mod(lambda s, b, h, q, kv: s + ROWS[h].reshape(4, 2).sum())


def test_row_reduction_in_the_text_form_is_the_same_ir():
    py = flexgen.score_mod(lambda s, b, h, q, kv: s + (rows[h] * weights).sum(-1) + rows.shape[1] + rows[h] @ weights)
    text = flexgen.score_mod("score + (rows[h] * weights).sum(-1) + rows.shape[1] + rows[h] @ weights",
                             rows=ROWS, weights=WEIGHTS)
    assert text.expr == py.expr and text.buffer_specs == py.buffer_specs


rows, weights = ROWS, WEIGHTS  # the names the text form binds, for the Python form above
