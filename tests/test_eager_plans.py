"""Planned eager calls (flexgen/eager_plans.py), on the CPU with the kernels swapped for the float64 reference
(tests/reference_launches.py): a call with a known signature runs its plan, and everything that changes what the
whole path would compute makes a new plan instead. tests/test_gpu_eager_plans.py runs the same through the kernels."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import flexgen
from flexgen import eager_plans, ops
from reference_launches import reference_backward, reference_forward, reference_launches

B, H, L, D = 1, 2, 128, 64


@pytest.fixture
def made(monkeypatch):
    """CPU tensors take the eager route, whose launches run the reference; the list of launches planned."""
    from flexgen import attention
    from flexgen.runtime import backward, forward

    monkeypatch.setattr(ops, "eager_route_ok", lambda *a: True)
    monkeypatch.setattr(attention, "unfused_reason", lambda *a: None)
    monkeypatch.setattr(forward, "forward_call", reference_forward)  # (unplanned calls)
    monkeypatch.setattr(backward, "backward_call", reference_backward)
    return reference_launches(monkeypatch)


def qkv(requires_grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.bfloat16).requires_grad_(requires_grad) for _ in range(3)]


def expected(q, k, v, score_mod=None, mask_mod=None):
    return flexgen.reference_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod).to(q.dtype)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_a_repeated_call_is_planned_once_and_computes_each_time(made):
    mask = flexgen.create_block_mask(causal, None, None, L, L, device="cpu")
    for seed in range(3):  # fresh inputs of the same layout: the plan, with these tensors
        q, k, v = qkv(seed=seed)
        out = flexgen.flex_attention(q, k, v, block_mask=mask)
        torch.testing.assert_close(out, expected(q, k, v, mask_mod=causal), rtol=2e-2, atol=2e-2)
    assert made == ["fwd"] and len(eager_plans._plans) == 1


def test_what_the_whole_path_reads_makes_a_new_plan(made):
    q, k, v = qkv()
    mask = flexgen.create_block_mask(causal, None, None, L, L, device="cpu")
    flexgen.flex_attention(q, k, v, block_mask=mask)
    other_mask = flexgen.create_block_mask(lambda b, h, qi, ki: qi >= ki + 8, None, None, L, L, device="cpu")
    out = flexgen.flex_attention(q, k, v, block_mask=other_mask)
    torch.testing.assert_close(out, expected(q, k, v, mask_mod=other_mask.mask_mod), rtol=2e-2, atol=2e-2)
    flexgen.flex_attention(q, k, v, block_mask=mask, scale=0.5)
    flexgen.flex_attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, block_mask=mask)  # other strides
    flexgen.flex_attention(q.float().to(torch.float16), k.to(torch.float16), v.to(torch.float16), block_mask=mask)
    flexgen.flex_attention(q, k, v, block_mask=mask, return_aux=flexgen.AuxRequest(lse=True))
    flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options={"BLOCK_M": 128})
    assert made == ["fwd"] * 7
    flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options={"BLOCK_M": 128})
    flexgen.flex_attention(q, k, v, block_mask=mask)
    assert made == ["fwd"] * 7


def test_a_closure_rebound_to_another_tensor_is_planned_again(made):
    q, k, v = qkv()
    bias = torch.zeros(L)

    def key_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx]

    flexgen.flex_attention(q, k, v, score_mod=key_bias)
    bias = torch.randn(L) * 4  # read by key_bias through its closure
    out = flexgen.flex_attention(q, k, v, score_mod=key_bias)
    want = flexgen.reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias.double()[ki]).to(q.dtype)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(out, expected(q, k, v), rtol=2e-2, atol=2e-2)
    assert made == ["fwd", "fwd"]


def test_a_mask_changed_in_place_is_planned_again(made):
    q, k, v = qkv()
    mask = flexgen.create_block_mask(causal, None, None, L, L, device="cpu")
    flexgen.flex_attention(q, k, v, block_mask=mask)
    mask.kv_num_blocks.add_(0)  # any in-place write bumps the version (paged attention updates masks so)
    flexgen.flex_attention(q, k, v, block_mask=mask)
    assert made == ["fwd", "fwd"]


def test_grad_mode_and_requires_grad_are_part_of_the_plan(made):
    q, k, v = qkv(requires_grad=True)
    with torch.no_grad():
        flexgen.flex_attention(q, k, v)
    out = flexgen.flex_attention(q, k, v)
    assert out.requires_grad
    out.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flexgen.flex_attention(q, k, v).sum().backward()  # the plan, and its backward, again
    assert made == ["fwd", "fwd", "bwd"]
    for t, g in zip((q, k, v), grads):
        torch.testing.assert_close(t.grad, g)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    flexgen.reference_attention(*x64).sum().backward()
    for t, x in zip((q, k, v), x64):
        torch.testing.assert_close(t.grad.double(), x.grad, rtol=5e-2, atol=5e-2)


def test_another_grad_out_layout_gets_its_own_backward(made):
    q, k, v = qkv(requires_grad=True)
    flexgen.flex_attention(q, k, v).sum().backward()  # grad_out: ones expanded, strides 0
    flexgen.flex_attention(q, k, v).backward(torch.randn(B, H, L, D, dtype=torch.bfloat16))
    flexgen.flex_attention(q, k, v).sum().backward()
    assert made == ["fwd", "bwd", "bwd"]


def test_a_buffer_that_starts_needing_a_gradient_is_planned_again(made):
    q, k, v = qkv(requires_grad=True)
    slopes = torch.rand(H)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    flexgen.flex_attention(q, k, v, score_mod=alibi)
    slopes.requires_grad_()
    flexgen.flex_attention(q, k, v, score_mod=alibi)
    assert made == ["fwd", "fwd"]


def test_calls_that_are_never_planned(made):
    q, k, v = qkv()
    assert eager_plans.signature(q, k, v, None, None, -0.5, False, False, None, None, None) is None
    assert eager_plans.signature(q, k, v, None, None, None, False, False, None, 0.1, None) is None
    assert eager_plans.signature(q, k, v, None, None, None, False, False, {"x": [1]}, None, None) is None
    assert eager_plans.signature(q, k, v, None, None, None, False, False, {"BLOCK_M": 64}, None, None) is not None
    flexgen.flex_attention(q, k, v, scale=-0.5)  # the sign moves onto the query: the whole path each time
    assert made == [] and not eager_plans._plans


def test_a_plan_neither_outlives_nor_keeps_alive_its_mask_and_score_mod(made):
    q, k, v = qkv()
    mask = flexgen.create_block_mask(causal, None, None, L, L, device="cpu")

    def softcap(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    flexgen.flex_attention(q, k, v, score_mod=softcap, block_mask=mask)
    assert len(eager_plans._plans) == 1
    mask_ref, mod_ref = weakref.ref(mask), weakref.ref(softcap)
    del mask, softcap
    gc.collect()
    assert mask_ref() is None and mod_ref() is None
    assert not eager_plans._plans


def test_the_least_recently_used_plans_go_first(made, monkeypatch):
    monkeypatch.setattr(eager_plans, "MAX_PLANS", 2)
    q, k, v = qkv()
    for scale in (0.1, 0.2, 0.3):
        flexgen.flex_attention(q, k, v, scale=scale)
    assert len(eager_plans._plans) == 2
    flexgen.flex_attention(q, k, v, scale=0.1)  # dropped: planned again
    flexgen.flex_attention(q, k, v, scale=0.3)  # kept
    assert made == ["fwd"] * 4


def test_pytorchs_empty_block_mask_is_planned_by_the_mask_the_caller_holds(made):
    """flex_attention replaces PyTorch's empty mask (one block for any length) before planning: the plan follows
    the caller's object, not the replacement."""
    from torch.nn.attention.flex_attention import _create_empty_block_mask

    q, k, v = qkv()
    empty = _create_empty_block_mask(q, k)
    for _ in range(2):
        out = flexgen.flex_attention(q, k, v, block_mask=empty)
        torch.testing.assert_close(out, expected(q, k, v), rtol=2e-2, atol=2e-2)
    assert made == ["fwd"]


