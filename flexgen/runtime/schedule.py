"""The sm90 kernels' work orders: for the forward (templates/sm90/work_order.cuh) which query tiles are
heaviest, how many (batch, head) pairs interleave, and the counter from which it draws its tiles; for the
backward, which KV tile each persistent CTA takes at each turn."""
from __future__ import annotations

import functools
import heapq
import threading

import torch

from ..blockmask_cache import cached_per_mask, capturing
from ..cuda_graphs import allocating_for_a_graph

# The K and V of one chunk of (batch, head) pairs should take at most this share of the L2 cache: they are
# read by every CTA working on the chunk, while Q, O and the next chunk's K and V pass through beside them.
_L2_SHARE = 1 / 3
# Under a block mask, on the forward's 192-row tiles (D = 64), chunk_by_tail looks for the shortest tail among chunks
# up to what 4/3 of a wave covers whole: tiles of unequal cost do not run in waves, so a chunk a little past one wave
# still has most of its K and V read at about the same time, and the shorter tail pays there (on 128-row tiles it
# did not: docs/scheduling.md, step 7).
TAIL_REACH = (4, 3)


def query_tile_order(block_mask, block_m: int) -> torch.Tensor | None:
    """The query tiles of `block_m` rows, heaviest first, as int32 indices: a tile weighs the number of KV
    blocks the mask lists for its query block (partial and full), summed over batch and heads. Ties keep
    the later tile first (causal). Cached per count tensor (blockmask_cache.py); None under CUDA-graph
    capture."""
    counts, full = block_mask.kv_num_blocks, block_mask.full_kv_num_blocks
    if capturing(counts):
        return None
    key = (id(counts), id(full), block_m, block_mask.seq_lengths[0], block_mask.BLOCK_SIZE[0])
    return cached_per_mask(key, counts, full, lambda: _query_tile_order(counts, full, block_mask, block_m))


def chunk_by_tail(block_mask, block_m: int, pairs: int, ctas: int, bound: int) -> "int | TailChoice":
    """The head chunk, at most `bound` (head_chunk), whose modeled tail (modeled_tail, the query tiles weighed by
    the block mask) is shortest; the largest among equals. On a GPU a TailChoice (its value is `bound` until the
    mask's costs have come back to the host, which is never waited for); cached per count tensor as
    query_tile_order; `bound` under CUDA-graph capture."""
    counts, full = block_mask.kv_num_blocks, block_mask.full_kv_num_blocks
    if bound <= 1 or capturing(counts):
        return bound
    key = ("chunk", id(counts), id(full), block_m, block_mask.seq_lengths[0], block_mask.BLOCK_SIZE[0], pairs, ctas,
           bound)
    choice = cached_per_mask(key, counts, full, lambda: TailChoice(_query_tile_costs(counts, full, block_mask, block_m),
                                                                    pairs, ctas, bound))
    return choice if counts.is_cuda else choice.value()


