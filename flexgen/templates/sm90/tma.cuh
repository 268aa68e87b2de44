// Tile loads by the tensor memory accelerator (TMA, `cp.async.bulk.tensor`) for the sm90 kernels.
// One thread issues a whole tile: the copy engine computes the addresses, applies the 128-byte
// swizzle that wgmma.cuh's descriptors expect, fills rows past the tensor's end with zeros, and
// completes the transfer on an mbarrier by its byte count. The producer then costs the consumers
// almost no issue slots (a cp.async producer took 60% of the forward's instructions, ncu on the H200).
//
// The tensor map describing a (B, H, L, D) tensor is encoded on the host (runtime/tensor_maps.py,
// the driver's cuTensorMapEncodeTiled) as 4 dimensions, innermost first: D, L, H, B; its box is
// 64 columns (one 128-byte swizzle panel) x ROWS rows. It travels inside the kernel's
// __grid_constant__ parameter, so its generic address is valid for the copy instruction.
#pragma once

struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

// One arrival that also announces `bytes` more to come from the copy engine; the phase completes
// when every expected arrival has come and all announced bytes have landed.
__device__ __forceinline__ void mbar_arrive_expect_bytes(unsigned long long* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(mbar_addr(bar)), "r"(bytes) : "memory");
}

// The box at (column, row, head, batch) of `map` into shared memory at `dst` (1024-byte aligned for the
// 128-byte swizzle); completes on `bar`.
__device__ __forceinline__ void tma_load_box(void* dst, const TensorMap* map, unsigned long long* bar, int col, int row,
                                             int head, int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
        ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(reinterpret_cast<unsigned long long>(map)),
          "r"(col), "r"(row), "r"(head), "r"(batch), "r"(mbar_addr(bar))
        : "memory");
}

// The reverse: the box at `src` (same layout) to (column, row, head, batch) of `map`, in the calling
// thread's bulk group (bulk_commit, bulk_wait_read in tiles.cuh). Rows past the tensor's end are not written.
__device__ __forceinline__ void tma_store_box(const TensorMap* map, const void* src, int col, int row, int head,
                                              int batch) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
        ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(head), "r"(batch),
          "r"(static_cast<unsigned>(__cvta_generic_to_shared(src)))
        : "memory");
}

// `bytes` contiguous bytes from global `src` to shared `dst` by the copy engine (a 1-D bulk copy, no tensor map),
// completing on `bar` as the tile loads do: both addresses and the size multiples of 16 bytes.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(static_cast<unsigned>(__cvta_generic_to_shared(dst))), "l"(src), "r"(bytes), "r"(mbar_addr(bar))
        : "memory");
}

// Fetches a tensor map into the descriptor cache ahead of its first use.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}

// A ROWS x D tile (rows row0.., all D columns) of the (batch, head) matrix of `map` into the sw128 tile
// layout of sm90/tiles.cuh: one box per 64-column panel, panel p at dst + p * ROWS * 128 bytes. The
// caller has announced the tile's bytes (tile_bytes<ROWS>()) on `bar`.
template <int ROWS>
__device__ __forceinline__ void tma_load_tile(half_bits* dst, const TensorMap* map, unsigned long long* bar, int row0,
                                              int head, int batch) {
    #pragma unroll
    for (int panel = 0; panel < D / 64; ++panel)
        tma_load_box(reinterpret_cast<unsigned char*>(dst) + panel * ROWS * PANEL_ROW_BYTES, map, bar, panel * 64, row0,
                     head, batch);
}
template <int ROWS>
__host__ __device__ constexpr unsigned tile_bytes() { return ROWS * D * 2; }

// Adds the box at (column, row, head, batch) of `map` from shared memory at `src` (laid out as a TMA load of
// the same box would write it: 1024-byte aligned, 128-byte swizzle) into global memory, element by element
// (the reduction is done in L2, like red.global.add). Elements outside the tensor are skipped. Completes
// as a bulk group: bulk_commit(), then bulk_wait_read() before `src` is written again.
__device__ __forceinline__ void tma_reduce_add_box(const TensorMap* map, const void* src, int col, int row, int head,
                                                   int batch) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n"
        ::"l"(reinterpret_cast<unsigned long long>(map)), "r"(col), "r"(row), "r"(head), "r"(batch),
          "r"(static_cast<unsigned>(__cvta_generic_to_shared(src)))
        : "memory");
}

// Adds `bytes` contiguous fp32 values from shared memory at `src` into global memory at `dst` (a 1-D bulk reduction,
// no tensor map; done in L2, like red.global.add): both addresses and the size multiples of 16 bytes. Completes as a
// bulk group, as tma_reduce_add_box.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const void* src, unsigned bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
        ::"l"(dst), "r"(static_cast<unsigned>(__cvta_generic_to_shared(src))), "r"(bytes)
        : "memory");
}
