"""Differentiable flex_attention: the forward kernel saves (out, lse); the backward recomputes P.

score_mod buffers that require grad (a learnable ALiBi slope table, a relative-bias table)
are passed to the autograd.Function as extra inputs, after the fixed ones, so their
gradients reach `.grad` like any other input's; the backward kernel accumulates them (fp32).
"""
from __future__ import annotations

import torch

from .attention import forward_call

_FIXED_INPUTS = 9  # query, key, value, score, bm, mask, scale, kernel_options, grad_buffer_names


class _FlexAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, score, bm, mask, scale, kernel_options, grad_buffer_names, *grad_buffer_tensors):
        out, lse = forward_call(query, key, value, score, bm, mask, scale, kernel_options)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.extra = (score, bm, mask, scale, kernel_options, grad_buffer_names)
        ctx.buffer_dtypes = tuple(t.dtype for t in grad_buffer_tensors)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        from .runtime.backward import backward_call

        query, key, value, out, lse = ctx.saved_tensors
        score, bm, mask, scale, kernel_options, names = ctx.extra
        wanted = tuple(n for n, need in zip(names, ctx.needs_input_grad[_FIXED_INPUTS:]) if need)
        dq, dk, dv, buffer_grads = backward_call(
            query, key, value, out, lse, grad_out, score, bm, mask, scale, kernel_options, ctx.needs_input_grad[:3],
            grad_buffers=wanted,
        )
        extra = tuple(
            buffer_grads[n].to(dt) if n in buffer_grads else None for n, dt in zip(names, ctx.buffer_dtypes)
        )
        return (dq, dk, dv) + (None,) * (_FIXED_INPUTS - 3) + extra


def _learnable_buffers(score) -> dict:
    """score_mod buffers that require grad (float tensors only can)."""
    if score is None:
        return {}
    return {name: t for name, t in score.buffers.items() if isinstance(t, torch.Tensor) and t.requires_grad}


def attention_with_grad(query, key, value, score, bm, mask, scale, kernel_options):
    grad_buffers = _learnable_buffers(score) if torch.is_grad_enabled() else {}
    needs_grad = torch.is_grad_enabled() and (any(t.requires_grad for t in (query, key, value)) or bool(grad_buffers))
    if not needs_grad:
        return forward_call(query, key, value, score, bm, mask, scale, kernel_options)
    return _FlexAttentionFunction.apply(
        query, key, value, score, bm, mask, scale, kernel_options, tuple(grad_buffers), *grad_buffers.values()
    )
