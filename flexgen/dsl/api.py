"""The user-facing constructors: score_mod, mask_mod, and_masks, or_masks, noop_mask, trace.

    flexgen.score_mod(lambda score, b, h, q_idx, kv_idx: score + (q_idx - kv_idx))
    flexgen.score_mod("cap * tanh(score / cap)", cap=30.0)
    flexgen.mask_mod("q_idx >= kv_idx and q_idx - kv_idx < window", window=1024)

Keyword bindings name tensors (buffers) and Python scalars (run-time parameters,
or constants with specialize=True). A Mod passed in comes back unchanged.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Union

from . import ir
from .errors import SignatureError
from .mod import MASK_ARGS, Mod
from .parse import parse_mod
from .trace import Tracer, trace_function

ModLike = Union[Mod, str, Callable[..., Any]]


def score_mod(fn_or_text: ModLike, *, name: str | None = None, specialize: bool = False, **bindings: Any) -> Mod:
    """A score_mod(score, b, h, q_idx, kv_idx) from a Python function, text, or a Mod."""
    return _make("score", fn_or_text, name, specialize, bindings)


def mask_mod(fn_or_text: ModLike, *, name: str | None = None, specialize: bool = False, **bindings: Any) -> Mod:
    """A mask_mod(b, h, q_idx, kv_idx) -> bool from a Python function, text, or a Mod."""
    return _make("mask", fn_or_text, name, specialize, bindings)


def trace(fn_or_text: ModLike, kind: str | None = None, *, name: str | None = None, specialize: bool = False,
          **bindings: Any) -> Mod:
    """score_mod or mask_mod, whichever fits: functions by their argument count (5 or 4),
    text by its result (bool is a mask) unless `kind` says."""
    if kind not in (None, "score", "mask"):
        raise ValueError(f"kind must be 'score', 'mask' or None, got {kind!r}")
    if kind is None and isinstance(fn_or_text, Mod):
        kind = fn_or_text.kind
    if kind is None and isinstance(fn_or_text, str):
        return parse_mod(fn_or_text, None, name=name, specialize=specialize, bindings=bindings)
    if kind is None:
        kind = "mask" if _positional_count(fn_or_text) == len(MASK_ARGS) else "score"
    return _make(kind, fn_or_text, name, specialize, bindings)


def _positional_count(fn: Callable) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


def _is_block_mask(obj) -> bool:
    """flexgen's or PyTorch's BlockMask, by its shape (this layer sits below flexgen.blockmask)."""
    return type(obj).__name__ == "BlockMask" and hasattr(obj, "kv_num_blocks") and hasattr(obj, "BLOCK_SIZE")


def _make(kind: str, obj: ModLike, name: str | None, specialize: bool, bindings: dict) -> Mod:
    if _is_block_mask(obj):
        raise TypeError(
            f"a BlockMask was passed as {kind}_mod; a BlockMask is not a {kind}_mod: pass it as block_mask= "
            "(flex_attention(..., block_mask=mask)), or pass its mask_mod (mask.mask_mod) where a mask_mod belongs"
        )
    if isinstance(obj, Mod):
        if obj.kind != kind:
            raise SignatureError(f"'{obj.name}' is a {obj.kind}_mod, not a {kind}_mod")
        if bindings:
            raise SignatureError(f"'{obj.name}' is already traced; bindings ({', '.join(bindings)}) cannot apply")
        return obj if name is None or name == obj.name else dataclasses.replace(obj, name=name)
    if isinstance(obj, str):
        return parse_mod(obj, kind, name=name, specialize=specialize, bindings=bindings)
    if callable(obj):
        return trace_function(obj, kind, name=name, specialize=specialize, bindings=bindings)
    raise TypeError(f"{kind}_mod expects a function, a text expression or a Mod, got {type(obj).__name__}")


# ---------------------------------------------------------------- combining masks


def and_masks(*masks: ModLike) -> Mod:
    """A mask that is True where every mask is (FlexAttention's and_masks; no masks: all True)."""
    return _combine(masks, "and")


def or_masks(*masks: ModLike) -> Mod:
    """A mask that is True where any mask is (FlexAttention's or_masks; no masks: all False)."""
    return _combine(masks, "or")


def _combine(masks: tuple[ModLike, ...], op: str) -> Mod:
    mods = [mask_mod(m) for m in masks]
    label = f"{op}_masks({', '.join(m.name for m in mods)})"
    tracer = Tracer("mask", label)
    inputs = tuple(tracer.input(a) for a in MASK_ARGS)
    result = None
    for mod in mods:
        value = tracer.inline(mod, inputs)
        if result is None:
            result = value
        else:
            result = result & value if op == "and" else result | value
    expr, buffers, params = tracer.finish(op == "and" if result is None else result)
    name = f"_{op}_".join(m.name for m in mods) if mods else f"{op}_masks"
    return Mod("mask", expr, buffers, params, name=name, source=label)


noop_mask = Mod("mask", ir.const(True), name="noop_mask", source="True")


def as_mask_mod(fn) -> Mod | None:
    """A Mod for a mask_mod (function, Mod or text), or None for one that keeps every element (noop)."""
    if fn is None:
        return None
    mod = mask_mod(fn)
    if mod is noop_mask or (mod.expr.op == "const" and mod.expr.attr is True):
        return None
    return mod
