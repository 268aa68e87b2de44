"""flex_attention's eager route (ops._EagerAttention: the ops' forward and backward without the
dispatcher) is taken only where the ops have nothing to add, and computes what the ops compute."""
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import flexgen
from flexgen import eager_plans, ops


def _qkv(device, requires_grad=False):
    return [torch.randn(1, 2, 96, 64, device=device, dtype=torch.float16, requires_grad=requires_grad) for _ in range(3)]


def test_eager_route_refuses_what_needs_the_ops():
    q, k, v = _qkv("meta")
    assert not ops.eager_route_ok(q, k, v, [])  # meta and fake tensors: the ops' fake kernels

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    cpu = _qkv("cpu")
    assert not ops.eager_route_ok(*cpu, [])  # not CUDA
    if torch.cuda.is_available():
        cuda = _qkv("cuda")
        assert ops.eager_route_ok(*cuda, [])
        with Passthrough():
            assert not ops.eager_route_ok(*cuda, [])
        with Dispatch():
            assert not ops.eager_route_ok(*cuda, [])


@pytest.mark.gpu
@pytest.mark.parametrize("use_lse", [False, True])
def test_eager_route_matches_the_ops(monkeypatch, use_lse):
    """Same kernels either way: outputs and (deterministic-mode) gradients bit for bit, with a learnable
    score_mod buffer and a block mask."""
    torch.manual_seed(torch.randint(0, 2**31, ()).item())
    bias = torch.randn(2, device="cuda", requires_grad=True)
    score_mod = lambda s, b, h, qi, kv: s + bias[h] * 0.1  # noqa: E731
    mask = flexgen.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 200, 200, device="cuda")
    base = [torch.randn(2, 2, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    grad = torch.randn_like(base[0])
    options = {"deterministic": True}

    def run():
        q, k, v = (t.clone().requires_grad_() for t in base)
        bias.grad = None
        out, lse = flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, return_lse=True,
                                          kernel_options=options)
        loss = (out * grad).sum() + (lse.square().sum() if use_lse else 0)
        loss.backward()
        return out.detach(), lse.detach(), q.grad, k.grad, v.grad, bias.grad.clone()

    planned = [run(), run()]  # planned (flexgen/eager_plans.py), then the plan run again
    assert len(eager_plans._plans) == 1
    taken = []
    real = ops.attention_eager
    monkeypatch.setattr(ops, "attention_eager", lambda *a: taken.append(1) or real(*a))
    monkeypatch.setattr(eager_plans, "signature", lambda *a: None)
    eager = run()
    assert taken, "the eager route was not taken"
    monkeypatch.setattr(ops, "eager_route_ok", lambda *a: False)
    through_ops = run()
    assert len(taken) == 1
    for got in (*planned, eager):
        for a, b in zip(got, through_ops):
            assert not torch.isnan(a).any()
            assert torch.equal(a, b)