class TailChoice:
    """chunk_by_tail's answer for one mask, made without waiting for the GPU: the query tiles' costs come back by
    a copy that the stream runs when it gets there (a fresh mask per training step then costs no sync), and until
    they have, the wave rule's bound stands. `fill` writes the current answer into a forward's parameters at each
    launch, so a planned call takes the model's chunk from the first launch after the costs arrive."""

    def __init__(self, costs: torch.Tensor, pairs: int, ctas: int, bound: int):
        self.pairs, self.ctas, self.bound = pairs, ctas, bound
        self._chosen: int | None = None
        self._ready = None
        if costs.is_cuda:
            self._costs = torch.empty(costs.shape, dtype=costs.dtype, pin_memory=True)
            self._costs.copy_(costs, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._costs = costs

    def value(self) -> int:
        if self._chosen is None:
            if self._ready is not None and (torch.cuda.is_current_stream_capturing() or not self._ready.query()):
                return self.bound  # (a capture may not query an event: the graph keeps the bound)
            self._chosen = _chunk_by_tail(tuple(self._costs.tolist()), self.pairs, self.ctas, self.bound)
            self._costs = self._ready = None
        return self._chosen

    def fill(self, p) -> None:
        p.head_chunk = self.value()


def _chunk_by_tail(costs: tuple[float, ...], pairs: int, ctas: int, bound: int) -> int:
    tails = {chunk: round(modeled_tail(costs, pairs, ctas, chunk), 6) for chunk in range(bound, 0, -1)}
    return min(tails, key=lambda chunk: (tails[chunk], -chunk))


def _query_tile_costs(counts, full, block_mask, block_m: int) -> torch.Tensor:
    """What a query tile of one (batch, head) pair costs, heaviest first, as float64 on the mask's device: its KV
    blocks (averaged over the mask's batch and heads) plus one for its fixed part (docs/scheduling.md's model)."""
    per_tile = _tile_weights(counts, full, block_mask, block_m).double() / (counts.shape[0] * counts.shape[1])
    return torch.sort(per_tile, descending=True).values + 1


def _tile_weights(counts, full, block_mask, block_m: int) -> torch.Tensor:
    """Per query tile of `block_m` rows, in order: the KV blocks the mask lists for its query block (partial and
    full), summed over batch and heads."""
    weights = counts.to(torch.int64) if full is None else counts.to(torch.int64) + full
    per_block = weights.sum(dim=(0, 1)) if weights.dim() == 3 else weights
    q_len, q_block = block_mask.seq_lengths[0], block_mask.BLOCK_SIZE[0]
    tiles = torch.arange(-(-q_len // block_m), device=per_block.device)
    return per_block[tiles * block_m // q_block]


def modeled_tail(costs: tuple[float, ...], pairs: int, ctas: int, chunk: int) -> float:
    """The last CTA's finish over the mean when `ctas` CTAs each take the next tile as they come free, the tiles
    in the forward's order (sm90/work_order.cuh): pairs in chunks of `chunk`, within a chunk the rank (`costs`,
    heaviest first) varying slowest."""
    free = [0.0] * min(ctas, pairs * len(costs))
    total = 0.0
    for first in range(0, pairs, chunk):
        in_chunk = min(chunk, pairs - first)
        for cost in costs:
            for _ in range(in_chunk):
                heapq.heapreplace(free, free[0] + cost)
            total += cost * in_chunk
    return max(free) / (total / len(free))


def _query_tile_order(counts, full, block_mask, block_m: int) -> torch.Tensor:
    weights = _tile_weights(counts, full, block_mask, block_m)
    tiles = torch.arange(weights.numel() - 1, -1, -1, device=weights.device)  # later tiles first among equals
    return tiles[torch.sort(weights[tiles], descending=True, stable=True).indices].to(torch.int32)


def kv_tile_turns(block_mask, block_n: int, num_kv_tiles: int, batch: int, heads: int, kv_heads: int,
                  ctas: int) -> torch.Tensor | None:
    """The sm90 backward's persistent walk under a block mask: entry c + t * ctas is the work tile CTA c takes
    at its turn t (tile n of KV head hk in batch b is n + num_kv_tiles * (hk + kv_heads * b)), -1 where a CTA
    has no more. Turn t holds the same work tiles as the static walk's (t * ctas to t * ctas + ctas - 1 in that
    order, the KV tile fastest), so the tiles that run together, and share Q, dO and dQ rows in L2, are the
    same; only which CTA takes which changes: the heaviest tile of a turn goes to the CTA with the least work so
    far. A tile weighs the query blocks the mask lists for its KV block (partial ones twice) over the KV head's
    query heads, plus one for its K / V loads and dK / dV epilogue. (The static walk leaves causal masks a
    long tail where the CTAs' stride nearly divides the tiles per head; sorting tiles across turns balances
    better but breaks the L2 sharing: docs/scheduling.md.) Int32 on the mask's device, cached per count tensor
    as query_tile_order; None under CUDA-graph capture (the kernel then walks statically)."""
    counts, full = block_mask.q_num_blocks, block_mask.full_q_num_blocks
    if capturing(counts):
        return None
    key = ("kv", id(counts), id(full), block_n, num_kv_tiles, batch, heads, kv_heads, ctas, block_mask.BLOCK_SIZE[1])
    return cached_per_mask(key, counts, full, lambda: _kv_tile_turns(counts, full, block_mask, block_n, num_kv_tiles,
                                                                     batch, heads, kv_heads, ctas))


# The backward's turns may be dealt in windows of this many: a window's tiles heaviest first across its turns, each
# turn's to the least loaded CTAs. That balances the CTAs better, but the tiles that run together then come from
# more heads and share less in L2, so windows are taken only where the model's busiest CTA comes out at least
# MIN_WINDOW_GAIN lighter than turn by turn. (H100, kernel time at base clocks, N = 8k, windows of 4 against turn by
# turn: D = 128 causal -3.6%, prefix-LM -4.9%, documents -3.5%, D = 64 causal -3.0%, documents -6.6%, where the
# model gains 3-5%; the D = 128 sliding window +25%, where it gains 0.5%: docs/scheduling.md.)
WINDOW_TURNS = 4
MIN_WINDOW_GAIN = 0.02


def _kv_tile_turns(counts, full, block_mask, block_n: int, num_kv_tiles: int, batch: int, heads: int, kv_heads: int,
                   ctas: int) -> torch.Tensor:
    # A partial block evaluates the mask on every score and counts twice.
    weights = 2 * counts.to(torch.int64) if full is None else 2 * counts.to(torch.int64) + full
    weights = weights.expand(batch, heads, -1).reshape(batch, kv_heads, heads // kv_heads, -1).sum(dim=2)
    tiles = (torch.arange(num_kv_tiles, device=weights.device) * block_n // block_mask.BLOCK_SIZE[1])
    cost = weights[:, :, tiles.clamp(max=weights.shape[-1] - 1)].reshape(-1) + 1  # the KV tile fastest
    return balanced_turns(cost, ctas)


def balanced_turns(cost: torch.Tensor, ctas: int, window: int = WINDOW_TURNS,
                   min_gain: float = MIN_WINDOW_GAIN) -> torch.Tensor:
    """The turns dealt in windows of `window` turns where the busiest CTA's modelled work comes out at least
    `min_gain` lighter than dealt turn by turn, else turn by turn; chosen on the costs' device (no wait for the GPU)."""
    by_turn = _deal_turns(cost, ctas)
    if window == 1:
        return by_turn
    windowed = deal_in_windows(cost, ctas, window)
    better = busiest_load(windowed, cost, ctas) < (1 - min_gain) * busiest_load(by_turn, cost, ctas)
    return torch.where(better, windowed, by_turn)


def busiest_load(walk: torch.Tensor, cost: torch.Tensor, ctas: int) -> torch.Tensor:
    """The largest sum of `cost` over the tiles one CTA takes in `walk` (turn-major, -1 for none), as a tensor."""
    taken = torch.where(walk >= 0, cost[walk.clamp(min=0).long()], 0)
    return taken.view(-1, ctas).sum(dim=0).max()


def deal_in_windows(cost: torch.Tensor, ctas: int, window: int) -> torch.Tensor:
    """_deal_turns over the tiles of each window of `window` turns reordered heaviest first (window 1: as they come),
    as work tile indices into `cost`."""
    if window == 1:
        return _deal_turns(cost, ctas)
    span = window * ctas
    order = torch.cat([start + torch.argsort(cost[start:start + span], descending=True, stable=True)
                       for start in range(0, cost.numel(), span)])
    dealt = _deal_turns(cost[order], ctas)
    return torch.where(dealt < 0, dealt, order.to(torch.int32)[dealt.clamp(min=0).long()])


def _deal_turns(cost: torch.Tensor, ctas: int) -> torch.Tensor:
    """Turn t deals work tiles t * ctas, ... (costs `cost`), heaviest to the least loaded CTA; a short last turn
    leaves -1 to the most loaded ones. On the costs' device, so that a mask's turns are made without waiting for
    the GPU: a few small operations per turn, once per mask."""
    tiles, device = cost.numel(), cost.device
    turns = -(-tiles // ctas)
    padded = torch.full((turns * ctas,), -1, dtype=torch.int64, device=device)
    padded[:tiles] = cost
    padded = padded.view(turns, ctas)
    heaviest = torch.argsort(padded, dim=1, descending=True, stable=True)  # (a short turn's padding last)
    turn_cost = torch.gather(padded, 1, heaviest)
    turn_tiles = torch.where(turn_cost < 0, -1, heaviest + ctas * torch.arange(turns, device=device)[:, None])
    turn_tiles, turn_cost = turn_tiles.to(torch.int32), turn_cost.clamp(min=0)
    walk = torch.empty(turns, ctas, dtype=torch.int32, device=device)
    loads = torch.zeros(ctas, dtype=torch.int64, device=device)
    for t in range(turns):
        lightest = torch.argsort(loads, stable=True)
        walk[t, lightest] = turn_tiles[t]
        loads[lightest] += turn_cost[t]
    return walk.reshape(-1)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).L2_cache_size


def head_chunk(pairs: int, kv_len: int, head_dim: int, elem_bytes: int, kv_group: int, l2_bytes: int,
               query_tiles: int = 0, ctas: int = 0) -> int:
    """How many (batch, head) pairs' tiles to interleave: as many as keep their K and V within a share of
    L2 (query heads of one KV head share theirs), and no more than a wave of `ctas` covers with every one of
    their `query_tiles` (each pair's K and V then stream through L2 once, read by all its tiles at about the same
    time); at least one, at most all."""
    per_pair = max(1, 2 * kv_len * head_dim * elem_bytes // kv_group)
    chunk = int(l2_bytes * _L2_SHARE) // per_pair
    if query_tiles > 0 and ctas > 0:
        chunk = min(chunk, ctas // query_tiles)
    return max(1, min(pairs, chunk))


_counters: dict[tuple[int, int], torch.Tensor] = {}
_counters_lock = threading.Lock()


def tile_counter(device: torch.device, stream: int) -> torch.Tensor:
    """A zeroed int32 the sm90 forward, launched on `stream` (the current one of `device`, a raw pointer), draws
    work tiles from. The kernel leaves it zero when it ends, so one counter serves every launch on a stream
    (launches on one stream never overlap); each stream has its own. Where allocations belong to a CUDA graph
    (cuda_graphs.py) a fresh one is made, its zeroing captured with the graph."""
    if allocating_for_a_graph():
        return torch.zeros(1, dtype=torch.int32, device=device)
    key = (device.index, stream)
    counter = _counters.get(key)
    if counter is None:
        # Made once under a lock: two threads' first launches on a stream would otherwise each make one, and the
        # one the dictionary drops is freed while its launch still points at it (its memory then reused, the
        # counter garbage by the time the kernel draws from it).
        with _counters_lock:
            counter = _counters.get(key)
            if counter is None:
                counter = _counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


# Split keys (runtime/split_kv.py), parts per query tile: none shorter than MIN_TILES_PER_PART KV tiles, at most
# MAX_SPLITS, and among those the count that the wave model below finishes first. A part's fixed work (its Q, the
# pipeline's fill, its fp32 partials) costs about PART_OVERHEAD_TILES KV tiles.
MIN_TILES_PER_PART = 4
MAX_SPLITS = 128
PART_OVERHEAD_TILES = 2


def kv_splits(query_tiles: int, kv_tiles: int, slots: int) -> int:
    """How many parts each of `query_tiles` query tiles (over all batches and heads) is split into, for a KV
    sequence of `kv_tiles` tiles on a GPU where `slots` CTAs of the kernel are resident at once (SMs times CTAs per
    SM). Modelled time: the waves of CTAs times the longest part's tiles plus its fixed cost; the fewest parts
    among equals. (A count that spills a few CTAs into a second wave doubles the time; rounding the parts up to
    fill the GPU did that.)"""
    if query_tiles <= 0 or kv_tiles <= 0:
        return 1
    most = max(1, min(kv_tiles // MIN_TILES_PER_PART, MAX_SPLITS))

    def modeled(splits: int) -> int:
        waves = -(-query_tiles * splits // max(1, slots))
        return waves * (-(-kv_tiles // splits) + PART_OVERHEAD_TILES)

    return min(range(1, most + 1), key=lambda splits: (modeled(splits), splits))
