"""Decoding-shaped forwards (a few query rows against a long cache) on the GPU: the split-key forward and its merge
(runtime/split_kv.py) against the float64 ground truth, with the bar of test_gpu_forward.py (twice PyTorch's own
low-precision error); gradients through such a forward with test_gpu_backward.py's.

Each test checks that the split path ran with more than one part (a spy on the merge), so a change of the
planning rule cannot leave these tests on another kernel unnoticed. Under GQA the query heads of a KV head share a
tile (families.packed_heads) wherever the mask's lists allow it.
"""
from __future__ import annotations

import pytest
import torch

import flexgen
import test_gpu_backward as bwd
import test_gpu_forward as fwd
from flexgen.runtime import split_kv

gpu = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture
def merges(monkeypatch):
    """The number of parts each merge launched so far combined (one entry per fwd_combine launch)."""
    seen = []
    original = split_kv.Combine.run

    def spy(self, *args, **kwargs):
        seen.append(self.splits)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(split_kv.Combine, "run", spy)
    return seen


@pytest.fixture
def packs(monkeypatch):
    """The packed_heads of each split-key forward planned so far."""
    from flexgen.runtime import families

    seen = []
    original = families.packed_heads

    def spy(*args):
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(families, "packed_heads", spy)
    return seen


def _decode_mask(name: str, lq: int, lkv: int):
    """Masks as a decoding step writes them: query row i is token lkv - lq + i of the sequence (an offset tensor,
    so that every length runs one kernel)."""
    offset = torch.tensor([lkv - lq], device=DEV, dtype=torch.int32)
    if name == "decode_causal":
        return lambda b, h, q, kv: q + offset[0] >= kv
    if name == "decode_window":  # the last 300 tokens: most parts of the cache hold no tile of it
        return lambda b, h, q, kv: (q + offset[0] >= kv) & (q + offset[0] - kv < 300)
    if name == "decode_sinks":  # StreamingLLM: 4 sink tokens and a window of 200
        return lambda b, h, q, kv: (kv < 4) | ((q + offset[0] >= kv) & (q + offset[0] - kv < 200))
    raise KeyError(name)


def _check_decode_mask(name, s: fwd.Shape, D, dtype, gqa_kv_heads=None):
    seed = fwd.fresh_seed()
    hkv = gqa_kv_heads or s.H
    q = fwd.randn(s.B, s.H, s.Lq, D, dtype=dtype)
    k, v = (fwd.randn(s.B, hkv, s.Lkv, D, dtype=dtype) for _ in range(2))
    mask = _decode_mask(name, s.Lq, s.Lkv)
    bm = flexgen.create_block_mask(mask, None, None, s.Lq, s.Lkv, device=DEV)
    out, lse = fwd.run_flexgen(q, k, v, None, bm, gqa=gqa_kv_heads is not None)
    fwd.assert_matches(out, lse, q, k, v, None, mask, gqa=gqa_kv_heads is not None, seed=seed,
                       what=f"{name} {s} D={D} {dtype}")


DECODE_VARIANTS = ["none", "document", "alibi", "softcap", "relative_bias", "per_head_mask", "padding_mask", "user_fn",
                   "or_masks"]
DECODE_SHAPES = [(1, 5000), (7, 3001), (64, 2049)]


@gpu
@pytest.mark.parametrize("lq,lkv", DECODE_SHAPES)
@pytest.mark.parametrize("name", DECODE_VARIANTS)
def test_decoding_variants(name, lq, lkv, merges):
    fwd.check_variant(name, fwd.Shape(2, 4, lq, lkv), 64, torch.bfloat16)
    assert merges and min(merges) > 1


@gpu
@pytest.mark.parametrize("lq,lkv", [(1, 5000), (7, 3001), (32, 2049)])  # (at most 64 rows per KV head: 32 x 2)
@pytest.mark.parametrize("name", ["decode_causal", "decode_window", "decode_sinks"])
def test_decoding_masks_at_the_end_of_the_cache(name, lq, lkv, merges):
    _check_decode_mask(name, fwd.Shape(2, 4, lq, lkv), 128, torch.bfloat16, gqa_kv_heads=2)
    assert merges and min(merges) > 1


