"""The text form: `"cap * tanh(score / cap)"` with `cap=30.0` bound by keyword.

The text is parsed with lark (grammar.lark) and its tree is evaluated with the
same proxies and handlers that trace Python functions: `a + b` applies Python's
`+` to the operand values, `tanh(x)` calls the handler `torch.tanh` reaches.
Constant subexpressions fold exactly as Python folds them, so the text form and
the Python form of one variant produce identical IR.
"""
from __future__ import annotations

import ast

import difflib
import functools
import math
import operator
from pathlib import Path
from typing import Any, Callable

import torch
from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from . import ir
from .errors import FlexgenSyntaxError, FlexgenTraceError, FlexgenTypeError, SignatureError
from .ir import DType
from .mod import SCORE_ARGS, Mod
from .trace import FUNCTIONS, ArrayValue, Proxy, Tracer, as_scalar, apply, arg_names, cast, round_scalar, to_node

_GRAMMAR = Path(__file__).with_name("grammar.lark")


@functools.lru_cache(maxsize=1)
def parser() -> Lark:
    return Lark(_GRAMMAR.read_text(), parser="lalr", lexer="basic", propagate_positions=True)


def parse_tree(text: str) -> Tree:
    """The syntax tree of `text`; syntax errors come with line, column and a caret."""
    try:
        return parser().parse(text)
    except UnexpectedInput as e:
        if _at_end(e):  # point just past the last character, where something is missing
            lines = text.splitlines() or [""]
            raise FlexgenSyntaxError(_syntax_detail(e), text, len(lines), len(lines[-1]) + 1) from None
        context = _indent(e.get_context(text)) if e.pos_in_stream is not None else None
        raise FlexgenSyntaxError(_syntax_detail(e), text, max(e.line, 1), max(e.column, 1), context) from None


def _at_end(e: UnexpectedInput) -> bool:
    return isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END")


def _syntax_detail(e: UnexpectedInput) -> str:
    if isinstance(e, UnexpectedCharacters):
        return f"syntax error: unexpected character {e.char!r}"
    if _at_end(e):
        return "syntax error: the expression ends too early"
    if isinstance(e, UnexpectedToken):
        return f"syntax error: unexpected {e.token.value!r}"
    return "syntax error"


def _indent(context: str | None) -> str | None:
    if context is None:
        return None
    return "\n".join(f"    {line}" for line in context.rstrip("\n").split("\n"))


# ---------------------------------------------------------------- names the text can use


class TextFunction:
    """A function callable from the text form; `fold` computes it on plain Python numbers."""

    def __init__(self, tracer: Tracer, name: str, handler: Callable, fold: Callable | None = None):
        self.tracer, self.name, self.handler, self.fold = tracer, name, handler, fold

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fold is not None and not kwargs and all(as_scalar(a) is not None for a in args):
            return self.fold(*args)
        return apply(self.tracer, f"{self.name}()", self.handler, args, kwargs)


class Namespace:
    """`torch.` and `math.` prefixes in the text form."""

    def __init__(self, name: str, members: dict[str, Any]):
        self.name, self.members = name, members


def _cast_handler(dtype: torch.dtype) -> Callable:
    return lambda t, x: Proxy(t, cast(t, to_node(t, x), dtype))


def text_functions(tracer: Tracer) -> dict[str, TextFunction]:
    table = {
        name: TextFunction(tracer, name, handler)
        for name, handler in FUNCTIONS.items()
        if not name.startswith("__") and not name.endswith("_like")
    }
    casts = {
        "float": (torch.float32, float), "float32": (torch.float32, float),
        "int": (torch.int32, int), "int32": (torch.int32, int),
        "long": (torch.int64, int), "int64": (torch.int64, int), "bool": (torch.bool, bool),
    }
    for low in (torch.float16, torch.bfloat16):
        casts[str(low).removeprefix("torch.")] = (low, functools.partial(round_scalar, dtype=low))
    casts["half"] = casts["float16"]
    for name, (dtype, fold) in casts.items():
        table[name] = TextFunction(tracer, name, _cast_handler(dtype), fold)
    for op in ir.PRECISION_OPS:  # how the printer writes a rounding cast
        table[op] = TextFunction(tracer, op, lambda t, x, op=op: Proxy(t, ir.unary(op, to_node(t, x))))
    table["abs"].fold = abs
    table["min"].fold = min
    table["max"].fold = max
    return table


