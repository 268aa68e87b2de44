"""Symbolic tracing: run a FlexAttention-style Python function on proxies to build IR.

The function is called once with `Proxy` objects standing for score, b, h, q_idx
and kv_idx. Python operators on proxies, `torch.*` functions (through the
`__torch_function__` protocol), tensor methods and indexing of captured tensors
each append IR nodes, so helper functions, closures and nesting work as they
would under torch. Anything whose value is only known inside the kernel
(`if`, `bool()`, `.item()`) raises an error that points at the user's line.

The text form (parse.py) evaluates its syntax tree with these same proxies and
handlers, which is what makes both forms of a variant produce identical IR.
"""
from __future__ import annotations

import functools
import inspect
import keyword
import numbers
import re
from types import ModuleType
from typing import Any, Callable

import torch

from . import functional, inline_asm, ir, vectors
from .errors import (
    ControlFlowError,
    FlexgenTraceError,
    FlexgenTypeError,
    IndexingError,
    ReturnTypeError,
    SignatureError,
    UnsupportedBufferError,
    UnsupportedOperationError,
    describe_function,
    frame_location,
    source_line,
    unwrap_function,
    user_frame,
)
from .ir import BufferSpec, DType, Node
from .mod import MASK_ARGS, SCORE_ARGS, Mod, set_inliner

BUFFER_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
BUFFER_DEVICES = ("cpu", "cuda")

_TORCH_DTYPE_TO_IR = {
    torch.float32: DType.FLOAT32, torch.float16: DType.FLOAT32, torch.bfloat16: DType.FLOAT32,
    torch.float64: DType.FLOAT32, torch.int64: DType.INT64, torch.int32: DType.INT32,
    torch.int16: DType.INT32, torch.int8: DType.INT32, torch.uint8: DType.INT32, torch.bool: DType.BOOL,
}
_IR_TO_TORCH_DTYPE = {
    DType.FLOAT32: torch.float32, DType.INT32: torch.int32, DType.INT64: torch.int64, DType.BOOL: torch.bool,
}

Value = Any  # Proxy | bool | int | float | torch.Tensor


def arg_names(kind: str) -> tuple[str, ...]:
    return SCORE_ARGS if kind == "score" else MASK_ARGS


# ---------------------------------------------------------------- the tracer


class Tracer:
    """State of one trace: the buffers and parameters met so far, and how to report errors."""

    def __init__(self, kind: str, label: str, preferred_names: dict[int, str] | None = None, locate: bool = True):
        self.kind = kind
        self.label = label  # e.g. "mask_mod 'natten' (defined at x.py:3)"
        self.preferred_names = dict(preferred_names or {})  # id(tensor) -> name to give its buffer
        self.locate = locate  # False for the text form, which reports positions itself
        self.buffers: dict[str, torch.Tensor] = {}
        self.params: dict[str, bool | int | float] = {}
        self._specs: dict[int, BufferSpec] = {}
        self._auto_names = 0
        self._inlined_params: dict[tuple[int, str], str] = {}
        self._keepalive: list[object] = []  # objects whose id() we key on must outlive the trace

    # -- errors

    def error(self, cls: type[FlexgenTraceError], detail: str) -> FlexgenTraceError:
        location = ""
        if self.locate:
            where = frame_location(user_frame())
            location = f"while tracing {self.label}" + (f"\n{where}" if where else "")
        return cls(detail, location)

    # -- leaves

    def input(self, name: str) -> "Proxy":
        return Proxy(self, ir.input_(name))

    def param(self, name: str, value: bool | int | float) -> "Proxy":
        dtype = _scalar_dtype(value)
        if dtype.is_int:
            try:
                ir.check_int_range(value, dtype, f"parameter {name!r} =")
            except ir.IRTypeError as e:
                raise self.error(FlexgenTypeError, str(e)) from None
        name = self._fresh_name(name)
        self.params[name] = value
        return Proxy(self, ir.param(name, dtype))

    def bind(self, name: str, value: Any, specialize: bool) -> Any:
        """What a keyword binding stands for while tracing: a tensor (a buffer once it is read),
        a parameter proxy, or (specialize=True) the plain scalar, which bakes in as a constant."""
        if isinstance(value, torch.Tensor):
            self.preferred_names[id(value)] = name
            self._keepalive.append(value)
            return value
        scalar = as_scalar(value)
        if scalar is not None:
            return scalar if specialize else self.param(name, scalar)
        return value

    def buffer(self, tensor: torch.Tensor, preferred: str | None = None) -> BufferSpec:
        """The BufferSpec for a captured tensor; the same tensor object is always one buffer."""
        spec = self._specs.get(id(tensor))
        if spec is not None:
            return spec
        name = self.preferred_names.get(id(tensor)) or preferred
        if name is None:
            name = f"buf{self._auto_names}"
            self._auto_names += 1
        name = self._fresh_name(name)
        self._check_buffer(tensor, name)
        spec = BufferSpec(name, str(tensor.dtype).removeprefix("torch."), tensor.dim())
        self._specs[id(tensor)] = spec
        self.buffers[name] = tensor
        return spec

    def _check_buffer(self, tensor: torch.Tensor, name: str) -> None:
        if tensor.dtype not in BUFFER_DTYPES:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in BUFFER_DTYPES)
            raise self.error(
                UnsupportedBufferError,
                f"buffer '{name}' has dtype {str(tensor.dtype).removeprefix('torch.')}, which kernels cannot read; "
                f"allowed buffer dtypes are: {allowed}",
            )
        if tensor.device.type not in BUFFER_DEVICES:
            raise self.error(
                UnsupportedBufferError,
                f"buffer '{name}' is on device '{tensor.device}'; buffers must hold real data on a CPU or CUDA device",
            )
        for other_name, other in self.buffers.items():
            # (a 0-dim tensor goes with any device, as in PyTorch's ops: the launch copies it over, 4 bytes)
            if other.device != tensor.device and other.dim() > 0 and tensor.dim() > 0:
                raise self.error(
                    UnsupportedBufferError,
                    f"Buffers cannot be created across devices in one mod: buffer '{name}' is on {tensor.device} "
                    f"but buffer '{other_name}' is on {other.device}; all buffers of one mod must be on the same "
                    "device (move them with .to(device) outside the mod, once)",
                )

    def _fresh_name(self, base: str) -> str:
        # an ASCII identifier (ir.check_name), with room left for a numeric suffix
        base = re.sub(r"[^0-9A-Za-z_]", "_", base)[:ir.MAX_NAME_LENGTH - 4] or "buf"
        if base[0].isdigit() or keyword.iskeyword(base):
            base = f"_{base}"
        taken = set(self.buffers) | set(self.params) | set(SCORE_ARGS)
        name, n = base, 1
        while name in taken:
            name, n = f"{base}_{n}", n + 1
        return name

    # -- inlining an already traced Mod (calling a Mod on proxies, and_masks, ...)

    def inline(self, mod: Mod, args: tuple[Value, ...]) -> "Proxy":
        if len(args) != len(mod.arg_names):
            raise self.error(
                SignatureError,
                f"{mod.kind}_mod '{mod.name}' takes ({', '.join(mod.arg_names)}), got {len(args)} argument(s)",
            )
        self._keepalive.append(mod)
        inputs = {name: to_node(self, a) for name, a in zip(mod.arg_names, args)}
        memo: dict[str, Node] = {}
        try:
            for n in ir.postorder(mod.expr):
                memo[n.digest] = self._rebuild(mod, n, [memo[a.digest] for a in n.args], inputs)
        except ir.IRTypeError as e:
            raise self.error(FlexgenTypeError, f"calling {mod.kind}_mod '{mod.name}': {e}") from None
        return Proxy(self, memo[mod.expr.digest])

    def _rebuild(self, mod: Mod, n: Node, args: list[Node], inputs: dict[str, Node]) -> Node:
        """Re-apply n's op through the typed constructors, so substituted operands re-promote."""
        if n.op == "input":
            return inputs[n.attr]
        if n.op == "const":
            return n
        if n.op == "param":
            return ir.param(self._inline_param(mod, n.attr), n.dtype)
        if n.op == "load":
            return ir.load(self.buffer(mod.buffers[n.attr.name], preferred=n.attr.name), tuple(args))
        if n.op == "cast":
            return ir.cast(args[0], n.attr)
        if n.op == "where":
            return ir.where(*args)
        if n.op == inline_asm.OP:
            asm_str, constraints, pack = n.attr
            return inline_asm.inline_asm(tuple(args), asm_str, constraints, n.dtype, pack)
        if n.op in ir.UNARY_OPS:
            return ir.unary(n.op, args[0])
        return ir.binary(n.op, args[0], args[1])

    def _inline_param(self, mod: Mod, name: str) -> str:
        # Parameters of different mods never merge, even with equal values: the structure
        # (and so the hash) must not depend on parameter values.
        key = (id(mod), name)
        if key not in self._inlined_params:
            fresh = self._fresh_name(name)
            self.params[fresh] = mod.params[name]
            self._inlined_params[key] = fresh
        return self._inlined_params[key]

    # -- the result

    def finish(self, result: Value) -> tuple[Node, dict[str, torch.Tensor], dict[str, Any]]:
        """The traced expression checked against the mod kind, with the buffers and params it uses."""
        if result is None:
            what = "the new score" if self.kind == "score" else "a bool mask value"
            raise ReturnTypeError(f"{self.label} returned None; it must return {what}")
        if isinstance(result, (tuple, list)):
            raise ReturnTypeError(f"{self.label} returned a {type(result).__name__}; it must return one value")
        scalar = as_scalar(result)
        if self.kind == "score" and scalar is not None and not isinstance(scalar, bool):
            result = float(scalar)  # a constant score is a float constant, not a cast
        node = to_node(self, result)
        if self.kind == "mask" and node.dtype is not DType.BOOL:
            raise ReturnTypeError(
                f"{self.label} must return bool (a comparison, or comparisons combined with & | ~), "
                f"but it returns {node.dtype.value}"
            )
        if self.kind == "score":
            if node.dtype is DType.BOOL:
                raise ReturnTypeError(
                    f"{self.label} returns bool, but a score_mod must return the (float) score; "
                    "a function that returns bool is a mask_mod: use flexgen.mask_mod, or "
                    "torch.where(cond, score, -float('inf')) to mask inside a score_mod (flex_attention backward "
                    "requires the output of score_mod to depend on score)"
                )
            node = ir.cast(node, DType.FLOAT32)  # scores are float; an integer result is promoted
        try:
            ir.check_size(node, self.label)
        except ir.IRTypeError as e:
            raise FlexgenTraceError(str(e)) from None
        buffers = {s.name: self.buffers[s.name] for s in ir.buffers_of(node)}
        params = {name: self.params[name] for name in ir.params_of(node)}
        return node, buffers, params


