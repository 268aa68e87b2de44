"""Plain float64 attention with FlexAttention semantics: the ground truth kernels are tested against.

    score  = (q @ k^T) * scale                        scale defaults to 1/sqrt(head_dim)
    score  = score_mod(score, b, h, q_idx, kv_idx)    h is the *query* head
    score  = -inf where mask_mod(b, h, q_idx, kv_idx) is False
    out    = softmax(score, over kv) @ v              a fully masked row gives 0, never NaN
    lse    = logsumexp(score, over kv)                natural log; -inf on a fully masked row

score_mod / mask_mod mean what they mean to the kernels: a function of one score and one
(b, h, q_idx, kv_idx), with int32 indices whose arithmetic wraps around. A plain callable is
traced to the IR (flexgen.dsl.api), exactly as flex_attention traces it, and the IR is evaluated
(flexgen.dsl.evaluate), so the ground truth and the kernel cannot disagree on what a function
means (a mod that indexes a captured tensor and then indexes the result, say). A callable the
tracer refuses is evaluated the way PyTorch's FlexAttention does it, through torch.vmap over
b, h, q_idx and kv_idx, one element at a time in meaning. Scores are float64; a mask's float
arithmetic is float32, as in the kernels and in create_block_mask.

With `block_mask` (a flexgen or PyTorch BlockMask), a position is visible where its block is
listed as full, or listed as partial and its mask_mod (the block mask's) holds there; unlisted
blocks are skipped: FlexAttention's semantics, computed densely. The softmax subtracts the row
maximum, so it is exact for scores of any size. The work is chunked over query rows, heads and batch
rows so that one score chunk holds about 2**24 elements. The computation is differentiable by torch
autograd, so it also gives reference gradients; past 2**26 scores the backward recomputes each chunk rather than
keeping it.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .errors import FlexgenTraceError, ReturnTypeError, SignatureError
from .mod import Mod

CHUNK_ELEMENTS = 1 << 24
RECOMPUTE_ABOVE = 1 << 26  # scores of a call past which its chunks are recomputed in the backward (below)
_INDEX_DTYPE = torch.int32
_SKIP, _PARTIAL, _FULL = 0, 1, 2  # a block's state in a block mask


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_mod: Mod | Callable | None = None,
    mask_mod: Mod | Callable | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    block_mask=None,
):
    """Attention of q (B, Hq, Lq, D) over k (B, Hkv, Lkv, D) and v (B, Hkv, Lkv, Dv).

    Returns out (B, Hq, Lq, Dv) in q.dtype, and with return_lse also lse (B, Hq, Lq), in
    float64 for float64 inputs and float32 otherwise. With enable_gqa, query head h reads kv
    head h // (Hq // Hkv). `block_mask` replaces mask_mod (it carries its own)."""
    out, lse, _ = reference_outputs(q, k, v, score_mod, mask_mod, scale, enable_gqa, block_mask)
    return (out, lse) if return_lse else out


