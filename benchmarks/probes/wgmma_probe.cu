// wgmma probe: C (64 x 64, fp32, row-major) = A (64 x K) * B^T, where A and B are bf16,
// row-major 64 x K in global memory (B given as B^T: "K-major"). One CTA of one warpgroup
// (128 threads). benchmarks/probes/wgmma_probe.py prepends wgmma.cuh and the kernels' wgmma
// wrappers (probe_mma_*, from sm90/wgmma_mma.j2) and compiles this for sm_90a. lbo / sbo are
// kernel arguments so the probe can also try other descriptor values.

template <int kK, bool kSwizzle128>
__device__ __forceinline__ int probe_offset(int row, int k) {
    return kSwizzle128 ? sw128_offset(row, k, 64) : interleave_offset(row, k, 64);
}

// Global -> shared in the layout the descriptors describe. 16-byte chunks (8 bf16 along K)
// stay contiguous in both layouts; only where each chunk goes differs.
template <int kK, bool kSwizzle128>
__device__ __forceinline__ void probe_load_tile(unsigned short* smem, const unsigned short* gmem, int tid) {
    constexpr int kChunksPerRow = kK / 8;
#pragma unroll
    for (int c = tid; c < 64 * kChunksPerRow; c += 128) {
        const int row = c / kChunksPerRow, k = (c % kChunksPerRow) * 8;
        const uint4 v = *reinterpret_cast<const uint4*>(gmem + row * kK + k);
        *reinterpret_cast<uint4*>(smem + probe_offset<kK, kSwizzle128>(row, k)) = v;
    }
}

// Both operands into shared memory, visible to wgmma's async-proxy reads (generic-proxy stores, a proxy fence, then
// the CTA barrier).
template <int kK, bool kSwizzle128>
__device__ __forceinline__ void probe_load_operands(unsigned short* sA, unsigned short* sB, const unsigned short* A,
                                                    const unsigned short* B, int tid) {
    probe_load_tile<kK, kSwizzle128>(sA, A, tid);
    probe_load_tile<kK, kSwizzle128>(sB, B, tid);
    fence_proxy_async_shared();
    __syncthreads();
}

// Closes the batch of wgmmas, waits for it, and writes the 64 x 64 accumulator to C (row-major).
__device__ __forceinline__ void probe_finish(float (&d)[32], float* C, int tid) {
    wgmma_commit_group();
    wgmma_wait_group<0>();
    wgmma_fence_operands(d);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        int row, col;
        wgmma_acc_coord(tid, i, row, col);
        C[row * 64 + col] = d[i];
    }
}

template <int kK, bool kSwizzle128>
__device__ __forceinline__ void probe_body(unsigned short* sA, unsigned short* sB, const unsigned short* A,
                                           const unsigned short* B, float* C, unsigned lbo, unsigned sbo) {
    const int tid = threadIdx.x;
    probe_load_operands<kK, kSwizzle128>(sA, sB, A, B, tid);

    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;

    const unsigned a0 = wgmma_smem_u32(sA), b0 = wgmma_smem_u32(sB);
    const unsigned swz = kSwizzle128 ? kSwizzle128B : kSwizzleNone;
    wgmma_fence();
    wgmma_fence_operands(d);
#pragma unroll
    for (int s = 0; s < kK / 16; ++s) {
        // Start of the 64 x 16 slice [16 s, 16 s + 16): where its row 0, column 16 s lies.
        const unsigned step = 2u * probe_offset<kK, kSwizzle128>(0, 16 * s);
        const unsigned long long desc_a = wgmma_desc(a0 + step, lbo, sbo, swz), desc_b = wgmma_desc(b0 + step, lbo, sbo, swz);
        if (s == 0) probe_mma_ss_first(d, desc_a, desc_b);
        else probe_mma_ss(d, desc_a, desc_b, 1);
    }
    probe_finish(d, C, tid);
}