def as_scalar(value: Any) -> bool | int | float | None:
    if isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def _scalar_dtype(value: bool | int | float) -> DType:
    if isinstance(value, bool):
        return DType.BOOL
    if isinstance(value, int):
        return DType.INT32 if -(2**31) <= value < 2**31 else DType.INT64
    return DType.FLOAT32


# ---------------------------------------------------------------- values -> nodes


def _scalar_const(value: bool | int | float, like: DType | None) -> Node:
    """Python scalars are weakly typed, as in torch: an int next to a float value is a float
    constant, an int next to an int32 or int64 value has that type (and must fit in it: torch
    would wrap it silently, the kernel too)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if like is DType.FLOAT32:
            return ir.const(float(value))
        if like is not None and like.is_int:
            return ir.const(value, like)
    return ir.const(value)


def to_node(tracer: Tracer, value: Value, like: DType | None = None) -> Node:
    if isinstance(value, Proxy):
        if value.tracer is not tracer:
            raise tracer.error(UnsupportedOperationError, "a traced value from another trace was used here")
        return value.node
    if isinstance(value, ArrayValue):
        raise tracer.error(IndexingError, array_as_value(value))
    scalar = as_scalar(value)
    if scalar is not None:
        try:
            return _scalar_const(scalar, like)
        except ir.IRTypeError as e:  # a constant out of its type's range
            raise tracer.error(FlexgenTypeError, str(e)) from None
    if isinstance(value, torch.Tensor):
        spec = tracer.buffer(value)
        if spec.ndim != 0:
            raise tracer.error(
                IndexingError,
                f"captured tensor '{spec.name}' of shape {tuple(value.shape)} is used as a value; "
                f"index it with the inputs (e.g. {spec.name}[h] or {spec.name}[q_idx]) to read one element",
            )
        return ir.load(spec, ())
    raise tracer.error(
        UnsupportedOperationError,
        f"a value of type {type(value).__name__} cannot be used in a {tracer.kind}_mod; "
        "use traced inputs, Python numbers and captured tensors",
    )


def array_as_value(array: "ArrayValue") -> str:
    """Why an array cannot stand where one value is needed, and what to write instead."""
    why = array._too_few() if isinstance(array, PartialIndex) else array.origin
    shape = tuple(array.shape)
    return (f"{why}; here it stands for {vectors.numel(shape)} values (shape {shape}) where one is needed: "
            "index it, or reduce it (e.g. .sum(-1), .amax(-1))")


def _nodes(tracer: Tracer, *values: Value) -> list[Node]:
    """Operands as nodes; bare Python scalars take the type of the traced operands (torch's rule)."""
    known = {i: to_node(tracer, v) for i, v in enumerate(values) if as_scalar(v) is None}
    like = None
    for node in known.values():
        like = node.dtype if like is None else ir.promote(like, node.dtype)
    if like is None and any(isinstance(v, float) for v in values):
        like = DType.FLOAT32
    if like is None or like is DType.BOOL:
        like = DType.INT64  # a Python int beside bools only (torch.where(c, 1, 0), c * 5) is int64 in torch
    return [known[i] if i in known else to_node(tracer, v, like) for i, v in enumerate(values)]


# ---------------------------------------------------------------- handlers
# Each handler takes the tracer and torch-style arguments and returns a Proxy.


def binary(tracer: Tracer, op: str, a: Value, b: Value) -> "Proxy":
    na, nb = _nodes(tracer, a, b)
    return Proxy(tracer, ir.binary(op, na, nb))


def unary(tracer: Tracer, op: str, x: Value) -> "Proxy":
    return Proxy(tracer, ir.unary(op, to_node(tracer, x)))


def _truthy(tracer: Tracer, x: Value) -> Node:
    """torch.logical_* treat nonzero as True."""
    node = to_node(tracer, x)
    return node if node.dtype is DType.BOOL else ir.binary("ne", node, _scalar_const(0, node.dtype))


def logical(tracer: Tracer, op: str, a: Value, b: Value) -> "Proxy":
    return Proxy(tracer, ir.binary(op, _truthy(tracer, a), _truthy(tracer, b)))


def logical_not(tracer: Tracer, x: Value) -> "Proxy":
    return Proxy(tracer, ir.unary("not", _truthy(tracer, x)))


def where(tracer: Tracer, condition: Value, input: Value = None, other: Value = None) -> "Proxy":
    if input is None or other is None:
        raise tracer.error(
            UnsupportedOperationError,
            "torch.where(condition) with one argument returns indices and is not supported; "
            "use torch.where(condition, a, b)",
        )
    cond = to_node(tracer, condition)
    a, b = _nodes(tracer, input, other)
    return Proxy(tracer, ir.where(cond, a, b))


def clamp(tracer: Tracer, x: Value, min: Value = None, max: Value = None) -> "Proxy":
    if min is None and max is None:
        raise tracer.error(UnsupportedOperationError, "clamp() needs min and/or max")
    node = to_node(tracer, x)
    if min is not None:
        node = ir.binary("max", *_nodes(tracer, Proxy(tracer, node), min))
    if max is not None:
        node = ir.binary("min", *_nodes(tracer, Proxy(tracer, node), max))
    return Proxy(tracer, node)


def minmax(tracer: Tracer, op: str, x: Value, other: Value = None, **kwargs: Any) -> "Proxy":
    other = kwargs.pop("other", other)
    if other is None or kwargs:
        raise tracer.error(
            UnsupportedOperationError,
            f"torch.{'min' if op == 'min' else 'max'} over one tensor is a reduction, which a mod cannot do; "
            f"use torch.{op}imum(a, b) for the elementwise {op}imum",
        )
    return binary(tracer, op, x, other)


def divide(tracer: Tracer, a: Value, b: Value, rounding_mode: str | None = None) -> "Proxy":
    if rounding_mode is None:
        return binary(tracer, "div", a, b)
    if rounding_mode == "floor":
        return binary(tracer, "floordiv", a, b)
    raise tracer.error(
        UnsupportedOperationError,
        f"division with rounding_mode={rounding_mode!r} is not supported; use rounding_mode='floor' or //",
    )


def add_sub(tracer: Tracer, op: str, a: Value, b: Value, alpha: Value = 1) -> "Proxy":
    if alpha != 1:
        b = binary(tracer, "mul", b, alpha)
    return binary(tracer, op, a, b)


def round_(tracer: Tracer, x: Value, decimals: Any = 0) -> "Proxy":
    """torch.round: half to even; with decimals, at that many decimal digits."""
    if isinstance(decimals, bool) or not isinstance(decimals, int):
        raise tracer.error(
            UnsupportedOperationError, f"round(decimals=...) takes a Python int, got {type(decimals).__name__}"
        )
    return Proxy(tracer, functional.round_decimals(to_node(tracer, x), decimals))


def gelu(tracer: Tracer, x: Value, approximate: Any = "none") -> "Proxy":
    if approximate not in ("none", "tanh"):
        raise tracer.error(
            UnsupportedOperationError, f"gelu(approximate={approximate!r}): approximate is 'none' or 'tanh'"
        )
    return Proxy(tracer, functional.gelu(to_node(tracer, x), approximate))


def softplus(tracer: Tracer, x: Value, beta: Value = 1.0, threshold: Value = 20.0) -> "Proxy":
    beta_node = None if as_scalar(beta) == 1 else to_node(tracer, beta, DType.FLOAT32)
    threshold_node = to_node(tracer, threshold, DType.FLOAT32)
    return Proxy(tracer, functional.softplus(to_node(tracer, x), beta_node, threshold_node))


def _given(value: Any) -> str:
    return "a traced value" if isinstance(value, (Proxy, ArrayValue, torch.Tensor)) else repr(value)


def _constant_arg(tracer: Tracer, fn: str, name: str, value: Any) -> float:
    """An activation's argument that must be known when tracing (hardtanh's bounds are compared then)."""
    scalar = as_scalar(value)
    if scalar is None:
        raise tracer.error(
            UnsupportedOperationError,
            f"{fn}({name}=...) needs a constant Python number (the bounds are checked when tracing), got "
            f"{_given(value)}; a bound parameter is baked in as a constant with specialize=True",
        )
    return float(scalar)


def _coefficient_arg(tracer: Tracer, fn: str, name: str, value: Any) -> float | Node:
    """alpha / negative_slope: a Python number, or a traced scalar (a bound parameter, a captured 0-d tensor)."""
    scalar = as_scalar(value)
    if scalar is not None:
        return float(scalar)
    if isinstance(value, (Proxy, torch.Tensor)):
        node = to_node(tracer, value)
        if node.dtype is DType.BOOL:
            raise tracer.error(UnsupportedOperationError, f"{fn}({name}=...) needs a number, got a bool value")
        return node
    raise tracer.error(UnsupportedOperationError, f"{fn}({name}=...) needs a number, got {_given(value)}")


# The activations' `inplace` is accepted and ignored: a traced value is never modified in place.


def elu(tracer: Tracer, x: Value, alpha: Value = 1.0, inplace: bool = False) -> "Proxy":
    return Proxy(tracer, functional.elu(to_node(tracer, x), _coefficient_arg(tracer, "elu", "alpha", alpha)))


def celu(tracer: Tracer, x: Value, alpha: Value = 1.0, inplace: bool = False) -> "Proxy":
    a = _coefficient_arg(tracer, "celu", "alpha", alpha)
    if isinstance(a, float) and a == 0.0:
        raise tracer.error(UnsupportedOperationError, "celu(alpha=0): alpha cannot be 0 (celu divides by it)")
    return Proxy(tracer, functional.celu(to_node(tracer, x), a))


def leaky_relu(tracer: Tracer, x: Value, negative_slope: Value = 0.01, inplace: bool = False) -> "Proxy":
    slope = _coefficient_arg(tracer, "leaky_relu", "negative_slope", negative_slope)
    return Proxy(tracer, functional.leaky_relu(to_node(tracer, x), slope))


def hardtanh(tracer: Tracer, x: Value, min_val: Value = -1.0, max_val: Value = 1.0, inplace: bool = False) -> "Proxy":
    lo = _constant_arg(tracer, "hardtanh", "min_val", min_val)
    hi = _constant_arg(tracer, "hardtanh", "max_val", max_val)
    if lo != lo or hi != hi:
        raise tracer.error(UnsupportedOperationError, f"hardtanh(min_val={lo}, max_val={hi}): a bound is NaN")
    if lo > hi:
        raise tracer.error(
            UnsupportedOperationError, f"hardtanh(min_val={lo}, max_val={hi}): min_val cannot be greater than max_val"
        )
    return Proxy(tracer, functional.hardtanh(to_node(tracer, x), lo, hi))


def _activation(fn: Callable[[Node], Node]) -> Callable:
    """A handler for an activation without parameters; `inplace` is ignored."""
    return lambda t, x, inplace=False: Proxy(t, fn(to_node(t, x)))


def shift(tracer: Tracer, op: str, x: Value, count: Value) -> "Proxy":
    """x << count / x >> count on integers, for a constant count (torch's results for any count)."""
    n = as_scalar(count)
    if n is None or isinstance(n, (bool, float)):
        what = "a traced value" if isinstance(count, Proxy) else f"a {type(count).__name__}"
        raise tracer.error(
            UnsupportedOperationError,
            f"a bit shift by {what} is not supported, only by a constant Python int "
            "(x << 3 is x * 8 and x >> 3 is x // 8, which torch.div(x, 8, rounding_mode='floor') also writes); "
            "for a traced count, keep the powers of two in a captured tensor and index it",
        )
    fn = functional.shift_left if op == "lshift" else functional.shift_right
    return Proxy(tracer, fn(to_node(tracer, x), int(n)))


def matmul(tracer: Tracer, a: Value, b: Value) -> "Proxy":
    raise tracer.error(
        UnsupportedOperationError,
        "`@` / torch.matmul multiplies matrices, but traced values are scalars: use `*` (torch.mul); "
        "for a dot product with a row of a captured tensor, write (table[h] * weights).sum(-1)",
    )


def rmatmul(tracer: Tracer, a: Value, b: Value) -> "Proxy":
    return matmul(tracer, b, a)


def to_dtype(tracer: Tracer, x: Value, *args: Any, **kwargs: Any) -> "Proxy":
    """`.to(dtype)` / `.to(device)` / `.type(dtype)`: devices are ignored (the kernel decides)."""
    dtype = kwargs.pop("dtype", None)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, Proxy):
            dtype = _IR_TO_TORCH_DTYPE[a.node.dtype]
    node = to_node(tracer, x)
    return Proxy(tracer, node if dtype is None else cast(tracer, node, dtype))


