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
