"""The forward pass: plan the kernel, pack FwdParams, launch on torch's current stream (the grid, the
threads and the schedule are the family's, the shared memory the compiled kernel's).

FwdParams is declared once, in codegen/params.py: the templates paste its C text, this module
fills its ctypes type.
"""
from __future__ import annotations

import functools

import torch

from ..blockmask import BlockMask
from ..cache.jit import get_kernel
from ..cache.kernel import dim3
from ..codegen.cstruct import pack_mod_args
from ..codegen.lower import lower_mods
from ..codegen.params import FWD_PARAMS
from ..codegen.spec import KernelSpec
from ..dropout import check_dropout, dropout_scale, dropout_threshold
from ..dsl.mod import Mod
from . import families
from .arguments import kernel_ready, mod_arguments
from .call_checks import check_block_grid, empty_like_layout, layout_allocator
from .coarse_rows import coarse_rows
from .kernel_symbols import shared_memory_bytes
from .plan import make_spec
from .split_kv import Combine
from .streams import current_stream_ptr
from .tensor_maps import map_layout

LOG2E = 1.4426950408889634
O_STORE_ROWS = 64  # the sm90 forward stores O by TMA, one box of 64 rows per consumer warpgroup


def bh_strides(t: torch.Tensor | None, batch: int, heads: int) -> tuple[int, int, int]:
    """Strides of a (B or 1, H or 1, nQ, ...) block-mask tensor; size-1 dims broadcast (stride 0)."""
    if t is None:
        return 0, 0, 0
    sb = t.stride(0) if t.shape[0] == batch and batch > 1 else 0
    sh = t.stride(1) if t.shape[1] == heads and heads > 1 else 0
    return sb, sh, t.stride(2)


def forward_params(spec: KernelSpec, mod_args, q, k, v, out_strides: tuple[int, ...], scale: float, block_mask,
                   dropout_p: float = 0.0):
    """A FwdParams instance with every field but the tensors' addresses, the maps and the per-stream fields
    (ForwardLaunch fills those per launch): a function of the tensors' shapes and strides, the mask, the mod
    arguments and the scale."""
    batch, heads, q_len, _ = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    writes_max = bool(spec.option("max_scores", False))
    family = families.of(spec)
    p = FWD_PARAMS.ctypes_type(type(mod_args), spec.dropout, writes_max, family.tensor_maps,
                               bool(spec.option("split_kv", False)))()
    p.q_stride_b, p.q_stride_h, p.q_stride_l, _ = q.stride()
    p.k_stride_b, p.k_stride_h, p.k_stride_l, _ = k.stride()
    p.v_stride_b, p.v_stride_h, p.v_stride_l, _ = v.stride()
    p.o_stride_b, p.o_stride_h, p.o_stride_l, _ = out_strides
    p.q_len, p.kv_len, p.num_heads, p.kv_group = q_len, kv_len, heads, heads // kv_heads
    p.scale, p.scale_log2 = scale, scale * LOG2E
    if block_mask is not None:
        p.has_block_mask = 1
        p.mask_q_block, p.mask_kv_block = block_mask.BLOCK_SIZE
        p.kv_num_blocks, p.kv_indices = block_mask.kv_num_blocks.data_ptr(), block_mask.kv_indices.data_ptr()
        p.kvn_stride_b, p.kvn_stride_h, p.kvn_stride_q = bh_strides(block_mask.kv_num_blocks, batch, heads)
        p.kvi_stride_b, p.kvi_stride_h, p.kvi_stride_q = bh_strides(block_mask.kv_indices, batch, heads)
        if block_mask.full_kv_num_blocks is not None:
            p.full_kv_num_blocks = block_mask.full_kv_num_blocks.data_ptr()
            p.full_kv_indices = block_mask.full_kv_indices.data_ptr()
            p.fkvn_stride_b, p.fkvn_stride_h, p.fkvn_stride_q = bh_strides(block_mask.full_kv_num_blocks, batch, heads)
            p.fkvi_stride_b, p.fkvi_stride_h, p.fkvi_stride_q = bh_strides(block_mask.full_kv_indices, batch, heads)
    if spec.dropout:
        set_dropout_rate(p, dropout_p)
    p.mod = mod_args
    p.batch = batch
    return p


def set_dropout_rate(p, dropout_p: float) -> None:
    """The dropout members of a FwdParams / BwdParams instance but the Philox seed and offset (dropout_p > 0,
    validated), which change per call."""
    p.dropout_p, p.dropout_threshold, p.dropout_scale = dropout_p, dropout_threshold(dropout_p), dropout_scale(dropout_p)


