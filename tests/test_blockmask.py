"""create_block_mask / BlockMask on the CPU, checked against brute-force element-level masks.

For every mask the dense (B, H, Q_LEN, KV_LEN) boolean mask is evaluated directly and
reduced per tile; the block mask must then
  (a) visit every tile that holds any True element,
  (b) mark full only tiles whose in-range elements are all True,
  (c) skip every tile with no True element,
and (since the builder refines every tile static analysis leaves undecided) list as
partial exactly the tiles that are mixed.
"""
from __future__ import annotations

import pytest
import torch

import flexgen
from flexgen.blockmask import BlockMask, block_sparse_mask
from flexgen.dsl.api import as_mask_mod
from flexgen.make_block_mask import create_block_mask

# ---------------------------------------------------------------- brute force


def dense_mask(fn, B, H, q_len, kv_len) -> torch.Tensor:
    """(B, H, Q_LEN, KV_LEN) bool, evaluating fn on broadcast index tensors (as torch's create_mask)."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(q_len).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len).view(1, 1, 1, kv_len)
    m = fn(b, h, q, kv)
    m = torch.as_tensor(m).to(torch.bool)
    return m.expand(B, H, q_len, kv_len)


def tile_stats(mask: torch.Tensor, bq: int, bkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tile: any element True; all in-range elements True. Each (B, H, nQ, nKV)."""
    B, H, q_len, kv_len = mask.shape
    n_q, n_kv = -(-q_len // bq), -(-kv_len // bkv)
    pad_q, pad_kv = n_q * bq - q_len, n_kv * bkv - kv_len
    m = torch.nn.functional.pad(mask, (0, pad_kv, 0, pad_q), value=False)
    valid = torch.nn.functional.pad(torch.ones(q_len, kv_len, dtype=torch.bool), (0, pad_kv, 0, pad_q), value=False)
    m = m.view(B, H, n_q, bq, n_kv, bkv).permute(0, 1, 2, 4, 3, 5)
    valid = valid.view(n_q, bq, n_kv, bkv).permute(0, 2, 1, 3)
    any_true = m.flatten(-2).any(-1)
    all_true = (m | ~valid).flatten(-2).all(-1)
    return any_true, all_true


def dense_of(counts, indices, n_cols) -> torch.Tensor:
    """Independent re-implementation of the (counts, indices) -> dense layout conversion."""
    shape = indices.shape[:-1]
    out = torch.zeros(*shape, n_cols, dtype=torch.bool)
    c = counts.reshape(-1)
    idx = indices.reshape(-1, indices.shape[-1])
    flat = out.view(-1, n_cols)
    for r in range(idx.shape[0]):
        n = int(c[r])
        assert 0 <= n <= idx.shape[1]
        cols = idx[r, :n].long()
        assert len(set(cols.tolist())) == n, "duplicate block indices in a row"
        assert (cols >= 0).all() and (cols < n_cols).all()
        flat[r, cols] = True
    return out


def layouts(bm: BlockMask, B, H):
    """(partial, full) dense (B, H, nQ, nKV) layouts of a BlockMask, broadcast to B, H."""
    n_kv = bm.kv_indices.shape[-1]
    partial = dense_of(bm.kv_num_blocks, bm.kv_indices, n_kv)
    if bm.full_kv_num_blocks is not None:
        full = dense_of(bm.full_kv_num_blocks, bm.full_kv_indices, bm.full_kv_indices.shape[-1])
    else:
        full = torch.zeros_like(partial)
    return partial.expand(B, H, *partial.shape[-2:]), full.expand(B, H, *full.shape[-2:])


def check_against_brute_force(fn, B, H, q_len, kv_len, block_size=128, mask_arg=None, exact=True):
    """Build with create_block_mask and compare tile by tile with the dense mask of fn."""
    bq, bkv = (block_size, block_size) if isinstance(block_size, int) else block_size
    bm = create_block_mask(fn if mask_arg is None else mask_arg, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=block_size)
    Bx, Hx = B or 1, H or 1
    truth = dense_mask(fn, Bx, Hx, q_len, kv_len)
    any_true, all_true = tile_stats(truth, bq, bkv)
    n_q, n_kv = any_true.shape[-2:]
    assert bm.BLOCK_SIZE == (bq, bkv)
    assert tuple(bm.seq_lengths) == (q_len, kv_len)
    assert bm.kv_indices.shape[-2] >= n_q and bm.kv_indices.shape[-1] >= n_kv
    assert bm.kv_num_blocks.dtype == torch.int32 and bm.kv_indices.dtype == torch.int32
    partial, full = layouts(bm, Bx, Hx)
    partial, full = partial[..., :n_q, :n_kv], full[..., :n_q, :n_kv]
    visited = partial | full
    assert not (partial & full).any(), "a tile is listed both partial and full"
    # (a) every tile with a True element is visited
    missed = any_true & ~visited
    assert not missed.any(), f"tiles with visible elements are skipped: {missed.nonzero()[:5].tolist()}"
    # (b) full tiles hold only True (in range)
    bad_full = full & ~all_true
    assert not bad_full.any(), f"tiles marked full hold masked elements: {bad_full.nonzero()[:5].tolist()}"
    # (c) empty tiles are skipped
    extra = visited & ~any_true
    assert not extra.any(), f"empty tiles are visited: {extra.nonzero()[:5].tolist()}"
    if exact:
        assert torch.equal(full, all_true & any_true), "an all-visible tile is left partial"
    # to_dense agrees with the lists
    td = bm.to_dense()
    assert td.dtype == torch.int32
    assert torch.equal(td.expand(Bx, Hx, *td.shape[-2:])[..., :n_q, :n_kv].bool(), visited)
    # the q-major transposes describe the same tiles
    if bm.q_num_blocks is not None:
        q_partial = dense_of(bm.q_num_blocks, bm.q_indices, bm.q_indices.shape[-1])
        qp = q_partial.transpose(-1, -2).expand(Bx, Hx, -1, -1)[..., :n_q, :n_kv]
        assert torch.equal(qp, partial)
    if bm.full_q_num_blocks is not None:
        q_full = dense_of(bm.full_q_num_blocks, bm.full_q_indices, bm.full_q_indices.shape[-1])
        qf = q_full.transpose(-1, -2).expand(Bx, Hx, -1, -1)[..., :n_q, :n_kv]
        assert torch.equal(qf, full)
    # sparsity: share of tiles skipped
    expected = 100.0 * (1.0 - visited.sum().item() / visited.numel())
    assert bm.sparsity() == pytest.approx(expected, abs=1e-6)
    return bm, truth


# ---------------------------------------------------------------- masks


def causal(b, h, q, kv):
    return q >= kv


def sliding(window):
    def sliding_window(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return sliding_window


def prefix_lm(prefix):
    def prefix_lm_mask(b, h, q, kv):
        return (kv < prefix) | (q >= kv)

    return prefix_lm_mask


def random_doc_ids(length, n_docs, seed=0):
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(length - 1, generator=g)[: n_docs - 1] + 1
    ids = torch.zeros(length, dtype=torch.int32)
    ids[cuts] = 1
    return torch.cumsum(ids, 0).to(torch.int32)


def document(doc_ids, causal=True):
    def document_mask(b, h, q, kv):
        same = doc_ids[q] == doc_ids[kv]
        return same & (q >= kv) if causal else same

    return document_mask


# ---------------------------------------------------------------- tests: masks against brute force


@pytest.mark.parametrize(
    "q_len,kv_len",
    [(256, 256), (1000, 1000), (1000, 777), (777, 1000), (1, 300), (300, 1), (128, 128), (129, 257)],
)
def test_causal(q_len, kv_len):
    check_against_brute_force(causal, None, None, q_len, kv_len)


@pytest.mark.parametrize("window", [1, 100, 128, 300])
def test_sliding_window(window):
    check_against_brute_force(sliding(window), None, None, 1000, 1000)


def test_sliding_window_block_size_pair():
    check_against_brute_force(sliding(200), None, None, 1000, 777, block_size=(128, 64))


@pytest.mark.parametrize("prefix", [0, 1, 200, 256, 1000])
def test_prefix_lm(prefix):
    check_against_brute_force(prefix_lm(prefix), None, None, 1000, 1000)


@pytest.mark.parametrize("doc_causal", [True, False])
def test_document(doc_causal):
    doc_ids = random_doc_ids(1000, 7, seed=1)
    check_against_brute_force(document(doc_ids, doc_causal), None, None, 1000, 1000)


def test_document_block_size_pair():
    doc_ids = random_doc_ids(777, 5, seed=2)
    check_against_brute_force(document(doc_ids), 2, 3, 777, 777, block_size=(128, 64))


def test_mask_depending_on_h():
    # head h sees a window of 64 * (h + 1) keys behind it
    def per_head_window(b, h, q, kv):
        return (q >= kv) & (q - kv < 64 * (h + 1))

    bm, _ = check_against_brute_force(per_head_window, 2, 4, 1000, 1000)
    assert bm.shape == (2, 4, 1000, 1000)
    dense = bm.to_dense()
    assert not torch.equal(dense[0, 0], dense[0, 3]), "heads should differ"


def test_mask_depending_on_b_and_h():
    lengths = torch.tensor([300, 1000, 650], dtype=torch.int32)

    def padded(b, h, q, kv):
        return (kv < lengths[b]) & ((h % 2 == 0) | (q >= kv))

    bm, _ = check_against_brute_force(padded, 3, 2, 1000, 1000)
    assert bm.shape == (3, 2, 1000, 1000)


def test_broadcast_none_b_h():
    bm, _ = check_against_brute_force(causal, None, None, 512, 512)
    assert bm.shape == (1, 1, 512, 512)
    assert bm.kv_num_blocks.shape[:2] == (1, 1)


def test_broadcast_b_h_given_but_unused():
    # a mask that ignores b and h is computed once and copied out to (B, H), as PyTorch lays it out
    bm, _ = check_against_brute_force(causal, 4, 8, 512, 512)
    assert bm.shape == (4, 8, 512, 512)
    assert bm.kv_num_blocks.shape[:2] == (4, 8)
    d = bm.to_dense()
    assert torch.equal(d[3, 7], d[0, 0])


@pytest.mark.parametrize("block_size", [(128, 64), (64, 128), (64, 64), (16, 32), 256])
def test_block_sizes(block_size):
    check_against_brute_force(causal, None, None, 1000, 777, block_size=block_size)
    check_against_brute_force(sliding(150), None, None, 1000, 777, block_size=block_size)


def test_ragged_lengths_combined():
    doc_ids = random_doc_ids(1000, 4, seed=3)

    def mixed(b, h, q, kv):
        return ((q >= kv) & (q - kv < 333)) | (doc_ids[q] == 0)

    check_against_brute_force(mixed, None, 2, 1000, 777)


def test_q_len_differs_from_kv_len():
    # bottom-right aligned causal mask (decode-style): query i sees keys up to i + (KV - Q)
    q_len, kv_len = 300, 1000

    def bottom_right(b, h, q, kv):
        return kv <= q + (kv_len - q_len)

    check_against_brute_force(bottom_right, None, None, q_len, kv_len)
    check_against_brute_force(causal, None, None, kv_len, q_len)


def test_all_masked_and_all_visible():
    def nothing(b, h, q, kv):
        return q < 0

    bm, _ = check_against_brute_force(nothing, None, None, 300, 300)
    assert bm.to_dense().sum() == 0
    assert bm.sparsity() == pytest.approx(100.0)

    def everything(b, h, q, kv):
        return q >= 0

    bm, _ = check_against_brute_force(everything, None, None, 300, 300)
    assert bm.sparsity() == pytest.approx(0.0)


def test_noop_mask_is_all_full():
    bm = create_block_mask(flexgen.noop_mask, None, None, 1000, 777, device="cpu")
    assert bm.to_dense().bool().all()
    assert bm.sparsity() == 0.0
    assert int(bm.kv_num_blocks.sum()) == 0
    bm2 = create_block_mask(None, None, None, 1000, 777, device="cpu")
    assert torch.equal(bm2.to_dense(), bm.to_dense())


def test_built_in_variants_against_brute_force():
    v = flexgen.variants
    doc_ids = random_doc_ids(1000, 6, seed=4)
    cases = [
        v.causal,
        v.sliding_window(200),
        v.prefix_lm(300),
        v.document(doc_ids),
        v.document(doc_ids, causal=False),
        flexgen.and_masks(v.causal, v.sliding_window(500)),
        flexgen.or_masks(v.sliding_window(100), v.prefix_lm(64)),
    ]
    for mod in cases:
        # the Mod is callable on tensors: that evaluation is the ground truth
        check_against_brute_force(mod, None, None, 1000, 1000)
        check_against_brute_force(mod, None, None, 1000, 1000, block_size=(128, 64))


def test_text_and_function_forms_agree():
    from_fn = create_block_mask(sliding(256), None, None, 1000, 1000, device="cpu")
    mod = flexgen.mask_mod(sliding(256))
    from_mod = create_block_mask(mod, None, None, 1000, 1000, device="cpu")
    assert torch.equal(from_fn.to_dense(), from_mod.to_dense())


# ---------------------------------------------------------------- views and conversions


def test_repr_small_and_large():
    bm = create_block_mask(causal, None, None, 512, 512, device="cpu")
    text = repr(bm)
    assert text.startswith("BlockMask(")
    assert "Q_LEN=512" in text and "KV_LEN=512" in text
    assert "sparsity=" in text and "BLOCK_SIZE=(128, 128)" in text
    # a 4 x 4 grid: diagonal partial, below full, above skipped
    rows = [line.strip() for line in text.splitlines()[1:5]]
    assert rows == ["░···", "█░··", "██░·", "███░"]
    big = create_block_mask(causal, None, None, 128 * 40, 128 * 40, device="cpu")
    assert len(repr(big).splitlines()) == 1


def test_sparsity_values():
    bm = create_block_mask(causal, None, None, 1024, 1024, device="cpu")
    # 8 x 8 tiles, 36 visited
    assert bm.sparsity() == pytest.approx(100.0 * (1 - 36 / 64))


def test_from_kv_blocks_round_trip():
    doc_ids = random_doc_ids(1000, 5, seed=5)
    for fn, B, H, bs in [(causal, None, None, 128), (document(doc_ids), 2, 3, (128, 64)), (sliding(300), None, 4, (64, 128))]:
        bm = create_block_mask(fn, B, H, 1000, 1000, device="cpu", BLOCK_SIZE=bs)
        rt = BlockMask.from_kv_blocks(
            bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
            BLOCK_SIZE=bm.BLOCK_SIZE, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths,
        )
        assert rt.BLOCK_SIZE == bm.BLOCK_SIZE and tuple(rt.seq_lengths) == tuple(bm.seq_lengths)
        assert torch.equal(rt.to_dense(), bm.to_dense())
        for a, b in [(rt.q_num_blocks, rt.q_indices), (bm.q_num_blocks, bm.q_indices)]:
            assert a is not None and b is not None
        assert torch.equal(
            dense_of(rt.q_num_blocks, rt.q_indices, rt.q_indices.shape[-1]),
            dense_of(bm.q_num_blocks, bm.q_indices, bm.q_indices.shape[-1]),
        )
        assert torch.equal(
            dense_of(rt.full_q_num_blocks, rt.full_q_indices, rt.full_q_indices.shape[-1]),
            dense_of(bm.full_q_num_blocks, bm.full_q_indices, bm.full_q_indices.shape[-1]),
        )
        assert rt.sparsity() == pytest.approx(bm.sparsity())


def test_from_kv_blocks_without_full_and_default_lengths():
    counts = torch.tensor([[[1, 2, 0]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 0, 0], [1, 0, 0], [2, 0, 0]]]], dtype=torch.int32)
    bm = BlockMask.from_kv_blocks(counts, idx)
    assert tuple(bm.seq_lengths) == (3 * 128, 3 * 128)
    dense = bm.to_dense()
    assert dense.reshape(3, 3).tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 0]]
    with pytest.raises(ValueError):
        BlockMask.from_kv_blocks(counts, idx, full_kv_num_blocks=counts)
    with pytest.raises(ValueError):
        BlockMask.from_kv_blocks(counts, torch.zeros(3, dtype=torch.int32))


