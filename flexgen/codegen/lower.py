"""Lowering: IR expressions -> readable CUDA C++ device functions.

`lower_mods(spec)` returns the C text a template pastes in (see `LoweredMods`):

    struct ModArgs { ... };                        // buffers, strides, scalar params, grads
    float score_mod(float score, int b, int h, int q_idx, int kv_idx, const ModArgs& args);
    bool  mask_mod(int b, int h, int q_idx, int kv_idx, const ModArgs& args);
    float score_mod_bwd(..., float grad_out, const ModArgs& args);   // kind "bwd" only
    float score_mod_bwd(..., const ModArgs& args, FlexgenGradSlots& grads);  // ... with buffer gradients
                                                   // (deterministic mode: other slots, same signature)

Semantics follow flexgen.dsl.evaluate exactly: integer `//` and `%` floor like
Python (small helper functions; C's unsigned `/` and `%` where the dividend's range is >= 0 and the
divisor's >= 1, where flooring and truncating agree), floats are float32, int32/int64 are int/long long.
Integer `+ - *`, negation and abs wrap around like torch's int32/int64 tensors: where the
operands' value ranges (indices are in [0, 2**31 - 1]) show that no overflow can happen the
plain C operator is written, elsewhere `fg_add(a, b)` etc., which compute in unsigned
arithmetic (signed overflow is undefined in C++, so a compiler may fold `q + c > q` to true).
A float cast to an integer is `fg_float_to_int(x)`: truncation toward zero, saturating, NaN -> 0.
Float multiplies are written `__fmul_rn(a, b)` so the compiler cannot fuse them
with an add into an FMA: the result then rounds exactly like torch's float32.
No CUDA header is needed: 16-bit buffers are read as raw `unsigned short` bits.
"""
from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..dsl import inline_asm
from ..dsl.affine import AffineScore
from ..dsl.folds import score_fold
from ..dsl.graph import postorder
from ..dsl.ir import INT_RANGE, BufferSpec, DType, IRTypeError, Node, buffers_of, inputs_of, params_of
from ..dsl.ir import check_size as ir_check_size
from ..dsl.printer import format_node, pretty, pretty_lines
from ..dsl.softcap import SoftcapScore

CTYPE = {DType.BOOL: "bool", DType.INT32: "int", DType.INT64: "long long", DType.FLOAT32: "float"}

# torch dtype name -> (C element type in memory, how to turn an element expression into the IR value)
STORAGE = {
    "float32": ("float", "{}"),
    "float64": ("double", "(float){}"),
    "float16": ("unsigned short", "fg_half_to_float({})"),
    "bfloat16": ("unsigned short", "fg_bf16_to_float({})"),
    "int64": ("long long", "{}"),
    "int32": ("int", "{}"),
    "int16": ("short", "(int){}"),
    "int8": ("signed char", "(int){}"),
    "uint8": ("unsigned char", "(int){}"),
    "bool": ("bool", "{}"),
}
_CONVERSION_HELPER = {"float16": "fg_half_to_float", "bfloat16": "fg_bf16_to_float"}

SCORE_SIGNATURE = (
    "__device__ __forceinline__ float score_mod(float score, int b, int h, int q_idx, int kv_idx, const ModArgs& args)"
)
MASK_SIGNATURE = "__device__ __forceinline__ bool mask_mod(int b, int h, int q_idx, int kv_idx, const ModArgs& args)"
SCORE_BWD_SIGNATURE = (
    "__device__ __forceinline__ float score_mod_bwd(float score, int b, int h, int q_idx, int kv_idx, "
    "float grad_out, const ModArgs& args)"
)
SCORE_BWD_GRADS_SIGNATURE = SCORE_BWD_SIGNATURE[:-1] + ", FlexgenGradSlots& grads)"

_CPP_KEYWORDS = frozenset(
    """alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t char32_t
    class compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield
    decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
    goto if inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private
    protected public register reinterpret_cast requires return short signed sizeof static static_assert
    static_cast struct switch template this thread_local throw true try typedef typeid typename union
    unsigned using virtual void volatile wchar_t while xor xor_eq""".split()
)


class LoweringError(ValueError):
    pass


@dataclass(frozen=True)
class ArgField:
    """One member of `struct ModArgs`, and where the host gets its value.

    source: ("buffer_ptr", buf) | ("buffer_stride", buf, dim) | ("param", name)
            | ("grad_ptr", buf) | ("grad_stride", buf, dim) | ("padding",)
    """

    name: str
    ctype: str
    source: tuple


@dataclass(frozen=True)
class LoweredMods:
    mod_args_decl: str  # helper device functions the variant uses, then `struct ModArgs { ... };`
    score_mod_fn: str
    mask_mod_fn: str
    score_mod_bwd_fn: str  # a comment only, unless spec.kind == "bwd"; with grad_sites, FlexgenGradSlots first
    fields: tuple[ArgField, ...]
    buffers: tuple[BufferSpec, ...]
    params: tuple[tuple[str, DType], ...]
    grad_buffers: tuple[str, ...]
    helpers: tuple[str, ...]  # names of the helper functions in mod_args_decl
    mask_reads_buffers: bool = False  # the forward then evaluates the mask before QK^T (register pressure)
    grad_sites: int = 0  # buffer-gradient sites in score_mod_bwd: > 0 means it takes `FlexgenGradSlots& grads`
    # kind "fwd", score_mods of a shape the forward folds into terms per row, column and head ("" for others):
    score_affine_fn: str = ""  # affine in the indices (ALiBi, dsl/affine.py): score_mod_affine, its coefficients
    score_softcap_fn: str = ""  # outer * tanh(inner * score) (dsl/softcap.py): score_mod_softcap, the two factors

    @property
    def code(self) -> str:
        """Everything, in dependency order (for templates that paste one block)."""
        return "\n\n".join([self.mod_args_decl, self.score_mod_fn, self.mask_mod_fn, self.score_mod_bwd_fn])


# ---------------------------------------------------------------- names


