"""flex_attention called from several threads at once: the trace cache, the plans, the block-mask caches and the
unfused path's own state are shared by the threads, and each thread's results must still be its own. (On the CPU:
the unfused float64 path, checked against a dense float64 computation.)"""
from __future__ import annotations

import math

import pytest
import torch

import flexgen
from at_once import at_once


def _dense(q, k, v, cap, window):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = cap * torch.tanh(s / cap)
    rows, cols = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
    s = s.masked_fill(~((rows >= cols) & (rows - cols < window)), -math.inf)
    return torch.softmax(s, -1) @ v


# (the unfused path says it runs; warnings.catch_warnings would change the process's filters from eight threads)
@pytest.mark.filterwarnings("ignore:.*unfused float64 path")
def test_threads_calling_at_once_each_get_their_own_variant():
    calls = 3

    def worker(i: int):
        cap, window = 5.0 + i, 16 + 8 * i  # (each thread its own variant: its own trace, plan and mask)
        score = lambda s, b, h, q, kv: cap * torch.tanh(s / cap)  # noqa: E731
        mask = lambda b, h, q, kv: (q >= kv) & (q - kv < window)  # noqa: E731
        gen = torch.Generator().manual_seed(1000 + i)
        bm = flexgen.create_block_mask(mask, None, None, 96, 96)
        for _ in range(calls):
            q, k, v = (torch.randn(1, 2, 96, 32, generator=gen, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
            out.sum().backward()
            ref = _dense(q.detach(), k.detach(), v.detach(), cap, window)
            torch.testing.assert_close(out.detach(), ref, rtol=1e-10, atol=1e-10)
            grads = torch.autograd.grad(_dense(q, k, v, cap, window).sum(), (q, k, v))
            for got, want in zip((q.grad, k.grad, v.grad), grads):
                torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)

    at_once(worker, 8)  # (a thread's failure is raised here, with its index)
