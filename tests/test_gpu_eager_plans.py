"""Planned eager calls (flexgen/eager_plans.py) through the kernels: the second and later calls of a signature run
its plan (the launches prepared by the first), with fresh inputs each time, and everything the plan must follow
(a closure rebound to another tensor, a mask changed in place, another layout of the output gradient, a CUDA
graph) gives what the whole path gives. Same bar as tests/test_gpu_edges.py: the error against float64 at most
twice PyTorch's own low-precision error; outputs poisoned before each call."""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen import eager_plans
from flexgen.dsl.reference import reference_outputs
from test_gpu_edges import DEV, check, fresh_seed, leaves, poison

gpu = pytest.mark.gpu


def _document_mask(ids):
    return lambda b, h, q_idx, kv_idx: (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)


def _variants(L: int):
    ids = torch.randint(0, 4, (L,), device=DEV).sort().values
    slopes = torch.exp2(-torch.arange(1, 5, device=DEV, dtype=torch.float32))
    return {
        "none": (None, None),
        "causal": (None, flexgen.variants.causal),
        "softcap_causal": (lambda s, b, h, q, kv: 20 * torch.tanh(s / 20), flexgen.variants.causal),
        "alibi_causal": (lambda s, b, h, q, kv: s + slopes[h] * (kv - q), flexgen.variants.causal),
        "sliding": (None, lambda b, h, q, kv: (q >= kv) & (q - kv < 100)),
        "document": (None, _document_mask(ids)),
    }


