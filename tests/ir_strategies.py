"""Hypothesis strategies for random, well-typed IR expressions, plus the inputs to run them.

Shared by the simplifier, derivative and mask-analysis tests. Expressions are
built only through the typed constructors of `flexgen.dsl.ir`, so they are
well-typed by construction. Buffer loads always index with `x % BUF_SIZE`, so
every load is in range whatever the index expression evaluates to.
Integer constants and index ranges stay small in these, so nothing overflows
int32 at the depths used; wide_int_exprs / wide_masks and wide_boxes reach int32's
limits instead, to test wrap-around (kernels compute indices in int32).

Strategies: exprs (any dtype), int_exprs, bool_exprs, float_exprs, diff_exprs
(differentiable floats), affine_masks, wide_int_exprs, wide_masks, wide_boxes;
inputs: make_inputs, make_buffers, make_params; comparison: same_values.
"""
from __future__ import annotations

import functools

import torch
from hypothesis import strategies as st

from flexgen.dsl import ir
from flexgen.dsl.ir import BufferSpec, DType, Node

BUF_SIZE = 7
FVEC = BufferSpec("fvec", "float32", 1)
FMAT = BufferSpec("fmat", "float32", 2)
IVEC = BufferSpec("ivec", "int32", 1)
LVEC = BufferSpec("lvec", "int64", 1)
BVEC = BufferSpec("bvec", "bool", 1)
WVEC = BufferSpec("wvec", "int32", 1)  # values near int32's limits
FLOAT_BUFFERS = (FVEC, FMAT)

PARAMS = {"alpha": DType.FLOAT32, "w": DType.INT32, "flag": DType.BOOL}
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")

# Float constants exactly representable in float32 (so folding is exact), plus
# a few that are not, and signed zeros.
NICE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -1.5, 3.0, 0.25)
ODD_FLOATS = (0.1, -0.7, 1e-3, 10.0)
INT_CONSTS = (0, 1, -1, 2, 3, -3, 5, 7)
# Constants and index positions where int32 arithmetic wraps (65536 * 65536 = 2**32, 46341**2 > 2**31).
WIDE_INT_CONSTS = (0, 1, -1, 3, -7, 1000, 46341, 65536, 2**30, 2**31 - 1, -(2**31), 2**31 - 1000)
WIDE_STARTS = (0, 1000, 46330, 65530, 2**30, 2**31 - 20)


def _index(draw, depth: int) -> Node:
    """An int expression reduced into [0, BUF_SIZE)."""
    x = draw(int_exprs(max_depth=depth, allow_loads=False))
    return ir.binary("mod", x, ir.const(BUF_SIZE))


# ---------------------------------------------------------------- generic expressions


@st.composite
def _float_consts_impl(draw) -> Node:
    v = draw(st.sampled_from(NICE_FLOATS + ODD_FLOATS) | st.floats(-4, 4, width=32))
    return ir.const(float(v), DType.FLOAT32)


@st.composite
def _int_exprs(draw, max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True) -> Node:
    """An INT32 or INT64 expression over the index inputs."""
    leaves = _leaves("int", allow_params)
    if max_depth <= 0:
        return draw(leaves)
    kind = draw(st.sampled_from(["leaf", "leaf", "arith", "arith", "divmod", "unary", "where", "cast", "load"]))
    d = max_depth - 1
    if kind == "leaf":
        return draw(leaves)
    if kind == "arith":
        op = draw(st.sampled_from(["add", "sub", "mul", "min", "max"]))
        return ir.binary(op, draw(int_exprs(d, allow_loads, allow_params)), draw(int_exprs(d, allow_loads, allow_params)))
    if kind == "divmod":
        op = draw(st.sampled_from(["floordiv", "mod"]))
        divisor = ir.const(draw(st.sampled_from([1, 2, 3, -2, 4, 16, -5])))
        return ir.binary(op, draw(int_exprs(d, allow_loads, allow_params)), divisor)
    if kind == "unary":
        return ir.unary(draw(st.sampled_from(["neg", "abs"])), draw(int_exprs(d, allow_loads, allow_params)))
    if kind == "where":
        c = draw(bool_exprs(d, allow_loads=allow_loads, allow_params=allow_params))
        return ir.where(c, draw(int_exprs(d, allow_loads, allow_params)), draw(int_exprs(d, allow_loads, allow_params)))
    if kind == "cast":
        src = draw(st.sampled_from(["int", "bool", "float"]))
        if src == "bool":
            return ir.cast(draw(bool_exprs(d, allow_loads=allow_loads, allow_params=allow_params)), DType.INT32)
        if src == "float":
            x = draw(float_exprs(d, allow_loads=allow_loads, allow_params=allow_params, allow_score=False))
            # clamp so the truncating cast stays in range even for large floats
            x = ir.binary("min", ir.binary("max", x, ir.const(-1000.0)), ir.const(1000.0))
            return ir.cast(x, DType.INT32)
        return ir.cast(draw(int_exprs(d, allow_loads, allow_params)), draw(st.sampled_from([DType.INT32, DType.INT64])))
    if not allow_loads:
        return draw(leaves)
    spec = draw(st.sampled_from([IVEC, LVEC]))
    return ir.load(spec, (_index(draw, d),))


