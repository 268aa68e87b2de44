"""Calls the generated kernels do not take (float32 / float64 inputs, CPU tensors, other head dims, a value
head dim unlike the query's) run on flexgen's unfused float64 path with a warning: checked here on the CPU
against PyTorch's own FlexAttention (forward) and an independent dense float64 computation (gradients)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask, flex_attention as torch_flex

import flexgen
from flexgen import attention, warnings_once

CAUSAL = lambda b, h, q, kv: q >= kv  # noqa: E731
SOFTCAP = lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)  # noqa: E731


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(warnings_once, "_seen", set())


def _inputs(dtype, b=2, h=4, lq=90, lkv=70, d=64, dv=None, hkv=None, seed=None):
    gen = torch.Generator().manual_seed(torch.seed() if seed is None else seed)
    shapes = ((b, h, lq, d), (b, hkv or h, lkv, d), (b, hkv or h, lkv, dv or d))
    return tuple(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)


def _dense(q, k, v, scale=None, softcap=None, causal=False, group=1):
    """softmax(mod(q k^T scale) masked) v in float64, written out; and the natural-log lse."""
    q, k, v = (t.double() for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        keep = torch.arange(q.shape[2], device=q.device)[:, None] >= torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    return p @ v, lse


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_forward_matches_pytorch_flex_attention(dtype, tol):
    q, k, v = _inputs(dtype, lq=100, lkv=100)
    ref, ref_lse = _quiet(torch_flex, q, k, v, score_mod=SOFTCAP, return_lse=True,
                          block_mask=torch_block_mask(CAUSAL, None, None, 100, 100, device="cpu"))
    bm = flexgen.create_block_mask(CAUSAL, None, None, 100, 100)
    with pytest.warns(UserWarning, match="unfused float64 path"):
        out, lse = flexgen.flex_attention(q, k, v, score_mod=SOFTCAP, block_mask=bm, return_lse=True)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert not torch.isnan(out).any()
    scale = max(ref.abs().max().item(), 1.0)
    assert (out - ref).abs().max().item() <= tol * scale
    assert (lse - ref_lse).abs().max().item() <= tol * max(ref_lse.abs().max().item(), 1.0)


def test_gradients_including_the_lse_match_dense_float64():
    q, k, v = (t.requires_grad_() for t in _inputs(torch.float32))
    out, lse = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP, return_lse=True,
                      block_mask=flexgen.create_block_mask(CAUSAL, None, None, 90, 70))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, want_lse = _dense(q64, k64, v64, softcap=20.0, causal=True)
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad((out.double() * g).sum() + lse.double().square().sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * g).sum() + want_lse.square().sum(), (q64, k64, v64))
    assert (out.double() - want).abs().max().item() < 1e-5
    for got, ref in zip(got_grads, want_grads):
        assert (got.double() - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), 1.0)


def test_learnable_buffer_gets_its_gradient():
    q, k, v = _inputs(torch.float32, h=4)
    slopes = torch.rand(4, dtype=torch.float32, requires_grad=True)
    alibi = lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi)  # noqa: E731
    out = _quiet(flexgen.flex_attention, q, k, v, score_mod=alibi)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * g).sum(), slopes)
    s64 = slopes.detach().double().requires_grad_()
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / 8.0
    s = s + s64[None, :, None, None] * (torch.arange(70)[None, :] - torch.arange(90)[:, None]).double()
    (want,) = torch.autograd.grad(((torch.softmax(s, -1) @ v64) * g.double()).sum(), s64)
    assert (grad.double() - want).abs().max().item() <= 1e-5 * max(want.abs().max().item(), 1.0)


def test_shapes_the_kernels_do_not_take():
    # head dim 16, a value head dim of 40, GQA with a key/value batch of 1, fp32
    q, k, v = _inputs(torch.float32, b=3, h=4, hkv=2, d=16, dv=40)
    k, v = k[:1], v[:1]
    out = _quiet(flexgen.flex_attention, q, k, v, enable_gqa=True)
    assert out.shape == (3, 4, 90, 40)
    want, _ = _dense(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), group=2)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_reasons():
    def meta(dtype, d=64, dv=None):
        return torch.empty(1, 1, 8, d, dtype=dtype, device="meta"), torch.empty(1, 1, 8, dv or d, dtype=dtype, device="meta")

    assert attention.unfused_reason(*meta(torch.bfloat16)) is None
    assert attention.unfused_reason(*meta(torch.float32)) == "torch.float32 inputs"
    assert "value head dim (40)" in attention.unfused_reason(*meta(torch.float16, dv=40))
    assert "head dim 16" in attention.unfused_reason(*meta(torch.float16, d=16))
    assert attention.unfused_reason(torch.empty(1, 1, 8, 64, dtype=torch.bfloat16), torch.empty(1, 1, 8, 64)) == "CPU tensors"


def test_hand_made_lists_of_short_query_blocks_run_unfused():
    """Hand-made lists need query blocks of whole forward tiles (64 rows at least): a union of smaller ones would not
    be exact. Lists from create_block_mask run on the kernels at any size."""
    from flexgen.runtime.call_checks import hand_made_blocks_reason

    assert hand_made_blocks_reason((128, 128), False) is None and hand_made_blocks_reason((192, 64), False) is None
    assert hand_made_blocks_reason((32, 32), True) is None and hand_made_blocks_reason((80, 16), True) is None
    assert "32-row query blocks" in hand_made_blocks_reason((32, 128), False)
    assert "80-row query blocks" in hand_made_blocks_reason((80, 128), False)
    for size in ((8, 128), (128, 4), (24, 24)):  # (whether or not the lists follow a mask_mod)
        assert f"BLOCK_SIZE {size}" in hand_made_blocks_reason(size, True)
    assert hand_made_blocks_reason((1 << 30, 1 << 30), False) is None  # PyTorch's empty mask


def test_flex_attention_sends_hand_made_short_blocks_to_the_unfused_path(monkeypatch):
    """What a CUDA call does with such a mask, its inputs' own reasons set aside (these are CPU tensors)."""
    routed = []
    monkeypatch.setattr(attention, "unfused_reason", lambda q, v: None)
    monkeypatch.setattr(attention, "_unfused_attention", lambda reason, *args: routed.append(reason) or "unfused")
    q, k, v = _inputs(torch.bfloat16, lq=128, lkv=128)
    made = flexgen.create_block_mask(CAUSAL, None, None, 128, 128, BLOCK_SIZE=(32, 128))
    counts = made.kv_num_blocks.clone()
    counts[..., 3] = 0  # the last query block's diagonal block left out: lists that disagree with the mask_mod
    hand = flexgen.BlockMask.from_kv_blocks(counts, made.kv_indices, made.full_kv_num_blocks,
                                            made.full_kv_indices, made.BLOCK_SIZE, made.mask_mod, made.seq_lengths)
    assert flexgen.flex_attention(q, k, v, block_mask=hand) == "unfused" and "32-row query blocks" in routed[0]
    with pytest.raises(ValueError, match="dropout needs the generated kernels"):
        flexgen.flex_attention(q, k, v, block_mask=hand, dropout_p=0.1)


