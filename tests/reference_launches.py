"""The kernels swapped for the float64 reference on the CPU, at the three places calls reach them: forward_call and
backward_call (unplanned calls), and the launches a planned eager call makes (flexgen/eager_plans.py)."""
from __future__ import annotations

import torch

import flexgen


def reference_forward(q, k, v, score, bm, mask, scale, kernel_options, **_):
    out, lse = flexgen.reference_attention(q, k, v, score_mod=score, mask_mod=mask, scale=scale, return_lse=True)
    return out.to(q.dtype), lse


def reference_backward(q, k, v, out, lse, grad_out, score, bm, mask, scale, kernel_options, needs, grad_buffers=(),
                        grad_lse=None, **_):
    """float64 autograd of (out, lse) with the gradients the op received, on another thread (autograd is off
    inside an op's kernel, thread-locally)."""
    from concurrent.futures import ThreadPoolExecutor

    def run():
        with torch.enable_grad():
            x = [t.detach().double().requires_grad_() for t in (q, k, v)]
            o, l_ = flexgen.reference_attention(*x, score_mod=score, mask_mod=mask, scale=scale, return_lse=True)
            outs, grads = [o], [grad_out.double()]
            if grad_lse is not None:
                outs.append(l_)
                grads.append(grad_lse.double())
            g = torch.autograd.grad(outs, x, grads)
        return g[0].to(q.dtype), g[1].to(q.dtype), g[2].to(q.dtype), {}

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


class ReferenceLaunch:
    """A planned launch (runtime/forward.ForwardLaunch, runtime/backward.BackwardLaunch) that runs the float64
    reference instead of the kernels."""

    def __init__(self, make, run):
        self.args, self.run_reference = make, run

    def run(self, *tensors, **_):
        return self.run_reference(*tensors, *self.args)


def reference_launches(monkeypatch) -> list[str]:
    """forward.prepare_forward and backward.prepare_backward swapped for ReferenceLaunch makers; returns the list
    of what they made ("fwd", "bwd"), in order."""
    from flexgen.runtime import backward, forward

    made = []

    def prepare_forward(q, k, v, score, bm, mask, scale, kernel_options, dropout_p=0.0, max_scores=False):
        made.append("fwd")
        return ReferenceLaunch((score, bm, mask, scale, kernel_options),
                               lambda q, k, v, *a: (*reference_forward(q, k, v, *a), None))

    def prepare_backward(q, k, v, out, grad_out, score, bm, mask, scale, kernel_options, needs, grad_buffers=(),
                         dropout_p=0.0):
        made.append("bwd")
        return ReferenceLaunch((), lambda q, k, v, out, lse, do, dlse=None: reference_backward(
            q, k, v, out, lse, do, score, bm, mask, scale, kernel_options, needs, grad_lse=dlse))

    monkeypatch.setattr(forward, "prepare_forward", prepare_forward)
    monkeypatch.setattr(backward, "prepare_backward", prepare_backward)
    return made
