"""flexgen attention under torch.compile(fullgraph=True, inductor) on the GPU.

Compiled forward and backward equal eager flexgen's (same ops, same kernels), and the
float64 reference within test_gpu_backward's error contract; learnable ALiBi slopes get
gradients; a training loop compiles each kernel once; the backward does no dK/dV work when
only the query needs a gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flexgen
from flexgen.cache import jit
from test_gpu_backward import assert_grads_match, fresh_seed, lowp_grads, reference_grads
from test_gpu_forward import lowp_attention

gpu = pytest.mark.gpu
DEV = "cuda"
B, H, L, D = 2, 4, 384, 64


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Attention(nn.Module):
    """ALiBi with learnable slopes (a flexgen Mod, a function kept on the module, or one made in forward over a
    tensor of the trace), causal mask."""

    def __init__(self, how: str):
        super().__init__()
        self.slopes = nn.Parameter(flexgen.variants.alibi_slopes(H).to(DEV))
        self.how = how
        if how == "mod":
            self.score_mod = flexgen.variants.alibi(self.slopes)
        else:
            self.score_mod = lambda s, b, h, qi, ki: s + self.slopes[h] * (ki - qi)

    def forward(self, q, k, v, block_mask):
        if self.how == "in_forward":
            slopes = self.slopes * 1.0  # (a tensor of the graph: dynamo holds no Python function for the closure)

            def alibi(s, b, h, qi, ki):
                return s + slopes[h] * (ki - qi)

            return flexgen.flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
        return flexgen.flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask)


def _inputs(dtype=torch.bfloat16):
    fresh_seed()
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=dtype) for _ in range(3))
    return q, k, v, torch.randn(B, H, L, D, device=DEV, dtype=dtype)


def _run(fn, module, q, k, v, do, bm):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    module.slopes.grad = None
    out = fn(q, k, v, bm)
    out.backward(do)
    torch.cuda.synchronize()
    return out.detach(), [q.grad, k.grad, v.grad, module.slopes.grad.clone()]


@gpu
@pytest.mark.parametrize("how", ["mod", "init_lambda", "in_forward"])
def test_compiled_equals_eager_and_reference(how, isolated_kernel_cache):
    torch._dynamo.reset()
    module = Attention(how)
    bm = flexgen.create_block_mask(_causal, None, None, L, L, device=DEV)
    q, k, v, do = _inputs()
    out_e, grads_e = _run(module, module, q, k, v, do, bm)
    out_c, grads_c = _run(torch.compile(module, fullgraph=True), module, q, k, v, do, bm)
    torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
    for name, gc, ge in zip(("dq", "dk", "dv", "dslopes"), grads_c, grads_e):
        # dq and the slope gradient are fp32 sums (atomics) over thousands of terms: equal up to the
        # order of additions (measured 3e-5 relative on the H200), so 1e-4 of the largest value; dq is
        # then rounded to bf16, where that difference can flip the last bit (2^-7 relative at most).
        tol = {"atol": 1e-4 * ge.abs().max().item(), "rtol": 2**-7 if name == "dq" else 1e-4} if name in ("dq", "dslopes") else {"atol": 0, "rtol": 0}
        torch.testing.assert_close(gc, ge, **tol, msg=lambda m, n=name: f"{n}: {m}")
    score = flexgen.variants.alibi(module.slopes.detach())
    scale = D ** -0.5
    ref = reference_grads(q, k, v, do, score, _causal, scale, False, ["alibi_slopes"])
    base = lowp_grads(q, k, v, do, score, _causal, scale, ["alibi_slopes"])
    assert_grads_match(grads_c[:3], ref[:3], base[:3], ["dq", "dk", "dv"], f"compiled {how}")
    assert grads_c[3].abs().sum() > 0


@gpu
def test_training_steps_compile_each_kernel_once(isolated_kernel_cache, monkeypatch):
    torch._dynamo.reset()
    jit.clear_memory()
    loads: dict = {}
    real = jit._load_or_build

    def counting(spec, *args):
        loads[spec] = loads.get(spec, 0) + 1
        return real(spec, *args)

    monkeypatch.setattr(jit, "_load_or_build", counting)
    module = Attention("mod")
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    step = torch.compile(module, fullgraph=True)
    bm = flexgen.create_block_mask(_causal, None, None, L, L, device=DEV)
    for _ in range(5):
        q, k, v, do = _inputs()
        q.requires_grad_()
        opt.zero_grad()
        step(q, k, v, bm).backward(do)
        opt.step()
    torch.cuda.synchronize()
    assert loads and all(n == 1 for n in loads.values()), loads
    assert {s.kind for s in loads} >= {"fwd", "bwd", "bwd_preprocess", "bwd_postprocess"}


@gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_query_grad_only_does_no_dk_dv_work(compiled, monkeypatch):
    torch._dynamo.reset()
    from flexgen.runtime import backward as bwd

    seen = []
    real = bwd.prepare_backward  # (what both the ops and a planned eager call plan the backward with)

    def spy(*args, **kwargs):
        seen.append((tuple(args[10]), tuple(args[11] if len(args) > 11 else kwargs.get("grad_buffers", ()))))
        return real(*args, **kwargs)

    monkeypatch.setattr(bwd, "prepare_backward", spy)
    q, k, v, do = _inputs()
    q.requires_grad_()
    fn = lambda q, k, v: flexgen.flex_attention(q, k, v)  # noqa: E731
    out = (torch.compile(fn, fullgraph=True) if compiled else fn)(q, k, v)
    out.backward(do)
    assert seen == [((True, False, False), ())]
    assert q.grad is not None and k.grad is None and v.grad is None


@gpu
def test_torch_block_mask_compiled(isolated_kernel_cache):
    from torch.nn.attention.flex_attention import create_block_mask

    torch._dynamo.reset()
    bm = create_block_mask(_causal, None, None, L, L, device=DEV)
    q, k, v, _ = _inputs()
    fn = torch.compile(lambda q, k, v, m: flexgen.flex_attention(q, k, v, block_mask=m), fullgraph=True)
    torch.testing.assert_close(fn(q, k, v, bm), flexgen.flex_attention(q, k, v, block_mask=bm), atol=0, rtol=0)


def _offset_by(n):
    return lambda s, b, h, q_idx, kv_idx: s + (q_idx - kv_idx) * n / 64


@gpu
def test_a_captured_integer_changing_between_calls_runs_one_graph(isolated_kernel_cache):
    """Under dynamic=True an integer the score_mod captures is symbolic: the kernel reads it at run time (a 0-dim
    int32 buffer), so every value runs one graph and one kernel, forward and backward each value's own."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    attend = torch.compile(lambda q, k, v, score_mod: flexgen.flex_attention(q, k, v, score_mod=score_mod),
                           backend=backend, dynamic=True)
    scale = D ** -0.5
    for n in (3, 5, 7):
        q, k, v, do = _inputs()
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attend(q, k, v, _offset_by(n))
        out.backward(do)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any()
        score = flexgen.score_mod(_offset_by(n))
        ref = reference_grads(q, k, v, do, score, None, scale, False, [])
        base = lowp_grads(q, k, v, do, score, None, scale, [])
        assert_grads_match([q.grad, k.grad, v.grad], ref[:3], base[:3], ["dq", "dk", "dv"], f"offset {n}")
        ref_out = flexgen.reference_attention(*(t.detach().double() for t in (q, k, v)), score_mod=score, scale=scale)
        base_out, _ = lowp_attention(*(t.detach() for t in (q, k, v)), score, None, scale)
        err, bar = ((x.double() - ref_out).norm().item() for x in (out.detach(), base_out))
        assert err <= 2 * bar + 1e-5, (n, err, bar)
    assert backend.frame_count == 1