def test_to_device_keeps_layout():
    bm = create_block_mask(causal, 2, None, 600, 600, device="cpu")
    moved = bm.to("cpu")
    assert moved.device.type == "cpu"
    assert torch.equal(moved.to_dense(), bm.to_dense())
    assert moved.BLOCK_SIZE == bm.BLOCK_SIZE
    assert moved.blocks_follow_mask_mod and moved.mask_mod is bm.mask_mod
    for name in bm._TENSOR_ATTRS:
        assert (getattr(moved, name) is None) == (getattr(bm, name) is None), name


def test_block_sparse_mask():
    g = torch.Generator().manual_seed(6)
    layout = torch.rand(2, 3, 5, 7, generator=g) < 0.4
    bm = block_sparse_mask(layout, BLOCK_SIZE=(128, 64))
    assert bm.BLOCK_SIZE == (128, 64)
    assert tuple(bm.seq_lengths) == (5 * 128, 7 * 64)
    assert torch.equal(bm.to_dense().bool(), layout)
    assert int(bm.kv_num_blocks.sum()) == 0  # every listed block is full
    partial, full = layouts(bm, 2, 3)
    assert torch.equal(full, layout)
    assert bm.sparsity() == pytest.approx(100.0 * (1 - layout.sum().item() / layout.numel()))
    two_d = block_sparse_mask(layout[0, 0], BLOCK_SIZE=128, seq_lengths=(600, 800))
    assert two_d.shape == (1, 1, 600, 800)
    assert torch.equal(two_d.to_dense()[0, 0].bool(), layout[0, 0])
    # q-major transposes
    qf = dense_of(bm.full_q_num_blocks, bm.full_q_indices, bm.full_q_indices.shape[-1])
    assert torch.equal(qf.transpose(-1, -2), layout)


