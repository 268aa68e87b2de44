"""PyTorch's deterministic-dQ metadata on a BlockMask (torch 2.13 and newer): carried, checked and recomputed as
PyTorch's BlockMask does, for code that builds or reads it; flexgen's kernels do not read it (their deterministic
backward fixes the order of dQ's sums by itself).

`dq_write_order` / `dq_write_order_full` rank, for each KV block's list of query blocks, the order in which a
scheduler writes dQ; `dq_kv_order` is an explicit scheduler order (a tensor), `dq_kv_order_spt` a built-in one (a
bool). The ranks come from PyTorch's own `_compute_dq_write_order_from_block_mask`, where the installed torch has
it; a torch without it has no backend that reads them, and a mask then carries none.
"""
from __future__ import annotations

from typing import Any

import torch

FIELDS = ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt")


def check(dq_write_order: Any, dq_write_order_full: Any, dq_kv_order: Any, dq_kv_order_spt: Any, where: str) -> None:
    """PyTorch's rules, with its messages (ValueError)."""
    if dq_write_order_full is not None and dq_write_order is None:
        raise ValueError("dq_write_order_full requires dq_write_order")
    for name, value in (("dq_write_order", dq_write_order), ("dq_write_order_full", dq_write_order_full),
                        ("dq_kv_order", dq_kv_order)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a Tensor or None, got {type(value).__name__}")
    if dq_kv_order_spt is not None and not isinstance(dq_kv_order_spt, bool):
        raise ValueError(f"{where}: dq_kv_order_spt must be a bool or None, got {dq_kv_order_spt!r}")


def split_order(dq_kv_order: Any) -> tuple[torch.Tensor | None, bool | None]:
    """from_kv_blocks' dq_kv_order (a tensor, a bool or None) as (tensor order, built-in order)."""
    if dq_kv_order is not None and not isinstance(dq_kv_order, (bool, torch.Tensor)):
        raise ValueError("dq_kv_order must be a bool, Tensor, or None")
    return (dq_kv_order if isinstance(dq_kv_order, torch.Tensor) else None,
            dq_kv_order if isinstance(dq_kv_order, bool) else None)


def _torch_ranks():
    from torch.nn.attention import flex_attention as torch_flex

    return getattr(torch_flex, "_compute_dq_write_order_from_block_mask", None)


def computed(mask, spt: bool | None) -> dict[str, Any]:
    """The metadata fields of `mask` ranked in the built-in order `spt` (True: descending), by PyTorch's function
    (it reads the mask's lists only); without it, none."""
    ranks = _torch_ranks()
    if ranks is None:
        return {}
    order, order_full = ranks(mask, dq_kv_order=spt)
    return {"dq_write_order": order, "dq_write_order_full": order_full, "dq_kv_order_spt": spt}


def refuse_tensor_order(mask, what: str) -> None:
    """PyTorch's refusal to slice or adjust (`what`) a mask whose metadata was ranked in an explicit tensor order,
    which cannot be derived for the result."""
    if mask.dq_kv_order is not None:
        raise NotImplementedError(
            f"{what} BlockMask with tensor dq_kv_order is not supported yet. Construct a new BlockMask with "
            "matching precomputed dq_write_order metadata.")


def derived(old, new) -> dict[str, Any]:
    """The metadata of `new`, a slice or an adjustment of `old` (refuse_tensor_order passed), as PyTorch derives
    it: recomputed from `new`'s lists in `old`'s built-in order."""
    if old.dq_write_order is None:
        return {"dq_kv_order_spt": old.dq_kv_order_spt}
    return computed(new, old.dq_kv_order_spt) or {"dq_kv_order_spt": old.dq_kv_order_spt}
