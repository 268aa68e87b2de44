// The order in which the sm90 forward draws its work tiles (query tile, head, batch).
// Work tile w is the rank-th heaviest query tile of one (batch, head) pair: the pairs are taken in
// chunks of p.head_chunk, and within a chunk rank varies slowest. Heaviest first makes the grid's tail
// short (the last tiles drawn are the lightest), and a chunk's K and V stay in L2 while its tiles run.
// p.m_order lists the query tiles heaviest first (from the block mask's counts); without it, later
// tiles are taken as heavier (causal). Needs BLOCK_M and FwdParams.
#pragma once

struct WorkTile {
    int m0, h, b;
};

__device__ __forceinline__ WorkTile work_tile(int w, int n_m, const FwdParams& p) {
    const int chunk = w / (p.head_chunk * n_m);
    const int first_pair = chunk * p.head_chunk;
    const int pairs = min(p.head_chunk, p.num_heads * p.batch - first_pair);  // the last chunk may be short
    const int local = w - first_pair * n_m;
    const int rank = local / pairs;
    const int pair = first_pair + local % pairs;  // pair = b * num_heads + h: the heads of one KV head adjacent
    const int m_block = p.m_order != nullptr ? p.m_order[rank] : n_m - 1 - rank;
    return {m_block * BLOCK_M, pair % p.num_heads, pair / p.num_heads};
}
