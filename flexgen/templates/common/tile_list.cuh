// The list of KV tiles one query tile visits (both forward families): BLOCK_N-wide tiles, full
// mask blocks first, then partial ones, from the BlockMask's index lists; or every tile in order
// when there is no block mask. Needs BLOCK_N and FwdParams.
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

// The KV tiles of the query tile starting at row m0 of (b, h), from FwdParams' block-mask lists.
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
