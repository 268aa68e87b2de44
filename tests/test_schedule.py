"""The sm90 work orders (runtime/schedule.py): the forward's query tiles heaviest first from a block mask's
counts, cached per mask tensor, and how many (batch, head) pairs' tiles interleave; the backward's turns of
each persistent CTA."""
from __future__ import annotations

import types

import pytest
import torch

from flexgen import create_block_mask, variants as V
from flexgen.runtime import schedule
from flexgen.runtime.schedule import (MIN_WINDOW_GAIN, WINDOW_TURNS, balanced_turns, busiest_load, chunk_by_tail,
                                      deal_in_windows, head_chunk, kv_tile_turns, modeled_tail, query_tile_order)


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


def test_head_chunk_covers_no_more_pairs_than_one_wave_of_ctas_holds_whole():
    l2 = 50 * 2**20
    # 132 CTAs, 64 query tiles per pair (N = 8k, 128-row tiles): two pairs' tiles fill a wave, where L2 allows 4
    assert head_chunk(32, 8192, 128, 2, 1, l2, query_tiles=64, ctas=132) == 2
    assert head_chunk(32, 2048, 128, 2, 1, l2, query_tiles=16, ctas=132) == 8  # (L2 allows 16)
    assert head_chunk(32, 8192, 64, 2, 1, l2, query_tiles=43, ctas=132) == 3  # 192-row tiles at D = 64
    assert head_chunk(32, 1024, 64, 2, 1, l2, query_tiles=8, ctas=132) == 16  # (L2 allows 66)
    assert head_chunk(32, 32768, 128, 2, 1, l2, query_tiles=8, ctas=132) == 1  # a long KV: the L2 share decides
    assert head_chunk(32, 32768, 128, 2, 1, l2, query_tiles=256, ctas=132) == 1  # a pair outlasts a wave: one
    assert head_chunk(4, 8192, 128, 2, 1, l2, query_tiles=64, ctas=256) == 4  # a grid of one CTA per tile: no cap


def test_modeled_tail_follows_ctas_taking_the_next_tile_as_they_come_free():
    # Two pairs of tiles costing 4, 1, 1 on 3 CTAs. Pair by pair (4 1 1 4 1 1): the second 4 starts at 1 and
    # ends at 5, the mean is 4. Rank by rank (4 4 1 1 1 1): every CTA ends at 4.
    assert modeled_tail((4.0, 1.0, 1.0), 2, 3, 1) == pytest.approx(1.25)
    assert modeled_tail((4.0, 1.0, 1.0), 2, 3, 2) == pytest.approx(1.0)
    assert modeled_tail((2.0,), 1, 132, 1) == pytest.approx(1.0)  # fewer tiles than CTAs


def test_chunk_by_tail_takes_the_shortest_tail_within_the_bound_and_is_cached(monkeypatch):
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(causal, None, None, 8192, 8192, device="cpu")
    # D = 64, N = 8k: 192-row tiles, 43 per pair; the wave bound is 3, whose tail is the longest of 1-3
    costs = tuple(schedule._query_tile_costs(bm.kv_num_blocks, bm.full_kv_num_blocks, bm, 192).tolist())
    tails = {c: modeled_tail(costs, 32, 132, c) for c in (1, 2, 3)}
    assert min(tails, key=tails.get) == 2 and tails[3] > tails[1]
    assert chunk_by_tail(bm, 192, 32, 132, 3) == 2
    assert chunk_by_tail(bm, 128, 32, 132, 2) == 2  # D = 128: the bound is also the shortest
    assert chunk_by_tail(bm, 192, 32, 132, 1) == 1
    calls = []
    real = schedule._chunk_by_tail
    monkeypatch.setattr(schedule, "_chunk_by_tail", lambda *a: calls.append(a) or real(*a))
    chunk_by_tail(bm, 192, 32, 132, 3)
    assert calls == []  # (cached per mask)
    bm.kv_num_blocks.add_(0)  # an in-place change invalidates it
    assert chunk_by_tail(bm, 192, 32, 132, 3) == 2 and len(calls) == 1


def _tile_weights(bm, block_n, num_kv_tiles, batch, heads, kv_heads):
    """Per work tile (KV tile fastest, then KV head, then batch): the query blocks listed for its KV block (partial
    ones twice), summed over the KV head's query heads; written out with loops."""
    counts = 2 * bm.q_num_blocks.long() + (0 if bm.full_q_num_blocks is None else bm.full_q_num_blocks.long())
    group = heads // kv_heads
    out = []
    for b in range(batch):
        for hk in range(kv_heads):
            for n in range(num_kv_tiles):
                kvb = n * block_n // bm.BLOCK_SIZE[1]
                out.append(sum(int(counts[b if counts.shape[0] > 1 else 0, h if counts.shape[1] > 1 else 0, kvb])
                               for h in range(hk * group, (hk + 1) * group)))
    return out


