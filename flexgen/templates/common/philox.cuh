// Attention dropout: a counter-based Philox4x32-7 draw per element, never a stored mask.
// Plain C++ (no CUDA headers) so that the same code compiles for the host, where tests
// check it against flexgen/dropout.py.
//
// Element (b, h, q, kv) belongs to the group of eight {q0, q0 + 1, q0 + 8, q0 + 9} x {kv0, kv0 + 1}
// (q0 = 16 (q / 16) + 2 ((q / 2) % 4), kv0 = kv - kv % 2): the elements of one 16 x 8 accumulator
// tile that two lanes hold. One Philox call per group, with
//     counter = (kv / 2, (b * num_heads + h) * quads + quad  [mod 2^32], offset lo, offset hi)
//     quad    = 4 (q / 16) + (q / 2) % 4,   quads = 4 ceil(q_len / 16)
//     key     = (seed lo, seed hi)
// gives four uint32 words; the element's is word 2 (q % 2) + (q / 8) % 2, its low half for an
// even kv and its high half for an odd one, and it is kept iff that 16-bit half >= threshold,
// threshold = round(p * 2^16). So p is honoured to 2^-17, and the kernels scale the kept elements
// by 2^16 / (2^16 - threshold), the exact inverse of the keep probability. Eight elements per call
// (half the Philox work of full words). The offset has counter words of its own: calls with
// different offsets never share a counter, whatever the shapes.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define FLEXGEN_HD __host__ __device__ __forceinline__
#else
#define FLEXGEN_HD inline
#endif

struct PhiloxWords {
    unsigned w[4];
};

// Rounds of Philox per dropout draw: seven, as FlashAttention-2 draws the dropout of PyTorch's SDPA flash kernels.
// Random123's authors default to ten, a margin above the seven that already pass their statistical tests; each
// round is two wide multiplies per call on the consumers' critical path (docs/dropout.md).
constexpr int FLEXGEN_DROPOUT_ROUNDS = 7;

// The Philox4x32-R bijection of Salmon et al. (Random123), standard constants.
template <int ROUNDS>
FLEXGEN_HD PhiloxWords philox4x32(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0, unsigned k1) {
    #pragma unroll
    for (int round = 0; round < ROUNDS; ++round) {
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
    const unsigned uq = static_cast<unsigned>(q);
    const unsigned quads = (static_cast<unsigned>(q_len) + 15u) / 16u * 4u;
    const unsigned row = (static_cast<unsigned>(b) * num_heads + h) * quads + (uq / 16u) * 4u + (uq / 2u) % 4u;
    return philox4x32<FLEXGEN_DROPOUT_ROUNDS>(static_cast<unsigned>(kv) / 2u, row, static_cast<unsigned>(offset),
                         static_cast<unsigned>(offset >> 32), static_cast<unsigned>(seed), static_cast<unsigned>(seed >> 32));
}

// Whether the 16-bit half of `word` that column parity `odd_kv` picks survives.
FLEXGEN_HD bool dropout_half_kept(unsigned word, int odd_kv, unsigned threshold) {
    return (odd_kv ? word >> 16 : word & 0xFFFFu) >= threshold;
}

// Element-wise form (host tests, and the definition the kernels' fast path must agree with).
FLEXGEN_HD bool dropout_keep(unsigned long long seed, unsigned long long offset, unsigned threshold, int b, int h,
                             int q, int kv, int num_heads, int q_len) {
    const PhiloxWords g = dropout_group_words(seed, offset, b, h, q, kv, num_heads, q_len);
    return dropout_half_kept(g.w[2 * (q & 1) + ((q >> 3) & 1)], kv & 1, threshold);
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
// Bit 4 t + 2 r + c set where kept(t, r, c): tile t, row r, column c of a thread's two neighbouring tiles.
template <class Kept>
__device__ __forceinline__ unsigned dropout_tile_pair_bits(Kept kept) {
    unsigned bits = 0u;
    #pragma unroll
    for (int t = 0; t < 2; ++t) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            #pragma unroll
            for (int c = 0; c < 2; ++c) bits |= (kept(t, r, c) ? 1u : 0u) << (4 * t + 2 * r + c);
        }
    }
    return bits;
}

