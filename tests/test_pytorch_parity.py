"""Behaviours PyTorch's own FlexAttention tests rely on, on the CPU (the unfused float64 path, and under
torch.compile the custom ops running it): each against a dense float64 reference written out here."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import flexgen
from flexgen import BlockMask


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def _qkv(b=2, h=2, lq=128, lkv=128, d=16, dtype=torch.float32):
    return tuple(torch.randn(b, h, n, d, dtype=dtype) for n in (lq, lkv, lkv))


def _dense(q, k, v, bias=None, visible=None):
    """softmax(q k^T / sqrt(D) + bias, masked) v in float64."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v


class _Pages:
    """A plain object keeping a tensor, as PyTorch's PagedAttention keeps its page tables."""

    def __init__(self, n):
        self.table = torch.randn(n, dtype=torch.float64)


def test_a_tensor_on_a_plain_object_is_found_under_compile():
    pages = _Pages(128)
    mod = lambda s, b, h, q_idx, kv_idx: s + pages.table[kv_idx]  # noqa: E731
    q, k, v = _qkv()
    compiled = torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True)
    out = _quiet(compiled, q, k, v, score_mod=mod)
    assert not torch.isnan(out).any()
    assert (out.double() - _dense(q, k, v, bias=pages.table)).abs().max().item() < 1e-5
    pages.table = pages.table * 3  # rebound: the compiled call reads the new tensor
    out = _quiet(compiled, q, k, v, score_mod=mod)
    assert (out.double() - _dense(q, k, v, bias=pages.table)).abs().max().item() < 1e-5


def test_a_noop_mask_keeps_b_and_h():
    assert flexgen.create_block_mask(flexgen.noop_mask, 4, 2, 512, 256, device="cpu").shape == (4, 2, 512, 256)
    assert flexgen.create_block_mask(flexgen.noop_mask, None, None, 512, 256, device="cpu").shape == (1, 1, 512, 256)


def test_a_sliced_mask_is_refused_before_its_lengths_are_checked():
    mask = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 2, 2, 256, 256, device="cpu")
    q, k, v = _qkv(lq=64, lkv=64)
    with pytest.raises(RuntimeError, match="Cannot use mask_mod from a sliced BlockMask"):
        flexgen.flex_attention(q, k, v, block_mask=mask[1])


def test_pytorchs_messages_for_lengths_and_devices():
    mask = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, 1, 1, 256, 256, device="cpu")
    q, k, v = _qkv(lq=128, lkv=128)
    for error in (ValueError, RuntimeError):  # (older PyTorch raised the one, newer the other)
        with pytest.raises(error, match=r"block_mask was created for a larger length .*_adjust\(128, 128\)"):
            flexgen.flex_attention(q, k, v, block_mask=mask)
    with pytest.raises(RuntimeError, match=r"block_mask was created for a smaller length .* Q_LEN=512, KV_LEN=512\)$"):
        flexgen.flex_attention(*_qkv(lq=512, lkv=512), block_mask=mask)
    meta = torch.empty(q.shape, device="meta")
    with pytest.raises(ValueError, match="Expected query, key, and value to have the same device type"):
        flexgen.flex_attention(q, meta, v)


def test_mismatched_full_lists_are_an_assertion_error():
    n = torch.ones(1, 1, 1, dtype=torch.int32)
    i = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
    with pytest.raises(AssertionError, match="full_kv_num_blocks and full_kv_indices"):
        BlockMask((128, 128), n, i, n, None, None, None, None, None, (128, 128), None)
    with pytest.raises(AssertionError, match="full_q_num_blocks and full_q_indices"):
        BlockMask((128, 128), n, i, None, None, n, i, None, i, (128, 128), None)


