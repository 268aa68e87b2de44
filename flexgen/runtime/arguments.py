"""What a launch hands the kernels besides its spec: tensors the kernels can read as they are, and the
variant's buffers and scalar parameters (its ModArgs)."""
from __future__ import annotations

import weakref

import torch

from ..cuda_graphs import allocating_for_a_graph
from ..dsl.mod import Mod


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether the kernels (and the copy engine) can address t's rows: last dim contiguous, other strides and the
    base 16-byte aligned."""
    size = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """t, or an aligned copy where the kernels cannot read its rows (rows_aligned)."""
    # A fresh copy, not t.contiguous(): a contiguous view at a misaligned offset would come back as it is.
    return t if rows_aligned(t) else t.clone(memory_format=torch.contiguous_format)


# Device copies of captured buffers that live elsewhere (e.g. a variant built on the CPU),
# refreshed when the source tensor is modified in place (its version counter moves).
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys themselves.
_device_copies: dict[int, tuple] = {}


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    hit = _device_copies.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == device:
        return hit[3]
    copy = t.detach().to(device)
    if device.type == "cuda" and allocating_for_a_graph():  # (kept, it would outlive the graph's own memory)
        return copy
    key = id(t)
    _device_copies[key] = (weakref.ref(t, lambda _: _device_copies.pop(key, None)), t._version, device, copy)
    return copy


def mod_arguments(score: Mod | None, mask: Mod | None, device: torch.device) -> tuple[dict, dict]:
    """Buffers (on `device`) and scalar parameters of the variant, keyed by their IR names."""
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    return {n: on_device(t, device) for n, t in buffers.items()}, params
