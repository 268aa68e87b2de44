"""Value-preserving simplification of IR expressions: constant folding, algebraic
identities and common-subexpression sharing.

Every rewrite here is exact under the semantics of `evaluate()`:

* integers wrap like int32/int64 tensors do, so only identities that hold in
  modular arithmetic are used (x+0, x*1, x*0, x-x, reassociating constants);
* float identities must also hold for NaN, infinities and signed zeros, which
  rules out x*0 -> 0, x-x -> 0, x+0.0 -> x (-0.0 + 0.0 is +0.0) and x == x;
* a float operation on constants is folded to its float64 value, so float64
  evaluation (the ground truth) does not change at all, and only when float32
  evaluation (what kernels run) agrees up to a few ulps: float32 then reads the
  correctly rounded constant. Folds whose precisions disagree (float32 overflow,
  inf * 0, a signed zero) are left alone, as are int/bool results that differ.

Rewrites may drop subexpressions (x*0 for ints, False and x); a dropped
subexpression can no longer fail (an int division by zero, say).
"""
from __future__ import annotations

import math

import torch

from .evaluate import evaluate
from .ir import DType, Node, postorder

_COMMUTATIVE_INT = ("add", "mul", "min", "max", "eq", "ne")
_COMMUTATIVE_ANY = ("add", "mul", "and", "or", "xor", "eq", "ne")
_FLIP = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE_CMP = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le", "eq": "ne", "ne": "eq"}
_INT_BITS = {DType.INT32: 32, DType.INT64: 64}
_MAX_PASSES = 8


# ---------------------------------------------------------------- public API


def simplify(root: Node) -> Node:
    """An expression with the same value as `root` everywhere, usually smaller;
    structurally equal subtrees of the result are shared Python objects."""
    for _ in range(_MAX_PASSES):
        new = _pass(root)
        if new == root:
            break
        root = new
    return cse(root)


def cse(root: Node) -> Node:
    """Rebuild `root` so that structurally equal subtrees are one Python object."""
    canon: dict[str, Node] = {}
    for n in postorder(root):
        args = tuple(canon[a.digest] for a in n.args)
        if all(x is y for x, y in zip(args, n.args)):
            canon[n.digest] = n
        else:
            canon[n.digest] = Node(n.op, n.dtype, args, n.attr)
    return canon[root.digest]


def count_nodes(root: Node) -> int:
    """Number of distinct (structurally different) nodes in the DAG."""
    return sum(1 for _ in postorder(root))


# ---------------------------------------------------------------- one bottom-up pass


def _pass(root: Node) -> Node:
    memo: dict[str, Node] = {}
    for n in postorder(root):
        args = tuple(memo[a.digest] for a in n.args)
        same = all(x is y for x, y in zip(args, n.args))
        memo[n.digest] = _settle(n if same else Node(n.op, n.dtype, args, n.attr))
    return memo[root.digest]


def _mk(op: str, dtype: DType, args: tuple[Node, ...], attr=None) -> Node:
    """Build a node from already simplified operands, rewriting it to a fixpoint."""
    return _settle(Node(op, dtype, args, attr))


def _settle(node: Node) -> Node:
    for _ in range(16):  # rules shrink or canonicalize; the bound is a guard
        new = _rewrite(node)
        if new is None or new == node:
            return node
        node = new
    return node


def _k(value, dtype: DType) -> Node:
    if dtype.is_int:
        value = _wrap(int(value), dtype)
    return Node("const", dtype, (), _const_attr(value, dtype))


def _const_attr(value, dtype: DType):
    if dtype is DType.BOOL:
        return bool(value)
    if dtype.is_int:
        return int(value)
    return float(value)


def _wrap(v: int, dtype: DType) -> int:
    bits = _INT_BITS[dtype]
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >= 1 << (bits - 1) else v


def _is_const(n: Node, value=None) -> bool:
    if n.op != "const":
        return False
    if value is None:
        return True
    if isinstance(value, float) and value == 0.0:
        # distinguish the signed zeros: x + (-0.0) is x, x + 0.0 is not
        return n.attr == 0.0 and math.copysign(1.0, n.attr) == math.copysign(1.0, value)
    return n.attr == value and type(n.attr) is type(value)


# ---------------------------------------------------------------- constant folding


