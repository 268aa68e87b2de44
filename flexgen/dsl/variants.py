"""Built-in variants, each an ordinary Mod (composable with and_masks / or_masks).

Lengths, caps and offsets are run-time parameters, and tables are buffers, so
`sliding_window(128)` and `sliding_window(4096)` share one structural hash and
one compiled kernel.
"""
from __future__ import annotations

import torch

from .api import mask_mod, score_mod
from .mod import Mod

causal = mask_mod("q_idx >= kv_idx", name="causal")


def _check_length(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be non-negative, got {value}")
    return value


def sliding_window(window: int) -> Mod:
    """Causal, and at most `window - 1` positions back: 0 <= q_idx - kv_idx < window."""
    return mask_mod(
        "q_idx >= kv_idx and q_idx - kv_idx < window",
        window=_check_length("window", window), name="sliding_window",
    )


def prefix_lm(prefix_length: int) -> Mod:
    """Causal, except that the first `prefix_length` keys are visible to every query."""
    return mask_mod(
        "q_idx >= kv_idx or kv_idx < prefix_length",
        prefix_length=_check_length("prefix_length", prefix_length), name="prefix_lm",
    )


def document(doc_ids: torch.Tensor, causal: bool = True) -> Mod:
    """Packed sequences: a query sees keys of its own document (and, by default, only earlier ones).
    `doc_ids[i]` is the document of position i (1-D integer tensor of length seq_len)."""
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 1:
        raise ValueError("doc_ids must be a 1-D tensor with one document id per position")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"doc_ids must hold integers, got {doc_ids.dtype}")
    text = "doc_ids[q_idx] == doc_ids[kv_idx]" + (" and q_idx >= kv_idx" if causal else "")
    return mask_mod(text, doc_ids=doc_ids, name="document_causal" if causal else "document")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes 2^(-8 (h+1) / H), float32."""
    heads = torch.arange(1, _check_length("num_heads", num_heads) + 1, dtype=torch.float64)
    return torch.exp2(-8.0 * heads / num_heads).to(torch.float32)


def alibi(num_heads_or_slopes: int | torch.Tensor) -> Mod:
    """score + slope[h] * (kv_idx - q_idx); slopes from the head count, or given (one per head)."""
    if isinstance(num_heads_or_slopes, torch.Tensor):
        slopes = num_heads_or_slopes
        if slopes.dim() != 1 or not slopes.dtype.is_floating_point:
            raise ValueError("ALiBi slopes must be a 1-D float tensor with one slope per head")
    else:
        slopes = alibi_slopes(num_heads_or_slopes)
    return score_mod("score + alibi_slopes[h] * (kv_idx - q_idx)", alibi_slopes=slopes, name="alibi")


def softcap(cap: float) -> Mod:
    """Gemma-2 / Grok logit soft-capping: cap * tanh(score / cap)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
        raise ValueError(f"softcap cap must be a positive number, got {cap!r}")
    return score_mod("cap * tanh(score / cap)", cap=float(cap), name="softcap")


def relative_bias(table: torch.Tensor) -> Mod:
    """score + table[h, q_idx - kv_idx + center], center = table.shape[-1] // 2.

    `table` has shape (num_heads, 2 * max_len - 1): column `center + d` holds the bias for
    q_idx - kv_idx == d. The center is a run-time parameter, so tables of any width share a kernel.
    """
    if not isinstance(table, torch.Tensor) or table.dim() != 2:
        raise ValueError("the relative-bias table must be a 2-D tensor of shape (num_heads, 2 * max_len - 1)")
    return score_mod(
        "score + rel_bias[h, q_idx - kv_idx + rel_bias_center]",
        rel_bias=table, rel_bias_center=table.shape[-1] // 2, name="relative_bias",
    )
