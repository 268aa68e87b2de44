"""BlockMask's public surface against PyTorch's FlexAttention on the CPU: what the constructors
refuse (before any kernel could read past a tensor), and the methods a port calls (shape, numel,
indexing, to_string, as_tuple, create_mask, device=None), compared with torch's own answers."""
from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

import flexgen
from flexgen import variants as V
from flexgen.blockmask import BlockMask, block_sparse_mask, create_mask
from flexgen.make_block_mask import create_block_mask

fa = pytest.importorskip("torch.nn.attention.flex_attention")


def causal(b, h, q, kv):
    return q >= kv


def per_head_window(b, h, q, kv):
    return (q >= kv) & (q - kv < 64 * (h + 1) + 32 * b)


def listed_first(dense):
    """(counts, indices) of a (..., nQ, nKV) boolean layout, each row's listed blocks first."""
    order = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True)
    return dense.sum(-1).to(torch.int32), order.to(torch.int32)


def random_lists(g, B, H, n_q, n_kv):
    """A random layout as (counts, indices), and its dense form."""
    dense = torch.rand(B, H, n_q, n_kv, generator=g) < 0.5
    return (*listed_first(dense), dense)


# ---------------------------------------------------------------- from_kv_blocks refuses bad input


def _valid_lists():
    g = torch.Generator().manual_seed(1)
    counts, indices, _ = random_lists(g, 2, 3, 4, 5)
    return counts, indices


@pytest.mark.parametrize("block_size", [0, -128, (64, 0), (128, -8), True, 128.0, (128,), "128"])
def test_from_kv_blocks_refuses_block_size(block_size):
    counts, indices = _valid_lists()
    with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int"):
        BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=block_size)


def _bad_lists(case):
    counts, indices = _valid_lists()
    if case == "negative count":
        counts[1, 2, 3] = -1
    elif case == "count past the row":
        counts[0, 0, 0] = indices.shape[-1] + 1
    elif case == "negative index":
        counts[0, 1, 2] = 2
        indices[0, 1, 2, 1] = -1
    elif case == "index past the end":
        counts[1, 0, 1] = 1
        indices[1, 0, 1, 0] = indices.shape[-1]
    elif case == "repeated index":
        counts[0, 0, 0] = 2
        indices[0, 0, 0, :2] = 3
    return counts, indices


@pytest.mark.parametrize("case,message", [
    ("negative count", r"kv_num_blocks must lie in \[0, 5\]"),
    ("count past the row", r"kv_num_blocks must lie in \[0, 5\]"),
    ("negative index", r"lists KV block -1; block numbers must lie in \[0, 5\)"),
    ("index past the end", r"lists KV block 5; block numbers must lie in \[0, 5\)"),
    ("repeated index", r"more than once in row \(0, 0, 0\)"),
])
def test_from_kv_blocks_refuses_bad_lists(case, message):
    counts, indices = _bad_lists(case)
    with pytest.raises(ValueError, match=message):
        BlockMask.from_kv_blocks(counts, indices)


def test_from_kv_blocks_checks_indices_against_the_sequence():
    counts, indices = _valid_lists()
    # 5 columns of 128, but KV_LEN = 300 has only 3 blocks: a listed block 3 or 4 lies past the keys
    with pytest.raises(ValueError, match=r"block numbers must lie in \[0, 3\)"):
        BlockMask.from_kv_blocks(counts, indices, seq_lengths=(512, 300))
    dense = BlockMask.from_kv_blocks(counts, indices).to_dense().bool()
    dense[..., 3:] = False
    bm = BlockMask.from_kv_blocks(*listed_first(dense), seq_lengths=(512, 300))
    assert bm.shape == (2, 3, 512, 300) and torch.equal(bm.to_dense().bool(), dense)


@pytest.mark.parametrize("make,error,message", [
    (lambda c, i: (c.tolist(), i), TypeError, "kv_num_blocks must be a torch.Tensor of integers, got list"),
    (lambda c, i: (c, i.tolist()), TypeError, "kv_indices must be a torch.Tensor of integers, got list"),
    (lambda c, i: (c.float(), i), TypeError, "must hold integers"),
    (lambda c, i: (c, i.bool()), TypeError, "must hold integers"),
    (lambda c, i: (c[:, :, :2], i), ValueError, "without its last dimension"),
    (lambda c, i: (c[0, 0, 0], i[0, 0, 0]), ValueError, r"must have shape \(B, H, nQ, nKV\)"),
    (lambda c, i: (c[None], i[None]), ValueError, r"must have shape \(B, H, nQ, nKV\)"),
])
def test_from_kv_blocks_refuses_bad_tensors(make, error, message):
    counts, indices = make(*_valid_lists())
    with pytest.raises(error, match=message):
        BlockMask.from_kv_blocks(counts, indices)


def test_from_kv_blocks_refuses_inconsistent_full_lists():
    g = torch.Generator().manual_seed(2)
    counts, indices, dense = random_lists(g, 1, 2, 4, 4)
    with pytest.raises(ValueError, match="given together"):
        BlockMask.from_kv_blocks(counts, indices, full_kv_num_blocks=counts)
    with pytest.raises(ValueError, match="listed in both kv_indices and full_kv_indices"):
        BlockMask.from_kv_blocks(counts, indices, counts, indices)
    tall_counts, tall, _ = random_lists(g, 1, 2, 5, 4)
    with pytest.raises(ValueError, match=r"must match kv_indices .* in nQ"):
        BlockMask.from_kv_blocks(counts, indices, tall_counts, tall)
    with pytest.raises(ValueError, match="seq_lengths must be a"):
        BlockMask.from_kv_blocks(counts, indices, seq_lengths=(0, 512))
    with pytest.raises(ValueError, match=r"kv_indices lists KV block 4; block numbers must lie in \[0, 4\)"):
        BlockMask.from_kv_blocks(torch.ones(1, 1, 4, dtype=torch.int32), torch.full((1, 1, 4, 1), 4),
                                 seq_lengths=(512, 512))