# Identifiers a ModArgs member must not be named: macros a kernel's translation unit may define
# (NVRTC's, libc's in the host tests, flexgen's own FG_* / FLEXGEN_*: a member `NULL` would be
# macro-expanded), CUDA's built-in variables and common device functions.
_C_RESERVED = _CPP_KEYWORDS | frozenset(
    """NULL EOF INFINITY NAN HUGE_VAL HUGE_VALF assert offsetof errno stdin stdout stderr CHAR_BIT INT_MAX
    INT_MIN UINT_MAX LLONG_MAX LLONG_MIN FLT_MAX FLT_MIN FLT_EPSILON DBL_MAX DBL_MIN DBL_EPSILON M_PI M_E
    min max isnan isinf isfinite signbit threadIdx blockIdx blockDim gridDim warpSize typeof restrict""".split()
)


def c_name(name: str) -> str:
    """A C identifier for a buffer or parameter name: the name itself unless C++, CUDA or a macro
    claims it (then suffixed, or prefixed with v_ where a leading underscore makes it reserved)."""
    out = re.sub(r"[^0-9A-Za-z_]", "_", name)
    if not out or out[0].isdigit():
        out = "_" + out
    if out.startswith("__") or re.match(r"_[A-Z]", out):
        return "v_" + out.lstrip("_")
    if out in _C_RESERVED or re.match(r"(FG|FLEXGEN)_", out):
        return out + "_"
    return out


def _member_names(bufs: list[BufferSpec], params: dict[str, DType]) -> dict[str, str]:
    """Buffer / parameter name -> C member name, distinct also from every derived member
    (`bias_stride0`, `bias_grad`, ...)."""
    taken: set[str] = {"unused_"}
    names: dict[str, str] = {}
    ndims = {b.name: b.ndim for b in bufs}
    for name in [b.name for b in bufs] + list(params):
        base = c_name(name)
        member, n = base, 2
        while True:
            derived = {member}
            if name in ndims:
                derived |= {f"{member}_grad"} | {f"{member}{g}_stride{d}" for g in ("", "_grad") for d in range(ndims[name])}
            if not derived & taken:
                break
            member, n = f"{base}_{n}", n + 1
        taken |= derived
        names[name] = member
    return names


def _comment(text: str) -> str:
    """`text` made safe for a // comment: one line of printable ASCII, no backslash (a line splice
    would comment out the next line) and no `*/`."""
    return re.sub(r"[^\x20-\x7e]", "?", text).replace("\\", "/").replace("*/", "* /")


# ---------------------------------------------------------------- literals