def reference_outputs(q, k, v, score_mod=None, mask_mod=None, scale=None, enable_gqa=False, block_mask=None):
    """(out, lse, max_scores) of reference_attention: max_scores is each row's maximum of the modded, scaled
    scores that take part (-inf where none does), without a gradient, in lse's dtype."""
    B, Hq, Lq, D, Hkv, Lkv, Dv = _check_shapes(q, k, v, enable_gqa)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    layout = None
    if block_mask is not None:
        if mask_mod is not None:
            raise ValueError("pass either mask_mod or block_mask (whose mask_mod applies inside its partial blocks), not both")
        from ..blockmask import BlockMask

        block_mask = BlockMask.from_torch(block_mask).for_batch_and_heads(B, Hq)
        layout = _block_layout(block_mask, B, Hq, Lq, Lkv, q.device)
        mask_mod = block_mask.mask_mod
    score_fn = _as_score_fn(score_mod)
    mask_fn = _as_mask_fn(mask_mod)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    device = q.device
    if B * Hq * Lq == 0 or Lkv == 0:
        none = torch.full((B, Hq, Lq), -math.inf, dtype=lse_dtype, device=device)
        return q.new_zeros(B, Hq, Lq, Dv), none, none.clone()
    group = Hq // Hkv
    rows = max(1, min(Lq, CHUNK_ELEMENTS // Lkv))
    heads = max(1, min(Hq, CHUNK_ELEMENTS // (rows * Lkv)))
    # Several batch rows per chunk where a whole (heads, rows) slab is small (many short sequences): a chunk per
    # batch row would make B tiny chunks, each paying Python and, under autograd, its own saved tensors.
    batches = max(1, min(B, CHUNK_ELEMENTS // (Hq * Lq * Lkv))) if (heads, rows) == (Hq, Lq) else 1
    kv_idx = torch.arange(Lkv, dtype=_INDEX_DTYPE, device=device)
    # Under autograd a chunk keeps about 18 bytes per score for the backward (its scores, probabilities, mask):
    # 36 GB for a float32 sequence of 8k at B * H = 32 on a GPU. Past RECOMPUTE_ABOVE scores, each chunk keeps only
    # its inputs and is computed again in the backward, chunk by chunk (about 1.5x the time). torch.func's
    # transforms (the compiled unfused path's backward) take no saved-tensor hooks: there the chunks are kept.
    recompute = (torch.is_grad_enabled() and B * Hq * Lq * Lkv > RECOMPUTE_ABOVE
                 and torch._C._functorch.peek_interpreter_stack() is None)

    outs, lses, maxes = [], [], []
    for b0 in range(0, B, batches):
        b_idx = torch.arange(b0, min(b0 + batches, B), dtype=_INDEX_DTYPE, device=device)
        kb, vb = k[b0 : b0 + len(b_idx)].to(torch.float64), v[b0 : b0 + len(b_idx)].to(torch.float64)
        out_b, lse_b, max_b = [], [], []
        for h0 in range(0, Hq, heads):
            h_idx = torch.arange(h0, min(h0 + heads, Hq), dtype=_INDEX_DTYPE, device=device)
            kv_head = (h_idx // group).long()
            kh, vh = kb[:, kv_head], vb[:, kv_head]  # (batches, heads, Lkv, D), (batches, heads, Lkv, Dv)
            out_h, lse_h, max_h = [], [], []
            for q0 in range(0, Lq, rows):
                q_idx = torch.arange(q0, min(q0 + rows, Lq), dtype=_INDEX_DTYPE, device=device)
                qc = q[b0 : b0 + len(b_idx), h0 : h0 + len(h_idx), q0 : q0 + len(q_idx)].to(torch.float64)
                idx = (b_idx, h_idx, q_idx, kv_idx)
                if recompute:
                    o, l, m = checkpoint(_chunk, qc, kh, vh, idx, scale, score_fn, mask_fn, layout, use_reentrant=False)
                else:
                    o, l, m = _chunk(qc, kh, vh, idx, scale, score_fn, mask_fn, layout)
                out_h.append(o)
                lse_h.append(l)
                max_h.append(m)
            out_b.append(torch.cat(out_h, dim=2))
            lse_b.append(torch.cat(lse_h, dim=2))
            max_b.append(torch.cat(max_h, dim=2))
        outs.append(torch.cat(out_b, dim=1))
        lses.append(torch.cat(lse_b, dim=1))
        maxes.append(torch.cat(max_b, dim=1))
    out = torch.cat(outs, dim=0).to(q.dtype)
    return out, torch.cat(lses, dim=0).to(lse_dtype), torch.cat(maxes, dim=0).to(lse_dtype)


def _chunk(qc, kh, vh, idx, scale, score_fn, mask_fn, layout):
    """(out, lse, row max) of one chunk: queries qc (batches, heads, rows, D) against keys kh and values vh of
    those heads, at positions idx = (b, h, q_idx, kv_idx)."""
    score = qc @ kh.transpose(-1, -2) * scale  # (batches, heads, rows, Lkv)
    if score_fn is not None:
        score = _full_shape(score_fn(score, *idx), torch.float64, score.shape)
    return _softmax_rows(score, _visible(idx, mask_fn, layout, score.shape), vh)


def _full_shape(value, dtype, shape) -> torch.Tensor:
    return torch.broadcast_to(torch.as_tensor(value).to(dtype), shape)


def _visible(idx, mask_fn, layout, shape):
    """Bool (batches, heads, rows, Lkv): which scores of the chunk take part, or None for all of them."""
    keep = None if mask_fn is None else _full_shape(mask_fn(*idx), torch.bool, shape)
    if layout is None:
        return keep
    states, (bq, bkv) = layout
    b, h, qi, ki = idx
    per_b = states[b.long()] if states.shape[0] > 1 else states  # (batches or 1, H or 1, blocks_q, blocks_kv)
    per_h = per_b[:, h.long()] if per_b.shape[1] > 1 else per_b
    state = per_h[:, :, (qi // bq).long()][:, :, :, (ki // bkv).long()]  # (batches or 1, heads or 1, rows, Lkv)
    visible = state == _FULL
    partial = state == _PARTIAL
    return torch.broadcast_to(visible | (partial if keep is None else partial & keep), shape)


def _softmax_rows(score, keep, vh):
    """Output, lse and row maximum for one (batches, heads, rows, Lkv) chunk of scores: the row maximum comes
    off first, so exp() never overflows and huge scores still normalise (sum of p, not 1 + ulps)."""
    if keep is not None:
        score = score.masked_fill(~keep, -math.inf)
    row_max = score.amax(dim=-1, keepdim=True).detach()  # the result does not depend on it
    top = torch.where(row_max == -math.inf, torch.zeros_like(row_max), row_max)  # fully masked rows: p = 0
    p = torch.exp(score - top)
    total = p.sum(dim=-1, keepdim=True)
    empty = total == 0
    out = (p @ vh) / torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, -math.inf, top + torch.log(torch.where(empty, torch.ones_like(total), total)))
    return out, lse.squeeze(-1), row_max.squeeze(-1)


# ---------------------------------------------------------------- what the mods mean


def _as_score_fn(score_mod):
    """(score, b, h, q_idx, kv_idx) with 1-D index vectors -> scores of shape (b, h, q, kv)."""
    if score_mod is None:
        return None
    mod, refusal = _traced(score_mod, "score")
    if mod is None:
        return _vmapped(score_mod, refusal, with_score=True)
    return lambda s, b, h, qi, ki: mod.evaluate(torch.float64, score=s, **_grid(b, h, qi, ki))


def _as_mask_fn(mask_mod):
    """(b, h, q_idx, kv_idx) with 1-D index vectors -> bools of shape (b, h, q, kv)."""
    if mask_mod is None:
        return None
    mod, refusal = _traced(mask_mod, "mask")
    if mod is None:
        return _vmapped(mask_mod, refusal, with_score=False)
    if mod.is_noop:
        return None
    return lambda b, h, qi, ki: mod.evaluate(torch.float32, **_grid(b, h, qi, ki))


def _grid(b, h, qi, ki) -> dict[str, torch.Tensor]:
    """1-D index vectors as broadcastable (b, h, q, kv) grids, as evaluate() takes them."""
    return {"b": b[:, None, None, None], "h": h[None, :, None, None],
            "q_idx": qi[None, None, :, None], "kv_idx": ki[None, None, None, :]}


def _traced(fn, kind: str) -> tuple[Mod | None, str]:
    """`fn` as a Mod (traced as flex_attention traces it), or (None, why) where the tracer cannot take it."""
    if isinstance(fn, Mod):
        if fn.kind != kind:
            raise ValueError(f"{kind}_mod must be a {kind} Mod, got a {fn.kind} Mod ({fn.name!r})")
        return fn, ""
    if hasattr(fn, "kv_indices") and hasattr(fn, "BLOCK_SIZE"):
        raise TypeError(f"{kind}_mod is a BlockMask; pass it as block_mask=")
    if not callable(fn):
        raise TypeError(f"{kind}_mod must be a Mod or a callable, got {type(fn).__name__}")
    from .api import mask_mod, score_mod  # api imports this package's tracer, which imports mod

    try:
        return (score_mod(fn) if kind == "score" else mask_mod(fn)), ""
    except (SignatureError, ReturnTypeError):
        raise  # the function is wrong, not merely beyond the tracer
    except FlexgenTraceError as refused:
        return None, refused.detail


def _vmapped(fn, refusal: str, with_score: bool):
    """`fn` applied per element, as PyTorch's FlexAttention does it: vmap over kv_idx, then
    q_idx, h and b (and the score along with them)."""
    mapped = fn
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        mapped = torch.vmap(mapped, in_dims=((0,) if with_score else ()) + dims)

    def run(*args):
        try:
            return mapped(*args)
        except Exception as e:
            e.add_note(f"(flexgen's tracer could not take this function either: {refusal})")
            raise

    return run


# ---------------------------------------------------------------- block masks


def _block_layout(bm, B: int, Hq: int, Lq: int, Lkv: int, device) -> tuple[torch.Tensor, tuple[int, int]]:
    """(states, BLOCK_SIZE): states (B or 1, H or 1, q blocks, kv blocks) holds _SKIP, _PARTIAL or
    _FULL for each block (a block listed as both is full)."""
    if tuple(bm.seq_lengths) != (Lq, Lkv):
        raise ValueError(
            f"the block mask was built for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)} but the inputs have ({Lq}, {Lkv})"
        )
    bq, bkv = bm.BLOCK_SIZE
    counts, indices = bm.kv_num_blocks, bm.kv_indices
    nq, cols = indices.shape[-2:]
    if nq * bq < Lq or cols * bkv < Lkv:
        raise ValueError(
            f"block mask of {nq} x {cols} blocks of {bq} x {bkv} does not cover Q_LEN={Lq}, KV_LEN={Lkv}"
        )
    partial = _dense_blocks(counts.to(device), indices.to(device), cols, B, Hq)
    full = torch.zeros_like(partial)
    if bm.full_kv_num_blocks is not None:
        full = _dense_blocks(bm.full_kv_num_blocks.to(device), bm.full_kv_indices.to(device), cols, B, Hq)
    partial, full = torch.broadcast_tensors(partial, full)
    states = torch.where(full, _FULL, torch.where(partial, _PARTIAL, _SKIP)).to(torch.int8)
    return states[:, :, : -(-Lq // bq), : -(-Lkv // bkv)], (bq, bkv)


def _dense_blocks(counts: torch.Tensor, indices: torch.Tensor, cols: int, B: int, Hq: int) -> torch.Tensor:
    """(B or 1, H or 1, q blocks, cols) bools from per-row counts and block indices, checked."""
    from ..blockmask import lists_to_dense

    if indices.dim() != 4 or counts.shape != indices.shape[:-1]:
        raise ValueError(
            f"block mask indices must be (B, H, q blocks, kv blocks) and counts (B, H, q blocks); "
            f"got {tuple(indices.shape)} and {tuple(counts.shape)}"
        )
    mb, mh = indices.shape[:2]
    if mb not in (1, B) or mh not in (1, Hq):
        raise ValueError(f"block mask has B={mb}, H={mh}; each must be 1 or match the query's B={B}, H={Hq}")
    slots = indices.shape[-1]
    if bool((counts < 0).any()) or bool((counts > slots).any()):
        raise ValueError(f"block mask lists block counts outside [0, {slots}] (the length of a row of its indices)")
    return lists_to_dense(counts, indices, cols)  # (blocks outside the sequence hold no keys: left out)


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
