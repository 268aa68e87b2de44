"""Reference semantics of the IR: evaluate an expression on torch tensors.

Integers are int32 or int64 tensors, as in the kernels (PyTorch's FlexAttention also passes
int32 indices): `+ - *`, negation and `abs` wrap around modulo 2**32 or 2**64, narrowing casts
keep the low bits. `//` floors and `%` takes the divisor's sign, like torch and Python (the
lowering's fg_floordiv / fg_mod do the same; INT_MIN // -1 is INT_MIN and INT_MIN % -1 is 0, as torch
gives them). On two bools, `+` / `*` are logical or / and (ir.binary builds them so), as in torch. A float cast to an integer truncates toward zero
and saturates at the type's bounds, NaN giving 0, as the GPU's cvt.rzi does (torch on a CPU
gives INT_MIN instead). Floats evaluate in `float_dtype` (float64 for the ground truth, float32
to mirror the kernels). Index inputs broadcast, so one call covers a whole (b, h, q, kv) grid. Inline PTX
(inline_asm.py) runs through PyTorch's Jiterator, on a CUDA device only.
"""
from __future__ import annotations

from typing import Mapping

import torch

from . import inline_asm
from .ir import DType, Node, postorder

_UNARY = {
    "neg": torch.neg,
    "abs": torch.abs,
    "not": torch.logical_not,
    "exp": torch.exp,
    "exp2": torch.exp2,
    "log": torch.log,
    "log2": torch.log2,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sin": torch.sin,
    "cos": torch.cos,
    "tan": torch.tan,
    "erf": torch.erf,
    "log1p": torch.log1p,
    "atan": torch.atan,
    "sign": torch.sign,
    "isnan": torch.isnan,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,  # half to even
    "trunc": torch.trunc,
    "round_to_fp16": lambda x: x.to(torch.float16).to(x.dtype),
    "round_to_bf16": lambda x: x.to(torch.bfloat16).to(x.dtype),
}

_BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "min": torch.minimum,
    "max": torch.maximum,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "eq": torch.eq,
    "ne": torch.ne,
    "and": torch.logical_and,
    "or": torch.logical_or,
    "xor": torch.logical_xor,
    "bitand": torch.bitwise_and,
    "bitor": torch.bitwise_or,
    "bitxor": torch.bitwise_xor,
    "mod": torch.remainder,
    "fmod": torch.fmod,
}


def torch_dtype(dtype: DType, float_dtype: torch.dtype = torch.float64) -> torch.dtype:
    return {
        DType.BOOL: torch.bool,
        DType.INT32: torch.int32,
        DType.INT64: torch.int64,
        DType.FLOAT32: float_dtype,
    }[dtype]


def evaluate(
    root: Node,
    inputs: Mapping[str, torch.Tensor | int | float],
    buffers: Mapping[str, torch.Tensor] | None = None,
    params: Mapping[str, bool | int | float] | None = None,
    float_dtype: torch.dtype = torch.float64,
    check_ranges: bool = True,
) -> torch.Tensor:
    """Value of `root` given tensors (or Python numbers) for the inputs it reads. `check_ranges=False` skips the
    check that each buffer index is in range (it reads the indices' values, a wait for the GPU): only for indices
    proven in range beforehand (mask_analysis.buffer_reads_in_range)."""
    buffers = buffers or {}
    params = params or {}
    device = None
    for v in inputs.values():
        if isinstance(v, torch.Tensor):
            device = v.device
            break
    values: dict[str, torch.Tensor] = {}
    outside: dict[str, tuple[torch.Tensor, str]] = {}  # load -> (where its index was out of range, the error)
    order = list(postorder(root))
    for n in order:
        dt = torch_dtype(n.dtype, float_dtype)
        if n.op == "input":
            if n.attr not in inputs:
                raise KeyError(f"evaluate(): no value given for input {n.attr!r}")
            v = torch.as_tensor(inputs[n.attr], device=device).to(dt)
        elif n.op == "const":
            v = torch.tensor(n.attr, dtype=dt, device=device)
        elif n.op == "param":
            if n.attr not in params:
                raise KeyError(f"evaluate(): no value bound for scalar parameter {n.attr!r}")
            v = torch.tensor(params[n.attr], device=device).to(dt)
        elif n.op == "load":
            v = _load(n, buffers, [values[a.digest] for a in n.args], device, check_ranges, outside).to(dt)
        else:
            args = [values[a.digest] for a in n.args]
            v = _apply(n, args, dt)
        values[n.digest] = v
    if outside:
        _check_used_reads(order, values, outside)
    return values[root.digest]