@st.composite
def _bool_exprs(draw, max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True, allow_float: bool = True) -> Node:
    leaves = _leaves("bool", allow_params)
    if max_depth <= 0:
        return draw(leaves)
    d = max_depth - 1
    kind = draw(st.sampled_from(["cmp", "cmp", "cmp", "logic", "logic", "not", "where", "leaf", "load", "fcmp"]))
    if kind == "cmp":
        op = draw(st.sampled_from(ir.COMPARE_OPS))
        return ir.binary(op, draw(int_exprs(d, allow_loads, allow_params)), draw(int_exprs(d, allow_loads, allow_params)))
    if kind == "fcmp" and allow_float:
        op = draw(st.sampled_from(ir.COMPARE_OPS))
        a = draw(float_exprs(d, allow_loads=allow_loads, allow_params=allow_params, allow_score=False))
        shape = draw(st.sampled_from((None, None, "isnan", "sign") + ir.ROUNDING_OPS))  # ops masks meet less often
        if shape == "isnan":
            return ir.unary("isnan", a)
        return ir.binary(op, ir.unary(shape, a) if shape else a, draw(float_consts()))
    if kind == "logic":
        op = draw(st.sampled_from(ir.LOGIC_OPS))
        kw = dict(allow_loads=allow_loads, allow_params=allow_params, allow_float=allow_float)
        return ir.binary(op, draw(bool_exprs(d, **kw)), draw(bool_exprs(d, **kw)))
    if kind == "not":
        return ir.unary("not", draw(bool_exprs(d, allow_loads=allow_loads, allow_params=allow_params, allow_float=allow_float)))
    if kind == "where":
        kw = dict(allow_loads=allow_loads, allow_params=allow_params, allow_float=allow_float)
        return ir.where(draw(bool_exprs(d, **kw)), draw(bool_exprs(d, **kw)), draw(bool_exprs(d, **kw)))
    if kind == "load" and allow_loads:
        return ir.load(BVEC, (_index(draw, d),))
    return draw(leaves)


@st.composite
def _float_exprs(
    draw, max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True, allow_score: bool = True
) -> Node:
    leaves = _leaves("float", allow_params, allow_score)
    if max_depth <= 0:
        return draw(leaves)
    d = max_depth - 1
    kw = dict(allow_loads=allow_loads, allow_params=allow_params, allow_score=allow_score)
    kind = draw(st.sampled_from(["leaf", "leaf", "arith", "arith", "unary", "where", "cast", "load"]))
    if kind == "arith":
        op = draw(st.sampled_from(["add", "sub", "mul", "div", "pow", "min", "max", "floordiv", "mod"]))
        return ir.binary(op, draw(float_exprs(d, **kw)), draw(float_exprs(d, **kw)))
    if kind == "unary":
        op = draw(st.sampled_from(("neg", "abs") + ir.UNARY_FLOAT_OPS))
        return ir.unary(op, draw(float_exprs(d, **kw)))
    if kind == "where":
        c = draw(bool_exprs(d, allow_loads=allow_loads, allow_params=allow_params))
        return ir.where(c, draw(float_exprs(d, **kw)), draw(float_exprs(d, **kw)))
    if kind == "cast":
        src = draw(st.sampled_from(["int", "bool"]))
        if src == "bool":
            return ir.cast(draw(bool_exprs(d, allow_loads=allow_loads, allow_params=allow_params)), DType.FLOAT32)
        return ir.cast(draw(int_exprs(d, allow_loads, allow_params)), DType.FLOAT32)
    if kind == "load" and allow_loads:
        if draw(st.booleans()):
            return ir.load(FVEC, (_index(draw, d),))
        return ir.load(FMAT, (_index(draw, d), _index(draw, d)))
    return draw(leaves)


