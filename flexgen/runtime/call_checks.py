"""Checks of a flex_attention call that need no kernel and no GPU, shared by the eager call
(attention.py) and the custom ops' fake kernels (ops.py), which torch.compile traces: both refuse
the same calls with the same errors. Also the layout of the outputs, which both must agree on."""
from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from ..blockmask_validate import KERNEL_BLOCK_MULTIPLE
from ..codegen.spec import HEAD_DIMS
from ..warnings_once import warn_once

# Inputs the generated kernels do not take but the operator is defined for run through the float64 reference
# (flexgen.reference_attention, chunked, differentiable by autograd): correct and slow, with one warning per reason.
UNFUSED_DTYPES = (torch.float32, torch.float64)


def unfused_reason(query, value) -> str | None:
    """Why this call cannot use the generated kernels (None: it can)."""
    if query.device.type == "cpu":
        return "CPU tensors"
    if query.dtype in UNFUSED_DTYPES:
        return f"{query.dtype} inputs"
    if value.dtype != query.dtype:
        return f"{value.dtype} key and value with a {query.dtype} query"
    if value.shape[-1] != query.shape[-1]:
        return f"a value head dim ({value.shape[-1]}) different from the query's ({query.shape[-1]})"
    if query.shape[-1] not in HEAD_DIMS:
        return f"head dim {query.shape[-1]} (the kernels have {HEAD_DIMS})"
    return None


# The shortest forward tile (the sm80 family's: 16 rows per warp, 4 warps). Only lists computed from the mask_mod
# may be walked in unions of query blocks (runtime/coarse_rows.py); hand-made ones need blocks of whole tiles.
MIN_TILE_ROWS = 64


def hand_made_blocks_reason(block_size: tuple[int, int], blocks_follow_mask_mod: bool) -> str | None:
    """Why a block mask's blocks keep the call off the generated kernels (None: they do not)."""
    q_block, kv_block = block_size
    if q_block % KERNEL_BLOCK_MULTIPLE or kv_block % KERNEL_BLOCK_MULTIPLE:
        return (f"block masks of BLOCK_SIZE {tuple(block_size)} (the kernels walk blocks of a multiple of "
                f"{KERNEL_BLOCK_MULTIPLE} tokens)")
    if blocks_follow_mask_mod or q_block % MIN_TILE_ROWS == 0:
        return None
    return (f"hand-made block lists of {q_block}-row query blocks (the kernels walk hand-made lists in blocks of a "
            f"multiple of {MIN_TILE_ROWS} rows, and create_block_mask's lists at any size)")


def unfused_notice(reason: str, stacklevel: int = 3) -> None:
    warn_once(f"flex_attention: {reason} run on flexgen's unfused float64 path (correct, much slower than the "
              f"generated kernels, which take bfloat16 / float16 CUDA tensors with head dims {HEAD_DIMS})",
              stacklevel=stacklevel)


# gridDim.y and gridDim.z are at most 65535: the sm80 grids put heads in y and the batch in z.
MAX_GRID_YZ = 65535


def check_scale(scale) -> None:
    if scale is not None and not math.isfinite(float(scale)):
        raise ValueError(f"flex_attention: scale must be a finite number, got {scale}")


def check_grid(batch: int, heads: int) -> None:
    """The kernels' grids hold heads and batch in gridDim.y / gridDim.z; past their limit a launch would
    fail, so such a call is refused before it."""
    for what, n in (("batch size", batch), ("number of query heads", heads)):
        if n > MAX_GRID_YZ:
            raise ValueError(
                f"flex_attention: {what} {n} is past the {MAX_GRID_YZ} the kernels' grids take (CUDA's limit of "
                "gridDim.y and gridDim.z); split the call along that dimension"
            )


class BlockMaskLengthError(ValueError, RuntimeError):
    """A block mask made for other sequence lengths than the call's: a ValueError as flexgen raises bad arguments,
    and a RuntimeError as newer PyTorch raises this one."""