def _fold(node: Node) -> Node | None:
    """Evaluate an operation on constants the way evaluate() would, or None if unsafe."""
    try:
        v32 = evaluate(node, {}, float_dtype=torch.float32).item()
        v64 = evaluate(node, {}, float_dtype=torch.float64).item()
    except (RuntimeError, ZeroDivisionError, OverflowError, ValueError):
        return None  # e.g. an integer division by zero: leave it to fail at run time
    if node.dtype is not DType.FLOAT32:
        # an int/bool result may still depend on floats below it (a comparison, a cast)
        return _k(v32, node.dtype) if v32 == v64 else None
    if math.isnan(v32) or math.isnan(v64):
        return _k(math.nan, DType.FLOAT32) if math.isnan(v32) and math.isnan(v64) else None
    f = _to_f32(v64)  # what a float32 kernel reads for the stored constant
    if math.copysign(1, f) != math.copysign(1, v32):
        return None  # +0.0 vs -0.0 (or inf signs): not a rounding difference
    # float64 keeps its exact value; float32 gets the correctly rounded constant, at most
    # a few ulps from what float32 arithmetic on the operands gives
    if f == v32 or (math.isfinite(f) and math.isfinite(v32) and abs(f - v32) <= 1e-5 * abs(v64)):
        return _k(v64, DType.FLOAT32)
    return None  # the precisions disagree (float32 overflow, say): leave it to run time


def _to_f32(v: float) -> float:
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


# ---------------------------------------------------------------- rewrite rules


def _rewrite(n: Node) -> Node | None:
    op, args = n.op, n.args
    if op in ("const", "input", "param", "load", "inline_asm"):  # (user PTX is opaque, and runs only on a GPU)
        return None
    if all(a.op == "const" for a in args):
        return _fold(n)
    if op == "cast":
        return _rewrite_cast(n)
    if op == "where":
        return _rewrite_where(n)
    if op in ("neg", "abs", "not"):
        return _rewrite_unary(n)
    if op in _IDEMPOTENT:
        return _rewrite_idempotent(n)
    if len(args) != 2:
        return None
    a, b = args
    # constants to the right, so later rules (and CSE) see one shape
    if a.op == "const" and b.op != "const":
        if op in _COMMUTATIVE_ANY or (op in _COMMUTATIVE_INT and a.dtype.is_int):
            return _mk(op, n.dtype, (b, a))
        if op in _FLIP:
            return _mk(_FLIP[op], n.dtype, (b, a))
    if op in ("and", "or", "xor"):
        return _rewrite_logic(n, a, b)
    if op in _FLIP:
        return _rewrite_compare(n, a, b)
    if a.dtype.is_int:
        return _rewrite_int(n, a, b)
    if a.dtype.is_float:
        return _rewrite_float(n, a, b)
    return None


def _rewrite_cast(n: Node) -> Node | None:
    (x,) = n.args
    if x.dtype is n.dtype:
        return x
    # cast(cast(x, mid), out) == cast(x, out) when x -> mid loses nothing
    if x.op == "cast":
        inner = x.args[0]
        lossless = inner.dtype is DType.BOOL or (inner.dtype is DType.INT32 and x.dtype is DType.INT64)
        if lossless:
            return inner if inner.dtype is n.dtype else _mk("cast", n.dtype, (inner,), n.dtype)
    return None


def _rewrite_where(n: Node) -> Node | None:
    c, a, b = n.args
    if c.op == "const":
        return a if c.attr else b
    if a == b:
        return a
    if c.op == "not":
        return _mk("where", n.dtype, (c.args[0], b, a))
    if n.dtype is DType.BOOL and a.op == "const" and b.op == "const":
        return c if a.attr else _mk("not", DType.BOOL, (c,))
    return None


def _rewrite_unary(n: Node) -> Node | None:
    (x,) = n.args
    if n.op == "not":
        if x.op == "not":
            return x.args[0]
        # negated comparison: exact for ints and bools, not for floats (NaN)
        if x.op in _NEGATE_CMP and not x.args[0].dtype.is_float:
            return _mk(_NEGATE_CMP[x.op], DType.BOOL, x.args)
        return None
    if n.op == "neg":
        if x.op == "neg":
            return x.args[0]
        if x.op == "sub" and x.dtype.is_int:  # -(a-b) == b-a; floats differ in the sign of zero
            return _mk("sub", n.dtype, (x.args[1], x.args[0]))
        return None
    if n.op == "abs" and x.op in ("abs", "neg"):
        return _mk("abs", n.dtype, (x.args[0],)) if x.op == "neg" else x
    return None


# op(op(x)) == op(x); a rounding to an integral value also leaves any other one's result alone
# (floor(round(x)) == round(x), -0.0, infinities and NaN included).
_INTEGRAL = ("floor", "ceil", "round", "trunc")
_IDEMPOTENT = _INTEGRAL + ("sign", "round_to_fp16", "round_to_bf16")


def _rewrite_idempotent(n: Node) -> Node | None:
    (x,) = n.args
    if x.op == n.op or (n.op in _INTEGRAL and x.op in _INTEGRAL):
        return x
    return None


def _rewrite_logic(n: Node, a: Node, b: Node) -> Node | None:
    op = n.op
    if b.op == "const":
        if op == "and":
            return a if b.attr else b
        if op == "or":
            return b if b.attr else a
        return _mk("not", DType.BOOL, (a,)) if b.attr else a  # xor
    if a == b:
        return _k(False, DType.BOOL) if op == "xor" else a
    if _complementary(a, b):
        return _k(op != "and", DType.BOOL)  # x and not x / x or not x / x xor not x
    return None


