"""Small arrays while tracing: a row of a captured tensor that a mod combines and reduces.

FlexAttention calls a mod on one element at a time, so `(table[h] * w).sum(-1)` with
`table` of shape (H, K) is a K-element computation per score. The tracer expands such a
value into its K elements (one IR node each: K loads, K products) and a reduction folds
them into one node, so kernels still see scalar IR. The expansion is bounded by
MAX_ELEMENTS; past it the mod has to index every dimension.

These helpers work on element lists in row-major order and know nothing of proxies.
"""
from __future__ import annotations

import math

import torch

from . import ir
from .ir import DType, Node

MAX_ELEMENTS = 64


class VectorShapeError(ValueError):
    """Shapes that do not broadcast, a bad dim, or an array too large to expand."""


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def check_size(shape: tuple[int, ...], what: str) -> None:
    if numel(shape) > MAX_ELEMENTS:
        raise VectorShapeError(
            f"{what} has shape {tuple(shape)}, {numel(shape)} elements: a mod can compute with at most "
            f"{MAX_ELEMENTS} elements of a captured tensor at once (each one is a load in the kernel)"
        )


def broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    try:
        out = tuple(torch.broadcast_shapes(*shapes))
    except RuntimeError:
        raise VectorShapeError(f"shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast together") from None
    check_size(out, "the result")
    return out


def _grid(shape: tuple[int, ...]) -> torch.Tensor:
    """An array of `shape` holding each element's own row-major position: what torch's indexing or a shape method
    does to it says which elements the result takes."""
    return torch.arange(numel(shape)).reshape(shape)


def _taken(picked: torch.Tensor) -> tuple[list[int], tuple[int, ...]]:
    """A _grid's result: the positions it took, row-major, and its shape."""
    return picked.reshape(-1).tolist(), tuple(picked.shape)


def positions(shape: tuple[int, ...], target: tuple[int, ...]) -> list[int]:
    """For each element of `target` (row-major), the element of an array of `shape` that broadcasts to it."""
    return _taken(_grid(shape).broadcast_to(target))[0]


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def select(shape: tuple[int, ...], key) -> tuple[list[int], tuple[int, ...]]:
    """Constant indexing (ints, slices, None, ...): the selected positions and the result shape."""
    return _taken(_grid(shape)[key])


# Methods that only rearrange an array's elements (row-major order kept or permuted), on traced values as on tensors.
SHAPE_METHODS = ("unsqueeze", "squeeze", "reshape", "view", "flatten", "expand", "broadcast_to", "permute",
                 "transpose", "movedim", "t")


def rearrange(shape: tuple[int, ...], method: str, args: tuple, kwargs: dict) -> tuple[list[int], tuple[int, ...]]:
    """`method` applied to an array of `shape` (torch's own rules, on the positions): the positions of the result's
    elements and its shape."""
    try:
        picked = getattr(_grid(shape), method)(*args, **kwargs)
    except (RuntimeError, TypeError, IndexError) as e:
        raise VectorShapeError(f"{method}() of an array of shape {tuple(shape)}: {e}") from None
    check_size(tuple(picked.shape), f"the result of {method}()")
    return _taken(picked)


def _dims(dim, ndim: int) -> tuple[int, ...]:
    if dim is None:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    out = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            raise VectorShapeError(f"dim must be a Python int or a tuple of them, got {d!r}")
        if not -max(ndim, 1) <= d < max(ndim, 1):
            raise VectorShapeError(f"dim {d} is out of range for {ndim} dimension(s)")
        out.append(d % max(ndim, 1))
    return tuple(sorted(set(out)))


def _fold(op: str, items: list[Node]) -> Node:
    """Pairwise combination: a tree of depth log2(n), not a chain of n."""
    while len(items) > 1:
        items = [ir.binary(op, items[i], items[i + 1]) if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


def _truthy(x: Node) -> Node:
    return x if x.dtype is DType.BOOL else ir.binary("ne", x, ir.const(0, x.dtype) if x.dtype.is_int else ir.const(0.0))


def _combine(name: str, items: list[Node]) -> Node:
    if name in ("sum", "prod"):
        if not items[0].dtype.is_float:
            items = [ir.cast(x, DType.INT64) for x in items]  # torch sums integers and bools in int64
        return _fold("add" if name == "sum" else "mul", items)
    if name == "mean":
        if not items[0].dtype.is_float:
            raise ir.IRTypeError(f"mean() of {items[0].dtype.value} values: torch needs a float dtype; use .float().mean()")
        return ir.binary("div", _fold("add", items), ir.const(float(len(items))))
    if name in ("any", "all"):
        return _fold("or" if name == "any" else "and", [_truthy(x) for x in items])
    if items[0].dtype is DType.BOOL:  # amax / amin of bools
        return _fold("or" if name == "amax" else "and", items)
    return _fold("max" if name == "amax" else "min", items)


REDUCTIONS = ("sum", "prod", "mean", "amax", "amin", "any", "all")


def reduce(name: str, items: list[Node], shape: tuple[int, ...], dim=None, keepdim: bool = False):
    """torch.<name>(x, dim, keepdim) on the elements: (result elements, result shape)."""
    if not items:
        raise VectorShapeError(f"{name}() of an empty array")
    dims = _dims(dim, len(shape))
    if not shape:
        return [_combine(name, items)], ()
    kept = [d for d in range(len(shape)) if d not in dims]
    grid = torch.arange(len(items)).reshape(shape).permute(*kept, *dims)
    outer = tuple(shape[d] for d in kept)
    groups = grid.reshape(numel(outer), -1).tolist()
    out = [_combine(name, [items[i] for i in group]) for group in groups]
    if keepdim:
        outer = tuple(1 if d in dims else shape[d] for d in range(len(shape)))
    return out, outer
