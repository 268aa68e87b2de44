"""Hypothesis strategies for random, well-typed IR expressions, plus the inputs to run them.

Shared by the simplifier, derivative and mask-analysis tests. Expressions are
built only through the typed constructors of `flexgen.dsl.ir`, so they are
well-typed by construction. Buffer loads always index with `x % BUF_SIZE`, so
every load is in range whatever the index expression evaluates to.
Integer constants and index ranges stay small so nothing overflows int32 at
the depths used here (the mask analysis assumes no overflow).

Strategies: exprs (any dtype), int_exprs, bool_exprs, float_exprs, diff_exprs
(differentiable floats), affine_masks; inputs: make_inputs, make_buffers,
make_params; comparison: same_values.
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
FLOAT_BUFFERS = (FVEC, FMAT)

PARAMS = {"alpha": DType.FLOAT32, "w": DType.INT32, "flag": DType.BOOL}
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")

# Float constants exactly representable in float32 (so folding is exact), plus
# a few that are not, and signed zeros.
NICE_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, -1.5, 3.0, 0.25)
ODD_FLOATS = (0.1, -0.7, 1e-3, 10.0)
INT_CONSTS = (0, 1, -1, 2, 3, -3, 5, 7)


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
        return ir.binary(op, a, draw(float_consts()))
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
