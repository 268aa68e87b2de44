"""torch functions that are compositions of IR ops, written as torch computes them.

Each takes and returns IR nodes; the tracer (trace.py) checks the Python-level arguments.
The formulas follow torch's CPU and CUDA kernels operation for operation, so float64
evaluation agrees with torch on float64 inputs to the last bit or two, and the symbolic
derivative of the composition is torch's gradient formula.
"""
from __future__ import annotations

import math

from . import ir
from .ir import DType, Node

F32 = DType.FLOAT32
_SQRT1_2 = math.sqrt(0.5)
_GELU_TANH_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5  # sqrt(2 / pi)
_GELU_TANH_KAPPA = 0.044715


def _k(value: float) -> Node:
    return ir.const(float(value))


def _mul(a: Node, b: Node) -> Node:
    return ir.binary("mul", a, b)


def _add(a: Node, b: Node) -> Node:
    return ir.binary("add", a, b)


def _div(a: Node, b: Node) -> Node:
    return ir.binary("div", a, b)


def _coef(value: float | Node) -> Node:
    """A coefficient given as a Python number (a constant) or as a traced node (a parameter)."""
    return value if isinstance(value, Node) else _k(value)


def gelu(x: Node, approximate: str) -> Node:
    """F.gelu: x * 0.5 * (1 + erf(x / sqrt(2))), or with approximate="tanh"
    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))."""
    x = ir.cast(x, F32)
    if approximate == "tanh":
        cube = _mul(_mul(x, x), x)
        inner = _mul(_k(_GELU_TANH_BETA), _add(x, _mul(_k(_GELU_TANH_KAPPA), cube)))
        return _mul(_mul(_k(0.5), x), _add(_k(1.0), ir.unary("tanh", inner)))
    return _mul(_mul(x, _k(0.5)), _add(_k(1.0), ir.unary("erf", _mul(x, _k(_SQRT1_2)))))


def silu(x: Node) -> Node:
    """F.silu: x / (1 + exp(-x))."""
    x = ir.cast(x, F32)
    return ir.binary("div", x, _add(_k(1.0), ir.unary("exp", ir.unary("neg", x))))


def softplus(x: Node, beta: Node | None, threshold: Node) -> Node:
    """F.softplus: x where x * beta > threshold (linear there), else log1p(exp(x * beta)) / beta.
    beta None means 1 (no multiply and no divide, which is exact)."""
    x = ir.cast(x, F32)
    scaled = x if beta is None else _mul(x, beta)
    soft = ir.unary("log1p", ir.unary("exp", scaled))
    if beta is not None:
        soft = ir.binary("div", soft, beta)
    return ir.where(ir.binary("gt", scaled, threshold), x, soft)


# torch's SELU constants (Klambauer et al.), as torch spells them; its kernel multiplies them in double.
SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _expm1(x: Node) -> Node:
    """exp(x) - 1 without the cancellation near 0 (torch's elu kernels call expm1, which the IR has not):
    tanh(x / 2) * (exp(x) + 1), a product of two well-conditioned factors, so a few ulp for every x,
    -1 at -inf and inf at inf; its derivative is exp(x)."""
    return _mul(ir.unary("tanh", _mul(x, _k(0.5))), _add(ir.unary("exp", x), _k(1.0)))


def elu(x: Node, alpha: float | Node, scale: float = 1.0, input_scale: float | Node = 1.0) -> Node:
    """torch's elu kernel, which also computes selu and celu: expm1(x * input_scale) * (alpha * scale)
    where x <= 0, else x * scale. The x <= 0 test is torch's, so the gradient at 0 is the exponential
    side's (alpha * scale * input_scale) and at NaN the linear side's (scale), as torch.autograd gives.
    A traced alpha / input_scale is a node; scales of 1 are left out (multiplying by 1 is exact)."""
    x = ir.cast(x, F32)
    scaled = x if isinstance(input_scale, float) and input_scale == 1.0 else _mul(x, _coef(input_scale))
    if isinstance(alpha, Node):
        alpha = ir.cast(alpha, F32)
        negcoef = alpha if scale == 1.0 else _mul(alpha, _k(scale))
    else:
        negcoef = None if alpha * scale == 1.0 else _k(alpha * scale)  # torch multiplies the two in double too
    negative = _expm1(scaled) if negcoef is None else _mul(_expm1(scaled), negcoef)
    positive = x if scale == 1.0 else _mul(x, _k(scale))
    return ir.where(ir.binary("le", x, _k(0.0)), negative, positive)


def celu(x: Node, alpha: float | Node) -> Node:
    """F.celu: elu with input_scale 1 / alpha (a reciprocal computed once, as torch does)."""
    inverse = _div(_k(1.0), ir.cast(alpha, F32)) if isinstance(alpha, Node) else 1.0 / alpha
    return elu(x, alpha, 1.0, inverse)


def selu(x: Node) -> Node:
    """F.selu: elu with torch's fixed alpha and scale."""
    return elu(x, SELU_ALPHA, SELU_SCALE)


def leaky_relu(x: Node, negative_slope: float | Node) -> Node:
    """F.leaky_relu: x where x > 0, else x * negative_slope; torch's gradient at 0 is negative_slope."""
    x = ir.cast(x, F32)
    return ir.where(ir.binary("gt", x, _k(0.0)), x, _mul(x, ir.cast(_coef(negative_slope), F32)))


