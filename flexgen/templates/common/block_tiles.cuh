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

// `n_part` / `part_idx`: this row's count and list of partial blocks; `n_full` / `full_idx` those of
// full blocks (null when the mask has none). Read only when `masked`.
template <int TILE>
__device__ __forceinline__ BlockTiles<TILE> block_tiles(bool masked, int mask_block, int len, const int* n_part,
                                                        const int* part_idx, const int* n_full, const int* full_idx) {
    BlockTiles<TILE> tiles;
    tiles.dense = !masked;
    if (masked) {
        tiles.sub = mask_block / TILE;
        tiles.n_part = *n_part;
        tiles.part_idx = part_idx;
        tiles.n_full = n_full != nullptr ? *n_full : 0;
        tiles.full_idx = full_idx;
    } else {
        tiles.sub = 1;
        tiles.n_full = (len + TILE - 1) / TILE;
        tiles.n_part = 0;
        tiles.full_idx = nullptr;
        tiles.part_idx = nullptr;
    }
    tiles.count = (tiles.n_full + tiles.n_part) * tiles.sub;
    return tiles;
}