def _check_turns(bm, block_n, batch, heads, kv_heads, ctas):
    """Every work tile once, each window of WINDOW_TURNS turns the static walk's tiles of those turns, one tile a CTA
    in every turn but the last, -1 only at the end of a walk; returns the busiest CTA's work over the mean (a tile
    costs its weight plus one)."""
    num_kv_tiles = -(-bm.seq_lengths[1] // block_n)
    turns = kv_tile_turns(bm, block_n, num_kv_tiles, batch, heads, kv_heads, ctas)
    weights = _tile_weights(bm, block_n, num_kv_tiles, batch, heads, kv_heads)
    assert turns.dtype == torch.int32 and turns.numel() % ctas == 0
    rounds = turns.view(-1, ctas).tolist()
    span = WINDOW_TURNS * ctas
    for w in range(0, len(rounds), WINDOW_TURNS):  # the tiles that run together come from the static walk's window
        tiles = [x for turn in rounds[w:w + WINDOW_TURNS] for x in turn if x >= 0]
        assert sorted(tiles) == list(range(w * ctas, min(len(weights), w * ctas + span)))
    assert all(-1 not in turn for turn in rounds[:-1])
    walks = [list(w) for w in zip(*rounds)]  # walks[c]: CTA c's tiles, turn by turn
    for walk in walks:  # a CTA's walk ends at its first -1
        assert all(t < 0 for t in walk[walk.index(-1):]) if -1 in walk else True
    loads = [sum(weights[t] + 1 for t in walk if t >= 0) for walk in walks]
    return max(loads) / (sum(loads) / ctas)


def _static_imbalance(bm, block_n, batch, heads, kv_heads, ctas):
    """The same measure for the walk without turns: CTA c takes work tiles c, c + ctas, ..."""
    num_kv_tiles = -(-bm.seq_lengths[1] // block_n)
    weights = _tile_weights(bm, block_n, num_kv_tiles, batch, heads, kv_heads)
    loads = [sum(w + 1 for w in weights[c::ctas]) for c in range(ctas)]
    return max(loads) / (sum(loads) / ctas)


def test_backward_turns_balance_a_causal_mask():
    # One 16k sequence over 16 heads: 2048 work tiles of 128 weights, 132 CTAs. The static walk strides by 132,
    # 4 past a head's 128 tiles, so half the CTAs take the heavy tiles of every head.
    bm = create_block_mask(V.causal, None, None, 16384, 16384, device="cpu")
    assert _static_imbalance(bm, 128, 1, 16, 16, 132) > 1.5
    assert _check_turns(bm, 128, 1, 16, 16, 132) < 1.04
    bm = create_block_mask(V.causal, None, None, 8192, 8192, device="cpu")
    assert _check_turns(bm, 128, 2, 16, 16, 132) < 1.05 < _static_imbalance(bm, 128, 2, 16, 16, 132)


@pytest.mark.parametrize("kv_tiles, heads", [(64, 32), (128, 16), (16, 128)])
def test_backward_turns_in_windows_balance_causal_masks(kv_tiles, heads):
    """Causal tiles (KV tile n of a head walks kv_tiles - n steps) over 132 CTAs: turn by turn the busiest CTA has
    3-5% more steps than the mean; over windows of four turns, sorted heaviest first, under 1%. Every tile once."""
    steps = torch.tensor([kv_tiles - n for n in range(kv_tiles)] * heads)
    imbalance = {}
    for window in (1, 4):
        walk = deal_in_windows(steps + 1, 132, window)
        assert sorted(t for t in walk.tolist() if t >= 0) == list(range(steps.numel()))
        loads = torch.zeros(132, dtype=torch.int64)
        for turn in walk.view(-1, 132):
            loads[turn >= 0] += steps[turn[turn >= 0].long()]
        imbalance[window] = float(loads.max()) / float(loads.float().mean())
    assert imbalance[4] < 1.01 and imbalance[1] > 1.02


def _tile_costs(mask, n: int, batch: int, heads: int) -> torch.Tensor:
    """The costs kv_tile_turns weighs the 128-key tiles of `mask` by (_tile_weights, + 1)."""
    bm = create_block_mask(mask, None, None, n, n, device="cpu")
    return torch.tensor(_tile_weights(bm, 128, n // 128, batch, heads, heads)) + 1


def test_windows_are_taken_only_where_the_model_gains():
    """Over windows of turns where the busiest CTA comes out MIN_WINDOW_GAIN lighter, else turn by turn. At
    N = 8k, B = 2, H = 16 over 132 CTAs, the masks whose A/B gained 3-7% (causal, prefix-LM, documents) take windows
    and the sliding window, which lost 25% with them, does not (docs/scheduling.md)."""
    doc = torch.repeat_interleave(torch.arange(6), torch.tensor([1500, 900, 2100, 700, 1800, 1192])).to(torch.int32)
    cases = {"causal": (V.causal, True), "prefix-lm": (lambda b, h, q, kv: (kv < 2048) | (q >= kv), True),
             "documents": (lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), True),
             "sliding window": (V.sliding_window(1024), False)}
    for name, (mask, windows) in cases.items():
        cost = _tile_costs(mask, 8192, 2, 16)
        by_turn, windowed = deal_in_windows(cost, 132, 1), deal_in_windows(cost, 132, WINDOW_TURNS)
        chosen = balanced_turns(cost, 132)
        assert sorted(t for t in chosen.tolist() if t >= 0) == list(range(cost.numel())), name
        assert torch.equal(chosen, windowed if windows else by_turn), name
        gain = 1 - float(busiest_load(windowed, cost, 132)) / float(busiest_load(by_turn, cost, 132))
        assert (gain >= MIN_WINDOW_GAIN) == windows, (name, gain)
    # window 1 and a gain nobody reaches are turn by turn
    cost = _tile_costs(V.causal, 8192, 2, 16)
    assert torch.equal(balanced_turns(cost, 132, window=1), deal_in_windows(cost, 132, 1))
    assert torch.equal(balanced_turns(cost, 132, min_gain=0.5), deal_in_windows(cost, 132, 1))


def test_backward_turns_with_gqa_per_head_masks_and_a_short_last_round():
    def late_heads_see_more(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (h > 1)

    bm = create_block_mask(late_heads_see_more, 2, 4, 1100, 1100, device="cpu")
    for kv_heads, ctas in ((4, 30), (2, 7), (1, 5), (2, 13)):
        assert _check_turns(bm, 128, 2, 4, kv_heads, ctas) < _static_imbalance(bm, 128, 2, 4, kv_heads, ctas)
    # 72 tiles over 40 CTAs, two turns: 8 CTAs end at a -1
    assert _check_turns(bm, 128, 2, 4, 4, 40) <= _static_imbalance(bm, 128, 2, 4, 4, 40)
    last = kv_tile_turns(bm, 128, 9, 2, 4, 4, 40)[40:].tolist()
    assert last.count(-1) == 8 and sorted(x for x in last if x >= 0) == list(range(40, 72))


def test_backward_turns_of_documents_and_their_cache():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    lengths = torch.randint(100, 900, (16,), generator=gen)
    doc = torch.repeat_interleave(torch.arange(16), lengths)[:4000].to(torch.int32)
    bm = create_block_mask(V.document(doc), None, None, 4000, 4000, device="cpu")
    # Each turn's heaviest tile to the least loaded CTA is a heuristic: on random documents it loses to the static
    # walk now and then (28 of 2000 seeds, by at most 3.4%); it must not lose by much.
    assert _check_turns(bm, 128, 1, 4, 4, 11) <= 1.1 * _static_imbalance(bm, 128, 1, 4, 4, 11)
    num_kv_tiles = -(-4000 // 128)
    turns = kv_tile_turns(bm, 128, num_kv_tiles, 1, 4, 4, 11)
    assert kv_tile_turns(bm, 128, num_kv_tiles, 1, 4, 4, 11) is turns
    bm.q_num_blocks.zero_()  # an in-place change invalidates the cached turns
    assert kv_tile_turns(bm, 128, num_kv_tiles, 1, 4, 4, 11) is not turns


def test_a_tail_choice_keeps_the_bound_until_the_costs_have_arrived(monkeypatch):
    """On a GPU the costs come back by a copy that nothing waits for: until its event has completed the bound (the
    wave rule) is the answer, then the model's, at every launch that fills its parameters. A launch captured in a
    CUDA graph may not query the event: it keeps the bound."""
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])

    class Event:
        done = False

        def query(self):
            assert not capturing[0], "an event queried during a capture"
            return self.done

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    bm = create_block_mask(causal, None, None, 8192, 8192, device="cpu")
    choice = schedule.TailChoice(schedule._query_tile_costs(bm.kv_num_blocks, bm.full_kv_num_blocks, bm, 192),
                                 32, 132, 3)
    choice._ready = event = Event()
    p = types.SimpleNamespace(head_chunk=0)
    choice.fill(p)
    assert p.head_chunk == 3 and choice.value() == 3
    event.done = capturing[0] = True
    choice.fill(p)
    assert p.head_chunk == 3
    capturing[0] = False
    choice.fill(p)
    assert p.head_chunk == 2 == chunk_by_tail(bm, 192, 32, 132, 3)  # (the shortest tail: the test above)


def test_threads_first_on_a_stream_share_one_tile_counter(monkeypatch):
    """Threads that launch first on a stream at the same moment get the same counter: one made by a thread and dropped
    from the table by another would be freed under its launch."""
    import time

    from at_once import at_once

    monkeypatch.setattr(schedule, "_counters", {})
    monkeypatch.setattr(schedule, "allocating_for_a_graph", lambda: False)
    made = []
    zeros = torch.zeros

    def slow_zeros(*args, **kwargs):  # (widens the window between the lookup and the store)
        time.sleep(0.02)
        made.append(1)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(schedule.torch, "zeros", slow_zeros)
    got = at_once(lambda i: schedule.tile_counter(torch.device("cpu"), 1234), 8)
    assert len(got) == 8 and all(c is got[0] for c in got)
    assert len(made) == 1 and int(got[0].item()) == 0