@pytest.mark.parametrize("block_size", [8, (4, 12), 2, 24])
def test_block_masks_of_any_block_size(block_size):
    """PyTorch's BlockMasks take blocks of any size (attention-gym's VSA tests use 2-8 tokens); the kernels walk
    multiples of 16, so such a call runs the unfused path, exactly: lists from create_block_mask, and hand-made lists
    (a random layout of listed blocks, some of them full) against the dense mask they stand for."""
    lq, lkv = 40, 36
    q, k, v = _inputs(torch.float64, lq=lq, lkv=lkv)
    made = flexgen.create_block_mask(CAUSAL, None, None, lq, lkv, device="cpu", BLOCK_SIZE=block_size)
    out = _quiet(flexgen.flex_attention, q, k, v, block_mask=made)
    want, _ = _dense(q, k, v, causal=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)

    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else block_size
    nq, nkv = -(-lq // bq), -(-lkv // bkv)
    gen = torch.Generator().manual_seed(torch.seed())
    state = torch.randint(0, 3, (2, 4, nq, nkv), generator=gen)  # 0 not listed, 1 partial (causal), 2 full
    state[..., 0] = 2  # (no row without a key)

    def lists(which):  # each row's blocks of that state in a random order, then the others (past the count)
        listed = state == which
        key = torch.where(listed, torch.rand(state.shape, generator=gen, dtype=torch.float64), 2.0)
        return listed.sum(-1).to(torch.int32), key.argsort(-1).to(torch.int32)

    (counts, indices), (full_counts, full_indices) = lists(1), lists(2)
    hand = flexgen.BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=block_size,
                                            mask_mod=CAUSAL, seq_lengths=(lq, lkv))
    out = _quiet(flexgen.flex_attention, q, k, v, block_mask=hand)
    dense_state = state.repeat_interleave(bq, 2)[:, :, :lq].repeat_interleave(bkv, 3)[..., :lkv]
    causal = torch.arange(lq)[:, None] >= torch.arange(lkv)[None, :]
    keep = (dense_state == 2) | ((dense_state == 1) & causal)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
    want = torch.softmax(s, -1).nan_to_num() @ v
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_a_cuda_call_with_blocks_of_another_size_runs_unfused(monkeypatch):
    routed = []
    monkeypatch.setattr(attention, "unfused_reason", lambda q, v: None)
    monkeypatch.setattr(attention, "_unfused_attention", lambda reason, *args: routed.append(reason) or "unfused")
    q, k, v = _inputs(torch.bfloat16, lq=64, lkv=64)
    mask = flexgen.create_block_mask(CAUSAL, None, None, 64, 64, device="cpu", BLOCK_SIZE=8)
    assert flexgen.flex_attention(q, k, v, block_mask=mask) == "unfused" and "BLOCK_SIZE (8, 8)" in routed[0]


