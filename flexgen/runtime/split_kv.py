"""Forwards with split keys: decoding-shaped calls (a few query rows against a long key/value cache).

Such a call has few query tiles: one CTA per tile would leave most SMs idle and read the cache at a fraction of
the memory's bandwidth. So each query tile's KV tiles are dealt into `kv_splits` parts, one CTA each
(templates/sm80/fwd.cu.j2 with split_kv): a part writes its O, normalised by its own row sums, and its lse in
fp32, and fwd_combine (templates/sm80/fwd_combine.cu.j2) merges them into O and lse as the unsplit forward gives
them. Under GQA the query heads of a KV head share the rows of a tile (families.packed_heads), so each KV tile is
read once for all of them. The backward is untouched: it reads only O and lse. Design and measurements:
docs/decoding.md.
"""
from __future__ import annotations

import math

import torch

from ..cache.jit import get_kernel
from ..cache.kernel import dim3
from ..codegen.cstruct import pack_mod_args
from ..codegen.lower import lower_mods
from ..codegen.params import FWD_COMBINE_PARAMS
from . import families
from .plan import make_spec


class Combine:
    """fwd_combine for one layout of outputs: the parts' workspace (allocated per run) and the launch that merges
    them into `out` and `lse`."""

    def __init__(self, query: torch.Tensor, out_strides: tuple[int, ...], splits: int):
        spec = make_spec("fwd_combine", query, None, None, None)
        self.kernel = get_kernel(spec)
        self.splits = splits
        batch, heads, q_len, d = query.shape
        self.shape = (splits, batch, heads, q_len, d)
        empty_args = pack_mod_args(lower_mods(spec), {}, {})
        p = self.params = FWD_COMBINE_PARAMS.ctypes_type(type(empty_args))()
        p.o_stride_b, p.o_stride_h, p.o_stride_l = out_strides[:3]
        p.part_rows = batch * heads * q_len
        threads = families.of(spec).threads_per_cta(spec)
        groups = self.groups = part_groups(splits, threads // (d // 8))
        p.q_len, p.num_heads, p.num_splits, p.part_groups = q_len, heads, splits, groups
        p.mod = empty_args
        rows_per_cta = threads // (d // 8 * groups)  # as fwd_combine.cu.j2: a thread per 8 columns, per group
        self.grid = dim3(-(-batch * heads * q_len // rows_per_cta))
        self.threads = dim3(threads)

    def workspace(self, device: torch.device) -> tuple[torch.Tensor, int, int]:
        """One uninitialised fp32 buffer for the parts' O, then their lse (one allocation per call), and the two
        addresses. Every element is written by the forward (a part with no KV tiles writes zeros and -inf)."""
        o_elements = math.prod(self.shape)
        buffer = torch.empty(o_elements + o_elements // self.shape[-1], dtype=torch.float32, device=device)
        o_part = buffer.data_ptr()
        return buffer, o_part, o_part + 4 * o_elements  # (lse after O: O's float4 reads stay 16-byte aligned)

    def run(self, o_part: int, lse_part: int, out: torch.Tensor, lse: torch.Tensor, stream: int) -> None:
        p = type(self.params).from_buffer_copy(self.params)
        p.o_part, p.lse_part, p.o, p.lse = o_part, lse_part, out.data_ptr(), lse.data_ptr()
        self.kernel.launch_dim3(self.grid, self.threads, 0, stream, p)


PARTS_PER_GROUP = 4  # fwd_combine's UNROLL: one batch of loads in flight per group
MAX_PART_GROUPS = 8


def part_groups(splits: int, most: int) -> int:
    """How many thread groups fwd_combine deals a row's parts to: a power of 2 with at least PARTS_PER_GROUP parts
    each, at most MAX_PART_GROUPS and `most` (the CTA's threads over a row's chunks). A row's merge is a chain of
    dependent loads, PARTS_PER_GROUP parts per link: the groups cut it when a decoding step has many parts."""
    groups = 1
    while groups * 2 <= min(MAX_PART_GROUPS, most) and splits >= groups * 2 * PARTS_PER_GROUP:
        groups *= 2
    return groups
