// The tiles of TILE rows that one row (or column) of a block mask lists: full mask blocks first,
// then partial ones (mask_mod applies), each mask block cut into mask_block / TILE kernel tiles;
// or, without a block mask, every tile of the sequence in order. The forward walks KV tiles
// (common/tile_list.cuh), the backward query tiles (common/q_schedule.cuh).
#pragma once

// SHIFT: `sub` (tiles per mask block) is a run-time value, so t / sub is an integer division (a reciprocal and
// a dozen instructions) at every step, on the path to the step's copies and products; a power of two (the
// usual case: 128-token blocks over 128- or 64-row tiles) shifts instead. (The sm80 kernels keep the
// division: they sit at the register limit, and the test costs one more register.)
template <int TILE, bool SHIFT>
struct BlockTiles {
    const int* full_idx;
    const int* part_idx;
    int n_full, n_part, sub, count;
    bool dense;  // no block mask: tile t starts at t * TILE

    __device__ int block_of(int t) const {
        if constexpr (SHIFT) return (sub & (sub - 1)) == 0 ? t >> (__ffs(sub) - 1) : t / sub;
        return t / sub;
    }
    // First tile of the list's mask block `blk` (a block mask's lists only): walkers that step through the tiles
    // in order look each block up once, where start(t) divides t and loads the index at every tile.
    __device__ int block_tile(int blk) const {
        const int block = blk < n_full ? full_idx[blk] : part_idx[blk - n_full];
        return block * sub;
    }
    __device__ int start(int t) const {
        if (dense) return t * TILE;
        const int blk = block_of(t);
        if constexpr (SHIFT) return (block_tile(blk) + t - blk * sub) * TILE;
        return block_tile(blk) * TILE + (t % sub) * TILE;
    }
    __device__ bool partial(int t) const {  // (never, without a block mask)
        if constexpr (SHIFT) return t >= n_full * sub;
        return t / sub >= n_full;
    }
};