def test_a_mask_for_more_batches_and_heads_serves_with_its_first_ones():
    """PyTorch's kernels read batch b % B and head h % H of a block mask: its decoding tests attend one request with
    a mask made for max_batch_size (and sliced by _adjust). flexgen takes the first batches and heads; a mask with
    fewer (but more than one) is refused, as before."""
    lengths = torch.tensor([5, 30, 17, 40])
    heads_window = torch.tensor([3, 1000])

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (q_idx - kv_idx < heads_window[h]) & (q_idx >= kv_idx)

    block_mask = flexgen.create_block_mask(mask_mod, 4, 2, 48, 48, device="cpu", BLOCK_SIZE=16)
    q, k, v = _inputs(torch.float64, b=2, h=1, lq=48, lkv=48)
    for attend in (flexgen.flex_attention, torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True)):
        out = _quiet(attend, q, k, v, block_mask=block_mask)
        qi, ki = torch.arange(48)[:, None], torch.arange(48)[None, :]
        keep = torch.stack([mask_mod(b, 0, qi, ki) for b in range(2)])[:, None]
        s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, -math.inf)
        assert not out.isnan().any()
        torch.testing.assert_close(out, torch.softmax(s, -1).nan_to_num() @ v, atol=1e-12, rtol=1e-12)  # (empty rows: 0)
    q4 = torch.randn(4, 1, 48, 64, dtype=torch.float64)
    three = flexgen.create_block_mask(mask_mod, 3, 1, 48, 48, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="block mask has B=3, H=1; each must be 1 or match the query's B=4"):
        _quiet(flexgen.flex_attention, q4, q4, q4, block_mask=three)


def test_bf16_on_the_cpu_is_rounded_once():
    q, k, v = _inputs(torch.bfloat16)
    with pytest.warns(UserWarning, match="CPU tensors"):
        out = flexgen.flex_attention(q, k, v, score_mod=SOFTCAP)
    want, _ = _dense(q, k, v, softcap=20.0)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16))


