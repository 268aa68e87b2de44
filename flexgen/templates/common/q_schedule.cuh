// The query tiles one KV tile visits in the backward (both families): for each query head of the
// KV head's group, full mask blocks first, then partial ones, from the BlockMask's transposed lists;
// or every query tile in order when there is no block mask. Needs BLOCK_M, BwdParams and
// common/block_tiles.cuh.
#pragma once

// The query tiles one (KV tile, query head) pair visits.
using QTileList = BlockTiles<BLOCK_M, SHIFT_MASK_BLOCKS>;

__device__ QTileList query_tiles(const BwdParams& p, int b, int h, int kv_block) {
    QTileList l;
    l.dense = !p.has_block_mask;
    if (p.has_block_mask) {
        l.sub = p.mask_q_block / BLOCK_M;
        l.n_part = p.q_num_blocks[b * p.qn_stride_b + h * p.qn_stride_h + kv_block * p.qn_stride_kv];
        l.part_idx = p.q_indices + b * p.qi_stride_b + h * p.qi_stride_h + kv_block * p.qi_stride_kv;
        if (p.full_q_num_blocks != nullptr) {
            l.n_full = p.full_q_num_blocks[b * p.fqn_stride_b + h * p.fqn_stride_h + kv_block * p.fqn_stride_kv];
            l.full_idx = p.full_q_indices + b * p.fqi_stride_b + h * p.fqi_stride_h + kv_block * p.fqi_stride_kv;
        } else {
            l.n_full = 0;
            l.full_idx = nullptr;
        }
    } else {
        l.sub = 1;
        l.n_full = (p.q_len + BLOCK_M - 1) / BLOCK_M;
        l.n_part = 0;
        l.full_idx = nullptr;
        l.part_idx = nullptr;
    }
    l.count = (l.n_full + l.n_part) * l.sub;
    return l;
}

// One unit of work: query tile [m0, m0 + BLOCK_M) of query head h.
struct Work {
    int h, m0;
    bool partial;
};

// Walks (query head of the KV head's group, query tile) in order; tiles past q_len are skipped. The walk is
// incremental: a block mask's index is loaded once per mask block, and no tile index is divided.
struct Schedule {
    int g, t;          // next: query head h_kv * kv_group + g, tile t of its list
    int blk, within;   // t's mask block in the list, and t's tile within that block
    int row;           // first row of mask block blk, once loaded (within > 0)
    QTileList list;

    __device__ void begin(const BwdParams& p, int b, int h_kv, int kv_block) {
        g = 0;
        restart(p, b, h_kv, kv_block);
    }
    __device__ void restart(const BwdParams& p, int b, int h_kv, int kv_block) {
        t = blk = within = row = 0;
        list = query_tiles(p, b, h_kv * p.kv_group + g, kv_block);
    }
    __device__ bool next(const BwdParams& p, int b, int h_kv, int kv_block, Work& w) {
        while (true) {
            if (t < list.count) {
                if (within == 0) row = list.dense ? t * BLOCK_M : list.block_tile(blk) * BLOCK_M;
                const int m0 = row + within * BLOCK_M;
                const bool partial = blk >= list.n_full;  // (a dense list's n_full covers it)
                ++t;
                if (++within == list.sub) {
                    within = 0;
                    ++blk;
                }
                if (m0 < p.q_len) {
                    w.h = h_kv * p.kv_group + g;
                    w.m0 = m0;
                    w.partial = partial;
                    return true;
                }
            } else if (g + 1 < p.kv_group) {
                ++g;
                restart(p, b, h_kv, kv_block);
            } else {
                return false;
            }
        }
    }
};