def _compacted(indices: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return indices[..., :max(int(counts.max()), 1)].contiguous()


def test_from_kv_blocks_takes_lists_compacted_to_the_longest_row():
    """PyTorch's masks may keep only as many columns as the longest list: the mask is the one the full-width lists
    describe (the lists themselves are kept as given), and its q lists have a column per query block."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(2, 3, 6, 9, generator=g) < 0.3
    dense[..., 0, 8] = True  # (a block past the longest row's width)
    full = (torch.rand(2, 3, 6, 9, generator=g) < 0.2) & ~dense
    (counts, indices), (fcounts, findices) = listed_first(dense), listed_first(full)
    wide = BlockMask.from_kv_blocks(counts, indices, fcounts, findices, BLOCK_SIZE=16, seq_lengths=(90, 140))
    narrow_kv, narrow_full = _compacted(indices, counts), _compacted(findices, fcounts)
    assert narrow_kv.shape[-1] < 9
    narrow = BlockMask.from_kv_blocks(counts, narrow_kv, fcounts, narrow_full, BLOCK_SIZE=16, seq_lengths=(90, 140))
    assert narrow.kv_indices.shape == narrow_kv.shape and torch.equal(narrow.kv_indices, narrow_kv)
    assert torch.equal(narrow.to_dense(), wide.to_dense()) and narrow.to_dense().shape[-1] == 9
    assert narrow.sparsity() == wide.sparsity()
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(narrow, name), getattr(wide, name)), name
    adopted = BlockMask.from_torch(narrow)
    assert adopted.kv_indices.shape[-1] == 9 and torch.equal(adopted.to_dense(), wide.to_dense())


def test_from_kv_blocks_accepts_what_torch_builds():
    """Valid lists of every layout torch accepts: lower dimensions broadcast, int64 converts."""
    g = torch.Generator().manual_seed(3)
    counts, indices, dense = random_lists(g, 2, 3, 5, 6)
    *_, full = random_lists(g, 2, 3, 5, 6)
    full_dense = full & ~dense
    fc, fi = (t.long() for t in listed_first(full_dense))
    bm = BlockMask.from_kv_blocks(counts, indices.long(), fc, fi, BLOCK_SIZE=(64, 32))
    theirs = fa.BlockMask.from_kv_blocks(counts, indices, fc.int(), fi.int(), BLOCK_SIZE=(64, 32))
    assert torch.equal(bm.to_dense().bool(), theirs.to_dense().bool())
    assert torch.equal(bm.to_dense().bool(), dense | full_dense)
    assert bm.kv_indices.dtype == torch.int32 and bm.shape == theirs.shape == (2, 3, 320, 192)
    flat = BlockMask.from_kv_blocks(counts[0, 0], indices[0, 0])
    assert flat.shape == (1, 1, 5 * 128, 6 * 128) and torch.equal(flat.to_dense()[0, 0].bool(), dense[0, 0])


def test_torch_lists_naming_blocks_outside_the_sequence_are_left_out():
    """PyTorch's PagedAttention lists page -1 for pages it has not reserved (its mask_mod masks them): such
    blocks, and blocks past KV_LEN, hold no keys. Adopting the mask leaves them out (on the device, without
    reading the lists back); attention over it equals attention over the mask without them."""
    g = torch.Generator().manual_seed(5)
    counts, indices, dense = random_lists(g, 1, 2, 4, 5)
    dense[..., -1] = False  # a free slot in every row for the extra entry
    counts, indices = (t.clone() for t in listed_first(dense))
    rows = counts.long().unsqueeze(-1)
    indices.scatter_(-1, rows, torch.where(torch.rand(rows.shape, generator=g) < 0.5, -1, 5).int())
    theirs = fa.BlockMask.from_kv_blocks(counts + 1, indices, BLOCK_SIZE=(32, 32), seq_lengths=(128, 160))
    ours = BlockMask.from_torch(theirs)
    want_num, want_idx = listed_first(dense)
    listed = torch.arange(want_idx.shape[-1]) < want_num.unsqueeze(-1)
    assert torch.equal(ours.kv_num_blocks, want_num)
    assert torch.equal(torch.where(listed, ours.kv_indices, -7), torch.where(listed, want_idx, -7))  # blocks in order
    assert torch.equal(ours.to_dense().bool(), dense)
    assert torch.equal(ours.q_num_blocks, dense.transpose(-1, -2).sum(-1, dtype=torch.int32))
    clean = fa.BlockMask.from_kv_blocks(*listed_first(dense), BLOCK_SIZE=(32, 32), seq_lengths=(128, 160))
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (128, 160, 160))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        got = flexgen.flex_attention(q, k, v, block_mask=theirs)
        want = flexgen.flex_attention(q, k, v, block_mask=clean)
    assert not torch.isnan(got).any() and torch.equal(got, want)


def test_adopting_the_same_torch_lists_again_gives_the_same_tensors():
    """What is derived from a mask's lists is cached per count tensor (the adoption, the work orders), so adopting
    the same PyTorch lists must give the same tensors; lists changed in place, or other index tensors beside the same
    counts, give their own."""
    g = torch.Generator().manual_seed(9)
    counts, indices, dense = random_lists(g, 1, 2, 4, 5)
    theirs = fa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(32, 32), seq_lengths=(128, 160))
    first, second = BlockMask.from_torch(theirs), BlockMask.from_torch(theirs)
    assert first.kv_num_blocks is second.kv_num_blocks and first.kv_indices is second.kv_indices
    theirs.kv_indices[0, 0, 0, 0] = -1  # (in place: the first slot of the first row now names no block)
    changed = BlockMask.from_torch(theirs)
    assert changed.kv_indices is not first.kv_indices
    assert int(changed.kv_num_blocks[0, 0, 0]) == int(counts[0, 0, 0]) - 1
    other = fa.BlockMask.from_kv_blocks(counts, indices.clone(), BLOCK_SIZE=(32, 32), seq_lengths=(128, 160))
    other.kv_num_blocks = theirs.kv_num_blocks  # the same counts beside another index tensor
    assert BlockMask.from_torch(other).kv_indices is not changed.kv_indices


def test_traced_adoption_of_torch_lists_leaves_out_blocks_outside_the_sequence():
    """Under torch.compile the lists hold no values while the graph is traced, so the graph itself leaves out
    the blocks outside [0, n_kv): the adopted lists equal those of the mask without them, blocks in order."""
    g = torch.Generator().manual_seed(8)
    counts, indices, dense = random_lists(g, 2, 1, 4, 5)
    dense[..., -1] = False
    counts, indices = (t.clone() for t in listed_first(dense))
    rows = counts.long().unsqueeze(-1)
    indices.scatter_(-1, rows, torch.where(torch.rand(rows.shape, generator=g) < 0.5, -1, 5).int())
    theirs = fa.BlockMask.from_kv_blocks(counts + 1, indices, BLOCK_SIZE=(32, 32), seq_lengths=(128, 160))

    def adopt(bm):
        ours = BlockMask.from_torch(bm)
        return ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks, ours.full_kv_indices

    torch._dynamo.reset()
    kv_num, kv_idx, full_num, full_idx = torch.compile(adopt, backend="eager", fullgraph=True)(theirs)
    want_num, want_idx = listed_first(dense)
    assert torch.equal(kv_num, want_num)
    listed = torch.arange(kv_idx.shape[-1]) < want_num.unsqueeze(-1)
    assert torch.equal(torch.where(listed, kv_idx, -7), torch.where(listed, want_idx, -7))


# ---------------------------------------------------------------- block_sparse_mask refuses bad input


def test_block_sparse_mask_refuses_bad_input():
    layout = torch.rand(1, 2, 3, 4, generator=torch.Generator().manual_seed(4)) < 0.5
    with pytest.raises(TypeError, match="got list"):
        block_sparse_mask(layout.tolist())
    for bs in (0, -16, 7.0, (128, 0)):
        with pytest.raises(ValueError, match="BLOCK_SIZE must be a positive int"):
            block_sparse_mask(layout, BLOCK_SIZE=bs)
    with pytest.raises(ValueError, match=r"need a layout of \(2, 4\) blocks, got \(3, 4\)"):
        block_sparse_mask(layout, BLOCK_SIZE=128, seq_lengths=(256, 512))
    with pytest.raises(ValueError, match="seq_lengths must be a"):
        block_sparse_mask(layout, seq_lengths=(-1, 512))
    with pytest.raises(ValueError, match="none of them 0"):
        block_sparse_mask(torch.zeros(1, 1, 0, 4, dtype=torch.bool))


@pytest.mark.parametrize("B,H", [(None, None), (2, None), (-1, None), (None, 0), (1.5, None)])
def test_create_block_mask_checks_b_h(B, H):
    if all(v is None or (isinstance(v, int) and v > 0) for v in (B, H)):
        assert create_block_mask(causal, B, H, 256, 256, device="cpu").shape == (B or 1, H or 1, 256, 256)
    else:
        with pytest.raises(ValueError, match="must be a positive int or None"):
            create_block_mask(causal, B, H, 256, 256, device="cpu")


# ---------------------------------------------------------------- PyTorch parity


CASES = [  # mask, B, H, Q_LEN, KV_LEN, BLOCK_SIZE
    (causal, None, None, 1000, 1000, 128),
    (causal, 2, None, 700, 900, (128, 64)),
    (per_head_window, 2, 3, 640, 512, 64),
    (per_head_window, None, 4, 384, 384, 128),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_views_match_torch(case):
    fn, B, H, q_len, kv_len, bs = CASES[case]
    ours = create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
    theirs = fa.create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
    assert ours.shape == theirs.shape and ours.numel() == theirs.numel()
    assert torch.equal(ours.to_dense().bool(), theirs.to_dense().bool())
    for grid, limit in [((20, 20), 4), (3, 2), (-1, 10)]:
        assert ours.to_string(grid, limit) == theirs.to_string(grid, limit)
    assert str(ours).replace(f"{ours.sparsity():.2f}", "S") == str(theirs).replace(f"{theirs.sparsity():.2f}", "S")
    mine, torchs = ours.as_tuple(), theirs.as_tuple()
    assert len(mine) == len(torchs)
    for a, b in zip(mine, torchs):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.shape[:-1] == b.shape[:-1]  # index rows: same (B, H, rows)
        elif not callable(b):
            assert a == b  # lengths, block sizes, the unused deterministic-dQ fields
    assert ours.as_tuple(flatten=False)[0] == (q_len, kv_len)
    assert ours.as_tuple(flatten=False)[-2] == theirs.as_tuple(flatten=False)[-2]


@pytest.fixture(scope="module")
def per_head_masks():
    """flexgen's and torch's mask of CASES[2]: B=2, H=3, 10 x 8 blocks."""
    fn, B, H, q_len, kv_len, bs = CASES[2]
    return (create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs),
            fa.create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs))


@pytest.mark.parametrize("index", [0, -1, 1, (0, 1), (slice(None), 2), (slice(0, 2), slice(1, 3)), (-2, -1, 3),
                                   (1, slice(None), torch.tensor([0, 2])), (slice(None), slice(None), slice(1, None))])
def test_getitem_matches_torch(index, per_head_masks):
    ours, theirs = (m[index] for m in per_head_masks)
    # (Q_LEN follows the query blocks kept, as PyTorch's after 2.13: test_getitem_query_slices_set_q_len)
    assert ours.shape[:2] + ours.shape[3:] == theirs.shape[:2] + theirs.shape[3:]
    assert ours.kv_num_blocks.shape == theirs.kv_num_blocks.shape
    assert torch.equal(ours.to_dense().bool(), theirs.to_dense().bool())
    transposed = BlockMask.from_kv_blocks(ours.kv_num_blocks, ours.kv_indices, ours.full_kv_num_blocks,
                                          ours.full_kv_indices, ours.BLOCK_SIZE, seq_lengths=ours.seq_lengths)
    assert torch.equal(ours.q_num_blocks, transposed.q_num_blocks)  # the backward's lists follow the slice
    with pytest.raises(RuntimeError, match="was sliced"):
        ours.mask_mod(*(torch.zeros((), dtype=torch.int32),) * 4)


def test_getitem_refuses_out_of_range():
    bm = create_block_mask(causal, 2, 3, 256, 256, device="cpu")
    with pytest.raises(IndexError, match="out of range for head of size 3"):
        bm[0, 3]
    with pytest.raises(IndexError, match="at most 3 indices"):
        bm[0, 0, 0, 0]
    sparse = block_sparse_mask(torch.ones(2, 1, 2, 2, dtype=torch.bool))
    assert sparse[1].mask_mod is None and sparse[1].shape == (1, 1, 256, 256)  # nothing to lose


@pytest.mark.parametrize("drops", [False, True])
@pytest.mark.parametrize("index", [0, -1, (0, 1), (slice(None), 2), (1, slice(None), torch.tensor([0, 2])), (0, 1, 3),
                                   (slice(0, 2), -1)])
def test_getitem_int_dims_follow_torch(index, drops, per_head_masks, monkeypatch):
    """An int on B or H drops that dimension where the installed PyTorch's BlockMask does (torch 2.11) and keeps
    it where it does (2.13): the lists are then the original's indexed as tensors, ints on B and H as they are and
    an int on the query blocks as a one-block slice."""
    import flexgen.blockmask as bm_module

    monkeypatch.setattr(bm_module, "_torch_getitem_drops_int_dims", lambda: drops)
    mask = per_head_masks[0]
    index = index if isinstance(index, tuple) else (index,)
    as_tensor = tuple(slice(i % n, i % n + 1) if isinstance(i, int) and (not drops or dim == 2) else i
                      for dim, (i, n) in enumerate(zip(index, mask.kv_num_blocks.shape)))
    sliced = mask[index]
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert torch.equal(getattr(sliced, name), getattr(mask, name)[as_tensor]), name
    assert torch.equal(sliced.to_dense(), mask.to_dense()[as_tensor])
    q_blocks = mask.kv_indices[as_tensor].shape[-2]
    assert sliced.shape == tuple(mask.kv_indices[as_tensor].shape[:-2]) + (
        mask.seq_lengths[0] if q_blocks == mask.kv_indices.shape[-2] else q_blocks * mask.BLOCK_SIZE[0],
        mask.seq_lengths[1])
    rows = BlockMask.from_kv_blocks(sliced.kv_num_blocks, sliced.kv_indices, sliced.full_kv_num_blocks,
                                    sliced.full_kv_indices, sliced.BLOCK_SIZE, seq_lengths=sliced.seq_lengths)
    assert torch.equal(sliced.q_num_blocks.reshape(rows.q_num_blocks.shape), rows.q_num_blocks)
    assert repr(sliced).startswith("BlockMask(shape=(") and str(sliced).startswith("BlockMask(")
    again = sliced[0]  # a slice indexes again along its own leading dimension
    assert torch.equal(again.kv_num_blocks, sliced.kv_num_blocks[(slice(0, 1),) if not drops or
                                                                  sliced.kv_num_blocks.dim() == 1 else (0,)])


@pytest.mark.parametrize("q_len, index, rows", [
    (8, slice(0, 1), 4), (8, 0, 4), (8, 1, 4), (9, slice(None), 9), (9, 1, 4), (9, slice(1, None), 5),
    (9, slice(0, 0), 0), (9, slice(None, None, 2), 5), (9, 2, 1), (9, -1, 1), (9, torch.tensor([2]), 4),
    (9, torch.tensor([True, False, True]), 8)])
def test_getitem_query_slices_set_q_len(q_len, index, rows):
    """A cut along the query blocks keeps KV_LEN and makes Q_LEN the rows of the blocks kept (the last block as
    short as the sequence makes it; a tensor index counts whole blocks), with the dense blocks and the transposed
    lists of the rows kept."""
    mask = create_block_mask(causal, None, None, q_len, 10, device="cpu", BLOCK_SIZE=4)
    cut = mask[:, :, index]
    assert cut.seq_lengths == (rows, 10) and cut.shape == (1, 1, rows, 10)
    picked = index if not isinstance(index, int) else slice(index % 3, index % 3 + 1)
    assert torch.equal(cut.to_dense(), mask.to_dense()[:, :, picked, :])
    again = BlockMask.from_kv_blocks(cut.kv_num_blocks, cut.kv_indices, cut.full_kv_num_blocks, cut.full_kv_indices,
                                     cut.BLOCK_SIZE, seq_lengths=mask.seq_lengths)
    assert torch.equal(cut.q_num_blocks, again.q_num_blocks) and torch.equal(cut.q_indices, again.q_indices)


def test_getitem_query_slice_attends_the_rows_it_keeps():
    """The second query block of a causal mask, cut out, attends those queries as the whole mask does them."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g, dtype=torch.float64) for _ in range(3))
    mask = create_block_mask(causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=128)
    cut = dataclasses.replace(mask[:, :, 1], mask_mod=lambda b, h, q_idx, kv_idx: q_idx + 128 >= kv_idx)
    whole = flexgen.flex_attention(q, k, v, block_mask=mask)
    torch.testing.assert_close(flexgen.flex_attention(q[:, :, 128:], k, v, block_mask=cut), whole[:, :, 128:])


def test_getitem_refuses_kv_block_index():
    mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
    with pytest.raises(IndexError, match="batch, head, and Q-block"):
        mask[:, :, :, :1]


def test_getitem_semantics_probe_matches_torch():
    from flexgen.blockmask import torch_int_index_drops_dim

    theirs = fa.BlockMask.from_kv_blocks(torch.ones(3, 2, 1, dtype=torch.int32), torch.zeros(3, 2, 1, 1, dtype=torch.int32))
    assert torch_int_index_drops_dim() == (theirs[1].kv_num_blocks.dim() == 2)


@pytest.mark.parametrize("lead", [0, 1])
def test_lists_without_batch_or_heads_attend_as_pytorch_reads_them(lead):
    """PyTorch reads lists of (nQ, nKV) and (H, nQ, nKV) with B and H of 1 in front: flexgen's slices with dropped
    dimensions and PyTorch's hand-made masks of that shape attend the same as their four-dimensional form."""
    g = torch.Generator().manual_seed(11 + lead)
    H, bs, n = 3, 64, 4
    counts, indices, _ = random_lists(g, 1, H if lead else 1, n, n)
    counts[..., :] = counts.clamp(min=1)  # (no query row without keys)
    counts, indices = counts[0, 0] if not lead else counts[0], indices[0, 0] if not lead else indices[0]
    q, k, v = (torch.randn(2, H, n * bs, 32, generator=g, dtype=torch.float64) for _ in range(3))
    theirs = fa.BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=bs, mask_mod=causal)
    four = fa.BlockMask.from_kv_blocks(counts.reshape((1,) * (2 - lead) + counts.shape),
                                       indices.reshape((1,) * (2 - lead) + indices.shape), BLOCK_SIZE=bs,
                                       mask_mod=causal)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flexgen.flex_attention(q, k, v, block_mask=theirs)
        assert torch.equal(out, flexgen.flex_attention(q, k, v, block_mask=four))
        keep = fa.create_mask(causal, None, None, n * bs, n * bs, device="cpu") & four.to_dense().bool().repeat_interleave(
            bs, -2).repeat_interleave(bs, -1)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _dense_attention(q, k, v, keep), atol=1e-10, rtol=1e-10)