def test_fully_masked_rows_give_zero_and_minus_infinity():
    q, k, v = _inputs(torch.float32, lq=8, lkv=8)
    none_before_4 = lambda b, h, qi, kv: qi >= 4  # noqa: E731
    bm = flexgen.create_block_mask(none_before_4, None, None, 8, 8, BLOCK_SIZE=16)
    out, lse = _quiet(flexgen.flex_attention, q, k, v, block_mask=bm, return_lse=True)
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert torch.isneginf(lse[:, :, :4]).all() and torch.isfinite(lse[:, :, 4:]).all()


def test_return_aux_gives_lse_and_row_max():
    from flexgen.attention import AuxRequest

    q, k, v = _inputs(torch.float64, lq=40, lkv=40)
    bm = flexgen.create_block_mask(CAUSAL, None, None, 40, 40, BLOCK_SIZE=16)
    out, aux = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP, block_mask=bm,
                      return_aux=AuxRequest(lse=True, max_scores=True))
    s = 20.0 * torch.tanh(q @ k.transpose(-1, -2) / 8.0 / 20.0)
    s = s.masked_fill(~(torch.arange(40)[:, None] >= torch.arange(40)[None, :]), -math.inf)
    assert torch.allclose(aux.max_scores, s.amax(-1), rtol=0, atol=1e-12)
    assert torch.allclose(aux.lse, torch.logsumexp(s, -1), rtol=0, atol=1e-12)
    assert not aux.max_scores.requires_grad


def test_one_warning_per_reason():
    q, k, v = _inputs(torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            flexgen.flex_attention(q, k, v)
    assert sum("unfused" in str(w.message) for w in caught) == 1


def test_what_the_unfused_path_refuses():
    q, k, v = _inputs(torch.float32)
    with pytest.raises(ValueError, match="dropout needs the generated kernels"):
        _quiet(flexgen.flex_attention, q, k, v, dropout_p=0.1)
    with pytest.raises(TypeError, match="float16"):
        flexgen.flex_attention(*(t.to(torch.int32) for t in (q, k, v)))
    with pytest.raises(ValueError, match="same dtype"):  # integer key and value with a float query
        flexgen.flex_attention(q, k.to(torch.int32), v.to(torch.int32))


def test_under_torch_compile():
    q, k, v = _inputs(torch.float32)
    eager = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP)
    torch._dynamo.reset()
    compiled = torch.compile(flexgen.flex_attention, backend="eager")
    got = _quiet(compiled, q, k, v, score_mod=SOFTCAP)
    assert torch.equal(got, eager)


def test_block_mask_checks_are_the_kernels():
    q, k, v = _inputs(torch.float32, lq=64, lkv=64)
    wrong = flexgen.create_block_mask(CAUSAL, None, None, 128, 128)
    with pytest.raises(ValueError, match="Q_LEN"):
        _quiet(flexgen.flex_attention, q, k, v, block_mask=wrong)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float64, 64), (torch.bfloat16, 80)])
def test_on_the_gpu(dtype, d):
    """float32 / float64 inputs and a head dim the kernels lack, on CUDA tensors: forward and gradients."""
    q, k, v = (t.cuda().requires_grad_() for t in _inputs(dtype, d=d))
    bm = flexgen.create_block_mask(CAUSAL, None, None, 90, 70, device="cuda")
    out = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP, block_mask=bm)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, _ = _dense(q64, k64, v64, softcap=20.0, causal=True)
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad((out.double() * g).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * g).sum(), (q64, k64, v64))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert not torch.isnan(out).any()
    assert (out.double() - want).abs().max().item() <= tol * max(want.abs().max().item(), 1.0)
    for got, ref in zip(got_grads, want_grads):
        assert (got.double() - ref).abs().max().item() <= tol * max(ref.abs().max().item(), 1.0)


