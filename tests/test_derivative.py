import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexgen
from flexgen.dsl import ir
from flexgen.dsl.derivative import grad_buffers, grad_score, grad_wrt
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import BufferSpec, DType

from ir_strategies import FLOAT_BUFFERS, diff_exprs, make_buffers, make_inputs, make_params

s = ir.input_("score")
q = ir.input_("q_idx")
kv = ir.input_("kv_idx")
BIAS = BufferSpec("bias", "float32", 1)


def k(v):
    return ir.const(v)


def autograd_reference(e, inputs, buffers, params):
    """d e / d score elementwise and d sum(e) / d buffer, by torch autograd in float64."""
    score = inputs["score"].clone().requires_grad_(True)
    bufs = {n: (t.clone().requires_grad_(True) if t.dtype.is_floating_point else t) for n, t in buffers.items()}
    out = evaluate(e, {**inputs, "score": score}, bufs, params, torch.float64)
    out = out.expand(score.shape)
    leaves = [score] + [bufs[spec.name] for spec in FLOAT_BUFFERS]
    if out.requires_grad:
        grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    else:  # a constant expression
        grads = [None] * len(leaves)
    grads = [torch.zeros_like(l) if g is None else g for g, l in zip(grads, leaves)]
    return out.detach(), grads[0], dict(zip([b.name for b in FLOAT_BUFFERS], grads[1:]))


def symbolic(e, inputs, buffers, params):
    """The same gradients from the symbolic derivatives, scattered like the backward kernel does."""
    shape = inputs["score"].shape
    ds = evaluate(grad_score(e), inputs, buffers, params, torch.float64).expand(shape)
    gbuf = {spec.name: torch.zeros_like(buffers[spec.name]) for spec in FLOAT_BUFFERS}
    for load, partial in grad_buffers(e):
        p = evaluate(partial, inputs, buffers, params, torch.float64).expand(shape)
        idx = [evaluate(i, inputs, buffers, params).long().expand(shape) for i in load.args]
        gbuf[load.attr.name].index_put_(tuple(idx), p, accumulate=True)
    return ds, gbuf


def at_a_jump(e, inputs, buffers, params):
    """Where a float modulo of e has a whole quotient (to rounding): a % b jumps there, so neither derivative is
    defined, and autograd's floor division and the rule's own rounding may land on either side (w * x % x)."""
    shape = inputs["score"].shape
    jumps = torch.zeros(shape, dtype=torch.bool)
    for n in ir.postorder(e):
        if n.op in ("mod", "fmod") and n.dtype is DType.FLOAT32:
            a, b = (evaluate(x, inputs, buffers, params, torch.float64).expand(shape) for x in n.args)
            quotient = a / b
            jumps |= (quotient - quotient.round()).abs() <= 1e-6 * quotient.abs().clamp(min=1)
    return jumps


def close(a, b, ok):
    a, b = a[ok], b[ok]
    return torch.allclose(a, b, rtol=1e-6, atol=1e-8 * (1 + b.abs().max().item() if b.numel() else 1))


# ---------------------------------------------------------------- fixed cases


def test_simple_rules():
    inputs = {"score": torch.linspace(-2, 2, 9, dtype=torch.float64)}
    x = inputs["score"]
    cases = [
        (ir.binary("mul", s, k(3.0)), torch.full_like(x, 3.0)),
        (ir.unary("exp", s), torch.exp(x)),
        (ir.unary("tanh", s), 1 - torch.tanh(x) ** 2),
        (ir.binary("add", s, ir.cast(q, DType.FLOAT32)), torch.ones_like(x)),
        (ir.unary("abs", s), torch.sign(x)),
    ]
    for e, want in cases:
        got = evaluate(grad_score(e), {**inputs, "q_idx": 3}).expand(x.shape)
        assert torch.allclose(got, want), (e, got, want)


def test_structural_zeros():
    assert grad_score(ir.cast(q, DType.FLOAT32)) == k(0.0)
    assert grad_score(ir.binary("lt", s, k(1.0))) == k(0.0)
    assert grad_score(ir.cast(ir.cast(s, DType.INT32), DType.FLOAT32)) == k(0.0)
    assert grad_score(ir.binary("floordiv", s, k(2.0))) == k(0.0)
    assert grad_score(s) == k(1.0)
    assert grad_score(ir.binary("add", s, k(2.0))) == k(1.0)


def test_min_max_ties_match_torch():
    # torch gives half the gradient to each side of a tie
    e = ir.binary("max", s, k(1.0))
    x = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    got = evaluate(grad_score(e), {"score": x})
    assert got.tolist() == [0.0, 0.5, 1.0]
    e = ir.binary("min", s, s)
    assert evaluate(grad_score(e), {"score": x}).expand(3).tolist() == [1.0, 1.0, 1.0]


def test_where_routes_gradient():
    e = ir.where(ir.binary("ge", q, kv), ir.binary("mul", s, k(2.0)), ir.unary("neg", s))
    got = evaluate(grad_score(e), {"score": torch.zeros(1), "q_idx": torch.arange(3)[:, None], "kv_idx": torch.arange(3)})
    want = torch.where(torch.arange(3)[:, None] >= torch.arange(3), 2.0, -1.0).double()
    assert torch.equal(got.expand(3, 3), want)


