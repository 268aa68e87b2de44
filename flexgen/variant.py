"""From flex_attention's Python arguments to what the torch.library ops take: a variant key (a string) and the
variant's buffer tensors.

A flexgen Mod carries its `token` and `buffer_tensors` as plain attributes: dynamo reads them like any attribute
(guarding the token by value, not the Mod by identity). A function is traced into a Mod (captures.py), under
torch.compile from traced code (compiled_mods.py).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .captures import traced
from .compiled_mods import compiled_parts
from .dsl.mod import Mod, mod_for_token
from .dynamo_marks import assume_constant_result

# Buffer identities a variant keeps its Mods bound for (Variant.bind).
_BOUND_PER_VARIANT = 8


def mod_parts(fn, kind: str, device: torch.device | None = None) -> tuple[str, tuple] | None:
    """(token, buffer tensors) of a score_mod or mask_mod; ("", ()) when there is none.
    None under torch.compile for a function dynamo cannot hand over (compiled_mods.py). `device`: where the
    call's tensors are, for the buffers made of sizes a compiled function captured."""
    if fn is None:
        return "", ()
    if isinstance(fn, Mod):
        if fn.kind != kind:
            raise TypeError(f"flex_attention: got a {fn.kind}_mod where a {kind}_mod belongs")
        return ("", ()) if fn.is_noop else (fn.token, fn.buffer_tensors)
    if torch.compiler.is_compiling():
        return compiled_parts(fn, kind, device)
    mod = traced(fn, kind)
    return ("", ()) if mod is None else (mod.token, mod.buffer_tensors)


@dataclass(frozen=True)
class Variant:
    """What a variant key stands for (everything the ops need that is not a tensor)."""

    score: Mod | None
    mask: Mod | None
    block_size: tuple[int, int] | None
    kernel_options: dict
    blocks_follow_mask: bool = False  # BlockMask.blocks_follow_mask_mod of the call's mask

    bound: dict = field(default_factory=dict, compare=False, repr=False)

    def bind(self, buffers) -> tuple[Mod | None, Mod | None]:
        """The score and mask Mods with this call's buffer tensors. Kept per buffer identity
        (the entries hold the tensors, so an id cannot be reused while cached)."""
        ids = tuple(id(t) for t in buffers)
        hit = self.bound.get(ids)
        if hit is None:
            if len(self.bound) >= _BOUND_PER_VARIANT:
                self.bound.clear()
            n = len(self.score.buffer_names) if self.score is not None else 0
            score = self.score and _with_buffers(self.score, buffers[:n])
            mask = self.mask and _with_buffers(self.mask, buffers[n:])
            hit = self.bound[ids] = (score, mask, tuple(buffers))
        return hit[0], hit[1]


def _with_buffers(mod: Mod, tensors) -> Mod:
    return dataclasses.replace(mod, buffers=dict(zip(mod.buffer_names, tensors)))


# key -> Variant; least recently used first out past _MAX_VARIANTS (see dsl/mod.py's tokens).
_VARIANTS: "OrderedDict[str, Variant]" = OrderedDict()
_MAX_VARIANTS = 4096


@assume_constant_result
def variant_key(score_token: str, mask_token: str, block_size, kernel_options, blocks_follow_mask: bool = False) -> str:
    """The key the ops carry; registers what it stands for. (Not the block mask's lengths: the ops take them from
    the inputs, which flex_attention has checked against the mask, so a mask's lengths made symbolic under
    torch.compile(dynamic=True) never have to become constants here.)"""
    options = tuple(sorted((kernel_options or {}).items()))
    key = repr((score_token, mask_token, block_size, options, bool(blocks_follow_mask)))
    if key in _VARIANTS:
        _VARIANTS.move_to_end(key)
    else:
        _VARIANTS[key] = Variant(
            mod_for_token(score_token) if score_token else None,
            mod_for_token(mask_token) if mask_token else None,
            block_size, dict(options), bool(blocks_follow_mask),
        )
        if len(_VARIANTS) > _MAX_VARIANTS:
            _VARIANTS.popitem(last=False)
    return key


def variant(key: str) -> Variant:
    try:
        _VARIANTS.move_to_end(key)
        return _VARIANTS[key]
    except KeyError:
        raise RuntimeError(f"flexgen: unknown variant key {key!r}; keys are made by flex_attention in this process") from None