def test_block_sparse_mask_bad_layout():
    with pytest.raises(TypeError, match="bool"):
        block_sparse_mask(torch.ones(1, 1, 4, 4, dtype=torch.int32))
    with pytest.raises(TypeError):
        block_sparse_mask(torch.ones(4, 4))
    with pytest.raises(ValueError):
        block_sparse_mask(torch.ones(2, 4, 4, dtype=torch.bool))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("block_size", [0, -128, (128, -50), 8.0, (128, 0), (128,)])
def test_bad_block_size(block_size):
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(causal, None, None, 512, 512, device="cpu", BLOCK_SIZE=block_size)


@pytest.mark.parametrize("q_len,kv_len", [(0, 10), (10, 0), (-1, 10)])
def test_bad_lengths(q_len, kv_len):
    with pytest.raises(ValueError):
        create_block_mask(causal, None, None, q_len, kv_len, device="cpu")


# ---------------------------------------------------------------- torch's BlockMask


def _torch_create_block_mask():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    return fa.create_block_mask


@pytest.mark.parametrize(
    "name,B,H,q_len,kv_len,bs",
    [
        ("causal", None, None, 1000, 1000, 128),
        ("causal", None, None, 1000, 777, (128, 64)),
        ("sliding", 2, None, 1024, 1024, 128),
        ("prefix", None, 2, 777, 1000, 128),
        ("document", None, None, 1000, 1000, (128, 64)),
        ("per_head", 2, 3, 640, 512, 64),
    ],
)
def test_torch_block_mask_converts(name, B, H, q_len, kv_len, bs):
    torch_create = _torch_create_block_mask()
    doc_ids = random_doc_ids(max(q_len, kv_len), 5, seed=7)

    def per_head(b, h, q, kv):
        return (q >= kv) & (q - kv < 100 * (h + 1))

    fn = {
        "causal": causal, "sliding": sliding(256), "prefix": prefix_lm(200),
        "document": document(doc_ids), "per_head": per_head,
    }[name]
    tbm = torch_create(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
    converted = BlockMask.from_torch(tbm)
    assert tuple(converted.seq_lengths) == (q_len, kv_len)
    assert converted.BLOCK_SIZE == ((bs, bs) if isinstance(bs, int) else tuple(bs))
    ours = create_block_mask(fn, B, H, q_len, kv_len, device="cpu", BLOCK_SIZE=bs)
    Bx, Hx = B or 1, H or 1
    theirs = converted.to_dense()
    mine = ours.to_dense()
    n_q, n_kv = mine.shape[-2:]
    assert torch.equal(
        theirs.expand(Bx, Hx, *theirs.shape[-2:])[..., :n_q, :n_kv],
        mine.expand(Bx, Hx, *mine.shape[-2:]),
    )
    assert torch.equal(theirs.bool(), tbm.to_dense().bool())
    # the converted mask satisfies the same tile rules against brute force
    truth = dense_mask(fn, Bx, Hx, q_len, kv_len)
    bq, bkv = converted.BLOCK_SIZE
    any_true, all_true = tile_stats(truth, bq, bkv)
    partial, full = layouts(converted, Bx, Hx)
    partial, full = partial[..., :n_q, :n_kv], full[..., :n_q, :n_kv]
    assert torch.equal(partial | full, any_true)
    assert not (full & ~all_true).any()
    # flexgen's transposes, rebuilt or adopted, describe the same tiles
    qp = dense_of(converted.q_num_blocks, converted.q_indices, converted.q_indices.shape[-1])
    assert torch.equal(qp.transpose(-1, -2).expand(Bx, Hx, -1, -1)[..., :n_q, :n_kv], partial)
    assert BlockMask.from_torch(converted) is converted


def test_torch_block_mask_without_q_lists():
    torch_create = _torch_create_block_mask()
    tbm = torch_create(causal, None, None, 512, 512, device="cpu")
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    bare = fa.BlockMask.from_kv_blocks(
        tbm.kv_num_blocks, tbm.kv_indices, tbm.full_kv_num_blocks, tbm.full_kv_indices,
        BLOCK_SIZE=tbm.BLOCK_SIZE, mask_mod=causal, seq_lengths=(512, 512),
    )
    converted = BlockMask.from_torch(bare)
    assert converted.q_num_blocks is not None
    ours = create_block_mask(causal, None, None, 512, 512, device="cpu")
    assert torch.equal(converted.to_dense(), ours.to_dense())


def test_batch_only_through_buffers_shares_one_analysis(monkeypatch):
    """b reaches a per-row document mask only through a buffer index: one static analysis for
    every batch row, the rest decided by evaluation, and the blocks equal brute force."""
    from flexgen import blockmask
    from flexgen.dsl.ir import inputs_outside_loads

    b, n = 3, 700
    ids = torch.sort(torch.randint(0, 4, (b, n)), dim=1).values.to(torch.int32).reshape(-1)

    def per_row_docs(bi, h, q_idx, kv_idx):
        return (ids[bi * n + q_idx] == ids[bi * n + kv_idx]) & (q_idx >= kv_idx)

    assert inputs_outside_loads(as_mask_mod(per_row_docs).expr) == {"q_idx", "kv_idx"}
    calls = []
    real = blockmask._classify
    monkeypatch.setattr(blockmask, "_classify", lambda *a: calls.append(a) or real(*a))
    check_against_brute_force(per_row_docs, b, None, n, n)
    assert len(calls) == 1