GLOBAL_BIAS = torch.zeros(L)


def global_key_bias(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_BIAS[kv_idx]


def test_a_module_global_rebound_to_another_tensor_is_traced_again(made, monkeypatch):
    """A score_mod that reads a module global sees the tensor the global holds at the call, as PyTorch's does."""
    q, k, v = qkv()
    flexgen.flex_attention(q, k, v, score_mod=global_key_bias)
    monkeypatch.setitem(globals(), "GLOBAL_BIAS", torch.randn(L) * 4)
    out = flexgen.flex_attention(q, k, v, score_mod=global_key_bias)
    assert made == ["fwd", "fwd"]
    bias = GLOBAL_BIAS.to(torch.float64)
    want = flexgen.reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki]).to(q.dtype)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert not torch.allclose(out, expected(q, k, v), rtol=2e-2, atol=2e-2)


class _KeyBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.zeros(L)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.bias[kv_idx]


def test_a_tensor_reached_through_an_attribute_or_a_container_is_followed(made):
    """A bound method whose owner's attribute is rebound, and a closure over a dict whose entry is replaced: the
    signature (the function, its owner, its closure cells) is the same, the buffer the mod reads is not."""
    q, k, v = qkv()
    owner = _KeyBias()
    flexgen.flex_attention(q, k, v, score_mod=owner.score_mod)
    flexgen.flex_attention(q, k, v, score_mod=owner.score_mod)  # a new bound method each time: the same plan
    owner.bias = torch.randn(L) * 4
    out = flexgen.flex_attention(q, k, v, score_mod=owner.score_mod)
    bias = owner.bias.double()
    want = flexgen.reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki]).to(q.dtype)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert made == ["fwd", "fwd"]

    held = {"bias": torch.zeros(L)}

    def from_dict(score, b, h, q_idx, kv_idx):
        return score + held["bias"][kv_idx]

    flexgen.flex_attention(q, k, v, score_mod=from_dict)
    held["bias"] = torch.randn(L) * 4
    out = flexgen.flex_attention(q, k, v, score_mod=from_dict)
    bias = held["bias"].double()
    want = flexgen.reference_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[ki]).to(q.dtype)
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert made == ["fwd"] * 4


