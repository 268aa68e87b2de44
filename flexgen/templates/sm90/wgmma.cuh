// Warpgroup-level building blocks for sm_90a: shared-memory matrix descriptors, the wgmma
// fence / commit / wait sequence, one m64n64k16 bf16 MMA with both operands in shared
// memory, and where its fp32 accumulators sit in the 64x64 output. No CUDA headers; raw PTX.
//
// Written from the PTX ISA sections "Asynchronous Warpgroup Level Matrix Multiply-Accumulate"
// (wgmma.mma_async, the matrix descriptor, the canonical shared-memory layouts). Still
// unproven on hardware: benchmarks/probes/wgmma_probe.py checks every piece against torch.
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

// ------------------------------------------------------------------ the MMA
//
// D (64 x 64 fp32, 32 registers per thread) = A (64 x 16, desc_a) * B (16 x 64, desc_b, given
// K-major as 64 x 16) + (scale_d ? D : 0). Both operands come from shared memory.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_ss(float (&d)[32], unsigned long long desc_a,
                                                        unsigned long long desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

// D (64 x 64 fp32) = A (64 x 16, registers) * B (16 x 64, desc_b) + (scale_d ? D : 0), with B
// MN-major (N contiguous, imm-trans-b = 1): the O += P V product of the forward. A register
// fragment a[0..3] is, per warp (rows 16w..16w+15), the mma.sync m16n8k16 A fragment (PTX ISA
// Figure 148). There is no imm-trans-a operand when A is in registers.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs_tn(float (&d)[32], const unsigned (&a)[4],
                                                           unsigned long long desc_b, int scale_d) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n"
        "}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
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
