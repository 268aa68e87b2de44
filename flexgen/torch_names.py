"""The private names of `torch.nn.attention.flex_attention` that code written for it imports (PyTorch's own
FlexAttention tests among it), so that moving such code to flexgen stays a one-line import change.

flexgen's own: the mod signatures, `_identity`, the block sizes, `_create_empty_block_mask` (a block mask
that masks nothing at any length; `flex_attention` treats it as no block mask) and `_WARNINGS_SHOWN` (the keys of
the once-only warnings it shares with PyTorch, such as return_lse's deprecation; clearing it shows them again). PyTorch's, handed through
because they are PyTorch's machinery rather than part of the attention operator: `_apply_kernel_options`,
`flex_attention_hop`, and the public `FlexKernelOptions` type (flexgen takes its keys and says
which it ignores); the package itself hands through any other private name of PyTorch's module, such as the dQ
write order its deterministic kernels take from a block mask. They are imported only when asked for: they load
torch's compiler stack.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .blockmask import DEFAULT_BLOCK_SIZE, LARGE_BLOCK_SIZE, BlockMask
from .warnings_once import _WARNINGS_SHOWN  # noqa: F401  (exported under PyTorch's name)

_score_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
_mask_mod_signature = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
_DEFAULT_SPARSE_BLOCK_SIZE = DEFAULT_BLOCK_SIZE
_LARGE_SPARSE_BLOCK_SIZE = LARGE_BLOCK_SIZE


def _identity(score: Tensor, batch: Tensor, head: Tensor, token_q: Tensor, token_kv: Tensor) -> Tensor:
    """The score_mod that changes nothing (flex_attention's default)."""
    return score


def _create_empty_block_mask(query: Tensor, key: Tensor) -> BlockMask:
    """A block mask that masks nothing, whatever the lengths: one block of LARGE_BLOCK_SIZE tokens."""
    one = dict(dtype=torch.int32, device=query.device)
    return BlockMask.from_kv_blocks(torch.ones(1, 1, 1, **one), torch.zeros(1, 1, 1, 1, **one),
                                    BLOCK_SIZE=LARGE_BLOCK_SIZE, seq_lengths=(1, 1))


_FROM_TORCH = {
    "FlexKernelOptions": "torch.nn.attention.flex_attention",
    "_apply_kernel_options": "torch.nn.attention.flex_attention",
    "flex_attention_hop": "torch._higher_order_ops.flex_attention",
}
_TORCH_NAME = {"flex_attention_hop": "flex_attention"}


def __getattr__(name: str):
    if name not in _FROM_TORCH:
        raise AttributeError(f"module 'flexgen.torch_names' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_FROM_TORCH[name]), _TORCH_NAME.get(name, name))