def score_alibi_window(score, b, h, q, kv):
    return torch.where(q - kv > 100 * (h + 1), -float("inf"), score + (kv - q) * 0.5)


def _doc_ids(n, seed=5):
    return torch.sort(torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(seed))).values.to(torch.int32)


def test_create_mask_matches_torch():
    ids = _doc_ids(300)

    def documents(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv)

    for fn, B, H in [(causal, None, None), (per_head_window, 2, 3), (score_alibi_window, 1, 2), (documents, 2, 1)]:
        ours = create_mask(fn, B, H, 300, 257, device="cpu")
        theirs = fa.create_mask(fn, B, H, 300, 257, device="cpu")
        assert ours.dtype == torch.bool and ours.shape == theirs.shape and torch.equal(ours, theirs)
    assert create_mask(flexgen.noop_mask, 2, 2, 5, 7, device="cpu").all()
    with pytest.raises(TypeError, match="takes 3"):
        create_mask(lambda b, q, kv: q >= kv, None, None, 4, 4, device="cpu")


def test_flexgen_mods_work_in_torch_create_block_mask():
    """A Mod is a mask_mod to PyTorch: right arity, vmapped over index tensors like a function."""
    ids = _doc_ids(700, seed=6)
    mods = [
        V.causal, V.sliding_window(200), V.prefix_lm(130), V.document(ids), flexgen.noop_mask,
        flexgen.and_masks(V.sliding_window(300), V.document(ids)),
        flexgen.mask_mod("q_idx >= kv_idx and q_idx - kv_idx < w", w=150),
        flexgen.mask_mod(per_head_window),
    ]
    for mod in mods:
        theirs = fa.create_block_mask(mod, 2, 3, 700, 700, device="cpu", BLOCK_SIZE=64)
        ours = create_block_mask(mod, 2, 3, 700, 700, device="cpu", BLOCK_SIZE=64)
        assert torch.equal(theirs.to_dense().bool(), ours.to_dense().expand(2, 3, -1, -1).bool()), mod
        assert torch.equal(fa.create_mask(mod, 2, 3, 700, 700, device="cpu"), create_mask(mod, 2, 3, 700, 700, device="cpu"))
    # a score_mod Mod is a score_mod to PyTorch (5 arguments): masked where it gives -inf
    softcap_window = flexgen.score_mod(score_alibi_window)
    assert torch.equal(fa.create_mask(softcap_window, 1, 2, 300, 300, device="cpu"),
                       fa.create_mask(score_alibi_window, 1, 2, 300, 300, device="cpu"))