// Keep bits of one thread's eight elements in two neighbouring 16 x 8 accumulator tiles: tile t
// holds {outer, outer + 8} x {inner + 8 t, inner + 8 t + 1}, and bit 4 t + 2 r + c is element
// (outer + 8 r, inner + 8 t + c), the accumulator's own order; outer has the parity of lane / 4,
// inner is even and inner % 16 < 8. Lanes l and l ^ 4 hold the other parity of outer in the same
// columns: between them they hold two groups, and each draws one (one Philox call) and hands the
// partner its half of it. OUTER_IS_Q: outer runs over queries (the forward's S), else over
// keys (the backward's S^T). (q, kv) is the element (outer, inner). Every lane must call it.
template <bool OUTER_IS_Q>
__device__ __forceinline__ unsigned dropout_keep_bits(unsigned long long seed, unsigned long long offset,
                                                      unsigned threshold, int b, int h, int q, int kv, int num_heads,
                                                      int q_len) {
    const int odd = (threadIdx.x / 4) & 1;  // parity of this lane's outer index
    if constexpr (OUTER_IS_Q) {
        // A group is one tile (rows q0, q0 + 1, q0 + 8, q0 + 9; columns kv0, kv0 + 1); its words 2 o, 2 o + 1 are
        // the rows of parity o. This lane draws tile `odd`'s group and keeps its parity's two words.
        const PhiloxWords g = dropout_group_words(seed, offset, b, h, q, kv + 8 * odd, num_heads, q_len);
        const unsigned mine0 = odd ? g.w[2] : g.w[0], mine1 = odd ? g.w[3] : g.w[1];
        const unsigned theirs0 = __shfl_xor_sync(0xffffffffu, odd ? g.w[0] : g.w[2], 4);
        const unsigned theirs1 = __shfl_xor_sync(0xffffffffu, odd ? g.w[1] : g.w[3], 4);
        // words of tile t, row r (r = 0: outer, 1: outer + 8)
        const unsigned w00 = odd ? theirs0 : mine0, w01 = odd ? theirs1 : mine1;  // tile 0
        const unsigned w10 = odd ? mine0 : theirs0, w11 = odd ? mine1 : theirs1;  // tile 1
        const unsigned words[2][2] = {{w00, w01}, {w10, w11}};
        return dropout_tile_pair_bits([&](int t, int r, int c) { return dropout_half_kept(words[t][r], c, threshold); });
    } else {
        // Outer runs over keys: a group is the key pair {kv0, kv0 + 1} (this lane's row and the partner's) over the
        // query quad {q, q + 1, q + 8, q + 9} (both tiles). This lane draws the group of its row + 8 odd, keeps the
        // half of its own key parity of all four words and hands the partner the other halves, two to a word.
        const PhiloxWords g = dropout_group_words(seed, offset, b, h, q, kv + 8 * odd, num_heads, q_len);
        // word 2 (q' % 2) + (q' / 8) % 2 for q' = q + c + 8 t: words w[2 c + t]
        const unsigned sel_mine = odd ? 0x7632u : 0x5410u, sel_theirs = odd ? 0x5410u : 0x7632u;
        const unsigned mine_a = __byte_perm(g.w[0], g.w[1], sel_mine);    // halves of (c = 0, t = 0), (c = 0, t = 1)
        const unsigned mine_b = __byte_perm(g.w[2], g.w[3], sel_mine);    // (c = 1, t = 0), (c = 1, t = 1)
        const unsigned theirs_a = __shfl_xor_sync(0xffffffffu, __byte_perm(g.w[0], g.w[1], sel_theirs), 4);
        const unsigned theirs_b = __shfl_xor_sync(0xffffffffu, __byte_perm(g.w[2], g.w[3], sel_theirs), 4);
        // row r = 0 (this lane's key) comes from the group it drew when odd == 0, else from the partner's
        const unsigned r0a = odd ? theirs_a : mine_a, r0b = odd ? theirs_b : mine_b;
        const unsigned r1a = odd ? mine_a : theirs_a, r1b = odd ? mine_b : theirs_b;
        const unsigned rows[2][2] = {{r0a, r0b}, {r1a, r1b}};
        return dropout_tile_pair_bits([&](int t, int r, int c) { return dropout_half_kept(rows[r][c], t, threshold); });
    }
}
#endif
