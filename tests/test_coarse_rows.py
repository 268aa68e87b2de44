"""runtime/coarse_rows.py: a block mask over 192-row query tiles (the sm90 forward at D = 64) or 80-row ones (the sm90
backward's steps at D = 128, with transposed lists) shows every element as the mask itself does."""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen.blockmask import lists_to_dense
from flexgen.runtime.coarse_rows import coarse_rows


def _state(bm) -> torch.Tensor:
    """(B, H, nQ, nKV): 0 absent, 1 partial (mask_mod decides), 2 full."""
    cols = bm.kv_indices.shape[-1]
    state = lists_to_dense(bm.kv_num_blocks, bm.kv_indices, cols).to(torch.int8)
    if bm.full_kv_num_blocks is not None:
        state = state + 2 * lists_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, cols).to(torch.int8)
    return state


def _visible(bm, mask_fn, batch: int, heads: int) -> torch.Tensor:
    """Each element's visibility as a kernel walking `bm` gives it: full blocks whole, partial ones through mask_fn."""
    q_len, kv_len = bm.seq_lengths
    bq, bkv = bm.BLOCK_SIZE
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    state = _state(bm)
    out = torch.empty(batch, heads, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            s = state[min(b, state.shape[0] - 1), min(h, state.shape[1] - 1)][q // bq, kv // bkv]
            out[b, h] = (s == 2) | ((s == 1) & mask_fn(torch.tensor(b), torch.tensor(h), q, kv))
    return out


def _sliding(b, h, q, kv):
    return (q >= kv) & (q - kv < 300)


def _prefix(b, h, q, kv):
    return (kv < 200) | (q >= kv)


def _per_head(b, h, q, kv):
    return (q >= kv) & ((q - kv) % (h + 2) != 1)


@pytest.mark.parametrize("mask_fn,heads", [(lambda b, h, q, kv: q >= kv, None), (_sliding, None), (_prefix, None),
                                           (_per_head, 3)])
@pytest.mark.parametrize("q_len,kv_len,block", [(1000, 1000, 128), (777, 1100, 128), (1100, 700, 64), (191, 193, 128),
                                                (2048, 2048, 64)])
@pytest.mark.parametrize("rows", [192, 80])
def test_coarse_rows_show_every_element_as_the_mask(mask_fn, heads, q_len, kv_len, block, rows):
    bm = flexgen.create_block_mask(mask_fn, None, heads, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    coarse = coarse_rows(bm, rows, q_lists=rows == 80)
    assert coarse.BLOCK_SIZE == (rows, block) and coarse.seq_lengths == (q_len, kv_len)
    assert coarse.kv_indices.shape[-2:] == (-(-q_len // rows), bm.kv_indices.shape[-1])
    if rows == 80:  # the backward's lists: per KV block, the query tiles in the same states, full ones apart
        assert coarse.q_num_blocks is not None
        q_cols = coarse.q_indices.shape[-1]
        q_state = lists_to_dense(coarse.q_num_blocks, coarse.q_indices, q_cols).to(torch.int8)
        q_state += 2 * lists_to_dense(coarse.full_q_num_blocks, coarse.full_q_indices, q_cols).to(torch.int8)
        assert torch.equal(q_state.transpose(-2, -1), _state(coarse))
    else:
        assert coarse.q_num_blocks is None
    assert coarse.kv_num_blocks.dtype == torch.int32 and coarse.kv_indices.dtype == torch.int32
    h = heads or 1
    want = _visible(bm, mask_fn, 1, h)
    assert torch.equal(_visible(coarse, mask_fn, 1, h), want)
    q, kv = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    for head in range(h):  # and both are the mask itself
        assert torch.equal(want[0, head], mask_fn(torch.tensor(0), torch.tensor(head), q, kv))
    # a block is full for a tile only if full for every row of it: causal keeps most blocks full
    if q_len >= 1000 and mask_fn(torch.tensor(0), torch.tensor(0), torch.tensor(999), torch.tensor(0)):
        assert int(coarse.full_kv_num_blocks.sum()) > 0


def test_coarse_rows_are_cached_per_mask_and_follow_in_place_changes():
    bm = flexgen.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 1024, 1024, device="cpu")
    first = coarse_rows(bm, 192)
    assert coarse_rows(bm, 192) is first
    same_tensors = flexgen.BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks,
                                                    bm.full_kv_indices, bm.BLOCK_SIZE, bm.mask_mod, bm.seq_lengths)
    assert coarse_rows(same_tensors, 192) is first  # a model's layers rebuild the mask around the same tensors
    bm.kv_num_blocks.zero_()  # every partial block dropped
    assert coarse_rows(bm, 192) is not first
    assert int(coarse_rows(bm, 192).kv_num_blocks.sum()) < int(first.kv_num_blocks.sum())
    big = flexgen.create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 1024, 1024, device="cpu", BLOCK_SIZE=384)
    assert coarse_rows(big, 192) is big  # query blocks already a multiple of the tile


def test_block_tiles_check_takes_any_query_block_for_the_sm90_forward():
    """The check a traced call runs (ops.check_traced_call) before any launch agrees with what the forward walks: a
    192-row tile under 128- or 64-row blocks is fine; KV blocks must still be multiples of the tile's."""
    from flexgen import variants as V
    from flexgen.codegen.api import make_spec
    from flexgen.runtime.forward import check_block_tiles

    def causal(b, h, q, kv):
        return q >= kv

    for block in ((128, 128), (64, 128)):
        bm = flexgen.create_block_mask(causal, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=block)
        spec = make_spec("fwd", None, V.causal, head_dim=64, arch="sm_90a", family="sm90", mask_block=block)
        assert spec.block_m == 192
        check_block_tiles(bm, spec)
    bm = flexgen.create_block_mask(causal, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=(128, 64))
    with pytest.raises(ValueError, match="multiple of the kernel tile"):
        check_block_tiles(bm, spec)


def test_only_lists_computed_from_the_mask_mod_are_walked_in_unions():
    """A union of query blocks is exact only where absent and full blocks agree with mask_mod: lists from
    create_block_mask (and what keeps them: to, _adjust, broadcasting), not hand-made ones, slices, or a mask
    whose mask_mod was replaced."""
    from flexgen.codegen.api import make_spec
    from flexgen.runtime.forward import kernel_block_mask

    def causal(b, h, q, kv):
        return q >= kv

    made = flexgen.create_block_mask(causal, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=(64, 128))
    assert made.blocks_follow_mask_mod and made.to("cpu").blocks_follow_mask_mod
    assert made._adjust(500, 600).blocks_follow_mask_mod and made._broadcast_to(2, 3).blocks_follow_mask_mod
    hand = flexgen.BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                            made.full_kv_indices, made.BLOCK_SIZE, made.mask_mod, made.seq_lengths)
    assert not hand.blocks_follow_mask_mod and not made[0].blocks_follow_mask_mod
    assert not flexgen.blockmask.block_sparse_mask(torch.ones(1, 1, 8, 8, dtype=torch.bool)).blocks_follow_mask_mod
    replaced = made.to("cpu")
    replaced.mask_mod = lambda b, h, q, kv: q >= kv
    assert not replaced.blocks_follow_mask_mod
    q = k = torch.empty(1, 1, 1000, 64)
    spec = make_spec("fwd", None, causal, head_dim=64, arch="sm_90a", mask_block=(64, 128))
    assert spec.block_m == 192
    assert kernel_block_mask(made, q, k, spec).BLOCK_SIZE == (192, 128)
    with pytest.raises(ValueError, match="multiple of the kernel tile"):
        kernel_block_mask(hand, q, k, spec)
    hand_spec = make_spec("fwd", None, causal, head_dim=64, arch="sm_90a", mask_block=(128, 128),
                          blocks_follow_mask=False)
    made_128 = flexgen.create_block_mask(causal, None, None, 1000, 1000, device="cpu")
    hand_128 = flexgen.BlockMask.from_kv_blocks(made_128.kv_num_blocks, made_128.kv_indices, made_128.full_kv_num_blocks,
                                                made_128.full_kv_indices, 128, causal, (1000, 1000))
    assert hand_spec.block_m == 128 and kernel_block_mask(hand_128, q, k, hand_spec) is hand_128


def test_hand_made_query_blocks_below_every_tile_are_refused_before_a_launch(monkeypatch):
    """32-row query blocks made by hand: no forward tile is that short (16 rows per warp, 4 warps), and a union
    would not be exact, so the kernels' own check says what the tile needs (flex_attention sends such a mask to the
    unfused path before it gets there: tests/test_unfused_path.py)."""
    import flexgen.arch
    from flexgen.runtime.forward import kernel_block_mask
    from flexgen.runtime.plan import make_spec

    def causal(b, h, q, kv):
        return q >= kv

    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")
    made = flexgen.create_block_mask(causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=(32, 128))
    hand = flexgen.BlockMask.from_kv_blocks(made.kv_num_blocks, made.kv_indices, made.full_kv_num_blocks,
                                            made.full_kv_indices, made.BLOCK_SIZE, made.mask_mod, made.seq_lengths)
    q = torch.empty(1, 1, 512, 128, dtype=torch.bfloat16)
    spec = make_spec("fwd", q, None, flexgen.variants.causal, None, mask_block=(32, 128))
    assert (spec.family, spec.block_m) == ("sm80", 64)
    with pytest.raises(ValueError, match=r"BLOCK_SIZE \(32, 128\) must be a multiple of the kernel tile \(64, 64\)"):
        kernel_block_mask(hand, q, q, spec)
    made_spec = make_spec("fwd", q, None, flexgen.variants.causal, None, mask_block=(32, 128), blocks_follow_mask=True)
    # (a causal forward at D = 128 takes 192-row tiles, which walk the union of six 32-row blocks)
    assert made_spec.family == "sm90" and kernel_block_mask(made, q, q, made_spec).BLOCK_SIZE == (192, 128)