def test_device_none_picks_like_torch(monkeypatch):
    expected = torch.accelerator.current_accelerator(check_available=True) or torch.device("cpu")
    bm = create_block_mask(causal, None, None, 8192, 8192)  # the README's port example, no device
    assert bm.device.type == expected.type and create_mask(causal, 1, 1, 4, 4).device.type == expected.type
    # a CUDA build of torch on a machine without a GPU names CUDA but cannot use it: the CPU then
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None if check_available else torch.device("cuda"))
    assert create_block_mask(causal, None, None, 512, 512).device.type == "cpu"


@pytest.mark.gpu
def test_sliced_mask_needs_a_mask_mod_before_attending():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    bm = create_block_mask(per_head_window, 2, 2, 256, 256)
    with pytest.raises(Exception, match="was sliced"):
        flexgen.flex_attention(q, q, q, block_mask=bm[1])
    sliced = bm[1]
    sliced.mask_mod = lambda b, h, q_idx, kv_idx: per_head_window(b + 1, h, q_idx, kv_idx)  # the slice's own positions
    out = flexgen.flex_attention(q, q, q, block_mask=sliced)
    want = flexgen.reference_attention(*(q.double(),) * 3, mask_mod=lambda b, h, qi, ki: per_head_window(b + 1, h, qi, ki))
    assert ((out.double() - want).norm() / want.norm()).item() < 2e-2