@st.composite
def _exprs(draw, max_depth: int = 3) -> Node:
    """An expression of any dtype."""
    kind = draw(st.sampled_from(["float", "int", "bool"]))
    if kind == "float":
        return draw(float_exprs(max_depth))
    if kind == "int":
        return draw(int_exprs(max_depth))
    return draw(bool_exprs(max_depth))


# ---------------------------------------------------------------- differentiable expressions


def _positive(x: Node) -> Node:
    """|x| + 0.25: keeps log/sqrt/pow/div away from their singular points."""
    return ir.binary("add", ir.unary("abs", x), ir.const(0.25))


@st.composite
def _diff_exprs(draw, max_depth: int = 3) -> Node:
    """FLOAT32 expressions whose ops are all differentiable almost everywhere,
    with singular domains kept out of reach (log/sqrt/rsqrt/pow of |x|+0.25 and so on)."""
    leaves = _leaves("float", True, True)
    if max_depth <= 0:
        return draw(leaves)
    d = max_depth - 1
    kind = draw(st.sampled_from(["leaf", "arith", "arith", "unary", "unary", "where", "load", "load", "cast", "pow", "div"]))
    if kind == "arith":
        op = draw(st.sampled_from(["add", "sub", "mul", "min", "max", "mod"]))
        return ir.binary(op, draw(diff_exprs(d)), draw(diff_exprs(d)))
    if kind == "div":
        den = _positive(draw(diff_exprs(d)))
        if draw(st.booleans()):
            den = ir.unary("neg", den)
        return ir.binary("div", draw(diff_exprs(d)), den)
    if kind == "pow":
        return ir.binary("pow", _positive(draw(diff_exprs(d))), draw(diff_exprs(d)))
    if kind == "unary":
        op = draw(st.sampled_from(("neg", "abs", "exp", "exp2", "tanh", "sigmoid", "sin", "cos", "erf", "log", "log2", "sqrt", "rsqrt")))
        x = draw(diff_exprs(d))
        if op in ("log", "log2", "sqrt", "rsqrt"):
            x = _positive(x)
        if op in ("exp", "exp2"):
            x = ir.binary("min", x, ir.const(8.0))  # keep values finite
        return ir.unary(op, x)
    if kind == "where":
        c = ir.binary(draw(st.sampled_from(["lt", "ge"])), draw(diff_exprs(d)), draw(float_consts()))
        return ir.where(c, draw(diff_exprs(d)), draw(diff_exprs(d)))
    if kind == "load":
        if draw(st.booleans()):
            return ir.load(FVEC, (_index(draw, d),))
        return ir.load(FMAT, (_index(draw, d), _index(draw, d)))
    if kind == "cast":  # gradient dies at an int cast
        return ir.cast(draw(int_exprs(d, allow_loads=False)), DType.FLOAT32)
    return draw(leaves)


# ---------------------------------------------------------------- affine masks


@st.composite
def affine_terms(draw) -> Node:
    """a*q_idx + c*kv_idx + d (+ maybe h), as an INT32 expression."""
    a = draw(st.integers(-2, 2))
    c = draw(st.integers(-2, 2))
    d = draw(st.integers(-40, 40))
    e = ir.const(d)
    for coef, name in ((a, "q_idx"), (c, "kv_idx")):
        if coef:
            term = ir.input_(name) if coef == 1 else ir.binary("mul", ir.const(coef), ir.input_(name))
            e = ir.binary("add", e, term)
    if draw(st.integers(0, 4)) == 0:
        e = ir.binary("sub", e, ir.input_("h"))
    return e


@st.composite
def _affine_masks(draw, max_depth: int = 3) -> Node:
    """and/or/not combinations of comparisons between affine forms."""
    if max_depth <= 0 or draw(st.integers(0, 2)) == 0:
        op = draw(st.sampled_from(ir.COMPARE_OPS))
        rhs = draw(affine_terms()) if draw(st.booleans()) else ir.param("w", DType.INT32)
        return ir.binary(op, draw(affine_terms()), rhs)
    op = draw(st.sampled_from(["and", "or", "xor", "not"]))
    if op == "not":
        return ir.unary("not", draw(affine_masks(max_depth - 1)))
    return ir.binary(op, draw(affine_masks(max_depth - 1)), draw(affine_masks(max_depth - 1)))


# ---------------------------------------------------------------- expressions that wrap around