// P V probe: C (64 x 64) = P (64 x 64) * V (64 x 64), both bf16 row-major in global memory.
// P goes to registers in the A-fragment layout; V ([k][n], n contiguous) is stored in the same
// sw128 layout as a K-major tile (rows = k) and read MN-major (imm-trans-b = 1), as the sm90
// forward reads its V tiles. lbo / sbo: MN-major meanings (LBO = next 64-column panel along N,
// unused at N = 64; SBO = next 8-row group along K, 1024).
__device__ __forceinline__ void probe_pv_body(unsigned short* sV, const unsigned short* P, const unsigned short* V,
                                              float* C, unsigned lbo, unsigned sbo) {
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    probe_load_tile<64, true>(sV, V, tid);
    fence_proxy_async_shared();
    __syncthreads();

    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    unsigned a[4][4];
    const int row = warp * 16 + (lane >> 2);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        const int col = 16 * s + 2 * (lane & 3);
        a[s][0] = *reinterpret_cast<const unsigned*>(P + row * 64 + col);
        a[s][1] = *reinterpret_cast<const unsigned*>(P + (row + 8) * 64 + col);
        a[s][2] = *reinterpret_cast<const unsigned*>(P + row * 64 + col + 8);
        a[s][3] = *reinterpret_cast<const unsigned*>(P + (row + 8) * 64 + col + 8);
        wgmma_fence_operands(a[s]);
    }
    const unsigned v0 = wgmma_smem_u32(sV);
    wgmma_fence_operands(d);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)  // K step s: rows [16 s, 16 s + 16) of V, 16 rows * 128 bytes further
        probe_mma_rs(d, a[s], wgmma_desc(v0 + s * 16 * 128, lbo, sbo, kSwizzle128B), s > 0);
    probe_finish(d, C, tid);
}

// A^T B probe: C (64 x 64) = A^T * B, A and B bf16 row-major 64 x 64 in global memory ([k][m] and [k][n]), both
// stored in the sw128 layout (rows = k) and read MN-major (imm-trans-a = imm-trans-b = 1), as the D = 256
// backward reads P (for P^T) and dO in dV += P^T dO. lbo / sbo: the MN-major meanings, for both operands.
__device__ __forceinline__ void probe_at_body(unsigned short* sA, unsigned short* sB, const unsigned short* A,
                                              const unsigned short* B, float* C, unsigned lbo, unsigned sbo) {
    const int tid = threadIdx.x;
    probe_load_operands<64, true>(sA, sB, A, B, tid);

    float d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) d[i] = 0.f;
    const unsigned a0 = wgmma_smem_u32(sA), b0 = wgmma_smem_u32(sB);
    wgmma_fence_operands(d);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s)  // K step s: rows [16 s, 16 s + 16) of both, 16 rows * 128 bytes further
        probe_mma_tt(d, wgmma_desc(a0 + s * 16 * 128, lbo, sbo, kSwizzle128B),
                     wgmma_desc(b0 + s * 16 * 128, lbo, sbo, kSwizzle128B), s > 0);
    probe_finish(d, C, tid);
}

extern "C" __global__ void __launch_bounds__(128)
    wgmma_probe_at_sw128_n64(const unsigned short* A, const unsigned short* B, float* C, unsigned lbo, unsigned sbo) {
    __shared__ __align__(1024) unsigned short sA[64 * 64];
    __shared__ __align__(1024) unsigned short sB[64 * 64];
    probe_at_body(sA, sB, A, B, C, lbo, sbo);
}

extern "C" __global__ void __launch_bounds__(128)
    wgmma_probe_pv_sw128_n64(const unsigned short* P, const unsigned short* V, float* C, unsigned lbo, unsigned sbo) {
    __shared__ __align__(1024) unsigned short sV[64 * 64];
    probe_pv_body(sV, P, V, C, lbo, sbo);
}

#define WGMMA_PROBE_ENTRY(NAME, K, SWIZZLE)                                                               \
    extern "C" __global__ void __launch_bounds__(128)                                                   \
        NAME(const unsigned short* A, const unsigned short* B, float* C, unsigned lbo, unsigned sbo) {  \
        __shared__ __align__(1024) unsigned short sA[64 * K];                                            \
        __shared__ __align__(1024) unsigned short sB[64 * K];                                            \
        probe_body<K, SWIZZLE>(sA, sB, A, B, C, lbo, sbo);                                              \
    }

WGMMA_PROBE_ENTRY(wgmma_probe_sw128_k64, 64, true)
WGMMA_PROBE_ENTRY(wgmma_probe_sw128_k128, 128, true)
WGMMA_PROBE_ENTRY(wgmma_probe_interleave_k64, 64, false)
