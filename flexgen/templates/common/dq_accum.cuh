// The backward's fp32 dQ accumulator (both families; needs DETERMINISTIC from the kernel).
#pragma once

// Two fp32 values into the dQ accumulator. Plain atomics, or (deterministic mode, where this
// thread is the only writer of these addresses in this split) an ordered read-add-write.
__device__ __forceinline__ void add_dq(float* dst, float x0, float x1) {
    if constexpr (DETERMINISTIC) {
        float2 cur = *reinterpret_cast<float2*>(dst);
        cur.x += x0;
        cur.y += x1;
        *reinterpret_cast<float2*>(dst) = cur;
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        asm volatile("red.global.add.v2.f32 [%0], { %1, %2 };\n" ::"l"(dst), "f"(x0), "f"(x1) : "memory");
#else
        asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst), "f"(x0) : "memory");
        asm volatile("red.global.add.f32 [%0], %1;\n" ::"l"(dst + 1), "f"(x1) : "memory");
#endif
    }
}