def test_a_mask_without_q_lists_attends_and_differentiates():
    counts = torch.tensor([[[1, 2]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=128, compute_q_blocks=False)
    assert mask.q_num_blocks is None and mask.q_indices is None and mask.full_q_num_blocks is None
    q, k, v = (t.double().requires_grad_() for t in _qkv(lq=256, lkv=256))
    out = _quiet(flexgen.flex_attention, q, k, v, block_mask=mask)
    blocks = torch.tensor([[True, False], [True, True]])
    visible = blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = _dense(q64, k64, v64, visible=visible)
    assert (out - want).abs().max().item() < 1e-10
    g = torch.randn_like(want)
    for got, ref in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((want * g).sum(), (q64, k64, v64))):
        assert (got - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize("compiled", [False, True])
def test_tan_in_a_score_mod(compiled):
    mod = lambda s, b, h, q_idx, kv_idx: torch.sin(torch.cos(s)) + torch.tan(b)  # noqa: E731 (PyTorch's _trig)
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    call = torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True) if compiled else flexgen.flex_attention
    out = _quiet(call, q, k, v, score_mod=mod)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) / math.sqrt(q.shape[-1])
    want = torch.softmax(torch.sin(torch.cos(s)) + torch.tan(torch.arange(2.0, dtype=torch.float64))[:, None, None, None], -1) @ v64
    assert (out - want).abs().max().item() < 1e-10
    (got,), (ref,) = torch.autograd.grad(out.sum(), (q,)), torch.autograd.grad(want.sum(), (q64,))
    assert (got - ref).abs().max().item() < 1e-10


def test_new_zeros_of_an_index_shape_under_compile():
    """PyTorch's test_new_empty_mask_mod: a mod's values are 0-d, so h.new_zeros(h.shape) is the scalar 0."""
    n = 128
    keep = torch.rand(3, 1, n, n) > 0.3
    keep[..., 0] = True  # every row sees a key

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + keep[b, h.new_zeros(h.shape), q_idx, kv_idx]

    def mask_mod(b, h, q_idx, kv_idx):
        return keep[b, h.new_zeros(h.shape), q_idx, kv_idx]

    q, k, v = _qkv(b=3, h=1, lq=n, lkv=n)
    mask = flexgen.create_block_mask(mask_mod, B=3, H=None, Q_LEN=n, KV_LEN=n, device="cpu")
    out = _quiet(torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True), q, k, v, score_mod,
                 block_mask=mask)
    want = _dense(q, k, v, bias=keep.double(), visible=keep)
    assert not torch.isnan(out).any() and (out.double() - want).abs().max().item() < 1e-5


def test_the_unfused_output_keeps_the_querys_dimension_order():
    q = torch.randn(4, 2, 64, 16).transpose(0, 1)  # (B, H, L, D) with H outermost in memory
    k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    out = _quiet(flexgen.flex_attention, q, k, v)
    assert out.stride() == q.stride()
    assert (out.double() - _dense(q, k, v)).abs().max().item() < 1e-5


def _deinterleave(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    return (code | (code >> 4)) & 0x00FF00FF


def _morton_window(b, h, q_idx, kv_idx):
    """attention-gym's Morton-order neighbourhood mask: integer &, | and >> on the indices."""
    qx, qy = _deinterleave(q_idx), _deinterleave(q_idx >> 1)
    kx, ky = _deinterleave(kv_idx), _deinterleave(kv_idx >> 1)
    return ((qx - kx).abs() <= 2) & ((qy - ky).abs() <= 2) | ((q_idx ^ kv_idx) == 0)


def test_integer_bitwise_operators_in_a_mask_mod():
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    n = 256
    mask = flexgen.create_block_mask(_morton_window, 1, 1, n, n, device="cpu", BLOCK_SIZE=32)
    assert torch.equal(mask.to_dense(), torch_block_mask(_morton_window, 1, 1, n, n, device="cpu", BLOCK_SIZE=32).to_dense())
    idx = torch.arange(n)
    visible = _morton_window(0, 0, idx[:, None], idx[None, :])
    q, k, v = _qkv(b=1, lq=n, lkv=n)
    for call in (flexgen.flex_attention, torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True)):
        out = _quiet(call, q, k, v, block_mask=mask)
        assert (out.double() - _dense(q, k, v, visible=visible)).abs().max().item() < 1e-5
    mod = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: ((q_idx | kv_idx) & 3) == (q_idx ^ (kv_idx & 5)))
    assert flexgen.mask_mod(str(mod).split(": ", 1)[1]).expr == mod.expr  # the text form reads back the same


