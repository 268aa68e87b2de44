"""BlockMask: which (query block, KV block) tiles a kernel visits, and which need mask_mod.

The layout is PyTorch FlexAttention's, so a `torch.nn.attention.flex_attention.BlockMask`
converts without copying its index tensors. Building a mask never materialises an
N x N tensor: the static analysis of the mask's IR classifies tiles wholesale, and only
tiles it cannot decide are evaluated, a chunk of tiles at a time, on the target device.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from . import blockmask_dq_order as dq_order
from . import blockmask_validate as check
from .blockmask_cache import cached_per_mask, capturing
from .dsl.mod import Mod
from .dynamo_marks import assume_constant_result

DEFAULT_BLOCK_SIZE = 128
# PyTorch's "empty" block mask (its _create_empty_block_mask) is one block this large with lengths (1, 1): it
# stands for no block sparsity at any length (flex_attention drops it, or rebuilds it when it masks anything).
LARGE_BLOCK_SIZE = 1 << 30
# Elements evaluated at once when refining undecided tiles (bounds the temporary memory).
_EVAL_CHUNK_ELEMENTS = 1 << 24
# BlockMask.blocks_from of lists that came from elsewhere (from_kv_blocks, PyTorch's masks, slices).
_NOT_DERIVED = object()


def _same_mod(a, b) -> bool:
    """`a is b`, spelled out for functools.partials: dynamo cannot trace `is` between two of them (a mask over
    a partial, compiled with fullgraph=True), but can between their functions and bound values."""
    if isinstance(a, functools.partial) and isinstance(b, functools.partial):
        return (a.func is b.func and len(a.args) == len(b.args) and all(x is y for x, y in zip(a.args, b.args))
                and a.keywords.keys() == b.keywords.keys() and all(a.keywords[k] is b.keywords[k] for k in a.keywords))
    return a is b


def sliced_mask_mod(b, h, q_idx, kv_idx):
    raise RuntimeError(
        "this BlockMask was sliced (block_mask[...]), so it has no mask_mod: the slice's batch, head and query "
        "positions no longer match the original's. Set sliced.mask_mod to a mask_mod written for the slice "
        "(from the original mask_mod, with the offsets), or build a new mask for the inputs you attend with"
    )


def default_device() -> torch.device:
    """PyTorch's choice for device=None, the current accelerator, where one is usable; else the CPU
    (a CUDA build of torch names CUDA even on a machine with no GPU)."""
    return torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")


@functools.lru_cache(maxsize=1)
def _torch_dq_fields() -> int:
    """How many deterministic-dQ fields PyTorch's BlockMask.as_tuple has (4 from torch 2.13 on, else 0)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    return 4 if "dq_write_order" in inspect.signature(TorchBlockMask.__init__).parameters else 0


@functools.lru_cache(maxsize=1)
def _torch_getitem_drops_int_dims() -> bool:
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    one = dict(dtype=torch.int32)
    probe = TorchBlockMask.from_kv_blocks(torch.ones(2, 1, 1, **one), torch.zeros(2, 1, 1, 1, **one), BLOCK_SIZE=128)
    return probe[0].kv_num_blocks.dim() == 2


@assume_constant_result
def torch_int_index_drops_dim() -> bool:
    """Whether the installed PyTorch's BlockMask[int] drops that dimension (as torch 2.11's does) or keeps it with
    size 1 (as from torch 2.13 on): asked of a two-block mask of its own, once."""
    return _torch_getitem_drops_int_dims()


def _pair(block_size) -> tuple[int, int]:
    if isinstance(block_size, int):
        return block_size, block_size
    q, kv = block_size
    return int(q), int(kv)