def _to_f32(x: float) -> float:
    """Round a double to float32 (nearest even), overflowing to inf like torch does."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        # beyond float32's range: inf, unless it still rounds down to FLT_MAX
        return math.copysign(math.inf if abs(x) >= 3.4028235677973366e38 else 3.4028234663852886e38, x)


def float_literal(value: float) -> str:
    """Shortest C literal that parses to the same float32 that torch rounds `value` to."""
    f = _to_f32(value)
    if math.isnan(f):
        return "__uint_as_float(0x7fc00000u)"
    if math.isinf(f):
        return "__uint_as_float(0x7f800000u)" if f > 0 else "__uint_as_float(0xff800000u)"
    shortest = next(float(t) for t in (f"{f:.{p}g}" for p in range(1, 10)) if _to_f32(float(t)) == f)
    text = repr(shortest).replace("e+", "e")  # 100.0, 0.1, 1e20, 1.5e-05
    return f"{text}f" if not text.startswith("-") else f"({text}f)"


def int_literal(value: int, dtype: DType) -> str:
    if dtype is DType.INT64:
        value = (value + 2**63) % 2**64 - 2**63
        if value == -(2**63):
            return "(-9223372036854775807LL - 1)"
        return f"{value}LL" if value >= 0 else f"({value}LL)"
    value = (value + 2**31) % 2**32 - 2**31
    if value == -(2**31):
        return "(-2147483647 - 1)"
    return str(value) if value >= 0 else f"({value})"


# ---------------------------------------------------------------- expressions


# exp, log, tanh, sigmoid and division go through fg_* helpers: on the GPU they use the
# special-function unit (a few ulp, far below bf16/fp16 rounding of P) unless the kernel is
# built with the `precise_math` option; on the host (tests) they are the libm functions.
_UNARY_FLOAT_FN = {
    "exp": "fg_exp", "exp2": "exp2f", "log": "fg_log", "log2": "fg_log2", "sqrt": "sqrtf", "rsqrt": "rsqrtf",
    "tanh": "fg_tanh", "sigmoid": "fg_sigmoid", "sin": "sinf", "cos": "cosf", "tan": "tanf", "erf": "erff",
    "log1p": "log1pf", "atan": "atanf", "floor": "floorf", "ceil": "ceilf", "trunc": "truncf",
    "round": "rintf",  # the default rounding mode: half to even, like torch.round
    "round_to_fp16": "fg_round_fp16", "round_to_bf16": "fg_round_bf16", "isnan": "fg_isnan",
}
_INFIX = {"add": "+", "sub": "-", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
          "ne": "!=", "and": "&", "or": "|", "xor": "!=",
          "bitand": "&", "bitor": "|", "bitxor": "^"}  # no short-circuit: branch-free masks


def _unparen(text: str) -> str:
    """Drop one pair of parentheses that encloses the whole expression."""
    if not (text.startswith("(") and text.endswith(")")):
        return text
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(text) - 1:
            return text
    return text[1:-1]


def _call(fn: str, args: list[str]) -> str:
    return f"{fn}({', '.join(_unparen(x) for x in args)})"


_INDEX_RANGE = (0, 2**31 - 1)  # b, h, q_idx, kv_idx: int32 indices, never negative
_WRAPPING = {"add": "fg_add", "sub": "fg_sub", "mul": "fg_mul"}


def _fits(lo: int, hi: int, dtype: DType) -> bool:
    t_lo, t_hi = INT_RANGE[dtype]
    return t_lo <= lo and hi <= t_hi


def _int_range(n: Node, args: list[tuple[int, int] | None]) -> tuple[int, int] | None:
    """Exact bounds of an integer node's values if its C operator cannot overflow, else None
    (the node is then computed with a wrapping helper, and its value may be anything)."""
    op = n.op
    if op == "const":
        return (int(n.attr), int(n.attr))
    if op == "input":
        return _INDEX_RANGE
    if op == "cast":
        src = n.args[0].dtype
        if src is DType.BOOL:
            return (0, 1)
        return args[0] if src.is_int and args[0] is not None and _fits(*args[0], n.dtype) else None
    if op in ("add", "sub", "mul", "neg", "abs", "min", "max", "where"):
        if any(a is None for a in args[-2:]):
            return None
        if op == "neg":
            lo, hi = -args[0][1], -args[0][0]
        elif op == "abs":
            lo, hi = args[0]
            lo, hi = (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
        elif op in ("min", "max", "where"):
            (alo, ahi), (blo, bhi) = args[-2:]
            pick = min if op == "min" else max if op == "max" else None
            lo, hi = (pick(alo, blo), pick(ahi, bhi)) if pick else (min(alo, blo), max(ahi, bhi))
        else:
            (alo, ahi), (blo, bhi) = args
            if op == "add":
                lo, hi = alo + blo, ahi + bhi
            elif op == "sub":
                lo, hi = alo - bhi, ahi - blo
            else:
                corners = (alo * blo, alo * bhi, ahi * blo, ahi * bhi)
                lo, hi = min(corners), max(corners)
        return (lo, hi) if _fits(lo, hi, n.dtype) else None
    if op in ("floordiv", "mod", "fmod"):
        return _division_range(op, args[0], args[1], n.dtype)
    if op == "sign":
        return (-1, 1)
    return None


def _division_range(op: str, a: tuple[int, int] | None, b: tuple[int, int] | None,
                    dtype: DType) -> tuple[int, int] | None:
    """Bounds of integer `//`, `%` (floored, like torch) or fmod (truncated) over divisors that exclude 0. A dividend
    of unknown range is any value of its type: the helpers take the wrapped value, and only INT_MIN // -1 leaves the
    type (then None)."""
    if b is None or b[0] <= 0 <= b[1]:
        return None
    (alo, ahi), (blo, bhi) = a if a is not None else INT_RANGE[dtype], b
    if op == "floordiv":  # monotone in each operand on either side of 0: the extremes are at the corners
        corners = (alo // blo, alo // bhi, ahi // blo, ahi // bhi)
        lo, hi = min(corners), max(corners)
        return (lo, hi) if _fits(lo, hi, dtype) else None
    if op == "mod":  # the divisor's sign, below its magnitude; a dividend already in [0, b) is the result
        if blo > 0:
            return (alo, ahi) if 0 <= alo and ahi < blo else (0, bhi - 1 if alo < 0 else min(ahi, bhi - 1))
        return (alo, ahi) if bhi < alo and ahi <= 0 else (blo + 1 if ahi > 0 else max(alo, blo + 1), 0)
    top = max(abs(blo), abs(bhi)) - 1  # fmod: the dividend's sign, below the divisor's magnitude
    return (0 if alo >= 0 else max(alo, -top), 0 if ahi <= 0 else min(ahi, top))


# A conjunction `a and b and ...` is emitted as one `&` over its terms, up to this many (a longer chain is split
# into named parts, as long expressions are), so that two bounds of one difference pair up wherever they sit.
_MAX_CONJUNCTS = 32
_LINEAR_ATOMS = 4  # a compare's sides, as a sum of terms: at most this many distinct terms (a band needs three)


def _is_true(n: Node) -> bool:
    return n.op == "const" and n.dtype is DType.BOOL and n.attr is True


def _difference_at_least(form) -> tuple[Node, Node, int] | None:
    """(x, y, low) where the compare `form` (from _Body._at_most_zero) reads `x - y >= low` for a constant low
    (`x >= y`, `0 <= x - y`, `x >= y - 1`, ...)."""
    if form is None or len(form[0]) != 2:
        return None
    (a, ca), (b, cb) = form[0].values()
    if {ca, cb} != {1, -1}:
        return None
    return (a, b, form[1]) if ca == -1 else (b, a, form[1])


_MAX_INLINE = 240  # characters of C an expression may grow to before it is named


class _Body:
    """Statements for one device function computing several roots that share temporaries.

    A node used more than once (counting every root as one use) gets one named
    `const` temporary; everything else is inlined into its single user.
    """

    def __init__(self, roots: list[Node], names: dict[str, str], helpers: set[str]):
        self.names = names  # buffer / param name -> C member name
        self.helpers = helpers
        self.lines: list[str] = []
        self.expr: dict[str, str] = {}
        self.ranges: dict[str, tuple[int, int] | None] = {}  # integer nodes whose C operator cannot overflow
        self.temps = 0
        notes: dict[str, tuple[str, int]] = {}  # each node's text, cut at 80 characters (linear memory)
        order: list[Node] = []
        seen: set[str] = set()
        uses: dict[str, int] = {}
        for root in roots:
            uses[root.digest] = uses.get(root.digest, 0) + 1
            stack: list[tuple[Node, bool]] = [(root, False)]
            while stack:  # postorder across all roots, each distinct node once
                node, expanded = stack.pop()
                if node.digest in seen:
                    continue
                if expanded:
                    seen.add(node.digest)
                    order.append(node)
                    for a in node.args:
                        uses[a.digest] = uses.get(a.digest, 0) + 1
                else:
                    stack.append((node, True))
                    stack.extend((a, False) for a in reversed(node.args) if a.digest not in seen)
        # Conjunctions: an `and` used once by another `and` is written as part of it, in one flat list of terms.
        self.conjuncts: dict[str, list[Node]] = {}
        absorbed: set[str] = set()
        for node in order:
            if node.op != "and":
                continue
            terms: list[Node] = []
            for a in node.args:
                inner = self.conjuncts.get(a.digest)
                if inner is not None and uses[a.digest] == 1 and len(terms) + len(inner) + 1 <= _MAX_CONJUNCTS:
                    absorbed.add(a.digest)
                    terms += inner
                elif not _is_true(a):  # and_masks' chains start from True
                    terms.append(a)
            self.conjuncts[node.digest] = terms
        for node in order:
            if node.dtype.is_int:
                self.ranges[node.digest] = _int_range(node, [self.ranges.get(a.digest) for a in node.args])
            notes[node.digest] = format_node(node, [notes[a.digest] for a in node.args], 80)
            if node.digest in absorbed:  # its terms are in its user's text
                self.expr[node.digest] = ""
                continue
            text = self._format(node, [self.expr[a.digest] for a in node.args])
            # shared nodes get a temporary, and so does a long expression (keeps each line readable
            # and the work linear: a 1000-deep chain is not one 1000-deep C expression)
            if (uses[node.digest] > 1 or len(text) > _MAX_INLINE) and node.op not in ("input", "const", "param"):
                name = f"t{self.temps}"
                self.temps += 1
                note = notes[node.digest][0]
                note = f"  // {_comment(note)}" if len(note) <= 80 and note != _unparen(text) else ""
                self.lines.append(f"    const {CTYPE[node.dtype]} {name} = {_unparen(text)};{note}")
                text = name
            self.expr[node.digest] = text

    def __getitem__(self, node: Node) -> str:
        return self.expr[node.digest]

    def _helper(self, name: str, section: str | None = None) -> str:
        """`name`, a helper function from score_math.cuh's section `section` (default: its own)."""
        self.helpers.add(section or name)
        return name

    def _format(self, n: Node, a: list[str]) -> str:
        op = n.op
        if op == "input":
            return n.attr
        if op == "const":
            if n.dtype is DType.BOOL:
                return "true" if n.attr else "false"
            if n.dtype is DType.FLOAT32:
                lit = float_literal(n.attr)
                return lit
            return int_literal(n.attr, n.dtype)
        if op == "param":
            member = f"args.{self.names[n.attr]}"
            return f"({member} != 0)" if n.dtype is DType.BOOL else member
        if op == "load":
            return self._load(n, a)
        if op == "cast":
            return self._cast(n.args[0].dtype, n.dtype, a[0])
        if op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op == inline_asm.OP:
            return _call(self._helper(_asm_helper(n)), a)
        is_float = n.args[0].dtype is DType.FLOAT32 if n.args else False
        # an integer + - * neg abs whose operands' ranges rule out overflow keeps C's operator
        exact = n.dtype.is_int and self.ranges.get(n.digest) is not None
        if op == "neg":
            return f"(-{a[0]})" if is_float or exact else _call(self._helper("fg_neg", "fg_wrap"), a)
        if op == "not":
            return f"(!{a[0]})"
        if op == "abs":
            return _call("fabsf", a) if is_float else _call(self._helper("fg_abs"), a)
        if op == "sign":
            return _call(self._helper("fg_sign"), a)
        if op in _UNARY_FLOAT_FN:
            fn = _UNARY_FLOAT_FN[op]
            if fn.startswith("fg_"):
                self._helper(fn)
            return _call(fn, a)
        if op == "mul":
            if is_float:
                return _call("__fmul_rn", a)
            return f"({a[0]} * {a[1]})" if exact else _call(self._helper("fg_mul", "fg_wrap"), a)
        if op == "div":
            return _call(self._helper("fg_div"), a)
        if op in ("floordiv", "mod", "fmod") and not is_float and self._nonnegative_quotient(n):
            return self._unsigned_division(n, a)
        if op == "floordiv":
            return f"floorf({a[0]} / {a[1]})" if is_float else _call(self._helper("fg_floordiv"), a)
        if op == "mod":
            return _call(self._helper("fg_fmod_floor" if is_float else "fg_mod"), a)
        if op == "fmod":
            if is_float:
                return _call("fmodf", a)
            if n.args[1].op == "const" and n.args[1].attr not in (0, -1):  # C's remainder is torch.fmod's
                return f"({a[0]} % {a[1]})"
            return _call(self._helper("fg_fmod"), a)  # ... except INT_MIN % -1, undefined in C
        if op == "pow":
            return _call("powf", a)
        if op in ("min", "max"):
            return _call(self._helper("fg_" + op), a)
        if op in _WRAPPING and not is_float and not exact:
            return _call(self._helper(_WRAPPING[op], "fg_wrap"), a)
        if op == "and":
            return self._conjunction(n)
        if op in ("lt", "le", "gt", "ge") and not is_float:
            window = self._abs_window(n)
            if window is not None:
                return window
        if op in _INFIX:
            return f"({a[0]} {_INFIX[op]} {a[1]})"
        raise LoweringError(f"lowering has no rule for IR op {op!r}")

    # ---- integer division

    def _nonnegative_quotient(self, n: Node) -> bool:
        """Whether the dividend's range is >= 0 and the divisor's >= 1: floored and truncated division then agree,
        and C's unsigned `/` and `%` compute them (the cheapest form, for a constant divisor a multiply-high)."""
        a, b = (self.ranges.get(x.digest) for x in n.args)
        return a is not None and b is not None and a[0] >= 0 and b[0] >= 1

    def _unsigned_division(self, n: Node, a: list[str]) -> str:
        """`//`, `%` or fmod of a dividend >= 0 by a divisor >= 1, in unsigned arithmetic, cast back to the signed
        type (the quotient and remainder fit it)."""
        unsigned, suffix = ("unsigned", "u") if n.dtype is DType.INT32 else ("unsigned long long", "ull")
        divisor = n.args[1]
        right = f"{divisor.attr}{suffix}" if divisor.op == "const" else f"({unsigned}){a[1]}"
        return f"({CTYPE[n.dtype]})(({unsigned}){a[0]} {'/' if n.op == 'floordiv' else '%'} {right})"

    # ---- conjunctions and bands

    def _conjunction(self, n: Node) -> str:
        """The terms of a conjunction `&`-ed (no short circuit: branch-free masks), with each pair of bounds
        `x - y >= low` and `x - y < c` (or `<= c`, in any of the spellings `_at_most_zero` reads) over a difference
        that cannot overflow written as one unsigned compare (fg_band) where the first of the two stood: low 0 and
        any bound, or a constant low and a constant bound (a range, such as a window of tiles `|x - y| <= 1`)."""
        terms = self.conjuncts[n.digest]
        forms = [self._at_most_zero(t) for t in terms]
        bands: dict[int, str] = {}
        paired: set[int] = set()
        for i, lower in enumerate(forms):
            xy = _difference_at_least(lower)
            if xy is None or i in paired:
                continue
            for j, upper in enumerate(forms):
                band = None if j == i or j in paired or upper is None else self._band(*xy, upper)
                if band is not None:
                    paired |= {i, j}
                    bands[min(i, j)] = band
                    break
        parts = [bands.get(i, self.expr[t.digest]) for i, t in enumerate(terms) if i in bands or i not in paired]
        if not parts:
            return "true"
        return parts[0] if len(parts) == 1 else "(" + " & ".join(parts) + ")"

    def _linear(self, n: Node) -> tuple[dict[str, tuple[Node, int]], int] | None:
        """n as sum(coefficient * term) + constant, unfolding the + - and negations whose C operators cannot
        overflow (so the sum is the value n has); None past _LINEAR_ATOMS terms."""
        coefficients: dict[str, list] = {}
        constant, stack, visits = 0, [(n, 1)], 0
        while stack:
            node, sign = stack.pop()
            visits += 1
            if visits > 4 * _LINEAR_ATOMS:
                return None
            if node.op == "const":
                constant += sign * node.attr
            elif node.op in ("add", "sub", "neg") and self.ranges.get(node.digest) is not None:
                stack.append((node.args[0], -sign if node.op == "neg" else sign))
                if node.op != "neg":
                    stack.append((node.args[1], sign if node.op == "add" else -sign))
            else:
                coefficients.setdefault(node.digest, [node, 0])[1] += sign
        terms = {k: (node, c) for k, (node, c) in coefficients.items() if c != 0}
        return (terms, constant) if len(terms) <= _LINEAR_ATOMS else None

    def _at_most_zero(self, n: Node) -> tuple[dict[str, tuple[Node, int]], int, bool] | None:
        """An integer compare `a < b` (<=, >, >=) as `sum(coefficient * term) + k <= 0` over exact integers, and
        whether it was strict; None for anything else."""
        if n.op not in ("lt", "le", "gt", "ge") or not n.args[0].dtype.is_int or n.args[0].dtype is not n.args[1].dtype:
            return None
        small, big = n.args if n.op in ("lt", "le") else n.args[::-1]
        left, right = self._linear(small), self._linear(big)
        if left is None or right is None:
            return None
        terms = dict(left[0])
        for key, (node, c) in right[0].items():
            total = terms.get(key, (node, 0))[1] - c
            if total:
                terms[key] = (node, total)
            else:
                terms.pop(key, None)
        strict = n.op in ("lt", "gt")
        return terms, left[1] - right[1] + strict, strict

    def _band(self, x: Node, y: Node, low: int, upper) -> str | None:
        """fg_band_lt / fg_band_le(x - y, c) for `x - y >= 0` and the bound `upper` (from _at_most_zero) where it
        reads `x - y <= c` and both x - y and c are computed exactly in the compare's type; for `x - y >= low` with
        another constant low, fg_band_le(x - y - low, u - low) where the bound is a constant u and x - y - low is
        exact too; else None."""
        terms, k, strict = upper
        dtype = x.dtype
        if terms.get(x.digest, (None, 0))[1] != 1 or terms.get(y.digest, (None, 0))[1] != -1:
            return None
        rest = [terms[key] for key in terms if key not in (x.digest, y.digest)]
        rx, ry = self.ranges.get(x.digest), self.ranges.get(y.digest)
        if len(rest) > 1 or rx is None or ry is None or not _fits(rx[0] - ry[1] - low, rx[1] - ry[0] - low, dtype):
            return None
        sub = Node("sub", dtype, (x, y))
        d = self.expr.get(sub.digest) if self.ranges.get(sub.digest) is not None else None
        d = d or f"({self.expr[x.digest]} - {self.expr[y.digest]})"
        if low != 0:
            if rest or not _fits(low, low, dtype):
                return None
            # low <= x - y <= -k, that is 0 <= x - y - low <= -k - low; past the type's end the bound is its end
            # (x - y - low lies in the type), below -1 it is -1 (no value)
            bound = min(max(-k - low, -1), INT_RANGE[dtype][1])
            shifted = f"({_unparen(d)} {'+' if low < 0 else '-'} {int_literal(abs(low), dtype)})"
            return _call(self._helper("fg_band_le", "fg_band"), [shifted, int_literal(bound, dtype)])
        # x - y + rest + k <= 0, that is x - y <= -rest - k
        if not rest:  # a constant bound: x - y lies in the type, so one past either end is as good as the end
            lo, hi = INT_RANGE[dtype]
            bound = min(max(-k, lo), hi)
            kind, bound = ("lt", bound + 1) if strict and bound < hi else ("le", bound)
            c = int_literal(bound, dtype)
        else:
            (t, coefficient), = rest
            if t.dtype is not dtype or coefficient not in (1, -1):
                return None
            if coefficient == -1 and k in (0, 1):  # x - y <= t (- 1): the bound as written
                kind, c = ("lt" if k == 1 else "le"), self.expr[t.digest]
            else:  # x - y < c computed as t + offset or offset - t, where neither overflows
                rt, offset = self.ranges.get(t.digest), 1 - k
                if rt is None or not _fits(offset, offset, dtype):
                    return None
                lo, hi = (rt[0] + offset, rt[1] + offset) if coefficient == -1 else (offset - rt[1], offset - rt[0])
                if not _fits(lo, hi, dtype):
                    return None
                if coefficient == -1:
                    minus = offset < 0 and _fits(-offset, -offset, dtype)
                    c = f"({self.expr[t.digest]} {'-' if minus else '+'} {int_literal(-offset if minus else offset, dtype)})"
                else:
                    c = f"({int_literal(offset, dtype)} - {self.expr[t.digest]})"
                kind = "lt"
        return _call(self._helper(f"fg_band_{kind}", "fg_band"), [d, c])

    def _abs_window(self, n: Node) -> str | None:
        """`abs(d) <= c` (or `< c`, `c >= abs(d)`, `c > abs(d)`) for a constant c as one unsigned compare,
        fg_band_le(d + c, 2 c), where d's range excludes the type's minimum (whose abs wraps to itself) and d + c and
        2 c are exact; else None."""
        small, big = n.args if n.op in ("lt", "le") else n.args[::-1]
        if small.op != "abs" or big.op != "const" or small.dtype is not big.dtype:
            return None
        d, dtype = small.args[0], small.dtype
        c = int(big.attr) - (n.op in ("lt", "gt"))
        rd = self.ranges.get(d.digest)
        if c < 0 or rd is None or rd[0] == INT_RANGE[dtype][0] or not _fits(rd[0] + c, rd[1] + c, dtype) \
                or not _fits(2 * c, 2 * c, dtype):
            return None
        shifted = f"({_unparen(self.expr[d.digest])} + {int_literal(c, dtype)})" if c else self.expr[d.digest]
        return _call(self._helper("fg_band_le", "fg_band"), [shifted, int_literal(2 * c, dtype)])

    def _cast(self, src: DType, dst: DType, x: str) -> str:
        if dst is DType.BOOL:
            return f"({x} != 0.0f)" if src is DType.FLOAT32 else f"({x} != 0)"
        if src is DType.FLOAT32 and dst.is_int:  # a C cast is undefined out of range: saturate like cvt.rzi
            fn = "fg_float_to_int" if dst is DType.INT32 else "fg_float_to_long"
            return _call(self._helper(fn, "fg_float_to_int"), [x])
        return f"({CTYPE[dst]}){x}"

    def _load(self, n: Node, idx: list[str]) -> str:
        spec: BufferSpec = n.attr
        member = self.names[spec.name]
        return _convert(spec, f"args.{member}[{self.index(spec, n.args, idx, member)}]", self.helpers)

    @staticmethod
    def index(spec: BufferSpec, nodes: tuple[Node, ...], idx: list[str], member: str) -> str:
        """Element offset: sum of index * stride, in 64-bit so large buffers do not overflow."""
        if not nodes:
            return "0"
        terms = []
        for d, (node, text) in enumerate(zip(nodes, idx)):
            wide = text if node.dtype is DType.INT64 else f"(long long){text}"
            terms.append(f"{wide} * args.{member}_stride{d}")
        return " + ".join(terms)