@st.composite
def _wide_int_exprs(draw, max_depth: int = 3) -> Node:
    """INT32/INT64 expressions whose values may leave int32 (and int64): products of indices,
    large constants, loads of large values, narrowing casts."""
    if max_depth <= 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            return ir.input_(draw(st.sampled_from(INDEX_INPUTS)))
        return ir.const(draw(st.sampled_from(WIDE_INT_CONSTS)))
    d = max_depth - 1
    kind = draw(st.sampled_from(["arith", "arith", "arith", "unary", "divmod", "minmax", "where", "widen", "narrow", "load"]))
    if kind == "arith":
        op = draw(st.sampled_from(["add", "sub", "mul"]))
        return ir.binary(op, draw(wide_int_exprs(d)), draw(wide_int_exprs(d)))
    if kind == "unary":
        return ir.unary(draw(st.sampled_from(["neg", "abs"])), draw(wide_int_exprs(d)))
    if kind == "divmod":
        divisor = ir.const(draw(st.sampled_from([-1, 2, -3, 7, 65536, 2**31 - 1])))
        return ir.binary(draw(st.sampled_from(["floordiv", "mod"])), draw(wide_int_exprs(d)), divisor)
    if kind == "minmax":
        return ir.binary(draw(st.sampled_from(["min", "max"])), draw(wide_int_exprs(d)), draw(wide_int_exprs(d)))
    if kind == "where":
        return ir.where(draw(wide_masks(d)), draw(wide_int_exprs(d)), draw(wide_int_exprs(d)))
    if kind == "widen":
        return ir.cast(draw(wide_int_exprs(d)), DType.INT64)
    if kind == "narrow":
        return ir.cast(draw(wide_int_exprs(d)), DType.INT32)
    return ir.load(WVEC, (_index_wide(draw(wide_int_exprs(d))),))


def _index_wide(x: Node) -> Node:
    """x reduced into [0, BUF_SIZE) in x's own type (a floor modulo never leaves it)."""
    return ir.binary("mod", x, ir.const(BUF_SIZE, x.dtype))


@st.composite
def _wide_masks(draw, max_depth: int = 3) -> Node:
    """Comparisons of wide integer expressions, combined with and/or/xor/not."""
    if max_depth <= 0 or draw(st.integers(0, 2)) == 0:
        op = draw(st.sampled_from(ir.COMPARE_OPS))
        return ir.binary(op, draw(wide_int_exprs(max(max_depth - 1, 0))), draw(wide_int_exprs(max(max_depth - 1, 0))))
    op = draw(st.sampled_from(["and", "or", "xor", "not"]))
    if op == "not":
        return ir.unary("not", draw(wide_masks(max_depth - 1)))
    return ir.binary(op, draw(wide_masks(max_depth - 1)), draw(wide_masks(max_depth - 1)))


@st.composite
def wide_boxes(draw, max_size: int = 12):
    """((q0, q1), (kv0, kv1), (b0, b1), (h0, h1)): half-open index ranges, some near int32's limits."""
    def one(starts, size):
        lo = draw(st.sampled_from(starts)) + draw(st.integers(0, 8))
        return lo, lo + draw(st.integers(1, size))

    return one(WIDE_STARTS, max_size), one(WIDE_STARTS, max_size), one((0, 60000), 2), one((0, 60000), 2)


# ---------------------------------------------------------------- cached strategy objects
# Building and validating a fresh strategy on every recursive draw dominates the
# run time, so each (kind, arguments) strategy is made once.


@functools.lru_cache(maxsize=None)
def int_exprs(max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True):
    """INT32/INT64 expressions over the index inputs."""
    return _int_exprs(max_depth, allow_loads, allow_params)


@functools.lru_cache(maxsize=None)
def bool_exprs(max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True, allow_float: bool = True):
    """BOOL expressions: comparisons, logic, where, loads."""
    return _bool_exprs(max_depth, allow_loads, allow_params, allow_float)


@functools.lru_cache(maxsize=None)
def float_exprs(max_depth: int = 3, allow_loads: bool = True, allow_params: bool = True, allow_score: bool = True):
    """Any FLOAT32 expression, including ones that produce inf/nan."""
    return _float_exprs(max_depth, allow_loads, allow_params, allow_score)


@functools.lru_cache(maxsize=None)
def diff_exprs(max_depth: int = 3):
    """Differentiable FLOAT32 expressions with singular domains out of reach."""
    return _diff_exprs(max_depth)


@functools.lru_cache(maxsize=None)
def affine_masks(max_depth: int = 3):
    """and/or/not/xor of comparisons between affine forms of q_idx, kv_idx (and h)."""
    return _affine_masks(max_depth)


