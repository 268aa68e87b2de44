"""affine_score: recognising score + A*kv_idx + B*q_idx + C (ALiBi and relatives), refusing the rest."""
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import flexgen
from flexgen.dsl import ir
from flexgen.dsl.affine import AffineScore, affine_score
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import BufferSpec, DType
from flexgen.dsl.variants import alibi

from ir_strategies import float_exprs, make_buffers, make_params

HEADS = 8


def _inputs(gen: torch.Generator, n: int = 512) -> dict:
    return {
        "score": torch.randn(n, generator=gen, dtype=torch.float64) * 5,
        "b": torch.randint(0, 2, (n,), generator=gen, dtype=torch.int32),
        "h": torch.randint(0, HEADS, (n,), generator=gen, dtype=torch.int32),
        "q_idx": torch.randint(0, 5000, (n,), generator=gen, dtype=torch.int32),
        "kv_idx": torch.randint(0, 5000, (n,), generator=gen, dtype=torch.int32),
    }


def _recomposed(a: AffineScore) -> ir.Node:
    """score + kv_coef*kv_idx + q_coef*q_idx + bias, as the kernel computes it."""
    kv = ir.binary("mul", a.kv_coef, ir.cast(ir.input_("kv_idx"), DType.FLOAT32))
    q = ir.binary("mul", a.q_coef, ir.cast(ir.input_("q_idx"), DType.FLOAT32))
    return ir.binary("add", ir.binary("add", ir.binary("add", ir.input_("score"), kv), q), a.bias)


def _assert_same(expr, a: AffineScore, inputs, buffers, params):
    """Equal in float64 up to rounding (relative to the largest term of the sum)."""
    run = lambda e: evaluate(e, inputs, buffers, params, torch.float64)  # noqa: E731
    want, got = torch.broadcast_tensors(run(expr), run(_recomposed(a)))
    terms = (inputs["score"], run(a.kv_coef) * inputs["kv_idx"], run(a.q_coef) * inputs["q_idx"], run(a.bias))
    scale = max(float(torch.as_tensor(t).abs().max()) for t in terms) + 1.0
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * scale)


def _slopes(gen):
    return torch.rand(HEADS, generator=gen) + 0.01


def _recognised():
    gen = torch.Generator().manual_seed(0)
    slopes, bias = _slopes(gen), torch.randn(HEADS, generator=gen)
    return {
        "alibi": flexgen.score_mod("score + slopes[h] * (kv_idx - q_idx)", slopes=slopes),
        "alibi_exp2": flexgen.score_mod("score + exp2(-8.0 * (h + 1) / heads) * (kv_idx - q_idx)", heads=HEADS),
        "alibi_minus": flexgen.score_mod("score - slope * (q_idx - kv_idx)", slope=0.37),
        "alibi_swapped": flexgen.score_mod("(kv_idx - q_idx) * slopes[h] + score", slopes=slopes),
        "alibi_variant": alibi(HEADS),
        "float_casts": flexgen.score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv.float() - q.float())),
        "long_casts": flexgen.score_mod(lambda s, b, h, q, kv: s + (kv.long() - q.long()).float() * slopes[h]),
        "divided": flexgen.score_mod("score + (kv_idx - q_idx) / temp", temp=3.0),
        "const_bias": flexgen.score_mod("score + 2.5"),
        "head_bias": flexgen.score_mod("score + bias[h]", bias=bias),
        "times_one": flexgen.score_mod("score * 1.0 + 3 * kv_idx - (q_idx + 7) * 2"),
        "mixed": flexgen.score_mod(
            lambda s, b, h, q, kv: -(slopes[h] * (2 * q - kv + 100).float() - s) / 1.0 + bias[h] * 0.5
        ),
    }


@pytest.mark.parametrize("name", list(_recognised()))
def test_recognised_matches(name):
    mod = _recognised()[name]
    a = affine_score(mod.expr)
    assert a is not None, mod.pretty()
    for part in (a.kv_coef, a.q_coef, a.bias):
        assert part.dtype is DType.FLOAT32
        assert not ir.inputs_of(part) & {"score", "q_idx", "kv_idx"}
    gen = torch.Generator().manual_seed(1)
    fresh = {k: torch.rand(v.shape, generator=gen) + 0.01 for k, v in mod.buffers.items()}
    for buffers in (mod.buffers, fresh):
        _assert_same(mod.expr, a, _inputs(gen), buffers, mod.params)


def test_alibi_coefficients():
    a = affine_score(_recognised()["alibi"].expr)
    slope = ir.load(BufferSpec("slopes", "float32", 1), (ir.input_("h"),))
    assert (a.kv_coef, a.q_coef, a.bias) == (slope, ir.unary("neg", slope), ir.const(0.0))