def _check_used_reads(order: list[Node], values: dict[str, torch.Tensor], outside: dict) -> None:
    """Raise for a buffer read out of range whose value reaches the result. A read that a where discards is
    allowed, as torch's own eager code allows it (PyTorch's PagedAttention calls the user's score_mod at the
    negative positions of unmapped pages and discards what it returns); it was read at index 0 instead."""
    used = {order[-1].digest: torch.ones((), dtype=torch.bool)}
    for n in reversed(order):  # (users before their operands)
        mask = used.get(n.digest)
        if mask is None:
            continue
        if n.op == "where":
            cond = values[n.args[0].digest]
            parts = ((n.args[0], mask), (n.args[1], mask & cond), (n.args[2], mask & ~cond))
        else:
            parts = tuple((a, mask) for a in n.args)
        for arg, m in parts:
            used[arg.digest] = m if arg.digest not in used else used[arg.digest] | m
    for digest, (bad, message) in outside.items():
        if (bad & used.get(digest, torch.zeros((), dtype=torch.bool))).any():
            raise IndexError(message)


def _load(n: Node, buffers: Mapping[str, torch.Tensor], idx: list[torch.Tensor], device, check_ranges: bool,
          outside: dict) -> torch.Tensor:
    spec = n.attr
    if spec.name not in buffers:
        raise KeyError(f"evaluate(): no tensor bound for buffer {spec.name!r}")
    buf = buffers[spec.name]
    if device is not None and buf.device != device:
        buf = buf.to(device)
    idx = [i.long() for i in idx]
    for dim, i in enumerate(idx if check_ranges else ()):
        size = buf.shape[dim]
        # Negative indices down to -size count from the end, as torch's indexing (and so PyTorch's eager
        # FlexAttention) reads them. Under torch.vmap (PyTorch's create_block_mask calling a Mod) values
        # cannot be read out; the index op below still refuses an out-of-range index there.
        if i.numel() and not torch._C._functorch.is_functorch_wrapped_tensor(i) and (int(i.min()) < -size or int(i.max()) >= size):
            message = (f"buffer {spec.name!r} read out of range in dimension {dim}: index range "
                       f"[{int(i.min())}, {int(i.max())}] but the size is {size} (indices from -{size} to {size - 1} "
                       f"are read as torch reads them)")
            bad = (i < -size) | (i >= size)
            idx[dim] = torch.where(bad, 0, i)  # (raised by _check_used_reads if the value is used)
            earlier = outside.get(n.digest)
            outside[n.digest] = (bad if earlier is None else earlier[0] | bad, earlier[1] if earlier else message)
    if not idx:
        return buf.reshape(())
    idx = torch.broadcast_tensors(*idx)
    return buf[tuple(idx)]


def _saturating_int(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """float -> int32/int64 as the GPU converts: truncate, clamp to the type's range, NaN -> 0."""
    info = torch.iinfo(dt)
    x = torch.nan_to_num(x.to(torch.float64), nan=0.0).trunc()
    # the type's bounds as floats are exact powers of two: compare there, convert what is inside
    inside = (x >= info.min) & (x < -float(info.min))
    out = torch.where(inside, x, torch.zeros_like(x)).to(dt)
    out = torch.where(x >= -float(info.min), torch.full_like(out, info.max), out)
    return torch.where(x < info.min, torch.full_like(out, info.min), out)


def _apply(n: Node, args: list[torch.Tensor], dt: torch.dtype) -> torch.Tensor:
    op = n.op
    if op == inline_asm.OP:
        return inline_asm.evaluate(n, args, dt)
    if op == "cast":
        x = args[0]
        if x.dtype.is_floating_point and not dt.is_floating_point and dt is not torch.bool:
            return _saturating_int(x, dt)
        return x.to(dt)
    if op == "where":
        return torch.where(args[0], args[1], args[2]).to(dt)
    if op == "floordiv":
        a, b = args
        if a.dtype.is_floating_point:
            return torch.floor(a / b)
        return torch.div(a, b, rounding_mode="floor").to(dt)
    if op in _UNARY:
        return _UNARY[op](args[0]).to(dt)
    if op in _BINARY:
        return _BINARY[op](args[0], args[1]).to(dt)
    raise NotImplementedError(f"evaluate(): op {op!r}")
