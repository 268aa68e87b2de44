// Shared-memory tiles of the sm90 kernels (forward and backward): matrix descriptors of the
// 128-byte-swizzled layout (wgmma.cuh: sw128_offset, 64-column panels), the hand-offs between producer
// and consumers, and bulk stores. Needs wgmma.cuh and mbarrier.cuh. (Tiles are loaded by TMA: tma.cuh.)
#pragma once

constexpr int PANEL_ROW_BYTES = 128;  // one row of a 64-column panel

// ---------------------------------------------------------------- descriptors
// K-major tiles (each row one query / key, K = the head dim contiguous): 128-byte swizzle, SBO = 1024
// (next 8-row group), LBO unused for swizzled K-major (1 by convention). Step kk of K (16 columns =
// 32 bytes) is in panel kk / 4 at byte (kk % 4) * 32 of the row.
// A descriptor's low 14 bits are the start address >> 4, and shared addresses stay below 2^18, so a
// descriptor moves by adding bytes >> 4: each operand's descriptor is built once, and every k-step
// adds a compile-time offset (fewer uniform-datapath instructions between the wgmmas).
__device__ __forceinline__ unsigned long long desc_plus(unsigned long long desc, unsigned bytes) { return desc + (bytes >> 4); }
__device__ __forceinline__ unsigned long long kmajor_desc(unsigned tile_row0) {
    return wgmma_desc(tile_row0, 16, 1024, kSwizzle128B);
}
__host__ __device__ constexpr unsigned kmajor_step_bytes(int tile_rows, int kk) {
    return (kk / 4) * tile_rows * PANEL_ROW_BYTES + (kk % 4) * 32;
}
// The same bytes read MN-major (N contiguous, imm-trans-b = 1): V for O = P V (K = kv, N = d), and in
// the backward dO and Q for dV and dK, K for dQ. PTX ISA 9.7.15.5.1.2.1 canonical layout, MN-major
// 128B swizzle: ((T,8,m),(8,k)) : ((1,T,LBO),(8T,SBO)), T = 8 elements (16 bytes):
//   along N: 64 contiguous elements (one 128-byte panel row), then the next 64 at LBO:
//            LBO = the panel stride = tile_rows * 128 bytes (only used when N > 64)
//   along K: 8 rows 128 bytes apart (the swizzle atom), then the next 8 rows at SBO = 1024.
// (Note the roles are swapped relative to K-major, where SBO steps along M/N.)
// Step kk of K (16 rows) starts MN_STEP_BYTES further: still 1024-aligned.
__device__ __forceinline__ unsigned long long mnmajor_desc(unsigned tile, int tile_rows) {
    return wgmma_desc(tile, tile_rows * PANEL_ROW_BYTES, 1024, kSwizzle128B);
}
constexpr unsigned MN_STEP_BYTES = 16 * PANEL_ROW_BYTES;

// ---------------------------------------------------------------- hand-offs
// After a wait on a `full` barrier: the copy engine wrote the tile through the async proxy, which wgmma
// reads through too, and the barrier's acquire orders the two, so no proxy fence is needed. The warp
// converges again (lanes leave the barrier's wait loop apart) before the .aligned wgmma instructions.
__device__ __forceinline__ void converge_for_wgmma() { __syncwarp(); }

// One arrival per consumer warp on an `empty` barrier: this warp is done with the tile.
__device__ __forceinline__ void release(unsigned long long* empty) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(empty);
}

// ---------------------------------------------------------------- bulk groups (shared -> global)
// TMA stores and reductions (tma.cuh) go out asynchronously in the issuing thread's bulk group: it goes on,
// and only before the source is written again (or the CTA exits) waits for what it committed. The source
// was written through the generic proxy: the writers fence (fence_proxy_async_shared) and meet the issuer at
// a barrier first.
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The committed copies have read their sources (which may then be overwritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// The committed copies are complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
