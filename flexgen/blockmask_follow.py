"""Whether a block mask's hand-made lists (PyTorch's create_block_mask, from_kv_blocks) agree with its mask_mod.

A kernel tile may walk the union of several query blocks' lists, mask_mod deciding each element the union makes
partial (runtime/coarse_rows.py), only where every block the lists leave out is one mask_mod hides whole and every
full block one it shows whole. flexgen's create_block_mask marks its masks so (BlockMask.blocks_follow_mask_mod).
PyTorch's create_block_mask computes its lists from the mask_mod as well, but its masks carry no such mark: here
flexgen classifies the blocks itself (blockmask.block_mask_of) and adopts the mask when the lists agree. Eager calls
only (a compiled graph's tensors are symbolic), once per mask (blockmask_cache.py), for mask_mods without buffers.
"""
from __future__ import annotations

import logging

import torch

from .blockmask import BlockMask, block_mask_of, reads_batch_heads
from .dsl.mod import Mod, mod_for_token
from .blockmask_cache import cached_per_mask, capturing

log = logging.getLogger(__name__)

# Blocks (B x H x nQ x nKV) past which a mask is not classified: the comparison holds them densely, a byte each.
MAX_BLOCKS = 1 << 26


def adopt_if_lists_follow(bm: BlockMask, mask_token: str, mask_buffers) -> BlockMask:
    """`bm` marked as following its mask_mod where its lists agree with the traced mask (`mask_token`); else `bm`."""
    if bm.blocks_follow_mask_mod or not mask_token or mask_buffers or torch.compiler.is_compiling():
        return bm
    counts, full = bm.kv_num_blocks, bm.full_kv_num_blocks
    if capturing(counts):  # (classifying runs kernels, which a graph would capture)
        return bm
    key = ("follows", id(counts), id(full), mask_token, tuple(bm.seq_lengths), tuple(bm.BLOCK_SIZE))
    follows = cached_per_mask(key, counts, full, lambda: _checked(bm, mod_for_token(mask_token)))
    return bm.derived_from_mask_mod() if follows else bm


def _checked(bm: BlockMask, mod: Mod) -> bool:
    """lists_follow, False where the classification itself fails: adopting a mask only speeds a call up, so a
    mask that cannot be classified here is walked as it is rather than refused."""
    try:
        return lists_follow(bm, mod)
    except Exception as e:  # noqa: BLE001
        log.debug("could not classify the blocks of %s: %s", mod.name, e)
        return False


def lists_follow(bm: BlockMask, mod: Mod) -> bool:
    """Whether every block `bm` leaves out is one `mod` hides whole, and every block it lists as full one `mod`
    shows whole (partial blocks may be anything: mask_mod decides them). flexgen's classification is exact for the
    blocks it calls empty or full and may call a block partial that is either, which can only answer False."""
    batch, heads = bm.kv_num_blocks.shape[:2]
    reads_b, reads_h = reads_batch_heads(mod)
    if (reads_b and batch == 1) or (reads_h and heads == 1):
        return False  # lists shared across batches or heads by a mask that tells them apart
    q_len, kv_len = bm.seq_lengths
    bq, bkv = bm.BLOCK_SIZE
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bkv)
    if batch * heads * n_q * n_kv > MAX_BLOCKS:
        return False
    ours = block_mask_of(mod, batch, heads, q_len, kv_len, bq, bkv, bm.device)
    their_partial, their_full = bm.block_states(n_q, n_kv)
    our_partial, our_full = ours.block_states(n_q, n_kv)
    hidden_by_them = ~(their_partial | their_full)
    hidden_by_mod = ~(our_partial | our_full)
    return not bool(((hidden_by_them & ~hidden_by_mod) | (their_full & ~our_full)).any())