@functools.lru_cache(maxsize=None)
def wide_int_exprs(max_depth: int = 3):
    """INT32/INT64 expressions that may wrap around (see _wide_int_exprs)."""
    return _wide_int_exprs(max_depth)


@functools.lru_cache(maxsize=None)
def wide_masks(max_depth: int = 3):
    """Masks over wide integer expressions."""
    return _wide_masks(max_depth)


@functools.lru_cache(maxsize=None)
def exprs(max_depth: int = 3):
    """An expression of any dtype."""
    return _exprs(max_depth)


@functools.lru_cache(maxsize=None)
def _leaves(kind: str, allow_params: bool, allow_score: bool = True):
    if kind == "int":
        out = [st.sampled_from(INDEX_INPUTS).map(ir.input_), st.sampled_from(INT_CONSTS).map(ir.const)]
        if allow_params:
            out.append(st.just(ir.param("w", DType.INT32)))
    elif kind == "bool":
        out = [st.booleans().map(ir.const)]
        if allow_params:
            out.append(st.just(ir.param("flag", DType.BOOL)))
    else:
        out = [float_consts()]
        if allow_score:
            out += [st.just(ir.input_("score"))] * 2
        if allow_params:
            out.append(st.just(ir.param("alpha", DType.FLOAT32)))
    return st.one_of(*out)


@functools.lru_cache(maxsize=None)
def float_consts():
    return _float_consts_impl()


# ---------------------------------------------------------------- inputs


def make_buffers(seed: int, float_dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fvec": torch.randn(BUF_SIZE, generator=g, dtype=torch.float64).to(float_dtype),
        "fmat": torch.randn(BUF_SIZE, BUF_SIZE, generator=g, dtype=torch.float64).to(float_dtype),
        "ivec": torch.randint(-20, 20, (BUF_SIZE,), generator=g, dtype=torch.int32),
        "lvec": torch.randint(-20, 20, (BUF_SIZE,), generator=g, dtype=torch.int64),
        "bvec": torch.rand(BUF_SIZE, generator=g) < 0.5,
        "wvec": torch.tensor([2**31 - 1, -(2**31), 2**30, -1, 0, 65536, 46341], dtype=torch.int32)[
            torch.randperm(BUF_SIZE, generator=g)],
    }


def make_params(seed: int) -> dict[str, bool | int | float]:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "alpha": float(torch.randn((), generator=g, dtype=torch.float64).to(torch.float32)),
        "w": int(torch.randint(-8, 9, (), generator=g)),
        "flag": bool(torch.randint(0, 2, (), generator=g)),
    }