def _batch_bias(n):
    return lambda s, b, h, qi, ki: s + (b + 1) * n * 0.25


@gpu
def test_a_size_captured_inside_the_compiled_forward_runs_one_graph(isolated_kernel_cache):
    """PyTorch's test_symbol_closure_in_score_mod: a score_mod made in the compiled forward over the batch size,
    under dynamic=True, runs one graph for every batch size (the size a 0-dim buffer the kernel reads), each
    matching float64."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def attend(q, k, v):
        batch = q.shape[0]
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + (b + 1) * batch * 0.25)

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("inductor")
    compiled = torch.compile(attend, backend=backend, dynamic=True, fullgraph=True)
    for batch in (2, 3, 5):
        fresh_seed()
        q, k, v = (torch.randn(batch, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q).fill_(float("nan"))
        out.copy_(compiled(q, k, v))
        score = flexgen.score_mod(_batch_bias(batch))
        ref = flexgen.reference_attention(q.double(), k.double(), v.double(), score_mod=score)
        base, _ = lowp_attention(q, k, v, score, None, D ** -0.5)
        err, bar = ((x.double() - ref).norm().item() for x in (out, base))
        assert not torch.isnan(out).any() and err <= 2 * bar + 1e-5, (batch, err, bar)
    assert backend.frame_count == 1


@gpu
def test_a_compiled_create_block_mask_over_a_buffer_read_by_batch(isolated_kernel_cache):
    """flexgen's create_block_mask under torch.compile(dynamic=True) with a functools.partial padding mask that
    reads a length per batch row (PyTorch's dynamic-batch test): the mask and the attention over it match eager's
    and float64."""
    import functools

    def padded(b, h, q_idx, kv_idx, lengths):
        return (q_idx < lengths[b]) & (kv_idx < lengths[b])

    torch._dynamo.reset()
    seed = fresh_seed()
    lengths = torch.randint(L // 2, L + 1, (3,), device=DEV)
    mod = functools.partial(padded, lengths=lengths)
    build = torch.compile(flexgen.create_block_mask, dynamic=True, fullgraph=False)
    bm = build(mod, B=3, H=None, Q_LEN=L, KV_LEN=L, device=DEV)
    eager = flexgen.create_block_mask(mod, 3, None, L, L, device=DEV)
    assert torch.equal(bm.to_dense(), eager.to_dense()), f"seed {seed}"
    q, k, v = (torch.randn(3, 2, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out = flexgen.flex_attention(q, k, v, block_mask=bm)
    mask = flexgen.mask_mod(mod)
    ref = flexgen.reference_attention(q.double(), k.double(), v.double(), mask_mod=mask)
    base, _ = lowp_attention(q, k, v, None, mask, D ** -0.5)
    err, bar = ((x.double() - ref).norm().item() for x in (out, base))  # (rows past a length: zeros in all three)
    assert not torch.isnan(out).any() and err <= 2 * bar + 1e-5, (err, bar, seed)


@gpu
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_cuda_graph_modes_keep_no_allocation_of_their_own(isolated_kernel_cache, mode):
    """torch.compile's CUDA-graph modes (cudagraph trees) require every allocation left alive in a graph's pool to
    be an output: what flexgen keeps across calls (the sm90 forward's per-stream tile counter, the work orders kept
    per mask) is made afresh while they warm up. Forward and backward, repeated (warm-up, recording, replays),
    equal eager calls."""
    torch._dynamo.reset()
    q, k, v, do = _inputs()
    bm = flexgen.create_block_mask(_causal, None, None, L, L, device=DEV)
    fn = torch.compile(lambda q, k, v, m: flexgen.flex_attention(q, k, v, block_mask=m), fullgraph=True,
                       dynamic=True, mode=mode)
    want = flexgen.flex_attention(q, k, v, block_mask=bm)
    for _ in range(4):
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(qs, ks, vs, bm)
        out.backward(do)
        torch.cuda.synchronize()
        torch.testing.assert_close(out.detach().clone(), want, atol=0, rtol=0)
        assert not torch.isnan(qs.grad).any() and not torch.isnan(ks.grad).any() and not torch.isnan(vs.grad).any()