def asm_elementwise(tracer: Tracer, *inputs: Value, asm_str: Any, constraints: Any, dtype: Any,
                    is_pure: Any = True, pack: Any = 1) -> "Proxy":
    """PyTorch's inline_asm_elementwise (torch.ops.higher_order, torch 2.13 and newer): the PTX goes into the kernel
    as written (dsl/inline_asm.py)."""
    if is_pure is not True:
        raise tracer.error(UnsupportedOperationError, "inline_asm_elementwise only supports is_pure=True (as in PyTorch)")
    result = inline_asm.RESULT_TYPES.get(str(dtype).removeprefix("torch."))
    if result is None:
        raise tracer.error(UnsupportedOperationError,
                           f"inline_asm_elementwise: dtype {dtype} is not supported; the result is torch.float32, "
                           "torch.int32 or torch.int64 (for a bool, return an int32 and compare it with 0)")
    args = tuple(to_node(tracer, x) for x in inputs)
    return Proxy(tracer, inline_asm.inline_asm(args, asm_str, constraints, result, pack))


# Casts to a 16-bit float round the value to that precision and keep it as a float32 (what
# x.half().float() gives). Arithmetic on the result stays float32, where eager torch would round
# again after every operation on a 16-bit value.
_ROUNDING_CASTS = {torch.float16: "round_to_fp16", torch.bfloat16: "round_to_bf16"}