def test_buffer_loads_at_different_indices_are_separate():
    bq = ir.load(BIAS, (q,))
    bk = ir.load(BIAS, (kv,))
    e = ir.binary("add", ir.binary("mul", s, bq), ir.binary("mul", bk, bk))
    pairs = grad_buffers(e)
    assert [p[0] for p in pairs] == [bq, bk]
    assert pairs[0][1] == s
    assert grad_score(e) == bq
    # a load only used in a condition has a zero partial and is left out by default
    e2 = ir.where(ir.binary("gt", bq, k(0.0)), s, k(0.0))
    assert grad_buffers(e2) == []
    assert [p[0] for p in grad_buffers(e2, drop_zero=False)] == [bq]


def test_int_valued_score_mod():
    assert grad_score(q) == k(0.0)
    assert grad_wrt(ir.binary("add", q, kv), s) == k(0.0)


def test_softcap_matches_autograd():
    cap = ir.param("cap", DType.FLOAT32)
    e = ir.binary("mul", cap, ir.unary("tanh", ir.binary("div", s, cap)))
    x = torch.linspace(-30, 30, 41, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((20 * torch.tanh(xr / 20)).sum(), xr)
    got = evaluate(grad_score(e), {"score": x}, params={"cap": 20.0})
    assert torch.allclose(got, g)


# ---------------------------------------------------------------- property: matches torch autograd


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(e=diff_exprs(max_depth=4), seed=st.integers(0, 2**16))
def test_derivative_matches_autograd(e, seed):
    inputs = make_inputs(seed)
    buffers = make_buffers(seed)
    params = make_params(seed)
    out, ref_ds, ref_gbuf = autograd_reference(e, inputs, buffers, params)
    ds, gbuf = symbolic(e, inputs, buffers, params)
    jumps = at_a_jump(e, inputs, buffers, params)
    ok = out.isfinite() & ref_ds.isfinite() & ds.isfinite() & (ref_ds.abs() < 1e8) & ~jumps
    assert close(ds, ref_ds, ok), (e, grad_score(e))
    # buffer gradients sum over every element, so only compare when all of it is finite and differentiable
    if bool(out.isfinite().all()) and out.abs().max() < 1e8 and not bool(jumps.any()):
        for name in gbuf:
            r = ref_gbuf[name]
            if bool(r.isfinite().all()) and r.abs().max() < 1e8:
                assert close(gbuf[name], r, torch.ones_like(r, dtype=torch.bool)), (e, name)


# ---------------------------------------------------------------- the newer torch functions, against torch's own autograd

_ROW = torch.randn(8, dtype=torch.float64) + 3.0  # fmod divisors, well away from 0

TORCH_GRADIENTS = {
    "log1p": lambda x, h, row: torch.log1p(x.abs()) * torch.log1p(x * 0.04),
    "atan": lambda x, h, row: torch.atan(x * 0.7) * x,
    "gelu": lambda x, h, row: F.gelu(x),
    "gelu_tanh": lambda x, h, row: F.gelu(x, approximate="tanh"),
    "silu": lambda x, h, row: F.silu(x),
    "softplus": lambda x, h, row: F.softplus(x) + F.softplus(x, beta=2.5, threshold=3.0),
    "rounding_is_flat": lambda x, h, row: torch.round(x * 3) + torch.floor(x) * x + torch.ceil(x) + torch.trunc(x) * 2 + torch.sign(x) * x,
    "fmod": lambda x, h, row: torch.fmod(x * 5, 1.25) + torch.fmod(x, row[h]) * 2,
    # straight through (torch also rounds the gradient to 16 bits: 3 and 1 are exact)
    "half_casts_pass_gradients": lambda x, h, row: x.half().float() * 3 + x.bfloat16().float(),
}


@pytest.mark.parametrize("name", sorted(TORCH_GRADIENTS))
def test_new_functions_match_torch_autograd(name):
    """d/dscore of the traced mod, and the gradient of the captured row it reads, against torch.autograd
    of the torch function itself run per element (float64), away from the jumps of the rounding ops."""
    fn = TORCH_GRADIENTS[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(512, generator=g, dtype=torch.float64) * 4
    x = torch.where((x * 15).frac().abs() < 0.05, x + 0.01, x)  # where torch's gradient is only a convention
    h = torch.randint(0, 8, (512,), generator=g, dtype=torch.int32)
    mod = flexgen.score_mod(lambda score, b, hh, q_idx, kv_idx: fn(score, hh, _ROW))
    xr, row = x.clone().requires_grad_(True), _ROW.clone().requires_grad_(True)
    out = torch.vmap(fn, in_dims=(0, 0, None))(xr, h, row)
    want_ds, want_row = torch.autograd.grad(out.sum(), [xr, row], allow_unused=True)
    inputs = {"score": x, "b": 0, "h": h, "q_idx": 0, "kv_idx": 0}
    got = evaluate(grad_score(mod.expr), inputs, mod.buffers, mod.params, torch.float64).expand(x.shape)
    torch.testing.assert_close(got, want_ds, rtol=1e-9, atol=1e-12)
    row_grad = torch.zeros(8, dtype=torch.float64)
    for load, partial in grad_buffers(mod.expr):
        p = evaluate(partial, inputs, mod.buffers, mod.params, torch.float64).expand(x.shape)
        row_grad.index_put_((evaluate(load.args[0], inputs).long().expand(x.shape),), p, accumulate=True)
    torch.testing.assert_close(row_grad, torch.zeros(8, dtype=torch.float64) if want_row is None else want_row,
                               rtol=1e-9, atol=1e-9)