class ForwardLaunch:
    """The forward kernel planned for one layout of inputs (shapes, strides, dtype, device), one block mask and
    one set of mod arguments: the kernel, its grid and a parameter struct filled but for the addresses. `run`
    allocates the outputs, fills the addresses (and the maps, per address) and launches, so that a model's
    repeated calls pay neither the planning nor the struct's fill. It holds the tensors whose addresses its
    struct carries (the mask's lists, the buffers, the work order), not the mask or the mods themselves."""

    def __init__(self, kernel, spec: KernelSpec, params, grid: tuple, copies: tuple[bool, bool, bool], keep: tuple,
                 late_fields: tuple = (), combine: Combine | None = None):
        self.kernel, self.spec, self.family = kernel, spec, families.of(spec)
        self.combine = combine  # split keys: the parts' merge (runtime/split_kv.py)
        self.params, self.copies, self._keep = params, copies, keep
        self._late_fields = late_fields  # fields known only after planning: each fills p at every launch
        self.grid, self.threads = dim3(grid), dim3(self.family.threads_per_cta(spec))
        self.shared_memory = int(shared_memory_bytes(kernel))
        self.writes_max = bool(spec.option("max_scores", False))
        self._maps: tuple | None = None  # (q, k, v, o) MapLayouts, made at the first run
        self._empty: tuple | None = None  # (O's allocation, a per-row fp32 one), made at the first run

    def _output_makers(self, query) -> tuple:
        """Allocators of O (in the query's dimension order, as PyTorch's) and of a per-row fp32 output (the lse,
        the row max) for the layout the launch serves, worked out once."""
        b, h, lq, _ = query.shape
        empty_rows = functools.partial(torch.empty, (b, h, lq), dtype=torch.float32, device=query.device)
        self._empty = (layout_allocator(query), empty_rows)
        return self._empty

    def run(self, query, key, value, philox: tuple[int, int] | None = None):
        """(out, lse, max_scores) of these inputs, of the layout the launch was planned for; max_scores None unless
        the kernel writes it; philox (seed, offset) where it was planned with dropout."""
        q, k, v = query, key, value
        if self.copies != (False, False, False):
            q, k, v = (kernel_ready(t) if copy else t for t, copy in zip((query, key, value), self.copies))
        empty_out, empty_rows = self._empty or self._output_makers(query)
        out, lse = empty_out(), empty_rows()
        p = type(self.params).from_buffer_copy(self.params)
        p.q, p.k, p.v, p.o, p.lse = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
        if self.family.tensor_maps:
            maps = self._maps
            if maps is None:
                maps = self._maps = (map_layout(q, self.spec.block_m), map_layout(k, self.spec.block_n),
                                     map_layout(v, self.spec.block_n), map_layout(out, O_STORE_ROWS))
            p.q_map, p.k_map, p.v_map, p.o_map = (maps[0].at(p.q), maps[1].at(p.k), maps[2].at(p.v), maps[3].at(p.o))
        if philox is not None:
            p.philox_seed, p.philox_offset = philox
        row_max = None
        if self.writes_max:
            row_max = empty_rows()
            p.max_scores = row_max.data_ptr()
        for field in self._late_fields:
            field.fill(p)
        workspace = None
        if self.combine is not None:  # (the buffer is held until both launches are queued)
            workspace, p.o_part, p.lse_part = self.combine.workspace(query.device)
        stream = current_stream_ptr(query.device)
        self.family.stream_fields(p, query.device, stream)
        self.kernel.launch_dim3(self.grid, self.threads, self.shared_memory, stream, p)
        if workspace is not None:
            self.combine.run(p.o_part, p.lse_part, out, lse, stream)
        return out, lse, row_max


def prepare_forward(query, key, value, score: Mod | None, bm: BlockMask | None, mask: Mod | None, scale: float,
                    kernel_options, dropout_p: float = 0.0, max_scores: bool = False) -> ForwardLaunch:
    """The ForwardLaunch of validated, non-empty inputs with this mask, these mods and options."""
    spec, bm = _planned(query, key, score, bm, mask, kernel_options, dropout_p, max_scores)
    return _launch_for(spec, bm, query, key, value, score, mask, scale, dropout_p)