def _complementary(a: Node, b: Node) -> bool:
    """a == not b for every input: `x` vs `not x`, or `p < q` vs `p >= q` / `q <= p` on ints."""
    if (a.op == "not" and a.args[0] == b) or (b.op == "not" and b.args[0] == a):
        return True
    if a.op in _NEGATE_CMP and b.op in _NEGATE_CMP and not a.args[0].dtype.is_float:
        neg = _NEGATE_CMP[a.op]
        return (b.op == neg and b.args == a.args) or (b.op == _FLIP[neg] and b.args == a.args[::-1])
    return False


def _rewrite_compare(n: Node, a: Node, b: Node) -> Node | None:
    op = n.op
    if a.dtype is DType.BOOL and b.op == "const" and op in ("eq", "ne"):  # x == True, x != False, ...
        keep = (op == "eq") == b.attr
        return a if keep else _mk("not", DType.BOOL, (a,))
    if a == b and not a.dtype.is_float:
        return _k(op in ("le", "ge", "eq"), DType.BOOL)
    return None


def _int_offset(n: Node) -> tuple[Node, int] | None:
    """n == base + offset (modular) for `x + c` and `x - c`."""
    if n.op == "add" and n.args[1].op == "const":
        return n.args[0], n.args[1].attr
    if n.op == "sub" and n.args[1].op == "const":
        return n.args[0], -n.args[1].attr
    return None


def _rewrite_int(n: Node, a: Node, b: Node) -> Node | None:
    op, t = n.op, n.dtype
    zero = _is_const(b, 0)
    if op in ("add", "sub"):
        if zero:
            return a
        if a == b and op == "sub":
            return _k(0, t)
        if op == "sub" and _is_const(a, 0):
            return _mk("neg", t, (b,))
        if b.op == "neg":  # a + (-x) == a - x and a - (-x) == a + x
            return _mk("sub" if op == "add" else "add", t, (a, b.args[0]))
        if b.op == "const":  # (x + c1) + c2 == x + (c1 + c2) in modular arithmetic
            inner = _int_offset(a)
            if inner is not None:
                base, c1 = inner
                total = _wrap(c1 + (b.attr if op == "add" else -b.attr), t)
                if total == 0:
                    return base
                if total < 0 and total != -(1 << (_INT_BITS[t] - 1)):
                    return _mk("sub", t, (base, _k(-total, t)))
                return _mk("add", t, (base, _k(total, t)))
        return None
    if op == "mul":
        if zero:
            return b
        if _is_const(b, 1):
            return a
        if _is_const(b, -1):
            return _mk("neg", t, (a,))
        if b.op == "const" and a.op == "mul" and a.args[1].op == "const":
            return _mk("mul", t, (a.args[0], _k(a.args[1].attr * b.attr, t)))
        return None
    if op == "floordiv" and _is_const(b, 1):
        return a
    if op in ("mod", "fmod") and (_is_const(b, 1) or _is_const(b, -1)):
        return _k(0, t)
    if op in ("min", "max") and a == b:
        return a
    return None


def _rewrite_float(n: Node, a: Node, b: Node) -> Node | None:
    op, t = n.op, n.dtype
    if op == "add":
        if _is_const(b, -0.0) or (_is_const(b, 0.0) and _never_negative_zero(a)):
            return a
        if b.op == "neg":
            return _mk("sub", t, (a, b.args[0]))  # IEEE: a - x is a + (-x)
        return None
    if op == "sub":
        if _is_const(b, 0.0):
            return a
        if b.op == "neg":
            return _mk("add", t, (a, b.args[0]))
        return None
    if op == "mul":
        if _is_const(b, 1.0):
            return a
        if _is_const(b, -1.0):
            return _mk("neg", t, (a,))
        return None
    if op == "div":
        if _is_const(b, 1.0):
            return a
        if _is_const(b, -1.0):
            return _mk("neg", t, (a,))
        return None
    if op == "pow":
        if _is_const(b, 1.0):
            return a
        if b.op == "const" and b.attr == 0.0:
            return _k(1.0, t)  # pow(x, +-0) is 1 even for NaN x
        return None
    if op in ("min", "max") and a == b:
        return a
    return None


def _never_negative_zero(n: Node) -> bool:
    """True where `n` can never be -0.0 (so n + 0.0 == n bit for bit)."""
    if n.op == "cast":
        return not n.args[0].dtype.is_float
    if n.op == "const":
        return not (n.attr == 0.0 and math.copysign(1.0, n.attr) < 0)
    return n.op in ("abs", "exp", "exp2", "sigmoid")
