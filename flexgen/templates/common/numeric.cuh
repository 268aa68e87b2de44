// Values in registers, for every kernel: 16-bit values as raw bits and their conversions, infinities,
// the hardware exp2, and the reductions over the four lanes that share a row of an MMA accumulator.
// No CUDA headers: 16-bit values travel as raw bits, so NVRTC needs no include path.
#pragma once

typedef unsigned short half_bits;  // raw bf16 / fp16 bits in memory

#define FLEXGEN_NEG_INF (-__int_as_float(0x7f800000))
#define FLEXGEN_POS_INF (__int_as_float(0x7f800000))

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest even.
template <bool kBF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
    if constexpr (kBF16) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}

// Two non-negative floats -> bf16x2 by truncation: one byte permute keeps both high halves, off the conversion unit
// that cvt takes (docs/forward-sm90.md measures the difference). Unbiased for values first scaled by 1 + TRUNC_BIAS:
// truncation takes off 2^-8 / m of a value on average (m its significand, in [1, 2)), 0.72 x 2^-8 for significands
// spread evenly in log, as those of exponentials are; the error stays within 0.72 of a bf16 unit either way
// (round to nearest: 0.5).
[[maybe_unused]] constexpr float TRUNC_BIAS = 0.0028177f;  // 2^-8 / (2 ln 2) (not every kernel truncates)
__device__ __forceinline__ unsigned pack_bf16x2_truncated(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632);
}

template <bool kBF16>
__device__ __forceinline__ float half_to_float(half_bits x) {
    if constexpr (kBF16) {
        return __uint_as_float(static_cast<unsigned>(x) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(x));
        return f;
    }
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Lanes 4k .. 4k+3 hold one row of an m16n8 accumulator tile (and of a warp's slice of a wgmma one).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