def _partition(keep: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last dim: how many `keep` holds, and `values` with the kept ones first, both parts in order."""
    # A stable partition by prefix sums: linear, where a sort of each row costs n log n (80 ms for causal at 128k
    # tokens on a CPU); traceable, and no host sync.
    counts = keep.sum(-1, dtype=torch.int32)
    kept = keep.to(torch.int32)
    slot = torch.where(keep, kept.cumsum(-1) - 1, counts.unsqueeze(-1) + (1 - kept).cumsum(-1) - 1)
    order = torch.empty(keep.shape, dtype=values.dtype, device=values.device)
    order.scatter_(-1, slot.long(), values.expand(keep.shape))
    return counts, order


def dense_to_lists(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., rows, cols) bool -> per-row counts and the column indices, present ones first."""
    return _partition(blocks, torch.arange(blocks.shape[-1], dtype=torch.int32, device=blocks.device))


def lists_inside(counts: torch.Tensor, indices: torch.Tensor, n_kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The lists without the blocks outside [0, n_kv_blocks), the rest in order."""
    return _partition(_listed(counts, indices) & (indices >= 0) & (indices < n_kv_blocks), indices)


def _listed(counts: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Which slots of each row of `indices` the row's count covers."""
    return torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)


def lists_to_dense(counts: torch.Tensor, indices: torch.Tensor, cols: int) -> torch.Tensor:
    """(..., rows, cols) bools from per-row counts and block numbers; block numbers outside [0, cols) name no
    column and are left out."""
    present = _listed(counts, indices) & (indices >= 0) & (indices < cols)
    dense = torch.zeros(*indices.shape[:-1], cols + 1, dtype=torch.bool, device=indices.device)
    # Absent slots scatter into a spare column that is dropped afterwards.
    target = torch.where(present, indices.long(), torch.full_like(indices.long(), cols))
    dense.scatter_(-1, target, True)
    return dense[..., :cols]


def _torch_lists_inside(kv_num, kv_idx, fkv_num, fkv_idx, n_kv: int) -> tuple:
    """A PyTorch mask's kv lists without blocks outside [0, n_kv) (lists_inside); eager, the same tensors for the
    same lists (blockmask_cache.py), so that what is derived from them and cached per count tensor (the
    adoption, the work orders) is made once per mask, not once per call."""
    def make():
        inside = lists_inside(kv_num, _full_width(kv_idx, n_kv), n_kv)
        full = lists_inside(fkv_num, _full_width(fkv_idx, n_kv), n_kv) if fkv_num is not None else (None, None)
        return (*inside, *full)

    if torch.compiler.is_compiling() or capturing(kv_num):  # (traced tensors; a captured graph keeps addresses)
        return make()
    also = (kv_idx,) if fkv_num is None else (kv_idx, fkv_idx)
    key = ("inside", id(kv_num), id(kv_idx), id(fkv_num), id(fkv_idx), n_kv)
    return cached_per_mask(key, kv_num, fkv_num, make, also)


def _kv_blocks(bm) -> int:
    return -(-int(bm.seq_lengths[1]) // _pair(bm.BLOCK_SIZE)[1])


def _full_width(indices: torch.Tensor | None, columns: int) -> torch.Tensor | None:
    """`indices` with at least `columns` slots per row. PyTorch's masks may be compacted to as many columns as
    the longest list has blocks; the checks and the dense views here take a row's width as its number of blocks,
    so narrower lists are padded (the slots past a row's count are never read)."""
    if indices is None or indices.shape[-1] >= columns:
        return indices
    return torch.nn.functional.pad(indices, (0, columns - indices.shape[-1]))


@dataclass
class BlockMask:
    """Block-sparse description of a mask, in PyTorch FlexAttention's layout.

    `kv_num_blocks`/`kv_indices` list the partial blocks of each query block (mask_mod is
    applied inside them); `full_kv_*` the blocks where every element is visible. The `q_*`
    fields are the transposes, for the backward pass. B or H of size 1 broadcast.
    """

    seq_lengths: tuple[int, int]
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor | None
    full_kv_indices: torch.Tensor | None
    q_num_blocks: torch.Tensor | None
    q_indices: torch.Tensor | None
    full_q_num_blocks: torch.Tensor | None
    full_q_indices: torch.Tensor | None
    # (defaults as PyTorch's constructor has them; no mask_mod: every element of a listed block is visible)
    BLOCK_SIZE: tuple[int, int] = (DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    mask_mod: Any = None
    # The mask_mod the lists were computed from (create_block_mask), else _NOT_DERIVED: see blocks_follow_mask_mod.
    blocks_from: Any = field(default=_NOT_DERIVED, repr=False, compare=False)
    # PyTorch's deterministic-dQ metadata (blockmask_dq_order.py), keyword-only as in its constructor.
    dq_write_order: torch.Tensor | None = field(default=None, kw_only=True, repr=False, compare=False)
    dq_write_order_full: torch.Tensor | None = field(default=None, kw_only=True, repr=False, compare=False)
    dq_kv_order: torch.Tensor | None = field(default=None, kw_only=True, repr=False, compare=False)
    dq_kv_order_spt: bool | None = field(default=None, kw_only=True, repr=False, compare=False)

    # PyTorch's pytree layout (BlockMask._flatten / _unflatten): the index tensors that are present, then the rest.
    _TENSOR_ATTRS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
                     "dq_write_order", "dq_write_order_full", "dq_kv_order")
    _CONTEXT_ATTRS = ("seq_lengths", "BLOCK_SIZE", "mask_mod", "blocks_follow_mask_mod", "dq_kv_order_spt")

    def __post_init__(self):
        # (AssertionError, as PyTorch's BlockMask raises for these)
        for kind in ("kv", "q"):
            if (getattr(self, f"full_{kind}_num_blocks") is None) != (getattr(self, f"full_{kind}_indices") is None):
                raise AssertionError(f"BlockMask: full_{kind}_num_blocks and full_{kind}_indices must be both provided or omitted")
        dq_order.check(self.dq_write_order, self.dq_write_order_full, self.dq_kv_order, self.dq_kv_order_spt, "BlockMask")

    def _dq_kv_order(self) -> torch.Tensor | bool | None:
        """The scheduler order the dQ metadata was ranked in: the explicit one, else the built-in one (PyTorch's)."""
        return self.dq_kv_order if self.dq_kv_order is not None else self.dq_kv_order_spt

    # ------------------------------------------------------------ construction
    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: torch.Tensor | None = None,
        full_kv_indices: torch.Tensor | None = None,
        BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE,
        mask_mod: Callable | Mod | None = None,
        seq_lengths: tuple[int, int] | None = None,
        compute_q_blocks: bool = True,
        *,
        dq_write_order: torch.Tensor | None = None,
        dq_write_order_full: torch.Tensor | None = None,
        dq_kv_order: torch.Tensor | bool | None = None,
    ) -> "BlockMask":
        """A mask from PyTorch's lists: for each query block, `kv_num_blocks` partial KV blocks
        listed first in `kv_indices` (mask_mod applied), and optionally the full ones.
        compute_q_blocks=False leaves the transposed lists out (the forward does not read them; a backward
        builds them when it needs them). The dq_* arguments are PyTorch's deterministic-dQ metadata, carried as
        given (blockmask_dq_order.py): dq_kv_order a tensor order or a bool for a built-in one.

        Shapes (B, H, nQ) and (B, H, nQ, nKV) (B and H may be left out, or be 1 to broadcast).
        Everything is checked here: counts within a row's length, block numbers within the
        sequence, no block listed twice, none both partial and full."""
        where = "BlockMask.from_kv_blocks"
        order_tensor, order_spt = dq_order.split_order(dq_kv_order)
        dq_order.check(dq_write_order, dq_write_order_full, order_tensor, order_spt, where)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError(f"{where}: full_kv_num_blocks and full_kv_indices must be given together")
        bq, bkv = check.block_size(BLOCK_SIZE, where)
        indices_shape = tuple(getattr(kv_indices, "shape", ()))
        n_q, n_kv = (indices_shape[-2], indices_shape[-1]) if len(indices_shape) >= 2 else (0, 0)
        seq_lengths = (n_q * bq, n_kv * bkv) if seq_lengths is None else check.seq_lengths(seq_lengths, where)
        kv_blocks = -(-seq_lengths[1] // bkv)
        n_kv = max(n_kv, kv_blocks)  # (lists may be compacted to the longest one's length)
        # Traced lists hold no values to check: they are made safe instead (counts within a row, blocks outside
        # the sequence left out, on the device, as PyTorch's masks are in from_torch); repeats go unchecked.
        traced = torch.compiler.is_compiling()

        def lists(counts, indices, prefix):
            counts, indices = check.block_lists(counts, indices, kv_blocks, prefix, where, not traced)
            return lists_inside(counts, indices, kv_blocks) if traced else (counts, indices)

        def dense(counts, indices, prefix):
            blocks = lists_to_dense(counts, indices, n_kv)
            if not traced:
                check.no_repeats(counts, blocks, prefix, where)
            return blocks

        kv_num_blocks, kv_indices = lists(kv_num_blocks, kv_indices, "kv")
        partial = dense(kv_num_blocks, kv_indices, "kv")
        q_num, q_idx = dense_to_lists(partial.transpose(-1, -2)) if compute_q_blocks else (None, None)
        fq_num = fq_idx = None
        if full_kv_num_blocks is not None:
            full_kv_num_blocks, full_kv_indices = lists(full_kv_num_blocks, full_kv_indices, "full_kv")
            if full_kv_indices.shape[-2] != kv_indices.shape[-2] or full_kv_indices.device != kv_indices.device:
                raise ValueError(
                    f"{where}: full_kv_indices {tuple(full_kv_indices.shape)} on {full_kv_indices.device} must match "
                    f"kv_indices {tuple(kv_indices.shape)} on {kv_indices.device} in nQ and device"
                )
            full = dense(full_kv_num_blocks, full_kv_indices, "full_kv")
            if not traced:
                check.disjoint(partial, full, where)
            if compute_q_blocks:
                fq_num, fq_idx = dense_to_lists(full.transpose(-1, -2))
        return cls(
            seq_lengths=tuple(seq_lengths),
            kv_num_blocks=kv_num_blocks,
            kv_indices=kv_indices,
            full_kv_num_blocks=full_kv_num_blocks,
            full_kv_indices=full_kv_indices,
            q_num_blocks=q_num,
            q_indices=q_idx,
            full_q_num_blocks=fq_num,
            full_q_indices=fq_idx,
            BLOCK_SIZE=(bq, bkv),
            mask_mod=mask_mod,
            dq_write_order=dq_write_order,
            dq_write_order_full=dq_write_order_full,
            dq_kv_order=order_tensor,
            dq_kv_order_spt=order_spt,
        )

    @classmethod
    def from_dense_blocks(cls, full: torch.Tensor, partial: torch.Tensor, block_size, seq_lengths, mask_mod) -> "BlockMask":
        """From (B, H, nQ, nKV) booleans: which blocks are full and which partial."""
        kv_num, kv_idx = dense_to_lists(partial)
        fkv_num, fkv_idx = dense_to_lists(full)
        q_num, q_idx = dense_to_lists(partial.transpose(-1, -2))
        fq_num, fq_idx = dense_to_lists(full.transpose(-1, -2))
        return cls(tuple(seq_lengths), kv_num, kv_idx, fkv_num, fkv_idx, q_num, q_idx, fq_num, fq_idx, _pair(block_size), mask_mod)

    @classmethod
    def from_torch(cls, bm) -> "BlockMask":
        """Adopt a torch.nn.attention.flex_attention.BlockMask as it is, with the (B, H) dimensions it leaves out
        put back as 1, which broadcast: PyTorch reads lists of (nQ, nKV) or (H, nQ, nKV) that way."""
        if isinstance(bm, BlockMask):
            return bm._with_batch_and_heads()._with_full_width()
        n_kv = _kv_blocks(bm)
        kv_num, kv_idx, fkv_num, fkv_idx = bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices
        # PyTorch's PagedAttention lists page -1 for the logical blocks it has reserved no pages for (its mask_mod
        # masks them), and a hand-made mask may list blocks past KV_LEN: they hold no keys, and the kernels would
        # read K and V there. Dropped on the device (a few fused element-wise ops and a scan), so that neither an
        # eager call waits for the GPU to find out whether there are any, nor a traced one, whose lists hold no
        # values. The q lists need no such step: PyTorch builds them by scattering into a spare column, which
        # leaves such blocks out.
        kv_num, kv_idx, fkv_num, fkv_idx = _torch_lists_inside(kv_num, kv_idx, fkv_num, fkv_idx, n_kv)
        q_num, q_idx, fq_num, fq_idx = bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices
        if q_num is None:
            made = cls.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, bm.BLOCK_SIZE, bm.mask_mod, bm.seq_lengths)
            q_num, q_idx, fq_num, fq_idx = made.q_num_blocks, made.q_indices, made.full_q_num_blocks, made.full_q_indices
        return cls(
            tuple(bm.seq_lengths), kv_num, kv_idx, fkv_num, fkv_idx,
            q_num, q_idx, fq_num, fq_idx, _pair(bm.BLOCK_SIZE), bm.mask_mod,
        )._with_batch_and_heads()._with_full_width()

    def _with_full_width(self) -> "BlockMask":
        """The mask with lists a column per block: kv lists as wide as the KV blocks of its sequence, q lists as
        its query blocks (_full_width)."""
        kv_cols, q_cols = self._kv_columns(), self.kv_indices.shape[-2]
        tensors = (self.kv_indices, self.full_kv_indices, self.q_indices, self.full_q_indices)
        widths = (kv_cols, kv_cols, q_cols, q_cols)
        if all(t is None or t.shape[-1] >= w for t, w in zip(tensors, widths)):
            return self
        kv, fkv, q, fq = (_full_width(t, w) for t, w in zip(tensors, widths))
        return replace(self, kv_indices=kv, full_kv_indices=fkv, q_indices=q, full_q_indices=fq)

    def _kv_columns(self) -> int:
        """KV blocks a row of the mask spans: its lists' width, or its sequence's blocks where those are more
        (lists compacted to the longest one's length)."""
        return max(self.kv_indices.shape[-1], _kv_blocks(self))

    def _with_batch_and_heads(self) -> "BlockMask":
        """The mask with lists of (B, H, nQ[, nKV]): the leading dimensions a slice or a hand-made mask left out
        become 1."""
        missing = 4 - self.kv_indices.dim()
        if missing <= 0:
            return self
        return self._map_tensors(lambda t: t.reshape((1,) * missing + tuple(t.shape)))

    # ------------------------------------------------------------ pytree
    @classmethod
    def _present(cls, absent) -> tuple[str, ...]:
        """The _TENSOR_ATTRS not named in `absent` (the last entry of a _flatten context), in order."""
        return tuple(a for a in cls._TENSOR_ATTRS if a not in absent)

    def _flatten(self) -> tuple[tuple[torch.Tensor, ...], tuple]:
        """(tensors, context) as PyTorch's BlockMask._flatten: the index tensors present, in _TENSOR_ATTRS order;
        the _CONTEXT_ATTRS values, then the names of the absent tensors."""
        absent = tuple(a for a in self._TENSOR_ATTRS if getattr(self, a) is None)
        tensors = tuple(getattr(self, a) for a in self._present(absent))
        return tensors, (*(getattr(self, a) for a in self._CONTEXT_ATTRS), absent)

    def _flatten_with_keys(self) -> tuple[tuple[tuple[Any, torch.Tensor], ...], tuple]:
        """_flatten with each tensor keyed by its attribute (torch.utils._pytree.GetAttrKey), for tracing."""
        from torch.utils._pytree import GetAttrKey

        tensors, context = self._flatten()
        return tuple((GetAttrKey(a), t) for a, t in zip(self._present(context[-1]), tensors)), context

    @classmethod
    def _unflatten(cls, tensors, context) -> "BlockMask":
        """The mask _flatten took apart (whether its lists follow its mask_mod included)."""
        *values, absent = context
        ctx = dict(zip(cls._CONTEXT_ATTRS, values))
        fields = dict.fromkeys(absent)
        fields.update(zip(cls._present(absent), tensors))
        return cls(seq_lengths=tuple(ctx["seq_lengths"]), BLOCK_SIZE=tuple(ctx["BLOCK_SIZE"]), mask_mod=ctx["mask_mod"],
                   blocks_from=ctx["mask_mod"] if ctx["blocks_follow_mask_mod"] else _NOT_DERIVED,
                   dq_kv_order_spt=ctx["dq_kv_order_spt"], **fields)

    # ------------------------------------------------------------ views
    @property
    def blocks_follow_mask_mod(self) -> bool:
        """Whether the lists were computed from this mask's mask_mod (create_block_mask): then an absent block
        hides, and a full one shows, every element just as mask_mod does, and a kernel tile may walk the union of
        several query blocks' lists, mask_mod deciding each element (runtime/coarse_rows.py). Lists made by hand
        (from_kv_blocks, a block-sparse layout, PyTorch's masks) may disagree with mask_mod, and are walked as
        they are."""
        return _same_mod(self.blocks_from, self.mask_mod)

    def derived_from_mask_mod(self) -> "BlockMask":
        """This mask, its lists marked as computed from its mask_mod."""
        return replace(self, blocks_from=self.mask_mod)

    @property
    def shape(self) -> tuple[int, ...]:
        """(B, H, Q_LEN, KV_LEN), as PyTorch's: B and H as stored (1 where they broadcast)."""
        return tuple(self.kv_indices.shape[:-2]) + tuple(self.seq_lengths)

    def numel(self) -> int:
        """Elements of the (B, H, Q_LEN, KV_LEN) mask it describes, sparsity aside."""
        return math.prod(self.shape)

    def as_tuple(self, flatten: bool = True) -> tuple:
        """The fields in the order of the installed PyTorch's BlockMask.as_tuple (its deterministic-dQ
        fields from torch 2.13 on); `flatten` spreads seq_lengths and BLOCK_SIZE into two ints each."""
        lengths = tuple(self.seq_lengths) if flatten else (tuple(self.seq_lengths),)
        block = tuple(self.BLOCK_SIZE) if flatten else (tuple(self.BLOCK_SIZE),)
        return (
            *lengths, self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
            self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
            *(getattr(self, f) for f in dq_order.FIELDS[:_torch_dq_fields()]), *block, self.mask_mod,
        )

    def __getitem__(self, index) -> "BlockMask":
        """The mask of some batches, heads or query blocks, like the installed PyTorch's: an int on the batch or
        head dimension drops it where PyTorch's BlockMask does (torch 2.11: mask[0] has lists of (H, nQ)) and keeps
        it with size 1 where PyTorch's does (torch 2.13); an int on the query-block dimension keeps it. A cut along
        the query blocks shortens Q_LEN to the rows of the blocks kept (PyTorch's behaviour after 2.13, so that
        the slice attends queries of that length). The result has no mask_mod (its positions no longer match the
        original's); set one for the slice before attending with it."""
        index = index if isinstance(index, tuple) else (index,)
        sizes = tuple(self.kv_num_blocks.shape)
        if len(index) > len(sizes):
            raise IndexError(f"BlockMask indexes only its batch, head, and Q-block dimensions (at most {len(sizes)} "
                             f"indices, the leading ones as its lists have them), got {len(index)}; the KV blocks "
                             f"cannot be indexed")
        dims = ("batch", "head", "query block")[-len(sizes):]
        picks, ints = [], []
        for i, n, dim in zip((*index, *(slice(None),) * len(sizes)), sizes, dims):
            if isinstance(i, int) and not isinstance(i, bool):
                if not -n <= i < n:
                    raise IndexError(f"BlockMask index {i} is out of range for {dim} of size {n}")
                ints.append(len(picks))
                i = slice(i % n, i % n + 1)
            picks.append(i)
        picks = tuple(picks)
        pick = lambda t: None if t is None else t[picks]  # noqa: E731
        dq_order.refuse_tensor_order(self, "Slicing")
        sliced = BlockMask.from_kv_blocks(
            pick(self.kv_num_blocks), pick(self.kv_indices), pick(self.full_kv_num_blocks), pick(self.full_kv_indices),
            self.BLOCK_SIZE, sliced_mask_mod if self.mask_mod is not None else None, self.seq_lengths,
            compute_q_blocks=self.q_num_blocks is not None,
        )
        # from_kv_blocks gave lists of (B, H, ...): this mask's own leading dimensions are the last of B and H
        lead = len(sizes) - 1
        drop = [lead_dim for lead_dim in ints if lead_dim < lead] if torch_int_index_drops_dim() else []
        keep = (0,) * (2 - lead) + tuple(0 if d in drop else slice(None) for d in range(lead))
        sliced = sliced if keep == (slice(None),) * 2 else sliced._map_tensors(lambda t: t[keep])
        q_len = self._rows_of_blocks(picks[-1], sizes[-1])
        return replace(sliced, seq_lengths=(q_len, self.seq_lengths[1]), **dq_order.derived(self, sliced))

    def _rows_of_blocks(self, pick, n_blocks: int) -> int:
        """Q_LEN of a mask cut to the query blocks `pick` selects (a slice, or a tensor of block numbers): the rows
        of the blocks taken, the last block as short as it is here; a tensor index counts whole blocks, as
        PyTorch's BlockMask does."""
        q_len, bq = self.seq_lengths[0], self.BLOCK_SIZE[0]
        if isinstance(pick, torch.Tensor):
            return int(pick.sum()) * bq if pick.dtype == torch.bool else pick.numel() * bq
        return sum(max(0, min(bq, q_len - b * bq)) for b in range(n_blocks)[pick])

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def _map_tensors(self, fn) -> "BlockMask":
        """The same mask with `fn` applied to each of its index tensors."""
        f = lambda t: None if t is None else fn(t)  # noqa: E731
        return BlockMask(
            self.seq_lengths, f(self.kv_num_blocks), f(self.kv_indices), f(self.full_kv_num_blocks),
            f(self.full_kv_indices), f(self.q_num_blocks), f(self.q_indices), f(self.full_q_num_blocks),
            f(self.full_q_indices), self.BLOCK_SIZE, self.mask_mod, self.blocks_from,
        )

    def to(self, device) -> "BlockMask":
        """The same mask, every tensor it holds (the dQ metadata's too) on `device`."""
        return replace(self, **{name: getattr(self, name).to(device) for name in self._TENSOR_ATTRS
                                if getattr(self, name) is not None})

    def _adjust(self, new_q_len: int, new_kv_len: int) -> "BlockMask":
        """The mask of the first new_q_len queries and new_kv_len keys: PyTorch's BlockMask._adjust, with which a
        mask built for the longest sequence serves a shorter one (a decoding step over a partly filled cache)."""
        q_len, kv_len = self.seq_lengths
        if not (0 < int(new_q_len) <= q_len and 0 < int(new_kv_len) <= kv_len):
            raise ValueError(f"BlockMask._adjust: new lengths ({new_q_len}, {new_kv_len}) must be positive and at most "
                             f"the mask's ({q_len}, {kv_len}); build a new mask for longer sequences")
        bq, bkv = self.BLOCK_SIZE
        partial, full = self.block_states(-(-int(new_q_len) // bq), -(-int(new_kv_len) // bkv))
        dq_order.refuse_tensor_order(self, "Adjusting")
        adjusted = BlockMask.from_dense_blocks(full, partial, self.BLOCK_SIZE, (int(new_q_len), int(new_kv_len)),
                                               self.mask_mod)
        adjusted = replace(adjusted, **dq_order.derived(self, adjusted))
        return adjusted.derived_from_mask_mod() if self.blocks_follow_mask_mod else adjusted

    def for_batch_and_heads(self, b: int, h: int) -> "BlockMask":
        """The mask's first b batches and h heads where it has more: PyTorch's kernels read batch `b % B` and head
        `h % H` of a mask, so one made for a larger batch serves a smaller one (a decoding cache's mask made for its
        max_batch_size, sliced to a request's length by _adjust)."""
        mb, mh = self.kv_num_blocks.shape[0], self.kv_num_blocks.shape[1]
        if mb <= b and mh <= h:
            return self
        rows, heads = (b if mb > b else mb), (h if mh > h else mh)
        return self._map_tensors(lambda t: t[:rows, :heads])

    def _broadcast_to(self, b: int, h: int) -> "BlockMask":
        """The lists copied out to (b, h, ...), as PyTorch's create_block_mask gives them: code written for it views
        them flat per batch (PagedAttention's `kv_indices.view(B, -1)`), which a stride-0 view refuses. A mask
        made with B and H of None stays (1, 1, ...)."""
        if b == 1 and h == 1:
            return self
        return self._map_tensors(lambda t: t.expand(b, h, *t.shape[2:]).contiguous())

    def _dense(self, counts, indices) -> torch.Tensor:
        return lists_to_dense(counts, indices, self._kv_columns())

    def block_states(self, rows: int | None = None, cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(partial, full) as (B, H, nQ, nKV) booleans from the KV lists, over the first `rows` x `cols` blocks (all
        by default); full is all False where the mask lists no full blocks."""
        partial = self._dense(self.kv_num_blocks, self.kv_indices)[..., :rows, :cols]
        if self.full_kv_num_blocks is None:
            return partial, torch.zeros_like(partial)
        return partial, self._dense(self.full_kv_num_blocks, self.full_kv_indices)[..., :rows, :cols]

    def to_dense(self) -> torch.Tensor:
        """(B, H, nQ, nKV) int32: 1 where a block is visited (partial or full)."""
        dense = self._dense(self.kv_num_blocks, self.kv_indices)
        if self.full_kv_num_blocks is not None:
            dense = dense | self._dense(self.full_kv_num_blocks, self.full_kv_indices)
        return dense.to(torch.int32)

    def sparsity(self) -> float:
        """Percentage of blocks skipped entirely."""
        n_q, n_kv = self.kv_indices.shape[-2], self._kv_columns()
        q_len, kv_len = self.seq_lengths
        n_q, n_kv = min(n_q, -(-q_len // self.BLOCK_SIZE[0])), min(n_kv, -(-kv_len // self.BLOCK_SIZE[1]))
        dense = self.to_dense()[..., :n_q, :n_kv]
        return 100.0 * (1.0 - dense.sum().item() / max(dense.numel(), 1))

    def to_string(self, grid_size: int | tuple[int, int] = (20, 20), limit: int = 4) -> str:
        """PyTorch's picture of the visited blocks, per (batch, head): █ all visited, ░ some, blank none,
        each cell summarising up to grid_size blocks a side (-1: one cell per block); `limit` pictures."""
        dense = self.to_dense()
        *batch_dims, rows, cols = dense.shape
        if grid_size == -1:
            max_rows, max_cols = rows, cols
        else:
            max_rows, max_cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
        row_step, col_step = max(1, -(-rows // max(max_rows, 1))), max(1, -(-cols // max(max_cols, 1)))
        pictures = []
        for n, at in enumerate(itertools.product(*(range(d) for d in batch_dims))):
            if n == limit:
                pictures += ["...", "To print out more, set BlockMask.to_string(limit=N)",
                             "You can also index (BlockMask[batch, head]) to choose a specific batch or head"]
                break
            grid = dense[at].float()
            lines = [f"{at}"]
            for r in range(0, rows, row_step):
                cells = (grid[r : r + row_step, c : c + col_step].mean().item() for c in range(0, cols, col_step))
                lines.append("".join(2 * ("█" if v == 1 else " " if v == 0 else "░") for v in cells))
            pictures.append("\n".join(lines) + "\n")
        return "\n".join(pictures)

    def __str__(self) -> str:
        return f"BlockMask(shape={self.shape}, sparsity={self.sparsity():.2f}%, \n{self.to_string().strip()}\n)"

    def __repr__(self) -> str:
        *lead, q_len, kv_len = self.shape
        dims = "".join(f"{d}={n}, " for d, n in zip(("B", "H")[2 - len(lead):], lead))  # (a slice may drop B or H)
        name = getattr(self.mask_mod, "name", getattr(self.mask_mod, "__name__", "noop")) if self.mask_mod is not None else "noop"
        lines = [
            f"BlockMask(shape=({dims}Q_LEN={q_len}, KV_LEN={kv_len}), BLOCK_SIZE={self.BLOCK_SIZE}, "
            f"sparsity={self.sparsity():.2f}%, mask_mod={name})"
        ]
        dense = self.to_dense()
        if dense.shape[-2] <= 16 and dense.shape[-1] <= 32:
            full = (
                self._dense(self.full_kv_num_blocks, self.full_kv_indices)
                if self.full_kv_num_blocks is not None
                else torch.zeros_like(dense, dtype=torch.bool)
            )
            d, f = dense.reshape(-1, *dense.shape[-2:])[0], full.reshape(-1, *full.shape[-2:])[0]
            for row in range(d.shape[0]):
                lines.append("  " + "".join("█" if f[row, c] else ("░" if d[row, c] else "·") for c in range(d.shape[1])))
            lines.append("  (█ full, ░ partial: mask_mod applied, · skipped; first batch and head)")
        return "\n".join(lines)


# ---------------------------------------------------------------- classification


# The static analyses below depend on the mask's expression, its scalars and the shapes, not on what its buffers
# hold: a mask rebuilt at every training step over fresh document ids (the same function, a new tensor) is analysed
# once. Both answers are read, never written, by their callers.
_ANALYSED: dict[tuple, Any] = {}
_MAX_ANALYSED = 128


def _analysed(key: tuple, analyse):
    if torch.compiler.is_compiling():  # host code on host tensors: run, not traced (its guards recompile often)
        return torch.compiler.disable(analyse, reason="flexgen's mask analysis is host code")()
    hit = _ANALYSED.get(key)
    if hit is None:
        if len(_ANALYSED) >= _MAX_ANALYSED:
            _ANALYSED.clear()
        hit = _ANALYSED[key] = analyse()
    return hit


def _classify(mod: Mod, q_len, kv_len, bq, bkv, b_range, h_range) -> tuple[torch.Tensor, torch.Tensor]:
    """(full, partial) over (nQ, nKV) by static analysis; undecided tiles come back partial."""
    from .dsl.mask_analysis import classify_blocks

    def analyse():
        full, partial = classify_blocks(mod.expr, q_len, kv_len, bq, bkv, params=dict(mod.params), b_range=b_range,
                                        h_range=h_range)
        return full.cpu(), partial.cpu()

    key = ("classify", mod.expr.digest, tuple(sorted(mod.params.items())), q_len, kv_len, bq, bkv, b_range, h_range)
    return _analysed(key, analyse)


def _reads_in_range(mod: Mod, q_len, kv_len, b_range, h_range) -> bool:
    """mask_analysis.buffer_reads_in_range of the mask over its buffers' shapes."""
    from .dsl.mask_analysis import buffer_reads_in_range

    shapes = {n: tuple(t.shape) for n, t in mod.buffers.items()}
    key = ("in range", mod.expr.digest, tuple(sorted(mod.params.items())), tuple(sorted(shapes.items())), q_len,
           kv_len, b_range, h_range)
    return _analysed(key, lambda: buffer_reads_in_range(mod.expr, shapes, q_len, kv_len, b_range, h_range,
                                                        dict(mod.params)))


def _mixed_at_corners(mod: Mod, tiles: torch.Tensor, q_len, kv_len, bq, bkv, in_range: bool) -> torch.Tensor:
    """Tiles whose four corner elements already disagree (the diagonal tiles of a causal mask):
    they are partial, whatever the rest holds, and need no full evaluation."""
    t = tiles.int()
    b, h = t[:, 0, None, None], t[:, 1, None, None]
    q_lo, kv_lo = t[:, 2] * bq, t[:, 3] * bkv
    q = torch.stack([q_lo, torch.clamp(q_lo + bq, max=q_len) - 1], 1)[:, :, None]
    kv = torch.stack([kv_lo, torch.clamp(kv_lo + bkv, max=kv_len) - 1], 1)[:, None, :]
    values = mod.evaluate(float_dtype=torch.float32, check_ranges=not in_range, b=b, h=h, q_idx=q,
                          kv_idx=kv).expand(len(t), 2, 2).flatten(1)
    return values.any(1) & ~values.all(1)


def _refine(mod: Mod, partial: torch.Tensor, q_len, kv_len, bq, bkv, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluate mask_mod on the undecided tiles of every (b, h) at once, a chunk of tiles at a time: which are in
    fact full or empty. `partial` is the (nb, nh, nQ, nKV) host tensor of undecided tiles; returns (full, still
    partial) on `device`. On a GPU nothing here waits for it where the mask's buffer reads are proven in range
    (no value is read back): a training step that builds a fresh mask keeps the GPU's queue full."""
    tiles = partial.nonzero()  # rows (b, h, q block, kv block), on the host
    in_range = _reads_in_range(mod, q_len, kv_len, (0, partial.shape[0]), (0, partial.shape[1]))
    if device.type == "cpu":  # (on a GPU the compaction would read a count back; the mixed tiles are evaluated)
        tiles = tiles[~_mixed_at_corners(mod, tiles, q_len, kv_len, bq, bkv, in_range)]
    tiles = _to_device(tiles, device)
    is_full = torch.zeros(len(tiles), dtype=torch.bool, device=device)
    is_empty = torch.zeros(len(tiles), dtype=torch.bool, device=device)
    per_chunk = max(1, _EVAL_CHUNK_ELEMENTS // (bq * bkv))
    qr = torch.arange(bq, device=device, dtype=torch.int32)
    kr = torch.arange(bkv, device=device, dtype=torch.int32)
    for start in range(0, len(tiles), per_chunk):
        chunk = tiles[start : start + per_chunk].int()
        b, h = chunk[:, 0, None, None], chunk[:, 1, None, None]
        q = (chunk[:, 2, None] * bq + qr)[:, :, None]
        kv = (chunk[:, 3, None] * bkv + kr)[:, None, :]
        valid = (q < q_len) & (kv < kv_len)
        values = mod.evaluate(float_dtype=torch.float32, check_ranges=not in_range, b=b, h=h,
                              q_idx=q.clamp(max=q_len - 1), kv_idx=kv.clamp(max=kv_len - 1))
        values = values.expand(valid.shape)
        is_full[start : start + len(chunk)] = (values | ~valid).flatten(1).all(1)
        is_empty[start : start + len(chunk)] = ~(values & valid).flatten(1).any(1)
    full = torch.zeros(partial.shape, dtype=torch.bool, device=device)
    still = _to_device(partial, device).clone()
    idx = tiles.unbind(1)
    full[idx] = is_full
    still[idx] = ~(is_full | is_empty)
    return full, still


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory without waiting (the copy is ordered on the
    stream before the kernels that read it, and the pinned block is kept until it is done)."""
    if device.type != "cuda" or torch.compiler.is_compiling():  # (dynamo has no fake pin_memory)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def block_mask_of(mod: Mod | None, B: int, H: int, Q_LEN: int, KV_LEN: int, bq: int, bkv: int, device) -> BlockMask:
    """The block mask of a traced mask (None: no element mask), of batch and head size 1 where the mask does not
    read b or h (reads_batch_heads), else B and H."""
    device = torch.device(device)
    n_q, n_kv = -(-Q_LEN // bq), -(-KV_LEN // bkv)
    refined_full = None
    if mod is None:
        full = torch.ones(1, 1, n_q, n_kv, dtype=torch.bool)
        partial = torch.zeros_like(full)
    else:
        reads_b, reads_h = reads_batch_heads(mod)
        nb, nh = (B if reads_b else 1), (H if reads_h else 1)
        full = torch.zeros(nb, nh, n_q, n_kv, dtype=torch.bool)
        partial = torch.zeros_like(full)
        # When b and h reach the mask only through buffer indices (documents per batch row), one
        # analysis over all (b, h) decides what a per-(b, h) one would; the rest is evaluated per
        # (b, h) below either way. Masks whose structure depends on b or h (per-head windows) are
        # analysed per (b, h).
        from .dsl.ir import inputs_outside_loads

        shared = None if inputs_outside_loads(mod.expr) & {"b", "h"} else _classify(mod, Q_LEN, KV_LEN, bq, bkv, (0, nb), (0, nh))
        for b in range(nb):
            for h in range(nh):
                full[b, h], partial[b, h] = shared or _classify(mod, Q_LEN, KV_LEN, bq, bkv, (b, b + 1), (h, h + 1))
        if partial.any():  # (the rest on the device: _refine)
            refined_full, partial = _refine(mod, partial, Q_LEN, KV_LEN, bq, bkv, device)
    full = _to_device(full, device)
    if refined_full is not None:
        full |= refined_full
    else:
        partial = _to_device(partial, device)
    return BlockMask.from_dense_blocks(full, partial, (bq, bkv), (Q_LEN, KV_LEN), mod).derived_from_mask_mod()


def reads_batch_heads(mod: Mod | None) -> tuple[bool, bool]:
    """Whether the mask reads b, and h: where it does not, its lists are stored once and broadcast."""
    if mod is None:
        return False, False
    from .dsl.ir import inputs_of

    used = inputs_of(mod.expr)
    return "b" in used, "h" in used


def block_sparse_mask(layout: torch.Tensor, BLOCK_SIZE: int | tuple[int, int] = DEFAULT_BLOCK_SIZE, seq_lengths=None) -> BlockMask:
    """Block-sparse attention from a boolean (B or 1, H or 1, nQ, nKV) layout of blocks.

    Every listed block is attended in full (no element mask); the others are skipped.
    seq_lengths (Q_LEN, KV_LEN) defaults to whole blocks; given, it must need exactly nQ x nKV blocks.
    """
    where = "block_sparse_mask"
    if not isinstance(layout, torch.Tensor):
        raise TypeError(f"{where}: layout must be a boolean torch.Tensor of blocks, got {type(layout).__name__}")
    if layout.dtype != torch.bool:
        raise TypeError(f"{where}: layout must be a boolean tensor of blocks, got dtype {layout.dtype}")
    if layout.dim() == 2:
        layout = layout[None, None]
    if layout.dim() != 4 or 0 in layout.shape:
        raise ValueError(f"{where}: layout must have shape (B or 1, H or 1, nQ, nKV), none of them 0, got {tuple(layout.shape)}")
    bq, bkv = check.block_size(BLOCK_SIZE, where)
    n_q, n_kv = layout.shape[-2:]
    if seq_lengths is None:
        seq_lengths = (n_q * bq, n_kv * bkv)
    q_len, kv_len = check.seq_lengths(seq_lengths, where)
    if (-(-q_len // bq), -(-kv_len // bkv)) != (n_q, n_kv):
        raise ValueError(
            f"{where}: seq_lengths {(q_len, kv_len)} in blocks of {(bq, bkv)} need a layout of "
            f"{(-(-q_len // bq), -(-kv_len // bkv))} blocks, got {(n_q, n_kv)}"
        )
    return BlockMask.from_dense_blocks(layout, torch.zeros_like(layout), (bq, bkv), (q_len, kv_len), None)


def create_mask(mod_fn, B: int | None, H: int | None, Q_LEN: int, KV_LEN: int,
                device: str | torch.device | None = None) -> torch.Tensor:
    """The dense (B, H, Q_LEN, KV_LEN) boolean mask of a mask_mod, or of a score_mod (False
    where it gives -inf), as PyTorch's create_mask; evaluated with the IR's semantics, the
    kernels' own. Mods, plain functions (4 arguments: mask_mod, 5: score_mod) and text."""
    from .dsl import api as dsl_api

    device = default_device() if device is None else torch.device(device)
    B, H = B or 1, H or 1
    mod = mod_fn if isinstance(mod_fn, Mod) else getattr(dsl_api, f"{_mod_kind(mod_fn)}_mod")(mod_fn)
    b, h, q, kv = (torch.arange(n, device=device).view([-1 if d == i else 1 for d in range(4)])
                   for i, n in enumerate((B, H, Q_LEN, KV_LEN)))
    if mod.kind == "mask":
        values = mod.evaluate(float_dtype=torch.float32, b=b, h=h, q_idx=q, kv_idx=kv)
    else:
        score = torch.zeros((), dtype=torch.float32, device=device)
        values = ~torch.isneginf(mod.evaluate(float_dtype=torch.float32, score=score, b=b, h=h, q_idx=q, kv_idx=kv))
    return values.to(torch.bool).expand(B, H, Q_LEN, KV_LEN).contiguous()


def _mod_kind(fn) -> str:
    """"mask" or "score" by the number of arguments without defaults, as PyTorch decides."""
    if isinstance(fn, str):
        raise TypeError("create_mask: text has no arity; pass flexgen.mask_mod(text) or flexgen.score_mod(text)")
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) not in (4, 5):
        raise TypeError(f"create_mask: a mask_mod takes 4 arguments (b, h, q_idx, kv_idx) and a score_mod 5, "
                        f"{getattr(fn, '__name__', fn)!r} takes {len(params)}")
    return "mask" if len(params) == 4 else "score"


def _register_pytree() -> None:
    """BlockMask as a pytree node, under PyTorch's layout, so that pytree tools (tree_map, torch.export's input
    specs) see its index tensors as leaves."""
    from torch.utils import _pytree

    _pytree.register_pytree_node(BlockMask, BlockMask._flatten, BlockMask._unflatten,
                                 flatten_with_keys_fn=BlockMask._flatten_with_keys,
                                 serialized_type_name="flexgen.BlockMask")


_register_pytree()
