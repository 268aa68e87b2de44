"""Host-side tensors derived from a block mask (the sm90 kernels' work orders, coarsened masks), kept per count
tensor: the layers of a model share one mask, and each call rebuilds the BlockMask around the same tensors, so
each derived tensor is computed once per mask, not once per layer."""
from __future__ import annotations

import weakref

import torch

from .cuda_graphs import allocating_for_a_graph

_MAX_ENTRIES = 256
_entries: dict[tuple, tuple] = {}


def cached_per_mask(key: tuple, counts: torch.Tensor, full: torch.Tensor | None, make, also: tuple = ()):
    """make()'s result, kept under `key` while `counts` lives and neither count tensor changes in place; `also`:
    further tensors it derives from, which must be the same objects, unchanged in place, as well."""
    hit = _entries.get(key)
    if hit is not None and hit[0]() is counts and hit[1] == _versions(counts, full, also) and \
            all(ref() is t for ref, t in zip(hit[3], also)):
        return hit[2]
    made = make()
    if len(_entries) >= _MAX_ENTRIES:
        _entries.clear()
    _entries[key] = (weakref.ref(counts), _versions(counts, full, also), made, tuple(weakref.ref(t) for t in also))
    return made


def _versions(counts: torch.Tensor, full: torch.Tensor | None, also: tuple = ()) -> tuple[int, ...]:
    """In-place changes to the mask's tensors bump their versions and invalidate what was derived from them."""
    return counts._version, -1 if full is None else full._version, *(t._version for t in also)


def capturing(counts: torch.Tensor) -> bool:
    """Whether allocations belong to a CUDA graph now (cuda_graphs.py), when nothing is cached or handed out
    from the cache."""
    return counts.is_cuda and allocating_for_a_graph()
