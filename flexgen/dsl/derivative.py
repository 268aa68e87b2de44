"""Symbolic derivatives of score_mod expressions, as IR the backward kernel can compile.

`grad_score(e)` is d e / d score. `grad_buffers(e)` gives, for every distinct
load of a float buffer in `e`, the partial derivative of `e` with respect to
the loaded element. The backward kernel does, per (b, h, q, kv) element,

    grad_buffer[indices of that load] += dout * partial      (atomically)

for each (load, partial) pair. A buffer read at two different index
expressions (`bias[q_idx]` and `bias[kv_idx]`) is two load nodes, each with its
own partial; when both happen to hit the same element, the two atomic adds sum
to the total derivative, which is exactly right. A load used in several places
is one node (the IR is structural), and its partial already sums those uses.

Derivatives follow torch autograd's conventions at the kinks, so they match
`torch.autograd.grad` on `evaluate()`:

* abs: sign(x), with sign(0) = 0;
* minimum/maximum: the chosen side gets the gradient, a tie splits it 0.5/0.5,
  and a NaN on either side passes it to both;
* pow(a, b): d/da is 0 where b == 0, d/db is 0 where a == 0 and b >= 0;
* floor division, floor / ceil / round / trunc, sign: 0; remainder: d/da = 1, d/db = -floor(a / b);
  fmod: d/da = 1, d/db = -trunc(a / b);
* rounding to float16 / bfloat16: 1 (torch also rounds the gradient itself to 16 bits);
* where: routed to the branch taken; comparisons, bools, ints and casts: 0.
"""
from __future__ import annotations

import math
from typing import Collection

from . import inline_asm, ir
from .errors import UnsupportedOperationError
from .ir import DType, Node, postorder
from .printer import pretty
from .simplify import simplify