@gpu
@pytest.mark.parametrize("name", ["none", "causal", "softcap_causal", "alibi_causal", "sliding", "document"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_planned_call_computes_fresh_inputs_each_time(name, head_dim, dtype):
    seed = fresh_seed()
    L = 333
    score, mask = _variants(L)[name]
    bm = flexgen.create_block_mask(mask, None, None, L, L, device=DEV) if mask is not None else None
    for step in range(3):
        q, k, v = leaves(*(torch.randn(2, 4, L, head_dim, device=DEV, dtype=dtype) for _ in range(3)))
        check(q, k, v, score, mask, (1.0, 0.3, 0.05), block_mask=bm,
              tag=f"{name} D={head_dim} {dtype} call {step} (seed {seed})")
    assert len(eager_plans._plans) == 1


@gpu
def test_layouts_gqa_shared_kv_and_max_scores_through_a_plan():
    """Inputs in (B, L, H, D) memory order, GQA with a key / value batch of 1, and max_scores, twice each."""
    seed = fresh_seed()
    B, Hq, Hkv, L, D = 3, 8, 2, 300, 64
    mask = flexgen.variants.causal
    bm = flexgen.create_block_mask(mask, None, None, L, L, device=DEV)
    for step in range(2):
        q = torch.randn(B, L, Hq, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k, v = leaves(*(torch.randn(1, Hkv, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(2)))
        check(q, k, v, None, mask, (1.0, 0.0, 0.0), gqa=True, block_mask=bm, tag=f"BLHD GQA call {step} (seed {seed})")
        with torch.no_grad():
            poison(q[..., 0].float())
            out, aux = flexgen.flex_attention(q, k, v, block_mask=bm, enable_gqa=True,
                                              return_aux=flexgen.AuxRequest(lse=True, max_scores=True))
            ref = reference_outputs(*(t.double() for t in (q, k.expand(B, -1, -1, -1), v.expand(B, -1, -1, -1))),
                                    mask_mod=mask, enable_gqa=True)[2]
        assert out.stride() == q.stride() and not torch.isnan(aux.max_scores).any()
        torch.testing.assert_close(aux.max_scores.double(), ref, rtol=2e-2, atol=2e-2)


@gpu
def test_a_plan_follows_a_rebound_closure_and_a_mask_changed_in_place():
    seed = fresh_seed()
    L, D = 256, 64
    ids = torch.zeros(L, dtype=torch.int64, device=DEV)
    ids[128:] = 1

    def bias(s, b, h, q_idx, kv_idx):
        return s + table[h]

    table = torch.zeros(4, device=DEV)
    mask_mod = _document_mask(ids)
    bm = flexgen.create_block_mask(mask_mod, None, None, L, L, device=DEV)
    q, k, v = (torch.randn(1, 4, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))

    def expect(mod, mask):
        return flexgen.reference_attention(q.double(), k.double(), v.double(), score_mod=mod, mask_mod=mask)

    with torch.no_grad():
        first = flexgen.flex_attention(q, k, v, score_mod=bias, block_mask=bm)
        torch.testing.assert_close(first.double(), expect(bias, mask_mod), rtol=2e-2, atol=2e-2)
        table = torch.randn(4, device=DEV) * 3  # a new tensor behind the same name
        poison(q)
        second = flexgen.flex_attention(q, k, v, score_mod=bias, block_mask=bm)
        torch.testing.assert_close(second.double(), expect(bias, mask_mod), rtol=2e-2, atol=2e-2)
        ids[64:] += 2  # the documents move: the mask's tensors are rewritten in place
        moved = flexgen.create_block_mask(mask_mod, None, None, L, L, device=DEV)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                     "q_indices", "full_q_num_blocks", "full_q_indices"):
            getattr(bm, name).copy_(getattr(moved, name))
        poison(q)
        third = flexgen.flex_attention(q, k, v, score_mod=bias, block_mask=bm)
        assert not torch.isnan(third).any(), f"seed {seed}"
        torch.testing.assert_close(third.double(), expect(bias, mask_mod), rtol=2e-2, atol=2e-2)


@gpu
def test_another_layout_of_the_output_gradient_gets_its_own_backward():
    seed = fresh_seed()
    q, k, v = leaves(*(torch.randn(2, 4, 200, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3)))
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, 200, 200, device=DEV)
    grads = []
    for do in (torch.ones(2, 4, 200, 128, device=DEV, dtype=torch.bfloat16),
               torch.ones((), device=DEV, dtype=torch.bfloat16).expand(2, 4, 200, 128),  # strides 0, as sum()'s
               torch.ones(2, 200, 4, 128, device=DEV, dtype=torch.bfloat16).transpose(1, 2)):
        for t in (q, k, v):
            t.grad = None
        flexgen.flex_attention(q, k, v, block_mask=bm).backward(do)
        grads.append([t.grad.clone() for t in (q, k, v)])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert not torch.isnan(b).any(), f"seed {seed}"
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # same gradient, any layout: the same sums


@gpu
def test_a_planned_call_in_a_cuda_graph():
    seed = fresh_seed()
    L, D = 512, 64
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, L, L, device=DEV)
    q, k, v = (torch.randn(2, 4, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        flexgen.flex_attention(q, k, v, block_mask=bm)  # planned outside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flexgen.flex_attention(q, k, v, block_mask=bm)
        for _ in range(2):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            graph.replay()
            torch.cuda.synchronize()
            ref = flexgen.reference_attention(q.double(), k.double(), v.double(), mask_mod=flexgen.variants.causal)
            assert not torch.isnan(out).any(), f"seed {seed}"
            torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@gpu
# (not PyTorch's causal mask: a PyTorch mask without buffers is compared with its mask_mod once per mask, on the host)
@pytest.mark.parametrize("builder, name", [("flexgen", "document"), ("torch", "document"), ("flexgen", "causal")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_step_with_a_fresh_mask_never_waits_for_the_gpu(builder, name, head_dim):
    """Packed documents change at every training step: building the mask, the forward and the backward must queue
    their work without reading anything back, or the GPU idles while the host catches up. Each step runs under
    torch's sync debug mode set to raise; its forward is then checked against float64 (a second run over the same
    mask, bitwise equal to the step's)."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    seed = fresh_seed()
    B, H, L = 2, 4, 1000
    build = flexgen.create_block_mask if builder == "flexgen" else torch_create_block_mask
    for step in range(3):
        ids = (torch.rand(L, device=DEV) < 5 / L).cumsum(0)  # (no index writes: those copy a host scalar)
        mask = _document_mask(ids) if name == "document" else flexgen.variants.causal
        q, k, v = leaves(*(torch.randn(B, H, L, head_dim, device=DEV, dtype=torch.bfloat16) for _ in range(3)))
        w = torch.randn(B, H, L, head_dim, device=DEV, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        if step > 0:  # (the first step compiles the kernels)
            torch.cuda.set_sync_debug_mode("error")
        try:
            bm = build(mask, B, None, L, L, device=DEV)
            out = flexgen.flex_attention(q, k, v, block_mask=bm)
            (out * w).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        step_out = out.detach().clone()
        check(q, k, v, None, mask, (1.0, 0.3, 0.05), block_mask=bm,
              tag=f"fresh {name} mask by {builder}, D={head_dim}, step {step} (seed {seed})")
        again = flexgen.flex_attention(q.detach(), k.detach(), v.detach(), block_mask=bm)
        assert torch.equal(again, step_out), f"the step's forward differs from the checked one (seed {seed})"