def hardtanh(x: Node, min_val: float, max_val: float) -> Node:
    """F.hardtanh (constant bounds, min_val <= max_val): clamp(x, min_val, max_val), with torch's gradient,
    which is 0 at the bounds themselves (clamp's would be 1, or 0.5 through minimum / maximum). NaN passes."""
    x = ir.cast(x, F32)
    lo, hi = _k(min_val), _k(max_val)
    return ir.where(ir.binary("le", x, lo), lo, ir.where(ir.binary("ge", x, hi), hi, x))


def relu6(x: Node) -> Node:
    """F.relu6: hardtanh(x, 0, 6) in torch too, so its gradient is 0 at 0 and at 6."""
    return hardtanh(x, 0.0, 6.0)


def hardsigmoid(x: Node) -> Node:
    """F.hardsigmoid: min(max(x + 3, 0), 6) / 6; torch's gradient is 1/6 strictly inside (-3, 3), 0 at
    and beyond +-3 (a NaN's gradient here is 1/6 where torch's is 0)."""
    x = ir.cast(x, F32)
    inside = _div(_add(x, _k(3.0)), _k(6.0))
    return ir.where(ir.binary("le", x, _k(-3.0)), _k(0.0), ir.where(ir.binary("ge", x, _k(3.0)), _k(1.0), inside))


def hardswish(x: Node) -> Node:
    """F.hardswish: x * min(max(x + 3, 0), 6) / 6, each piece computed as torch computes it (so -0.0 below
    -3 and NaN at -inf, as torch gives); torch's gradient is 0 for x <= -3, x / 3 + 1/2 inside, 1 for x >= 3."""
    x = ir.cast(x, F32)
    six = _k(6.0)
    inside = _div(_mul(x, _add(x, _k(3.0))), six)
    return ir.where(ir.binary("le", x, _k(-3.0)), _mul(x, _k(0.0)),
                    ir.where(ir.binary("lt", x, _k(3.0)), inside, _div(_mul(x, six), six)))


def mish(x: Node) -> Node:
    """F.mish: x * tanh(log1p(exp(x))). The log1p(exp(x)) is softplus's, linear past 20: tanh is 1 there
    either way, but the derivative of log1p(exp(x)) would be inf / inf once exp overflows."""
    x = ir.cast(x, F32)
    return _mul(x, ir.unary("tanh", softplus(x, None, _k(20.0))))


def logsigmoid(x: Node) -> Node:
    """F.logsigmoid, torch's stable form min(x, 0) - log1p(exp(-|x|)), with min and |x| written as torch's
    backward reads them (x < 0 or not), so the gradient at 0 is 1/2 and never exp overflows."""
    x = ir.cast(x, F32)
    negative = ir.binary("lt", x, _k(0.0))
    low = ir.where(negative, x, _k(0.0))
    z = ir.unary("exp", ir.where(negative, x, ir.unary("neg", x)))  # exp(-|x|)
    return ir.binary("sub", low, ir.unary("log1p", z))


def softsign(x: Node) -> Node:
    """F.softsign: x / (|x| + 1), torch's own composition (gradient through abs: sign(0) = 0)."""
    x = ir.cast(x, F32)
    return _div(x, _add(ir.unary("abs", x), _k(1.0)))


def round_decimals(x: Node, decimals: int) -> Node:
    """torch.round(x, decimals=d): rint(x * 10^d) / 10^d, or rint(x / 10^-d) * 10^-d for d < 0."""
    if decimals == 0:
        return ir.unary("round", x)
    if not x.dtype.is_float:
        raise ir.IRTypeError(f"round(decimals={decimals}) needs a float value, got {x.dtype.value}")
    scale = _k(10.0 ** abs(decimals))
    if decimals > 0:
        return ir.binary("div", ir.unary("round", _mul(x, scale)), scale)
    return _mul(ir.unary("round", ir.binary("div", x, scale)), scale)


def _int_operand(x: Node, what: str) -> Node:
    if x.dtype.is_float:
        raise ir.IRTypeError(f"{what} needs an integer value, got {x.dtype.value}; multiply or divide by a power of two")
    return ir.cast(x, DType.INT64) if x.dtype is DType.BOOL else x  # torch: bool << int is int64


def shift_left(x: Node, count: int) -> Node:
    """x << count (constant count), torch's way: 0 for a count outside [0, bits); otherwise
    x * 2^count in wrapping integer arithmetic, which is exactly the shifted bits."""
    x = _int_operand(x, "<<")
    bits = 64 if x.dtype is DType.INT64 else 32
    if count == 0:
        return x
    if not 0 <= count < bits:
        return ir.const(0, x.dtype)
    factor = (1 << count) - (1 << bits) if count == bits - 1 else 1 << count  # 2^(bits-1) wraps to the minimum
    return ir.binary("mul", x, ir.const(factor, x.dtype))


def shift_right(x: Node, count: int) -> Node:
    """x >> count (constant count), arithmetic like torch's: floor(x / 2^count); a count outside
    [0, bits - 1) leaves only the sign (0 or -1)."""
    x = _int_operand(x, ">>")
    bits = 64 if x.dtype is DType.INT64 else 32
    if count == 0:
        return x
    if 0 <= count < bits - 1:
        return ir.binary("floordiv", x, ir.const(1 << count, x.dtype))
    return ir.where(ir.binary("lt", x, ir.const(0, x.dtype)), ir.const(-1, x.dtype), ir.const(0, x.dtype))