@gpu
@pytest.mark.parametrize("lq", [1, 5, 16])
@pytest.mark.parametrize("name", ["alibi", "softcap", "user_fn", "relative_bias", "document", "or_masks", "per_head_mask"])
def test_gqa_heads_sharing_a_tile(name, lq, merges, packs):
    """Under GQA a tile holds the query heads of one KV head (row R: head R / q_len of the group): score_mods and
    masks that read the head see each row's own; a mask whose lists differ per head keeps a head per tile."""
    fwd.check_variant(name, fwd.Shape(2, 8, lq, 3000), 64, torch.bfloat16, gqa_kv_heads=2)
    assert merges and min(merges) > 1
    assert packs == [1 if name == "per_head_mask" else 4]


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_decoding_head_dims_with_gqa(D, dtype, merges):
    fwd.check_variant("none", fwd.Shape(3, 8, 1, 4099), D, fwd.DTYPES[dtype], gqa_kv_heads=2)
    _check_decode_mask("decode_causal", fwd.Shape(1, 8, 5, 2500), D, fwd.DTYPES[dtype], gqa_kv_heads=1)
    assert merges and min(merges) > 1


@gpu
def test_rows_that_see_nothing_give_zero_and_minus_inf(merges):
    """A row no part sees (and parts that see no key of a visible row) merge to O = 0 and lse = -inf."""
    fwd.check_variant("nothing", fwd.Shape(1, 2, 3, 3000), 64, torch.bfloat16)
    _check_decode_mask("decode_window", fwd.Shape(1, 2, 1, 9000), 64, torch.bfloat16)
    assert merges and min(merges) > 1


@gpu
@pytest.mark.parametrize("splits", [9, 37, 128])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_many_parts_merge_in_groups(D, splits, monkeypatch):
    """One row against a long cache in `splits` parts (forced): the merge deals them to thread groups, whose sums
    meet in shared memory, including groups whose parts all saw nothing (a window at the end of the cache)."""
    from flexgen.runtime import families

    monkeypatch.setattr(families, "kv_splits", lambda query_tiles, kv_tiles, slots: splits)
    seen = []
    original = split_kv.Combine.run

    def spy(self, *args, **kwargs):
        seen.append((self.splits, self.groups))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(split_kv.Combine, "run", spy)
    fwd.check_variant("none", fwd.Shape(1, 2, 1, 9000 + splits), D, torch.bfloat16)
    _check_decode_mask("decode_window", fwd.Shape(2, 2, 1, 9100 + splits), D, torch.bfloat16)
    groups = split_kv.part_groups(splits, 128 // (D // 8))
    assert groups > 1 and seen and set(seen) == {(splits, groups)}


@gpu
def test_a_short_sequence_is_not_split(merges):
    """Fewer KV tiles than a part's least: one part, O and lse written by the forward itself."""
    fwd.check_variant("none", fwd.Shape(2, 4, 1, 100), 64, torch.bfloat16)
    assert merges == []


@gpu
def test_split_kv_false_and_the_usual_forward_agree():
    """kernel_options split_kv=False runs the usual forward on a decoding query; both meet the bar, and their
    outputs differ by no more than the bar between them."""
    seed = fwd.fresh_seed()
    q = fwd.randn(2, 4, 3, 128, dtype=torch.bfloat16)
    k, v = (fwd.randn(2, 4, 5000, 128, dtype=torch.bfloat16) for _ in range(2))
    split = fwd.run_flexgen(q, k, v, None, None)
    usual = fwd.run_flexgen(q, k, v, None, None, kernel_options={"split_kv": False})
    for out, lse in (split, usual):
        fwd.assert_matches(out, lse, q, k, v, None, None, seed=seed, what="split_kv on and off")


@gpu
@pytest.mark.parametrize("name", ["none", "causal", "alibi_causal_learnable", "softcap_causal", "document"])
def test_gradients_through_a_decoding_forward(name, merges):
    """The backward reads only O and lse: through the split forward it gives the usual gradients (a prefill
    chunk of 48 rows over a long prefix, as chunked prefill computes it)."""
    bwd.check_variant(name, bwd.Shape(2, 4, 48, 3000), 64, torch.bfloat16)
    assert merges and min(merges) > 1


@gpu
def test_a_decoding_step_in_a_cuda_graph(merges):
    """Captured once, replayed with new queries: the workspace of the parts is the graph's own."""
    q = fwd.randn(2, 8, 1, 128, dtype=torch.bfloat16)
    k, v = (fwd.randn(2, 2, 6000, 128, dtype=torch.bfloat16) for _ in range(2))
    step = lambda: flexgen.flex_attention(q, k, v, enable_gqa=True, return_lse=True)  # noqa: E731
    step()  # compile and plan outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for _ in range(2):
        seed = fwd.fresh_seed()
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        fwd.assert_matches(out, lse, q, k, v, None, None, gqa=True, seed=seed, what="CUDA graph replay")
    assert merges and min(merges) > 1


@gpu
def test_gqa_heads_sharing_a_tile_in_one_part(merges, packs):
    """Many sequences over a short cache: one part per tile (the forward writes O and lse itself) with the query
    heads of a KV head sharing the tile."""
    fwd.check_variant("alibi", fwd.Shape(64, 8, 2, 200), 64, torch.bfloat16, gqa_kv_heads=2)
    assert merges == [] and packs == [4]


@gpu
@pytest.mark.parametrize("layout", ["blhd", "bhdl", "offset"])
def test_decoding_inputs_in_other_layouts(layout, merges):
    """(B, L, H, D) views, a strided last dimension and offset views: the packed rows' addresses and the output in
    the query's dimension order."""
    fwd.check_variant("softcap", fwd.Shape(2, 8, 3, 3000), 64, torch.bfloat16, gqa_kv_heads=2, layout=layout)
    assert merges and min(merges) > 1


@pytest.fixture
def split_rows(monkeypatch):
    """The query rows per tile of each split-key forward launched so far."""
    from flexgen.runtime import families

    seen = []
    original = families.SM80.forward_grid

    def spy(self, spec, *args):
        if spec.option("split_kv", False):
            seen.append(spec.block_m)
        return original(self, spec, *args)

    monkeypatch.setattr(families.SM80, "forward_grid", spy)
    return seen


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["none", "alibi", "softcap", "document", "decode_causal", "decode_sinks"])
def test_a_prefill_chunk_against_a_long_cache_is_split(name, D, merges, split_rows):
    """More than 64 rows per KV head (here 100 x 4) against a long cache, on a grid of few work tiles: split too
    (plan.split_block_m), on 128-row tiles, with the chunk's causal offset where the mask has one."""
    s = fwd.Shape(1, 8, 100, 5000)
    if name.startswith("decode_"):
        _check_decode_mask(name, s, D, torch.bfloat16, gqa_kv_heads=2)
    else:
        fwd.check_variant(name, s, D, torch.bfloat16, gqa_kv_heads=2)
    assert merges and min(merges) > 1
    assert split_rows and set(split_rows) == {128}


