// The list of KV tiles one query tile visits (both forward families): BLOCK_N-wide tiles, full
// mask blocks first, then partial ones, from the BlockMask's index lists; or every tile in order
// when there is no block mask. Needs BLOCK_N, FwdParams and common/block_tiles.cuh (with SHIFT_MASK_BLOCKS).
#pragma once

using TileList = BlockTiles<BLOCK_N, SHIFT_MASK_BLOCKS>;

// The KV tiles of the query tile starting at row m0 of (b, h), from FwdParams' block-mask lists.
// (Filled field by field, as query_tiles in common/q_schedule.cuh: the sm80 kernels sit at the register
// limit; a shared builder function, or the counts loaded apart from the pointers, spilled 4-24 bytes there.)
__device__ __forceinline__ TileList kv_tiles(const FwdParams& p, int m0, int b, int h) {
    TileList tiles;
    tiles.dense = !p.has_block_mask;
    if (p.has_block_mask) {
        const int qb = m0 / p.mask_q_block;
        tiles.sub = p.mask_kv_block / BLOCK_N;
        tiles.n_part = p.kv_num_blocks[b * p.kvn_stride_b + h * p.kvn_stride_h + qb * p.kvn_stride_q];
        tiles.part_idx = p.kv_indices + b * p.kvi_stride_b + h * p.kvi_stride_h + qb * p.kvi_stride_q;
        if (p.full_kv_num_blocks != nullptr) {
            tiles.n_full = p.full_kv_num_blocks[b * p.fkvn_stride_b + h * p.fkvn_stride_h + qb * p.fkvn_stride_q];
            tiles.full_idx = p.full_kv_indices + b * p.fkvi_stride_b + h * p.fkvi_stride_h + qb * p.fkvi_stride_q;
        } else {
            tiles.n_full = 0;
            tiles.full_idx = nullptr;
        }
    } else {
        tiles.sub = 1;
        tiles.n_full = (p.kv_len + BLOCK_N - 1) / BLOCK_N;
        tiles.n_part = 0;
        tiles.full_idx = nullptr;
        tiles.part_idx = nullptr;
    }
    tiles.count = (tiles.n_full + tiles.n_part) * tiles.sub;
    return tiles;
}

// The same list with its counts loaded elsewhere (the sm90 forward's producer loads them ahead of the
// consumers): the list's own loads of them are then dead, and the compiler drops them.
__device__ __forceinline__ TileList with_counts(TileList tiles, int n_full, int n_part) {
    tiles.n_full = n_full;
    tiles.n_part = n_part;
    tiles.count = (n_full + n_part) * tiles.sub;
    return tiles;
}
