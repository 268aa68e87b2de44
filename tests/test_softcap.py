"""softcap_score: recognising outer * tanh(inner * score) (logit soft-capping), refusing the rest."""
import pytest
import torch

import flexgen
from flexgen.dsl import ir
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import DType
from flexgen.dsl.softcap import SoftcapScore, softcap_score
from flexgen.dsl.variants import softcap
from test_affine import _inputs as affine_inputs

HEADS = 4


def _inputs(gen: torch.Generator) -> dict:
    inputs = affine_inputs(gen)  # (heads there are 8: the mods below index at most 4)
    return {**inputs, "score": inputs["score"] * 8, "h": inputs["h"] % HEADS}


def _recomposed(t: SoftcapScore) -> ir.Node:
    """outer * tanh(inner * score), as the forward computes it."""
    return ir.binary("mul", t.outer, ir.unary("tanh", ir.binary("mul", t.inner, ir.input_("score"))))


def _recognised():
    caps = torch.rand(HEADS, generator=torch.Generator().manual_seed(0)) * 40 + 5
    return {
        "variant": softcap(30.0),
        "text": flexgen.score_mod("cap * tanh(score / cap)", cap=50.0),
        "python_float": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)),
        "swapped": flexgen.score_mod(lambda s, b, h, q, kv: torch.tanh(s * 0.05) * 20.0),
        "negative_outer": flexgen.score_mod(lambda s, b, h, q, kv: -10.0 * torch.tanh(s / 10.0)),
        "per_head": flexgen.score_mod(lambda s, b, h, q, kv: caps[h] * torch.tanh(s / caps[h])),
        "plain_tanh": flexgen.score_mod(lambda s, b, h, q, kv: torch.tanh(s)),
        "divided_outside": flexgen.score_mod(lambda s, b, h, q, kv: torch.tanh(s / 8.0) / 0.125),
    }


@pytest.mark.parametrize("name", list(_recognised()))
def test_recognised_matches(name):
    mod = _recognised()[name]
    t = softcap_score(mod.expr)
    assert t is not None, mod.pretty()
    for part in (t.outer, t.inner):
        assert part.dtype is DType.FLOAT32
        assert not ir.inputs_of(part) & {"score", "q_idx", "kv_idx"}
    run = lambda e: evaluate(e, _inputs(torch.Generator().manual_seed(1)), mod.buffers, mod.params, torch.float64)  # noqa: E731
    want, got = torch.broadcast_tensors(run(mod.expr), run(_recomposed(t)))
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_variant_factors():
    t = softcap_score(softcap(30.0).expr)
    cap = ir.param("cap", DType.FLOAT32)
    assert t.outer == cap
    assert t.inner == ir.binary("div", ir.const(1.0), cap)


def _refused():
    slopes = torch.rand(HEADS)
    return {
        "alibi": flexgen.score_mod("score + slopes[h] * (kv_idx - q_idx)", slopes=slopes),
        "capped_alibi": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh((s + slopes[h] * (kv - q)) / 30.0)),
        "offset_inside": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0 + 1.0)),
        "plus_outside": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0) + 1.0),
        "position_outer": flexgen.score_mod(lambda s, b, h, q, kv: q.float() * torch.tanh(s / 30.0)),
        "position_inner": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.tanh(s * kv.float())),
        "sigmoid": flexgen.score_mod(lambda s, b, h, q, kv: 30.0 * torch.sigmoid(s / 30.0)),
        "score_outside": flexgen.score_mod(lambda s, b, h, q, kv: s * torch.tanh(s)),
        "nested": flexgen.score_mod(lambda s, b, h, q, kv: torch.tanh(torch.tanh(s))),
    }


@pytest.mark.parametrize("name", list(_refused()))
def test_refused(name):
    assert softcap_score(_refused()[name].expr) is None
