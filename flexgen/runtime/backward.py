"""The backward pass: three generated kernels, launched in order on torch's current stream.

1. bwd_preprocess   delta = rowsum(dO * O) (fp32), and zero the fp32 dQ accumulator.
2. bwd              one CTA per (KV tile, batch, KV head): recompute P, accumulate dK, dV in
                    registers (summed over the query heads of a GQA group), add dQ partials
                    into the accumulator, and (through score_mod_bwd) buffer gradients.
3. bwd_postprocess  dQ = scale * accumulator, in the input dtype.

Two families of the main kernel: sm80 (templates/sm80/bwd.cu.j2, every GPU from sm_80) and, on
Hopper where it applies (arch.resolve_backward_family), sm90 (templates/sm90/bwd.cu.j2: wgmma, a
producer warpgroup, 384 threads). Both take the same BwdParams and grid; the pre- and postprocess
kernels are sm80's for both.

`BwdParams` (templates/common/bwd_params.j2), `BwdPreParams` and `BwdPostParams`
(templates/sm80/bwd_{pre,post}process.cu.j2) are mirrored below field for field (ModArgs last);
tests compare their sizes with the kernels' parameter sizes in the PTX.

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
would, the call is refused. Measured (H200, fwd+bwd, causal, B=2, H=16, N=8k, D=128): learnable
ALiBi 18.7 ms against 13.2 non-deterministic (12.2 with fixed slopes, deterministic); a
(16, 16383) relative-bias table 34.6 ms against 20.3 (4 splits of 256 copies of 1 MiB).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from ..arch import resolve_backward_family
from ..attention import mod_arguments
from ..codegen.configs import choose_config
from ..codegen.spec import HEAD_DIMS, KernelSpec
from .forward import DROPOUT_FIELDS, LOG2E, _bh_strides, _sm_count, set_dropout, threads_per_cta

_ptr = ctypes.c_void_p
_i64 = ctypes.c_longlong
_i32 = ctypes.c_int
_f32 = ctypes.c_float


def _strides3(prefix: str) -> list[tuple[str, type]]:
    return [(f"{prefix}_stride_b", _i64), (f"{prefix}_stride_h", _i64), (f"{prefix}_stride_l", _i64)]


_BWD_FIELDS = (
    [("q", _ptr), ("k", _ptr), ("v", _ptr), ("dout", _ptr), ("lse", _ptr), ("delta", _ptr),
     ("dq_accum", _ptr), ("dk", _ptr), ("dv", _ptr)]
    + _strides3("q") + _strides3("k") + _strides3("v") + _strides3("do") + _strides3("dk") + _strides3("dv")
    + [("dq_split_stride", _i64), ("grad_slot_stride", _i64),
       ("q_len", _i32), ("kv_len", _i32), ("num_heads", _i32), ("kv_group", _i32),
       ("scale", _f32), ("scale_log2", _f32),
       ("q_num_blocks", _ptr), ("q_indices", _ptr), ("full_q_num_blocks", _ptr), ("full_q_indices", _ptr),
       ("qn_stride_b", _i64), ("qn_stride_h", _i64), ("qn_stride_kv", _i64),
       ("qi_stride_b", _i64), ("qi_stride_h", _i64), ("qi_stride_kv", _i64),
       ("fqn_stride_b", _i64), ("fqn_stride_h", _i64), ("fqn_stride_kv", _i64),
       ("fqi_stride_b", _i64), ("fqi_stride_h", _i64), ("fqi_stride_kv", _i64),
       ("has_block_mask", _i32), ("mask_q_block", _i32), ("mask_kv_block", _i32), ("num_kv_tiles", _i32),
       ("persistent", _i32), ("batch", _i32), ("kv_heads", _i32)]
)

_PRE_FIELDS = (
    [("o", _ptr), ("dout", _ptr), ("delta", _ptr), ("dq_accum", _ptr)]
    + _strides3("o") + _strides3("do")
    + [("dq_split_stride", _i64), ("q_len", _i32), ("num_heads", _i32), ("num_splits", _i32)]
)

_POST_FIELDS = (
    [("dq_accum", _ptr), ("dq", _ptr)]
    + _strides3("dq")
    + [("dq_split_stride", _i64), ("q_len", _i32), ("num_heads", _i32), ("num_splits", _i32), ("scale", _f32)]
)


def _struct(name: str, fields: list, mod_args_type: type) -> type:
    return type(name, (ctypes.Structure,), {"_fields_": fields + [("mod", mod_args_type)]})


@functools.lru_cache(maxsize=None)
def bwd_params_type(mod_args_type: type, dropout: bool = False) -> type:
    """The ctypes mirror of BwdParams (templates/sm80/bwd.cu.j2) for one ModArgs layout."""
    return _struct("BwdParams", _BWD_FIELDS + (DROPOUT_FIELDS if dropout else []), mod_args_type)


@functools.lru_cache(maxsize=None)
def pre_params_type(mod_args_type: type) -> type:
    """The ctypes mirror of BwdPreParams (templates/sm80/bwd_preprocess.cu.j2)."""
    return _struct("BwdPreParams", _PRE_FIELDS, mod_args_type)


@functools.lru_cache(maxsize=None)
def post_params_type(mod_args_type: type) -> type:
    """The ctypes mirror of BwdPostParams (templates/sm80/bwd_postprocess.cu.j2)."""
    return _struct("BwdPostParams", _POST_FIELDS, mod_args_type)


# ---------------------------------------------------------------- tile configuration

PRE_POST_ROWS, PRE_POST_WARPS = 64, 4

# Dynamic shared memory one CTA may use, per target.
SMEM_LIMIT = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024}


def warp_layout(head_dim: int, block_m: int, block_n: int, num_warps: int) -> tuple[int, int]:
    """(key warps, other warps) of bwd.cu.j2 (key_warps()): key rows in groups of 32 where that
    leaves every warp whole 16-wide steps of the query and D columns, else of 16."""
    def whole_steps(other: int) -> bool:
        return block_m % (16 * other) == 0 and head_dim % (16 * other) == 0

    key_warps = min(max(block_n // 32, 1), num_warps)
    while key_warps < num_warps and key_warps < block_n // 16 and not whole_steps(num_warps // key_warps):
        key_warps *= 2
    return key_warps, num_warps // key_warps


def layout_fits(head_dim: int, block_m: int, block_n: int, num_warps: int) -> bool:
    """Whether bwd.cu.j2's static_asserts hold for this tile and warp count."""
    key_warps, other = warp_layout(head_dim, block_m, block_n, num_warps)
    return (key_warps * other == num_warps and block_n % (16 * key_warps) == 0
            and block_m % (16 * other) == 0 and head_dim % (16 * other) == 0)


