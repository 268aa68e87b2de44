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
        p.q_len, p.num_heads, p.num_splits = q_len, heads, splits
        p.mod = empty_args
        threads = families.of(spec).threads_per_cta(spec)
        rows_per_cta = threads // (d // 8)  # fwd_combine.cu.j2's ROWS: a thread per 8 columns of a row
        self.grid = dim3(-(-batch * heads * q_len // rows_per_cta))
        self.threads = dim3(threads)

    def parts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialised (O, lse) parts: every element is written by the forward (a part with no KV tiles writes
        zeros and -inf)."""
        o_part = torch.empty(self.shape, dtype=torch.float32, device=device)
        return o_part, torch.empty(self.shape[:-1], dtype=torch.float32, device=device)

    def run(self, o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
            stream: int) -> None:
        p = type(self.params).from_buffer_copy(self.params)
        p.o_part, p.lse_part, p.o, p.lse = o_part.data_ptr(), lse_part.data_ptr(), out.data_ptr(), lse.data_ptr()
        self.kernel.launch_dim3(self.grid, self.threads, 0, stream, p)
