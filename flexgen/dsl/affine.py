"""Recognise score_mods that are affine in the positions: `score + A*kv_idx + B*q_idx + C`.

ALiBi and its relatives (a per-head slope times kv_idx - q_idx, a per-head bias) have this shape; the
kernel generator then computes the score as `score + A*kv + B*q + C` in float32 with A, B, C evaluated
once per (b, h), instead of running the expression per element.

The analysis maps every node to a linear form. Float nodes get (score, q, kv, const) coefficients,
each an IR node or None for zero. Integer nodes get Python ints (q, kv, const). Only small integer
constants may appear there: int arithmetic wraps in the kernel, the float decomposition would not.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .ir import DType, Node, postorder
from .simplify import simplify

MAX_INT_COEF = 2**8  # |q/kv coefficient| of an integer form, and of an integer multiplier
MAX_INT_ATOM = 2**16  # |integer constant| allowed as a term of an integer form
MAX_INT_CONST = 2**24  # |combined integer constant|: exact in float32, far from int32's limits
PER_HEAD_INPUTS = frozenset({"b", "h"})  # what a coefficient may read: it is computed once per (b, h)


@dataclass(frozen=True)
class AffineScore:
    """score_mod(score, b, h, q_idx, kv_idx) == score + kv_coef * kv_idx + q_coef * q_idx + bias,
    the three coefficients float32 IR nodes that depend on b, h, params and buffer loads only."""

    kv_coef: Node
    q_coef: Node
    bias: Node


FloatForm = tuple  # (score, q, kv, const): Node | None each
IntForm = tuple  # (q, kv, const): ints


def affine_score(expr: Node) -> AffineScore | None:
    """The decomposition of a score_mod that is exactly `score + A*kv_idx + B*q_idx + C` in real
    arithmetic (A, B, C free of score and the positions), or None."""
    if expr.dtype is not DType.FLOAT32:
        return None
    inputs: dict[str, frozenset] = {}
    forms: dict[str, FloatForm | IntForm | None] = {}  # None: not linear
    for n in postorder(expr):  # iterative, each shared node once
        used = frozenset({n.attr}) if n.op == "input" else frozenset().union(*(inputs[a.digest] for a in n.args))
        inputs[n.digest] = used
        if n.dtype is DType.FLOAT32 and used <= PER_HEAD_INPUTS:
            forms[n.digest] = (None, None, None, n)  # evaluated as is, once per (b, h)
        elif n.dtype.is_int:
            forms[n.digest] = _int_form(n, [forms[a.digest] for a in n.args])
        elif n.dtype is DType.FLOAT32:
            forms[n.digest] = _float_form(n, [forms[a.digest] for a in n.args])
        else:
            forms[n.digest] = None
    form = forms[expr.digest]
    if form is None or form[0] is None or simplify(form[0]) != ir.const(1.0):
        return None
    zero = ir.const(0.0)
    q, kv, c = (simplify(x) if x is not None else zero for x in form[1:])
    return AffineScore(kv_coef=kv, q_coef=q, bias=c)


def _int_form(n: Node, args: list) -> IntForm | None:
    if any(a is None for a in args):
        return None
    if n.op == "input":
        form = {"q_idx": (1, 0, 0), "kv_idx": (0, 1, 0)}.get(n.attr)  # b, h: int atoms, refused
    elif n.op == "const":
        form = (0, 0, n.attr) if abs(n.attr) <= MAX_INT_ATOM else None
    elif n.op == "cast":  # only widening: int32 -> int64 keeps every value
        form = args[0] if n.args[0].dtype is DType.INT32 and n.dtype is DType.INT64 else None
    elif n.op == "neg":
        form = tuple(-x for x in args[0])
    elif n.op in ("add", "sub"):
        sign = 1 if n.op == "add" else -1
        form = tuple(x + sign * y for x, y in zip(*args))
    elif n.op == "mul":
        a, b = args
        if a[:2] != (0, 0):
            a, b = b, a
        form = tuple(a[2] * y for y in b) if a[:2] == (0, 0) and abs(a[2]) <= MAX_INT_COEF else None
    else:
        form = None
    if form is None or max(abs(form[0]), abs(form[1])) > MAX_INT_COEF or abs(form[2]) > MAX_INT_CONST:
        return None
    return form


def _float_form(n: Node, args: list) -> FloatForm | None:
    if any(a is None for a in args):
        return None
    if n.op == "input":  # the only float input left (b, h-only nodes are free)
        return (ir.const(1.0), None, None, None)
    if n.op == "cast":
        if not n.args[0].dtype.is_int:
            return None
        return (None,) + tuple(ir.const(float(x)) if x else None for x in args[0])
    if n.op == "neg":
        return tuple(_op("neg", x) for x in args[0])
    if n.op in ("add", "sub"):
        return tuple(_op(n.op, x, y) for x, y in zip(*args))
    if n.op in ("mul", "div"):
        a, b = args
        if n.op == "mul" and not _is_free(b):
            a, b = b, a
        if not _is_free(b):  # a product or quotient of two position-dependent terms
            return None
        return tuple(None if x is None else ir.binary(n.op, x, b[3]) for x in a)
    return None


def _is_free(form: FloatForm) -> bool:
    return form[:3] == (None, None, None) and form[3] is not None


def _op(op: str, x: Node | None, y: Node | None = None) -> Node | None:
    """add / sub / neg with None standing for zero."""
    if op == "neg":
        return None if x is None else ir.unary("neg", x)
    if y is None:
        return x
    if x is None:
        return y if op == "add" else ir.unary("neg", y)
    return ir.binary(op, x, y)
