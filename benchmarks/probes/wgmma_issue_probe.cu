// wgmma issue probe: does issuing a wgmma stall the issuing warp while the tensor cores are busy, and how
// many products may be queued before it does? benchmarks/probes/wgmma_issue_probe.py prepends wgmma.cuh and the
// kernels' wgmma wrappers and compiles this for sm_90a. The operands are zeros: only timing is measured.
//
// One CTA of two warpgroups. The filler warpgroup (1) issues FILLER m64n128k16 products (64 cycles each
// at the tensor cores' peak) as one group, stamping the clock after each of the first STAMPS issues, then signals
// the prober and waits for its group. The prober warpgroup (0) waits for that signal, then issues GROUPS groups of
// PER_GROUP m64n64k16 products, stamping the clock after each commit, and waits for them all. Every stamp is
// relative to the filler's first clock read (clock() is per SM, so the two warpgroups' stamps compare).

constexpr int STAMPS = 32, GROUPS = 16;

// A zeroed accumulator, fenced for the products about to add into it.
template <int N>
__device__ __forceinline__ void zeroed_for_products(float (&d)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i) d[i] = 0.f;
    wgmma_fence();
    wgmma_fence_operands(d);
}

// Every count is a template argument: a product under a run-time branch or in a run-time loop makes ptxas serialise
// all of them (C7519), which would time the serialisation instead.
template <int FILLER, int PER_GROUP>
__device__ __forceinline__ void probe(unsigned* out) {
    __shared__ __align__(1024) unsigned short tiles[8192];  // 16 KB of zeros: every operand reads from here
    for (int i = threadIdx.x; i < 8192; i += blockDim.x) tiles[i] = 0;
    fence_proxy_async_shared();
    __syncthreads();
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const unsigned base = wgmma_smem_u32(tiles);
    // No swizzle; 8-row groups 256 bytes apart, the two 8-column halves of a k16 slice 128 bytes apart (in bounds).
    const unsigned long long desc = wgmma_desc(base, 128, 256, kSwizzleNone);
    __shared__ unsigned start;
    if (threadIdx.x == 0) start = clock();
    __syncthreads();
    const unsigned t0 = start;

    if (wg == 1) {
        float d[64];
        unsigned stamp[STAMPS];
        zeroed_for_products(d);
        #pragma unroll
        for (int i = 0; i < STAMPS; ++i) {
            if (i < FILLER) probe_n128(d, desc, desc, 1);
            stamp[i] = clock() - t0;
        }
        #pragma unroll
        for (int i = STAMPS; i < FILLER; ++i) probe_n128(d, desc, desc, 1);
        wgmma_commit_group();
        const unsigned issued = clock() - t0;
        asm volatile("bar.arrive 1, 256;\n" ::: "memory");
        wgmma_wait_group<0>();
        wgmma_fence_operands(d);
        const unsigned done = clock() - t0;
        if (tid == 0) {
            for (int i = 0; i < STAMPS; ++i) out[i] = stamp[i];
            out[STAMPS] = issued;
            out[STAMPS + 1] = done;
            out[STAMPS + 2] = d[0] == 0.f;  // keeps the products
        }
    } else if (wg == 0) {
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        const unsigned begin = clock() - t0;
        float d[32];
        unsigned stamp[GROUPS];
        zeroed_for_products(d);
        #pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            #pragma unroll
            for (int k = 0; k < PER_GROUP; ++k) probe_n64(d, desc, desc, 1);
            wgmma_commit_group();
            stamp[g] = clock() - t0;
        }
        wgmma_wait_group<0>();
        wgmma_fence_operands(d);
        const unsigned done = clock() - t0;
        if (tid == 0) {
            out[64] = begin;
            for (int g = 0; g < GROUPS; ++g) out[65 + g] = stamp[g];
            out[65 + GROUPS] = done;
            out[66 + GROUPS] = d[0] == 0.f;
        }
    }
}

// One entry per case: wgmma_issue_probe.py appends a PROBE_ENTRY(filler, per_group) line for each of its CONFIGS.
#define PROBE_ENTRY(F, G) \
    extern "C" __global__ void __launch_bounds__(256) wgmma_issue_probe_##F##_##G(unsigned* out) { probe<F, G>(out); }
