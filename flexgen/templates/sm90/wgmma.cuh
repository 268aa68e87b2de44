// Warpgroup-level building blocks for sm_90a: shared-memory layouts and matrix descriptors, the
// wgmma fence / commit / wait sequence, and where the fp32 accumulators sit in the output. The MMA
// instructions themselves, one wrapper per shape, are emitted by sm90/wgmma_mma.j2. No CUDA
// headers; raw PTX.
//
// Written from the PTX ISA sections "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
// (wgmma.mma_async, the matrix descriptor, the canonical shared-memory layouts).
// benchmarks/probes/wgmma_probe.py checks every piece against torch on a Hopper GPU.
#pragma once

// ------------------------------------------------------------------ shared-memory layouts
//
// Operands are "K-major": A is M x K and B is given as B^T, N x K, both with K contiguous, so
// both are read by the instruction without transposition (imm-trans-a = imm-trans-b = 0).
// The hardware reads a tile as 8-row x 16-byte "core matrices" (8 x 8 bf16).
//
// 128-byte swizzle (the layout TMA writes, and the one the real kernels will use):
//   one row of 64 bf16 is 128 bytes = 8 chunks of 16 bytes; 8 such rows form a 1024-byte
//   swizzle atom. Chunk c of row r is stored at chunk position c ^ (r % 8). Without the
//   XOR, the 8 rows of a core matrix (same c, 8 consecutive r) would all sit in the same
//   16-byte bank group, 128 bytes apart: an 8-way bank conflict for every reader. The hardware
//   applies the XOR to absolute shared addresses (address bits [4,7) ^= bits [7,10)), so each
//   atom must be 1024-byte aligned (then the descriptor's base-offset field stays 0).
//   For K > 64 the tile is a sequence of 64-wide "panels": panel p holds columns
//   [64p, 64p + 64) of every row, rows * 128 bytes per panel.
//   Descriptor: SBO (stride byte offset) = 1024, the step between 8-row groups along M/N.
//   LBO (leading byte offset) would be the step between core matrices along K, but with
//   swizzling it is implied: one wgmma reads K = 16 = 32 bytes, which stays inside the
//   128-byte row, and the swizzle fixes where each 16-byte chunk is. By convention it is
//   set to 16 bytes (encoded 1). Stepping K by 16 moves the start address by 32 bytes;
//   bits [7,10) do not change, so the XOR pattern the hardware applies stays that of the atom.
__device__ __forceinline__ int sw128_offset(int row, int k, int rows) {  // in bf16 elements
    const int panel = k >> 6, kk = k & 63;
    return panel * rows * 64 + row * 64 + ((((kk >> 3) ^ (row & 7))) << 3) + (kk & 7);
}

// No swizzle ("interleaved"): each 8 x 8 core matrix is 128 contiguous bytes (row i at 16 i).
// Here core matrix (row block rb, k block kb) sits at index kb * (rows / 8) + rb: K blocks
// outer. So LBO (next core matrix along K) = rows / 8 * 128 bytes, SBO (next along M/N) = 128
// bytes. They differ on purpose: swapping them in the descriptor gives wrong results, so the
// probe tells which field is which. Stepping K by 16 moves the start by 2 * LBO.
__device__ __forceinline__ int interleave_offset(int row, int k, int rows) {  // in bf16 elements
    return ((k >> 3) * (rows >> 3) + (row >> 3)) * 64 + (row & 7) * 8 + (k & 7);
}

// ------------------------------------------------------------------ matrix descriptor
//
// 64-bit descriptor of one operand tile in shared memory (all byte quantities >> 4):
//   bits  0-13  start address        bits 16-29  leading dimension byte offset (LBO)
//   bits 32-45  stride byte offset   bits 49-51  base offset (0: atoms 1024-byte aligned)
//   bits 62-63  swizzle: 0 none, 1 128-byte, 2 64-byte, 3 32-byte
enum WgmmaSwizzle : unsigned { kSwizzleNone = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

__device__ __forceinline__ unsigned long long wgmma_desc(unsigned smem_addr, unsigned lbo_bytes, unsigned sbo_bytes,
                                                          unsigned swizzle) {
    unsigned long long d = 0;
    d |= static_cast<unsigned long long>((smem_addr >> 4) & 0x3FFF);
    d |= static_cast<unsigned long long>((lbo_bytes >> 4) & 0x3FFF) << 16;
    d |= static_cast<unsigned long long>((sbo_bytes >> 4) & 0x3FFF) << 32;
    d |= static_cast<unsigned long long>(swizzle & 0x3) << 62;
    return d;
}

__device__ __forceinline__ unsigned wgmma_smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------ ordering
//
// Shared memory written by ordinary st.shared (the generic proxy) is read by wgmma through the
// async proxy: each writer fences the proxies, then the CTA barrier makes all writes visible.
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Before the first wgmma of a batch (and whenever the accumulator registers or the operand
// shared memory were touched by other instructions since the last one).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
// Closes the wgmma instructions issued so far into one group.
__device__ __forceinline__ void wgmma_commit_group() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N groups are still in flight; only then may the accumulators be read.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The accumulators are written asynchronously, behind the compiler's back: this empty asm
// "uses and redefines" each one, so no read or write of them is moved across a wgmma / wait.
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for register A fragments (packed 16-bit pairs): pins their computation before a wgmma_fence.
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(unsigned (&a)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// ------------------------------------------------------------------ accumulator layout
//
// Warp w of the warpgroup owns output rows [16 w, 16 w + 16). Within a warp, each 8-column
// block j is laid out like an mma.sync m16n8 C fragment: registers 4j..4j+3 of lane l hold
//   (row 16w + l/4,     col 8j + 2(l%4) + {0, 1})  for registers 4j, 4j+1
//   (row 16w + l/4 + 8, col 8j + 2(l%4) + {0, 1})  for registers 4j+2, 4j+3.
// `tid` is the thread's index within the warpgroup (0..127); i the register (0..N/2-1).
__device__ __forceinline__ void wgmma_acc_coord(int tid, int i, int& row, int& col) {
    const int warp = tid >> 5, lane = tid & 31;
    row = warp * 16 + (lane >> 2) + ((i >> 1) & 1) * 8;
    col = (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
}

// A compile-time flag as a value, to instantiate one step lambda twice (with and without a product): a run-time
// branch around a wgmma makes ptxas serialise every wgmma of the kernel (C7513), a peeled loop does not.
template <bool V>
struct BoolConstant {
    static constexpr bool value = V;
};