def cast(tracer: Tracer, node: Node, dtype: torch.dtype) -> Node:
    if dtype not in _TORCH_DTYPE_TO_IR:
        raise tracer.error(UnsupportedOperationError, f"casting to {dtype} is not supported")
    out = ir.cast(node, _TORCH_DTYPE_TO_IR[dtype])
    return ir.unary(_ROUNDING_CASTS[dtype], out) if dtype in _ROUNDING_CASTS else out


def round_scalar(value: bool | int | float, dtype: torch.dtype) -> float:
    """A Python number as torch holds it in `dtype` (a 16-bit float)."""
    return torch.tensor(float(value), dtype=torch.float64).to(dtype).item()


def constant_like(tracer: Tracer, x: Value, fill: Value, dtype: torch.dtype | None = None, **_: Any) -> "Proxy":
    """zeros_like / ones_like / full_like / new_ones ...: every element is the fill value."""
    if dtype is not None and dtype not in _TORCH_DTYPE_TO_IR:
        raise tracer.error(UnsupportedOperationError, f"dtype {dtype} is not supported in a mod")
    target = _TORCH_DTYPE_TO_IR[dtype] if dtype is not None else to_node(tracer, x).dtype
    scalar = as_scalar(fill)
    if scalar is None:
        return Proxy(tracer, cast(tracer, to_node(tracer, fill), dtype) if dtype is not None
                     else ir.cast(to_node(tracer, fill), target))
    if dtype in _ROUNDING_CASTS:
        scalar = round_scalar(scalar, dtype)
    return Proxy(tracer, ir.const(scalar, target))


def new_constant(tracer: Tracer, x: Value, size: Any, fill: Value, dtype: torch.dtype | None = None, **_: Any):
    if tuple(size) != ():
        raise tracer.error(
            UnsupportedOperationError,
            f"new tensors of size {tuple(size)} are not supported in a mod; only size () (a scalar)",
        )
    return constant_like(tracer, x, fill, dtype)


def index(tracer: Tracer, tensor: Value, key: Any) -> "Proxy | PartialIndex":
    """`tensor[i, j, ...]` with integer index expressions: a load from the tensor's buffer."""
    if isinstance(tensor, Proxy):
        raise tracer.error(
            IndexingError,
            "a traced value (one of the inputs, or something computed from them) cannot be indexed; "
            "only tensors captured by the function (or bound by keyword) can",
        )
    if not isinstance(tensor, torch.Tensor):
        raise tracer.error(IndexingError, f"cannot index a {type(tensor).__name__} with traced values; use a tensor")
    spec = tracer.buffer(tensor)
    return _load(tracer, tensor, spec, (), key)


def _load(tracer: Tracer, tensor: torch.Tensor, spec: BufferSpec, done: tuple[Node, ...], key: Any):
    items = key if isinstance(key, tuple) else (key,)
    nodes = done + tuple(_index_node(tracer, spec, item) for item in items)
    if len(nodes) > spec.ndim:
        raise tracer.error(
            IndexingError,
            f"too many indices for buffer '{spec.name}': it has {spec.ndim} dimension(s) "
            f"(shape {tuple(tensor.shape)}) but is indexed with {len(nodes)}",
        )
    if len(nodes) < spec.ndim:
        return PartialIndex(tracer, tensor, spec, nodes)
    return Proxy(tracer, ir.load(spec, nodes))


def _index_node(tracer: Tracer, spec: BufferSpec, item: Any) -> Node:
    where_ = f"index into buffer '{spec.name}'"
    if isinstance(item, Proxy):
        if item.node.dtype is DType.FLOAT32:
            raise tracer.error(
                IndexingError,
                f"a float value is used as an {where_}; indices must be integers "
                "(use // instead of /, or cast with .long() / .int())",
            )
        if item.node.dtype is DType.BOOL:
            raise tracer.error(
                IndexingError, f"a bool value is used as an {where_}; boolean-mask indexing is not supported"
            )
        return to_node(tracer, item)
    if isinstance(item, bool) or item is None or item is Ellipsis or isinstance(item, slice):
        raise tracer.error(
            IndexingError,
            f"{item!r} is not a supported {where_}: slices, None, ... and bools are not supported; "
            "index every dimension with an integer expression",
        )
    if isinstance(item, float):
        raise tracer.error(IndexingError, f"the float {item!r} is used as an {where_}; indices must be integers")
    if isinstance(item, int):
        if item < 0:
            raise tracer.error(IndexingError, f"negative constant {where_} ({item}) is not supported")
        return ir.const(item)
    if isinstance(item, torch.Tensor) and item.dim() == 0 and not item.dtype.is_floating_point:
        return to_node(tracer, item)
    raise tracer.error(IndexingError, f"a {type(item).__name__} is not a supported {where_}")


# ---------------------------------------------------------------- dispatch tables


def _b(op: str) -> Callable:
    return lambda t, a, b: binary(t, op, a, b)


def _rb(op: str) -> Callable:
    return lambda t, a, b: binary(t, op, b, a)


def _u(op: str) -> Callable:
    return lambda t, x: unary(t, op, x)


def _lg(op: str) -> Callable:
    return lambda t, a, b: logical(t, op, a, b)


def _cast_to(dtype: torch.dtype) -> Callable:
    return lambda t, x, *a, **k: Proxy(t, cast(t, to_node(t, x), dtype))


_BINARY_NAMES = {
    "mul": "mul", "multiply": "mul", "div": "div", "divide": "div", "true_divide": "div",
    "floor_divide": "floordiv", "remainder": "mod", "pow": "pow", "float_power": "pow",
    "minimum": "min", "maximum": "max", "fmin": "min", "fmax": "max",
    "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
    "greater": "gt", "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne",
    "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor", "fmod": "fmod",
}
_DUNDER_BINARY = {
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "div", "div": "div", "floordiv": "floordiv",
    "mod": "mod", "pow": "pow", "and": "and", "or": "or", "xor": "xor",
    "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
}

