"""torch.nn.functional's activations in score_mods: elu, celu, selu, leaky_relu, hardtanh, relu6, hardsigmoid,
hardswish, mish, logsigmoid and softsign, each a composition of IR ops (flexgen/dsl/functional.py).

Against torch itself: float64 values (kinks, thresholds and huge values included), the symbolic derivative
against torch.autograd (torch's own choices at the kinks), the text form, and the lowered code run on the host.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen.dsl import functional, ir
from flexgen.dsl.derivative import grad_score
from flexgen.dsl.errors import FlexgenSyntaxError, UnsupportedOperationError
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import BufferSpec, DType

from test_lower import N_POINTS, Case, check, needs_gxx, run_on_host
from test_trace import _against_torch

S = ir.input_("score")
c = ir.const

# Where the activations bend or switch formulas (0, +-3, 6, softplus's 20), values whose expm1 / log1p
# would lose digits (tiny ones), and values that overflow exp (+-700 and beyond in float64).
KINKS = (0.0, -0.0, 3.0, -3.0, 6.0, -6.0, 20.0, -20.0, 2.5, -2.5, 1.0, -1.0, 0.3, -0.3, 1.5, -1.5, 2.0, -2.0,
         1e-12, -1e-12, 1e-300, -1e-300, 5e-324, 50.0, -50.0, 700.0, -700.0, 800.0, -800.0, 1e4, -1e4,
         math.nextafter(3.0, 0.0), math.nextafter(-3.0, 0.0), math.nextafter(3.0, 9.0), math.nextafter(-3.0, -9.0),
         math.nextafter(0.0, 1.0), math.nextafter(20.0, 0.0), math.nextafter(20.0, 99.0))

# name -> a function of the score; torch.celu / torch.selu are torch's own spellings (Tensor has no such methods)
ACTIVATIONS = {
    "elu": lambda x: F.elu(x),
    "elu_alpha": lambda x: F.elu(x, alpha=0.5) + F.elu(x, 2.0, inplace=False) - F.elu(x, -0.7, False),
    "celu": lambda x: F.celu(x) + torch.celu(x, alpha=0.3),
    "celu_alpha": lambda x: F.celu(x, 2.5, inplace=False) + F.celu(x, alpha=-1.5) * 3,
    "selu": lambda x: F.selu(x) + torch.selu(x) * 0.5 + F.selu(x, inplace=False),
    "leaky_relu": lambda x: F.leaky_relu(x) + F.leaky_relu(x, 0.2),
    "leaky_relu_slopes": lambda x: F.leaky_relu(x, negative_slope=-0.5, inplace=False) + F.leaky_relu(x, 1.5),
    "hardtanh": lambda x: F.hardtanh(x),
    "hardtanh_bounds": lambda x: F.hardtanh(x, -2.5, 3.0) + F.hardtanh(x, min_val=0.0, max_val=6.0, inplace=False)
    + F.hardtanh(x, 1.0, 1.0) + F.hardtanh(x, -math.inf, 2.0),
    "relu6": lambda x: F.relu6(x) + F.relu6(x, inplace=False),
    "hardsigmoid": lambda x: F.hardsigmoid(x) + F.hardsigmoid(x, inplace=False),
    "hardswish": lambda x: F.hardswish(x) + F.hardswish(x, inplace=False),
    "mish": lambda x: F.mish(x) + F.mish(x, inplace=False),
    "logsigmoid": lambda x: F.logsigmoid(x) + torch.nn.functional.logsigmoid(x * 3),
    "softsign": lambda x: F.softsign(x),
}
# Piecewise linear or rational, computed operation for operation as torch does: bit for bit in float64.
EXACT = ("leaky_relu", "leaky_relu_slopes", "hardtanh", "hardtanh_bounds", "relu6", "hardsigmoid", "hardswish",
         "softsign")


def _mod(fn):
    return flexgen.score_mod(lambda s, b, h, q, kv: fn(s))


# ---------------------------------------------------------------- values against torch


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_values_match_torch(name):
    fn = ACTIVATIONS[name]
    # torch's vectorised libm (expm1, log1p, tanh) and the IR's compositions differ by a few ulp
    _against_torch(lambda s, b, h, q, kv: fn(s), exact=True if name in EXACT else 1e-12, seed=len(name) + 100,
                   specials=KINKS)


def test_expm1_composition_keeps_small_values():
    """elu near 0 is alpha * expm1(x); exp(x) - 1 would keep only a few digits of it there."""
    x = torch.tensor([-1e-15, -1e-10, -3e-8, -1e-4, -0.01, -0.5, -1.0, -5.0, -30.0, -745.0, -math.inf, 1e-9, 0.7, 30.0],
                     dtype=torch.float64)
    got = evaluate(functional._expm1(S), {"score": x})
    torch.testing.assert_close(got, torch.expm1(x), rtol=4 * 2.0 ** -52, atol=0.0)
    got32 = evaluate(functional._expm1(S), {"score": x.float()}, float_dtype=torch.float32)
    torch.testing.assert_close(got32, torch.expm1(x).float(), rtol=4 * 2.0 ** -23, atol=0.0)


def test_the_compositions_use_only_existing_ops():
    ops = lambda fn: {n.op for n in ir.postorder(_mod(fn).expr)}  # noqa: E731
    assert ops(F.elu) == {"input", "const", "le", "where", "mul", "tanh", "exp", "add"}
    assert ops(F.leaky_relu) == {"input", "const", "gt", "where", "mul"}
    assert ops(F.mish) == {"input", "const", "mul", "tanh", "gt", "where", "log1p", "exp"}
    assert ops(F.softsign) == {"input", "const", "abs", "add", "div"}
    # an integer argument is a float first, as for gelu
    m = flexgen.score_mod(lambda s, b, h, q, kv: s + F.elu(q - kv) + F.hardtanh(kv, 0, 100))
    assert m.evaluate(score=torch.tensor(0.5), b=0, h=0, q_idx=2, kv_idx=5).item() == pytest.approx(0.5 + math.expm1(-3) + 5)


# ---------------------------------------------------------------- derivatives against torch.autograd


def _autograd_points(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor(KINKS + (math.inf, -math.inf), dtype=torch.float64),
                      torch.randn(400, generator=g, dtype=torch.float64) * 6])


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_derivative_matches_torch_autograd(name):
    """torch's gradient at the kinks is a convention (elu: the exponential side at 0; hardtanh / relu6 /
    hardsigmoid: 0 at the bounds; hardswish: 0 at -3, 1 at 3; logsigmoid: 1/2 at 0): the derivative of the
    composition must make the same choices, exactly at the kinks."""
    fn = ACTIVATIONS[name]
    x = _autograd_points(len(name))
    xr = x.clone().requires_grad_(True)
    out = fn(xr)
    (want,) = torch.autograd.grad(out.sum(), xr)
    got = evaluate(grad_score(_mod(fn).expr), {"score": x}).expand(x.shape)
    # where the value itself overflows (celu with a negative alpha far below 0) torch's gradient is inf and
    # the composition's NaN (0 * inf inside expm1's derivative): neither is a gradient
    finite = ~out.detach().isinf()
    # torch's backward takes two coefficients in float32: celu's 1 / float(alpha), hardsigmoid's 1/6
    rtol = 1e-7 if name.startswith("celu") or name == "hardsigmoid" else 1e-9
    torch.testing.assert_close(got[finite], want[finite], rtol=rtol, atol=1e-12, equal_nan=True)


def test_derivative_at_nan_follows_torch():
    """NaN scores: NaN out, and the gradient torch gives (the linear side's for elu and leaky_relu, 1 for
    hardtanh and hardswish); hardsigmoid's NaN gets 1/6 where torch's backward gives 0."""
    x = torch.tensor([math.nan], dtype=torch.float64)
    for name, fn in ACTIVATIONS.items():
        xr = x.clone().requires_grad_(True)
        out = fn(xr)
        (want,) = torch.autograd.grad(out.sum(), xr)
        mod = _mod(fn)
        assert mod.evaluate(score=x, b=0, h=0, q_idx=0, kv_idx=0).isnan().all(), name
        got = evaluate(grad_score(mod.expr), {"score": x})
        if name != "hardsigmoid":
            torch.testing.assert_close(got.expand(1), want, equal_nan=True, msg=name)


def test_traced_coefficients_have_their_gradient():
    """A bound (not specialized) alpha is a kernel parameter: its value is read at run time."""
    def mod(score, b, h, q_idx, kv_idx, *, alpha, slope):
        return F.elu(score, alpha) + F.celu(score, alpha=alpha) + F.leaky_relu(score, slope)

    # parameters are float32 kernel arguments: values exact in float32 compare with torch's float64 ones
    m = flexgen.score_mod(mod, alpha=0.75, slope=0.0625)
    assert m.params == {"alpha": 0.75, "slope": 0.0625}
    x = _autograd_points(7)
    got = m.evaluate(score=x, b=0, h=0, q_idx=0, kv_idx=0)
    xr = x.clone().requires_grad_(True)
    want = F.elu(xr, 0.75) + F.celu(xr, 0.75) + F.leaky_relu(xr, 0.0625)
    torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-300, equal_nan=True)
    (dwant,) = torch.autograd.grad(want.sum(), xr)
    dgot = evaluate(grad_score(m.expr), {"score": x}, params=m.params)
    torch.testing.assert_close(dgot, dwant, rtol=1e-9, atol=1e-12, equal_nan=True)
    # a captured 0-d tensor as alpha is a buffer read
    alpha = torch.tensor(0.25)
    m = flexgen.score_mod(lambda s, b, h, q, kv: F.elu(s, alpha))
    assert [spec.name for spec in ir.buffers_of(m.expr)] == ["alpha"]
    torch.testing.assert_close(m.evaluate(score=x, b=0, h=0, q_idx=0, kv_idx=0), F.elu(x, 0.25), rtol=1e-12, atol=0.0)


def test_activations_of_a_captured_row_apply_elementwise():
    rows = torch.randn(4, 6, dtype=torch.float64)
    m = flexgen.score_mod(lambda s, b, h, q, kv: s + F.hardswish(rows[h]).sum(-1) + F.elu(rows[h], 0.5).amax())
    got = m.evaluate(score=torch.zeros(4, dtype=torch.float64), b=0, h=torch.arange(4), q_idx=0, kv_idx=0)
    torch.testing.assert_close(got, F.hardswish(rows).sum(-1) + F.elu(rows, 0.5).amax(-1))


# ---------------------------------------------------------------- the text form

TEXT = [
    ("F.elu(score) + torch.nn.functional.elu(score, alpha=0.5, inplace=False) + elu(score, 2.0)",
     lambda s: F.elu(s) + F.elu(s, alpha=0.5, inplace=False) + F.elu(s, 2.0)),
    ("F.celu(score, 0.3) + torch.celu(score) + F.selu(score) + torch.selu(score, inplace=True)",
     lambda s: F.celu(s, 0.3) + torch.celu(s) + F.selu(s) + torch.selu(s)),
    ("F.leaky_relu(score, negative_slope=0.2) + F.hardtanh(score, -2, 3) + F.relu6(score)",
     lambda s: F.leaky_relu(s, negative_slope=0.2) + F.hardtanh(s, -2, 3) + F.relu6(s)),
    ("F.hardsigmoid(score) * F.hardswish(score, inplace=False) - F.mish(score)",
     lambda s: F.hardsigmoid(s) * F.hardswish(s, inplace=False) - F.mish(s)),
    ("torch.nn.functional.logsigmoid(score) + F.softsign(score * 2) + logsigmoid(-score)",
     lambda s: F.logsigmoid(s) + F.softsign(s * 2) + F.logsigmoid(-s)),
    ("F.hardtanh(score, min_val=-1.5, max_val=2.5, inplace=False) + F.elu(score * 0.5).exp()",
     lambda s: F.hardtanh(s, min_val=-1.5, max_val=2.5, inplace=False) + F.elu(s * 0.5).exp()),
]


@pytest.mark.parametrize("case", TEXT, ids=[t for t, _ in TEXT])
def test_text_form_gives_the_same_ir(case):
    text, fn = case
    parsed, python = flexgen.score_mod(text), _mod(fn)
    assert parsed.expr == python.expr
    x = _autograd_points(len(text))
    torch.testing.assert_close(parsed.evaluate(score=x, b=0, h=0, q_idx=0, kv_idx=0), fn(x), rtol=1e-12, atol=1e-300,
                               equal_nan=True)


def test_text_form_with_bound_coefficients():
    def fn(score, b, h, q_idx, kv_idx, *, a, s):
        return F.elu(score, alpha=a) + F.leaky_relu(score, s)

    parsed = flexgen.score_mod("F.elu(score, alpha=a) + F.leaky_relu(score, s)", a=0.5, s=0.1)
    python = flexgen.score_mod(fn, a=0.5, s=0.1)
    assert parsed.expr == python.expr and parsed.params == python.params == {"a": 0.5, "s": 0.1}
    baked = flexgen.score_mod("F.hardtanh(score, lo, hi)", lo=-1.0, hi=2.0, specialize=True)
    assert baked.expr == _mod(lambda x: F.hardtanh(x, -1.0, 2.0)).expr


# ---------------------------------------------------------------- bad arguments

BAD = [
    (lambda s: F.hardtanh(s, 2.0, 1.0), "min_val cannot be greater than max_val"),
    (lambda s: F.hardtanh(s, min_val=s, max_val=1.0), "hardtanh(min_val=...) needs a constant Python number"),
    (lambda s: F.hardtanh(s, -1.0, torch.tensor(1.0)), "hardtanh(max_val=...) needs a constant Python number"),
    (lambda s: F.hardtanh(s, math.nan, 1.0), "a bound is NaN"),
    (lambda s: F.celu(s, 0.0), "alpha cannot be 0"),
    (lambda s: torch.celu(s, alpha=0), "alpha cannot be 0"),
    (lambda s: F.elu(s, alpha="1"), "elu(alpha=...) needs a number, got '1'"),
    (lambda s: F.elu(s, alpha=None), "elu(alpha=...) needs a number, got None"),
    (lambda s: F.leaky_relu(s, s > 0), "leaky_relu(negative_slope=...) needs a number, got a bool value"),
]


@pytest.mark.parametrize("case", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_clear_errors(case):
    fn, message = case
    with pytest.raises(UnsupportedOperationError, match=re.escape(message)):
        _mod(fn)


def test_bad_arguments_in_the_text_form():
    with pytest.raises(FlexgenSyntaxError, match="needs a constant Python number"):
        flexgen.score_mod("F.hardtanh(score, lo, 1.0)", lo=-1.0)  # a bound parameter is a run-time value
    with pytest.raises(FlexgenSyntaxError, match="min_val cannot be greater than max_val"):
        flexgen.score_mod("F.hardtanh(score, min_val=1, max_val=-1)")
    with pytest.raises(FlexgenSyntaxError, match="unsupported arguments"):
        flexgen.score_mod("F.elu(score, beta=1.0)")
    with pytest.raises(FlexgenSyntaxError, match="unsupported arguments"):
        flexgen.score_mod("torch.selu(score, 1.0, 2.0)")


# ---------------------------------------------------------------- lowered code on the host


def _exprs() -> list[ir.Node]:
    """Each activation on the score, and on the score rounded (integers: exactly 0, +-3, 6) or shifted so
    that the harness's fixed points (0, +-1, +-2.5, +-7) land on a kink."""
    rounded = ir.unary("round", S)
    shifted = [S, rounded, ir.binary("add", S, c(0.5)), ir.binary("sub", S, c(0.5)), ir.binary("sub", S, c(1.0))]
    out = []
    for x in shifted:
        out += [functional.hardtanh(x, -1.0, 3.0), functional.relu6(x), functional.hardsigmoid(x), functional.hardswish(x)]
    for x in (S, rounded, ir.binary("mul", S, c(0.01))):
        out += [functional.elu(x, 1.0), functional.elu(x, 0.5), functional.celu(x, 0.3), functional.selu(x),
                functional.leaky_relu(x, 0.1), functional.mish(x), functional.logsigmoid(x), functional.softsign(x)]
    out += [functional.mish(ir.binary("mul", S, c(8.0))), functional.logsigmoid(ir.binary("mul", S, c(30.0))),
            functional.elu(ir.binary("mul", S, c(30.0)), 1.0)]  # past softplus's threshold, and exp's overflow
    return out


