"""The backward pass: three generated kernels, launched in order on torch's current stream.

1. bwd_preprocess   delta = rowsum(dO * O) (fp32) and lse * log2(e), both padded to ROWS_ALIGN rows per
                    (batch, head), and zero the fp32 dQ accumulator.
2. bwd              one CTA per (KV tile, batch, KV head): recompute P, accumulate dK, dV in
                    registers (summed over the query heads of a GQA group), add dQ partials
                    into the accumulator, and (through score_mod_bwd) buffer gradients.
3. bwd_postprocess  dQ = scale * accumulator, in the input dtype.

The planner (plan.py) picks the main kernel's family and tile; every family's main kernel takes
BwdParams, and its grid and threads come from the family (families.py). The pre- and
postprocess kernels are the sm80 family's. Their parameter structs (BwdParams, BwdPreParams,
BwdPostParams) are declared once, in codegen/params.py: the templates paste their C text, this
module fills their ctypes types.

Deterministic mode (kernel_options={"deterministic": True}): the main kernel runs `splits`
CTAs per (batch, KV head); CTA x takes KV tiles x, x + splits, ... in order and owns dQ
partial number x, which only it writes, each element always from the same thread (a plain
read-add-write, no atomics). The postprocess sums the partials in a fixed order. Cost: fewer
CTAs in flight (splits is chosen to fill the GPU about twice) and splits x B x H x L x D x 4
bytes of accumulator.

Buffer gradients in deterministic mode: every warp of every CTA adds into its own fp32 copy of
all the gradient buffers, B x H_kv x splits x num_warps copies (slot ((b * H_kv + h_kv) * splits
+ x) * num_warps + warp), which only that warp writes, in an order fixed by its program (see
FlexgenGradSlots in codegen/lower.py and flexgen_grad_add in bwd.cu.j2); the copies are then
summed in a fixed pairwise order (_ordered_sum). Cost: copies x (total elements of the gradient
buffers) x 4 bytes, zeroed before and read after the kernel, and a warp-wide merge wherever a
thread's running sum moves to another element (every score for a relative-bias table; never
mid-step for an element of (b, h) alone, as ALiBi's slopes[h]). Where the copies would pass
DETERMINISTIC_GRAD_BYTES, fewer splits are used; where even one split per (batch, KV head)
would, the call is refused.
"""
from __future__ import annotations

import functools
import math

import torch

from ..codegen.params import BWD_PARAMS, BWD_POST_PARAMS, BWD_PRE_PARAMS
from . import families
from .arguments import kernel_ready, mod_arguments, rows_aligned
from .call_checks import empty_like_layout, layout_allocator
from .coarse_rows import coarse_rows
from ..cache.kernel import dim3
from ..codegen.spec import dq_fragments
from .forward import LOG2E, bh_strides, set_dropout_rate
from .kernel_symbols import shared_memory_bytes
from .plan import backward_helpers, make_spec
from .schedule import sm_count
from .streams import current_stream_ptr
from .tensor_maps import map_layout