# torch.<name>(...) and Tensor.<name>(...) that take the traced value first.
FUNCTIONS: dict[str, Callable] = {
    **{name: _b(op) for name, op in _BINARY_NAMES.items()},
    **{f"__{name}__": _b(op) for name, op in _DUNDER_BINARY.items()},
    **{f"__r{name}__": _rb(op) for name, op in _DUNDER_BINARY.items()},
    **{name: _u(name) for name in ir.UNARY_FLOAT_OPS},
    "add": lambda t, a, b, alpha=1: add_sub(t, "add", a, b, alpha),
    "sub": lambda t, a, b, alpha=1: add_sub(t, "sub", a, b, alpha),
    "subtract": lambda t, a, b, alpha=1: add_sub(t, "sub", a, b, alpha),
    "rsub": lambda t, a, b, alpha=1: add_sub(t, "sub", b, a, alpha),
    "div": divide, "divide": divide,
    "abs": _u("abs"), "absolute": _u("abs"), "__abs__": _u("abs"),
    "neg": _u("neg"), "negative": _u("neg"), "__neg__": _u("neg"),
    "special_expit": _u("sigmoid"), "expit": _u("sigmoid"),
    "special_log1p": _u("log1p"), "arctan": _u("atan"),
    "sign": _u("sign"), "sgn": _u("sign"), "isnan": _u("isnan"),
    "floor": _u("floor"), "ceil": _u("ceil"), "trunc": _u("trunc"), "fix": _u("trunc"),
    "round": round_, "special_round": round_,
    "gelu": gelu, "silu": lambda t, x, inplace=False: Proxy(t, functional.silu(to_node(t, x))),
    "softplus": softplus,
    "elu": elu, "celu": celu, "selu": _activation(functional.selu), "leaky_relu": leaky_relu,
    "hardtanh": hardtanh, "relu6": _activation(functional.relu6), "hardsigmoid": _activation(functional.hardsigmoid),
    "hardswish": _activation(functional.hardswish), "mish": _activation(functional.mish),
    # F.logsigmoid is torch._C._nn.log_sigmoid, which reaches __torch_function__ by that name
    **dict.fromkeys(("logsigmoid", "log_sigmoid"), lambda t, x: Proxy(t, functional.logsigmoid(to_node(t, x)))),
    "softsign": lambda t, x: Proxy(t, functional.softsign(to_node(t, x))),
    **{f"__{name}__": (lambda op: lambda t, a, b: shift(t, op, a, b))(name) for name in ("lshift", "rshift")},
    **{f"__r{name}__": (lambda op: lambda t, a, b: shift(t, op, b, a))(name) for name in ("lshift", "rshift")},
    "bitwise_left_shift": lambda t, a, b: shift(t, "lshift", a, b),
    "bitwise_right_shift": lambda t, a, b: shift(t, "rshift", a, b),
    "matmul": matmul, "__matmul__": matmul, "__rmatmul__": rmatmul,
    "logical_and": _lg("and"), "logical_or": _lg("or"), "logical_xor": _lg("xor"),
    "logical_not": logical_not, "bitwise_not": _u("not"), "__invert__": _u("not"),
    "where": where,
    "clamp": clamp, "clip": clamp,
    "clamp_min": lambda t, x, min: clamp(t, x, min=min),
    "clamp_max": lambda t, x, max: clamp(t, x, max=max),
    "min": lambda t, x, *a, **k: minmax(t, "min", x, *a, **k),
    "max": lambda t, x, *a, **k: minmax(t, "max", x, *a, **k),
    "square": lambda t, x: binary(t, "mul", x, x),
    "relu": lambda t, x, inplace=False: clamp(t, x, min=0),
    "reciprocal": lambda t, x: binary(t, "div", 1.0, x),
    "zeros_like": lambda t, x, dtype=None, **k: constant_like(t, x, 0, dtype),
    "ones_like": lambda t, x, dtype=None, **k: constant_like(t, x, 1, dtype),
    "full_like": lambda t, x, fill_value, dtype=None, **k: constant_like(t, x, fill_value, dtype),
    "inline_asm_elementwise": asm_elementwise,
    "__getitem__": index,
}

# x.<name>(...) on a traced value.
METHODS: dict[str, Callable] = {
    **{k: v for k, v in FUNCTIONS.items() if not k.startswith("__") and not k.endswith("_like")},
    "where": lambda t, x, condition, other: where(t, condition, x, other),
    "to": to_dtype, "type": to_dtype,
    "float": _cast_to(torch.float32), "half": _cast_to(torch.float16), "bfloat16": _cast_to(torch.bfloat16),
    "double": _cast_to(torch.float32), "int": _cast_to(torch.int32), "short": _cast_to(torch.int32),
    "long": _cast_to(torch.int64), "bool": _cast_to(torch.bool),
    "new_ones": lambda t, x, size, dtype=None, **k: new_constant(t, x, size, 1, dtype),
    "new_zeros": lambda t, x, size, dtype=None, **k: new_constant(t, x, size, 0, dtype),
    "new_full": lambda t, x, size, fill_value, dtype=None, **k: new_constant(t, x, size, fill_value, dtype),
    "contiguous": lambda t, x, *a, **k: x, "clone": lambda t, x, *a, **k: x, "detach": lambda t, x: x,
}

# Methods whose result Python needs right away; they cannot be traced.
_CONCRETE_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


def supported_functions() -> str:
    names = sorted(n for n in FUNCTIONS if not n.startswith("__"))
    return ", ".join(names)


def apply(tracer: Tracer, what: str, handler: Callable, args: tuple, kwargs: dict) -> Any:
    """Run a handler, turning IR type errors into errors that point at the user's line.
    Arrays among the arguments (rows of captured tensors) map the handler over their elements."""
    if handler is not index and any(_is_array(v) for v in (*args, *kwargs.values())):
        if handler in (matmul, rmatmul):  # a @ b of two rows: their dot product
            return array_function(tracer, "matmul" if handler is matmul else "__rmatmul__", args, kwargs)
        return elementwise(tracer, what, handler, args, kwargs)
    try:
        return handler(tracer, *args, **kwargs)
    except ir.IRTypeError as e:
        raise tracer.error(FlexgenTypeError, f"{what}: {e}") from None
    except TypeError as e:
        if isinstance(e, FlexgenTraceError):
            raise
        try:  # say "wrong arguments" rather than leak the handler's own signature
            inspect.signature(handler).bind(tracer, *args, **kwargs)
        except TypeError as mismatch:
            raise tracer.error(SignatureError, f"{what}: unsupported arguments ({mismatch})") from None
        raise


def _find_tracer(values: Any) -> Tracer | None:
    stack = [values]
    while stack:
        v = stack.pop()
        if isinstance(v, (Proxy, ArrayValue)):
            return v.tracer
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return None


def _torch_name(func: Callable) -> str:
    name = getattr(func, "__name__", repr(func))
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    if hasattr(torch.Tensor, name):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module else name


def torch_function(func: Callable, args: tuple, kwargs: dict | None) -> Any:
    """The `__torch_function__` entry: torch.where(proxy, ...), tensor[proxy], tensor + proxy, ..."""
    kwargs = kwargs or {}
    tracer = _find_tracer((args, kwargs))
    name = getattr(func, "__name__", "")
    if name in _ARRAY_FUNCTIONS and any(_is_array(v) for v in (*args, *kwargs.values())):
        return array_function(tracer, name, args, kwargs)
    if name in vectors.SHAPE_METHODS and args and isinstance(args[0], (Proxy, ArrayValue)):
        return rearranged(args[0], name, args[1:], kwargs)
    handler = METHODS["where"] if func is torch.Tensor.where else FUNCTIONS.get(name)
    if name in _CONCRETE_METHODS:
        raise concrete_value_error(tracer, f".{name}()")
    if handler is None:
        raise tracer.error(
            UnsupportedOperationError,
            f"{_torch_name(func)} is not supported in a {tracer.kind}_mod. "
            f"Supported torch functions: {supported_functions()}",
        )
    return apply(tracer, _torch_name(func), handler, args, kwargs)


