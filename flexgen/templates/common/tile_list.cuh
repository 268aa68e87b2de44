// The list of KV tiles one query tile visits (both forward families): BLOCK_N-wide tiles, full
// mask blocks first, then partial ones, from the BlockMask's index lists; or every tile in order
// when there is no block mask. Needs BLOCK_N.
#pragma once

// The n-th KV tile this CTA visits: full mask blocks first, then partial ones;
// each mask block is cut into mask_kv_block / BLOCK_N kernel tiles.
struct TileList {
    const int* full_idx;
    const int* part_idx;
    int n_full, n_part, sub, count;
    bool dense;  // no block mask: tile t starts at t * BLOCK_N

    __device__ int start(int t) const {
        if (dense) return t * BLOCK_N;
        const int blk = t / sub;
        const int kv_block = blk < n_full ? full_idx[blk] : part_idx[blk - n_full];
        return kv_block * sub * BLOCK_N + (t % sub) * BLOCK_N;
    }
    __device__ bool partial(int t) const { return t / sub >= n_full; }
};
