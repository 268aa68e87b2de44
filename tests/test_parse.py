"""The text form: same IR as the Python form, Python precedence, errors with a caret."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen import variants
from flexgen.dsl import ir
from flexgen.dsl.errors import FlexgenSyntaxError, SignatureError
from flexgen.dsl.printer import pretty

SLOPES = torch.rand(8)
TABLE = torch.randn(8, 31)
DOC = torch.tensor([0, 0, 1, 1, 1, 2])
TABLE8 = TABLE[:, :8]


def _softcap_kw(score, b, h, q_idx, kv_idx, *, cap):
    return cap * torch.tanh(score / cap)


def _window_kw(b, h, q_idx, kv_idx, *, window):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)


# (text, bindings, python function, python bindings)
SAME_IR = [
    ("30.0 * tanh(score / 30.0)", {}, lambda score, b, h, q, kv: 30.0 * torch.tanh(score / 30.0), {}),
    ("cap * tanh(score / cap)", {"cap": 30.0}, _softcap_kw, {"cap": 30.0}),
    ("q_idx >= kv_idx and q_idx - kv_idx < window", {"window": 1024}, _window_kw, {"window": 1024}),
    ("(q_idx >= kv_idx) & (q_idx - kv_idx < window)", {"window": 1024}, _window_kw, {"window": 1024}),
    ("score + SLOPES[h] * (kv_idx - q_idx)", {"SLOPES": SLOPES},
     lambda score, b, h, q_idx, kv_idx: score + SLOPES[h] * (kv_idx - q_idx), {}),
    ("score + TABLE[h, q_idx - kv_idx + 15]", {"TABLE": TABLE},
     lambda score, b, h, q_idx, kv_idx: score + TABLE[h, q_idx - kv_idx + 15], {}),
    ("torch.where(q_idx >= kv_idx, score, -inf)", {},
     lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, -float("inf")), {}),
    ("where(abs(kv_idx - q_idx) % 2 == 1, score * 0.5, score)", {},
     lambda s, b, h, q, kv: torch.where(torch.abs(kv - q) % 2 == 1, s * 0.5, s), {}),
    ("(q_idx // 4).clamp(1, 6) <= kv_idx.abs() // 4", {},
     lambda b, h, q, kv: (q // 4).clamp(1, 6) <= kv.abs() // 4, {}),
    ("not (q_idx < kv_idx) or kv_idx == 0", {}, lambda b, h, q, kv: ~(q < kv) | (kv == 0), {}),
    ("exp2(-(h + 1) * 8.0 / 8) * (kv_idx - q_idx) + score", {},
     lambda s, b, h, q, kv: torch.exp2(-(h + 1) * 8.0 / 8) * (kv - q) + s, {}),
    ("score * sigmoid(float(kv_idx - q_idx) / 8.0) - rsqrt(1.0 + score ** 2)", {},
     lambda s, b, h, q, kv: s * torch.sigmoid((kv - q).float() / 8.0) - torch.rsqrt(1.0 + s ** 2), {}),
    ("minimum(score, 3.0) + max(score, -3) + int64(q_idx) * 2", {},
     lambda s, b, h, q, kv: torch.minimum(s, torch.full_like(s, 3.0)) + torch.maximum(s, torch.full_like(s, -3)) + q.long() * 2, {}),
    ("DOC[q_idx] == DOC[kv_idx] and q_idx >= kv_idx", {"DOC": DOC},
     lambda b, h, q, kv: (DOC[q] == DOC[kv]) & (q >= kv), {}),
    ("1.0 / 30.0 * score", {}, lambda s, b, h, q, kv: 1.0 / 30.0 * s, {}),
    ("-3 < q_idx - kv_idx", {}, lambda b, h, q, kv: -3 < q - kv, {}),
    ("q_idx.to(torch.float32) * 0.5 + score", {}, lambda s, b, h, q, kv: q.to(torch.float32) * 0.5 + s, {}),
    # the functions added for issue 14, with string keyword arguments and the F. / torch.nn.functional. prefixes
    ('F.gelu(score, approximate="tanh") + gelu(score)', {},
     lambda s, b, h, q, kv: F.gelu(s, approximate="tanh") + F.gelu(s), {}),
    ("torch.nn.functional.silu(score) + F.softplus(score, beta=2, threshold=5.0)", {},
     lambda s, b, h, q, kv: F.silu(s) + F.softplus(s, beta=2, threshold=5.0), {}),
    ("round(score, decimals=2) + score.round() + floor(score) + ceil(score) + trunc(score) + sign(score)", {},
     lambda s, b, h, q, kv: torch.round(s, decimals=2) + s.round() + torch.floor(s) + torch.ceil(s) + torch.trunc(s)
     + torch.sign(s), {}),
    ("torch.where(isnan(score), 0.0, log1p(atan(score)) + fmod(score, 1.5) + fmod(q_idx, 3))", {},
     lambda s, b, h, q, kv: torch.where(torch.isnan(s), 0.0, torch.log1p(torch.atan(s)) + torch.fmod(s, 1.5) + torch.fmod(q, 3)), {}),
    ("q_idx >> 4 == kv_idx >> 4 and (q_idx << 1) >= kv_idx", {},
     lambda b, h, q, kv: ((q >> 4) == (kv >> 4)) & ((q << 1) >= kv), {}),
    ("score.half() + bfloat16(score * 3.3) + score.to(torch.float16) + half(0.1)", {},
     lambda s, b, h, q, kv: s.half() + (s * 3.3).bfloat16() + s.to(torch.float16) + 0.0999755859375, {}),
    ("score + (TABLE8[h] * SLOPES[h]).sum(-1) + TABLE8.shape[1]", {"TABLE8": TABLE8, "SLOPES": SLOPES},
     lambda s, b, h, q, kv: s + (TABLE8[h] * SLOPES[h]).sum(-1) + TABLE8.shape[1], {}),
]
@pytest.mark.parametrize("case", SAME_IR, ids=[c[0] for c in SAME_IR])
def test_text_and_python_give_identical_ir(case):
    text, bindings, fn, fn_bindings = case
    python = flexgen.trace(fn, **fn_bindings)
    parsed = flexgen.trace(text, kind=python.kind, **bindings)
    assert parsed.expr == python.expr, f"{pretty(parsed.expr)}  !=  {pretty(python.expr)}"
    assert parsed.structural_hash == python.structural_hash
    assert parsed.buffer_specs == python.buffer_specs


def test_specialized_text_equals_literal_python():
    lit = flexgen.score_mod(lambda score, b, h, q, kv: 30.0 * torch.tanh(score / 30.0))
    text = flexgen.score_mod("30.0 * tanh(score / 30.0)")
    spec = flexgen.score_mod("cap*tanh(score/cap)", cap=30.0, specialize=True)
    assert lit.structural_hash == text.structural_hash == spec.structural_hash
    param = flexgen.score_mod("cap*tanh(score/cap)", cap=30.0)
    assert param.structural_hash != lit.structural_hash
    assert param.params == {"cap": 30.0}


def test_builtin_variants_match_python_equivalents():
    py = flexgen.mask_mod(_window_kw, window=7)
    assert variants.sliding_window(99).structural_hash == py.structural_hash
    ids = torch.tensor([0, 1, 1])

    def doc(b, h, q_idx, kv_idx):
        return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

    doc_ids = ids
    assert variants.document(ids).expr == flexgen.mask_mod(doc).expr


def test_python_precedence():
    # & binds tighter than ==, ** is right-associative and tighter than unary minus
    a = flexgen.mask_mod("(q_idx > 1) & (kv_idx > 1) == (h > 0)")
    b = flexgen.mask_mod(lambda b, h, q, kv: (q > 1) & (kv > 1) == (h > 0))
    assert a.expr == b.expr
    c = flexgen.score_mod("-score ** 2 ** 0.5")
    d = flexgen.score_mod(lambda s, b, h, q, kv: -s ** 2 ** 0.5)
    assert c.expr == d.expr
    e = flexgen.mask_mod("q_idx - kv_idx // 2 * 3 % 5 + 1 > 0")
    f = flexgen.mask_mod(lambda b, h, q, kv: q - kv // 2 * 3 % 5 + 1 > 0)
    assert e.expr == f.expr


def test_chained_comparison_means_and():
    a = flexgen.mask_mod("0 <= q_idx - kv_idx < 8")
    b = flexgen.mask_mod(lambda b, h, q, kv: (0 <= q - kv) & (q - kv < 8))
    assert a.expr == b.expr


def test_literals_comments_and_whitespace():
    a = flexgen.mask_mod("""
        q_idx >= kv_idx   # causal
        and kv_idx < 0x10  # first 16 keys
    """)
    b = flexgen.mask_mod(lambda b, h, q, kv: (q >= kv) & (kv < 16))
    assert a.expr == b.expr
    t = flexgen.mask_mod("true and q_idx == kv_idx or False")
    assert t.evaluate(b=0, h=0, q_idx=torch.tensor(3), kv_idx=torch.tensor(3)).item() is True
    assert flexgen.score_mod("score * .5e1").expr == flexgen.score_mod(lambda s, b, h, q, kv: s * 5.0).expr
    assert flexgen.score_mod("score * math.pi").expr == flexgen.score_mod(lambda s, b, h, q, kv: s * 3.141592653589793).expr


def test_keyword_arguments_and_methods_in_text():
    a = flexgen.score_mod("clamp(score, min=-5.0, max=5.0) + score.abs().exp()")
    b = flexgen.score_mod(lambda s, b, h, q, kv: torch.clamp(s, min=-5.0, max=5.0) + s.abs().exp())
    assert a.expr == b.expr


def test_bound_mod_is_callable_from_text():
    m = flexgen.mask_mod("inner(b, h, q_idx, kv_idx) and kv_idx > 0", inner=variants.causal)
    assert m.expr == ir.binary("and", variants.causal.expr, ir.binary("gt", ir.input_("kv_idx"), ir.const(0)))


def test_printer_output_parses_back():
    mods = [
        variants.sliding_window(5), variants.prefix_lm(3), variants.document(DOC), variants.alibi(8),
        variants.softcap(20.0), variants.relative_bias(TABLE),
        flexgen.score_mod(lambda s, b, h, q, kv: torch.where(q >= kv, s * 2 - 1, -float("inf")) + q.long() % 3),
        flexgen.mask_mod(lambda b, h, q, kv: ((q > 1) ^ (kv > 2)) | ~(q == kv)),
        flexgen.score_mod(lambda s, b, h, q, kv: -(s ** 2) + torch.minimum(s, 1.0 + 0 * s) - (q - kv).abs()),
        flexgen.score_mod(lambda s, b, h, q, kv: F.softplus(s.half(), beta=2) + torch.fmod(s.bfloat16(), 2.0)
                          + torch.round(s, decimals=-1) + torch.sign(q - kv) + F.gelu(s, approximate="tanh")),
        flexgen.mask_mod(lambda b, h, q, kv: torch.isnan(torch.log1p(torch.atan(q * 1.0))) | ((q >> 2) >= kv << 3)),
    ]
    for mod in mods:
        again = flexgen.trace(pretty(mod.expr), kind=mod.kind, **dict(mod.buffers), **dict(mod.params))
        assert again.expr == mod.expr, pretty(mod.expr)


# ---------------------------------------------------------------- errors


def _raises(text, **kw):
    with pytest.raises(FlexgenSyntaxError) as info:
        flexgen.trace(text, **kw)
    return info.value


def test_syntax_error_has_caret():
    err = _raises("q_idx >= kv_idx $ 3", kind="mask")
    assert (err.line, err.column) == (1, 17)
    lines = str(err).splitlines()
    assert "unexpected character '$'" in lines[0]
    assert lines[-2].strip() == "q_idx >= kv_idx $ 3"
    assert lines[-1].index("^") == lines[-2].index("$")


def test_unexpected_end_points_past_the_text():
    err = _raises("q_idx >= (kv_idx + ", kind="mask")
    assert "ends too early" in str(err)
    assert err.column == len("q_idx >= (kv_idx + ") + 1


def test_unknown_name_with_suggestion_and_position():
    err = _raises("q_idx >= kv_idx and\n  q_idx - windw < 3", kind="mask", window=3)
    assert (err.line, err.column) == (2, 11)
    assert "unknown name 'windw'" in str(err) and "did you mean 'window'" in str(err)
    assert str(err).splitlines()[-1].endswith("^")


def test_score_in_mask_text():
    err = _raises("score > 0", kind="mask")
    assert "'score' is not an input of a mask_mod" in str(err)


def test_bitwise_precedence_hint():
    err = _raises("score > 0 & score < 1", kind="score")  # 0 & score: a float operand of &
    assert "bind tighter than comparisons" in str(err)


def test_bitwise_on_integers_binds_as_in_python():
    """`&` binds tighter than comparisons: this text is Python's chained comparison around kv_idx & (q_idx - kv_idx)."""
    text = flexgen.mask_mod("q_idx >= kv_idx & q_idx - kv_idx < 3")
    spelled = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= (kv_idx & (q_idx - kv_idx)))
                               & ((kv_idx & (q_idx - kv_idx)) < 3))
    assert text.expr == spelled.expr


def test_semantic_error_in_text_points_at_subexpression():
    err = _raises("score + tab[h, q_idx]", kind="score", tab=torch.zeros(3))
    assert "too many indices for buffer 'tab'" in str(err)
    assert err.column == 9


def test_unused_bindings_are_ignored():
    mod = flexgen.mask_mod("q_idx >= kv_idx", cap=3.0, table=torch.zeros(2))
    assert not mod.params and not mod.buffers
    assert mod.structural_hash == flexgen.variants.causal.structural_hash


def test_binding_cannot_hide_an_input():
    with pytest.raises(SignatureError, match="hide the input"):
        flexgen.mask_mod("q_idx >= kv_idx", q_idx=3)


def test_shift_precedence_and_strings():
    a = flexgen.mask_mod("q_idx + 1 << 2 >= kv_idx >> 3 - 1")
    b = flexgen.mask_mod(lambda b, h, q, kv: (q + 1 << 2) >= (kv >> 3 - 1))
    assert a.expr == b.expr
    err = _raises("score + 'tanh'", kind="score")
    assert "str cannot be used" in str(err) and err.column == 1
    err = _raises("gelu(score, approximate='exact')", kind="score")
    assert "'none' or 'tanh'" in str(err)