def concrete_value_error(tracer: Tracer, what: str) -> ControlFlowError:
    line = source_line(user_frame()) if tracer.locate else ""
    builtin = re.search(r"(?<![\w.])(min|max)\s*\(", line) if what == "bool()" else None
    if builtin:
        name = builtin.group(1)
        detail = (
            f"Python's built-in {name}() compares traced values with `<`, whose result is only known inside "
            f"the kernel. Use torch.{name}imum(a, b) for the elementwise {name}imum (torch.clamp for a bound), "
            "or torch.where(cond, a, b) to choose"
        )
    elif what == "bool()":
        if re.match(r"(if|elif|while|assert)\b", line):
            kind = f"a Python `{line.split()[0]}`"
        elif re.search(r"\b(and|or|not)\b", line):
            kind = "Python `and` / `or` / `not` (or a chained comparison like a < b < c)"
        else:
            kind = "bool() (or a chained comparison like a < b < c, or Python's min() / max(): use torch.minimum / torch.maximum)"
        detail = (
            f"{kind} depends on a traced value, which is only known inside the kernel. "
            "Use torch.where(cond, a, b) to choose between values, and & | ~ to combine conditions"
        )
    elif what == "index":
        detail = (
            "a traced value is used as a Python integer (a list/tuple index, range(), or int()); "
            "keep lookup tables in a torch tensor and index that instead"
        )
    elif what == "float":
        detail = (
            "a traced value is converted to a Python float (float(), or a math.* function); "
            "use the torch function instead, e.g. torch.exp rather than math.exp"
        )
    else:
        detail = f"{what} reads a concrete value, but traced values are only known inside the kernel"
    return tracer.error(ControlFlowError, detail)


# ---------------------------------------------------------------- proxies


class Proxy:
    """A traced scalar value: an IR node plus the trace it belongs to."""

    __slots__ = ("tracer", "node")

    def __init__(self, tracer: Tracer, node: Node) -> None:
        self.tracer = tracer
        self.node = node

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(func, args, kwargs)

    def __repr__(self) -> str:
        return f"Proxy({self.node!r})"

    @property
    def dtype(self) -> torch.dtype:
        return _IR_TO_TORCH_DTYPE[self.node.dtype]

    # A mod sees each score and index as one element (a 0-d tensor under PyTorch's vmap): so its shape is ().
    shape = torch.Size([])
    ndim = 0

    def size(self, dim: int | None = None):
        if dim is not None:
            raise self.tracer.error(IndexingError, f".size({dim}) of a 0-d value: a mod's values are scalars")
        return torch.Size([])

    def dim(self) -> int:
        return 0

    def numel(self) -> int:
        return 1

    @property
    def device(self) -> None:
        """Unknown until the kernel runs; None is what torch takes as "unspecified"
        (`b.new_ones((), device=b.device)`, `offsets.to(q_idx.device)` leave things as they are)."""
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _CONCRETE_METHODS:
            raise concrete_value_error(self.tracer, f".{name}()")
        if name in vectors.SHAPE_METHODS:
            return lambda *args, **kwargs: rearranged(self, name, args, kwargs)
        method = METHODS.get(name)
        if method is None:
            if hasattr(torch.Tensor, name):
                raise self.tracer.error(
                    UnsupportedOperationError,
                    f"Tensor.{name} is not supported on traced values. Supported methods: "
                    + ", ".join(sorted(METHODS)),
                )
            raise AttributeError(f"traced value has no attribute {name!r}")
        return lambda *args, **kwargs: apply(self.tracer, f".{name}()", method, (self, *args), kwargs)

    # Python needs a concrete answer for these; traced values have none.
    def __bool__(self):
        raise concrete_value_error(self.tracer, "bool()")

    def __index__(self):
        raise concrete_value_error(self.tracer, "index")

    def __int__(self):
        raise concrete_value_error(self.tracer, "index")

    def __float__(self):
        raise concrete_value_error(self.tracer, "float")

    def __len__(self):
        raise self.tracer.error(UnsupportedOperationError, "traced values are scalars; len() is not defined")

    def __iter__(self):
        raise self.tracer.error(UnsupportedOperationError, "traced values are scalars and cannot be iterated")

    def __getitem__(self, key):
        return apply(self.tracer, "indexing", index, (self, key), {})

    def __pos__(self):
        return self

    __hash__ = None  # == builds an expression, so proxies cannot be dict keys


_SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "div": "/", "floordiv": "//", "mod": "%", "pow": "**",
    "and": "&", "or": "|", "xor": "^", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    "lshift": "<<", "rshift": ">>", "matmul": "@",
}


def _operator(name: str, reverse: bool) -> Callable:
    dunder = f"__r{name}__" if reverse else f"__{name}__"
    handler = FUNCTIONS[dunder]
    what = f"operator {_SYMBOLS[name]}"

    def method(self: Proxy, other: Any) -> Any:
        return apply(self.tracer, what, handler, (self, other), {})

    method.__name__ = dunder
    return method


def _python_rounding(value: Any, name: str, what: str) -> Any:
    """math.floor(x), round(x), ...: Python wants a number now (torch tensors refuse too)."""
    raise value.tracer.error(
        UnsupportedOperationError,
        f"Python's {what}() needs a concrete number, but traced values are only known inside the kernel; "
        f"use torch.{name}(x){' (half to even, like Python)' if name == 'round' else ''}",
    )


class ArrayValue:
    """What a traced array answers like a tensor: its (constant) shape, and elementwise operators,
    torch functions, methods and reductions (through apply(), which maps them over the elements)."""

    __slots__ = ()
    tracer: Tracer

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    def elements(self) -> "Vector":
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return vectors.numel(tuple(self.shape))

    def __len__(self) -> int:
        if not self.shape:
            raise self.tracer.error(UnsupportedOperationError, "len() of a 0-d value")
        return self.shape[0]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return torch_function(func, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in _CONCRETE_METHODS:
            raise concrete_value_error(self.tracer, f".{name}()")
        if name in _ARRAY_FUNCTIONS:
            return lambda *args, **kwargs: array_function(self.tracer, name, (self, *args), kwargs)
        if name in vectors.SHAPE_METHODS:
            return lambda *args, **kwargs: rearranged(self, name, args, kwargs)
        if name in METHODS:
            method = METHODS[name]
            return lambda *args, **kwargs: apply(self.tracer, f".{name}()", method, (self, *args), kwargs)
        raise self.tracer.error(UnsupportedOperationError, f"Tensor.{name} is not supported on arrays in a mod")

    def __bool__(self):
        raise concrete_value_error(self.tracer, "bool()")

    def __index__(self):
        raise concrete_value_error(self.tracer, "index")

    def __float__(self):
        raise concrete_value_error(self.tracer, "float")

    __int__ = __index__
    __hash__ = None


for _cls in (Proxy, ArrayValue):
    for _name in (*_DUNDER_BINARY, "lshift", "rshift", "matmul"):
        setattr(_cls, f"__{_name}__", _operator(_name, reverse=False))
        if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):  # comparisons reflect on their own
            setattr(_cls, f"__r{_name}__", _operator(_name, reverse=True))
    for _name, _what in (("floor", "math.floor"), ("ceil", "math.ceil"), ("trunc", "math.trunc"), ("round", "round")):
        setattr(_cls, f"__{_name}__", (lambda name, what: lambda self, *a: _python_rounding(self, name, what))(_name, _what))
    for _name, _op, _what in (("neg", "neg", "unary -"), ("abs", "abs", "abs()"), ("invert", "not", "operator ~")):
        setattr(_cls, f"__{_name}__", (lambda op, what: lambda self: apply(self.tracer, what, _u(op), (self,), {}))(_op, _what))


