"""`Mod`: a traced score_mod or mask_mod: its IR plus the values bound to it.

The IR (and so the structural hash and every kernel cache key) holds only the
structure; buffer tensors and scalar parameter values ride alongside and become
kernel arguments. A Mod is also callable with torch tensors, so it can be passed
wherever FlexAttention expects a plain function.
"""
from __future__ import annotations

import hashlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

from .evaluate import evaluate
from .ir import BufferSpec, DType, Node, buffers_of, params_of
from .printer import pretty

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")

# token -> what a Mod with that structure and those parameter values is made of, without its
# buffer tensors: torch.library ops carry only the token and get the buffers as inputs
# (flexgen/ops.py). Least recently used first out past _MAX_TOKENS, so that a parameter whose
# value changes on every call cannot grow it without bound; it keeps no tensor alive.
_BY_TOKEN: "OrderedDict[str, tuple]" = OrderedDict()
_MAX_TOKENS = 4096


# How a Mod called on traced values splices itself into the trace: set by trace.py (which imports this
# module) when it loads. Until then no traced value exists, and a call evaluates the Mod on tensors.
_inline_call = None


def set_inliner(inline_call) -> None:
    """`inline_call(mod, args)`: the traced result of calling `mod` on `args`, or None if none is traced."""
    global _inline_call
    _inline_call = inline_call


def register_mod(mod: "Mod") -> None:
    if mod.token in _BY_TOKEN:
        _BY_TOKEN.move_to_end(mod.token)
        return
    _BY_TOKEN[mod.token] = (mod.kind, mod.expr, dict(mod.params), mod.name, mod.source)
    if len(_BY_TOKEN) > _MAX_TOKENS:
        _BY_TOKEN.popitem(last=False)


def mod_for_token(token: str) -> "Mod":
    """A Mod with this token's structure and parameters and no buffer tensors (bind them later)."""
    kind, expr, params, name, source = _BY_TOKEN[token]
    return Mod(kind, expr, {}, params, name, source)


class _CallSignature:
    """A Mod's call signature, (b, h, q_idx, kv_idx) or (score, b, h, q_idx, kv_idx): PyTorch tells a
    mask_mod from a score_mod by its positional arguments (its create_block_mask, create_mask).
    On the class itself it is None, so inspect.signature(Mod) still describes the constructor."""

    def __get__(self, mod, owner=None):
        if mod is None:
            return None
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        return inspect.Signature([inspect.Parameter(name, kind) for name in mod.arg_names])


@dataclass(frozen=True, eq=False)
class Mod:
    kind: str  # "score" or "mask"
    expr: Node
    buffers: Mapping[str, torch.Tensor] = field(default_factory=dict)
    params: Mapping[str, bool | int | float] = field(default_factory=dict)
    name: str = "mod"
    source: str = ""  # what the user wrote (text form, or the function's source)

    def __post_init__(self) -> None:
        if self.kind not in ("score", "mask"):
            raise ValueError(f"Mod kind must be 'score' or 'mask', got {self.kind!r}")
        want = DType.BOOL if self.kind == "mask" else DType.FLOAT32
        if self.expr.dtype is not want and not (self.kind == "score" and self.expr.dtype.is_int):
            raise TypeError(f"a {self.kind}_mod must return {want.value}, got {self.expr.dtype.value}")
        object.__setattr__(self, "buffers", MappingProxyType(dict(self.buffers)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        # Plain attributes that torch.compile reads as constants / graph inputs (see flexgen/ops.py).
        names = tuple(s.name for s in buffers_of(self.expr))
        params = ",".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        object.__setattr__(self, "token", f"{self.kind}:{self.expr.digest}:{params}:{','.join(names)}")
        object.__setattr__(self, "buffer_names", names)
        object.__setattr__(self, "buffer_tensors", tuple(self.buffers.get(n) for n in names))
        object.__setattr__(self, "is_noop", self.kind == "mask" and self.expr.op == "const" and self.expr.attr is True)
        register_mod(self)

    @property
    def __name__(self) -> str:
        """A label only (not part of the IR or any key): code written for PyTorch reads and sets it on mask and
        score functions, combined ones too (`mask = or_masks(a, b); mask.__name__ = "global_window"`)."""
        return self.__dict__.get("_label", self.name)

    @property
    def arg_names(self) -> tuple[str, ...]:
        return SCORE_ARGS if self.kind == "score" else MASK_ARGS

    __signature__ = _CallSignature()

    @property
    def structural_hash(self) -> str:
        """Stable across processes; independent of buffer contents and parameter values."""
        return hashlib.sha256(f"{self.kind}:{self.expr.digest}".encode()).hexdigest()

    @property
    def buffer_specs(self) -> list[BufferSpec]:
        return buffers_of(self.expr)

    @property
    def param_specs(self) -> dict[str, DType]:
        return params_of(self.expr)

    def pretty(self) -> str:
        return pretty(self.expr)

    def evaluate(self, float_dtype: torch.dtype = torch.float64, check_ranges: bool = True, **inputs) -> torch.Tensor:
        return evaluate(self.expr, inputs, self.buffers, self.params, float_dtype, check_ranges)

    def __call__(self, *args):
        if len(args) != len(self.arg_names):
            raise TypeError(f"{self.kind}_mod {self.name!r} takes ({', '.join(self.arg_names)}), got {len(args)} arguments")
        traced = _inline_call(self, args) if _inline_call is not None else None  # inside a function being traced
        if traced is not None:
            return traced
        inputs = dict(zip(self.arg_names, args))
        fdt = args[0].dtype if self.kind == "score" and isinstance(args[0], torch.Tensor) else torch.float32
        out = evaluate(self.expr, inputs, self.buffers, self.params, fdt if fdt.is_floating_point else torch.float32)
        return out

    def __repr__(self) -> str:
        return f"{self.kind}_mod {self.name}: {self.pretty()}"


_frozen_setattr = Mod.__setattr__


def _set_label_only(mod: Mod, name: str, value) -> None:
    """A Mod stays immutable but for its __name__ label."""
    if name != "__name__":
        _frozen_setattr(mod, name, value)
        return
    if not isinstance(value, str):
        raise TypeError(f"__name__ must be set to a string, not {type(value).__name__}")
    object.__setattr__(mod, "_label", value)


Mod.__setattr__ = _set_label_only
