"""The sm90 forward's work order (templates/sm90/work_order.cuh): which query tiles are heaviest, how many
(batch, head) pairs interleave, and the counter from which the sm90 kernel draws its tiles."""
from __future__ import annotations

import functools
import weakref

import torch

# The K and V of one chunk of (batch, head) pairs should take at most this share of the L2 cache: they are
# read by every CTA working on the chunk, while Q, O and the next chunk's K and V pass through beside them.
_L2_SHARE = 1 / 3


def query_tile_order(block_mask, block_m: int) -> torch.Tensor:
    """The query tiles of `block_m` rows, heaviest first, as int32 indices: a tile weighs the number of KV
    blocks the mask lists for its query block (partial and full), summed over batch and heads. Ties keep
    the later tile first (causal). Cached per count tensor, so the layers of a model that share one mask
    (each call rebuilds the BlockMask around the same tensors) compute it once."""
    counts, full = block_mask.kv_num_blocks, block_mask.full_kv_num_blocks
    key = (id(counts), id(full), block_m, block_mask.seq_lengths[0], block_mask.BLOCK_SIZE[0])
    hit = _orders.get(key)
    if hit is not None and hit[0]() is counts and hit[1] == _versions(counts, full):
        return hit[2]
    weights = counts.to(torch.int64) if full is None else counts.to(torch.int64) + full
    per_block = weights.sum(dim=(0, 1)) if weights.dim() == 3 else weights
    q_len, q_block = block_mask.seq_lengths[0], block_mask.BLOCK_SIZE[0]
    tiles = torch.arange(-(-q_len // block_m) - 1, -1, -1, device=per_block.device)  # later tiles first among equals
    weight = per_block[tiles * block_m // q_block]
    order = tiles[torch.sort(weight, descending=True, stable=True).indices].to(torch.int32)
    if len(_orders) >= _MAX_ORDERS:
        _orders.clear()
    _orders[key] = (weakref.ref(counts), _versions(counts, full), order)
    return order


def _versions(counts: torch.Tensor, full: torch.Tensor | None) -> tuple[int, int]:
    """In-place changes to the mask's tensors bump their versions and invalidate the cached order."""
    return counts._version, -1 if full is None else full._version


_MAX_ORDERS = 256
_orders: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def head_chunk(pairs: int, kv_len: int, head_dim: int, elem_bytes: int, kv_group: int, l2_bytes: int) -> int:
    """How many (batch, head) pairs' tiles to interleave: as many as keep their K and V within a share of
    L2 (query heads of one KV head share theirs), at least one, at most all."""
    per_pair = max(1, 2 * kv_len * head_dim * elem_bytes // kv_group)
    return max(1, min(pairs, int(l2_bytes * _L2_SHARE) // per_pair))


_counters: dict[tuple[int, int], torch.Tensor] = {}


def tile_counter(stream: torch.cuda.Stream) -> torch.Tensor:
    """A zeroed int32 the sm90 forward, launched on `stream` (the current one), draws work tiles from. The
    kernel leaves it zero when it ends, so one counter serves every launch on a stream (launches on one
    stream never overlap); each stream has its own. Under CUDA graph capture a fresh one is made, its
    zeroing captured with the graph."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(1, dtype=torch.int32, device=stream.device)
    key = (stream.device_index, stream.cuda_stream)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = torch.zeros(1, dtype=torch.int32, device=stream.device)
    return counter