def test_adjust_keeps_the_prefix_as_pytorch_does():
    from torch.nn.attention.flex_attention import create_block_mask as torch_block_mask

    causal = lambda b, h, q, kv: q >= kv  # noqa: E731
    ours = flexgen.create_block_mask(causal, 2, 1, 512, 512, device="cpu")._adjust(200, 384)
    direct = flexgen.create_block_mask(causal, 2, 1, 200, 384, device="cpu")
    theirs = torch_block_mask(causal, 2, 1, 512, 512, device="cpu")._adjust(200, 384)
    assert ours.seq_lengths == (200, 384) and ours.shape == (2, 1, 200, 384)
    assert torch.equal(ours.to_dense(), direct.to_dense())
    assert torch.equal(ours.to_dense(), theirs.to_dense())
    full = ours._dense(ours.full_kv_num_blocks, ours.full_kv_indices)
    assert torch.equal(full, direct._dense(direct.full_kv_num_blocks, direct.full_kv_indices))
    # and attention through it equals attention through the mask built for those lengths
    q = torch.randn(2, 1, 200, 64)
    k, v = torch.randn(2, 1, 384, 64), torch.randn(2, 1, 384, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(flexgen.flex_attention(q, k, v, block_mask=ours), flexgen.flex_attention(q, k, v, block_mask=direct))
    with pytest.raises(ValueError, match="at most"):
        ours._adjust(300, 384)


# ---------------------------------------------------------------- pytree layout and constructor defaults


def _dense_attention(q, k, v, keep):
    """Float64 attention under an element mask; a row that sees nothing gives 0 (FlexAttention's convention)."""
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("hand_made", [False, True])
def test_flatten_unflatten_round_trip(hand_made):
    """PyTorch's BlockMask._flatten / _unflatten / _flatten_with_keys, which newer test files and tracing code call:
    the present tensors in _TENSOR_ATTRS order, the context then the absent names, and a rebuilt mask that attends
    as the original (whether its lists follow its mask_mod kept)."""
    g = torch.Generator().manual_seed(torch.seed())
    if hand_made:  # lists of its own, no full blocks, not derived from a mask_mod
        counts, indices, dense = random_lists(g, 2, 3, 4, 4)
        mask = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=128, mask_mod=per_head_window)
    else:
        mask = create_block_mask(per_head_window, 2, 3, 512, 512, device="cpu")
    tensors, context = mask._flatten()
    present = [a for a in BlockMask._TENSOR_ATTRS if getattr(mask, a) is not None]
    assert len(tensors) == len(present) and len(context) == len(BlockMask._CONTEXT_ATTRS) + 1
    assert set(context[-1]) == set(BlockMask._TENSOR_ATTRS) - set(present)
    rebuilt = BlockMask._unflatten(tensors, context)
    for attr in BlockMask._TENSOR_ATTRS:
        a, b = getattr(mask, attr), getattr(rebuilt, attr)
        assert (a is None and b is None) or torch.equal(a, b), attr
    for attr in BlockMask._CONTEXT_ATTRS:
        assert getattr(mask, attr) == getattr(rebuilt, attr), attr
    assert rebuilt.blocks_follow_mask_mod is (not hand_made)
    keyed, keyed_context = mask._flatten_with_keys()
    assert [key.name for key, _ in keyed] == present and keyed_context == context
    assert all(t is u for (_, t), u in zip(keyed, tensors))
    q, k, v = (torch.randn(2, 3, 512, 32, generator=g, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused path's notice
        got = flexgen.flex_attention(q, k, v, block_mask=rebuilt)
        want = flexgen.flex_attention(q, k, v, block_mask=mask)
    assert torch.equal(got, want)
    if not hand_made:
        keep = per_head_window(*torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(512), torch.arange(512),
                                               indexing="ij"))
        assert (got - _dense_attention(q, k, v, keep)).abs().max().item() < 1e-10


def test_block_mask_is_a_pytree_node():
    """As PyTorch's BlockMask: pytree tools take it apart into its present index tensors and put it back."""
    from torch.utils import _pytree

    mask = create_block_mask(per_head_window, 2, 3, 512, 512, device="cpu")
    leaves, spec = _pytree.tree_flatten({"mask": mask, "step": 3})
    present = [getattr(mask, a) for a in BlockMask._TENSOR_ATTRS if getattr(mask, a) is not None]
    assert len(leaves) == len(present) + 1 and all(a is b for a, b in zip(leaves, present)) and leaves[-1] == 3
    moved = _pytree.tree_map_only(torch.Tensor, lambda t: t + 0, {"mask": mask})["mask"]
    assert isinstance(moved, BlockMask) and moved.blocks_follow_mask_mod and moved.mask_mod is mask.mask_mod
    assert moved.kv_indices is not mask.kv_indices and torch.equal(moved.to_dense(), mask.to_dense())
    keyed, _ = _pytree.tree_flatten_with_path(mask)
    assert [_pytree.keystr(path) for path, _ in keyed][:2] == [".kv_num_blocks", ".kv_indices"]


def test_constructor_defaults_as_pytorch():
    """BLOCK_SIZE and mask_mod may be left out as in PyTorch's constructor: 128 x 128 blocks, and with no
    mask_mod every element of a listed block is visible."""
    g = torch.Generator().manual_seed(torch.seed())
    counts, indices, dense = random_lists(g, 1, 2, 3, 3)
    mask = BlockMask(seq_lengths=(384, 384), kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=None,
                     full_kv_indices=None, q_num_blocks=None, q_indices=None, full_q_num_blocks=None,
                     full_q_indices=None)
    # (PyTorch's constructor has these defaults from 2.13 on; before, it requires both)
    default = inspect.signature(fa.BlockMask.__init__).parameters["BLOCK_SIZE"].default
    assert mask.BLOCK_SIZE == (128, 128) and mask.mask_mod is None
    assert default is inspect.Parameter.empty or tuple(default) == mask.BLOCK_SIZE
    theirs = fa.BlockMask(seq_lengths=(384, 384), kv_num_blocks=counts, kv_indices=indices, full_kv_num_blocks=None,
                          full_kv_indices=None, q_num_blocks=None, q_indices=None, full_q_num_blocks=None,
                          full_q_indices=None, BLOCK_SIZE=(128, 128), mask_mod=fa.noop_mask)
    assert torch.equal(mask.to_dense(), theirs.to_dense())
    q, k, v = (torch.randn(1, 2, 384, 16, generator=g, dtype=torch.float64) for _ in range(3))
    keep = dense.repeat_interleave(128, -2).repeat_interleave(128, -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flexgen.flex_attention(q, k, v, block_mask=mask)
    assert not got.isnan().any()
    assert (got - _dense_attention(q, k, v, keep)).abs().max().item() < 1e-10


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mask_mod", [causal, per_head_window])
def test_separate_full_blocks_false_lists_every_block_as_partial_as_pytorch(mask_mod):
    """separate_full_blocks=False: no full lists, every visited block among the partial ones, in the layout PyTorch's
    create_block_mask gives; the attention is the same as with the lists separate."""
    if "separate_full_blocks" not in inspect.signature(fa.create_block_mask).parameters:
        pytest.skip("the installed PyTorch's create_block_mask has no separate_full_blocks")
    ours = create_block_mask(mask_mod, 2, 3, 300, 340, device="cpu", separate_full_blocks=False)
    theirs = fa.create_block_mask(mask_mod, 2, 3, 300, 340, device="cpu", separate_full_blocks=False)
    assert ours.full_kv_num_blocks is None and ours.full_q_num_blocks is None
    for name in ("kv_num_blocks", "kv_indices", "q_num_blocks", "q_indices"):
        torch.testing.assert_close(getattr(ours, name), getattr(theirs, name), rtol=0, atol=0)
    q, k, v = (torch.randn(2, 3, n, 32, dtype=torch.float64) for n in (300, 340, 340))
    separate = create_block_mask(mask_mod, 2, 3, 300, 340, device="cpu")
    assert separate.full_kv_num_blocks is not None
    torch.testing.assert_close(flexgen.flex_attention(q, k, v, block_mask=ours),
                               flexgen.flex_attention(q, k, v, block_mask=separate), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["separate_full_blocks", "compute_dq_write_order", "dq_kv_order"])
def test_create_block_mask_flags_must_be_bools(name):
    with pytest.raises(ValueError, match=f"{name} must be a bool"):
        create_block_mask(causal, 1, 1, 128, 128, device="cpu", **{name: torch.tensor([1, 0])})
    create_block_mask(causal, 1, 1, 128, 128, device="cpu", **{name: False})  # accepted


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("cls", ["flexgen", "torch"])
@pytest.mark.parametrize("compiled", [False, True])
def test_attention_under_lists_compacted_to_the_longest_row(cls, compiled):
    """A mask whose lists (kv and q) keep only the longest row's columns, built by either class's constructor,
    gives the full-width mask's output and gradients, eager and under torch.compile(fullgraph=True)."""
    if cls == "torch":
        from torch.nn.attention.flex_attention import BlockMask as make, create_block_mask as build
    else:
        make, build = BlockMask, create_block_mask
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor([40, 100, 20, 60, 36]))

    def same_document_causal(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    wide = build(same_document_causal, None, None, 256, 256, device="cpu", BLOCK_SIZE=32)
    cut = {f"{kind}_indices": _compacted(getattr(wide, f"{kind}_indices"), getattr(wide, f"{kind}_num_blocks"))
           for kind in ("kv", "full_kv", "q", "full_q")}
    assert cut["kv_indices"].shape[-1] < wide.kv_indices.shape[-1]
    narrow = make(seq_lengths=wide.seq_lengths, kv_num_blocks=wide.kv_num_blocks,
                  full_kv_num_blocks=wide.full_kv_num_blocks, q_num_blocks=wide.q_num_blocks,
                  full_q_num_blocks=wide.full_q_num_blocks, BLOCK_SIZE=wide.BLOCK_SIZE, mask_mod=wide.mask_mod, **cut)
    attend = torch.compile(flexgen.flex_attention, fullgraph=True, backend="eager") if compiled else flexgen.flex_attention
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 256, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    results = []
    for mask, call in ((wide, flexgen.flex_attention), (narrow, attend)):
        out = call(q, k, v, block_mask=mask)
        assert not out.isnan().any()
        results.append((out, *torch.autograd.grad((out * out).sum(), (q, k, v))))
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_slices_of_a_mask_without_q_lists_have_none():
    """compute_q_blocks=False leaves the q lists out; a slice of such a mask leaves them out too (PyTorch's does)."""
    g = torch.Generator().manual_seed(5)
    counts, indices, _ = random_lists(g, 2, 3, 4, 5)
    bm = BlockMask.from_kv_blocks(counts, indices, compute_q_blocks=False)
    for sliced in (bm[0], bm[:, 1], bm[1, :, 2:]):
        assert sliced.q_indices is None and sliced.q_num_blocks is None
    assert bm.q_indices is None
    assert BlockMask.from_kv_blocks(counts, indices)[0].q_indices is not None


def test_from_kv_blocks_under_fullgraph_compile():
    """Traced lists hold no values to check: from_kv_blocks compiles into one graph, gives eager's mask for valid
    lists, and leaves out blocks outside the sequence (and counts past a row) rather than let a kernel read them."""
    from torch._dynamo.testing import CompileCounter

    def build(counts, indices, full_counts, full_indices):
        bm = BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=32, seq_lengths=(96, 160))
        return bm.kv_num_blocks, bm.kv_indices, bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices

    g = torch.Generator().manual_seed(6)
    dense = torch.rand(2, 1, 3, 5, generator=g) < 0.5
    full = (torch.rand(2, 1, 3, 5, generator=g) < 0.5) & ~dense
    args = (*listed_first(dense), *listed_first(full))
    counter = CompileCounter()
    traced = torch.compile(build, fullgraph=True, backend=counter)
    for got, want in zip(traced(*args), build(*args)):
        assert torch.equal(got, want)
    assert counter.frame_count == 1
    counts, indices = torch.tensor([[[9, 2, 1]]], dtype=torch.int32), torch.tensor([[0, 7, 1, 2, 3]] * 3).view(1, 1, 3, 5)
    got_counts, got_indices, *_ = traced(counts, indices.to(torch.int32), *listed_first(torch.zeros(1, 1, 3, 5) > 0))
    assert got_counts.tolist() == [[[4, 1, 1]]] and got_indices[0, 0, 0, :4].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="must lie in"):  # (eager still refuses them)
        build(counts, indices.to(torch.int32), *listed_first(torch.zeros(1, 1, 3, 5) > 0))


