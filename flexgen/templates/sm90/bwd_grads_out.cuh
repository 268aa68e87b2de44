// How the sm90 backward's gradients leave the CTA (included by sm90/bwd.cu.j2, after its shape constants, the
// Pipeline struct and the shared-memory layout): dQ shares handed by each consumer warpgroup to a dQ warp through
// staging panels, which that warp adds to the fp32 accumulator with TMA reductions; dK and dV staged through the
// same panels at the end of a KV tile and stored by TMA.

// DQ_WARPS (not with DQ_FROM_REGISTERS): one warp of the producer warpgroup per consumer warpgroup adds that
// warpgroup's dQ share to global memory with TMA reductions. The warpgroup waits on BAR_DQ_FREE (its dQ warp's
// reductions have read the staging panels), writes the panels and a slot saying what they hold, and arrives on
// BAR_DQ_FULL without waiting; the dQ warp waits on BAR_DQ_FULL, reduces, waits for the copy engine to read the
// panels, and arrives on BAR_DQ_FREE. Each event alternates the two barriers, so neither side runs a phase ahead,
// and the warpgroup never waits for a reduction itself: it meets its dQ warp once per step.
constexpr bool DQ_WARPS = !DQ_FROM_REGISTERS;
constexpr int BAR_DQ_FULL = 4, BAR_DQ_FREE = 6;  // + the warpgroup (0 is __syncthreads, 1 dx_stored, 2-3 per warpgroup)
constexpr int DQ_HANDOFF_THREADS = 128 + 32;      // a consumer warpgroup and its dQ warp
enum DqSlot : int { DQ_SLOT_COL, DQ_SLOT_ROW, DQ_SLOT_HEAD, DQ_SLOT_BATCH, DQ_SLOT_KIND };
enum DqKind : int { DQ_KIND_NONE, DQ_KIND_REDUCE, DQ_KIND_EXIT };  // (NONE: the warpgroup used the panels itself)

// The consumer warpgroup's side: the panels are free once this returns (its own dK / dV stores have read them
// too: that thread waits for its bulk group first).
__device__ __forceinline__ void dq_panels_free(int wg, int wtid) {
    if (wtid == 0) bulk_wait_read();
    named_barrier_sync(BAR_DQ_FREE + wg, DQ_HANDOFF_THREADS);
}
// ... and after writing them (fenced for the copy engine where the dQ warp will reduce them): hand them over.
__device__ __forceinline__ void dq_panels_full(int* slot, int kind, int col, int row, int h, int b, int wtid,
                                               int wg) {
    if (wtid == 0) {
        slot[DQ_SLOT_COL] = col;
        slot[DQ_SLOT_ROW] = row;
        slot[DQ_SLOT_HEAD] = h;
        slot[DQ_SLOT_BATCH] = b;
        slot[DQ_SLOT_KIND] = kind;
    }
    named_barrier_arrive(BAR_DQ_FULL + wg, DQ_HANDOFF_THREADS);
}


// dQ's registers in fragment order: float4 j of this thread at `at` + j * HOLDERS float4s.
template <int HOLDERS>
__device__ __forceinline__ void store_dq_fragments(const float (&dq)[DQ_REGS], unsigned at) {
    #pragma unroll
    for (int j = 0; j < DQ_REGS / 4; ++j)
        asm volatile("st.shared.v4.f32 [%0], { %1, %2, %3, %4 };\n" ::"r"(at + j * HOLDERS * 16), "f"(dq[4 * j]),
                     "f"(dq[4 * j + 1]), "f"(dq[4 * j + 2]), "f"(dq[4 * j + 3]) : "memory");
}

// This warpgroup's dQ accumulator into its staging panels (see DQ_STAGE_BYTES) for its dQ warp's reductions
// (DQ_WARPS): once that warp's previous reductions have read them, and handed over without waiting. Row-major:
// element pairs (row, col), (row, col + 1) share a 16-byte chunk; with the swizzle a warp's 8-byte stores hit every
// bank once. (col0, row0): the share's first column and row in dQ of (b, h).
__device__ __forceinline__ void store_dq(const float (&dq)[DQ_REGS], unsigned char* panels, int* slot, int col0,
                                         int row0, int h, int b, int wg, int wtid) {
    dq_panels_free(wg, wtid);
    if constexpr (DQ_FRAGMENTS) {
        // The thread's address from an opaque copy of its index: a plain one is loop-invariant, and ptxas then keeps
        // it in registers across the whole step (8 B of spills in the soft-cap and ALiBi backwards).
        // Only the threads holding the head's own columns store (dq_chunk_cols): 2 per column, 16 per warp. Each
        // stride has a copy of its own, so that the offsets stay immediates.
        unsigned t;
        asm volatile("mov.u32 %0, %1;\n" : "=r"(t) : "r"(wtid));
        const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(panels)) + t * 16;
        if (dq_chunk_cols(wg) == DQ_COLS)
            store_dq_fragments<2 * DQ_COLS>(dq, at);
        else if (wtid < 2 * dq_chunk_cols(wg))
            store_dq_fragments<2 * (HEAD_DIM % DQ_COLS)>(dq, at);
    } else {
        #pragma unroll
        for (int i = 0; i < DQ_REGS; i += 2) {
            int row, col;
            wgmma_acc_coord(wtid, i, row, col);
            const int panel = col / 32, c = col % 32;
            const int chunk = (c / 4) ^ (row % 8);
            *reinterpret_cast<float2*>(panels + panel * DQ_PANEL_BYTES + row * 128 + chunk * 16 + (c % 4) * 4) =
                float2{dq[i], dq[i + 1]};
        }
    }
    fence_proxy_async_shared();
    dq_panels_full(slot, DQ_KIND_REDUCE, col0, row0, h, b, wtid, wg);
}

