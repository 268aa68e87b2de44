"""flex_attention at PyTorch's edges, through the kernels, against float64 autograd of
flexgen.reference_attention: misaligned views (forward and backward, grad_out included), the lse
gradient (a linear term and a z-loss), return_aux, a key/value batch of 1 beside a larger query
batch, and outputs and gradients in their inputs' dimension order.

The bar, as in tests/test_gpu_backward.py: the error norm against float64 is at most twice that of
PyTorch's own low-precision math (every op in the input dtype, eager autograd) plus a small epsilon.
Outputs are poisoned (NaN-filled blocks left in the caching allocator) before each flexgen call.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import flexgen
from lowp_math import masked_scores

gpu = pytest.mark.gpu
DEV = "cuda"
EPS = 1e-4


def fresh_seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    return seed


def poison(*tensors_like):
    bufs = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV) for t in tensors_like]
    del bufs


def misaligned(shape, dtype, offset=997):
    """A (B, H, L, D) view at `offset` elements into a larger buffer: base pointer not 16-byte aligned."""
    n = math.prod(shape)
    buf = torch.randn(n + offset + 64, device=DEV, dtype=dtype)
    strides = tuple(math.prod(shape[i + 1:]) for i in range(4))
    t = torch.as_strided(buf, shape, strides, offset)
    assert t.data_ptr() % 16
    return t


def alibi_causal(H):
    slopes = torch.exp2(-torch.arange(1, H + 1, device=DEV, dtype=torch.float32) * 8.0 / H)
    score = flexgen.score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    return score, flexgen.variants.causal


def loss_of(out, lse, w, a, b, c):
    """out weighted by w, plus a linear and a squared (z-loss) lse term."""
    return (out.double() * w.double()).sum() * a + lse.double().sum() * b + (lse.double() ** 2).sum() * c


def flexgen_run(q, k, v, score, bm, w, coeffs, gqa=False, kernel_options=None):
    """out, lse; the gradients land in q.grad, k.grad, v.grad."""
    poison(q, q[..., 0].float())
    out, aux = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=gqa,
                                      return_aux=flexgen.AuxRequest(lse=True), kernel_options=kernel_options)
    poison(q, k, v)
    loss_of(out, aux.lse, w, *coeffs).backward()
    torch.cuda.synchronize()
    return out.detach(), aux.lse.detach()


def reference_grads(q, k, v, score, mask, w, coeffs, gqa=False):
    """float64: (out, lse, dq, dk, dv); K and V of batch 1 expanded to the query's (autograd sums dK, dV)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.expand(q.shape[0], *t.shape[1:]) for t in (k64, v64))
    out, lse = flexgen.reference_attention(q64, kk, vv, score_mod=score, mask_mod=mask, enable_gqa=gqa,
                                           return_lse=True)
    loss_of(out, lse, w, *coeffs).backward()
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def lowp_grads(q, k, v, score, mask, w, coeffs):
    """PyTorch's own low-precision math with eager autograd (scores, softmax and PV in q.dtype)."""
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in (q, k, v))
    kk, vv = (t.expand(q.shape[0], *t.shape[1:]) for t in (kl, vl))
    s, vv = masked_scores(ql, kk, vv, score, mask, 1.0 / math.sqrt(q.shape[-1]))
    lse = torch.logsumexp(s.float(), dim=-1)
    out = torch.matmul(torch.softmax(s, dim=-1), vv)
    loss_of(out, lse, w, *coeffs).backward()
    return out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad


def assert_close_to_reference(got, ref, base, names, tag):
    for name, g, r, bl in zip(names, got, ref, base):
        assert g is not None, f"no {name}: {tag}"
        assert g.shape == r.shape, f"{name} shape {tuple(g.shape)} != {tuple(r.shape)}: {tag}"
        assert not torch.isnan(g).any(), f"NaN in {name}: {tag}"
        err = (g.double() - r).norm().item()
        bar = 2 * (bl.double() - r).norm().item() + EPS
        assert err <= bar, f"{name} error {err:.3e} > {bar:.3e} (2 x PyTorch's low-precision error + {EPS}): {tag}"


