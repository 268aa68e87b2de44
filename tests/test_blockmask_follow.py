"""blockmask_follow.py: PyTorch's masks whose lists agree with their mask_mod are adopted as flexgen's own, so that
a kernel tile may walk the union of their query blocks; lists that disagree anywhere are walked as they are."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

import flexgen
from flexgen import attention
from flexgen.blockmask import BlockMask, dense_to_lists, lists_to_dense
from flexgen.blockmask_follow import adopt_if_lists_follow, lists_follow
from flexgen.variant import mod_parts


def causal(b, h, q, kv):
    return q >= kv


def sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < 200)


def per_head(b, h, q, kv):
    return (q >= kv) & (q - kv < 64 * (h + 1))


def _adopted(torch_mask) -> BlockMask:
    bm = BlockMask.from_torch(torch_mask)
    assert not bm.blocks_follow_mask_mod
    return adopt_if_lists_follow(bm, *mod_parts(bm.mask_mod, "mask"))


@pytest.mark.parametrize("mask_fn,heads", [(causal, None), (sliding, None), (per_head, 4)])
@pytest.mark.parametrize("block", [(32, 128), (64, 64), (128, 128)])
def test_pytorch_masks_from_their_mask_mod_are_adopted(mask_fn, heads, block):
    torch_mask = torch_create_block_mask(mask_fn, None, heads, 700, 900, device="cpu", BLOCK_SIZE=block)
    assert _adopted(torch_mask).blocks_follow_mask_mod


def _states_of(bm):
    cols = bm.kv_indices.shape[-1]
    return (lists_to_dense(bm.kv_num_blocks, bm.kv_indices, cols),
            lists_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, cols))


def test_lists_that_hide_or_show_more_than_the_mask_mod_are_not_adopted():
    made = torch_create_block_mask(causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=(64, 128))
    partial, full = _states_of(made)
    dropped = partial.clone()
    dropped[..., 5, 2] = False  # a block the mask_mod shows some of, left out
    promoted_partial, promoted_full = partial.clone(), full.clone()
    promoted_partial[..., 4, 2], promoted_full[..., 4, 2] = False, True  # a diagonal block called full
    for p, f in ((dropped, full), (promoted_partial, promoted_full)):
        hand = TorchBlockMask.from_kv_blocks(*dense_to_lists(p), *dense_to_lists(f), BLOCK_SIZE=(64, 128),
                                             mask_mod=causal, seq_lengths=(512, 512))
        assert not _adopted(hand).blocks_follow_mask_mod
    # A block the mask_mod hides whole, listed as partial, is harmless: mask_mod decides it.
    extra = partial.clone()
    extra[..., 0, 3] = True
    hand = TorchBlockMask.from_kv_blocks(*dense_to_lists(extra), *dense_to_lists(full), BLOCK_SIZE=(64, 128),
                                         mask_mod=causal, seq_lengths=(512, 512))
    assert _adopted(hand).blocks_follow_mask_mod


def test_shared_lists_of_a_mask_that_reads_the_head_are_not_adopted():
    one_head = torch_create_block_mask(per_head, None, None, 512, 512, device="cpu")  # lists of head 0 for all
    assert not lists_follow(BlockMask.from_torch(one_head), flexgen.mask_mod(per_head))


def test_adoption_is_cached_per_mask_and_skipped_for_buffer_reading_masks():
    torch_mask = torch_create_block_mask(causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=(64, 128))
    bm = BlockMask.from_torch(torch_mask)
    token, buffers = mod_parts(bm.mask_mod, "mask")
    calls = []
    real = lists_follow

    def counting(*args):
        calls.append(1)
        return real(*args)

    import flexgen.blockmask_follow as follow

    follow.lists_follow = counting  # (what _checked calls)
    try:
        assert adopt_if_lists_follow(bm, token, buffers).blocks_follow_mask_mod
        assert adopt_if_lists_follow(BlockMask.from_torch(torch_mask), token, buffers).blocks_follow_mask_mod
    finally:
        follow.lists_follow = real
    assert len(calls) == 1
    docs = torch.zeros(512, dtype=torch.int32)
    doc_mask = flexgen.variants.document(docs)
    assert adopt_if_lists_follow(bm, *mod_parts(doc_mask, "mask")) is bm  # (its lists would need the buffer)


def test_flex_attention_runs_adopted_short_blocks_on_the_kernels(monkeypatch):
    """A PyTorch mask of 32-row blocks from its mask_mod goes on to the kernels, adopted; the same lists with a
    block left out go to the unfused path (these are CPU tensors: their own reason is set aside)."""
    routed, keys = [], []
    monkeypatch.setattr(attention, "unfused_reason", lambda q, v: None)
    monkeypatch.setattr(attention, "_unfused_attention", lambda reason, *args: routed.append(reason) or "unfused")

    def stop_at_the_variant(*args):
        keys.append(args)
        raise LookupError("stop")

    import flexgen.variant

    monkeypatch.setattr(flexgen.variant, "variant_key", stop_at_the_variant)
    q = k = v = torch.randn(1, 1, 256, 64, dtype=torch.bfloat16)
    made = torch_create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=(32, 128))
    with pytest.raises(LookupError, match="stop"):
        flexgen.flex_attention(q, k, v, block_mask=made)
    assert keys[0][-1] is True and not routed  # blocks_follow_mask
    partial, full = _states_of(made)
    partial[..., 7, 1] = False
    hand = TorchBlockMask.from_kv_blocks(*dense_to_lists(partial), *dense_to_lists(full), BLOCK_SIZE=(32, 128),
                                         mask_mod=causal, seq_lengths=(256, 256))
    assert flexgen.flex_attention(q, k, v, block_mask=hand) == "unfused" and "32-row" in routed[0]


def test_masks_past_the_classification_budget_are_walked_as_they_are(monkeypatch):
    import flexgen.blockmask_follow as follow

    torch_mask = torch_create_block_mask(causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=(64, 128))
    bm = BlockMask.from_torch(torch_mask)
    mod = flexgen.mask_mod(causal)
    assert lists_follow(bm, mod)
    monkeypatch.setattr(follow, "MAX_BLOCKS", 8 * 4 - 1)
    assert not lists_follow(bm, mod)