def _convert(spec: BufferSpec, element: str, helpers: set[str]) -> str:
    if spec.dtype not in STORAGE:
        raise LoweringError(
            f"buffer {spec.name!r} has dtype {spec.dtype}; supported buffer dtypes are {', '.join(STORAGE)}"
        )
    if spec.dtype in _CONVERSION_HELPER:
        helpers.add(_CONVERSION_HELPER[spec.dtype])
    return STORAGE[spec.dtype][1].format(element)


# ---------------------------------------------------------------- helper device functions
# They live in templates/common/score_math.cuh (and the gradient slots in grad_slots.cuh), one
# section per helper; a variant's code carries only the sections it uses.

_COMMON = Path(__file__).resolve().parent.parent / "templates" / "common"
_SECTION = re.compile(r"^// @section (\w+)(?: needs ([\w ]+))?$", re.M)


@lru_cache(maxsize=None)
def header_sections(name: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Section name -> (its text, the sections it needs), in the header's order."""
    text = (_COMMON / name).read_text()
    marks = list(_SECTION.finditer(text))
    out = {}
    for mark, following in zip(marks, marks[1:] + [None]):
        body = text[mark.end() + 1:following.start() if following else len(text)].rstrip("\n")
        out[mark.group(1)] = (body, tuple((mark.group(2) or "").split()))
    return out


def _helper_text(used: set[str]) -> str:
    """The helper functions named in `used`: sections of score_math.cuh (with the sections they need), then the
    variant's inline-asm functions (`_asm_helper`)."""
    sections = header_sections("score_math.cuh")
    asm = sorted(name for name in used if name in _ASM_HELPERS)
    used = used - set(asm)
    pending = list(used)
    while pending:
        pending = [need for name in pending for need in sections[name][1] if need not in used]
        used = used | set(pending)
    return "\n".join([text for name, (text, _) in sections.items() if name in used] + [_ASM_HELPERS[n] for n in asm])


_ASM_HELPERS: dict[str, str] = {}  # fg_asm_<digest> -> its device function (the text is a function of the name)


def _asm_helper(node: Node) -> str:
    """The name of a device function computing an inline-asm node from its operands: one per distinct asm, operand
    types and result type, whatever the operands are."""
    asm_str, constraints, pack = node.attr
    types = [CTYPE[a.dtype] for a in node.args]
    key = "|".join([asm_str, constraints, str(pack), CTYPE[node.dtype], *types])
    name = f"fg_asm_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if name not in _ASM_HELPERS:
        _ASM_HELPERS[name] = "\n".join([
            f"// inline PTX (inline_asm_elementwise), constraints {_comment(repr(constraints))}, pack={pack}:",
            *(f"//   {_comment(line)}" for line in asm_str.strip().splitlines()),
            f"__device__ __forceinline__ {CTYPE[node.dtype]} {name}({', '.join(f'{t} in{k}' for k, t in enumerate(types))}) {{",
            inline_asm.asm_statement(node, [f"in{k}" for k in range(len(types))], "out"),
            "    return out;",
            "}",
        ])
    return name


def _grad_slots(sites: int, deterministic: bool) -> str:
    body = header_sections("grad_slots.cuh")["deterministic" if deterministic else "atomic"][0]
    return f"constexpr int FLEXGEN_GRAD_SITES = {sites};  // gradient sites (grads.add calls) in score_mod_bwd\n{body}"


# ---------------------------------------------------------------- functions


def _function(signature: str, comment: list[str], body: _Body, result: str) -> str:
    lines = [f"// {_comment(c)}" for c in comment] + [signature + " {"] + body.lines + [f"    return {_unparen(result)};", "}"]
    return "\n".join(lines)


_COMMENT_LIMIT = 2000  # a longer expression is shown in the comment in SSA form, one line per shared node


def _expr_comment(label: str, expr: Node) -> list[str]:
    """The user's expression as comment lines: one line, or SSA lines where one would be too long."""
    text = pretty(expr, _COMMENT_LIMIT)
    if not text.endswith("..."):
        return [f"{label}{text}"]
    return [label.rstrip(": =") + ":"] + [f"    {line}" for line in pretty_lines(expr).splitlines()]


# A mod that reads more buffer elements than this per score (a dot product over a captured row, as MLA's RoPE
# term) is called rather than inlined: inlined at each of a thread's 32-64 scores, such a forward took NVRTC over a
# minute and spilled 400 B; called (the callee leaves the in-flight wgmma's registers alone), it compiles in
# seconds without spills. Mods below it stay inlined, where the compiler shares index arithmetic across scores.
CALL_ABOVE_LOADS = 16


def _loads(roots: list[Node]) -> int:
    """Distinct buffer reads across the roots."""
    return len({n.digest for root in roots for n in postorder(root) if n.op == "load"})


def _inline_or_call(signature: str, roots: list[Node]) -> str:
    if _loads(roots) > CALL_ABOVE_LOADS:
        return signature.replace("__forceinline__", "__noinline__", 1)
    return signature


def _score_fn(expr: Node | None, names, helpers) -> str:
    if expr is None:
        return _function(SCORE_SIGNATURE, ["score_mod: identity"], _Body([], names, helpers), "score")
    body = _Body([expr], names, helpers)
    result = body[expr] if expr.dtype is DType.FLOAT32 else f"(float){body[expr]}"
    return _function(_inline_or_call(SCORE_SIGNATURE, [expr]), _expr_comment("score_mod: ", expr), body, result)


def _per_head_fn(name: str, comment: list[str], outputs: dict[str, Node], names, helpers) -> str:
    """`void name(int b, int h, const ModArgs& args, float& out...)`: values that depend on b and h only, for a
    forward that folds the score_mod into terms of its own."""
    body = _Body(list(outputs.values()), names, helpers)
    params = ", ".join(f"float& {out}" for out in outputs)
    lines = [f"// {_comment(c)}" for c in comment]
    lines.append(f"__device__ __forceinline__ void {name}(int b, int h, const ModArgs& args, {params}) {{")
    lines += body.lines
    lines += [f"    {out} = {_unparen(body[node])};" for out, node in outputs.items()]
    lines.append("}")
    return "\n".join(lines)


def _score_affine_fn(expr: Node, terms, names, helpers) -> str:
    """score_mod_affine(b, h, args, kv_coef, q_coef, bias) where score_mod is score + kv_coef * kv_idx +
    q_coef * q_idx + bias for fixed b and h (ALiBi; `terms`, dsl/affine.py). A kernel can then add the index terms
    per row and per column instead of evaluating score_mod at every score."""
    comment = _expr_comment("score_mod, affine in the indices: ", expr) + [
        f"  = score + kv_idx * {pretty(terms.kv_coef, 200)} + q_idx * {pretty(terms.q_coef, 200)} + "
        f"{pretty(terms.bias, 200)}"]
    return _per_head_fn("score_mod_affine", comment,
                        {"kv_coef": terms.kv_coef, "q_coef": terms.q_coef, "bias": terms.bias}, names, helpers)


def _score_softcap_fn(expr: Node, terms, names, helpers) -> str:
    """score_mod_softcap(b, h, args, outer, inner) where score_mod is outer * tanh(inner * score) for fixed b and h
    (logit soft-capping; `terms`, dsl/softcap.py)."""
    comment = _expr_comment("score_mod, a soft cap: ", expr) + [
        f"  = {pretty(terms.outer, 200)} * tanh({pretty(terms.inner, 200)} * score)"]
    return _per_head_fn("score_mod_softcap", comment, {"outer": terms.outer, "inner": terms.inner}, names, helpers)


def _mask_fn(expr: Node | None, names, helpers) -> str:
    if expr is None:
        return _function(MASK_SIGNATURE, ["mask_mod: none (every position is visible)"], _Body([], names, helpers), "true")
    body = _Body([expr], names, helpers)
    return _function(_inline_or_call(MASK_SIGNATURE, [expr]), _expr_comment("mask_mod: ", expr), body, body[expr])


def _score_bwd_fn(expr: Node | None, grad_names: tuple[str, ...], names, helpers,
                  deterministic: bool = False) -> tuple[str, int]:
    """The text of score_mod_bwd and its number of gradient sites (0: no `grads` parameter).
    `deterministic`: the gradient slots of deterministic mode (templates/common/grad_slots.cuh)."""
    if expr is None:
        return _function(SCORE_BWD_SIGNATURE, ["score_mod_bwd: identity score_mod, d/dscore = 1"],
                         _Body([], names, helpers), "grad_out"), 0
    from ..dsl import derivative  # written alongside; imported only when a backward kernel is lowered

    dscore = derivative.grad_score(expr)
    partials = derivative.grad_buffers(expr, names=grad_names)
    # a grad buffer with no differentiable read (e.g. only compared) simply gets no contributions
    zero = sorted(set(grad_names) - {ld.attr.name for ld, _ in partials})
    roots = [dscore]
    for ld, p in partials:
        roots.append(p)
        roots.extend(ld.args)
    body = _Body(roots, names, helpers)
    comment = _expr_comment("score_mod_bwd of: ", expr) + _expr_comment("  d/dscore = ", dscore)
    comment += [f"  d/d{name}[...] = 0 everywhere (no differentiable read)" for name in zero]
    for k, (ld, p) in enumerate(partials):
        spec = ld.attr
        member = names[spec.name]
        offset = _Body.index(spec, ld.args, [body[i] for i in ld.args], f"{member}_grad")
        partial = _expr_comment(f"  d/d{pretty(ld, 200)} = ", p)
        partial[0] += f"  (gradient site {k})"
        comment += partial
        if deterministic:
            per_step = all(inputs_of(i) <= {"b", "h"} for i in ld.args)  # the element stays put for a step
            call, value = ("add_bh" if per_step else "add"), f"grad_out, {_unparen(body[p])}"
        else:
            call, value = "add", f"__fmul_rn(grad_out, {_unparen(body[p])})"
        body.lines.append(f"    grads.{call}({k}, &args.{member}_grad[{offset}], {value});")
    result = f"__fmul_rn(grad_out, {_unparen(body[dscore])})"
    if not partials:  # (with gradient sites it stays inlined: `grads` lives in registers)
        return _function(_inline_or_call(SCORE_BWD_SIGNATURE, roots), comment, body, result), 0
    if deterministic:
        comment.append("  grads.add(k, &element, grad_out, derivative): a running sum in slot k, sent out warp by warp "
                       "in a fixed order")
    else:
        comment.append("  grads.add(k, &element, grad_out * derivative): a running sum in slot k; the kernel flushes the slots")
    fn = _function(SCORE_BWD_GRADS_SIGNATURE, comment, body, result)
    return _grad_slots(len(partials), deterministic) + "\n\n" + fn, len(partials)


# ---------------------------------------------------------------- the struct


def _collect(spec) -> tuple[list[BufferSpec], dict[str, DType]]:
    bufs: dict[str, BufferSpec] = {}
    params: dict[str, DType] = {}
    for expr in (spec.score_expr, spec.mask_expr):
        if expr is None:
            continue
        for b in buffers_of(expr):
            if bufs.setdefault(b.name, b) != b:
                raise LoweringError(f"buffer {b.name!r} is read as {bufs[b.name]} and as {b}; one name, one buffer")
        for name, dt in params_of(expr).items():
            if params.setdefault(name, dt) is not dt:
                raise LoweringError(f"parameter {name!r} is used as {params[name].value} and as {dt.value}")
    return list(bufs.values()), params


def _fields(bufs: list[BufferSpec], params: dict[str, DType], grads: tuple[str, ...], names) -> list[ArgField]:
    fields: list[ArgField] = []
    for b in bufs:
        fields.append(ArgField(names[b.name], f"const {STORAGE[b.dtype][0]}*", ("buffer_ptr", b.name)))
        fields += [ArgField(f"{names[b.name]}_stride{d}", "long long", ("buffer_stride", b.name, d)) for d in range(b.ndim)]
    for p, dt in params.items():
        fields.append(ArgField(names[p], "int" if dt is DType.BOOL else CTYPE[dt], ("param", p)))
    by_name = {b.name: b for b in bufs}
    for g in grads:
        fields.append(ArgField(f"{names[g]}_grad", "float*", ("grad_ptr", g)))
        fields += [ArgField(f"{names[g]}_grad_stride{d}", "long long", ("grad_stride", g, d)) for d in range(by_name[g].ndim)]
    if not fields:
        fields.append(ArgField("unused_", "int", ("padding",)))
    return fields


def _struct(fields: list[ArgField]) -> str:
    lines = ["// Run-time arguments of the variant: captured buffers (element strides), scalar parameters, gradients.",
             "struct ModArgs {"]
    for f in fields:
        star = f.ctype.endswith("*")
        restrict = " __restrict__" if star and f.ctype.startswith("const") else ""
        lines.append(f"    {f.ctype}{restrict} {f.name};")
    lines.append("};")
    return "\n".join(lines)


@lru_cache(maxsize=1024)
def lower_mods(spec) -> LoweredMods:
    """Lower spec.score_expr / spec.mask_expr (and, for kind "bwd", the score_mod derivative).
    Memoized per spec: the runtime calls this on every launch to pack ModArgs."""
    if spec.mask_expr is not None and "score" in inputs_of(spec.mask_expr):
        raise LoweringError(f"mask_mod {pretty(spec.mask_expr, 200)!r} reads `score`; a mask_mod sees only b, h, q_idx, kv_idx")
    for what, expr in (("score_mod", spec.score_expr), ("mask_mod", spec.mask_expr)):
        if expr is not None:  # traced mods were checked already; IR built by hand is checked here
            try:
                ir_check_size(expr, what)
            except IRTypeError as e:
                raise LoweringError(str(e)) from None
    bufs, params = _collect(spec)
    for b in bufs:
        if b.dtype not in STORAGE:
            raise LoweringError(
                f"buffer {b.name!r} has dtype {b.dtype}; supported buffer dtypes are {', '.join(STORAGE)}"
            )
    score_bufs = {b.name: b for b in buffers_of(spec.score_expr)} if spec.score_expr is not None else {}
    for g in spec.grad_buffers:
        if g not in score_bufs:
            raise LoweringError(f"grad_buffers names {g!r}, which score_mod does not read")
    names = _member_names(bufs, params)
    fields = _fields(bufs, params, tuple(spec.grad_buffers), names)
    helpers: set[str] = set()
    score_fn = _score_fn(spec.score_expr, names, helpers)
    mask_fn = _mask_fn(spec.mask_expr, names, helpers)
    if spec.kind == "bwd":
        bwd_fn, grad_sites = _score_bwd_fn(spec.score_expr, tuple(spec.grad_buffers), names, helpers,
                                           spec.deterministic)
    else:
        bwd_fn, grad_sites = f"// score_mod_bwd: not generated for kernel kind {spec.kind!r}", 0
    fold = score_fold(spec.score_expr) if spec.kind in ("fwd", "bwd") else None
    affine_fn = _score_affine_fn(spec.score_expr, fold, names, helpers) if isinstance(fold, AffineScore) else ""
    softcap_fn = _score_softcap_fn(spec.score_expr, fold, names, helpers) if isinstance(fold, SoftcapScore) else ""
    precise = "#define FLEXGEN_PRECISE_MATH 1" if spec.option("precise_math") else ""
    decl = "\n\n".join(filter(None, [precise, _helper_text(helpers), _struct(fields)]))
    return LoweredMods(
        mod_args_decl=decl,
        score_mod_fn=score_fn,
        mask_mod_fn=mask_fn,
        score_mod_bwd_fn=bwd_fn,
        fields=tuple(fields),
        buffers=tuple(bufs),
        params=tuple(params.items()),
        grad_buffers=tuple(spec.grad_buffers),
        helpers=tuple(sorted(h for h in helpers if h.startswith("fg_"))),
        mask_reads_buffers=spec.mask_expr is not None and bool(buffers_of(spec.mask_expr)),
        grad_sites=grad_sites,
        score_affine_fn=affine_fn,
        score_softcap_fn=softcap_fn,
    )