class PartialIndex(ArrayValue):
    """A buffer indexed in fewer dimensions than it has (`table[h]` of a 2-D table): indexed further
    it is a load; used as a value it is the array of the remaining elements (at most
    vectors.MAX_ELEMENTS of them), as it is under FlexAttention's vmap."""

    __slots__ = ("tracer", "tensor", "spec", "nodes")

    def __init__(self, tracer: Tracer, tensor: torch.Tensor, spec: BufferSpec, nodes: tuple[Node, ...]):
        self.tracer, self.tensor, self.spec, self.nodes = tracer, tensor, spec, nodes

    def __getitem__(self, key: Any):
        return _load(self.tracer, self.tensor, self.spec, self.nodes, key)

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape[len(self.nodes):]

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def too_few_error(self, detail: str = "") -> IndexingError:
        return self.tracer.error(IndexingError, self._too_few() + detail)

    def _too_few(self) -> str:
        return (
            f"buffer '{self.spec.name}' has {self.spec.ndim} dimensions but is used after indexing only "
            f"{len(self.nodes)}; index every dimension (e.g. {self.spec.name}[h, q_idx])"
        )

    def elements(self) -> "Vector":
        shape = tuple(self.shape)
        if vectors.numel(shape) > vectors.MAX_ELEMENTS:
            # (it opens with the words of PyTorch's error for the same mod, which it cannot lower either)
            raise self.tracer.error(
                IndexingError,
                f"Buffers cannot be created in a score_mod / mask_mod past {vectors.MAX_ELEMENTS} elements: buffer "
                f"'{self.spec.name}' indexed in {len(self.nodes)} of its {self.spec.ndim} dimensions leaves a tensor of "
                f"shape {shape}, and a computation over one (a sum, a norm) is unrolled only up to "
                f"{vectors.MAX_ELEMENTS} elements; compute it outside the mod and capture the result (a value per "
                f"index, or per (q_idx, kv_idx) pair), or index every dimension (e.g. {self.spec.name}[h, q_idx])",
            )
        items = [ir.load(self.spec, self.nodes + _constant_index(j, shape)) for j in range(vectors.numel(shape))]
        return Vector(self.tracer, shape, items, self._too_few())


class Vector(ArrayValue):
    """A small array of traced values (IR nodes, row-major): a row of a captured tensor and what is
    computed from it elementwise, until a reduction (vectors.reduce) makes it one value."""

    __slots__ = ("tracer", "_shape", "items", "origin")

    def __init__(self, tracer: Tracer, shape: tuple[int, ...], items: list[Node], origin: str):
        self.tracer, self._shape, self.items = tracer, tuple(shape), list(items)
        self.origin = origin  # why this is an array: the error message for using it as one value

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    @property
    def dtype(self) -> torch.dtype:
        return _IR_TO_TORCH_DTYPE[self.items[0].dtype] if self.items else torch.float32

    def elements(self) -> "Vector":
        return self

    def __getitem__(self, key: Any):
        if _find_tracer(key) is not None:
            raise self.tracer.error(
                IndexingError,
                "an array computed in a mod can only be indexed with constants; index the captured tensor "
                "itself with the traced value (table[h, q_idx]) instead",
            )
        try:
            picked, shape = vectors.select(self._shape, key)
        except (IndexError, TypeError, ValueError) as e:
            raise self.tracer.error(IndexingError, f"indexing an array of shape {self._shape}: {e}") from None
        return Vector.of(self.tracer, shape, [self.items[i] for i in picked], self.origin)

    @staticmethod
    def of(tracer: Tracer, shape: tuple[int, ...], items: list[Node], origin: str) -> "Proxy | Vector":
        """One value (shape ()) as a Proxy, anything else as a Vector."""
        return Proxy(tracer, items[0]) if tuple(shape) == () else Vector(tracer, shape, items, origin)


def _constant_index(flat: int, shape: tuple[int, ...]) -> tuple[Node, ...]:
    return tuple(ir.const(i) for i in vectors.unravel(flat, shape))


def _tensor_elements(tracer: Tracer, tensor: torch.Tensor) -> Vector:
    """A captured tensor used whole in elementwise arithmetic with traced values: its elements."""
    spec = tracer.buffer(tensor)
    shape = tuple(tensor.shape)
    detail = (
        f"captured tensor '{spec.name}' of shape {shape} is used as a value; "
        f"index it (e.g. {spec.name}[h] or {spec.name}[q_idx]) to read one element"
    )
    if vectors.numel(shape) > vectors.MAX_ELEMENTS:
        raise tracer.error(IndexingError, detail)
    items = [ir.load(spec, _constant_index(j, shape)) for j in range(vectors.numel(shape))]
    return Vector(tracer, shape, items, detail)


def _is_array(value: Any) -> bool:
    return isinstance(value, ArrayValue) or (isinstance(value, torch.Tensor) and value.dim() > 0)


def rearranged(value: "Proxy | ArrayValue", method: str, args: tuple, kwargs: dict) -> "Proxy | Vector":
    """x.unsqueeze(-1), x.reshape(2, 3), x.t(), ...: the same elements in another shape (a traced score or index is
    an array of shape ())."""
    tracer = value.tracer
    array = value.elements() if isinstance(value, ArrayValue) else Vector(tracer, (), [value.node], "")
    try:
        picked, shape = vectors.rearrange(array._shape, method, args, kwargs)
    except vectors.VectorShapeError as e:
        raise tracer.error(IndexingError, str(e)) from None
    return Vector.of(tracer, shape, [array.items[i] for i in picked], array.origin)


def _elements(tracer: Tracer, value: Any) -> Vector | None:
    if isinstance(value, ArrayValue):
        return value.elements()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return _tensor_elements(tracer, value)
    return None


def elementwise(tracer: Tracer, what: str, handler: Callable, args: tuple, kwargs: dict) -> Vector:
    """A handler applied to arrays: broadcast them (torch's rules) and apply it element by element."""
    arrays = {key: _elements(tracer, v) for key, v in [*enumerate(args), *kwargs.items()]}
    arrays = {key: a for key, a in arrays.items() if a is not None}
    try:
        shape = vectors.broadcast([a._shape for a in arrays.values()])
    except vectors.VectorShapeError as e:
        raise tracer.error(IndexingError, f"{what}: {e}") from None
    picks = {key: vectors.positions(a._shape, shape) for key, a in arrays.items()}

    def element(key: Any, value: Any, j: int) -> Any:
        return Proxy(tracer, arrays[key].items[picks[key][j]]) if key in arrays else value

    items = []
    for j in range(vectors.numel(shape)):
        a = tuple(element(i, v, j) for i, v in enumerate(args))
        k = {name: element(name, v, j) for name, v in kwargs.items()}
        items.append(to_node(tracer, apply(tracer, what, handler, a, k)))
    return Vector(tracer, shape, items, next(iter(arrays.values())).origin)


_DOTS = ("dot", "inner", "vdot", "matmul", "__matmul__", "__rmatmul__")
_ARRAY_FUNCTIONS = (*vectors.REDUCTIONS, "max", "min", "nansum", *_DOTS)


