"""Static classification of mask tiles: all true (FULL), all false (EMPTY), or neither/unknown.

The analysis is an abstract interpretation of the mask expression over a box of
indices, q_idx in [q0, q1), kv_idx in [k0, k1), b in b_range, h in h_range:

* every integer value is an affine form  sum(c_i * x_i) + d  whose variables are
  the index inputs or "atoms" (non-affine subexpressions: products, divisions,
  loads, ...) with a known range. The min and max of an affine form over a box
  sit at corners, so for forms over the index inputs alone the range, and hence
  every comparison between such forms, is decided exactly. Atoms make the
  result sound but possibly loose (they are treated as independent variables);
* booleans are three-valued (may be true / may be false), combined by and/or/not.
  That alone is indecisive for correlated atoms such as `(q < kv) | (q >= kv)`,
  so and/or also carry the linear constraints their operands imply and try to
  refute them on the tile (integer bounds propagation plus one round of
  Fourier-Motzkin elimination, see `_feasible`). That is still incomplete in
  general, but masks made of comparisons of index differences (causal, sliding
  window, prefix-LM and their and/or/not combinations) come out exact on any tile;
* floats are intervals widened for float32/float64 rounding (and for the
  approximate transcendental functions kernels use), with a may-be-NaN flag;
* anything not understood (buffer loads, unknown ops) is "may be anything".

Integers are int32/int64 as in the kernels, where arithmetic wraps around. The
reasoning above is over unbounded integers, which agree with int32/int64 wherever no
operation leaves its type's range; so every integer operation's range is checked
against its type, and a tile where one may overflow (or a float converted to an
integer may be out of range or NaN) is reported PARTIAL: it is evaluated element by
element with the kernel's arithmetic. Unbound scalar parameters range over their
dtype. A FULL or EMPTY answer is then guaranteed for every point of the tile;
PARTIAL means "evaluate elementwise".

All bounds are float64 tensors so that one pass classifies a whole grid of
tiles at once (`classify_blocks`). Finite integer bounds are kept exact: any
bound beyond 2**52 in magnitude is pushed out to +-inf (or pulled in to +-2**52).
"""
from __future__ import annotations

import enum
import math
from typing import Mapping

import torch

from .ir import DType, Node, postorder

_BIG = 2.0**52  # float64 holds every integer up to 2**53 exactly
_F32_INT = 2.0**24  # float32 holds every integer up to 2**24 exactly
_ARITH_SLACK = 2.0**-20  # relative widening of float arithmetic (a few float32 ulps)
_TRANS_SLACK = 1e-3  # relative widening of transcendental functions (fast-math approximations)
_TINY = 1e-30  # absolute widening: subnormals, flush-to-zero
_INF = math.inf
_INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")
_ANY_INDEX = (0, 2**31 - 1)  # b and h when no range is given
_MAX_CONSTRAINTS = 16  # per conjunction, to bound the propagation work
_PROPAGATION_ROUNDS = 3
_MAX_DERIVED = 48  # constraints after Fourier-Motzkin combination


class TileClass(enum.Enum):
    FULL = "full"  # the mask is true at every point of the tile
    EMPTY = "empty"  # the mask is false at every point of the tile
    PARTIAL = "partial"  # mixed, or not decided statically: evaluate elementwise
    UNKNOWN = "partial"  # alias of PARTIAL


# ---------------------------------------------------------------- public API


def classify_tile(
    mask_expr: Node,
    q_range: tuple[int, int],
    kv_range: tuple[int, int],
    b_range: tuple[int, int] | None = None,
    h_range: tuple[int, int] | None = None,
    params: Mapping[str, bool | int | float] | None = None,
) -> TileClass:
    """Classify one tile; ranges are half-open [lo, hi). Never wrong about FULL/EMPTY."""
    ranges = {
        "q_idx": _point_range(q_range, "q_range"),
        "kv_idx": _point_range(kv_range, "kv_range"),
        "b": _point_range(b_range or _ANY_INDEX, "b_range"),
        "h": _point_range(h_range or _ANY_INDEX, "h_range"),
    }
    analyzer = _Analyzer(ranges, params)
    result = analyzer.run(_check_mask(mask_expr))
    if bool(analyzer.overflow):
        return TileClass.PARTIAL
    if not bool(result.may_f):
        return TileClass.FULL
    if not bool(result.may_t):
        return TileClass.EMPTY
    return TileClass.PARTIAL