def _refused():
    gen = torch.Generator().manual_seed(2)
    slopes, rel = _slopes(gen), torch.randn(HEADS, 64, generator=gen)
    return {
        "softcap": flexgen.score_mod("cap * tanh(score / cap)", cap=30.0),
        "score_times_2": flexgen.score_mod("score * 2 + kv_idx"),
        "abs": flexgen.score_mod("score + abs(q_idx - kv_idx)"),
        "rel_bias": flexgen.score_mod("score + rel[h, q_idx - kv_idx + 32]", rel=rel),
        "where": flexgen.score_mod(lambda s, b, h, q, kv: s + torch.where(q > kv, 1.0, 0.0)),
        "huge_multiplier": flexgen.score_mod("score + (kv_idx * 1000000)"),
        "int_atom_h": flexgen.score_mod("score + (q_idx + h) * slope", slope=0.5),
        "no_score": flexgen.score_mod("kv_idx - q_idx"),
        "no_score_float": flexgen.score_mod("(kv_idx - q_idx) * 0.5"),
        "scaled_score": flexgen.score_mod("score * slopes[h]", slopes=slopes),
        "product": flexgen.score_mod("score + (kv_idx * q_idx) * 0.001"),
        "int_param": flexgen.score_mod("score + (kv_idx - q_idx) * w", w=3),
        "narrowing": flexgen.score_mod(lambda s, b, h, q, kv: s + (kv.long() - q).int().float()),
        "floordiv": flexgen.score_mod("score + (kv_idx // 2)"),
    }


@pytest.mark.parametrize("name", list(_refused()))
def test_refused(name):
    assert affine_score(_refused()[name].expr) is None


# ---------------------------------------------------------------- soundness on random expressions

_Q, _KV, _S = ir.input_("q_idx"), ir.input_("kv_idx"), ir.input_("score")
_FREE = (ir.const(0.5), ir.param("alpha", DType.FLOAT32), ir.load(BufferSpec("slopes", "float32", 1), (ir.input_("h"),)))


@st.composite
def _int_linear(draw, depth=2):
    if depth == 0:
        return draw(st.sampled_from([_Q, _KV, ir.const(draw(st.integers(-300, 300))), ir.input_("h")]))
    op = draw(st.sampled_from(["add", "sub", "neg", "mul", "long", "leaf"]))
    if op == "leaf":
        return draw(_int_linear(0))
    if op == "neg":
        return ir.unary("neg", draw(_int_linear(depth - 1)))
    if op == "long":
        return ir.cast(draw(_int_linear(depth - 1)), DType.INT64)
    if op == "mul":
        return ir.binary("mul", draw(_int_linear(depth - 1)), ir.const(draw(st.integers(-300, 300))))
    return ir.binary(op, draw(_int_linear(depth - 1)), draw(_int_linear(depth - 1)))


@st.composite
def _float_linear(draw, depth=3):
    if depth == 0:
        return draw(st.sampled_from((_S, _S) + _FREE) | _int_linear().map(lambda x: ir.cast(x, DType.FLOAT32)))
    op = draw(st.sampled_from(["add", "sub", "neg", "mul", "div", "leaf", "other"]))
    if op == "leaf":
        return draw(_float_linear(0))
    if op == "neg":
        return ir.unary("neg", draw(_float_linear(depth - 1)))
    if op == "other":
        return draw(float_exprs(1))
    a, b = draw(_float_linear(depth - 1)), draw(_float_linear(depth - 1) | st.sampled_from(_FREE))
    if op in ("mul", "div") and draw(st.booleans()):
        a, b = b, a
    return ir.binary(op, a, b)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_float_linear(), seed=st.integers(0, 2**16))
def test_random_decompositions_are_exact(body, seed):
    expr = ir.binary("add", _S, body)
    a = affine_score(expr)
    if a is None:
        return
    gen = torch.Generator().manual_seed(seed)
    buffers = {**make_buffers(seed), "slopes": torch.randn(HEADS, generator=gen)}
    params, inputs = make_params(seed), _inputs(gen, 256)
    coefs = [evaluate(c, inputs, buffers, params) for c in (a.kv_coef, a.q_coef, a.bias)]
    assume(all(bool(torch.isfinite(c).all()) for c in coefs))  # inf * (kv - q) is not inf*kv - inf*q
    _assert_same(expr, a, inputs, buffers, params)


def test_random_decompositions_hit_often():
    """The generator above is not vacuous: a typical ALiBi-like tree is recognised."""
    body = ir.binary("mul", _FREE[2], ir.cast(ir.binary("sub", _KV, _Q), DType.FLOAT32))
    assert affine_score(ir.binary("add", _S, ir.binary("div", body, _FREE[1]))) is not None