# ---------------------------------------------------------------- PyTorch's deterministic-dQ metadata

needs_dq_order = pytest.mark.skipif(not hasattr(fa, "_compute_dq_write_order_from_block_mask"),
                                    reason="this torch's BlockMask has no deterministic-dQ metadata")


@needs_dq_order
@pytest.mark.parametrize("spt", [True, False])
@pytest.mark.parametrize("fn, B, H", [(causal, None, None), (per_head_window, 2, 3)])
def test_create_block_mask_ranks_dq_writes_as_torch_does(fn, B, H, spt):
    ours = create_block_mask(fn, B, H, 640, 512, device="cpu", BLOCK_SIZE=64, compute_dq_write_order=True,
                             dq_kv_order=spt)
    theirs = fa.create_block_mask(fn, B, H, 640, 512, device="cpu", BLOCK_SIZE=64, compute_dq_write_order=True,
                                  dq_kv_order=spt)
    assert ours._dq_kv_order() is spt and ours.dq_kv_order is None
    for name in ("dq_write_order", "dq_write_order_full"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for a, b in zip(ours.as_tuple(), theirs.as_tuple()):
        if isinstance(b, torch.Tensor) and b.shape == getattr(theirs, "dq_write_order").shape:
            assert torch.equal(a, b)
    plain = create_block_mask(fn, B, H, 640, 512, device="cpu", BLOCK_SIZE=64)
    assert plain.dq_write_order is None and plain.dq_write_order_full is None


@needs_dq_order
def test_slices_and_adjusted_masks_rank_again_as_torch_does():
    ours = create_block_mask(per_head_window, 2, 3, 512, 512, device="cpu", BLOCK_SIZE=128,
                             compute_dq_write_order=True)
    theirs = fa.create_block_mask(per_head_window, 2, 3, 512, 512, device="cpu", BLOCK_SIZE=128,
                                  compute_dq_write_order=True)
    for index in (1, (0, slice(1, 3)), (slice(None), 2)):
        mine, torchs = ours[index], theirs[index]
        assert torch.equal(mine.dq_write_order, torchs.dq_write_order), index
        assert mine._dq_kv_order() is True
    mine, torchs = ours._adjust(256, 384), theirs._adjust(256, 384)
    assert torch.equal(mine.dq_write_order, torchs.dq_write_order)
    moved = ours.to("cpu")
    assert moved.dq_write_order is not None and moved._dq_kv_order() is True


@needs_dq_order
def test_from_kv_blocks_carries_and_checks_dq_metadata():
    counts = torch.tensor([[[1, 2]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 0], [0, 1]]]], dtype=torch.int32)
    order = torch.zeros((1, 1, 2, 2), dtype=torch.int32)
    explicit = torch.tensor([[[1, 0]]], dtype=torch.int32)
    mask = BlockMask.from_kv_blocks(counts, indices, dq_write_order=order, dq_kv_order=explicit)
    assert mask.dq_write_order is order and mask.dq_kv_order is explicit and mask.dq_write_order_full is None
    assert BlockMask.from_kv_blocks(counts, indices, dq_write_order=order, dq_kv_order=True)._dq_kv_order() is True
    with pytest.raises(ValueError, match="dq_kv_order must be a bool, Tensor, or None"):
        BlockMask.from_kv_blocks(counts, indices, dq_write_order=order, dq_kv_order=1)
    with pytest.raises(ValueError, match="dq_write_order_full requires dq_write_order"):
        BlockMask.from_kv_blocks(counts, indices, dq_write_order_full=order)
    for derive in (lambda m: m[0], lambda m: m._adjust(128, 128)):
        with pytest.raises(NotImplementedError, match="tensor dq_kv_order"):
            derive(mask)


@needs_dq_order
def test_dq_metadata_survives_the_pytree_and_a_compiled_call():
    from torch.utils import _pytree as pytree

    mask = create_block_mask(causal, None, None, 256, 256, device="cpu", compute_dq_write_order=True,
                             dq_kv_order=False)
    leaves, spec = pytree.tree_flatten(mask)
    again = pytree.tree_unflatten(leaves, spec)
    assert torch.equal(again.dq_write_order, mask.dq_write_order) and again._dq_kv_order() is False
    assert len(leaves) == len(pytree.tree_flatten(create_block_mask(causal, None, None, 256, 256, device="cpu"))[0]) + 2
    q = torch.randn(1, 2, 256, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice for CPU tensors)
        compiled = torch.compile(lambda q, m: flexgen.flex_attention(q, q, q, block_mask=m), fullgraph=True)(q, mask)
        eager = flexgen.flex_attention(q, q, q, block_mask=create_block_mask(causal, None, None, 256, 256, device="cpu"))
    assert torch.allclose(compiled, eager, atol=1e-6)