_SHAPE_QUERIES = ("shape", "size", "dim", "ndim", "numel")  # of a bound tensor: constants
_NN_FUNCTIONAL = (  # F.<name> in the text form
    "gelu", "silu", "softplus", "relu", "sigmoid", "tanh", "elu", "celu", "selu", "leaky_relu", "hardtanh", "relu6",
    "hardsigmoid", "hardswish", "mish", "logsigmoid", "softsign",
)
_CONSTANTS = {"True": True, "False": False, "true": True, "false": False, "inf": math.inf, "nan": math.nan, "pi": math.pi}
_MATH = {"pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}


def environment(tracer: Tracer, inputs: tuple[str, ...], bindings: dict, specialize: bool) -> dict[str, Any]:
    functions = text_functions(tracer)
    dtypes = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                         torch.float64, torch.int32, torch.int64, torch.bool)}
    env: dict[str, Any] = {**_CONSTANTS, **functions}
    nn_functional = Namespace("torch.nn.functional", {name: functions[name] for name in _NN_FUNCTIONAL})
    env["F"] = nn_functional
    env["torch"] = Namespace("torch", {**functions, **dtypes, "float": torch.float32, "int": torch.int32,
                                       "long": torch.int64, "bool": torch.bool, "half": torch.float16,
                                       "nn": Namespace("torch.nn", {"functional": nn_functional})})
    env["math"] = Namespace("math", _MATH)
    env.update({name: tracer.input(name) for name in inputs})
    for name, value in bindings.items():
        if not name.isidentifier():
            raise SignatureError(f"binding name {name!r} is not an identifier")
        if name in SCORE_ARGS:
            raise SignatureError(f"binding '{name}' would hide the input {name}; choose another name")
        env[name] = tracer.bind(name, value, specialize)
    return env


# ---------------------------------------------------------------- evaluation


_BINARY = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow,
    "bit_and": operator.and_, "bit_or": operator.or_, "bit_xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift, "matmul": operator.matmul,
}
_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne}


# Syntax-tree nodes that are parts of a rule, not values: their rule reads them itself.
_NOT_VALUES = frozenset({"subscripts", "arguments", "keyword"})


def _is_scalar(v: Any) -> bool:
    return as_scalar(v) is not None