def classify_blocks(
    mask_expr: Node,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_kv: int,
    params: Mapping[str, bool | int | float] | None = None,
    b_range: tuple[int, int] | None = None,
    h_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classify every (block_q x block_kv) tile of a q_len x kv_len grid at once.

    Returns (full, partial), bool tensors of shape [ceil(q_len/block_q), ceil(kv_len/block_kv)];
    tiles that are neither are EMPTY. The last tile in each dimension may be ragged.
    All tiles are classified by one vectorized pass (no Python loop over tiles)."""
    if min(q_len, kv_len, block_q, block_kv) <= 0:
        raise ValueError("classify_blocks(): lengths and block sizes must be positive")
    nq = -(-q_len // block_q)
    nkv = -(-kv_len // block_kv)
    q_lo = torch.arange(nq, dtype=torch.float64) * block_q
    kv_lo = torch.arange(nkv, dtype=torch.float64) * block_kv
    q_hi = torch.clamp(q_lo + block_q, max=q_len) - 1
    kv_hi = torch.clamp(kv_lo + block_kv, max=kv_len) - 1
    ranges = {
        "q_idx": (q_lo[:, None], q_hi[:, None]),
        "kv_idx": (kv_lo[None, :], kv_hi[None, :]),
        "b": _point_range(b_range or _ANY_INDEX, "b_range"),
        "h": _point_range(h_range or _ANY_INDEX, "h_range"),
    }
    analyzer = _Analyzer(ranges, params)
    result = analyzer.run(_check_mask(mask_expr))
    may_t = result.may_t.expand(nq, nkv)
    may_f = result.may_f.expand(nq, nkv)
    overflow = analyzer.overflow.expand(nq, nkv)  # int32/int64 may wrap: decide element by element
    full = ~may_f & ~overflow
    partial = (may_t & may_f) | overflow
    return full.contiguous(), partial.contiguous()


def buffer_reads_in_range(
    expr: Node,
    shapes: Mapping[str, tuple[int, ...]],
    q_len: int,
    kv_len: int,
    b_range: tuple[int, int],
    h_range: tuple[int, int],
    params: Mapping[str, bool | int | float] | None = None,
) -> bool:
    """Whether every buffer index of `expr` provably lies in [-size, size) of its dimension (the range torch's
    indexing reads) wherever q_idx < q_len, kv_idx < kv_len and b, h lie in their half-open ranges, with no
    integer operation on the way that may wrap. `shapes`: each buffer's shape by name. Where this holds an
    evaluation over those indices needs no run-time range check, which would wait for the GPU."""
    if min(q_len, kv_len) <= 0:
        return False
    analyzer = _Analyzer({
        "q_idx": _point_range((0, q_len), "q range"),
        "kv_idx": _point_range((0, kv_len), "kv range"),
        "b": _point_range(b_range, "b_range"),
        "h": _point_range(h_range, "h_range"),
    }, params)
    vals = analyzer.values(expr)
    for n in postorder(expr):
        if n.op != "load":
            continue
        shape = shapes.get(n.attr.name)
        if shape is None or len(shape) != len(n.args):
            return False
        for index, size in zip((vals[a.digest] for a in n.args), shape):
            if not isinstance(index, _Int) or not bool(((index.lo >= -size) & (index.hi <= size - 1)).all()):
                return False
    return not bool(analyzer.overflow.any())


def _check_mask(mask_expr: Node) -> Node:
    if not isinstance(mask_expr, Node) or mask_expr.dtype is not DType.BOOL:
        raise TypeError("mask analysis needs a BOOL-valued IR expression")
    return mask_expr


def _point_range(r: tuple[int, int], what: str) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = int(r[0]), int(r[1])
    if hi <= lo:
        raise ValueError(f"{what} {r!r} is empty; ranges are half-open [lo, hi)")
    return torch.tensor(float(lo), dtype=torch.float64), torch.tensor(float(hi - 1), dtype=torch.float64)


# ---------------------------------------------------------------- abstract values


class _Int:
    """An integer: the affine form sum(coeffs[k] * var_k) + const, with inclusive bounds lo..hi.
    `const` is a Python int or a per-tile float64 tensor of exact integers."""

    __slots__ = ("coeffs", "const", "lo", "hi")

    def __init__(self, coeffs: dict[str, int], const, lo: torch.Tensor, hi: torch.Tensor):
        self.coeffs, self.const, self.lo, self.hi = coeffs, const, lo, hi

    @property
    def is_const(self) -> bool:
        return not self.coeffs and isinstance(self.const, int)


class _Bool:
    """Three-valued per tile: may the value be true somewhere, may it be false somewhere.

    `conj` lists linear constraints (coeffs, const), each meaning sum(c * x) + const >= 0,
    that hold wherever the value is true; `nconj` those that hold wherever it is false.
    They let and/or see through correlated atoms (see `_feasible`)."""

    __slots__ = ("may_t", "may_f", "conj", "nconj")

    def __init__(self, may_t, may_f, conj: tuple = (), nconj: tuple = ()):
        self.may_t = torch.as_tensor(may_t)
        self.may_f = torch.as_tensor(may_f)
        self.conj, self.nconj = conj, nconj

    @property
    def must_t(self):
        return ~self.may_f

    @property
    def must_f(self):
        return ~self.may_t


class _Float:
    """A float interval lo..hi (finite, or -inf..inf), plus may-be-NaN; `int_exact` when the
    values are integers no larger than 2**24 computed without rounding in float32 and float64."""

    __slots__ = ("lo", "hi", "nan", "int_exact")

    def __init__(self, lo, hi, nan, int_exact: bool = False):
        lo = torch.as_tensor(lo, dtype=torch.float64)
        hi = torch.as_tensor(hi, dtype=torch.float64)
        nan = torch.as_tensor(nan) | lo.isnan() | hi.isnan()
        bad = ~(lo.isfinite() & hi.isfinite()) | nan
        self.lo = torch.where(bad, -_INF, lo)
        self.hi = torch.where(bad, _INF, hi)
        self.nan = bad  # non-finite bounds are treated as "anything, NaN included"
        self.int_exact = int_exact and not bool(bad.any()) and _within(self.lo, self.hi, _F32_INT)


def _within(lo, hi, bound: float) -> bool:
    return bool((lo >= -bound).all() and (hi <= bound).all())


def _f(x) -> torch.Tensor:
    if isinstance(x, int):
        x = float(x)  # Python ints may exceed int64
    return torch.as_tensor(x, dtype=torch.float64)


def _clamp_int(lo, hi):
    """Keep finite integer bounds exact: past 2**52 they become +-inf (or +-2**52), soundly."""
    lo, hi = _f(lo), _f(hi)
    lo = torch.where(lo.isnan() | (lo < -_BIG), -_INF, torch.clamp(lo, max=_BIG))
    hi = torch.where(hi.isnan() | (hi > _BIG), _INF, torch.clamp(hi, min=-_BIG))
    return lo, hi


def _widen(lo, hi, rel: float):
    return lo - lo.abs() * rel - _TINY, hi + hi.abs() * rel + _TINY


_DTYPE_RANGE = {DType.INT32: (-(2.0**31), 2.0**31 - 1), DType.INT64: (-_INF, _INF)}
# What fits without wrapping (int64's bounds as floats are exact: -2**63 and 2**63, exclusive).
_FITS = {DType.INT32: (-(2.0**31), 2.0**31 - 1), DType.INT64: (-(2.0**63), 2.0**63)}
_BUFFER_RANGE = {
    "int8": (-128.0, 127.0),
    "uint8": (0.0, 255.0),
    "int16": (-32768.0, 32767.0),
    "int32": (-(2.0**31), 2.0**31 - 1),
    "int64": (-_INF, _INF),
    "bool": (0.0, 1.0),
}


# ---------------------------------------------------------------- the interpreter


class _Analyzer:
    def __init__(self, ranges: dict[str, tuple[torch.Tensor, torch.Tensor]], params):
        self.ranges = dict(ranges)  # variable (index input or atom digest) -> inclusive bounds
        self.params = dict(params or {})
        self.overflow = torch.tensor(False)  # per tile: some integer value may have wrapped

    def run(self, root: Node) -> _Bool:
        return self.values(root)[root.digest]

    def values(self, root: Node) -> dict[str, object]:
        """The abstract value of every node of `root`, by digest."""
        vals: dict[str, object] = {}
        for n in postorder(root):
            vals[n.digest] = self.visit(n, [vals[a.digest] for a in n.args])
        return vals

    def visit(self, n: Node, args: list):
        if n.dtype is DType.BOOL:
            return self.visit_bool(n, args)
        if n.dtype.is_int:
            value = self.visit_int(n, args)
            # loads and parameters are in range by their type (their bounds may be loose), and
            # where/min/max pick an operand: only arithmetic (and the inputs' ranges) can leave it
            if n.op not in ("load", "param", "where", "min", "max", "inline_asm"):
                self.check_fits(n.dtype, value.lo, value.hi)
            return value
        return self.visit_float(n, args)

    def check_fits(self, dtype: DType, lo, hi) -> None:
        """Mark the tiles where a value of `dtype` in lo..hi may lie outside the type (it wraps there)."""
        fit_lo, fit_hi = _FITS[dtype]
        strict = dtype is DType.INT64  # int64's upper bound 2**63 is itself out of range
        self.overflow = self.overflow | (lo < fit_lo) | ((hi >= fit_hi) if strict else (hi > fit_hi))

    # ------------------------------------------------------------ integers

    def affine(self, coeffs: dict[str, int], const) -> _Int:
        """An affine form with its exact range over the box (corners decide it)."""
        coeffs = {k: c for k, c in coeffs.items() if c != 0}
        lo = hi = _f(const)
        mag = _f(const).abs()
        for key, c in coeffs.items():
            vlo, vhi = self.ranges[key]
            cf = float(c)
            lo = lo + (cf * vlo if c > 0 else cf * vhi)
            hi = hi + (cf * vhi if c > 0 else cf * vlo)
            m = torch.maximum(vlo.abs(), vhi.abs())
            mag = mag + abs(cf) * torch.where(m.isfinite(), m, 0.0)
        if float(mag.max()) > _BIG:  # partial sums may have rounded: widen by their error bound
            err = torch.where(mag > _BIG, mag * (len(coeffs) + 2) * 2.0**-51, 0.0)
            lo, hi = torch.floor(lo - err), torch.ceil(hi + err)
        lo, hi = _clamp_int(lo, hi)
        return _Int(coeffs, const, lo, hi)

    def const_int(self, v) -> _Int:
        return self.affine({}, int(v))

    def atom(self, n: Node, lo, hi) -> _Int:
        """A non-affine value, standing for itself as a variable with range lo..hi."""
        lo, hi = _clamp_int(lo, hi)
        if bool((lo == hi).all()):
            return _Int({}, lo, lo, hi)
        self.ranges[n.digest] = (lo, hi)
        return _Int({n.digest: 1}, 0, lo, hi)

    def top_int(self, n: Node) -> _Int:
        lo, hi = _DTYPE_RANGE[n.dtype]
        return self.atom(n, _f(lo), _f(hi))

    def combine(self, a: _Int, b: _Int, sign: int) -> _Int:
        coeffs = dict(a.coeffs)
        for k, c in b.coeffs.items():
            coeffs[k] = coeffs.get(k, 0) + sign * c
        const = a.const + sign * b.const
        return self.affine(coeffs, const)

    def scale(self, a: _Int, c: int) -> _Int:
        const = a.const * c if isinstance(a.const, int) else a.const * float(c)
        return self.affine({k: v * c for k, v in a.coeffs.items()}, const)

    def visit_int(self, n: Node, args: list) -> _Int:
        op = n.op
        if op == "const":
            return self.const_int(n.attr)
        if op == "input":
            return self.affine({n.attr: 1}, 0) if n.attr in self.ranges else self.top_int(n)
        if op == "param":
            return self.const_int(self.params[n.attr]) if n.attr in self.params else self.top_int(n)
        if op == "load":
            lo, hi = _BUFFER_RANGE.get(n.attr.dtype, (-_INF, _INF))
            return self.atom(n, _f(lo), _f(hi))
        if op == "cast":
            return self.int_cast(n, args[0])
        if op == "add":
            return self.combine(args[0], args[1], 1)
        if op == "sub":
            return self.combine(args[0], args[1], -1)
        if op == "neg":
            return self.scale(args[0], -1)
        if op == "mul":
            return self.int_mul(n, *args)
        if op == "floordiv":
            return self.int_floordiv(n, *args)
        if op == "mod":
            return self.int_mod(n, *args)
        if op in ("min", "max"):
            return self.int_minmax(n, *args)
        if op == "abs":
            return self.int_abs(n, args[0])
        if op == "sign":
            return self.atom(n, _f(-1.0), _f(1.0))
        if op == "where":
            return self.int_where(n, *args)
        if op == "bitand":  # with a non-negative operand, within 0 .. that operand's maximum
            nonneg = [x.hi for x in args if bool((x.lo >= 0).all())]
            if nonneg:
                return self.atom(n, _f(0.0), nonneg[0] if len(nonneg) == 1 else torch.minimum(*nonneg))
        return self.top_int(n)

    def int_cast(self, n: Node, x) -> _Int:
        if isinstance(x, _Int):
            return x  # int32 <-> int64: the no-overflow assumption makes it the identity
        if isinstance(x, _Bool):
            if bool(x.must_t.all()):
                return self.const_int(1)
            if bool(x.must_f.all()):
                return self.const_int(0)
            return self.atom(n, torch.where(x.may_f, 0.0, 1.0), torch.where(x.may_t, 1.0, 0.0))
        # float -> int truncates toward zero, which is monotone; NaN converts to anything. Out of
        # range (or NaN) C's conversion is undefined, so those tiles are left to the kernel.
        lo, hi = torch.trunc(x.lo), torch.trunc(x.hi)
        dlo, dhi = _DTYPE_RANGE[n.dtype]
        self.check_fits(n.dtype, lo, hi)  # x.lo, x.hi are infinite where x may be NaN
        return self.atom(n, torch.where(x.nan, dlo, lo), torch.where(x.nan, dhi, hi))

    def int_mul(self, n: Node, a: _Int, b: _Int) -> _Int:
        if a.is_const:
            return self.scale(b, a.const)
        if b.is_const:
            return self.scale(a, b.const)
        corners = torch.stack(torch.broadcast_tensors(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi))
        corners = torch.nan_to_num(corners, nan=0.0, posinf=_INF, neginf=-_INF)  # 0 * inf is 0 here
        lo, hi = corners.amin(0), corners.amax(0)
        mag = torch.maximum(lo.abs(), hi.abs())
        err = torch.where(mag > _BIG, mag * 2.0**-51, 0.0)
        return self.atom(n, torch.floor(lo - err), torch.ceil(hi + err))

    def int_floordiv(self, n: Node, a: _Int, b: _Int) -> _Int:
        if b.is_const and b.const != 0:
            c = float(b.const)
            lo, hi = torch.floor(a.lo / c), torch.floor(a.hi / c)  # exact below 2**53
            if c < 0:
                lo, hi = hi, lo
            lo, hi = _clamp_int(lo, hi)
            if bool((lo == hi).all()):
                return _Int({}, lo, lo, hi)
            return self.atom(n, lo, hi)
        # a sign-definite divisor: a / b is monotone in each operand, extremes at corners
        finite = a.lo.isfinite() & a.hi.isfinite() & b.lo.isfinite() & b.hi.isfinite()
        ok = finite & ((b.lo > 0) | (b.hi < 0))
        safe_lo = torch.where(ok, b.lo, 1.0)
        safe_hi = torch.where(ok, b.hi, 1.0)
        q = torch.stack(torch.broadcast_tensors(a.lo / safe_lo, a.lo / safe_hi, a.hi / safe_lo, a.hi / safe_hi))
        lo = torch.where(ok, torch.floor(q.amin(0)), -_INF)
        hi = torch.where(ok, torch.floor(q.amax(0)), _INF)
        return self.atom(n, lo, hi)

    def int_mod(self, n: Node, a: _Int, b: _Int) -> _Int:
        # torch.remainder: a - floor(a / b) * b, with the sign of the divisor
        if b.is_const and b.const != 0:
            c = b.const
            k_lo, k_hi = torch.floor(a.lo / float(c)), torch.floor(a.hi / float(c))
            same = (k_lo == k_hi) & k_lo.isfinite()
            if bool(same.all()):  # one quotient on the whole tile: a - c*k, still affine
                return self.affine(a.coeffs, a.const - float(c) * k_lo)
            k = torch.where(same, k_lo, 0.0)
            lo = torch.where(same, a.lo - c * k, 0.0 if c > 0 else c + 1.0)
            hi = torch.where(same, a.hi - c * k, c - 1.0 if c > 0 else 0.0)
            return self.atom(n, lo, hi)
        pos, neg = b.lo > 0, b.hi < 0
        lo = torch.where(pos, 0.0, torch.where(neg, b.lo + 1, -_INF))
        hi = torch.where(pos, b.hi - 1, torch.where(neg, 0.0, _INF))
        # a value already inside [0, b) (or (b, 0]) is its own remainder
        lo = torch.where(neg & (a.hi <= 0), torch.maximum(lo, a.lo), lo)
        hi = torch.where(pos & (a.lo >= 0), torch.minimum(hi, a.hi), hi)
        return self.atom(n, lo, hi)

    def int_minmax(self, n: Node, a: _Int, b: _Int) -> _Int:
        d = self.combine(a, b, -1)
        a_le_b, a_ge_b = bool((d.hi <= 0).all()), bool((d.lo >= 0).all())
        if n.op == "min":
            if a_le_b or a_ge_b:
                return a if a_le_b else b
            return self.atom(n, torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi))
        if a_le_b or a_ge_b:
            return b if a_le_b else a
        return self.atom(n, torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi))

    def int_abs(self, n: Node, a: _Int) -> _Int:
        if bool((a.lo >= 0).all()):
            return a
        if bool((a.hi <= 0).all()):
            return self.scale(a, -1)
        lo = torch.where(a.lo >= 0, a.lo, torch.where(a.hi <= 0, -a.hi, 0.0))
        hi = torch.maximum(a.lo.abs(), a.hi.abs())
        return self.atom(n, lo, hi)

    def int_where(self, n: Node, c: _Bool, a: _Int, b: _Int) -> _Int:
        if n.args[1] == n.args[2] or bool(c.must_t.all()):
            return a
        if bool(c.must_f.all()):
            return b
        lo = torch.where(c.must_t, a.lo, torch.where(c.must_f, b.lo, torch.minimum(a.lo, b.lo)))
        hi = torch.where(c.must_t, a.hi, torch.where(c.must_f, b.hi, torch.maximum(a.hi, b.hi)))
        return self.atom(n, lo, hi)

    # ------------------------------------------------------------ booleans

    def visit_bool(self, n: Node, args: list) -> _Bool:
        op = n.op
        if op == "const":
            return _Bool(n.attr, not n.attr)
        if op == "param" and n.attr in self.params:
            v = bool(self.params[n.attr])
            return _Bool(v, not v)
        if op == "not":
            x = args[0]
            return _Bool(x.may_f, x.may_t, x.nconj, x.conj)
        if op in ("and", "or", "xor"):
            a, b = args
            if op == "and":
                conj = (a.conj + b.conj)[:_MAX_CONSTRAINTS]
                may_t = a.may_t & b.may_t
                # where one side surely holds, three-valued logic is already exact
                unsure = may_t & a.may_f & b.may_f
                if len(conj) > 1 and bool(unsure.any()):  # both may hold, but together?
                    may_t = may_t & _feasible(conj, self.ranges, unsure)
                return _Bool(may_t, a.may_f | b.may_f, conj, ())
            if op == "or":
                nconj = (a.nconj + b.nconj)[:_MAX_CONSTRAINTS]
                may_f = a.may_f & b.may_f
                unsure = may_f & a.may_t & b.may_t
                if len(nconj) > 1 and bool(unsure.any()):
                    may_f = may_f & _feasible(nconj, self.ranges, unsure)
                return _Bool(a.may_t | b.may_t, may_f, (), nconj)
            return self.bool_eq(n, a, b, negate=True)
        if op == "where":
            c, a, b = args
            if n.args[1] == n.args[2]:
                return a
            return _Bool((c.may_t & a.may_t) | (c.may_f & b.may_t), (c.may_t & a.may_f) | (c.may_f & b.may_f))
        if op == "cast":  # x != 0
            x = args[0]
            if isinstance(x, _Int):
                return _Bool((x.lo != 0) | (x.hi != 0), (x.lo <= 0) & (x.hi >= 0))
            return _Bool((x.lo != 0) | (x.hi != 0) | x.nan, (x.lo <= 0) & (x.hi >= 0))
        if op in ("lt", "le", "gt", "ge", "eq", "ne"):
            a, b = args
            if isinstance(a, _Bool):
                return self.bool_eq(n, a, b, negate=op == "ne")
            if isinstance(a, _Int):
                return self.int_compare(n, a, b)
            return self.float_compare(n, a, b)
        if op == "isnan":  # true only where the operand may be NaN
            return _Bool(args[0].nan, True)
        return _Bool(True, True)  # loads, unbound params, anything else

    def bool_eq(self, n: Node, a: _Bool, b: _Bool, negate: bool) -> _Bool:
        if n.args[0] == n.args[1]:
            return _Bool(not negate, negate)  # x == x is true, x != x false
        same = (a.may_t & b.may_t) | (a.may_f & b.may_f)
        differ = (a.may_t & b.may_f) | (a.may_f & b.may_t)
        return _Bool(differ, same) if negate else _Bool(same, differ)

    def int_compare(self, n: Node, a: _Int, b: _Int) -> _Bool:
        d = self.combine(a, b, -1)  # exact range of a - b when both are affine in the indices
        out = _compare_range(n.op, d.lo, d.hi)
        # the same comparison as constraints `... >= 0` (integers: d < 0 is -d - 1 >= 0)
        neg = {k: -c for k, c in d.coeffs.items()}
        ge = (d.coeffs, d.const)  # d >= 0
        le = (neg, -d.const)  # d <= 0
        gt = (d.coeffs, d.const - 1)  # d >= 1
        lt = (neg, -d.const - 1)  # d <= -1
        out.conj, out.nconj = {
            "ge": ((ge,), (lt,)),
            "gt": ((gt,), (le,)),
            "le": ((le,), (gt,)),
            "lt": ((lt,), (ge,)),
            "eq": ((ge, le), ()),
            "ne": ((), (ge, le)),
        }[n.op]
        return out

    def float_compare(self, n: Node, a: _Float, b: _Float) -> _Bool:
        a = self.infinite_const(n.args[0]) or a
        b = self.infinite_const(n.args[1]) or b
        nan = a.nan | b.nan
        op = n.op
        if n.args[0] == n.args[1]:  # x op x: decided unless x may be NaN
            if op in ("lt", "gt"):
                return _Bool(False, True)
            if op == "ne":
                return _Bool(a.nan, True)
            return _Bool(True, a.nan)
        if op in ("gt", "ge"):
            a, b = b, a
            op = "lt" if op == "gt" else "le"
        if op == "lt":
            return _Bool(a.lo < b.hi, (a.hi >= b.lo) | nan)
        if op == "le":
            return _Bool(a.lo <= b.hi, (a.hi > b.lo) | nan)
        overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
        point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
        if op == "eq":
            return _Bool(overlap, ~point | nan)
        return _Bool(~point | nan, overlap)

    def infinite_const(self, node: Node) -> _Float | None:
        """An infinite constant (or bound parameter) as the exact point it is. _Float otherwise
        keeps only finite intervals, as arithmetic on infinities can make NaN; a comparison cannot."""
        v = node.attr if node.op == "const" else self.params.get(node.attr) if node.op == "param" else None
        if isinstance(v, bool) or not isinstance(v, float) or not math.isinf(v):
            return None
        point = object.__new__(_Float)
        point.lo = point.hi = _f(v)
        point.nan, point.int_exact = torch.tensor(False), False
        return point

    # ------------------------------------------------------------ floats

    def visit_float(self, n: Node, args: list) -> _Float:
        op = n.op
        if op == "const" or (op == "param" and n.attr in self.params):
            return _float_const(float(n.attr if op == "const" else self.params[n.attr]))
        if op == "cast":
            return self.float_cast(args[0])
        if op in ("add", "sub", "mul", "div", "min", "max", "floordiv"):
            return self.float_binary(op, *args)
        if op in ("neg", "abs"):
            x = args[0]
            if op == "neg":
                return _Float(-x.hi, -x.lo, x.nan, x.int_exact)
            lo = torch.where(x.lo >= 0, x.lo, torch.where(x.hi <= 0, -x.hi, 0.0))
            return _Float(lo, torch.maximum(x.lo.abs(), x.hi.abs()), x.nan, x.int_exact)
        if op in _MONOTONE:
            return self.float_monotone(op, args[0])
        if op in ("sin", "cos"):
            return _Float(-1.0 - _TRANS_SLACK, 1.0 + _TRANS_SLACK, args[0].nan)
        if op == "sign":  # -1, 0 or 1 (NaN stays possible where the operand may be NaN)
            return _Float(_f(-1.0), _f(1.0), args[0].nan, True)
        if op == "where":
            c, a, b = args
            lo = torch.where(c.must_t, a.lo, torch.where(c.must_f, b.lo, torch.minimum(a.lo, b.lo)))
            hi = torch.where(c.must_t, a.hi, torch.where(c.must_f, b.hi, torch.maximum(a.hi, b.hi)))
            nan = (c.may_t & a.nan) | (c.may_f & b.nan)
            return _Float(lo, hi, nan, a.int_exact and b.int_exact)
        return _Float(-_INF, _INF, True)  # score, loads, unbound params, pow, mod, ...

    def float_cast(self, x) -> _Float:
        if isinstance(x, _Bool):
            return _Float(torch.where(x.may_f, 0.0, 1.0), torch.where(x.may_t, 1.0, 0.0), False, True)
        exact = _within(x.lo, x.hi, _F32_INT)
        lo, hi = (x.lo, x.hi) if exact else _widen(x.lo, x.hi, 2.0**-23)  # rounding is monotone
        return _Float(lo, hi, False, exact)

    def float_binary(self, op: str, a: _Float, b: _Float) -> _Float:
        nan = a.nan | b.nan
        if op in ("min", "max"):
            f = torch.minimum if op == "min" else torch.maximum
            return _Float(f(a.lo, b.lo), f(a.hi, b.hi), nan, a.int_exact and b.int_exact)
        if op == "add":
            lo, hi = a.lo + b.lo, a.hi + b.hi
        elif op == "sub":
            lo, hi = a.lo - b.hi, a.hi - b.lo
        else:
            if op in ("div", "floordiv"):
                zero = (b.lo <= 0) & (b.hi >= 0)  # x / 0 is inf or NaN
                nan = nan | zero
                b_lo, b_hi = torch.where(zero, 1.0, b.lo), torch.where(zero, 1.0, b.hi)
                quad = (a.lo / b_lo, a.lo / b_hi, a.hi / b_lo, a.hi / b_hi)
            else:
                quad = (a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi)
            corners = torch.stack(torch.broadcast_tensors(*quad))
            lo, hi = corners.amin(0), corners.amax(0)
        exact = op in ("add", "sub", "mul") and a.int_exact and b.int_exact and _within(lo, hi, _F32_INT)
        if not exact:
            lo, hi = _widen(lo, hi, _ARITH_SLACK)
        if op == "floordiv":
            lo, hi = torch.floor(lo), torch.floor(hi)
            exact = True
        return _Float(lo, hi, nan, exact)

    def float_monotone(self, op: str, x: _Float) -> _Float:
        fn, domain_lo, increasing = _MONOTONE[op]
        nan = x.nan | (x.lo < domain_lo) if domain_lo is not None else x.nan
        lo_in = torch.where(nan, 1.0, x.lo)
        hi_in = torch.where(nan, 1.0, x.hi)
        lo, hi = fn(lo_in), fn(hi_in)
        if not increasing:
            lo, hi = hi, lo
        lo, hi = _widen(lo, hi, _TRANS_SLACK)
        return _Float(lo, hi, nan)


# op -> (function, smallest argument outside which NaN/inf may appear, increasing?)
_MONOTONE = {
    "exp": (torch.exp, None, True),
    "exp2": (torch.exp2, None, True),
    "tanh": (torch.tanh, None, True),
    "sigmoid": (torch.sigmoid, None, True),
    "erf": (torch.erf, None, True),
    "log": (torch.log, 1e-30, True),
    "log2": (torch.log2, 1e-30, True),
    "sqrt": (torch.sqrt, 0.0, True),
    "rsqrt": (torch.rsqrt, 1e-30, False),
    "log1p": (torch.log1p, -1.0 + 1e-6, True),
    "atan": (torch.atan, None, True),
    # rounding to an integral value: non-decreasing (the widening keeps the bounds sound)
    "floor": (torch.floor, None, True),
    "ceil": (torch.ceil, None, True),
    "round": (torch.round, None, True),
    "trunc": (torch.trunc, None, True),
}


def _float_const(v: float) -> _Float:
    if math.isnan(v):
        return _Float(-_INF, _INF, True)
    v32 = torch.tensor(v, dtype=torch.float64).to(torch.float32).item()  # what a float32 kernel sees
    exact = math.isfinite(v) and v == v32 and v == math.floor(v) and abs(v) <= _F32_INT
    return _Float(min(v, v32), max(v, v32), False, exact)


def _compare_range(op: str, lo: torch.Tensor, hi: torch.Tensor) -> _Bool:
    """The comparison `d <op> 0` for d in lo..hi."""
    if op == "lt":
        return _Bool(lo < 0, hi >= 0)
    if op == "le":
        return _Bool(lo <= 0, hi > 0)
    if op == "gt":
        return _Bool(hi > 0, lo <= 0)
    if op == "ge":
        return _Bool(hi >= 0, lo < 0)
    zero = (lo <= 0) & (hi >= 0)
    point = (lo == 0) & (hi == 0)
    if op == "eq":
        return _Bool(zero, ~point)
    return _Bool(~point, zero)


def _feasible(constraints, ranges, tiles: torch.Tensor) -> torch.Tensor:
    """False on tiles where no integer point of the box satisfies every constraint.

    Bounds propagation: each constraint sum(c * x) + d >= 0 gives, for every variable
    x_j, c_j * x_j >= -d - max(rest), which tightens x_j's range (rounding inward,
    which is exact for integers). An emptied range proves infeasibility. Atoms are
    treated as free variables over their ranges, a relaxation, so "infeasible" is
    always sound; "feasible" only means "not proven infeasible".

    Before propagating, each constraint is divided by the gcd of its coefficients
    (rounding the constant down: an integer cut), and one round of Fourier-Motzkin
    elimination adds the pairwise sums that cancel a variable, so that `q >= kv`
    and `kv > q` are refuted at once instead of one step per round.

    Only the tiles selected by the bool mask `tiles` are examined (gathered into a
    flat batch, as they are usually few); the rest are reported feasible."""
    constraints = _eliminate([_normalize(c) for c in constraints])
    keys = {key for coeffs, _ in constraints for key in coeffs}
    parts = [tiles] + [t for key in keys for t in ranges[key]] + [_f(c) for _, c in constraints]
    shape = torch.broadcast_tensors(*parts)[0].shape  # views only: no copies
    sel = tiles.expand(shape)

    def gather(t):
        return _f(t).expand(shape)[sel]

    box = {key: (gather(ranges[key][0]), gather(ranges[key][1])) for key in keys}
    consts = [gather(const) for _, const in constraints]
    ok = torch.ones_like(consts[0], dtype=torch.bool)
    for _ in range(_PROPAGATION_ROUNDS):
        for (coeffs, _), const in zip(constraints, consts):
            tops = {}  # each variable's largest contribution c * x over the box
            mag = const.abs()
            for key, c in coeffs.items():
                lo, hi = box[key]
                tops[key] = float(c) * (hi if c > 0 else lo)
                m = torch.maximum(lo.abs(), hi.abs())
                mag = mag + abs(float(c)) * torch.where(m.isfinite(), m, _INF)
            exact = mag <= _BIG  # beyond this, float64 sums may round: do not tighten
            total = const + sum(tops.values(), torch.tensor(0.0, dtype=torch.float64))
            ok = ok & ~(exact & (total < 0))
            for key, c in coeffs.items():
                rest = const + sum((t for k2, t in tops.items() if k2 != key), torch.tensor(0.0, dtype=torch.float64))
                lo, hi = box[key]
                if c > 0:  # x >= ceil(-rest / c)
                    lo = torch.where(exact, torch.maximum(lo, torch.ceil(-rest / float(c))), lo)
                else:  # x <= floor(-rest / c)
                    hi = torch.where(exact, torch.minimum(hi, torch.floor(-rest / float(c))), hi)
                box[key] = (lo, hi)
                ok = ok & (lo <= hi)
    out = torch.ones(shape, dtype=torch.bool)
    out[sel] = ok
    return out


def _normalize(constraint):
    """sum(c * x) + d >= 0 with g = gcd(c) > 1 is sum(c/g * x) + floor(d / g) >= 0 on integers."""
    coeffs, const = constraint
    g = 0
    for c in coeffs.values():
        g = math.gcd(g, abs(c))
    if g <= 1:
        return constraint
    const = const // g if isinstance(const, int) else torch.floor(const / g)
    return {k: c // g for k, c in coeffs.items()}, const


def _eliminate(constraints):
    """The constraints plus, for each pair with opposite signs on a variable, the positive
    combination of the two that cancels it (an implied constraint)."""
    out = list(constraints)
    for i, (ci, di) in enumerate(constraints):
        for cj, dj in constraints[i + 1 :]:
            for key in ci.keys() & cj.keys():
                a, b = ci[key], cj[key]
                if a * b >= 0:
                    continue
                mi, mj = abs(b), abs(a)
                coeffs = {k: mi * ci.get(k, 0) + mj * cj.get(k, 0) for k in ci.keys() | cj.keys()}
                coeffs = {k: c for k, c in coeffs.items() if c}
                out.append(_normalize((coeffs, mi * di + mj * dj)))
                if len(out) >= _MAX_DERIVED:
                    return out
    return out