def check(q, k, v, score, mask, coeffs, gqa=False, kernel_options=None, tag="", block_mask=None):
    """flexgen's out, lse and gradients of loss_of against float64, for the given (possibly odd) inputs,
    which must be leaves that require grad; through `block_mask` where given (made from mask_mod otherwise)."""
    L = q.shape[2]
    bm = block_mask
    if bm is None and mask is not None:
        bm = flexgen.create_block_mask(mask, None, None, L, k.shape[2], device=DEV)
    w = torch.randn(q.shape, device=DEV, dtype=q.dtype)
    for t in (q, k, v):
        t.grad = None
    out, lse = flexgen_run(q, k, v, score, bm, w, coeffs, gqa, kernel_options)
    got = [out, lse, q.grad, k.grad, v.grad]
    ref = reference_grads(q, k, v, score, mask, w, coeffs, gqa)
    base = lowp_grads(q, k, v, score, mask, w, coeffs)
    assert_close_to_reference(got, ref, base, ["out", "lse", "dq", "dk", "dv"], tag)
    return out, got


def leaves(*tensors):
    return [t.requires_grad_() for t in tensors]


# ---------------------------------------------------------------- misaligned inputs


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_misaligned_views_forward_and_backward(dtype):
    seed = fresh_seed()
    shape = (2, 3, 300, 64)
    q, k, v = leaves(*(misaligned(shape, dtype) for _ in range(3)))
    score, mask = alibi_causal(3)
    check(q, k, v, score, mask, (1.0, 0.0, 0.0), tag=f"as_strided offset 997 {dtype} (seed {seed})")


@gpu
def test_misaligned_grad_out():
    """out.backward(do) with do a view at a misaligned offset: gradients of sum(out * do)."""
    seed = fresh_seed()
    q, k, v = leaves(*(torch.randn(2, 3, 300, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3)))
    do = misaligned(q.shape, torch.bfloat16)
    mask = flexgen.variants.causal
    out = flexgen.flex_attention(q, k, v, block_mask=flexgen.create_block_mask(mask, None, None, 300, 300, device=DEV))
    poison(q, k, v)
    out.backward(do)
    torch.cuda.synchronize()
    coeffs = (1.0, 0.0, 0.0)
    ref = reference_grads(q, k, v, None, mask, do, coeffs)[2:]
    base = lowp_grads(q, k, v, None, mask, do, coeffs)[2:]
    assert_close_to_reference([q.grad, k.grad, v.grad], ref, base, ["dq", "dk", "dv"], f"misaligned grad_out (seed {seed})")


@gpu
@pytest.mark.parametrize("layout", ["flat_slice", "odd_row_stride", "strided_last_dim"])
def test_other_unaligned_views(layout):
    seed = fresh_seed()
    B, H, L, D = 1, 2, 200, 64
    if layout == "flat_slice":  # contiguous, 5 elements into its buffer
        make = lambda: torch.randn(B * H * L * D + 5, device=DEV, dtype=torch.bfloat16)[5:].view(B, H, L, D)  # noqa: E731
    elif layout == "odd_row_stride":  # rows of D + 3 elements, starting 3 in
        make = lambda: torch.randn(B, H, L, D + 3, device=DEV, dtype=torch.bfloat16)[..., 3:]  # noqa: E731
    else:
        make = lambda: torch.randn(B, H, D, L, device=DEV, dtype=torch.bfloat16).transpose(2, 3)  # noqa: E731
    q, k, v = leaves(make(), make(), make())
    check(q, k, v, None, flexgen.variants.causal, (1.0, 0.0, 0.0), tag=f"{layout} (seed {seed})")


# ---------------------------------------------------------------- the lse gradient


@gpu
@pytest.mark.parametrize("coeffs", [(1.0, 0.5, 0.0), (0.0, 1.0, 0.0), (1.0, -0.3, 0.01)], ids=["out+lse", "lse_only", "z_loss"])
@pytest.mark.parametrize("family", [None, "sm80"])
def test_lse_gradient(coeffs, family):
    """loss = sum(out * w) * a + sum(lse) * b + sum(lse**2) * c; family sm80 runs the mma.sync backward on
    Hopper too (the default there is sm90's)."""
    seed = fresh_seed()
    q, k, v = leaves(*(torch.randn(2, 4, 333, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3)))
    score, mask = alibi_causal(4)
    options = {"family": family} if family else None
    check(q, k, v, score, mask, coeffs, kernel_options=options, tag=f"{coeffs} family={family} (seed {seed})")


