// Shared-memory barriers (mbarrier) for a producer/consumer pipeline on sm_90a. Raw PTX, no
// CUDA headers. A barrier completes a phase when its expected number of arrivals has come in;
// waiters name the phase by its parity (0, 1, 0, ...), so a stage used for the r-th time waits
// on parity r & 1.
#pragma once

__device__ __forceinline__ unsigned mbar_addr(const unsigned long long* bar) {
    return static_cast<unsigned>(__cvta_generic_to_shared(bar));
}

// Once, by one thread, before a CTA barrier that publishes it.
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(mbar_addr(bar)), "r"(arrivals) : "memory");
}

// One arrival (release semantics: this thread's earlier memory operations happen before the phase completes).
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(mbar_addr(bar)) : "memory");
}

// Blocks until the phase of the given parity has completed (acquire semantics).
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(mbar_addr(bar)), "r"(parity) : "memory");
}

// Register reallocation between warpgroups. Registers are split between the SM's four schedulers,
// so a CTA gets the same count for every thread at launch; a producer warpgroup that only copies
// gives most of its share back (dec) and the consumer warpgroups take it (inc). Executed by all
// threads of a warpgroup; the counts are multiples of 8 in [24, 256].
// What each thread holds at launch under __launch_bounds__(threads, 1): the register file split evenly, in
// multiples of 8. setmaxnreg only moves registers within the CTA's launch allocation: an inc beyond what
// the decs released never completes (the kernel hangs, as a 32 / 240 split of 384 threads did).
constexpr int launch_registers(int threads) { return (65536 / threads) & ~7; }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }

// Named CTA barriers (ids 1..15; 0 is __syncthreads). `count` threads take part in all: those
// that sync wait for the rest, those that arrive do not wait.
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