def test_pytorchs_backend_option_checks():
    q = torch.randn(1, 1, 16, 16)
    with pytest.raises(RuntimeError, match="BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION"):
        flexgen.flex_attention(q, q, q, kernel_options={"BACKEND": "TRITON", "FORCE_USE_FLEX_ATTENTION": True})
    with pytest.raises(ValueError, match="Invalid BACKEND value"):
        flexgen.flex_attention(q, q, q, kernel_options={"BACKEND": "CUTE"})


def test_create_block_mask_compiles_into_one_graph():
    """torch.compile(create_block_mask, fullgraph=True), as PyTorch's tests call it: the same blocks as eager, and
    after one recompile for a new length (automatic dynamic shapes) none for the next."""
    from torch._dynamo.testing import CompileCounterWithBackend

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    torch._dynamo.reset()
    backend = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(flexgen.create_block_mask, fullgraph=True, backend=backend)
    for n, frames in ((512, 1), (256, 2), (384, 2)):
        mask = compiled(causal, 1, 1, n, n, device="cpu")
        want = flexgen.create_block_mask(causal, 1, 1, n, n, device="cpu")
        assert isinstance(mask, BlockMask) and mask.shape == (1, 1, n, n)
        assert torch.equal(mask.to_dense(), want.to_dense()) and backend.frame_count == frames


def test_a_mask_built_inside_a_compiled_function():
    doc = torch.randint(0, 4, (256,)).sort().values

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def attend(q, k, v):
        mask = flexgen.create_block_mask(document_causal, None, None, q.shape[-2], k.shape[-2], device="cpu", BLOCK_SIZE=64)
        return flexgen.flex_attention(q, k, v, block_mask=mask)

    q, k, v = _qkv(lq=256, lkv=256)
    out = _quiet(torch.compile(attend, fullgraph=True, backend="aot_eager"), q, k, v)
    idx = torch.arange(256)
    visible = (doc[idx][:, None] == doc[idx][None, :]) & (idx[:, None] >= idx[None, :])
    assert not torch.isnan(out).any() and (out.double() - _dense(q, k, v, visible=visible)).abs().max().item() < 1e-5


@pytest.mark.skipif(__import__("importlib").util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")
def test_the_bitwise_mask_compiles_for_hopper(tmp_path, monkeypatch):
    """The kernels spell &, | and ^ on integers as C does; NVRTC builds the sm90 forward and backward of that mask."""
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path))
    mod = flexgen.mask_mod(_morton_window)
    for kind in ("fwd", "bwd"):
        source = flexgen.emit(kind, None, mod, head_dim=64, arch="sm_90a")
        assert " & 1431655765" in source and " | " in source and " ^ " in source
        kernel = flexgen.compile(kind, None, mod, head_dim=64, arch="sm_90a")
        assert kernel.cubin[:4] == b"\x7fELF"


def test_bitwise_not_of_an_integer_wraps_as_torch():
    """~x on int32 indices is -x - 1, at the type's ends too, as torch computes it."""
    mod = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: (~q_idx & 7) == (kv_idx & 7))
    q_idx = torch.tensor([-2**31, -1, 0, 5, 2**31 - 1], dtype=torch.int32)[:, None]
    kv_idx = torch.arange(16, dtype=torch.int32)[None, :]
    got = mod.evaluate(b=torch.tensor(0), h=torch.tensor(0), q_idx=q_idx, kv_idx=kv_idx)
    assert torch.equal(got, (~q_idx & 7) == (kv_idx & 7))
    with pytest.raises(Exception, match="bool or integer operand"):
        flexgen.score_mod(lambda s, b, h, q_idx, kv_idx: ~s)