def _gym_cases():
    from test_gym_functions import MASKS, SCORES

    return ([("mask", name, fn, shape) for name, (fn, shape) in sorted(MASKS.items())]
            + [("score", name, fn, shape) for name, (fn, shape) in sorted(SCORES.items())])


@pytest.mark.parametrize("kind,name,fn,shape", _gym_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_attention_gym_mods_are_planned_once_and_served(made, kind, name, fn, shape):
    """Every attention-gym mask and score_mod of tests/test_gym_functions.py: the second call runs the first one's
    plan (its signature hashes, its buffers are found again), with the reference's result both times."""
    from test_gym_functions import B as GB, H as GH

    q_len = kv_len = shape.get("q_len", 64)
    g = torch.Generator().manual_seed(7)
    mask = flexgen.create_block_mask(fn, GB, GH, q_len, kv_len, device="cpu") if kind == "mask" else None
    score = fn if kind == "score" else None
    for _ in range(2):
        q, k, v = (torch.randn(GB, GH, q_len, D, generator=g, dtype=torch.bfloat16) for _ in range(3))
        out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=mask)
        want = flexgen.reference_attention(q, k, v, score_mod=score, mask_mod=fn if kind == "mask" else None)
        assert not torch.isnan(out).any()
        torch.testing.assert_close(out, want.to(q.dtype), rtol=2e-2, atol=2e-2)
    assert made == ["fwd"], f"{name}: planned {len(made)} times"