@gpu
def test_gradients_through_a_prefill_chunk(merges, split_rows):
    """The backward after a tall split forward (O and lse only) gives the usual gradients."""
    bwd.check_variant("alibi_causal_learnable", bwd.Shape(1, 4, 200, 4500), 128, torch.bfloat16)
    assert merges and min(merges) > 1 and set(split_rows) == {128}


@gpu
def test_a_query_as_long_as_its_cache_is_not_split(merges):
    """Rows past 64 per KV head with keys fewer than 8 times them: the usual forward."""
    fwd.check_variant("causal", fwd.Shape(1, 2, 300, 2000), 128, torch.bfloat16)
    assert merges == []


@gpu
def test_a_compiled_decoding_step_over_a_growing_cache_splits(merges):
    """torch.compile(dynamic=True) over caches of three lengths: the cache's length is symbolic, the query's one
    row is not, and the step still takes the split forward (plan.split_block_m decides on the rows alone)."""
    torch._dynamo.reset()
    step = torch.compile(lambda q, k, v: flexgen.flex_attention(q, k, v, enable_gqa=True, return_lse=True),
                         dynamic=True)
    for n in (3000, 4100, 5200):
        seed = fwd.fresh_seed()
        q = fwd.randn(2, 8, 1, 64, dtype=torch.bfloat16)
        k, v = (fwd.randn(2, 2, n, 64, dtype=torch.bfloat16) for _ in range(2))
        fwd.poison(((2, 8, 1, 64), torch.bfloat16), ((2, 8, 1), torch.float32))
        out, lse = step(q, k, v)
        torch.cuda.synchronize()
        fwd.assert_matches(out, lse, q, k, v, None, None, gqa=True, seed=seed, what=f"compiled step over {n} keys")
    assert merges and min(merges) > 1