@needs_gxx
def test_lowered_activations_match_the_evaluator(tmp_path):
    check([Case("score", e, exact=False) for e in _exprs()], tmp_path, seed=11)


@needs_gxx
def test_lowered_backward_matches_autograd(tmp_path):
    """score_mod_bwd of each activation, kinks included (the harness's fixed points, shifted onto them),
    against float64 autograd of the IR and the symbolic derivative evaluated in float32; a traced alpha and
    a captured one too."""
    alpha = BufferSpec("alpha", "float32", 1)
    exprs = [e for e in _exprs() if not any(n.op == "round" for n in ir.postorder(e))]
    exprs.append(functional.elu(S, ir.param("a", DType.FLOAT32)))
    exprs.append(functional.celu(S, ir.load(alpha, (ir.binary("mod", ir.input_("h"), c(4)),))))
    table = torch.tensor([0.5, 1.0, 2.0, 0.25])
    cases = []
    for e in exprs:
        loads = ir.buffers_of(e)
        cases.append(Case("bwd", e, buffers={"alpha": (table, table)} if loads else {}, params={"a": 0.7}))
    for case, (got, _, _, pts) in zip(cases, run_on_host(cases, tmp_path, seed=12)):
        bufs = {n: v for n, (_, v) in case.buffers.items()}
        grad_out = 1.0 + torch.arange(N_POINTS, dtype=torch.float64) / N_POINTS
        score = pts["score"].to(torch.float64).requires_grad_(True)
        out = evaluate(case.expr, {**pts, "score": score}, bufs, case.params, float_dtype=torch.float64)
        (out * grad_out).sum().backward()
        msg = lambda m: f"{ir.Node.__repr__(case.expr)}: {m}"  # noqa: E731
        torch.testing.assert_close(got.to(torch.float64), score.grad, rtol=2e-5, atol=2e-5, msg=msg)
        dscore = evaluate(grad_score(case.expr), pts, bufs, case.params, float_dtype=torch.float32)
        torch.testing.assert_close(got, (grad_out.float() * dscore).expand(N_POINTS), rtol=1e-5, atol=1e-6, msg=msg)
