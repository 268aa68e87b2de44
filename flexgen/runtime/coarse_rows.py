"""A block mask over taller query tiles than its own blocks: for the sm90 forward's 192-row tiles (three consumer
warpgroups, templates/sm90/fwd.cu.j2) under a mask of 64- or 128-row blocks, and the sm90 backward's 80-row steps
(templates/sm90/bwd.cu.j2), which walk the transposed lists of such a mask.

The kernel walks one list of KV blocks per query tile. A tile of `rows` rows touches two or three of the mask's
query blocks; its list is their union. A KV block is full for the tile only if it is full for every query block the
tile touches; otherwise it is partial if any of them lists it, so that mask_mod decides each element. The element
visibility is therefore the mask's own, at the price of evaluating mask_mod on a few blocks that were full or empty
for some of the tile's rows.
"""
from __future__ import annotations

import torch

from ..blockmask import BlockMask, dense_to_lists
from ..blockmask_cache import cached_per_mask, capturing


def coarse_rows(block_mask, rows: int, q_lists: bool = False):
    """`block_mask` over query tiles of `rows` rows (BLOCK_SIZE (rows, its KV block)); the mask itself where its
    query blocks are already a multiple of `rows`. q_lists: with the transposed lists too (what the backward walks).
    Cached per count tensor (blockmask_cache.py); computed afresh under CUDA-graph capture, where a cached tensor's
    address must not be captured."""
    bq, bkv = block_mask.BLOCK_SIZE
    if bq % rows == 0:
        return block_mask
    counts, full_counts = block_mask.kv_num_blocks, block_mask.full_kv_num_blocks
    if capturing(counts):
        return _coarsen(block_mask, rows, q_lists)
    key = ("rows", id(counts), id(full_counts), rows, block_mask.seq_lengths, bq, q_lists)
    return cached_per_mask(key, counts, full_counts, lambda: _coarsen(block_mask, rows, q_lists))


def _coarsen(block_mask, rows: int, q_lists: bool = False) -> BlockMask:
    bq, bkv = block_mask.BLOCK_SIZE
    q_len, kv_len = block_mask.seq_lengths
    device = block_mask.kv_indices.device
    partial, full = block_mask.block_states()
    tiles = torch.arange(-(-q_len // rows), device=device)
    first = tiles * rows // bq
    last = (torch.clamp((tiles + 1) * rows, max=q_len) - 1) // bq
    touched = -(-rows // bq) + 1  # at most this many query blocks per tile
    blocks = torch.minimum(first[:, None] + torch.arange(touched, device=device), last[:, None])  # (tiles, touched)
    listed = (partial | full)[..., blocks, :].any(dim=-2)  # (..., tiles, cols)
    all_full = full[..., blocks, :].all(dim=-2)
    partial_tiles = listed & ~all_full
    if q_lists:
        return BlockMask.from_dense_blocks(all_full, partial_tiles, (rows, bkv), (q_len, kv_len), block_mask.mask_mod)
    kv_num, kv_idx = dense_to_lists(partial_tiles)
    full_num, full_idx = dense_to_lists(all_full)
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                     full_kv_indices=full_idx, q_num_blocks=None, q_indices=None, full_q_num_blocks=None,
                     full_q_indices=None, BLOCK_SIZE=(rows, bkv), mask_mod=block_mask.mask_mod)
