"""Attention dropout: the keep mask the kernels draw, computed with torch ops, and the
run-time values (threshold, scale) they are given.

The kernels never store a mask: each element's keep decision is a pure function of
(seed, offset, b, h, q, kv, q_len, num_heads), computed by Philox4x32-7 in both the
forward and the backward (templates/common/philox.cuh says how the counter is laid out).
`dropout_keep_mask` here reproduces it bit for bit, for tests and for reference math.
"""
from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
DROPOUT_ROUNDS = 7  # common/philox.cuh's FLEXGEN_DROPOUT_ROUNDS: FlashAttention-2's count (docs/dropout.md)


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hi and lo 32-bit words of a * b (a, b < 2^32) without int64 overflow: b in 16-bit halves."""
    t = a * (b & 0xFFFF)  # < 2^48
    u = a * (b >> 16) + (t >> 16)  # = (a * b) >> 16, < 2^49
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32(counter: torch.Tensor, key: torch.Tensor, rounds: int = 10) -> torch.Tensor:
    """Philox4x32-R (Random123). counter (..., 4) and key (..., 2) hold uint32 values in int64
    tensors (broadcast against each other); returns (..., 4) int64 words in [0, 2^32)."""
    c = [counter[..., i].to(torch.int64) & _MASK32 for i in range(4)]
    k0, k1 = (key[..., i].to(torch.int64) & _MASK32 for i in range(2))
    for r in range(rounds):
        if r > 0:
            k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
        hi0, lo0 = _mulhilo(_M0, c[0])
        hi1, lo1 = _mulhilo(_M1, c[2])
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return torch.stack(torch.broadcast_tensors(*c), dim=-1)


def check_dropout_range(dropout_p) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"flex_attention: dropout_p must satisfy 0 <= dropout_p < 1, got {dropout_p}")


def check_dropout(dropout_p, philox) -> tuple[float, tuple[int, int] | None]:
    """Validated (p, (seed, offset)); philox is required (and only used) when p > 0."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"flex_attention: dropout_p must be a float, got {type(dropout_p).__name__}")
    p = float(dropout_p)
    check_dropout_range(p)
    if p == 0.0:
        return p, None
    if philox is None:
        raise ValueError("flex_attention: dropout_p > 0 needs philox=(seed, offset), the random stream to draw from")
    seed, offset = philox
    for name, x in (("seed", seed), ("offset", offset)):
        if not 0 <= int(x) < 2**64:
            raise ValueError(f"flex_attention: the Philox {name} must be in [0, 2^64), got {x}")
    return p, (int(seed), int(offset))


def dropout_threshold(p: float) -> int:
    """The kernels' threshold: an element is kept iff its 16-bit Philox half >= threshold (common/philox.cuh),
    probability 1 - threshold / 2^16; at most 2^16 - 1, so that some elements survive any p < 1."""
    return min(int(round(p * 2.0**16)), 2**16 - 1)


def dropout_scale(p: float) -> float:
    """What kept elements are multiplied by: the inverse of their exact keep probability, so that dropout leaves
    the expectation unchanged (p itself is honoured to 2^-17)."""
    return 2.0**16 / (2.0**16 - dropout_threshold(p))


def dropout_keep_mask(seed: int, offset: int, B: int, H: int, Q_LEN: int, KV_LEN: int, p: float,
                      device=None) -> torch.Tensor:
    """(B, H, Q_LEN, KV_LEN) bool: True where the kernels keep the element (H = query heads)."""
    quads, kv2 = (Q_LEN + 15) // 16 * 4, (KV_LEN + 1) // 2
    rows = torch.arange(B * H * quads, device=device, dtype=torch.int64).view(-1, 1)
    cols = torch.arange(kv2, device=device, dtype=torch.int64).view(1, -1)
    zero = torch.zeros((), device=device, dtype=torch.int64)
    counter = torch.stack(torch.broadcast_tensors(cols, rows & _MASK32, zero + (offset & _MASK32), zero + (offset >> 32)), -1)
    key = torch.tensor([seed & _MASK32, seed >> 32], device=device, dtype=torch.int64)
    words = philox4x32(counter, key, DROPOUT_ROUNDS).view(B * H, quads, kv2, 4)
    q = torch.arange(Q_LEN, device=device)
    quad, word = (q >> 4) * 4 + ((q >> 1) & 3), 2 * (q & 1) + ((q >> 3) & 1)
    words = words[:, quad].gather(-1, word.view(1, -1, 1, 1).expand(B * H, Q_LEN, kv2, 1)).squeeze(-1)
    halves = torch.stack((words & 0xFFFF, words >> 16), -1).view(B, H, Q_LEN, 2 * kv2)  # kv even, kv odd
    return halves[..., :KV_LEN] >= dropout_threshold(p)