def check_block_mask_shape(seq_lengths, kv_num_blocks: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
    """The mask's (Q_LEN, KV_LEN), B and H against the inputs', and its device."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if tuple(seq_lengths) != (q_len, kv_len):
        shape = (*kv_num_blocks.shape[:2], *seq_lengths)
        smaller = q_len > seq_lengths[0] or kv_len > seq_lengths[1]
        crop = "" if smaller else f", or crop it with block_mask._adjust({q_len}, {kv_len}) where its mask_mod allows"
        which = "smaller" if smaller else "larger"
        head = f"flex_attention: block_mask was created for a {which} length than it is used for"
        if torch.compiler.is_compiling():  # (a message over traced sizes reaches a fullgraph caller unformatted)
            raise BlockMaskLengthError(
                f"{head}: its (Q_LEN, KV_LEN) differ from the query's and key's lengths; build one with "
                "create_block_mask(..., Q_LEN, KV_LEN) of the inputs (the eager call's error names them)")
        raise BlockMaskLengthError(
            f"{head}: block_mask.shape={shape} but got q_len={q_len} and kv_len={kv_len}; build a new one with "
            f"create_block_mask(..., Q_LEN={q_len}, KV_LEN={kv_len}){crop}"
        )
    if kv_num_blocks.device != query.device:
        raise ValueError(f"flex_attention: the block mask is on {kv_num_blocks.device} but the inputs are on "
                         f"{query.device}; use block_mask.to(device)")
    b, h = query.shape[0], query.shape[1]
    mb, mh = kv_num_blocks.shape[0], kv_num_blocks.shape[1]
    if not (mb == 1 or mb == b) or not (mh == 1 or mh == h):  # (not `in`: dynamo misjudges it on symbolic sizes)
        raise ValueError(f"flex_attention: block mask has B={mb}, H={mh}; each must be 1 or match the query's B={b}, "
                         f"H={h} (a mask with more batches or heads serves with its first ones)")


def check_block_grid(bm, query: torch.Tensor, key: torch.Tensor) -> None:
    """A block mask as the ops get it, its lengths taken from the inputs: its grid of blocks must be the one those
    lengths need (what check_block_mask_shape's length check is to flex_attention); then its B, H and device."""
    bq, bkv = bm.BLOCK_SIZE
    rows, cols = bm.kv_indices.shape[-2], bm.kv_indices.shape[-1]
    q_len, kv_len = query.shape[2], key.shape[2]
    need_rows, need_cols = -(-q_len // bq), -(-kv_len // bkv)
    if rows < need_rows or cols != need_cols:
        raise ValueError(
            f"flex_attention: the block mask has {rows} x {cols} blocks of {tuple(bm.BLOCK_SIZE)}, but inputs of "
            f"(Q_LEN, KV_LEN) = ({q_len}, {kv_len}) need {need_rows} x {need_cols}; build it with "
            f"create_block_mask(..., Q_LEN={q_len}, KV_LEN={kv_len})"
        )
    check_block_mask_shape(bm.seq_lengths, bm.kv_num_blocks, query, key)


def dim_order(t: torch.Tensor) -> list[int]:
    """t's dimensions outermost first, as its strides order them (PyTorch keeps the query's order for
    the output): equal strides (a size-1 dimension's) keep the outer dimension first, as PyTorch's fill order
    does, so the output's strides order like the query's; broadcast (stride 0) dimensions outermost; the head
    dim always innermost (the kernels write 16-byte rows)."""
    def outer_first(i: int):
        stride = t.stride(i) if t.stride(i) != 0 else math.inf
        return (-stride, i)

    return sorted(range(t.dim() - 1), key=outer_first) + [t.dim() - 1]


def row_major(t: torch.Tensor) -> bool:
    """Whether t's strides are exactly a row-major tensor's (is_contiguous ignores size-1 dimensions' strides,
    which PyTorch's stride order does not; without one it decides, and is the fast test)."""
    if 1 not in t.shape:
        return t.is_contiguous()
    try:
        return t.stride() == _row_major_strides_cached(t.shape)
    except TypeError:  # (symbolic sizes under torch.compile are no keys)
        return tuple(t.stride()) == _row_major_strides(t.shape)


@functools.lru_cache(maxsize=256)  # (planned calls ask for the same few shapes at every step)
def _row_major_strides_cached(shape: tuple[int, ...]) -> tuple[int, ...]:
    return _row_major_strides(shape)


def _row_major_strides(shape) -> tuple[int, ...]:
    strides, expected = [], 1
    for size in reversed(shape):
        strides.append(expected)
        expected *= size
    return tuple(reversed(strides))


def empty_like_layout(like: torch.Tensor, shape=None, dtype=None, device=None) -> torch.Tensor:
    """An empty tensor of `shape` (default like's) laid out in like's dimension order, on like's device (or
    `device`: "meta" for the layout alone)."""
    return layout_allocator(like, shape, dtype, device)()


def layout_allocator(like: torch.Tensor, shape=None, dtype=None, device=None) -> Callable[[], torch.Tensor]:
    """What empty_like_layout(like, shape, dtype, device) does, as a function of no arguments: a planned launch
    works out the layout once and allocates per call."""
    shape = tuple(like.shape if shape is None else shape)
    device = like.device if device is None else device
    if row_major(like):  # the common case, without working out the order
        return functools.partial(torch.empty, shape, dtype=dtype or like.dtype, device=device)
    return functools.partial(torch.empty_permuted, shape, dim_order(like), dtype=dtype or like.dtype, device=device)
