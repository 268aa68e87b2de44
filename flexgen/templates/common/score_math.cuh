// Device helpers that lowered score_mod / mask_mod code calls (flexgen/codegen/lower.py).
//
// Lowering pastes only the sections a variant uses, each one the lines after its "// @section NAME"
// marker, in the order of this file; "needs OTHER" on a marker pastes OTHER too. The whole file is
// valid CUDA C++ too, and needs no CUDA header: on the host (the tests' g++ harness) `__device__`
// and `__forceinline__` are shimmed and the libm functions stand in for the GPU's.
//
// Semantics are torch's (flexgen.dsl.evaluate): integer // and % floor like Python, minimum /
// maximum propagate NaN, sign(NaN) is 0, rounding to float16 / bfloat16 is to nearest even.

// @section fg_floordiv
// Python/torch floor division: rounds toward -inf, unlike C's `/`.
__device__ __forceinline__ int fg_floordiv(int a, int b) {
    const int q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long fg_floordiv(long long a, long long b) {
    const long long q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// @section fg_mod
// Python/torch remainder: takes the sign of the divisor, unlike C's `%`.
__device__ __forceinline__ int fg_mod(int a, int b) {
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long fg_mod(long long a, long long b) {
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// @section fg_fmod_floor
// torch.remainder on floats: fmod, moved to the divisor's sign.
__device__ __forceinline__ float fg_fmod_floor(float a, float b) {
    float r = fmodf(a, b);
    if (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) r += b;
    return r;
}

// @section fg_abs
__device__ __forceinline__ int fg_abs(int a) { return a < 0 ? -a : a; }
__device__ __forceinline__ long long fg_abs(long long a) { return a < 0 ? -a : a; }

// @section fg_sign
// torch.sign: -1, 0 or 1; 0 for both zeros and for NaN.
__device__ __forceinline__ float fg_sign(float a) { return (float)(0.0f < a) - (float)(a < 0.0f); }
__device__ __forceinline__ int fg_sign(int a) { return (0 < a) - (a < 0); }
__device__ __forceinline__ long long fg_sign(long long a) { return (long long)((0 < a) - (a < 0)); }

// @section fg_isnan
__device__ __forceinline__ bool fg_isnan(float a) { return a != a; }

// @section fg_min
// torch.minimum: NaN wins; otherwise the first operand on ties.
__device__ __forceinline__ float fg_min(float a, float b) { return (a != a || b != b) ? a + b : (b < a ? b : a); }
__device__ __forceinline__ int fg_min(int a, int b) { return b < a ? b : a; }
__device__ __forceinline__ long long fg_min(long long a, long long b) { return b < a ? b : a; }

// @section fg_max
// torch.maximum: NaN wins; otherwise the first operand on ties.
__device__ __forceinline__ float fg_max(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? b : a); }
__device__ __forceinline__ int fg_max(int a, int b) { return a < b ? b : a; }
__device__ __forceinline__ long long fg_max(long long a, long long b) { return a < b ? b : a; }

// @section fg_fast
// The fast forms below use the special-function unit (a few ulp, far below the bf16/fp16 rounding
// of P) unless the kernel is built with the precise_math option, which defines FLEXGEN_PRECISE_MATH.
#if defined(__CUDA_ARCH__) && !defined(FLEXGEN_PRECISE_MATH)
#define FG_FAST_MATH 1
#else
#define FG_FAST_MATH 0
#endif

// @section fg_div needs fg_fast
__device__ __forceinline__ float fg_div(float a, float b) {
#if FG_FAST_MATH
    return __fdividef(a, b);
#else
    return a / b;
#endif
}

// @section fg_exp needs fg_fast
__device__ __forceinline__ float fg_exp(float x) {
#if FG_FAST_MATH
    return __expf(x);
#else
    return expf(x);
#endif
}

// @section fg_log needs fg_fast
__device__ __forceinline__ float fg_log(float x) {
#if FG_FAST_MATH
    return __logf(x);
#else
    return logf(x);
#endif
}

// @section fg_log2 needs fg_fast
__device__ __forceinline__ float fg_log2(float x) {
#if FG_FAST_MATH
    return __log2f(x);
#else
    return log2f(x);
#endif
}

// @section fg_tanh needs fg_fast
// Fast path: the SFU's tanh.approx.f32 (one MUFU op instead of the two of 1 - 2 / (e^2x + 1); relative
// error about 2^-11, below bf16's 2^-9 rounding of a score); softcap's forward is MUFU-bound on Hopper.
__device__ __forceinline__ float fg_tanh(float x) {
#if FG_FAST_MATH
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return tanhf(x);
#endif
}

// @section fg_sigmoid needs fg_fast
__device__ __forceinline__ float fg_sigmoid(float x) {
#if FG_FAST_MATH
    return __fdividef(1.0f, 1.0f + __expf(-x));
#else
    return 1.0f / (1.0f + expf(-x));
#endif
}

// @section fg_bf16_to_float
// bfloat16 is the top half of a float32.
__device__ __forceinline__ float fg_bf16_to_float(unsigned short u) { return __uint_as_float((unsigned int)u << 16); }

// @section fg_half_to_float
// IEEE half -> float: one PTX instruction on the GPU, exact bit arithmetic elsewhere.
__device__ __forceinline__ float fg_half_to_float(unsigned short u) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(u));
    return f;
#else
    const unsigned int sign = (unsigned int)(u & 0x8000u) << 16, exp = (u >> 10) & 0x1fu, mant = u & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
        const float mag = (float)mant * 5.9604644775390625e-08f;
        return sign ? -mag : mag;
    }
    const unsigned int bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112u) << 23) | (mant << 13));
    return __uint_as_float(bits);
#endif
}

// @section fg_round_fp16
// x.half().float(): the nearest float16 (ties to even, overflow to inf), as a float.
__device__ __forceinline__ float fg_round_fp16(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    float f;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const unsigned int bits = __float_as_uint(x), sign = bits & 0x80000000u;
    unsigned int mag = bits ^ sign;
    if (mag > 0x7f800000u) return x;                          // NaN
    if (mag >= 0x477ff000u) return __uint_as_float(sign | 0x7f800000u);  // >= 65520: rounds past 65504
    if (mag < 0x38800000u) {                                  // below 2^-14: float16 steps of 2^-24
        const float steps = rintf(__uint_as_float(mag) * 16777216.0f);  // exact scaling, ties to even
        return __uint_as_float(sign | __float_as_uint(steps * 5.9604644775390625e-08f));
    }
    mag += 0xfffu + ((mag >> 13) & 1u);                       // keep 10 of 23 mantissa bits, ties to even
    return __uint_as_float(sign | (mag & 0xffffe000u));
#endif
}

// @section fg_round_bf16
// x.bfloat16().float(): the nearest bfloat16 (ties to even, overflow to inf), as a float.
__device__ __forceinline__ float fg_round_bf16(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return __uint_as_float((unsigned int)h << 16);
#else
    const unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return x;         // NaN
    return __uint_as_float((bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u);
#endif
}