def _num_splits(num_kv_tiles: int, batch: int, kv_heads: int, device: torch.device) -> int:
    """Deterministic mode: KV-tile CTAs per (batch, KV head), about two waves of the GPU."""
    want = -(-2 * sm_count(device) // max(1, batch * kv_heads))
    return max(1, min(num_kv_tiles, want))


# The sm90 backward adds dQ by TMA reductions of 64-row boxes, each consumer warpgroup's share of a step
# (templates/sm90/bwd.cu.j2, DQ_ROWS; over 80-row steps by bulk reductions in fragment order instead); it stores dK
# and dV by TMA too, 64 key rows per warpgroup.
DQ_BOX_ROWS = 64
DKV_BOX_ROWS = 64

# lse (in log2 units) and delta reach the main kernels from (B, H, q_len_padded) fp32 buffers, q_len rounded up to
# ROWS_ALIGN (rows past q_len 0), written by the preprocess kernel: the sm90 backward copies a step's BLOCK_M rows of
# each with one bulk copy, whose addresses and size must be multiples of 16 bytes, and never past the buffer's end.
# ROWS_ALIGN is a multiple of the preprocess kernel's rows per CTA and of every BLOCK_M of the backward kernels
# but the 80 rows of the unmasked D = 128 kernel, which pads to a multiple of both (640).
ROWS_ALIGN = 128


def padded_rows(q_len: int, block_m: int = ROWS_ALIGN) -> int:
    align = math.lcm(ROWS_ALIGN, block_m)
    return -(-q_len // align) * align

# Deterministic mode: at most this many bytes of per-warp buffer-gradient copies (fewer splits,
# then an error, past it).
DETERMINISTIC_GRAD_BYTES = 1 << 30


def deterministic_grad_splits(splits: int, copies_per_split: int, floats_per_copy: int,
                              names: tuple[str, ...]) -> int:
    """The most splits, up to `splits`, whose copies_per_split x floats_per_copy fp32 buffer-
    gradient copies per split fit DETERMINISTIC_GRAD_BYTES; a clear error where one does not."""
    per_split = copies_per_split * floats_per_copy * 4
    fit = DETERMINISTIC_GRAD_BYTES // max(1, per_split)
    if fit < 1:
        raise NotImplementedError(
            f"flex_attention backward: deterministic gradients of score_mod buffers ({', '.join(names)}) keep one fp32 "
            f"copy of them ({floats_per_copy} elements) per warp of every CTA, at least {copies_per_split} copies "
            f"({per_split / 2**30:.2f} GiB), past the limit of {DETERMINISTIC_GRAD_BYTES / 2**30:.2f} GiB "
            "(flexgen.runtime.backward.DETERMINISTIC_GRAD_BYTES); use kernel_options={'deterministic': False}, "
            "smaller buffers or fewer (batch, KV head) pairs per call, or raise the limit"
        )
    return min(splits, fit)


def fold_lse_grad(delta: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor) -> None:
    """The lse's gradient, in place into delta. lse_i = log sum_j exp(s_ij) has d lse_i / d s_ij = P_ij, so
    dL/ds_ij = P_ij (dP_ij - delta_i) + dLSE_i P_ij = P_ij (dP_ij - (delta_i - dLSE_i)): the kernels' own
    formula with delta_i - dLSE_i (natural units: lse, delta and the scores the kernels differentiate are).
    A row that saw nothing (lse = -inf, P = 0) gets nothing, even from a gradient like 2 lse of lse**2."""
    g = grad_lse.to(device=delta.device, dtype=delta.dtype).expand_as(delta)
    delta.sub_(torch.where(torch.isneginf(lse), torch.zeros((), device=delta.device), g))


def _ordered_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts (n, m) -> (m,): the rows summed in a fixed pairwise order (in place, into row 0)."""
    n = parts.shape[0]
    while n > 1:
        half = n // 2
        parts[:half] += parts[n - half:n]  # the middle row of an odd n waits for the next round
        n -= half
    return parts[0]


# ---------------------------------------------------------------- the call


def _set_mask(p, bm, batch: int, heads: int) -> None:
    p.has_block_mask = 1
    p.mask_q_block, p.mask_kv_block = bm.BLOCK_SIZE
    p.q_num_blocks, p.q_indices = bm.q_num_blocks.data_ptr(), bm.q_indices.data_ptr()
    p.qn_stride_b, p.qn_stride_h, p.qn_stride_kv = bh_strides(bm.q_num_blocks, batch, heads)
    p.qi_stride_b, p.qi_stride_h, p.qi_stride_kv = bh_strides(bm.q_indices, batch, heads)
    if bm.full_q_num_blocks is not None:
        p.full_q_num_blocks, p.full_q_indices = bm.full_q_num_blocks.data_ptr(), bm.full_q_indices.data_ptr()
        p.fqn_stride_b, p.fqn_stride_h, p.fqn_stride_kv = bh_strides(bm.full_q_num_blocks, batch, heads)
        p.fqi_stride_b, p.fqi_stride_h, p.fqi_stride_kv = bh_strides(bm.full_q_indices, batch, heads)


def _int32_lists(bm):
    """The transposed lists as int32 (what the kernel reads); built if a mask lacks them."""
    if bm.q_num_blocks is None:
        from ..blockmask import BlockMask

        bm = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                      bm.BLOCK_SIZE, bm.mask_mod, bm.seq_lengths)
    conv = lambda t: None if t is None else (t if t.dtype == torch.int32 else t.to(torch.int32))  # noqa: E731
    if any(t is not None and t.dtype != torch.int32 for t in (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)):
        from dataclasses import replace

        bm = replace(bm, q_num_blocks=conv(bm.q_num_blocks), q_indices=conv(bm.q_indices),
                     full_q_num_blocks=conv(bm.full_q_num_blocks), full_q_indices=conv(bm.full_q_indices))
    return bm


def backward_call(query, key, value, out, lse, grad_out, score, bm, mask, scale: float, kernel_options,
                  needs_input_grad, grad_buffers: tuple[str, ...] = (), dropout_p: float = 0.0,
                  philox: tuple[int, int] | None = None, grad_lse=None):
    """Gradients of flex_attention: (dq, dk, dv, buffer_grads).

    dq/dk/dv are None where needs_input_grad says so; buffer_grads maps each name in
    `grad_buffers` (score_mod buffers that require grad) to its gradient, fp32, in the
    buffer's shape. dropout_p and philox must be those the forward was called with.
    grad_lse: the gradient of the returned lse, or None where nothing used it.
    """
    from ..dropout import check_dropout

    dropout_p, philox = check_dropout(dropout_p, philox)
    want_dq, want_dk, want_dv = (bool(x) for x in needs_input_grad)
    if query.numel() == 0:  # a batch or head count of 0: empty gradients, nothing to launch
        grads = [empty_like_layout(t, t.shape, query.dtype) if want else None
                 for t, want in ((query, want_dq), (key, want_dk), (value, want_dv))]
        return (*grads, {name: torch.zeros(score.buffers[name].shape, dtype=torch.float32, device=query.device)
                         for name in grad_buffers})
    launch = prepare_backward(query, key, value, out, grad_out, score, bm, mask, scale, kernel_options,
                              needs_input_grad, tuple(grad_buffers), dropout_p)
    return launch.run(query, key, value, out, lse, grad_out, grad_lse, philox)


def prepare_backward(query, key, value, out, grad_out, score, bm, mask, scale: float, kernel_options,
                     needs_input_grad, grad_buffers: tuple[str, ...] = (), dropout_p: float = 0.0) -> "BackwardLaunch":
    """The BackwardLaunch of non-empty inputs of these layouts (and of this output and output gradient's)."""
    with torch.cuda.device(query.device):  # (kernels load on the current device)
        return BackwardLaunch(query, key, value, out, grad_out, score, bm, mask, scale, kernel_options,
                              needs_input_grad, grad_buffers, dropout_p)


class BackwardLaunch:
    """The three backward kernels planned for one layout of inputs, output and output gradient, one block mask,
    one set of mod arguments and the gradients wanted: specs, kernels, grids and parameter structs filled but
    for the addresses. `run` allocates the gradients and scratch, fills the addresses and launches; a planned
    eager call (flexgen/eager_plans.py) keeps one per layout of the output gradient. It holds the tensors whose
    addresses its structs carry (the mask's lists, the buffers, the work order), not the mask or the mods."""

    def __init__(self, query, key, value, out, grad_out, score, bm, mask, scale: float, kernel_options,
                 needs_input_grad, grad_buffers: tuple[str, ...], dropout_p: float):
        from ..cache.jit import get_kernel
        from ..codegen.cstruct import pack_mod_args, struct_class
        from ..codegen.lower import lower_mods

        self.want = want_dq, want_dk, want_dv = tuple(bool(x) for x in needs_input_grad)
        batch, heads, q_len, d = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        self.device, self.dtype, self.grad_buffers = query.device, query.dtype, grad_buffers
        # The layouts the kernels read: kernel_ready's copies (of the layout alone: meta tensors).
        self.copies = tuple(not rows_aligned(t) for t in (query, key, value, out))
        q, k, v, o = (_meta_copy(t) if copy else t for t, copy in zip((query, key, value, out), self.copies))

        spec = make_spec("bwd", query, score, mask, kernel_options, dropout=dropout_p > 0, grad_buffers=grad_buffers,
                         mask_block=tuple(bm.BLOCK_SIZE) if bm is not None else None,
                         blocks_follow_mask=bm is not None and bm.blocks_follow_mask_mod)
        if bm is not None:  # (steps taller than the mask's query blocks walk their unions: the family allowed it)
            bm = _int32_lists(coarse_rows(bm, spec.block_m, q_lists=True))
        self.spec, deterministic = spec, spec.deterministic
        # dQ's accumulator: (splits, B, H, q_len, D), or where the main kernel adds dQ in its fragment order,
        # (B, H, q_len_padded, width); the other two kernels are told which.
        self.dq_fragments = dq_fragments(spec)
        pre_spec, post_spec = backward_helpers(spec, query)

        num_kv_tiles = -(-kv_len // spec.block_n)
        splits = _num_splits(num_kv_tiles, batch, kv_heads, self.device) if deterministic else 1
        self.buffers, params = mod_arguments(score, mask, self.device)
        self.grad_floats = sum(self.buffers[name].numel() for name in grad_buffers)
        self.grad_copies = 0  # deterministic mode: per-warp copies of the buffer gradients (see the module docstring)
        if deterministic and grad_buffers:
            copies_per_split = batch * kv_heads * spec.num_warps
            splits = deterministic_grad_splits(splits, copies_per_split, self.grad_floats, grad_buffers)
            self.grad_copies = copies_per_split * splits
        self.splits = splits
        split_stride = batch * heads * q_len * d if splits > 1 else 0
        lowered = lower_mods(spec)
        # ModArgs: packed here without gradients; with them, per run (they are allocated per run)
        self._pack = lambda grads: pack_mod_args(lowered, self.buffers, params, grads)

        # 1. delta and lse, padded (see ROWS_ALIGN), and a zeroed dQ accumulator
        self.q_len_padded = q_len_padded = padded_rows(q_len, spec.block_m)
        assert q_len_padded % spec.block_m == 0 and q_len_padded % pre_spec.block_m == 0, (spec.block_m, pre_spec.block_m)
        self.pre_kernel = get_kernel(pre_spec)
        empty_args = pack_mod_args(lower_mods(pre_spec), {}, {})
        pre = self.pre = BWD_PRE_PARAMS.ctypes_type(type(empty_args))()
        pre.o_stride_b, pre.o_stride_h, pre.o_stride_l = o.stride()[:3]
        pre.dq_split_stride = split_stride
        pre.q_len, pre.q_len_padded, pre.num_heads, pre.num_splits = q_len, q_len_padded, heads, splits
        pre.mod = empty_args
        self.pre_grid = dim3((q_len_padded // pre_spec.block_m, heads, batch))  # (the padding rows too)
        self.pre_threads = dim3(families.of(pre_spec).threads_per_cta(pre_spec))

        # 2. the main kernel
        self.kernel = get_kernel(spec)
        family = self.family = families.of(spec)
        p = self.main = BWD_PARAMS.ctypes_type(struct_class(lowered.fields), spec.dropout,
                                               tensor_maps=family.tensor_maps)()
        # Gradients in their input's dimension order, as PyTorch's; where the copy engine stores them (sm90, not
        # deterministic) and cannot store into that layout, into a contiguous stand-in, copied after the kernel.
        tma_gradients = family.tensor_maps and not deterministic
        dk, dv = (empty_like_layout(t, (batch, kv_heads, kv_len, d), query.dtype, "meta") for t in (key, value))
        self.stand_ins = (tma_gradients and want_dk and not rows_aligned(dk),
                          tma_gradients and want_dv and not rows_aligned(dv))
        dk, dv = (_meta_copy(t) if stand_in else t for t, stand_in in zip((dk, dv), self.stand_ins))
        p.q_stride_b, p.q_stride_h, p.q_stride_l = q.stride()[:3]
        p.k_stride_b, p.k_stride_h, p.k_stride_l = k.stride()[:3]
        p.v_stride_b, p.v_stride_h, p.v_stride_l = v.stride()[:3]
        if want_dk:
            p.dk_stride_b, p.dk_stride_h, p.dk_stride_l = dk.stride()[:3]
        if want_dv:
            p.dv_stride_b, p.dv_stride_h, p.dv_stride_l = dv.stride()[:3]
        p.dq_split_stride = split_stride
        p.grad_slot_stride = self.grad_floats if self.grad_copies else 0
        p.q_len, p.kv_len, p.num_heads, p.kv_group = q_len, kv_len, heads, heads // kv_heads
        p.q_len_padded = q_len_padded
        p.scale, p.scale_log2 = scale, scale * LOG2E
        mask_lists = ()
        if bm is not None:
            _set_mask(p, bm, batch, heads)
            mask_lists = (bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices)
        p.num_kv_tiles = num_kv_tiles
        if spec.dropout:
            set_dropout_rate(p, dropout_p)
        if not grad_buffers:
            p.mod = self._pack({})
        p.batch, p.kv_heads = batch, kv_heads
        grid, schedule = family.backward_grid(spec, p, query, key, num_kv_tiles, splits, bm)
        self.grid, self.threads = dim3(grid), dim3(family.threads_per_cta(spec))
        self.do_rows = spec.block_m
        self.shared_memory = int(shared_memory_bytes(self.kernel))
        self._keep = (mask_lists, self.buffers, schedule, p.mod if not grad_buffers else None)
        self.maps = None
        self._do_layout = None  # dO's MapLayout, made at the first run
        self._empty: tuple | None = None  # _allocators, made at the first run
        if family.tensor_maps:
            dq_accum = torch.empty(batch, heads, q_len, d, dtype=torch.float32, device="meta")  # (one split)
            dq_by_tma = want_dq and not deterministic and not self.dq_fragments
            self.maps = (map_layout(q, spec.block_m), map_layout(k, spec.block_n), map_layout(v, spec.block_n),
                         map_layout(dq_accum, DQ_BOX_ROWS) if dq_by_tma else None,
                         map_layout(dk, DKV_BOX_ROWS) if tma_gradients and want_dk else None,
                         map_layout(dv, DKV_BOX_ROWS) if tma_gradients and want_dv else None)

        # 3. dQ in the input dtype
        if want_dq:
            self.post_kernel = get_kernel(post_spec)
            post = self.post = BWD_POST_PARAMS.ctypes_type(type(empty_args))()
            post.dq_stride_b, post.dq_stride_h, post.dq_stride_l = empty_like_layout(query, device="meta").stride()[:3]
            post.dq_split_stride = split_stride
            post.q_len, post.q_len_padded, post.num_heads, post.num_splits = q_len, q_len_padded, heads, splits
            post.scale = scale
            post.mod = empty_args
            self.post_grid = dim3((-(-q_len // post_spec.block_m), heads, batch))
            self.post_threads = dim3(families.of(post_spec).threads_per_cta(post_spec))

    def _allocators(self, query, key, value) -> tuple:
        """Allocators of the per-row fp32 scratch (delta, lse in log2 units), dQ's accumulator, dK, dV and dQ (each
        a function of no arguments; None where that gradient is not wanted), for the layouts the launch serves,
        worked out at its first run."""
        batch, heads, q_len, d = query.shape
        kv_heads, kv_len = key.shape[1], key.shape[2]
        want_dq, want_dk, want_dv = self.want
        rows = functools.partial(torch.empty, (batch, heads, self.q_len_padded), dtype=torch.float32,
                                 device=self.device)
        self._empty = (rows,
                       functools.partial(self.dq_accumulator, batch, heads, q_len, d) if want_dq else None,
                       layout_allocator(key, (batch, kv_heads, kv_len, d), self.dtype) if want_dk else None,
                       layout_allocator(value, (batch, kv_heads, kv_len, d), self.dtype) if want_dv else None,
                       layout_allocator(query, (batch, heads, q_len, d)) if want_dq else None)
        return self._empty

    def _buffer_grads(self) -> tuple[dict, torch.Tensor | None]:
        """The zeroed tensors the kernel adds the buffers' gradients into, by name, and in deterministic mode the
        per-warp copies they are views of."""
        names, buffers = self.grad_buffers, self.buffers
        if not names:
            return {}, None
        if self.grad_copies:  # ModArgs points at copy 0; each warp adds its copy's offset
            parts = torch.zeros(self.grad_copies, self.grad_floats, dtype=torch.float32, device=self.device)
            return dict(zip(names, _buffer_views(parts[0], names, buffers))), parts
        return {n: torch.zeros(buffers[n].shape, dtype=torch.float32, device=self.device) for n in names}, None

    def dq_accumulator(self, batch: int, heads: int, q_len: int, d: int) -> torch.Tensor:
        """dQ's fp32 accumulator, uninitialised (the preprocess kernel zeroes it): one (B, H, L, D) partial per split,
        or where the main kernel adds dQ in its fragment order, (B, H, q_len_padded, width)."""
        if self.dq_fragments:
            shape = (batch, heads, self.q_len_padded, self.dq_fragments[0])
        else:
            shape = (self.splits, batch, heads, q_len, d)
        return torch.empty(shape, dtype=torch.float32, device=self.device)

    def preprocess(self, o, do, lse, delta, lse_log2, dq_accum, stream: int) -> None:
        """The first kernel: delta (B, H, q_len_padded) <- rowsum(dO * O), lse_log2 (same shape) <- lse (B, H,
        q_len, contiguous) * log2(e), +inf for -inf, both 0 past q_len (every element written), and dq_accum
        (splits, B, H, q_len, D) zeroed where given."""
        pre = type(self.pre).from_buffer_copy(self.pre)
        pre.o, pre.dout, pre.delta = o.data_ptr(), do.data_ptr(), delta.data_ptr()
        pre.lse, pre.lse_log2 = lse.data_ptr(), lse_log2.data_ptr()
        pre.do_stride_b, pre.do_stride_h, pre.do_stride_l = do.stride()[:3]
        pre.dq_accum = dq_accum.data_ptr() if dq_accum is not None else None
        self.pre_kernel.launch_dim3(self.pre_grid, self.pre_threads, 0, stream, pre)

    def run(self, query, key, value, out, lse, grad_out, grad_lse=None, philox: tuple[int, int] | None = None):
        """(dq, dk, dv, buffer_grads) for inputs of the planned layouts (the output gradient in any)."""
        want_dq, want_dk, want_dv = self.want
        q, k, v, o = query, key, value, out
        if any(self.copies):
            q, k, v, o = (kernel_ready(t) if copy else t for t, copy in zip((query, key, value, out), self.copies))
        do = kernel_ready(grad_out.to(self.dtype))
        lse = lse.contiguous()  # (only the preprocess kernel reads it)
        q_len = query.shape[2]
        device = self.device
        with torch.cuda.device(device):  # kernels launch on the current device
            stream = current_stream_ptr(device)
            empty_rows, empty_dq_accum, empty_dk, empty_dv, empty_dq = self._empty or self._allocators(query, key, value)
            # lse and delta as the main kernel reads them (see ROWS_ALIGN); the preprocess writes every element.
            delta, lse_log2 = empty_rows(), empty_rows()
            dq_accum = empty_dq_accum() if want_dq else None
            dk = empty_dk() if want_dk else None
            dv = empty_dv() if want_dv else None
            do_strides = do.stride()[:3]

            self.preprocess(o, do, lse, delta, lse_log2, dq_accum, stream)
            if grad_lse is not None:
                fold_lse_grad(delta[..., :q_len], lse, grad_lse)

            # 2. the main kernel
            p = type(self.main).from_buffer_copy(self.main)
            buffer_grads, grad_parts = self._buffer_grads()
            if self.grad_buffers:
                p.mod = self._pack(buffer_grads)  # (buffer_grads holds the tensors until the launch)
            dk_out, dv_out = dk, dv
            if self.stand_ins[0]:
                dk = torch.empty(dk.shape, dtype=dk.dtype, device=device)
            if self.stand_ins[1]:
                dv = torch.empty(dv.shape, dtype=dv.dtype, device=device)
            p.q, p.k, p.v, p.dout = q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr()
            p.do_stride_b, p.do_stride_h, p.do_stride_l = do_strides
            p.lse_log2, p.delta = lse_log2.data_ptr(), delta.data_ptr()
            p.dq_accum = dq_accum.data_ptr() if dq_accum is not None else None
            p.dk = dk.data_ptr() if dk is not None else None
            p.dv = dv.data_ptr() if dv is not None else None
            if self.maps is not None:
                q_map, k_map, v_map, dq_map, dk_map, dv_map = self.maps
                p.q_map, p.k_map, p.v_map = q_map.at(p.q), k_map.at(p.k), v_map.at(p.v)
                do_layout = self._do_layout
                if do_layout is None:  # (a launch serves one layout of the output gradient)
                    do_layout = self._do_layout = map_layout(do, self.do_rows)
                p.do_map = do_layout.at(p.dout)
                if dq_map is not None:  # dQ added by TMA reductions
                    p.dq_map = dq_map.at(p.dq_accum)
                if dk_map is not None:  # dK and dV stored by TMA
                    p.dk_map = dk_map.at(p.dk)
                if dv_map is not None:
                    p.dv_map = dv_map.at(p.dv)
            if philox is not None:
                p.philox_seed, p.philox_offset = philox
            self.kernel.launch_dim3(self.grid, self.threads, self.shared_memory, stream, p)
            dk, dv = _copied_into(dk_out, dk), _copied_into(dv_out, dv)
            if grad_parts is not None:  # the copies summed in a fixed order; gradients that own their memory
                total = _ordered_sum(grad_parts)
                buffer_grads = {name: g.clone() for name, g in
                                zip(self.grad_buffers, _buffer_views(total, self.grad_buffers, self.buffers))}

            # 3. dQ in the input dtype
            dq = None
            if want_dq:
                dq = empty_dq()
                post = type(self.post).from_buffer_copy(self.post)
                post.dq_accum, post.dq = dq_accum.data_ptr(), dq.data_ptr()
                self.post_kernel.launch_dim3(self.post_grid, self.post_threads, 0, stream, post)
        # The tensors whose addresses the kernels hold stay referenced until here; kernels run in
        # stream order, and torch's caching allocator reuses freed blocks only in stream order too.
        del delta, lse_log2, dq_accum, grad_parts
        return dq, dk, dv, buffer_grads


def _meta_copy(t: torch.Tensor) -> torch.Tensor:
    """The layout of kernel_ready's (or a stand-in's) copy of t: contiguous, on the meta device."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _copied_into(out: torch.Tensor | None, written: torch.Tensor | None) -> torch.Tensor | None:
    if out is not None and written is not out:
        out.copy_(written)
    return out


def _buffer_views(flat: torch.Tensor, names: tuple[str, ...], buffers: dict) -> list[torch.Tensor]:
    """Consecutive pieces of a 1-D fp32 tensor, one per buffer in `names`, in the buffer's shape."""
    views, offset = [], 0
    for name in names:
        shape = buffers[name].shape
        n = buffers[name].numel()
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views