def make_inputs(seed: int, shape=(2, 2, 5, 6), float_dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Broadcast index grids plus a full-shape score tensor (scores in about [-3, 3])."""
    B, H, Q, K = shape
    g = torch.Generator().manual_seed(seed + 2)
    score = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5).to(torch.float32).to(float_dtype)
    q0 = int(torch.randint(0, 40, (), generator=g))
    k0 = int(torch.randint(0, 40, (), generator=g))
    return {
        "score": score,
        "b": torch.arange(B, dtype=torch.int32)[:, None, None, None],
        "h": torch.arange(H, dtype=torch.int32)[None, :, None, None],
        "q_idx": torch.arange(q0, q0 + Q, dtype=torch.int32)[None, None, :, None],
        "kv_idx": torch.arange(k0, k0 + K, dtype=torch.int32)[None, None, None, :],
    }


def same_values(a: torch.Tensor, b: torch.Tensor, rtol: float = 0.0, atol: float = 0.0) -> bool:
    """Equal values (shape after broadcasting, dtype class); NaN equals NaN, infinities must match."""
    a, b = torch.broadcast_tensors(a, b)
    if a.dtype.is_floating_point != b.dtype.is_floating_point:
        return False
    if not a.dtype.is_floating_point:
        return bool(torch.equal(a.to(torch.int64), b.to(torch.int64)))
    a = a.to(torch.float64)
    b = b.to(torch.float64)
    return bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True) and torch.equal(a.isinf(), b.isinf()))


# ---------------------------------------------------------------- plain Python mods
# A program is a tree of tuples; run_program interprets it with Python operators and torch
# functions, so the same program is a FlexAttention-style mask_mod both for the tracer (it gets
# proxies) and for torch (0-dim int32 tensors under vmap). It reads the captured tensors below.

TABLE = torch.tensor([2**31 - 1, -(2**31), 65536, -3, 0, 46341, 7], dtype=torch.int32)
TABLE64 = torch.tensor([2**62, -(2**40), 5, 0, -1, 2**33, 12], dtype=torch.int64)
INTERVALS = torch.tensor([[0, 5], [3, 9], [2**31 - 8, 2**31 - 1], [-4, 4], [7, 7], [1, 100], [40000, 70000]], dtype=torch.int32)
FLAGS = torch.tensor([True, False, False, True, True, False, True])
FTABLE = torch.tensor([0.5, -1.25, 3.0e9, -7.0, 0.0, 1.0e-3, 65536.0], dtype=torch.float32)
PROGRAM_INTS = WIDE_INT_CONSTS[:-3] + (2**31 - 1, -(2**31) + 1)
BIG_CONSTANTS = (2**31, -(2**31) - 1, 2**40, 2**64, -(2**70))
COMPARE_SYMBOLS = ("<", "<=", ">", ">=", "==", "!=")
_COMPARE = {"<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
            ">=": lambda a, b: a >= b, "==": lambda a, b: a == b, "!=": lambda a, b: a != b}
_ARITH = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INVALID = {  # fragment (a: an int value, p: a bool value, big: a constant) -> a flexgen error when traced
    "if": lambda a, p, big: a if p else -a,  # Python control flow on a traced value
    "big": lambda a, p, big: a.int() + big,  # a constant that does not fit in int32
    "big_long": lambda a, p, big: a.long() + big * 2**33,  # ... nor in int64
    "float_index": lambda a, p, big: TABLE[a.float()],
    "bool_index": lambda a, p, big: TABLE[p],
    "partial_index": lambda a, p, big: INTERVALS[a % 7] + 1,  # a row used as a value
    "tensor_value": lambda a, p, big: TABLE + a,
    "cumsum": lambda a, p, big: torch.cumsum(a, 0),
    "int()": lambda a, p, big: a + int(a),
    "float()": lambda a, p, big: float(a) + 1.0,
    "len": lambda a, p, big: len(a) + a,
    "item": lambda a, p, big: a.item() + a,
    "index_traced": lambda a, p, big: a[0],
    "too_many_indices": lambda a, p, big: TABLE[a % 7, 0],
    "where1": lambda a, p, big: torch.where(p),
    "reduction": lambda a, p, big: torch.max(a),
    "builtin_min": lambda a, p, big: min(a, a + 1),
    "builtin_max": lambda a, p, big: max(a, a - 1),  # Python's max compares: torch.maximum is the traced form
    "shift_by_traced": lambda a, p, big: 1 << a,  # a shift count must be a constant Python int
    "rshift_by_traced": lambda a, p, big: a >> a,
    "matmul": lambda a, p, big: a @ a,  # traced values are scalars: torch.mul
    "bool_minus_bool": lambda a, p, big: (p - p).int() + a,  # torch refuses - on two bools
    "float_condition": lambda a, p, big: torch.where(a.float(), a, a),
}


def run_program(node, env: dict):
    """The value of a program node, with env holding b, h, q_idx, kv_idx (proxies or tensors)."""
    kind, *rest = node
    r = lambda x: run_program(x, env)  # noqa: E731
    if kind == "in":
        return env[rest[0]]
    if kind == "k":
        return rest[0]
    if kind == "arith":
        op, a, b = rest
        return _ARITH[op](r(a), r(b))
    if kind == "rarith":  # a Python number on the left
        op, k, a = rest
        return _ARITH[op](k, r(a))
    if kind == "neg":
        return -r(rest[0])
    if kind == "abs":
        return abs(r(rest[0]))
    if kind == "floordiv":
        return r(rest[0]) // rest[1]
    if kind == "mod":
        return r(rest[0]) % rest[1]
    if kind in ("minimum", "maximum"):
        return getattr(torch, kind)(r(rest[0]), r(rest[1]))
    if kind == "where":
        return torch.where(r(rest[0]), r(rest[1]), r(rest[2]))
    if kind == "clamp":
        return torch.clamp(r(rest[0]), rest[1], rest[2])
    if kind == "bool_times":
        return r(rest[0]) * rest[1]
    if kind == "shift":  # by a constant count: x << k wraps like x * 2**k, x >> k floors like x // 2**k
        op, a, k = rest
        return r(a) << k if op == "<<" else r(a) >> k
    if kind == "bitwise":  # integer &, |, ^ (a traced operand first), and ~
        op, a, b = rest
        if op == "~":
            return ~r(a)
        return {"&": lambda x, y: x & y, "|": lambda x, y: x | y, "^": lambda x, y: x ^ y}[op](r(a), r(b))
    if kind == "bool_arith":  # torch: bool + bool is logical or, bool * bool logical and
        op, a, b = rest
        return r(a) + r(b) if op == "+" else r(a) * r(b)
    if kind == "long":
        return r(rest[0]).long()
    if kind == "int":
        return r(rest[0]).int()
    if kind == "load":
        return TABLE[r(rest[0]) % 7]
    if kind == "load64":
        return TABLE64[r(rest[0]) % 7]
    if kind == "interval":  # attention-gym's pattern: a row of a table, then an element of the row
        row = INTERVALS[r(rest[0]) % 7]
        return row[rest[1]]
    if kind == "interval2":
        return INTERVALS[r(rest[0]) % 7, rest[1]]
    if kind == "float_to_int":
        return torch.clamp(r(rest[0]), -1e9, 1e9).int()
    if kind == "float":
        return r(rest[0]).float()
    if kind == "fload":
        return FTABLE[r(rest[0]) % 7]
    if kind == "fdiv":
        return r(rest[0]) / r(rest[1])
    if kind == "cmp":
        op, a, b = rest
        return _COMPARE[op](r(a), r(b))
    if kind == "and":
        return r(rest[0]) & r(rest[1])
    if kind == "or":
        return r(rest[0]) | r(rest[1])
    if kind == "xor":
        return r(rest[0]) ^ r(rest[1])
    if kind == "not":
        return ~r(rest[0])
    if kind == "logical_and":
        return torch.logical_and(r(rest[0]), r(rest[1]))
    if kind == "flag":
        return FLAGS[r(rest[0]) % 7]
    if kind == "invalid":
        name, a, p, big = rest
        return _INVALID[name](r(a), r(p), big)
    if kind == "return_int":
        return r(rest[0])
    raise ValueError(f"unknown program node {kind!r}")


def program_mod(program):
    """The program as a plain mask_mod(b, h, q_idx, kv_idx)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return run_program(program, {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx})

    return mask_mod


def _reads_inputs(node) -> bool:
    return node[0] == "in" or any(isinstance(x, tuple) and _reads_inputs(x) for x in node[1:])


def _traced(node, float_: bool = False):
    """`node`, or a traced value in place of one that reads no input: Python would compute on
    plain numbers or concrete tensors there (unbounded ints, `.long()` on an int), which is not
    what these programs test."""
    if _reads_inputs(node):
        return node
    return ("float", ("in", "q_idx")) if float_ else ("in", "kv_idx")


def _traced_bool(node):
    """`node`, or a traced comparison in place of a condition that reads no input (a constant
    condition is plain Python to the tracer, so `if` on it is no error)."""
    return node if _reads_inputs(node) else ("cmp", "<", ("in", "q_idx"), ("in", "kv_idx"))


@st.composite
def _program_ints(draw, depth: int):
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.integers(0, 2)):
            return ("in", draw(st.sampled_from(INDEX_INPUTS)))
        return ("k", draw(st.sampled_from(PROGRAM_INTS)))
    d = depth - 1
    kind = draw(st.sampled_from(["arith", "arith", "arith", "rarith", "neg", "abs", "floordiv", "mod", "minimum",
                                 "maximum", "where", "clamp", "long", "int", "load", "load64", "interval",
                                 "interval2", "float_to_int", "bool_times", "shift", "bitwise"]))
    if kind == "arith":
        return ("arith", draw(st.sampled_from(sorted(_ARITH))), _traced(draw(program_ints(d))), draw(program_ints(d)))
    if kind == "rarith":
        return ("rarith", draw(st.sampled_from(sorted(_ARITH))), draw(st.sampled_from(PROGRAM_INTS)), _traced(draw(program_ints(d))))
    if kind in ("neg", "abs", "long", "int", "load", "load64"):
        return (kind, _traced(draw(program_ints(d))))
    if kind in ("floordiv", "mod"):
        return (kind, _traced(draw(program_ints(d))), draw(st.sampled_from([-1, 2, -3, 7, 65536, 2**31 - 1])))
    if kind in ("minimum", "maximum"):
        return (kind, _traced(draw(program_ints(d))), _traced(draw(program_ints(d))))  # torch.minimum takes tensors
    if kind == "where":  # both branches may be Python ints: torch makes those int64
        return ("where", draw(program_bools(d)), draw(program_ints(d)), draw(program_ints(d)))
    if kind == "shift":
        return ("shift", draw(st.sampled_from(["<<", ">>"])), _traced(draw(program_ints(d))),
                draw(st.sampled_from([0, 1, 3, 16, 31, 32, 40])))
    if kind == "bitwise":
        return ("bitwise", draw(st.sampled_from(["&", "|", "^", "~"])), _traced(draw(program_ints(d))),
                draw(program_ints(d)))
    if kind == "bool_times":  # bool * Python int is int64 in torch
        return ("bool_times", draw(program_bools(d)), draw(st.sampled_from(PROGRAM_INTS)))
    if kind == "clamp":
        lo = draw(st.sampled_from([-(2**31) + 1, -5, 0, 3]))
        return ("clamp", _traced(draw(program_ints(d))), lo, lo + draw(st.sampled_from([0, 10, 2**16, 2**31 - 10])))
    if kind in ("interval", "interval2"):
        return (kind, draw(program_ints(d)), draw(st.integers(0, 1)))
    return ("float_to_int", _traced(draw(program_floats(d, allow_div=False)), float_=True))


