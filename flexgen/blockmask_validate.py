"""Checks of what a user hands to BlockMask constructors, before any kernel reads it.

The kernels index KV tiles with the listed block numbers and trust the counts, so a
negative block index or a count past a row's length would read outside the tensors.
"""
from __future__ import annotations

import operator

import torch

# The kernels' tiles are multiples of 16 rows: they walk blocks that hold whole tiles. A block mask may have blocks
# of any size (PyTorch's take any); flex_attention runs blocks of other sizes on its unfused path.
KERNEL_BLOCK_MULTIPLE = 16


def as_int(value) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def block_size(BLOCK_SIZE, where: str, multiple: int = 1) -> tuple[int, int]:
    """(Q, KV) block sizes: an int, or a pair of ints, each positive (and a multiple of `multiple`)."""
    pair = (BLOCK_SIZE, BLOCK_SIZE) if not isinstance(BLOCK_SIZE, (tuple, list)) else tuple(BLOCK_SIZE)
    sizes = tuple(as_int(v) for v in pair) if len(pair) == 2 else (None,)
    if any(s is None or s <= 0 or s % multiple for s in sizes):
        what = "a positive int" if multiple == 1 else f"a positive multiple of {multiple}"
        raise ValueError(
            f"{where}: BLOCK_SIZE must be {what} (an int, or a (Q, KV) pair), got {BLOCK_SIZE!r}; 128 is the "
            f"default and what the kernels' tiles divide"
        )
    return sizes


def seq_lengths(lengths, where: str) -> tuple[int, int]:
    pair = tuple(lengths) if isinstance(lengths, (tuple, list)) else (lengths,)
    values = tuple(as_int(v) for v in pair) if len(pair) == 2 else (None,)
    if any(v is None or v <= 0 for v in values):
        raise ValueError(f"{where}: seq_lengths must be a (Q_LEN, KV_LEN) pair of positive ints, got {lengths!r}")
    return values


def index_tensor(t, name: str, where: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{where}: {name} must be a torch.Tensor of integers, got {type(t).__name__}; "
            f"wrap it: torch.tensor(..., dtype=torch.int32)"
        )
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"{where}: {name} must hold integers (torch.int32), got dtype {t.dtype}")
    return t


def block_lists(counts, indices, n_kv_blocks: int, prefix: str, where: str,
                values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Check one (counts, indices) pair, (..., nQ) and (..., nQ, width); return them as int32.

    Each row lists counts[row] distinct KV blocks in [0, n_kv_blocks); slots past the count are unused.
    values=False checks shapes, dtypes and devices only (traced lists hold no values)."""
    counts = index_tensor(counts, f"{prefix}_num_blocks", where)
    indices = index_tensor(indices, f"{prefix}_indices", where)
    if not 2 <= indices.dim() <= 4:
        raise ValueError(
            f"{where}: {prefix}_indices must have shape (B, H, nQ, nKV) (B and H may be left out), "
            f"got {tuple(indices.shape)}"
        )
    if tuple(counts.shape) != tuple(indices.shape[:-1]):
        raise ValueError(
            f"{where}: {prefix}_num_blocks has shape {tuple(counts.shape)} but {prefix}_indices has "
            f"{tuple(indices.shape)}; the counts' shape must be the indices' shape without its last dimension"
        )
    if counts.device != indices.device:
        raise ValueError(f"{where}: {prefix}_num_blocks is on {counts.device} but {prefix}_indices on {indices.device}")
    if values:  # (traced lists hold none: a boolean index of them would not even have a size)
        _check_values(counts, indices, n_kv_blocks, prefix, where)
    while indices.dim() < 4:  # (nQ, nKV) or (H, nQ, nKV): B and H of size 1 broadcast
        counts, indices = counts.unsqueeze(0), indices.unsqueeze(0)
    return counts.to(torch.int32), indices.to(torch.int32)


def _check_values(counts, indices, n_kv_blocks: int, prefix: str, where: str) -> None:
    """Counts within a row's width, listed blocks within the sequence."""
    width = indices.shape[-1]
    if counts.numel():
        low, high = int(counts.min()), int(counts.max())
        if low < 0 or high > width:
            raise ValueError(
                f"{where}: {prefix}_num_blocks must lie in [0, {width}] (the length of a row of {prefix}_indices), "
                f"got values from {low} to {high}"
            )
    used = indices[torch.arange(width, device=indices.device) < counts.unsqueeze(-1)]
    if used.numel():
        low, high = int(used.min()), int(used.max())
        if low < 0 or high >= n_kv_blocks:
            raise ValueError(
                f"{where}: {prefix}_indices lists KV block {low if low < 0 else high}; block numbers must lie in "
                f"[0, {n_kv_blocks}) (the KV blocks of the sequence, at most one per column of {prefix}_indices)"
            )


def no_repeats(counts: torch.Tensor, dense: torch.Tensor, prefix: str, where: str) -> None:
    """A block listed twice in a row would be attended twice."""
    repeated = dense.sum(-1, dtype=torch.int32) != counts
    if repeated.any():
        row = tuple(repeated.nonzero()[0].tolist())
        raise ValueError(f"{where}: {prefix}_indices lists a KV block more than once in row {row} (B, H, query block)")


def disjoint(partial: torch.Tensor, full: torch.Tensor, where: str) -> None:
    both = partial & full
    if both.any():
        at = tuple(both.nonzero()[0].tolist())
        raise ValueError(
            f"{where}: block {at} (B, H, query block, KV block) is listed in both kv_indices and full_kv_indices; "
            f"a block is either partial (mask_mod applied) or full"
        )
