// Attention dropout: a counter-based Philox4x32-10 draw per element, never a stored mask.
// Plain C++ (no CUDA headers) so that the same code compiles for the host, where tests
// check it against flexgen/dropout.py.
//
// Element (b, h, q, kv) belongs to the 2 x 2 group {q, q^1} x {kv, kv^1}. One Philox call
// per group, with
//     counter = (kv / 2, (b * num_heads + h) * ceil(q_len / 2) + q / 2  [mod 2^32], offset lo, offset hi)
//     key     = (seed lo, seed hi)
// gives four uint32 words; the element's word is number 2 * (q & 1) + (kv & 1), and the
// element is kept iff word >= threshold, threshold = round(p * 2^32) (clamped below 2^32).
// Full 32-bit words, so p is honoured to 2^-32. The offset has counter words of its own:
// calls with different offsets never share a counter, whatever the shapes.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FLEXGEN_HD __host__ __device__ __forceinline__
#else
#define FLEXGEN_HD inline
#endif

struct PhiloxWords {
    unsigned w[4];
};

// The Philox4x32-10 bijection of Salmon et al. (Random123), standard constants.
FLEXGEN_HD PhiloxWords philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0, unsigned k1) {
    #pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned long long p0 = 0xD2511F53ull * c0;  // one wide multiply: hi and lo words
        const unsigned long long p1 = 0xCD9E8D57ull * c2;
        const unsigned n0 = static_cast<unsigned>(p1 >> 32) ^ c1 ^ k0;
        const unsigned n2 = static_cast<unsigned>(p0 >> 32) ^ c3 ^ k1;
        c1 = static_cast<unsigned>(p1);
        c3 = static_cast<unsigned>(p0);
        c0 = n0;
        c2 = n2;
    }
    PhiloxWords out = {{c0, c1, c2, c3}};
    return out;
}

// The Philox words of the group holding element (b, h, q, kv).
FLEXGEN_HD PhiloxWords dropout_group_words(unsigned long long seed, unsigned long long offset, int b, int h, int q,
                                           int kv, int num_heads, int q_len) {
    const unsigned row_pair = (static_cast<unsigned>(b) * num_heads + h) * ((static_cast<unsigned>(q_len) + 1u) / 2u) +
                              static_cast<unsigned>(q) / 2u;
    return philox4x32_10(static_cast<unsigned>(kv) / 2u, row_pair, static_cast<unsigned>(offset),
                         static_cast<unsigned>(offset >> 32), static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
}

// Element-wise form (host tests, and the definition the kernels' fast path must agree with).
FLEXGEN_HD bool dropout_keep(unsigned long long seed, unsigned long long offset, unsigned threshold, int b, int h,
                             int q, int kv, int num_heads, int q_len) {
    const PhiloxWords g = dropout_group_words(seed, offset, b, h, q, kv, num_heads, q_len);
    return g.w[2 * (q & 1) + (kv & 1)] >= threshold;
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// Keep bits of one thread's four elements of an m16n8 accumulator tile: elements
// {outer, outer + 8} x {inner, inner + 1}, bit 2 * r + c for outer + 8r, inner + c (the
// accumulator's own element order), with outer of the parity of lane / 4 and inner even.
// Lanes l and l ^ 4 hold the two rows of the same two groups: each draws one group (its
// row r = (lane / 4) & 1) and hands the partner the other half, so no word is wasted.
// (q, kv) is the element (r = (lane / 4) & 1, c = 0). OUTER_IS_Q: outer runs over queries
// (the forward's S); otherwise over keys (the backward's S^T). Every lane must call it.
template <bool OUTER_IS_Q>
__device__ __forceinline__ unsigned dropout_keep_bits(unsigned long long seed, unsigned long long offset,
                                                      unsigned threshold, int b, int h, int q, int kv, int num_heads,
                                                      int q_len) {
    const int odd = (threadIdx.x / 4) & 1;  // parity of this lane's outer index
    const PhiloxWords g = dropout_group_words(seed, offset, b, h, q, kv, num_heads, q_len);
    // Word of (outer parity o, inner parity c) in the group. Selects, not g.w[index]: an index
    // unknown at compile time would put g in local memory.
    auto word = [&](int o, int c) {
        const int i = OUTER_IS_Q ? 2 * o + c : 2 * c + o;
        return i == 0 ? g.w[0] : i == 1 ? g.w[1] : i == 2 ? g.w[2] : g.w[3];
    };
    const unsigned mine0 = word(odd, 0), mine1 = word(odd, 1);
    const unsigned theirs0 = __shfl_xor_sync(0xffffffffu, word(odd ^ 1, 0), 4);
    const unsigned theirs1 = __shfl_xor_sync(0xffffffffu, word(odd ^ 1, 1), 4);
    // Row r = odd is this lane's draw, row r = odd ^ 1 the partner's.
    const unsigned own = (mine0 >= threshold ? 1u : 0u) | (mine1 >= threshold ? 2u : 0u);
    const unsigned other = (theirs0 >= threshold ? 1u : 0u) | (theirs1 >= threshold ? 2u : 0u);
    return (own << (2 * odd)) | (other << (2 * (odd ^ 1)));
}
#endif