@st.composite
def _program_floats(draw, depth: int, allow_div: bool):
    """float32 values: from ints, the float table and constants, with + - * (and / where allowed:
    a float cast to int must not see NaN, on which torch and the GPU differ)."""
    if depth <= 0 or draw(st.integers(0, 2)) == 0:
        leaf = draw(st.sampled_from(["float", "fload", "k"]))
        if leaf == "k":
            return ("k", draw(st.sampled_from([0.5, -1.5, 3.0, 1e-3, 65536.0, 2.0**31])))
        return (leaf, _traced(draw(program_ints(max(depth - 1, 0)))))
    ops = sorted(_ARITH) + (["/"] if allow_div else [])
    op = draw(st.sampled_from(ops))
    a, b = _traced(draw(program_floats(depth - 1, allow_div)), float_=True), draw(program_floats(depth - 1, allow_div))
    return ("fdiv", a, b) if op == "/" else ("arith", op, a, b)


@st.composite
def _program_bools(draw, depth: int):
    if depth <= 0 or draw(st.integers(0, 3)) == 0:
        if draw(st.booleans()):
            return ("flag", draw(program_ints(max(depth - 1, 0))))
        return ("cmp", draw(st.sampled_from(COMPARE_SYMBOLS)), _traced(draw(program_ints(max(depth - 1, 0)))),
                draw(program_ints(max(depth - 1, 0))))
    d = depth - 1
    kind = draw(st.sampled_from(["cmp", "cmp", "fcmp", "and", "or", "xor", "not", "logical_and", "where", "bool_arith"]))
    if kind == "cmp":
        return ("cmp", draw(st.sampled_from(COMPARE_SYMBOLS)), _traced(draw(program_ints(d))), draw(program_ints(d)))
    if kind == "fcmp":
        return ("cmp", draw(st.sampled_from(COMPARE_SYMBOLS)), _traced(draw(program_floats(d, allow_div=True)), float_=True),
                ("k", draw(st.sampled_from([0.0, 0.5, -2.5, 1e9, float("inf")]))))
    if kind == "not":
        return ("not", draw(program_bools(d)))
    if kind == "bool_arith":
        return ("bool_arith", draw(st.sampled_from(["+", "*"])), draw(program_bools(d)), draw(program_bools(d)))
    if kind == "where":
        return ("where", draw(program_bools(d)), draw(program_bools(d)), draw(program_bools(d)))
    return (kind, draw(program_bools(d)), draw(program_bools(d)))


@st.composite
def mask_programs(draw, depth: int = 3):
    """(program, valid): a random mask_mod program, and whether tracing must accept it. An
    invalid one carries one wrong fragment (see _INVALID), or returns an integer."""
    program = draw(program_bools(depth))
    choice = draw(st.integers(0, 2))
    if choice == 0:
        return program, True
    if choice == 1 and draw(st.integers(0, 4)) == 0:
        return ("return_int", _traced(draw(program_ints(depth)))), False
    name = draw(st.sampled_from(sorted(_INVALID)))
    fragment = ("invalid", name, _traced(draw(program_ints(1))), _traced_bool(draw(program_bools(1))),
                draw(st.sampled_from(BIG_CONSTANTS)))
    return (draw(st.sampled_from(["and", "or", "xor"])), program, ("cmp", "<", fragment, ("k", 3))), False


@functools.lru_cache(maxsize=None)
def program_ints(depth: int):
    return _program_ints(depth)


@functools.lru_cache(maxsize=None)
def program_floats(depth: int, allow_div: bool):
    return _program_floats(depth, allow_div)


@functools.lru_cache(maxsize=None)
def program_bools(depth: int):
    return _program_bools(depth)
