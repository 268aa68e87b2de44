"""Recognise logit soft-capping: score_mods of the form `outer * tanh(inner * score)`.

Gemma 2 and Grok write it as `cap * tanh(score / cap)`. With outer and inner free of score and the positions
(they may depend on b, h, parameters and buffers read at b and h), a forward can take tanh of the scaled raw
score and leave the outer factor to the exponential's multiply, and since tanh is odd and increasing, the row
maximum of outer * tanh(u) is |outer| * max tanh(sign(outer) u): one comparison per score, no product.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import ir
from .affine import PER_HEAD_INPUTS
from .ir import DType, Node, inputs_of
from .simplify import simplify


@dataclass(frozen=True)
class SoftcapScore:
    """score_mod(score, b, h, q_idx, kv_idx) == outer * tanh(inner * score), both float32 IR nodes that depend on
    b, h, params and buffer loads at b and h only."""

    outer: Node
    inner: Node


def softcap_score(expr: Node) -> SoftcapScore | None:
    outer, core = _scaled(expr)
    if core is None or core.op != "tanh":
        return None
    inner, arg = _scaled(core.args[0])
    if arg is None or arg != ir.input_("score"):
        return None
    return SoftcapScore(outer=simplify(outer), inner=simplify(inner))


def _free(n: Node) -> bool:
    return n.dtype is DType.FLOAT32 and inputs_of(n) <= PER_HEAD_INPUTS


def _scaled(n: Node) -> tuple[Node, Node | None]:
    """(factor, rest) with n == factor * rest, factor free: n itself with factor 1 unless n is a product or a
    quotient with a free operand (the divisor of a quotient). rest is None where n is free as a whole."""
    one = ir.const(1.0)
    if _free(n):
        return n, None
    if n.op == "mul" and n.dtype is DType.FLOAT32:
        a, b = n.args
        if _free(a) and not _free(b):
            return a, b
        if _free(b) and not _free(a):
            return b, a
    if n.op == "div" and _free(n.args[1]) and not _free(n.args[0]):
        return ir.binary("div", one, n.args[1]), n.args[0]
    return one, n
