"""create_block_mask, eagerly and under torch.compile. Under compile the block lists come from a custom op, so a
compiled function that builds its mask (or `torch.compile(create_block_mask)` itself) keeps one graph.

Building a mask is data-dependent work (flexgen evaluates the mask on the tiles its static analysis cannot
decide), which dynamo cannot trace; its results' shapes, though, follow from the lengths and block sizes alone,
which is all the op's fake kernel needs. The mask_mod reaches the op as its variant token and buffer tensors,
as a score_mod reaches the attention ops (variant.py, compiled_mods.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from . import blockmask_dq_order as dq_order
from . import blockmask_validate as check
from .blockmask import DEFAULT_BLOCK_SIZE, BlockMask, block_mask_of, default_device, dense_to_lists, reads_batch_heads
from .dsl.api import as_mask_mod
from .dynamo_marks import assume_constant_result


def create_block_mask(
    mask_mod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: str | torch.device | None = None,
    BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
    _compile: bool = False,
    separate_full_blocks: bool = True,
    compute_dq_write_order: bool = False,
    dq_kv_order: bool = True,
) -> BlockMask:
    """Block mask for `mask_mod` (a plain FlexAttention-style function, a flexgen Mod or text).

    Tiles are classified by static analysis of the traced mask where it can decide them
    (causal, windows, prefixes: no element is evaluated); the rest are evaluated on
    `device`, a chunk of tiles at a time. B or H of None broadcasts (size 1). device=None
    picks as PyTorch does: the current accelerator (CUDA), else the CPU.
    separate_full_blocks=False lists every visited block as partial (mask_mod applied everywhere), as PyTorch's
    does; inside a compiled region the lists stay separate (the same attention). compute_dq_write_order=True
    gives the mask PyTorch's deterministic-dQ metadata, ranked in the order dq_kv_order names
    (blockmask_dq_order.py; eager calls, where the installed torch computes it): flexgen's kernels do not read it.
    """
    where = "create_block_mask"
    for name, value in (("separate_full_blocks", separate_full_blocks),
                        ("compute_dq_write_order", compute_dq_write_order), ("dq_kv_order", dq_kv_order)):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: {name} must be a bool (True or False), got {value!r}")  # (as PyTorch)
    if torch.compiler.is_compiling():  # the lists from a custom op, so that a compiled graph holds them
        return _traced_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, check.block_size(BLOCK_SIZE, where))
    for name, value in (("B", B), ("H", H)):
        if value is not None and (check.as_int(value) is None or value <= 0):
            raise ValueError(f"{where}: {name} must be a positive int or None (broadcast), got {value!r}")
    if any(check.as_int(n) is None or n <= 0 for n in (Q_LEN, KV_LEN)):
        raise ValueError(f"{where}: Q_LEN and KV_LEN must be positive ints, got {Q_LEN!r} and {KV_LEN!r}")
    bq, bkv = check.block_size(BLOCK_SIZE, where)
    mod = as_mask_mod(mask_mod)
    device = default_device() if device is None else torch.device(device)
    mask = block_mask_of(mod, B or 1, H or 1, Q_LEN, KV_LEN, bq, bkv, device)
    if not separate_full_blocks:
        mask = _full_blocks_as_partial(mask)
    mask = mask._broadcast_to(B or 1, H or 1)
    return replace(mask, **dq_order.computed(mask, dq_kv_order)) if compute_dq_write_order else mask


def _full_blocks_as_partial(mask: BlockMask) -> BlockMask:
    """The mask with no full lists: every visited block listed as partial, in block order."""
    counts, indices = dense_to_lists(mask.to_dense().bool())
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod,
                                    seq_lengths=mask.seq_lengths)


LIST_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@torch.library.custom_op("flexgen::block_mask_lists", mutates_args=())
def block_mask_lists(buffers: list[Tensor], token: str, batch: int, heads: int, q_len: int, kv_len: int,
                     q_block: int, kv_block: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor,
                                                                                 Tensor, Tensor, Tensor, Tensor]:
    """The eight block lists of the mask `token` names (with these buffers), for (batch, heads) = what
    reads_batch_heads gives (1 where the mask does not read b or h): the caller broadcasts them."""
    mod = None
    if token:
        from .dsl.mod import mod_for_token

        mod = mod_for_token(token)
        mod = replace(mod, buffers=dict(zip(mod.buffer_names, buffers)))
    mask = block_mask_of(mod, batch, heads, q_len, kv_len, q_block, kv_block, device)
    return tuple(getattr(mask, f).contiguous() for f in LIST_FIELDS)


@block_mask_lists.register_fake
def _(buffers, token, batch, heads, q_len, kv_len, q_block, kv_block, device):
    n_q, n_kv = -(-q_len // q_block), -(-kv_len // kv_block)
    make = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
    return (make(batch, heads, n_q), make(batch, heads, n_q, n_kv), make(batch, heads, n_q),
            make(batch, heads, n_q, n_kv), make(batch, heads, n_kv), make(batch, heads, n_kv, n_q),
            make(batch, heads, n_kv), make(batch, heads, n_kv, n_q))


@assume_constant_result
def _batch_heads_read(token: str) -> tuple:
    """Whether the mask `token` names reads b, and h (a constant of the graph)."""
    from .dsl.mod import mod_for_token

    return reads_batch_heads(mod_for_token(token) if token else None)


def _traced_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, block_size: tuple[int, int]) -> BlockMask:
    """create_block_mask's work where dynamo traces it."""
    from .variant import mod_parts

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    parts = mod_parts(mask_mod, "mask", torch.device(device))
    if parts is None:
        raise RuntimeError("create_block_mask under torch.compile: a mask_mod made inside the compiled function "
                           "that captures tensors cannot be traced; define it outside the compiled function")
    token, buffers = parts
    batch, heads = B or 1, H or 1
    reads_b, reads_h = _batch_heads_read(token)
    lists = block_mask_lists(list(buffers), token, batch if reads_b else 1, heads if reads_h else 1, Q_LEN, KV_LEN,
                             block_size[0], block_size[1], torch.device(device))
    mask = BlockMask((Q_LEN, KV_LEN), *lists, block_size, mask_mod).derived_from_mask_mod()
    return mask._broadcast_to(batch, heads)
