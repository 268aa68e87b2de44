// wgmma probe: C (64 x 64, fp32, row-major) = A (64 x K) * B^T, where A and B are bf16,
// row-major 64 x K in global memory (B given as B^T: "K-major"). One CTA of one warpgroup
// (128 threads). benchmarks/probes/wgmma_probe.py prepends wgmma.cuh and compiles this for
// sm_90a. lbo / sbo are kernel arguments so the probe can also try other descriptor values.

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

template <int kK, bool kSwizzle128>
__device__ __forceinline__ void probe_body(unsigned short* sA, unsigned short* sB, const unsigned short* A,
                                           const unsigned short* B, float* C, unsigned lbo, unsigned sbo) {
    const int tid = threadIdx.x;
    probe_load_tile<kK, kSwizzle128>(sA, A, tid);
    probe_load_tile<kK, kSwizzle128>(sB, B, tid);
    fence_proxy_async_shared();  // generic-proxy stores -> visible to wgmma's async-proxy reads
    __syncthreads();

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
        wgmma_m64n64k16_bf16_ss(d, wgmma_desc(a0 + step, lbo, sbo, swz), wgmma_desc(b0 + step, lbo, sbo, swz), s > 0);
    }
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
