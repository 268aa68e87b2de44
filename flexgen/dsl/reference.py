"""Plain float64 attention with FlexAttention semantics: the ground truth kernels are tested against.

    score  = (q @ k^T) * scale                        scale defaults to 1/sqrt(head_dim)
    score  = score_mod(score, b, h, q_idx, kv_idx)    h is the *query* head
    score  = -inf where mask_mod(b, h, q_idx, kv_idx) is False
    out    = softmax(score, over kv) @ v              a fully masked row gives 0, never NaN
    lse    = logsumexp(score, over kv)                natural log; -inf on a fully masked row

score_mod / mask_mod are `Mod`s (evaluated in float64) or plain callables. Callables
get broadcastable int32 index tensors, the way FlexAttention passes them:
b[:, None, None, None], h[None, :, None, None], q_idx[None, None, :, None],
kv_idx[None, None, None, :], and a float64 score of shape (1, heads, q, kv) for
the current chunk. The work is chunked over query rows and heads so that one
score chunk holds about 2**24 elements. The computation is differentiable by
torch autograd, so it also gives reference gradients.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .mod import Mod

CHUNK_ELEMENTS = 1 << 24
_INDEX_DTYPE = torch.int32


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Mod | Callable | None = None,
    mask_mod: Mod | Callable | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
):
    """Attention of q (B, Hq, Lq, D) over k (B, Hkv, Lkv, D) and v (B, Hkv, Lkv, Dv).

    Returns out (B, Hq, Lq, Dv) in q.dtype, and with return_lse also lse (B, Hq, Lq)
    in float32. With enable_gqa, query head h reads kv head h // (Hq // Hkv)."""
    B, Hq, Lq, D, Hkv, Lkv, Dv = _check_shapes(q, k, v, enable_gqa)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    score_fn = _as_score_fn(score_mod)
    mask_fn = _as_mask_fn(mask_mod)
    group = Hq // Hkv
    rows = max(1, min(Lq, CHUNK_ELEMENTS // max(Lkv, 1)))
    heads = max(1, min(Hq, CHUNK_ELEMENTS // (rows * max(Lkv, 1))))
    device = q.device
    if B * Hq * Lq == 0:
        out = q.new_zeros(B, Hq, Lq, Dv)
        return (out, torch.zeros(B, Hq, Lq, dtype=torch.float32, device=device)) if return_lse else out
    kv_idx = torch.arange(Lkv, dtype=_INDEX_DTYPE, device=device)[None, None, None, :]

    outs, lses = [], []
    for b in range(B):
        kb, vb = k[b].to(torch.float64), v[b].to(torch.float64)
        b_idx = torch.full((1, 1, 1, 1), b, dtype=_INDEX_DTYPE, device=device)
        out_b, lse_b = [], []
        for h0 in range(0, Hq, heads):
            h1 = min(h0 + heads, Hq)
            h_idx = torch.arange(h0, h1, dtype=_INDEX_DTYPE, device=device)
            kv_head = (h_idx // group).long()
            kh, vh = kb[kv_head], vb[kv_head]  # (heads, Lkv, D), (heads, Lkv, Dv)
            out_h, lse_h = [], []
            for q0 in range(0, Lq, rows):
                q1 = min(q0 + rows, Lq)
                q_idx = torch.arange(q0, q1, dtype=_INDEX_DTYPE, device=device)[None, None, :, None]
                qc = q[b, h0:h1, q0:q1].to(torch.float64)
                score = (qc @ kh.transpose(-1, -2) * scale)[None]  # (1, heads, rows, Lkv)
                idx = (b_idx, h_idx[None, :, None, None], q_idx, kv_idx)
                o, l = _softmax_rows(score, vh, idx, score_fn, mask_fn)
                out_h.append(o)
                lse_h.append(l)
            out_b.append(torch.cat(out_h, dim=2))
            lse_b.append(torch.cat(lse_h, dim=2))
        outs.append(torch.cat(out_b, dim=1))
        lses.append(torch.cat(lse_b, dim=1))
    out = torch.cat(outs, dim=0).to(q.dtype)
    if return_lse:
        return out, torch.cat(lses, dim=0).to(torch.float32)
    return out


def _softmax_rows(score, vh, idx, score_fn, mask_fn):
    """Output and lse for one (1, heads, rows, Lkv) chunk of scores."""
    if score_fn is not None:
        score = torch.broadcast_to(torch.as_tensor(score_fn(score, *idx), device=score.device).to(torch.float64), score.shape)
    if mask_fn is not None:
        keep = torch.broadcast_to(torch.as_tensor(mask_fn(*idx), device=score.device).to(torch.bool), score.shape)
        score = score.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(score, dim=-1)  # -inf where the whole row is masked
    # a fully masked row would be exp(-inf - -inf) = NaN; shifting it by 0 makes it 0
    shift = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    p = torch.exp(score - shift[..., None])
    return p @ vh[None], lse


def _as_score_fn(score_mod):
    if score_mod is None:
        return None
    if isinstance(score_mod, Mod):
        if score_mod.kind != "score":
            raise ValueError(f"score_mod must be a score Mod, got a {score_mod.kind} Mod ({score_mod.name!r})")
        return lambda s, b, h, qi, ki: score_mod.evaluate(torch.float64, score=s, b=b, h=h, q_idx=qi, kv_idx=ki)
    if not callable(score_mod):
        raise TypeError(f"score_mod must be a Mod or a callable, got {type(score_mod).__name__}")
    return score_mod


def _as_mask_fn(mask_mod):
    if mask_mod is None:
        return None
    if isinstance(mask_mod, Mod):
        if mask_mod.kind != "mask":
            raise ValueError(f"mask_mod must be a mask Mod, got a {mask_mod.kind} Mod ({mask_mod.name!r})")
        return lambda b, h, qi, ki: mask_mod.evaluate(torch.float64, b=b, h=h, q_idx=qi, kv_idx=ki)
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a Mod or a callable, got {type(mask_mod).__name__}")
    return mask_mod


def _check_shapes(q, k, v, enable_gqa):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, length, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q, k and v must be on one device; {name} is on {t.device}, q on {q.device}")
    B, Hq, Lq, D = q.shape
    _, Hkv, Lkv, Dk = k.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if v.shape[1] != Hkv or v.shape[2] != Lkv:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in heads and length")
    if Dk != D:
        raise ValueError(f"q and k head dims differ: {D} vs {Dk}")
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    if Hq != Hkv and not enable_gqa:
        raise ValueError(f"q has {Hq} heads but k/v have {Hkv}; pass enable_gqa=True for grouped-query attention")
    return B, Hq, Lq, D, Hkv, Lkv, v.shape[3]