@pytest.mark.gpu
def test_on_the_gpu_recomputed_chunks_give_the_kept_chunks_gradients(monkeypatch):
    """A call past the recompute threshold (lowered here) on CUDA: the backward recomputes each chunk and gets the
    gradients that keeping them gives (to float32's last bit)."""
    from flexgen.dsl import reference

    q, k, v = (t.cuda().requires_grad_() for t in _inputs(torch.float32))
    bm = flexgen.create_block_mask(CAUSAL, None, None, 90, 70, device="cuda")
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 2 * 90 * 70)  # several chunks
    g = torch.randn(q.shape, device="cuda")
    grads = []
    for threshold in (1 << 40, 0):
        monkeypatch.setattr(reference, "RECOMPUTE_ABOVE", threshold)
        out = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP, block_mask=bm)
        grads.append(torch.autograd.grad((out * g).sum(), (q, k, v)))
    for kept, again in zip(*grads):
        torch.testing.assert_close(again, kept, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_fullgraph_runs_the_unfused_path_without_a_break(dtype):
    """Under torch.compile the unfused path goes through the custom ops (their implementation runs it), so
    fullgraph=True holds; outputs, lse and gradients equal the eager unfused path's bit for bit."""
    q, k, v = (t.requires_grad_() for t in _inputs(dtype, lq=100, lkv=100))
    bm = flexgen.create_block_mask(CAUSAL, None, None, 100, 100)
    compiled = torch.compile(flexgen.flex_attention, fullgraph=True, backend="aot_eager")
    out, lse = _quiet(compiled, q, k, v, score_mod=SOFTCAP, block_mask=bm, return_lse=True)
    want, want_lse = _quiet(flexgen.flex_attention, q, k, v, score_mod=SOFTCAP, block_mask=bm, return_lse=True)
    assert lse.dtype == want_lse.dtype and torch.equal(out, want) and torch.equal(lse, want_lse)
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v))
    ref = torch.autograd.grad((want * g).sum() + want_lse.sum(), (q, k, v))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_compiled_unfused_path_differentiates_captured_buffers():
    q, k, v = _inputs(torch.float32, lq=64, lkv=80)
    bias = torch.randn(4, requires_grad=True)
    mod = lambda s, b, h, qi, kv: s + bias[h]  # noqa: E731
    out = _quiet(torch.compile(flexgen.flex_attention, fullgraph=True, backend="aot_eager"), q, k, v, score_mod=mod)
    bias64 = bias.detach().double().requires_grad_()
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias64[None, :, None, None]
    want = torch.softmax(s, -1) @ v.double()  # float64, written out
    assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5
    weight = torch.randn_like(want)
    (got,) = torch.autograd.grad((out.double() * weight).sum(), (bias,))
    (ref,) = torch.autograd.grad((want * weight).sum(), (bias64,))
    assert (got.double() - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)


