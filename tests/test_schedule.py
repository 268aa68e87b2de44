"""The forward's work order (runtime/schedule.py): the query tiles heaviest first from a block mask's
counts, cached per mask tensor, and how many (batch, head) pairs' tiles interleave."""
from __future__ import annotations

import torch

from flexgen import create_block_mask, variants as V
from flexgen.runtime.schedule import head_chunk, query_tile_order


def _weights(bm, block_m):
    counts = bm.kv_num_blocks.long() + (0 if bm.full_kv_num_blocks is None else bm.full_kv_num_blocks.long())
    per_block = counts.sum(dim=(0, 1))
    n_m = -(-bm.seq_lengths[0] // block_m)
    return [int(per_block[m * block_m // bm.BLOCK_SIZE[0]]) for m in range(n_m)]


def _check_order(bm, block_m):
    order = query_tile_order(bm, block_m)
    weights = _weights(bm, block_m)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(len(weights)))  # a permutation
    ranked = [weights[m] for m in order.tolist()]
    assert ranked == sorted(ranked, reverse=True)
    for a, b in zip(order.tolist(), order.tolist()[1:]):  # among equals, the later tile first
        if weights[a] == weights[b]:
            assert a > b
    return order


def test_causal_order_is_the_reversed_tiles():
    bm = create_block_mask(V.causal, None, None, 1000, 1000, device="cpu")
    assert _check_order(bm, 128).tolist() == list(range(7, -1, -1))


def test_document_order_follows_the_counts():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    lengths = torch.randint(260, 700, (12,), generator=gen)  # at least 3120 tokens: covers the sequence
    doc = torch.repeat_interleave(torch.arange(12), lengths)[:3000].to(torch.int32)
    bm = create_block_mask(V.document(doc), None, None, 3000, 3000, device="cpu")
    for block_m in (64, 128):  # kernel tiles smaller than the mask's blocks share their block's weight
        _check_order(bm, block_m)


def test_per_head_masks_are_summed_and_the_order_is_cached():
    def late_heads_see_more(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h > 0)

    bm = create_block_mask(late_heads_see_more, 2, 3, 700, 700, device="cpu")
    order = _check_order(bm, 128)
    assert query_tile_order(bm, 128) is order
    bm.kv_num_blocks.zero_()  # an in-place change invalidates the cached order
    assert query_tile_order(bm, 128) is not order
    _check_order(bm, 128)


def test_head_chunk_keeps_a_chunk_within_a_share_of_l2():
    l2 = 50 * 2**20
    assert head_chunk(32, 8192, 128, 2, 1, l2) == 4  # 4 MiB of K and V per head
    assert head_chunk(32, 8192, 64, 2, 1, l2) == 8
    assert head_chunk(32, 8192, 128, 2, 4, l2) == 16  # GQA: four query heads share one KV head
    assert head_chunk(32, 1 << 20, 128, 2, 1, l2) == 1  # at least one pair
    assert head_chunk(3, 128, 64, 2, 1, l2) == 3  # at most all of them
