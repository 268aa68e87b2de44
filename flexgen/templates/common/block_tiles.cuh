// The tiles of TILE rows that one row (or column) of a block mask lists: full mask blocks first,
// then partial ones (mask_mod applies), each mask block cut into mask_block / TILE kernel tiles;
// or, without a block mask, every tile of the sequence in order. The forward walks KV tiles
// (common/tile_list.cuh), the backward query tiles (common/q_schedule.cuh).
#pragma once

template <int TILE>
struct BlockTiles {
    const int* full_idx;
    const int* part_idx;
    int n_full, n_part, sub, count;
    bool dense;  // no block mask: tile t starts at t * TILE

    __device__ int start(int t) const {
        if (dense) return t * TILE;
        const int blk = t / sub;
        const int block = blk < n_full ? full_idx[blk] : part_idx[blk - n_full];
        return block * sub * TILE + (t % sub) * TILE;
    }
    __device__ bool partial(int t) const { return t / sub >= n_full; }  // (never, without a block mask)
};