def test_dynamic_shapes_trace_the_call_once():
    """A default argument or the default scale must not reach the graph as a symbolic float: dynamo would then
    trace the whole call a second time (PyTorch's own dynamic-shape tests count the frames)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    q, k, v = _inputs(torch.float32, lq=128, lkv=128)
    _quiet(torch.compile(_call_with_global_mask, backend=backend, dynamic=True), q, k, v)
    assert backend.frame_count == 1


_GLOBAL_MASK = flexgen.create_block_mask(CAUSAL, 1, 1, 128, 128, device="cpu")


def _call_with_global_mask(q, k, v):
    return flexgen.flex_attention(q, k, v, block_mask=_GLOBAL_MASK, score_mod=SOFTCAP)


def test_a_captured_mask_under_dynamic_shapes_keeps_one_graph():
    """As PyTorch's dynamic-shape tests call it: flex_attention in a functools.partial holding a block mask,
    compiled with dynamic=True and fullgraph=True. The mask's lengths are symbolic there; a second length with its
    own mask runs the same graph (one frame), and both match the float64 reference."""
    import functools

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    for b, length in ((3, 512), (5, 256)):  # (sizes that differ, so duck sizing ties none of them together)
        q, k, v = (t.requires_grad_() for t in _inputs(torch.float32, b=b, h=7, lq=length, lkv=length))
        mask = flexgen.create_block_mask(CAUSAL, 1, 1, length, length, device="cpu")
        call = functools.partial(flexgen.flex_attention, score_mod=SOFTCAP, block_mask=mask)
        out = _quiet(torch.compile(call, backend=backend, dynamic=True, fullgraph=True), q, k, v)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        want, _ = _dense(q64, k64, v64, softcap=20.0, causal=True)
        assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5
        g = torch.randn_like(want)
        got = torch.autograd.grad((out.double() * g).sum(), (q, k, v))
        ref = torch.autograd.grad((want * g).sum(), (q64, k64, v64))
        for a, r in zip(got, ref):
            assert (a.double() - r).abs().max().item() < 1e-4 * max(r.abs().max().item(), 1.0)
        assert backend.frame_count == 1


def _alibi_over(num_heads):
    def alibi(score, b, h, q, kv):
        return score + (kv - q) * torch.exp2(-((h + 1) * 8.0 / num_heads))
    return alibi


def _alibi_reference(q, k, v, num_heads):
    q, k, v = (t.double() for t in (q, k, v))
    h = torch.arange(q.shape[1], dtype=torch.float64).view(-1, 1, 1)
    rel = (torch.arange(k.shape[2]).view(1, -1) - torch.arange(q.shape[2]).view(-1, 1)).double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + rel * torch.exp2(-((h + 1) * 8.0 / num_heads))
    return torch.softmax(s, -1) @ v


def test_a_captured_number_under_dynamic_shapes_keeps_one_graph():
    """PyTorch's dynamic-shape test of its ALiBi score_mod: an integer in the function's closure, which dynamo makes
    symbolic under dynamic=True, is read by the kernel at run time (a 0-dim buffer), so three shapes and another
    number run one graph, each with its own attention."""
    import functools

    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    # (sizes chosen so that no two of batch, heads and block counts are equal: duck sizing would tie them)
    for num_heads, b, length, frames in ((8, 3, 1024, 1), (8, 6, 512, 1), (8, 6, 256, 1), (4, 6, 256, 1)):
        q, k, v = (t.requires_grad_() for t in _inputs(torch.float32, b=b, h=5, lq=length, lkv=length, d=16))
        mask = flexgen.create_block_mask(flexgen.noop_mask, 1, 1, length, length, device="cpu")
        call = functools.partial(flexgen.flex_attention, score_mod=_alibi_over(num_heads), block_mask=mask)
        out = _quiet(torch.compile(call, backend=backend, dynamic=True), q, k, v)
        want = _alibi_reference(q, k, v, num_heads)
        assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5, (num_heads, length)
        assert backend.frame_count == frames, (num_heads, length)


def _offset_by(n):
    return lambda score, b, h, q, kv: score + (q - kv) * n / 64


def _offset_unless_small(n):
    def offset(score, b, h, q, kv):
        return score + (q - kv) / 64 if n > 4 else score  # (Python looks at n's value)
    return offset


def _scaled_offset(n):
    return lambda score, b, h, q, kv: score + n * 0.5 * (q - kv) / 64  # (n * 0.5: a tensor computed from n)


@pytest.mark.parametrize("make,frames", [(_offset_by, 1), (_offset_unless_small, 4), (_scaled_offset, 4)])
def test_a_captured_integer_is_read_at_run_time_where_the_trace_allows(make, frames):
    """Under dynamic=True a captured integer whose value changes between calls is symbolic: where the function
    traces with it as a tensor the kernel reads, one graph serves every value; where Python looks at its value, or
    a tensor is computed from it before the trace sees it, each value is specialised (its own graph). The
    attention is each value's either way."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flexgen.flex_attention, backend=backend, dynamic=True)
    q, k, v = _inputs(torch.float32, b=2, h=2, lq=64, lkv=64, d=16)
    rel = (torch.arange(64).view(-1, 1) - torch.arange(64).view(1, -1)).double() / 64
    for n in (3, 5, 7, 9):
        out = _quiet(compiled, q, k, v, score_mod=make(n))
        scale = (n if make is _offset_by else 0.5 * n if make is _scaled_offset else float(n > 4))
        want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4 + rel * scale, -1) @ v.double()
        assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5, n
    assert backend.frame_count == frames