def test_pagedattention_converts_a_flexgen_mask_and_attends_over_its_pages():
    """PyTorch's PagedAttention views the mask's lists flat per batch (`kv_indices.view(B, -1)`), so a mask made
    with B and H has them laid out as PyTorch's create_block_mask does; attention over the scattered pages then
    equals attention over the logical keys."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    b, h, n, d, page = 2, 2, 384, 16, 128
    mask = flexgen.create_block_mask(flexgen.variants.causal, b, h, n, n, device="cpu")
    assert mask.kv_indices.is_contiguous() and mask.kv_indices.view(b, -1).shape == (b, h * 3 * 3)
    pages = PagedAttention(n_pages=2 * b * n // page, page_size=page, max_batch_size=b, device="cpu")
    for i, length in enumerate((n // 3, n)):  # interleaved reservations scatter the second sequence's pages
        pages.reserve(torch.tensor(i), torch.tensor(length))
    pages.reserve(torch.tensor(0), torch.tensor(n))
    q, k, v = _qkv(b, h, n, n, d)
    k_cache, v_cache = (torch.zeros(1, h, 2 * b * n, d) for _ in range(2))
    pages.assign(torch.arange(b), torch.arange(n).expand(b, -1).contiguous(), k, v, k_cache, v_cache)
    paged_mask = pages.convert_logical_block_mask(mask)
    out = _quiet(flexgen.flex_attention, q, k_cache, v_cache, block_mask=paged_mask)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    assert not torch.isnan(out).any()
    assert (out.double() - _dense(q, k, v, visible=visible)).abs().max().item() < 1e-5


def test_a_negative_buffer_index_counts_from_the_end_as_torch_indexing_does():
    """PyTorch's eager FlexAttention indexes captured tensors with torch's indexing, where -1 is the last element
    (a paged score_mod reads at negative positions for unmapped pages and discards them with a where)."""
    n = 64
    table = torch.randn(n, dtype=torch.float64)
    q, k, v = _qkv(1, 2, n, n)
    out = _quiet(flexgen.flex_attention, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[kv_idx - 8])
    assert not torch.isnan(out).any()
    assert (out.double() - _dense(q, k, v, bias=table[torch.arange(n) - 8])).abs().max().item() < 1e-5
    with pytest.raises(IndexError, match=r"index range \[-72, -9\] but the size is 64"):
        _quiet(flexgen.flex_attention, q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[kv_idx - 72])


def test_a_read_out_of_range_that_a_where_discards_is_allowed():
    """PyTorch's PagedAttention calls the user's score_mod at the positions of unmapped pages too and discards what
    it returns with a where (its test_load_rel_bias then reads past the end of the bias); a read whose value reaches
    the result still raises, however the where is nested."""
    n = 64
    table = torch.randn(n, dtype=torch.float64)
    q, k, v = _qkv(1, 2, n, n)
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    inside = qi + ki < n

    def discarded(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx + kv_idx < n, s + table[q_idx + kv_idx], -float("inf"))

    out = _quiet(flexgen.flex_attention, q, k, v, score_mod=discarded)
    bias = torch.where(inside, table[(qi + ki).clamp(max=n - 1)], 0.0)
    assert not torch.isnan(out).any()
    assert (out.double() - _dense(q, k, v, bias=bias, visible=inside)).abs().max().item() < 1e-5

    def kept(s, b, h, q_idx, kv_idx):  # the out-of-range reads are the ones the where keeps
        return torch.where(q_idx + kv_idx < n, -float("inf"), s + table[q_idx + kv_idx])

    def nested(s, b, h, q_idx, kv_idx):  # kept by the outer where wherever the inner one passes them on
        return torch.where(q_idx < 60, torch.where(kv_idx < 60, s, s + table[q_idx + kv_idx]), s)

    for mod in (kept, nested, lambda s, b, h, q_idx, kv_idx: s + table[q_idx + kv_idx]):
        with pytest.raises(IndexError, match=r"'table' read out of range in dimension 0: index range \[0, 126\]"):
            _quiet(flexgen.flex_attention, q, k, v, score_mod=mod)


def test_pytorch_paged_score_mod_reading_past_its_bias():
    """PyTorch's test_load_rel_bias through its PagedAttention: the score_mod reads rel_bias[q - kv + n] at the
    logical positions of unmapped pages (negative), past the end of rel_bias, and the wrapper discards them."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    b, h, n, d, page = 2, 2, 128, 16, 32
    rel_bias = torch.randn(2 * n, dtype=torch.float64)

    def bias_mod(score, b, h, q_idx, kv_idx):
        return score + rel_bias[(q_idx - kv_idx) + n]

    pages = PagedAttention(n_pages=4 * b * n // page, page_size=page, max_batch_size=b, device="cpu")
    for i in range(b):
        pages.reserve(torch.tensor(i), torch.tensor(n))
    q, k, v = _qkv(b, h, n, n, d)
    k_cache, v_cache = (torch.zeros(1, h, 4 * b * n, d) for _ in range(2))
    pages.assign(torch.arange(b), torch.arange(n).expand(b, -1).contiguous(), k, v, k_cache, v_cache)
    mask = flexgen.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, b, h, n, n, device="cpu",
                                     BLOCK_SIZE=page)
    paged_mask = pages.convert_logical_block_mask(mask)
    out = _quiet(flexgen.flex_attention, q, k_cache, v_cache, score_mod=pages.get_score_mod(bias_mod),
                 block_mask=paged_mask)
    bias = rel_bias[torch.arange(n)[:, None] - torch.arange(n)[None, :] + n]
    assert not torch.isnan(out).any()
    assert (out.double() - _dense(q, k, v, bias=bias)).abs().max().item() < 1e-5


