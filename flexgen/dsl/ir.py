"""The typed, immutable expression IR that every stage after tracing speaks.

A variant (score_mod or mask_mod) is one DAG of `Node`s over the five inputs
`score, b, h, q_idx, kv_idx`, constants, scalar parameters and buffer loads.
Nodes are plain immutable data; equality and hashing are structural, through a
sha256 digest that is stable across processes and Python versions (it becomes
part of the kernel cache key). Parameter *values* and buffer *contents* are
never part of a node: only their names, dtypes and ranks are.
"""
from __future__ import annotations

import enum
import hashlib
import keyword
import math
from dataclasses import dataclass, field
from typing import Any

from .graph import postorder


class DType(enum.Enum):
    BOOL = "bool"
    INT32 = "int32"
    INT64 = "int64"
    FLOAT32 = "float32"

    @property
    def is_int(self) -> bool:
        return self in (DType.INT32, DType.INT64)

    @property
    def is_float(self) -> bool:
        return self is DType.FLOAT32


INPUT_DTYPES = {
    "score": DType.FLOAT32,
    "b": DType.INT32,
    "h": DType.INT32,
    "q_idx": DType.INT32,
    "kv_idx": DType.INT32,
}

UNARY_FLOAT_OPS = (
    "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "tan", "erf", "log1p", "atan",
)
# Rounding to an integral value keeps the operand's type (on integers they are the identity).
ROUNDING_OPS = ("floor", "ceil", "round", "trunc")  # round: half to even, like torch.round
# A float32 value rounded to float16 / bfloat16 precision (nearest even) and back: x.half().float().
PRECISION_OPS = ("round_to_fp16", "round_to_bf16")
UNARY_OPS = ("neg", "abs", "not", "sign", "isnan") + ROUNDING_OPS + UNARY_FLOAT_OPS + PRECISION_OPS
ARITH_OPS = ("add", "sub", "mul", "div", "floordiv", "mod", "fmod", "pow", "min", "max")  # fmod: C's, like torch.fmod
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC_OPS = ("and", "or", "xor")
# &, |, ^ on integers (the same Python operators on bools are LOGIC_OPS).
BITWISE_OPS = ("bitand", "bitor", "bitxor")
BINARY_OPS = ARITH_OPS + COMPARE_OPS + LOGIC_OPS + BITWISE_OPS
LEAF_OPS = ("input", "const", "param")
# inline_asm: user PTX over its operands (inline_asm.py builds and checks it; attr = (asm_str, constraints, pack))
ALL_OPS = LEAF_OPS + ("load", "cast", "where", "inline_asm") + UNARY_OPS + BINARY_OPS


class IRTypeError(TypeError):
    """An expression whose operand types the IR does not allow."""


MAX_NAME_LENGTH = 64


def check_name(name: object, what: str) -> None:
    """Buffer and parameter names reach generated C++ (members, comments): ASCII identifiers only."""
    if (
        not isinstance(name, str) or not name.isascii() or not name.isidentifier()
        or keyword.iskeyword(name) or len(name) > MAX_NAME_LENGTH
    ):
        raise IRTypeError(
            f"{what} name {name!r} is not allowed: names are ASCII Python identifiers (letters, digits and _, "
            f"not starting with a digit, not a Python keyword) of at most {MAX_NAME_LENGTH} characters"
        )