@gpu
def test_lse_gradient_gqa_fp16():
    seed = fresh_seed()
    q = torch.randn(1, 8, 500, 128, device=DEV, dtype=torch.float16)
    k, v = (torch.randn(1, 2, 500, 128, device=DEV, dtype=torch.float16) for _ in range(2))
    q, k, v = leaves(q, k, v)
    check(q, k, v, None, flexgen.variants.causal, (1.0, 0.7, 0.02), gqa=True, tag=f"gqa fp16 (seed {seed})")


@gpu
def test_return_aux_lse_equals_return_lse():
    q, k, v = (torch.randn(1, 2, 256, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    out, lse = flexgen.flex_attention(q, k, v, return_lse=True)
    out2, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest(lse=True))
    assert torch.equal(out, out2) and torch.equal(lse, aux.lse) and aux.max_scores is None


# ---------------------------------------------------------------- a key/value batch of 1


@gpu
@pytest.mark.parametrize("gqa", [False, True])
def test_kv_batch_of_one(gqa):
    seed = fresh_seed()
    q = torch.randn(3, 4, 400, 64, device=DEV, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2 if gqa else 4, 400, 64, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    q, k, v = leaves(q, k, v)
    score, mask = alibi_causal(4)
    check(q, k, v, score, mask, (1.0, 0.2, 0.0), gqa=gqa, tag=f"kv batch 1, gqa={gqa} (seed {seed})")
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


@gpu
@pytest.mark.parametrize("shape", [(0, 4, 300, 64), (2, 0, 300, 64)])
def test_an_empty_batch_or_head_count(shape):
    """No kernel runs (a tensor map of an empty tensor is invalid); the outputs, lse, max_scores and gradients
    come back empty in their inputs' shapes."""
    q, k, v = (torch.randn(*shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, 300, 300)
    out, aux = flexgen.flex_attention(q, k, v, block_mask=bm, return_aux=flexgen.AuxRequest(lse=True, max_scores=True))
    assert out.shape == q.shape and aux.lse.shape == shape[:3] and aux.max_scores.shape == shape[:3]
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# ---------------------------------------------------------------- layouts of outputs and gradients


@gpu
def test_outputs_and_gradients_keep_their_inputs_layout():
    seed = fresh_seed()
    B, H, L, D = 2, 4, 300, 64
    q = torch.randn(B, L, H, D, device=DEV, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(H, B, L, D, device=DEV, dtype=torch.bfloat16).transpose(0, 1).requires_grad_()
    v = torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    out, got = check(q, k, v, None, flexgen.variants.causal, (1.0, 0.0, 0.0), tag=f"layouts (seed {seed})")
    assert out.stride() == q.stride(), f"out strides {out.stride()} vs q's {q.stride()}"
    # autograd.grad hands back the op's own gradients (.grad may be restrided to match its leaf)
    out = flexgen.flex_attention(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


@gpu
def test_pytorch_only_kernel_options_run(monkeypatch):
    from flexgen import warnings_once

    monkeypatch.setattr(warnings_once, "_seen", set())
    q = torch.randn(1, 2, 256, 64, device=DEV, dtype=torch.bfloat16)
    want = flexgen.flex_attention(q, q, q)
    poison(q)
    with pytest.warns(UserWarning, match="USE_TMA"):
        got = flexgen.flex_attention(q, q, q, kernel_options={"USE_TMA": True, "BLOCK_M2": 64, "BACKEND": "TRITON"})
    assert torch.equal(got, want)  # ignored options change nothing the kernels compute


# ---------------------------------------------------------------- max_scores


@gpu
@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("with_score_mod", [False, True])
def test_max_scores(family, D, with_score_mod):
    """AuxRequest(max_scores=True): the row max of the modded, scaled scores, natural units; -inf on rows
    that see nothing; out and lse as without it."""
    seed = fresh_seed()
    B, H, L = 2, 3, 333
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    score = flexgen.variants.softcap(20.0) if with_score_mod else None
    mask = flexgen.mask_mod(lambda b, h, qi, ki: (qi % 7 != 0) & (ki <= qi))  # every 7th row sees nothing
    bm = flexgen.create_block_mask(mask, None, None, L, L, device=DEV)
    poison(q[..., 0].float(), q[..., 0].float())
    options = {"family": family}
    out, aux = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, kernel_options=options,
                                      return_aux=flexgen.AuxRequest(lse=True, max_scores=True))
    torch.cuda.synchronize()
    # beside it, the same family without max_scores
    plain_out, plain_lse = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, return_lse=True,
                                                  kernel_options=options)
    # the same operations; the compiler may contract them into FMAs differently around the extra max: one bf16 ulp
    torch.testing.assert_close(out, plain_out, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(aux.lse, plain_lse, rtol=1e-6, atol=1e-6)
    scale = 1.0 / math.sqrt(D)
    ref = masked_scores(q.double(), k.double(), v.double(), score, mask, scale)[0].amax(-1)
    base = masked_scores(q, k, v, score, mask, scale)[0].amax(-1).double()
    got = aux.max_scores
    tag = f"{family} D={D} score_mod={with_score_mod} (seed {seed})"
    assert got.shape == (B, H, L) and got.dtype == torch.float32 and not torch.isnan(got).any(), tag
    dead = torch.isneginf(ref)
    assert dead.any() and torch.equal(torch.isneginf(got), dead), tag
    err = (got.double() - ref)[~dead].norm().item()
    bar = 2 * (base - ref)[~dead].norm().item() + 1e-4
    assert err <= bar, f"max_scores error {err:.3e} > {bar:.3e}: {tag}"


@gpu
def test_a_thread_whose_first_cuda_work_is_a_flexgen_launch():
    """A fresh thread has no current CUDA context until something makes one current (PyTorch's autograd worker,
    where backwards run, may reach flexgen's first launch so): the launch makes the device's primary context
    current itself instead of failing with CUDA_ERROR_INVALID_CONTEXT."""
    import threading

    from cupy_backends.cuda.api import driver

    q, k, v = (torch.randn(1, 2, 256, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    want = flexgen.flex_attention(q, k, v)  # compiled and loaded, and the allocator holds blocks to reuse
    torch.cuda.synchronize()
    seen = {}

    def work():
        seen["context before"] = driver.ctxGetCurrent()
        seen["out"] = flexgen.flex_attention(q, k, v)
        torch.cuda.synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert "out" in seen, "the launch in a fresh thread failed"
    assert seen["context before"] == 0  # (else this test shows nothing)
    assert torch.equal(seen["out"], want)


@gpu
def test_threads_whose_first_launches_on_a_stream_coincide():
    """Eight threads start at once on a stream no launch has used (the persistent forward's tile counter is made at
    a stream's first launch), each with a variant of its own, forward and backward: each gets what the same call
    gets alone. (The forward is deterministic: bitwise; the gradients' dQ sums in any order: close.)"""
    from at_once import at_once

    seed = fresh_seed()
    stream, count = torch.cuda.Stream(), 8
    calls = []
    for i in range(count):
        cap = 10.0 + i
        score = flexgen.score_mod(lambda s, b, h, q, kv, cap=cap: cap * torch.tanh(s / cap))
        window = 128 * (i + 1)
        bm = flexgen.create_block_mask(lambda b, h, q, kv, w=window: (q >= kv) & (q - kv < w), None, None, 1024, 1024,
                                       device=DEV)
        q, k, v = (torch.randn(2, 4, 1024, 128, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        calls.append((q, k, v, score, bm, torch.randn(2, 4, 1024, 128, device=DEV, dtype=torch.bfloat16)))

    def run(q, k, v, score, bm, w):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm)
        (out.float() * w.float()).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    def on_the_stream(i):
        with torch.cuda.stream(stream):
            return run(*calls[i])

    torch.cuda.synchronize()
    got = at_once(on_the_stream, count, tag=f" (seed {seed})")
    torch.cuda.synchronize()
    for i, call in enumerate(calls):
        alone = run(*call)
        assert torch.equal(got[i][0], alone[0]), f"thread {i}: the output differs from the call alone (seed {seed})"
        for name, g, a in zip("qkv", got[i][1:], alone[1:]):
            assert not torch.isnan(g).any(), f"thread {i}: NaN in d{name} (seed {seed})"
            torch.testing.assert_close(g.float(), a.float(), rtol=2e-2, atol=2e-2 * a.float().abs().max().item(),
                                       msg=lambda m: f"thread {i}, d{name} (seed {seed}): {m}")