def _softcap_over(cap):
    def softcap(score, b, h, q, kv):
        return cap * torch.tanh(score / cap)
    return softcap


def test_a_captured_float_under_dynamic_shapes_is_traced_without_a_graph_break():
    """A float in the closure (a soft cap), which dynamo makes a symbolic graph input under dynamic=True: specialised
    too, so the call traces without a graph break into eager, and a second shape reuses the graph."""
    import functools

    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    backend = CompileCounterWithBackend("aot_eager")
    frames = []
    for b, length in ((3, 1024), (6, 512)):
        q, k, v = _inputs(torch.float32, b=b, h=5, lq=length, lkv=length, d=16)
        mask = flexgen.create_block_mask(flexgen.noop_mask, 1, 1, length, length, device="cpu")
        call = functools.partial(flexgen.flex_attention, score_mod=_softcap_over(20.0), block_mask=mask)
        out = _quiet(torch.compile(call, backend=backend, dynamic=True), q, k, v)
        want, _ = _dense(q, k, v, softcap=20.0)
        assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5
        frames.append(backend.frame_count)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert frames[0] == frames[1]  # (the first trace may restart once to specialise the float)


def test_a_function_made_in_the_compiled_region_over_its_values_runs_eagerly():
    """A score_mod made inside the compiled function over a value of the trace (a size there) has no Python
    value flexgen could trace: that call runs through the eager fallback, and gives the right attention."""
    def attend(x, q, k, v):
        bias = x.size(0)
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias * (qi - ki) / 64)

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="aot_eager", dynamic=True)
    for n in (2, 3):
        q, k, v = _inputs(torch.float32, b=n, h=2, lq=64, lkv=64, d=16)
        out = _quiet(compiled, torch.empty(n, 1), q, k, v)
        rel = (torch.arange(64).view(-1, 1) - torch.arange(64).view(1, -1)).double() * n / 64
        s = q.double() @ k.double().transpose(-1, -2) / 4 + rel
        want = torch.softmax(s, -1) @ v.double()
        assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5


def test_a_mask_for_other_lengths_is_refused_under_compile():
    q, k, v = _inputs(torch.float32, lq=128, lkv=128)
    mask = flexgen.create_block_mask(CAUSAL, 1, 1, 256, 256, device="cpu")
    compiled = torch.compile(flexgen.flex_attention, backend="aot_eager", dynamic=True, fullgraph=True)
    with pytest.raises(Exception, match="Q_LEN"):
        _quiet(compiled, q, k, v, block_mask=mask)


def test_a_compiled_create_block_mask_reads_a_captured_window_at_run_time():
    """create_block_mask under torch.compile(dynamic=True), its mask_mod capturing a window that changes between
    calls: one graph, and each window's lists exact (as eager create_block_mask gives them)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def window(w):
        return lambda b, h, q, kv: (q >= kv) & (q - kv < w)

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    make = torch.compile(flexgen.create_block_mask, backend=backend, dynamic=True)
    for w in (40, 70, 100, 130):
        got = make(window(w), None, None, 256, 256, device="cpu", BLOCK_SIZE=32)
        want = flexgen.create_block_mask(window(w), None, None, 256, 256, device="cpu", BLOCK_SIZE=32)
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            a, b = getattr(got, name), getattr(want, name)
            counts = got.kv_num_blocks if name.startswith("kv") else got.full_kv_num_blocks
            if name.endswith("indices"):  # (only the listed slots of each row are defined)
                listed = torch.arange(a.shape[-1]) < counts.unsqueeze(-1)
                a, b = a[listed], b[listed]
            assert torch.equal(a, b), (w, name)
    assert backend.frame_count == 1