def array_function(tracer: Tracer, name: str, args: tuple, kwargs: dict) -> Any:
    """Reductions and dot products of arrays (torch.sum(x, -1), x.amax(), a @ b, ...)."""
    what = f"{name}()"
    if name in ("max", "min"):
        rest = args[1:]
        if "other" in kwargs or (rest and not isinstance(rest[0], int)):
            return apply(tracer, what, FUNCTIONS[name], args, kwargs)  # elementwise maximum / minimum
        if rest or "dim" in kwargs:
            raise tracer.error(
                UnsupportedOperationError,
                f"torch.{name}(x, dim) returns values and indices; use torch.a{name}(x, dim) for the values",
            )
        name = "a" + name
    if name in _DOTS:
        a, b = (args[1], args[0]) if name == "__rmatmul__" else args[:2]
        va, vb = _elements(tracer, a), _elements(tracer, b)
        if va is None or vb is None or len(va._shape) != 1 or va._shape != vb._shape:
            shapes = [tuple(v._shape) if v is not None else () for v in (va, vb)]
            raise tracer.error(
                UnsupportedOperationError,
                f"{what} of shapes {shapes[0]} and {shapes[1]}: only the dot product of two 1-d arrays of one "
                "length is supported (write the sum of products for anything else)",
            )
        product = elementwise(tracer, what, FUNCTIONS["__mul__"], (va, vb), {})
        return array_function(tracer, "sum", (product,), {})
    x, dim, keepdim, dtype = _reduction_arguments(tracer, name, *args, **kwargs)
    array = _elements(tracer, x)
    if array is None:  # a scalar: a reduction over no dimension is the value itself
        array = Vector(tracer, (), [to_node(tracer, x)], "")
    items = array.items
    if dtype is not None:
        items = [cast(tracer, n, dtype) for n in items]
    try:
        out, shape = vectors.reduce("sum" if name == "nansum" else name, items, array._shape, dim, keepdim)
    except vectors.VectorShapeError as e:
        raise tracer.error(IndexingError, f"{what}: {e}") from None
    except ir.IRTypeError as e:
        raise tracer.error(FlexgenTypeError, f"{what}: {e}") from None
    return Vector.of(tracer, shape, out, array.origin)


def _reduction_arguments(tracer: Tracer, name: str, x: Any, dim: Any = None, keepdim: Any = False, *,
                         dtype: torch.dtype | None = None, **unknown: Any):
    if unknown or not isinstance(keepdim, bool):
        raise tracer.error(
            SignatureError, f"{name}(): unsupported arguments; it takes (x, dim=None, keepdim=False, dtype=None)"
        )
    if name == "nansum":
        raise tracer.error(UnsupportedOperationError, "nansum() is not supported; use torch.where(x.isnan(), 0, x).sum()")
    return x, dim, keepdim, dtype


# ---------------------------------------------------------------- tracing Python functions


def trace_function(
    fn: Callable, kind: str, *, name: str | None = None, specialize: bool = False, bindings: dict | None = None
) -> Mod:
    """Trace a FlexAttention-style Python function into a Mod."""
    bindings = dict(bindings or {})
    label = f"{kind}_mod {describe_function(fn)}"
    _check_signature(fn, kind, bindings, label)
    tracer = Tracer(kind, label, closure_tensor_names(fn))
    inputs = [tracer.input(a) for a in arg_names(kind)]
    kwargs = {k: tracer.bind(k, v, specialize) for k, v in bindings.items()}
    try:
        result = fn(*inputs, **kwargs)
    except FlexgenTraceError:
        raise
    except Exception as e:  # the user's own error: keep it, say which trace it came from
        e.add_note(f"(raised while flexgen was tracing {label})")
        raise
    expr, buffers, params = tracer.finish(result)
    return Mod(kind, expr, buffers, params, name=name or function_name(fn), source=_source_of(fn))


def function_name(fn: Callable) -> str:
    inner = unwrap_function(fn)
    name = getattr(inner, "__name__", None) or type(fn).__name__
    return "lambda" if name == "<lambda>" else name


def _source_of(fn: Callable) -> str:
    try:
        return inspect.getsource(unwrap_function(fn)).strip()
    except (OSError, TypeError):
        return ""


def _check_signature(fn: Callable, kind: str, bindings: dict, label: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without signatures: calling them tells
    want = arg_names(kind)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    if len(required) > len(want) or (len(positional) < len(want) and not var_positional):
        count = len(required) if len(required) > len(want) else len(positional)
        hint = ""
        if kind == "score" and count == 4:
            hint = " It takes 4 arguments, like a mask_mod: use flexgen.mask_mod for it."
        elif kind == "mask" and count == 5:
            hint = " It takes 5 arguments, like a score_mod: use flexgen.score_mod for it."
        raise SignatureError(
            f"{label} takes {count} positional argument(s) ({', '.join(p.name for p in positional)}), "
            f"but a {kind}_mod is called with {len(want)}: ({', '.join(want)}).{hint}"
        )
    bindable = {p.name for p in positional[len(want):]} | {p.name for p in params if p.kind is p.KEYWORD_ONLY}
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    for key in bindings:
        if key not in bindable and not var_keyword:
            raise SignatureError(
                f"binding {key}=... names no keyword parameter of {label}. Bindings fill keyword-only "
                f"parameters (def f({', '.join(want)}, *, {key}): ...); values the function captures "
                "in closures need no binding"
            )
    for p in params:
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in bindings:
            raise SignatureError(
                f"keyword-only parameter '{p.name}' of {label} has no value; pass it as a binding, "
                f"e.g. flexgen.{kind}_mod(fn, {p.name}=...)"
            )


def closure_tensor_names(fn: Callable) -> dict[int, str]:
    """id(tensor) -> the variable name the function (or a helper it reaches) knows it by."""
    names: dict[int, str] = {}
    seen: set[int] = set()

    def consider(var: str, value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            names.setdefault(id(value), var)
        elif isinstance(value, Mod) or isinstance(value, (type, ModuleType)):
            return
        elif callable(value):
            visit(value, depth + 1)

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            for var, value in obj.keywords.items():
                consider(var, value, depth)
            visit(obj.func, depth)
            return
        owner = getattr(obj, "__self__", None)  # bound method: look at the instance's attributes
        if owner is not None and not isinstance(owner, ModuleType):
            for var, value in _attributes(owner):
                consider(var, value, depth)
        func = getattr(obj, "__func__", obj)
        code = getattr(func, "__code__", None)
        if code is None:
            if hasattr(type(obj), "__call__") and not isinstance(obj, type):
                for var, value in _attributes(obj):
                    consider(var, value, depth)
                call = getattr(type(obj), "__call__", None)
                if getattr(call, "__code__", None) is not None:
                    visit(call, depth)
            return
        for var, cell in zip(code.co_freevars, func.__closure__ or ()):
            try:
                consider(var, cell.cell_contents, depth)
            except ValueError:  # empty cell
                pass
        for var, value in (getattr(func, "__kwdefaults__", None) or {}).items():
            consider(var, value, depth)
        defaults = getattr(func, "__defaults__", None) or ()
        for var, value in zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults):
            consider(var, value, depth)
        module_globals = getattr(func, "__globals__", {})
        for var in _code_names(code):
            if var in module_globals:
                consider(var, module_globals[var], depth)

    visit(fn, 0)
    return names


def _attributes(obj: Any) -> list[tuple[str, Any]]:
    out = list(getattr(obj, "__dict__", {}).items())
    for registry in ("_buffers", "_parameters"):  # torch.nn.Module keeps tensors here
        out.extend((getattr(obj, registry, None) or {}).items())
    return out


def _code_names(code) -> list[str]:
    """Global names read by a code object and the functions/lambdas defined inside it."""
    out = list(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            out.extend(_code_names(const))
    return out


def inline_call(mod: Mod, args: tuple) -> "Proxy | None":
    """A Mod called with proxies (inside a function being traced) splices its IR in; None otherwise."""
    tracer = _find_tracer(args)
    return None if tracer is None else tracer.inline(mod, args)


set_inliner(inline_call)