# dK and dV of a warp's rows and columns stay in registers all along: 128 registers at most.
MAX_DKV_FLOATS_PER_WARP = 128 * 32  # 128 registers x 32 lanes


def shared_memory_bytes(spec: KernelSpec) -> int:
    """Dynamic shared memory of the main backward kernel (layout in sm80/bwd.cu.j2: kv_tile_backward,
    or sm90_shared_memory_bytes for the sm90 family)."""
    if spec.option("family") == "sm90":
        return sm90_shared_memory_bytes(spec)
    d, bm, bn = spec.head_dim, spec.block_m, spec.block_n
    stages = 2 if spec.num_stages >= 2 else 1
    halves = 2 * bn * (d + 8) + 2 * stages * bm * (d + 8) + 2 * bn * (bm + 8)  # K, V; Q, dO per stage; P^T, dX^T
    return 2 * halves + 2 * stages * bm * 4  # + lse and delta per stage


def sm90_shared_memory_bytes(spec: KernelSpec) -> int:
    """Dynamic shared memory of the sm90 backward (layout in sm90/bwd.cu.j2, SMEM_BYTES): alignment
    slack, K, V, two stages of Q and dO, two dX buffers, two stages of lse and delta, the barriers."""
    d, bm, bn = spec.head_dim, spec.block_m, spec.block_n
    return 1024 + 2 * (2 * bn * d) + 2 * 2 * (2 * bm * d) + 2 * (2 * bm * bn) + 2 * 2 * bm * 4 + 128