def test_a_mask_capturing_numbers_compiles_whole_and_is_guarded_on_their_values():
    """PyTorch's sliding-window test captures an int; some dynamo versions take no id() of a constant."""
    from flexgen.compiled_mods import _guard_ident

    assert _guard_ident(64) == ("value", 64) and _guard_ident(None) == ("value", None)
    table = torch.zeros(3)
    assert _guard_ident(table) == ("id", id(table))

    def sliding(window):
        return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    q, k, v = _qkv(1, 2, 196, 196)
    compiled = torch.compile(flexgen.flex_attention, backend="aot_eager", fullgraph=True)
    for window in (64, 16):
        mask = flexgen.create_block_mask(sliding(window), None, None, 196, 196, device="cpu")
        out = _quiet(compiled, q, k, v, block_mask=mask)
        i = torch.arange(196)
        visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= window)
        assert (out.double() - _dense(q, k, v, visible=visible)).abs().max().item() < 1e-5


def test_a_score_mod_capturing_a_dynamic_size_inside_a_compiled_module():
    """PyTorch's test_symbol_closure_in_score_mod: the score_mod adds the batch size, a symbol under dynamic=True."""
    class AddBatch(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[0]
            return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + n)

    model = torch.compile(AddBatch(), dynamic=True, backend="aot_eager")
    for batch in (2, 3):
        q, k, v = _qkv(batch, 2, 64, 64)
        out = _quiet(model, q, k, v)
        expected = _dense(q, k, v, bias=torch.full((64, 64), float(batch), dtype=torch.float64))
        assert (out.double() - expected).abs().max().item() < 1e-5


class _Biases:
    def __init__(self, b, h, n):
        self.table = torch.randn(4, b, h, n, dtype=torch.float64)

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[1][b, h][q_idx]  # bias[1] is a view made while the function is traced


def test_a_view_of_a_captured_tensor_is_found_eager_and_under_compile():
    """PyTorch's test_index_weird1: a score_mod reads `bias[0][b, h][q_idx]`."""
    b, h, n = 2, 2, 64
    biases = _Biases(b, h, n)
    q, k, v = _qkv(b, h, n, n)
    compiled = torch.compile(flexgen.flex_attention, backend="aot_eager")
    for _ in range(2):  # the second round after the table is rebound: no stale view
        expected = _dense(q, k, v, bias=biases.table[1][:, :, :, None])
        for run in (flexgen.flex_attention, flexgen.flex_attention, compiled):
            out = _quiet(run, q, k, v, score_mod=biases.score_mod)
            assert (out.double() - expected).abs().max().item() < 1e-5
        biases.table = torch.randn(4, b, h, n, dtype=torch.float64)


def test_leading_index_finds_integer_views_only():
    from flexgen.captures import _leading_index

    base = torch.randn(4, 3, 5)
    assert _leading_index(base, base[2]) == (2,) and _leading_index(base, base[3, 1]) == (3, 1)
    assert _leading_index(base, base[:, 1]) is None  # not a leading index
    assert _leading_index(base, base[2].t()) is None and _leading_index(base, base[1, :, 2:]) is None