// A warpgroup's 64 rows of dK (times `scale`) and dV through its staging panels: each tile as 64-row boxes of the
// 128-byte-swizzled layout (a 64-column panel of 64 rows per box; with the swizzle a warp's 4-byte stores hit every
// bank once), fenced for the copy engine, then stored by one thread with TMA. The panels' previous reads (the dQ
// reductions, or the first tile's store where both do not fit at once) are waited for first. Rows past kv_len are not
// written.
__device__ __forceinline__ void stage_grad(const float (&acc)[DKV_REGS], float mul, unsigned char* at, int wtid) {
    #pragma unroll
    for (int i = 0; i < DKV_REGS; i += 2) {
        int row, col;
        wgmma_acc_coord(wtid, i, row, col);
        const int panel = col / 64, c = col % 64;
        const int chunk = (c / 8) ^ (row % 8);
        *reinterpret_cast<unsigned*>(at + panel * 64 * PANEL_ROW_BYTES + row * PANEL_ROW_BYTES + chunk * 16 + (c % 8) * 2) =
            pack2<IS_BF16>(acc[i] * mul, acc[i + 1] * mul);
    }
}

__device__ __forceinline__ void store_grads(const float (&dk)[DKV_REGS], const float (&dv)[DKV_REGS], float scale,
                                            bool want_dk, bool want_dv, const TensorMap* dk_map, const TensorMap* dv_map,
                                            unsigned char* panels, int* slot, int kv0, int h_kv, int b, int wg,
                                            int wtid) {
    auto send = [&](const TensorMap* map, const unsigned char* at) {
        fence_proxy_async_shared();
        named_barrier_sync(2 + wg, 128);
        if (wtid == 0) {
            #pragma unroll
            for (int panel = 0; panel < D / 64; ++panel)
                tma_store_box(map, at + panel * 64 * PANEL_ROW_BYTES, panel * 64, kv0, h_kv, b);
            bulk_commit();
        }
    };
    auto panels_free = [&] {
        if (wtid == 0) bulk_wait_read();
        named_barrier_sync(2 + wg, 128);
    };
    dq_panels_free(wg, wtid);  // (the dQ warp's last reductions have read them)
    if (want_dk) {
        stage_grad(dk, scale, panels, wtid);
        send(dk_map, panels);
    }
    if (want_dv) {
        unsigned char* at = GRADS_AT_ONCE >= 2 ? panels + GRAD_TILE_BYTES : panels;
        if (GRADS_AT_ONCE < 2 && want_dk) panels_free();
        stage_grad(dv, 1.f, at, wtid);
        send(dv_map, at);
    }
    dq_panels_full(slot, DQ_KIND_NONE, 0, 0, 0, 0, wtid, wg);  // (its own stores' reads: waited for in dq_panels_free)
}

// A dQ warp (DQ_WARPS): hands its consumer warpgroup's staging panels to the copy engine as TMA reductions into
// the fp32 dQ accumulator (DQ_FRAGMENTS: one bulk reduction into its chunk, by (b, h, BLOCK_M-row block of
// q_len_padded, chunk of the row)), one event at a time, until the warpgroup says it is done.
__device__ __forceinline__ void dq_warp(const TensorMap* dq_map, float* dq_accum, int heads, int q_len_padded,
                                        const int* slot, const unsigned char* panels, int served) {
    const bool issuer = threadIdx.x % 32 == 0;
    if (!DQ_FRAGMENTS && issuer) tma_prefetch_map(dq_map);
    named_barrier_arrive(BAR_DQ_FREE + served, DQ_HANDOFF_THREADS);  // the panels start free
    while (true) {
        named_barrier_sync(BAR_DQ_FULL + served, DQ_HANDOFF_THREADS);
        const int kind = slot[DQ_SLOT_KIND];
        if (kind == DQ_KIND_EXIT) break;
        if (kind == DQ_KIND_REDUCE && issuer) {
            if constexpr (DQ_FRAGMENTS) {
                // blocks of DQ_ROWS rows x HEAD_DIM, each its column chunks in turn (the last one narrower at D = 96)
                const int block = (slot[DQ_SLOT_BATCH] * heads + slot[DQ_SLOT_HEAD]) * (q_len_padded / DQ_ROWS) +
                                  slot[DQ_SLOT_ROW] / DQ_ROWS;
                if constexpr (HEAD_DIM % DQ_COLS == 0)
                    bulk_reduce_add(dq_accum + (long long)(block * (D / DQ_COLS) + slot[DQ_SLOT_COL] / DQ_COLS) *
                                    (DQ_ROWS * DQ_COLS), panels, DQ_ROWS * DQ_COLS * 4);
                else
                    bulk_reduce_add(dq_accum + (long long)block * DQ_ROWS * HEAD_DIM + slot[DQ_SLOT_COL] * DQ_ROWS,
                                    panels, DQ_ROWS * dq_chunk_cols(served) * 4);
            } else {
                #pragma unroll
                for (int panel = 0; panel < DQ_PANELS; ++panel)
                    tma_reduce_add_box(dq_map, panels + panel * DQ_PANEL_BYTES, slot[DQ_SLOT_COL] + panel * 32,
                                       slot[DQ_SLOT_ROW], slot[DQ_SLOT_HEAD], slot[DQ_SLOT_BATCH]);
            }
            bulk_commit();
            bulk_wait_read();
        }
        __syncwarp();
        named_barrier_arrive(BAR_DQ_FREE + served, DQ_HANDOFF_THREADS);
    }
    if (issuer) bulk_wait();  // the reductions are done before the CTA leaves
}