def bwd_tiles(head_dim: int, arch: str, mask_block: tuple[int, int] | None = None, dropout: bool = False,
              buffer_grads: bool = False, **overrides) -> dict:
    """Tile config of the main kernel: block mask blocks must be whole multiples of the tiles.
    `overrides` (block_m, block_n, num_warps) come from kernel_options BLOCK_M1 / BLOCK_N1 / num_warps1;
    num_warps is an upper bound (fewer where the tile's warp layout needs)."""
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(
            f"flex_attention backward: head dim {head_dim} is not supported; supported head dims are {HEAD_DIMS}"
        )
    target = arch if arch in SMEM_LIMIT else "sm_80"
    cfg = choose_config("bwd", head_dim, "bf16", target, dropout=dropout, buffer_grads=buffer_grads, **overrides)
    bm, bn = cfg["block_m"], cfg["block_n"]
    if mask_block is not None:
        bq, bkv = mask_block
        if bq % 16 or bkv % 16:
            raise ValueError(f"flex_attention backward: block mask BLOCK_SIZE {mask_block} must be a multiple of 16")
        while bq % bm:
            bm //= 2
        while bkv % bn:
            bn //= 2
    limit = SMEM_LIMIT.get(arch, 99 * 1024)
    # Shared memory: the first fit of fewer query rows (down to 32), then one Q/dO stage
    # instead of two, then fewer key rows; then as many warps as the layout gives work to.
    stage_options = (2, 1) if cfg["num_stages"] >= 2 else (1,)
    rows = [bm >> i for i in range(8) if (bm >> i) >= min(bm, 32)]
    for n in [bn >> i for i in range(8) if (bn >> i) >= 16]:
        for stages in stage_options:
            for m in rows:
                probe = KernelSpec(kind="bwd", head_dim=head_dim, arch=target, block_m=m, block_n=n, num_warps=1,
                                   num_stages=stages)
                warps = _warps_for(head_dim, m, n, cfg["num_warps"])
                if shared_memory_bytes(probe) <= limit and warps:
                    return {"block_m": m, "block_n": n, "num_warps": warps, "num_stages": stages}
    raise NotImplementedError(
        f"flex_attention backward: head dim {head_dim} has no tile that fits {arch}'s {limit} bytes of shared memory "
        f"per block and its registers; it is not supported on this GPU"
    )


def backward_spec(base: KernelSpec, mask_block: tuple[int, int] | None, grad_buffers: tuple[str, ...],
                  deterministic: bool, requested_family: str | None, tile_overrides: dict) -> KernelSpec:
    """The main kernel of a backward whose per-call spec is `base`: its family and the tiles that fit
    the GPU and divide the block mask's blocks (`flexgen build` asks for the same kernel)."""
    d = base.head_dim
    family = resolve_backward_family(requested_family, base.arch, d, base.dropout, bool(grad_buffers),
                                     bool(tile_overrides), mask_block)
    extra = tuple(kv for kv in base.extra if kv[0] != "family") + ((("family", family),) if family else ())
    if family == "sm90":
        tiles = choose_config("bwd", d, base.dtype, base.arch, family_override="sm90")
    else:
        tiles = bwd_tiles(d, base.arch, mask_block, base.dropout, bool(grad_buffers), **tile_overrides)
    return base.with_(grad_buffers=grad_buffers, deterministic=deterministic, extra=tuple(sorted(extra)), **tiles)


@functools.lru_cache(maxsize=64)
def pre_post_specs(head_dim: int, dtype: str, arch: str) -> tuple[KernelSpec, KernelSpec]:
    """The backward's preprocess (delta, dQ accumulator) and postprocess (dQ) kernels (one spec
    object per shape, so the kernel cache hashes it once)."""
    pre = KernelSpec(kind="bwd_preprocess", head_dim=head_dim, dtype=dtype, arch=arch, block_m=PRE_POST_ROWS,
                     block_n=PRE_POST_ROWS, num_warps=PRE_POST_WARPS, num_stages=1)
    return pre, pre.with_(kind="bwd_postprocess")


def _warps_for(head_dim: int, block_m: int, block_n: int, warps: int) -> int:
    """The most warps, up to `warps`, whose layout gives each one whole MMA steps and at most
    MAX_DKV_FLOATS_PER_WARP of dK, dV; 0 if there are none."""
    while warps >= 1:
        if layout_fits(head_dim, block_m, block_n, warps) and 2 * block_n * head_dim <= MAX_DKV_FLOATS_PER_WARP * warps:
            return warps
        warps //= 2
    return 0


