// Per-thread running sums for buffer gradients, which score_mod_bwd fills (flexgen/codegen/lower.py).
//
// Lowering pastes one section, after `constexpr int FLEXGEN_GRAD_SITES = <number of grads.add sites>;`:
// "atomic" normally, "deterministic" for deterministic mode. Both define FlexgenGradSlots, so the
// file is never pasted whole.
//
// score_mod_bwd runs for each of the ~32 scores a thread handles per step, and neighbouring scores
// often read the same buffer element (ALiBi's slopes[h]: every one of them). So each gradient site k
// keeps a running sum for the element it last added to, in slot k; a different element first sends
// the old sum out. The kernel flushes what is left at the end of a step.

// @section atomic
// A different element first sends the old sum out with a plain atomic (lanes may diverge here, so
// nothing warp-wide); at the end of a step the warp is converged and can merge lanes that share an element.
struct FlexgenGradSlots {
    float* addr[FLEXGEN_GRAD_SITES];  // element slot k sums into; null: nothing pending
    float sum[FLEXGEN_GRAD_SITES];
    // k is a literal at every call, so both arrays stay in registers.
    __device__ __forceinline__ void add(int k, float* element, float value) {
        const bool same = element == addr[k];
        // a new element: the old sum goes out now, with a plain atomic (lanes diverge here)
        if (!same && addr[k] != nullptr) atomicAdd(addr[k], sum[k]);
        sum[k] = same ? sum[k] + value : value;
        addr[k] = element;
    }
};

// @section deterministic
// Deterministic mode: a sum leaves its slot only with the whole warp, in a fixed order, into this
// warp's own partial copy of the gradients (flexgen_grad_add, defined by the kernel, `shift` elements
// past the ModArgs pointers); the runtime sums the copies in a fixed order. So every lane must call
// add at the same points: the kernel calls score_mod_bwd for every score, and one whose grad_out is 0
// (masked, or dS == 0) adds nothing and moves no slot. A site whose element depends on b and h alone
// (ALiBi's slopes[h]) takes add_bh, which has no vote: the kernel flushes whenever (b, h) may change
// (once a step), so its element never moves between flushes.
struct FlexgenGradSlots {
    float* addr[FLEXGEN_GRAD_SITES];  // element slot k sums into; null: nothing pending
    float sum[FLEXGEN_GRAD_SITES];
    long long shift;                  // this warp's partial copy: elements past the ModArgs gradient pointers
    // Called by every lane of the warp at once; k is a literal at every call.
    __device__ __forceinline__ void add(int k, float* element, float grad_out, float derivative) {
        const bool live = grad_out != 0.f;
        const bool same = element == addr[k];
        // lanes that move to a new element send the old sum out, all together (nothing: one vote)
        flexgen_grad_add(live && !same ? addr[k] : nullptr, sum[k], shift);
        if (live) {
            const float value = __fmul_rn(grad_out, derivative);
            sum[k] = same ? sum[k] + value : value;
            addr[k] = element;
        }
    }
    // A site whose element is a function of (b, h): the same element until the next flush.
    __device__ __forceinline__ void add_bh(int k, float* element, float grad_out, float derivative) {
        if (grad_out != 0.f) {
            const float value = __fmul_rn(grad_out, derivative);
            sum[k] = addr[k] != nullptr ? sum[k] + value : value;
            addr[k] = element;
        }
    }
};