def _planned(query, key, score, bm, mask, kernel_options, dropout_p: float, max_scores: bool):
    """The spec, and the block mask its kernel walks (checked against the inputs and the tile)."""
    spec = make_spec("fwd", query, score, mask, kernel_options, dropout=dropout_p > 0,
                     mask_block=tuple(bm.BLOCK_SIZE) if bm is not None else None, max_scores=max_scores,
                     blocks_follow_mask=bm is not None and bm.blocks_follow_mask_mod, kv_heads=key.shape[1],
                     kv_len=key.shape[2])
    return spec, (kernel_block_mask(bm, query, key, spec) if bm is not None else None)


def _launch_for(spec: KernelSpec, bm, query, key, value, score, mask, scale: float, dropout_p: float) -> ForwardLaunch:
    kernel = get_kernel(spec)
    buffers, params = mod_arguments(score, mask, query.device)
    mod_args = pack_mod_args(lower_mods(spec), buffers, params)
    q, k, v = kernel_ready(query), kernel_ready(key), kernel_ready(value)
    out_strides = empty_like_layout(query, device="meta").stride()  # (the output run allocates)
    p = forward_params(spec, mod_args, q, k, v, out_strides, scale, bm, dropout_p)
    grid, schedule = families.of(spec).forward_grid(spec, p, q, k, bm)
    copies = tuple(t is not r for t, r in ((query, q), (key, k), (value, v)))
    mask_lists = () if bm is None else tuple(getattr(bm, f) for f in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                                                                         "full_kv_indices"))
    late_fields = tuple(x for x in schedule if hasattr(x, "fill"))  # (families.Family.forward_grid)
    combine = Combine(query, out_strides, p.kv_splits) if spec.option("split_kv", False) and p.kv_splits > 1 else None
    return ForwardLaunch(kernel, spec, p, grid, copies, (mask_lists, buffers, mod_args, schedule), late_fields,
                         combine)


def kernel_block_mask(bm: BlockMask, query, key, spec: KernelSpec) -> BlockMask:
    """The mask's grid of blocks checked against the inputs (call_checks.check_block_grid), then the mask the kernel
    walks: over a tile taller than the mask's query blocks the union of those it touches (runtime/coarse_rows.py),
    checked against the kernel's tile."""
    check_block_grid(bm, query, key)
    check_block_tiles(bm, spec)
    if bm.blocks_follow_mask_mod:  # (a union's partial blocks are exact only then)
        bm = coarse_rows(bm, spec.block_m)  # (the mask itself where its query blocks fit the tile)
    return bm


def check_block_tiles(bm: BlockMask, spec: KernelSpec) -> None:
    """The mask's blocks against the kernel's tile (any query block size of a mask from create_block_mask: a taller
    tile walks the union of the blocks it touches)."""
    rows_fit = bm.BLOCK_SIZE[0] % spec.block_m == 0 or bm.blocks_follow_mask_mod
    if not rows_fit or bm.BLOCK_SIZE[1] % spec.block_n:
        raise ValueError(
            f"flex_attention: block mask BLOCK_SIZE {bm.BLOCK_SIZE} must be a multiple of the kernel tile "
            f"({spec.block_m}, {spec.block_n}); use BLOCK_SIZE=128 or set kernel_options BLOCK_M/BLOCK_N"
        )


def forward_call(query, key, value, score: Mod | None, bm: BlockMask | None, mask: Mod | None, scale: float, kernel_options,
                 dropout_p: float = 0.0, philox: tuple[int, int] | None = None, max_scores: bool = False):
    """Validated inputs -> (out, lse) through the generated forward kernel; (out, lse, max_scores) with
    max_scores=True (the row max of the modded scores, natural units, -inf where a row sees nothing).

    dropout_p > 0: attention dropout with the keep mask drawn from philox = (seed, offset)
    (flexgen/dropout.py); lse stays that of the un-dropped softmax."""
    dropout_p, philox = check_dropout(dropout_p, philox)
    spec, bm = _planned(query, key, score, bm, mask, kernel_options, dropout_p, max_scores)
    if query.numel() == 0:  # a batch or head count of 0: nothing to compile or launch (a tensor map of an empty tensor is invalid)
        b, h, lq, d = query.shape
        out = empty_like_layout(query, (b, h, lq, d))
        lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
        return (out, lse) if not max_scores else (out, lse, torch.empty_like(lse))
    out, lse, row_max = _launch_for(spec, bm, query, key, value, score, mask, scale, dropout_p).run(query, key, value,
                                                                                                  philox)
    return (out, lse) if not max_scores else (out, lse, row_max)
