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
// Python/torch floor division: rounds toward -inf, unlike C's `/`. INT_MIN // -1 wraps to INT_MIN
// as in torch (C leaves that division undefined, so it never reaches `/`).
__device__ __forceinline__ int fg_floordiv(int a, int b) {
    if (b == -1) return (int)(0u - (unsigned int)a);
    const int q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long fg_floordiv(long long a, long long b) {
    if (b == -1) return (long long)(0ull - (unsigned long long)a);
    const long long q = a / b;
    return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// @section fg_mod
// Python/torch remainder: takes the sign of the divisor, unlike C's `%`; x % -1 is 0 (also INT_MIN % -1).
__device__ __forceinline__ int fg_mod(int a, int b) {
    if (b == -1) return 0;
    const int r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
__device__ __forceinline__ long long fg_mod(long long a, long long b) {
    if (b == -1) return 0;
    const long long r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

// @section fg_fmod
// torch.fmod on integers: C's `%` (the dividend's sign), with INT_MIN fmod -1 = 0 as in torch.
__device__ __forceinline__ int fg_fmod(int a, int b) { return b == -1 ? 0 : a % b; }
__device__ __forceinline__ long long fg_fmod(long long a, long long b) { return b == -1 ? 0 : a % b; }

// @section fg_fmod_floor
// torch.remainder on floats: fmod, moved to the divisor's sign.
__device__ __forceinline__ float fg_fmod_floor(float a, float b) {
    float r = fmodf(a, b);
    if (r != 0.0f && ((r < 0.0f) != (b < 0.0f))) r += b;
    return r;
}

// @section fg_wrap
// int32 / int64 + - * and negation that wrap around modulo 2^32 / 2^64 like torch's integer tensors.
// Signed overflow is undefined in C++ (a compiler may assume `q + c > q`), unsigned arithmetic wraps:
// compute there and convert back (two's complement). Lowering uses plain `+ - *` where the operands'
// ranges show no overflow can happen.
__device__ __forceinline__ int fg_add(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
__device__ __forceinline__ int fg_sub(int a, int b) { return (int)((unsigned int)a - (unsigned int)b); }
__device__ __forceinline__ int fg_mul(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
__device__ __forceinline__ int fg_neg(int a) { return (int)(0u - (unsigned int)a); }
__device__ __forceinline__ long long fg_add(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);
}
__device__ __forceinline__ long long fg_sub(long long a, long long b) {
    return (long long)((unsigned long long)a - (unsigned long long)b);
}
__device__ __forceinline__ long long fg_mul(long long a, long long b) {
    return (long long)((unsigned long long)a * (unsigned long long)b);
}
__device__ __forceinline__ long long fg_neg(long long a) { return (long long)(0ull - (unsigned long long)a); }

// @section fg_abs needs fg_wrap
// torch.abs on integers: abs(INT_MIN) wraps to INT_MIN.
__device__ __forceinline__ int fg_abs(int a) { return a < 0 ? fg_neg(a) : a; }
__device__ __forceinline__ long long fg_abs(long long a) { return a < 0 ? fg_neg(a) : a; }

// @section fg_float_to_int
// float -> int32 / int64 truncating toward zero, saturating at the type's bounds, NaN -> 0: the GPU's
// cvt.rzi (a plain C cast is undefined out of range, so the compiler could assume it never is). The
// IR evaluator converts the same way; torch's CPU .int() differs only out of range (it gives INT_MIN).
__device__ __forceinline__ int fg_float_to_int(float x) {
#ifdef __CUDA_ARCH__
    return __float2int_rz(x);
#else
    if (x != x) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return -2147483647 - 1;
    return (int)x;
#endif
}
__device__ __forceinline__ long long fg_float_to_long(float x) {
#ifdef __CUDA_ARCH__
    return __float2ll_rz(x);
#else
    if (x != x) return 0;
    if (x >= 9223372036854775808.0f) return 9223372036854775807LL;
    if (x < -9223372036854775808.0f) return -9223372036854775807LL - 1;
    return (long long)x;
#endif
}

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

// @section fg_band
// 0 <= d < c and 0 <= d <= c (a band: a sliding window's `q_idx >= kv_idx and q_idx - kv_idx < window`), for a d
// computed without overflow: one unsigned compare per element where the two signed ones took two. A negative d is
// at least 2^31 unsigned, above any bound; the bound's clamp is the same for every element.
__device__ __forceinline__ bool fg_band_lt(int d, int c) { return (unsigned)d < (unsigned)(c < 0 ? 0 : c); }
__device__ __forceinline__ bool fg_band_lt(long long d, long long c) {
    return (unsigned long long)d < (unsigned long long)(c < 0 ? 0 : c);
}
__device__ __forceinline__ bool fg_band_le(int d, int c) { return (unsigned)d < (unsigned)(c < -1 ? -1 : c) + 1u; }
__device__ __forceinline__ bool fg_band_le(long long d, long long c) {
    return (unsigned long long)d < (unsigned long long)(c < -1 ? -1 : c) + 1ull;
}

// @section fg_fast
// The fast forms below use the special-function unit (a few ulp, far below the bf16/fp16 rounding
// of P) unless the kernel is built with the precise_math option, which defines FLEXGEN_PRECISE_MATH.
#if defined(__CUDA_ARCH__) && !defined(FLEXGEN_PRECISE_MATH)
#define FG_FAST_MATH 1
#else
#define FG_FAST_MATH 0
#endif

// @section fg_div needs fg_fast
// FLEXGEN_DIV_BY_RECIPROCAL (the sm90 templates): as a multiply by the reciprocal, so that where b is the same for
// every score (a captured scalar such as a softcap) the reciprocal and its range fix-up leave the loop and a score
// pays one FMUL. The sm80 kernels keep the quotient: at 255 registers the hoisted reciprocal spills there.
__device__ __forceinline__ float fg_div(float a, float b) {
#if FG_FAST_MATH && defined(FLEXGEN_DIV_BY_RECIPROCAL)
    return a * __fdividef(1.0f, b);
#elif FG_FAST_MATH
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