def _num_splits(num_kv_tiles: int, batch: int, kv_heads: int, device: torch.device) -> int:
    """Deterministic mode: KV-tile CTAs per (batch, KV head), about two waves of the GPU."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(1, batch * kv_heads))
    return max(1, min(num_kv_tiles, want))


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
    p.qn_stride_b, p.qn_stride_h, p.qn_stride_kv = _bh_strides(bm.q_num_blocks, batch, heads)
    p.qi_stride_b, p.qi_stride_h, p.qi_stride_kv = _bh_strides(bm.q_indices, batch, heads)
    if bm.full_q_num_blocks is not None:
        p.full_q_num_blocks, p.full_q_indices = bm.full_q_num_blocks.data_ptr(), bm.full_q_indices.data_ptr()
        p.fqn_stride_b, p.fqn_stride_h, p.fqn_stride_kv = _bh_strides(bm.full_q_num_blocks, batch, heads)
        p.fqi_stride_b, p.fqi_stride_h, p.fqi_stride_kv = _bh_strides(bm.full_q_indices, batch, heads)


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
                  philox: tuple[int, int] | None = None):
    """Gradients of flex_attention: (dq, dk, dv, buffer_grads).

    dq/dk/dv are None where needs_input_grad says so; buffer_grads maps each name in
    `grad_buffers` (score_mod buffers that require grad) to its gradient, fp32, in the
    buffer's shape. dropout_p and philox must be those the forward was called with.
    """
    from ..dropout import check_dropout

    dropout_p, philox = check_dropout(dropout_p, philox)
    with torch.cuda.device(query.device):  # kernels launch on the current device
        return _backward(query, key, value, out, lse, grad_out, score, bm, mask, scale, kernel_options,
                         needs_input_grad, tuple(grad_buffers), dropout_p, philox)


def _backward(query, key, value, out, lse, grad_out, score, bm, mask, scale, kernel_options, needs_input_grad,
              grad_buffers, dropout_p, philox):
    from ..attention import _kernel_ready, bwd_tile_overrides, make_spec
    from ..cache import get_kernel
    from ..codegen.cstruct import pack_mod_args
    from ..codegen.lower import lower_mods

    want_dq, want_dk, want_dv = (bool(x) for x in needs_input_grad)
    options = dict(kernel_options or {})
    deterministic = bool(options.get("deterministic", False))

    q, k, v = _kernel_ready(query), _kernel_ready(key), _kernel_ready(value)
    o, do = _kernel_ready(out), _kernel_ready(grad_out.to(query.dtype))
    lse = lse.contiguous()
    batch, heads, q_len, d = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    device = q.device
    stream = torch.cuda.current_stream(device).cuda_stream

    base = make_spec("bwd", query, score, mask, None, dropout=dropout_p > 0)
    if bm is not None:
        bm = _int32_lists(bm)
    mask_block = tuple(bm.BLOCK_SIZE) if bm is not None else None
    spec = backward_spec(base, mask_block, grad_buffers, deterministic, options.get("family"),
                         bwd_tile_overrides(kernel_options))
    family = spec.option("family")
    pre_spec, post_spec = pre_post_specs(d, base.dtype, base.arch)

    num_kv_tiles = -(-kv_len // spec.block_n)
    splits = _num_splits(num_kv_tiles, batch, kv_heads, device) if deterministic else 1
    buffers, params = mod_arguments(score, mask, device)
    grad_floats = sum(buffers[name].numel() for name in grad_buffers)
    grad_copies = 0  # deterministic mode: per-warp copies of the buffer gradients (see the module docstring)
    if deterministic and grad_buffers:
        copies_per_split = batch * kv_heads * spec.num_warps  # the sm80 family's warps: sm90 takes no buffer grads
        splits = deterministic_grad_splits(splits, copies_per_split, grad_floats, grad_buffers)
        grad_copies = copies_per_split * splits

    delta = torch.empty(batch, heads, q_len, dtype=torch.float32, device=device)
    dq_accum = torch.empty(splits, batch, heads, q_len, d, dtype=torch.float32, device=device) if want_dq else None
    split_stride = batch * heads * q_len * d if splits > 1 else 0
    dk = torch.empty(batch, kv_heads, kv_len, d, dtype=q.dtype, device=device) if want_dk else None
    dv = torch.empty(batch, kv_heads, kv_len, d, dtype=q.dtype, device=device) if want_dv else None

    # 1. delta, and a zeroed dQ accumulator
    pre_kernel = get_kernel(pre_spec)
    empty_args = pack_mod_args(lower_mods(pre_spec), {}, {})
    pre = pre_params_type(type(empty_args))()
    pre.o, pre.dout, pre.delta = o.data_ptr(), do.data_ptr(), delta.data_ptr()
    pre.dq_accum = dq_accum.data_ptr() if dq_accum is not None else None
    pre.o_stride_b, pre.o_stride_h, pre.o_stride_l = o.stride(0), o.stride(1), o.stride(2)
    pre.do_stride_b, pre.do_stride_h, pre.do_stride_l = do.stride(0), do.stride(1), do.stride(2)
    pre.dq_split_stride = split_stride
    pre.q_len, pre.num_heads, pre.num_splits = q_len, heads, splits
    pre.mod = empty_args
    rows_grid = (-(-q_len // PRE_POST_ROWS), heads, batch)
    pre_kernel.launch(rows_grid, (PRE_POST_WARPS * 32, 1, 1), 0, stream, pre)

    # 2. the main kernel
    grad_parts = None
    if grad_copies:  # ModArgs points at copy 0; each warp adds its copy's offset
        grad_parts = torch.zeros(grad_copies, grad_floats, dtype=torch.float32, device=device)
        buffer_grads = dict(zip(grad_buffers, _buffer_views(grad_parts[0], grad_buffers, buffers)))
    else:
        buffer_grads = {name: torch.zeros(buffers[name].shape, dtype=torch.float32, device=device) for name in grad_buffers}
    mod_args = pack_mod_args(lower_mods(spec), buffers, params, buffer_grads)
    kernel = get_kernel(spec)
    p = bwd_params_type(type(mod_args), spec.dropout)()
    p.q, p.k, p.v, p.dout = q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr()
    p.lse, p.delta = lse.data_ptr(), delta.data_ptr()
    p.dq_accum = dq_accum.data_ptr() if dq_accum is not None else None
    p.dk = dk.data_ptr() if dk is not None else None
    p.dv = dv.data_ptr() if dv is not None else None
    p.q_stride_b, p.q_stride_h, p.q_stride_l = q.stride(0), q.stride(1), q.stride(2)
    p.k_stride_b, p.k_stride_h, p.k_stride_l = k.stride(0), k.stride(1), k.stride(2)
    p.v_stride_b, p.v_stride_h, p.v_stride_l = v.stride(0), v.stride(1), v.stride(2)
    p.do_stride_b, p.do_stride_h, p.do_stride_l = do.stride(0), do.stride(1), do.stride(2)
    if dk is not None:
        p.dk_stride_b, p.dk_stride_h, p.dk_stride_l = dk.stride(0), dk.stride(1), dk.stride(2)
    if dv is not None:
        p.dv_stride_b, p.dv_stride_h, p.dv_stride_l = dv.stride(0), dv.stride(1), dv.stride(2)
    p.dq_split_stride = split_stride
    p.grad_slot_stride = grad_floats if grad_copies else 0
    p.q_len, p.kv_len, p.num_heads, p.kv_group = q_len, kv_len, heads, heads // kv_heads
    p.scale, p.scale_log2 = scale, scale * LOG2E
    if bm is not None:
        _set_mask(p, bm, batch, heads)
    p.num_kv_tiles = num_kv_tiles
    if spec.dropout:
        set_dropout(p, dropout_p, philox)
    p.mod = mod_args
    p.batch, p.kv_heads = batch, kv_heads
    grid = (splits if deterministic else num_kv_tiles, kv_heads, batch)
    if family == "sm90" and not deterministic and spec.option("persistent", True):
        # One CTA per SM walks the work tiles: the next tile's K and V copy behind this one's epilogue.
        p.persistent = 1
        grid = (min(num_kv_tiles * kv_heads * batch, _sm_count(device)), 1, 1)
    kernel.launch(grid, (threads_per_cta(spec), 1, 1), shared_memory_bytes(spec), stream, p)
    if grad_parts is not None:  # the copies summed in a fixed order; gradients that own their memory
        total = _ordered_sum(grad_parts)
        buffer_grads = {name: g.clone() for name, g in zip(grad_buffers, _buffer_views(total, grad_buffers, buffers))}

    # 3. dQ in the input dtype
    dq = None
    if want_dq:
        dq = torch.empty(batch, heads, q_len, d, dtype=q.dtype, device=device)
        post_kernel = get_kernel(post_spec)
        post = post_params_type(type(empty_args))()
        post.dq_accum, post.dq = dq_accum.data_ptr(), dq.data_ptr()
        post.dq_stride_b, post.dq_stride_h, post.dq_stride_l = dq.stride(0), dq.stride(1), dq.stride(2)
        post.dq_split_stride = split_stride
        post.q_len, post.num_heads, post.num_splits = q_len, heads, splits
        post.scale = scale
        post.mod = empty_args
        post_kernel.launch(rows_grid, (PRE_POST_WARPS * 32, 1, 1), 0, stream, post)
    # The tensors whose addresses the kernels hold stay referenced until here; kernels run in
    # stream order, and torch's caching allocator reuses freed blocks only in stream order too.
    del delta, dq_accum, grad_parts
    return dq, dk, dv, buffer_grads


def _buffer_views(flat: torch.Tensor, names: tuple[str, ...], buffers: dict) -> list[torch.Tensor]:
    """Consecutive pieces of a 1-D fp32 tensor, one per buffer in `names`, in the buffer's shape."""
    views, offset = [], 0
    for name in names:
        shape = buffers[name].shape
        n = buffers[name].numel()
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views