@dataclass(frozen=True)
class BufferSpec:
    """What the kernel needs to know about a captured tensor: not its contents, not its shape."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32", "bfloat16", "int64", "bool"
    ndim: int

    def __post_init__(self) -> None:
        check_name(self.name, "buffer")

    @property
    def load_dtype(self) -> DType:
        if self.dtype == "bool":
            return DType.BOOL
        if self.dtype == "int64":
            return DType.INT64
        if self.dtype in ("int32", "int16", "int8", "uint8"):
            return DType.INT32
        return DType.FLOAT32


@dataclass(frozen=True, eq=False)
class Node:
    """One IR operation. `attr` holds the leaf payload (input name, constant, param name,
    BufferSpec for loads, target DType for casts, (asm_str, constraints, pack) for inline_asm) and is None
    otherwise."""

    op: str
    dtype: DType
    args: tuple["Node", ...] = ()
    attr: Any = None
    _digest: str = field(default="", repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.op not in ALL_OPS:
            raise IRTypeError(f"unknown IR op {self.op!r}")
        object.__setattr__(self, "_digest", _digest_of(self))

    @property
    def digest(self) -> str:
        """sha256 of the structure: equal digests mean equal expressions."""
        return self._digest

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Node) and other._digest == self._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __repr__(self) -> str:
        from .printer import pretty

        return f"Node<{self.dtype.value}>({pretty(self, 2000)})"


def _attr_token(attr: Any) -> str:
    if attr is None:
        return "-"
    if isinstance(attr, bool):
        return f"b:{int(attr)}"
    if isinstance(attr, int):
        return f"i:{attr}"
    if isinstance(attr, float):
        return f"f:{attr.hex()}" if math.isfinite(attr) else f"f:{attr!r}"
    if isinstance(attr, DType):
        return f"t:{attr.value}"
    if isinstance(attr, BufferSpec):
        return f"buf:{attr.name}:{attr.dtype}:{attr.ndim}"
    if isinstance(attr, str):
        return f"s:{attr}"
    if isinstance(attr, tuple):  # (strings in it length-prefixed: free text such as PTX may hold "," and ")")
        return "(" + ",".join(f"s{len(a)}:{a}" if isinstance(a, str) else _attr_token(a) for a in attr) + ")"
    raise IRTypeError(f"unhashable IR attribute {attr!r}")


def _digest_of(node: Node) -> str:
    text = "|".join([node.op, node.dtype.value, _attr_token(node.attr)] + [a._digest for a in node.args])
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- constructors
# Every constructor checks operand types, so an ill-typed DAG cannot be built.


INT_RANGE = {DType.INT32: (-(2**31), 2**31 - 1), DType.INT64: (-(2**63), 2**63 - 1)}


def check_int_range(value: int, dtype: DType, what: str = "integer constant") -> None:
    """Kernels compute integers in int32/int64 (PyTorch passes int32 indices), so a constant
    that does not fit its type would wrap in the emitted CUDA: refuse it here instead."""
    lo, hi = INT_RANGE[dtype]
    if not lo <= value <= hi:
        bits = 32 if dtype is DType.INT32 else 64
        hint = ("; for int64 arithmetic, cast the traced value with .long() first"
                if dtype is DType.INT32 and INT_RANGE[DType.INT64][0] <= value <= INT_RANGE[DType.INT64][1] else "")
        raise IRTypeError(
            f"{what} {_int_text(value)} does not fit in {dtype.value}, the type it is computed in; "
            f"allowed range [-2**{bits - 1}, 2**{bits - 1} - 1]{hint}"
        )


def _int_text(value: int) -> str:
    """2**70 rather than 1180591620717411303424 where that is what it is."""
    mag = abs(value)
    if mag >= 2**20 and mag & (mag - 1) == 0:
        return f"{'-' if value < 0 else ''}2**{mag.bit_length() - 1}"
    return str(value)


def const(value: bool | int | float, dtype: DType | None = None) -> Node:
    if dtype is None:
        if isinstance(value, bool):
            dtype = DType.BOOL
        elif isinstance(value, int):
            dtype = DType.INT32 if -(2**31) <= value < 2**31 else DType.INT64
        elif isinstance(value, float):
            dtype = DType.FLOAT32
        else:
            raise IRTypeError(f"constants must be Python bool, int or float, got {type(value).__name__}")
    if dtype is DType.BOOL:
        value = bool(value)
    elif dtype.is_int:
        if isinstance(value, float) and not math.isfinite(value):
            raise IRTypeError(f"{value} cannot be an {dtype.value} constant; integers have no inf or nan")
        value = int(value)
        check_int_range(value, dtype)
    else:
        value = float(value)
    return Node("const", dtype, (), value)


def input_(name: str) -> Node:
    if name not in INPUT_DTYPES:
        raise IRTypeError(f"unknown input {name!r}; inputs are {', '.join(INPUT_DTYPES)}")
    return Node("input", INPUT_DTYPES[name], (), name)


def param(name: str, dtype: DType) -> Node:
    """A scalar the kernel takes as a run-time argument (its value lives outside the IR)."""
    check_name(name, "parameter")
    return Node("param", dtype, (), name)


def load(buffer: BufferSpec, indices: tuple[Node, ...]) -> Node:
    if len(indices) != buffer.ndim:
        raise IRTypeError(
            f"buffer {buffer.name!r} has {buffer.ndim} dimension(s) but was indexed with {len(indices)} index(es)"
        )
    for i in indices:
        if not i.dtype.is_int:
            raise IRTypeError(
                f"buffer {buffer.name!r} indexed with a {i.dtype.value} value; indices must be integers"
            )
    return Node("load", buffer.load_dtype, tuple(indices), buffer)


def cast(x: Node, dtype: DType) -> Node:
    if x.dtype is dtype:
        return x
    return Node("cast", dtype, (x,), dtype)


def promote(a: DType, b: DType) -> DType:
    """torch-like promotion: bool < int32 < int64 < float32."""
    order = [DType.BOOL, DType.INT32, DType.INT64, DType.FLOAT32]
    return max(a, b, key=order.index)


def unary(op: str, x: Node) -> Node:
    if op not in UNARY_OPS:
        raise IRTypeError(f"unknown unary op {op!r}")
    if op == "not":
        if x.dtype.is_int:  # ~ on an integer: bitwise, which is -x - 1 in two's complement (wrapping, as torch's)
            return binary("sub", Node("neg", x.dtype, (x,)), const(1, x.dtype))
        if x.dtype is not DType.BOOL:
            raise IRTypeError(f"'~'/not needs a bool or integer operand, got {x.dtype.value}")
        return Node(op, DType.BOOL, (x,))
    if op in UNARY_FLOAT_OPS or op in PRECISION_OPS:
        return Node(op, DType.FLOAT32, (cast(x, DType.FLOAT32),))
    if op == "isnan":
        return Node(op, DType.BOOL, (x,)) if x.dtype.is_float else const(False)
    if op in ROUNDING_OPS and not x.dtype.is_float:
        if x.dtype is DType.BOOL:
            raise IRTypeError(f"{op}() needs a number, got bool")
        return x
    if op == "sign" and x.dtype is DType.BOOL:
        return x  # torch.sign of a bool tensor is the tensor
    if x.dtype is DType.BOOL:
        x = cast(x, DType.INT32)
    return Node(op, x.dtype, (x,))


def binary(op: str, a: Node, b: Node) -> Node:
    if op in LOGIC_OPS and (a.dtype is not DType.BOOL or b.dtype is not DType.BOOL):
        op = "bit" + op  # &, |, ^ with an integer operand: bitwise, as torch's
    if op in BITWISE_OPS:
        if a.dtype.is_float or b.dtype.is_float:
            raise IRTypeError(f"'{op}' needs integer or bool operands, got {a.dtype.value} and {b.dtype.value}")
        t = promote(a.dtype, b.dtype)
        if t is DType.BOOL:
            return Node(op[3:], DType.BOOL, (a, b))
        return Node(op, t, (cast(a, t), cast(b, t)))
    if op in LOGIC_OPS:
        return Node(op, DType.BOOL, (a, b))
    if op in COMPARE_OPS:
        t = promote(a.dtype, b.dtype)
        if t is DType.BOOL and op not in ("eq", "ne"):
            t = DType.INT32
        return Node(op, DType.BOOL, (cast(a, t), cast(b, t)))
    if op not in ARITH_OPS:
        raise IRTypeError(f"unknown binary op {op!r}")
    if a.dtype is DType.BOOL and b.dtype is DType.BOOL and op != "div":
        return _bool_arith(op, a, b)
    t = promote(a.dtype, b.dtype)
    if t is DType.BOOL:
        t = DType.INT32
    if op in ("div", "pow"):
        t = DType.FLOAT32
    return Node(op, t, (cast(a, t), cast(b, t)))


# torch on two bool tensors: + and maximum are logical or, * and minimum logical and (the result
# stays bool); -, //, %, fmod and ** are refused. Division (true division) gives floats as usual.
_BOOL_ARITH = {"add": "or", "max": "or", "mul": "and", "min": "and"}


def _bool_arith(op: str, a: Node, b: Node) -> Node:
    if op not in _BOOL_ARITH:
        symbol = {"sub": "-", "floordiv": "//", "mod": "%", "fmod": "fmod", "pow": "**"}.get(op, op)
        raise IRTypeError(
            f"'{symbol}' on two bool values is not supported (torch refuses it too); cast one to int first "
            "(x.int()), or use logical_xor / ^ for a bool difference"
        )
    return Node(_BOOL_ARITH[op], DType.BOOL, (a, b))


def where(cond: Node, a: Node, b: Node) -> Node:
    if cond.dtype is not DType.BOOL:
        raise IRTypeError(f"where() needs a bool condition, got {cond.dtype.value}")
    t = promote(a.dtype, b.dtype)
    return Node("where", t, (cond, cast(a, t), cast(b, t)))


# ---------------------------------------------------------------- size


# A variant is at most this many distinct IR nodes (shared subexpressions count once). Every pass is
# linear in it (the derivative too: it shares subexpressions), so the cap only keeps compile times and
# generated code of a sane size; a real score_mod / mask_mod is a few dozen nodes.
MAX_NODES = 20000


def check_size(root: Node, what: str = "the expression") -> None:
    n = sum(1 for _ in postorder(root))
    if n > MAX_NODES:
        raise IRTypeError(
            f"{what} has {n} distinct operations; flexgen allows at most {MAX_NODES} (shared subexpressions "
            "count once): split the computation or precompute part of it into a captured buffer"
        )


# ---------------------------------------------------------------- traversal


def buffers_of(root: Node) -> list[BufferSpec]:
    """Buffers read by the expression, in first-use order."""
    out: dict[str, BufferSpec] = {}
    for n in postorder(root):
        if n.op == "load":
            out.setdefault(n.attr.name, n.attr)
    return list(out.values())


def inputs_outside_loads(root: Node) -> set[str]:
    """Inputs the expression uses other than inside a buffer index."""
    found, stack, seen = set(), [root], set()
    while stack:
        node = stack.pop()
        if node.digest in seen or node.op == "load":
            continue
        seen.add(node.digest)
        if node.op == "input":
            found.add(node.attr)
        stack.extend(node.args)
    return found


def has_positional_loads(root: Node) -> bool:
    """Whether some buffer load's index depends on q_idx or kv_idx (a different element for every
    score, like a relative-bias table), rather than only on b, h and parameters (ALiBi's slopes[h])."""
    return any(n.op == "load" and inputs_of(n) & {"q_idx", "kv_idx"} for n in postorder(root))


def params_of(root: Node) -> dict[str, DType]:
    return {n.attr: n.dtype for n in postorder(root) if n.op == "param"}


def inputs_of(root: Node) -> set[str]:
    return {n.attr for n in postorder(root) if n.op == "input"}


def replace(root: Node, mapping: dict[Node, Node]) -> Node:
    """Rebuild `root` with every node in `mapping` swapped for its image."""
    memo: dict[str, Node] = {}
    for n in postorder(root):
        if n in mapping:
            memo[n.digest] = mapping[n]
            continue
        args = tuple(memo[a.digest] for a in n.args)
        memo[n.digest] = n if args == n.args and all(x is y for x, y in zip(args, n.args)) else Node(n.op, n.dtype, args, n.attr)
    return memo[root.digest]
