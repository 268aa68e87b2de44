"""The attention scores the GPU tests' PyTorch baselines share (tests/test_gpu_*.py).

Each test measures flexgen's error against PyTorch's own low-precision math on the same inputs;
these are the first steps of that math, every op in q's dtype, as eager code would run them.
"""
from __future__ import annotations

import torch


def index_grids(B: int, H: int, Lq: int, Lkv: int, device) -> tuple[torch.Tensor, ...]:
    """b, h, q_idx, kv_idx as broadcastable (B,1,1,1) ... (1,1,1,Lkv) index tensors."""
    return tuple(torch.arange(n, device=device).view([n if i == d else 1 for i in range(4)])
                 for d, n in enumerate((B, H, Lq, Lkv)))


def masked_scores(q, k, v, score, mask, scale):
    """(S, V): S = score_mod(q k^T * scale), -inf where mask_mod hides, shape (B, Hq, Lq, Lkv);
    K and V repeated over a GQA group (V comes back repeated like K)."""
    B, Hq, Lq, _ = q.shape
    group = Hq // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    Lkv = k.shape[2]
    b, h, qi, ki = index_grids(B, Hq, Lq, Lkv, q.device)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if score is not None:
        s = torch.as_tensor(score(s, b, h, qi, ki)).to(q.dtype).expand(B, Hq, Lq, Lkv)
    if mask is not None:
        visible = torch.as_tensor(mask(b, h, qi, ki)).to(torch.bool).expand(B, Hq, Lq, Lkv)
        s = s.masked_fill(~visible, float("-inf"))
    return s, v