class Evaluator:
    """Evaluates a syntax tree to a value (a Proxy, or a Python number for constant parts)."""

    def __init__(self, text: str, tracer: Tracer, env: dict[str, Any], kind: str | None):
        self.text, self.tracer, self.env, self.kind = text, tracer, env, kind
        self.used: set[str] = set()
        self.done: dict[int, Any] = {}  # id(subtree) -> its value, filled bottom-up by `run`

    def run(self, tree: Tree) -> Any:
        """The value of `tree`. Subtrees are evaluated first, deepest first, without recursion, so a
        long chain such as `q_idx + 1 + 1 + ... + 1` needs no deep Python stack: when a rule then
        evaluates its operands, they are already in `done`."""
        order: list[Tree] = []
        stack = [tree]
        while stack:
            t = stack.pop()
            order.append(t)
            stack.extend(c for c in t.children if isinstance(c, Tree))
        for t in reversed(order):  # every operand before the rule that uses it
            if t.data not in _NOT_VALUES:
                self.done[id(t)] = self.eval(t)
        return self.done[id(tree)]

    def error(self, line: int, column: int, detail: str) -> FlexgenSyntaxError:
        return FlexgenSyntaxError(detail, self.text, line, column)

    def eval(self, tree: Tree | Token) -> Any:
        if id(tree) in self.done:
            return self.done[id(tree)]
        try:
            return getattr(self, f"_{tree.data}")(*tree.children)
        except FlexgenSyntaxError:
            raise
        except (FlexgenTraceError, ir.IRTypeError, ArithmeticError, TypeError, ValueError, IndexError) as e:
            detail = e.detail if isinstance(e, FlexgenTraceError) else str(e)
            if isinstance(e, (ir.IRTypeError, FlexgenTypeError)) and tree.data in ("bit_and", "bit_or", "bit_xor"):
                detail += " (note: & | ^ bind tighter than comparisons; write `and` / `or` or add parentheses)"
            raise self.error(tree.meta.line, tree.meta.column, detail) from None

    # -- leaves

    def _number(self, token: Token) -> int | float:
        text = token.value
        if text[:2].lower() == "0x":
            return int(text, 16)
        return float(text) if any(c in text for c in ".eE") else int(text)

    def _string(self, token: Token) -> str:
        try:
            return ast.literal_eval(token.value)  # a string literal only: the grammar admits nothing else here
        except (SyntaxError, ValueError) as e:
            raise self.error(token.line, token.column, f"bad string literal {token.value}: {e}") from None

    def _name(self, token: Token) -> Any:
        name = token.value
        if name in self.env:
            self.used.add(name)
            return self.env[name]
        if name == "score" and self.kind == "mask":
            detail = "'score' is not an input of a mask_mod (its inputs are b, h, q_idx, kv_idx)"
        else:
            known = [k for k, v in self.env.items() if not isinstance(v, (TextFunction, Namespace))]
            close = difflib.get_close_matches(name, list(self.env), n=1)
            detail = f"unknown name '{name}'"
            detail += f" (did you mean '{close[0]}'?)" if close else ""
            detail += f"; names here are {', '.join(known)}, the functions, and names bound by keyword"
        raise self.error(token.line, token.column, detail)

    # -- operators

    # Arithmetic and bitwise rules apply Python's operator to the operand values, exactly
    # as the same expression does in a traced Python function.
    def __getattr__(self, rule: str) -> Callable:
        op = _BINARY.get(rule.removeprefix("_"))
        if op is None:
            raise AttributeError(rule)
        return lambda a, *rest: op(self.eval(a), self.eval(rest[-1]))  # rest: [operator token,] operand

    def _logical_or(self, a: Tree, b: Tree) -> Any:
        return self._logical("or", self.eval(a), self.eval(b))

    def _logical_xor(self, a: Tree, b: Tree) -> Any:
        return self._logical("xor", self.eval(a), self.eval(b))

    def _logical_and(self, a: Tree, b: Tree) -> Any:
        return self._logical("and", self.eval(a), self.eval(b))

    def _logical(self, op: str, x: Any, y: Any) -> Any:
        if _is_scalar(x) and _is_scalar(y):
            return {"and": operator.and_, "or": operator.or_, "xor": operator.xor}[op](bool(x), bool(y))
        return apply(self.tracer, op, FUNCTIONS[f"logical_{op}"], (x, y), {})

    def _logical_not(self, a: Tree) -> Any:
        x = self.eval(a)
        return (not x) if _is_scalar(x) else apply(self.tracer, "not", FUNCTIONS["logical_not"], (x,), {})

    def _compare(self, *children: Tree | Token) -> Any:
        """Chained comparisons mean what they mean in Python: a < b < c is a < b and b < c."""
        values = [self.eval(c) for c in children[0::2]]
        result = None
        for left, op, right in zip(values, children[1::2], values[1:]):
            r = _COMPARE[op.value](left, right)
            result = r if result is None else self._logical("and", result, r)
        return result

    def _neg(self, a: Tree) -> Any:
        return -self.eval(a)

    def _pos(self, a: Tree) -> Any:
        return +self.eval(a)

    def _invert(self, a: Tree) -> Any:
        x = self.eval(a)
        return (not x) if isinstance(x, bool) else ~x

    # -- postfix

    def _index(self, base: Tree, subscripts: Tree) -> Any:
        target = self.eval(base)
        keys = tuple(self.eval(c) for c in subscripts.children if c is not None)
        key = keys[0] if len(keys) == 1 else keys
        if isinstance(target, (ArrayValue, torch.Size)):
            return target[key]
        if not isinstance(target, torch.Tensor):
            raise TypeError("only tensors bound by keyword can be indexed (e.g. slopes[h] with slopes=tensor)")
        return apply(self.tracer, "indexing", FUNCTIONS["__getitem__"], (target, key), {})

    def _call(self, func: Tree, arguments: Tree | None) -> Any:
        target = self.eval(func)
        args, kwargs = [], {}
        for child in arguments.children if arguments is not None else ():
            if child is None:
                continue
            if isinstance(child, Tree) and child.data == "keyword":
                kwargs[child.children[0].value] = self.eval(child.children[1])
            else:
                args.append(self.eval(child))
        if not callable(target) or isinstance(target, (torch.Tensor, Proxy)):
            what = "a traced value" if isinstance(target, Proxy) else f"a {type(target).__name__}"
            raise TypeError(f"{what} is not a function")
        return target(*args, **kwargs)

    def _attribute(self, base: Tree, name: Token) -> Any:
        target = self.eval(base)
        attr = name.value
        if isinstance(target, Namespace):
            if attr not in target.members:
                raise self.error(name.line, name.column, f"unknown name '{target.name}.{attr}'")
            return target.members[attr]
        if isinstance(target, (Proxy, ArrayValue)):
            return getattr(target, attr)
        if isinstance(target, torch.Tensor) and attr in _SHAPE_QUERIES:
            return getattr(target, attr)
        raise TypeError(f"a {type(target).__name__} value has no attribute '{attr}' in the text form")


# ---------------------------------------------------------------- entry point


def parse_mod(
    text: str, kind: str | None, *, name: str | None = None, specialize: bool = False, bindings: dict | None = None
) -> Mod:
    """Build a Mod from the text form. kind=None decides from the result: bool means a mask."""
    bindings = dict(bindings or {})
    tree = parse_tree(text)
    short = text if len(text) <= 60 else text[:57] + "..."
    tracer = Tracer(kind or "score", f"{kind or 'text'}_mod {short!r}", locate=False)
    env = environment(tracer, arg_names(kind or "score"), bindings, specialize)
    evaluator = Evaluator(text, tracer, env, kind)
    value = evaluator.run(tree)
    # Bindings the text does not use are ignored (callers may pass one set of names to a
    # score and a mask); a misspelt name in the text is still caught as an unknown name.
    if kind is None:
        kind = _infer_kind(value, tracer, evaluator)
        tracer.kind, tracer.label = kind, f"{kind}_mod {short!r}"
    expr, buffers, params = tracer.finish(value)
    return Mod(kind, expr, buffers, params, name=name or f"{kind}_mod", source=text)


def _infer_kind(value: Any, tracer: Tracer, evaluator: Evaluator) -> str:
    if isinstance(value, Proxy) and value.node.dtype is DType.BOOL or isinstance(value, bool):
        return "score" if "score" in evaluator.used else "mask"
    return "score"