F32 = DType.FLOAT32
_LN2 = math.log(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def grad_score(root: Node) -> Node:
    """d root / d score, a FLOAT32 expression over the same inputs as `root`."""
    return grad_wrt(root, ir.input_("score"))


def grad_buffers(root: Node, drop_zero: bool = True, names: Collection[str] | None = None) -> list[tuple[Node, Node]]:
    """(load node, d root / d loaded value) for each distinct float-buffer load in `root` (of the buffers in
    `names`, where given), in first-use order. Loads whose partial simplifies to the constant 0 are left out
    unless `drop_zero` is False (their buffers then get no gradient contributions)."""
    out = []
    for n in postorder(root):
        if n.op == "load" and n.dtype is F32 and (names is None or n.attr.name in names):
            d = grad_wrt(root, n)
            if drop_zero and d.op == "const" and d.attr == 0.0:
                continue
            out.append((n, d))
    return out


def grad_wrt(root: Node, var: Node) -> Node:
    """d root / d var, treating `var` (an input or a load node) as an independent variable."""
    if not root.dtype.is_float:
        return ir.const(0.0)
    d = _forward(root, var)
    return simplify(d) if d is not None else ir.const(0.0)


# ---------------------------------------------------------------- forward-mode differentiation
# Each node's derivative is built from its operands' derivatives; None stands
# for a structural zero, so unrelated subtrees add nothing to the result.


def _forward(root: Node, var: Node) -> Node | None:
    d: dict[str, Node | None] = {}
    for n in postorder(root):
        if n == var:
            d[n.digest] = ir.const(1.0)
        elif n.dtype is not F32 or n.op in ("const", "param", "input", "load", "cast"):
            d[n.digest] = None  # ints, bools, leaves other than var; casts lose the gradient
        else:
            d[n.digest] = _rule(n, [d[a.digest] for a in n.args])
    return d[root.digest]


def _k(v: float) -> Node:
    return ir.const(float(v))


def _add(x: Node | None, y: Node | None) -> Node | None:
    if x is None:
        return y
    if y is None:
        return x
    return ir.binary("add", x, y)


def _mul(x: Node | None, y: Node) -> Node | None:
    return None if x is None else ir.binary("mul", x, y)


def _neg(x: Node | None) -> Node | None:
    return None if x is None else ir.unary("neg", x)


def _sign(x: Node) -> Node:
    pos = ir.cast(ir.binary("gt", x, _k(0.0)), F32)
    neg = ir.cast(ir.binary("lt", x, _k(0.0)), F32)
    return ir.binary("sub", pos, neg)


def _pick_weight(a: Node, b: Node, lose_op: str) -> Node:
    """torch's min/max backward weight for `a`: 0.5 on a tie, 0 where `a lose_op b`, else 1."""
    lose = ir.binary(lose_op, a, b)
    return ir.where(ir.binary("eq", a, b), _k(0.5), ir.where(lose, _k(0.0), _k(1.0)))


_UNARY_LOCAL = {
    # d op(a) / d a, from the operand `a` and the result `f`
    "exp": lambda a, f: f,
    "exp2": lambda a, f: ir.binary("mul", f, _k(_LN2)),
    "log": lambda a, f: ir.binary("div", _k(1.0), a),
    "log2": lambda a, f: ir.binary("div", _k(1.0), ir.binary("mul", a, _k(_LN2))),
    "sqrt": lambda a, f: ir.binary("div", _k(1.0), ir.binary("mul", _k(2.0), f)),
    "rsqrt": lambda a, f: ir.binary("mul", _k(-0.5), ir.binary("mul", ir.binary("mul", f, f), f)),
    "tanh": lambda a, f: ir.binary("sub", _k(1.0), ir.binary("mul", f, f)),
    "sigmoid": lambda a, f: ir.binary("mul", f, ir.binary("sub", _k(1.0), f)),
    "sin": lambda a, f: ir.unary("cos", a),
    "cos": lambda a, f: ir.unary("neg", ir.unary("sin", a)),
    "tan": lambda a, f: ir.binary("add", _k(1.0), ir.binary("mul", f, f)),
    "erf": lambda a, f: ir.binary(
        "mul", _k(_TWO_OVER_SQRT_PI), ir.unary("exp", ir.unary("neg", ir.binary("mul", a, a)))
    ),
    "abs": lambda a, f: _sign(a),
    "log1p": lambda a, f: ir.binary("div", _k(1.0), ir.binary("add", a, _k(1.0))),
    "atan": lambda a, f: ir.binary("div", _k(1.0), ir.binary("add", ir.binary("mul", a, a), _k(1.0))),
}
# Piecewise constant: zero almost everywhere, and torch's gradient is zero everywhere.
_FLAT = ("sign", "floor", "ceil", "round", "trunc")
# Rounding to float16 / bfloat16: torch passes the gradient straight through (x.half()'s backward
# is grad.float(); torch rounds that gradient to the 16-bit type on the way, flexgen keeps float32).
_STRAIGHT_THROUGH = ("round_to_fp16", "round_to_bf16")


def _rule(n: Node, ds: list[Node | None]) -> Node | None:
    op = n.op
    if all(x is None for x in ds):
        return None
    if op == inline_asm.OP:
        raise UnsupportedOperationError(inline_asm.NO_DERIVATIVE.format(pretty(n, 160)))
    if op == "where":
        c = n.args[0]
        _, da, db = ds
        return ir.where(c, da if da is not None else _k(0.0), db if db is not None else _k(0.0))
    if op == "neg":
        return _neg(ds[0])
    if op in _FLAT:
        return None
    if op in _STRAIGHT_THROUGH:
        return ds[0]
    if op in _UNARY_LOCAL:
        return _mul(ds[0], _UNARY_LOCAL[op](n.args[0], n))
    a, b = n.args
    da, db = ds
    if op == "add":
        return _add(da, db)
    if op == "sub":
        return _add(da, _neg(db))
    if op == "mul":
        return _add(_mul(da, b), _mul(db, a))
    if op == "div":  # d/db = -(a / b) / b, as torch computes it
        return _add(ir.binary("div", da, b) if da is not None else None,
                    _mul(db, ir.unary("neg", ir.binary("div", n, b))))
    if op == "pow":
        zero = _k(0.0)
        d_base = ir.where(
            ir.binary("eq", b, zero), zero, ir.binary("mul", b, ir.binary("pow", a, ir.binary("sub", b, _k(1.0))))
        )
        d_exp = ir.where(
            ir.binary("and", ir.binary("eq", a, zero), ir.binary("ge", b, zero)), zero, ir.binary("mul", n, ir.unary("log", a))
        )
        return _add(_mul(da, d_base), _mul(db, d_exp))
    if op in ("min", "max"):
        # minimum: `a` loses where a > b; maximum: where a < b (torch's masked_fill)
        lose_a, lose_b = ("gt", "lt") if op == "min" else ("lt", "gt")
        return _add(_mul(da, _pick_weight(a, b, lose_a)), _mul(db, _pick_weight(a, b, lose_b)))
    if op == "mod":  # remainder(a, b) = a - floor(a / b) * b
        return _add(da, _mul(db, ir.unary("neg", ir.binary("floordiv", a, b))))
    if op == "fmod":  # fmod(a, b) = a - trunc(a / b) * b
        return _add(da, _mul(db, ir.unary("neg", ir.unary("trunc", ir.binary("div", a, b)))))
    if op == "floordiv":
        return None
    raise NotImplementedError(f"no derivative rule for op {op!r}")
