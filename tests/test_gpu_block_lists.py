"""Block masks whose lists were made by hand (a block-sparse layout, BlockMask.from_kv_blocks, PyTorch's own
BlockMask), on the GPU: the kernels visit exactly the listed blocks, apply mask_mod in the partial ones only and
show the full ones whole, whatever mask_mod would say elsewhere. The truth is an element mask that says the same
(a lookup of each element's block state), through the float64 reference, with the bars of test_gpu_forward.py and
test_gpu_backward.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import flexgen
from flexgen.blockmask import dense_to_lists
from test_gpu_backward import assert_grads_match, flexgen_grads, lowp_grads, reference_grads
from test_gpu_forward import assert_matches, fresh_seed, poison, run_flexgen

gpu = pytest.mark.gpu
DEV = "cuda"
B, H, L = 2, 3, 1000


def _causal(b, h, q, kv):
    return q >= kv


def _random_states(q_block: int, kv_block: int) -> torch.Tensor:
    """(nQ, nKV) int32: 0 absent, 1 partial, 2 full; every row sees its first KV block whole (no empty rows)."""
    n_q, n_kv = -(-L // q_block), -(-L // kv_block)
    states = torch.randint(0, 3, (n_q, n_kv), device=DEV, dtype=torch.int32)
    states[:, 0] = 2
    return states


def _hand_made(states: torch.Tensor, block: tuple[int, int], mask_mod, source: str):
    """The lists of `states` made by `source`'s from_kv_blocks; "-compact": then cut, as PyTorch allows, to as many
    columns as the longest list (q lists included), in a mask built by the class's constructor."""
    if source.endswith("-compact"):
        states[:, 1::2] = 0  # (rows of at most half the blocks: the cut lists are narrower than the grid)
    partial, full = dense_to_lists((states == 1)[None, None]), dense_to_lists((states == 2)[None, None])
    if source.startswith("torch"):
        from torch.nn.attention.flex_attention import BlockMask as cls
    else:
        cls = flexgen.BlockMask
    bm = cls.from_kv_blocks(*partial, *full, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(L, L))
    if not source.endswith("-compact"):
        return bm
    cut = {}
    for kind in ("kv", "full_kv", "q", "full_q"):
        counts, indices = getattr(bm, f"{kind}_num_blocks"), getattr(bm, f"{kind}_indices")
        cut[f"{kind}_indices"] = indices[..., :max(int(counts.max()), 1)].contiguous()
    assert cut["kv_indices"].shape[-1] < bm.kv_indices.shape[-1]
    return cls(seq_lengths=bm.seq_lengths, kv_num_blocks=bm.kv_num_blocks, full_kv_num_blocks=bm.full_kv_num_blocks,
               q_num_blocks=bm.q_num_blocks, full_q_num_blocks=bm.full_q_num_blocks, BLOCK_SIZE=bm.BLOCK_SIZE,
               mask_mod=bm.mask_mod, **cut)


def _same_as_lists(states: torch.Tensor, block: tuple[int, int], mask_mod):
    """The element mask a kernel walking the lists shows: full blocks whole, partial ones through mask_mod."""
    bq, bkv = block

    def element(b, h, q, kv):
        state = states[q // bq, kv // bkv]
        decided = mask_mod(b, h, q, kv) if mask_mod is not None else state > 0
        return (state == 2) | ((state == 1) & decided)

    return flexgen.mask_mod(element)


def _assert_grads_as_reference(got, q, k, v, do, same, what: str) -> None:
    """dQ, dK, dV of a flexgen call against the float64 reference over `same` (the element mask the lists stand
    for), with PyTorch's low-precision error as the bar."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    ref = reference_grads(q, k, v, do, None, same, scale, False, ())
    base = lowp_grads(q, k, v, do, None, same, scale, ())
    assert_grads_match(got, ref, base, ["dq", "dk", "dv"], what)


CASES = [  # (mask_mod, BLOCK_SIZE, where the lists come from)
    (None, (128, 128), "flexgen"),  # a block-sparse layout: partial blocks are shown whole
    (_causal, (128, 128), "flexgen"),
    (_causal, (128, 128), "torch"),
    (_causal, (64, 128), "flexgen"),  # query blocks below the forward's tile: no union may be walked
    (None, (256, 128), "torch"),
    (_causal, (32, 128), "torch"),  # shorter than every forward tile: the unfused path
    (_causal, (128, 128), "torch-compact"),  # lists cut to the longest one's length
    (None, (128, 64), "flexgen-compact"),
]


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask_mod,block,source", CASES)
def test_hand_made_lists_forward(mask_mod, block, source, D):
    seed = fresh_seed()
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    states = _random_states(*block)
    bm = _hand_made(states, block, mask_mod, source)
    out, lse = run_flexgen(q, k, v, None, bm)
    assert_matches(out, lse, q, k, v, None, _same_as_lists(states, block, mask_mod), seed=seed,
                   what=f"hand-made lists {source} {block} mask_mod={getattr(mask_mod, '__name__', None)} D={D}")


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("mask_mod,block,source", CASES)
def test_hand_made_lists_backward(mask_mod, block, source, D):
    seed = fresh_seed()
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    states = _random_states(*block)
    bm = _hand_made(states, block, mask_mod, source)
    got = flexgen_grads(q, k, v, do, None, bm, False, ())
    _assert_grads_as_reference(got, q, k, v, do, _same_as_lists(states, block, mask_mod),
                               f"hand-made lists {source} {block} D={D} (seed {seed})")


@gpu
def test_lists_from_the_mask_mod_stay_exact_when_a_tile_merges_query_blocks():
    """The same random block states as a mask_mod's own lists (create_block_mask): a forward tile of 128 rows
    (a mask that reads a buffer keeps D = 64 on two warpgroups) walks the union of two 64-row blocks."""
    seed = fresh_seed()
    q, k, v = (torch.randn(B, H, L, 64, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    same = _same_as_lists(_random_states(64, 128), (64, 128), _causal)
    bm = flexgen.create_block_mask(same, None, None, L, L, device=DEV, BLOCK_SIZE=(64, 128))
    assert bm.blocks_follow_mask_mod
    out, lse = run_flexgen(q, k, v, None, bm)
    assert_matches(out, lse, q, k, v, None, same, seed=seed, what="derived lists (64, 128) D=64")


@gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("block", [(32, 128), (64, 128), (128, 128)])
def test_pytorch_masks_from_their_mask_mod_are_adopted_and_exact(D, block):
    """PyTorch's create_block_mask computes its lists from the mask_mod: flexgen adopts them (blockmask_follow.py),
    so that a tile may walk the union of their query blocks, and the result stays the mask_mod's."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    from flexgen.blockmask import BlockMask
    from flexgen.blockmask_follow import adopt_if_lists_follow
    from flexgen.variant import mod_parts

    seed = fresh_seed()
    q, k, v = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    bm = torch_create_block_mask(_causal, None, None, L, L, device=DEV, BLOCK_SIZE=block)
    ours = BlockMask.from_torch(bm)
    assert adopt_if_lists_follow(ours, *mod_parts(ours.mask_mod, "mask")).blocks_follow_mask_mod
    out, lse = run_flexgen(q, k, v, None, bm)
    assert_matches(out, lse, q, k, v, None, flexgen.mask_mod(_causal), seed=seed,
                   what=f"PyTorch causal mask {block} D={D}")


def _torch_lists_naming_blocks_outside(states: torch.Tensor, block: tuple[int, int], mask_mod):
    """PyTorch's BlockMask whose partial lists also name block -1 and whose full lists name block n_kv (one past
    the last) in each row, as PyTorch's PagedAttention lists page -1 for pages it has not reserved."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    states = states.clone()
    states[:, -1] = 0  # a free slot in every row's lists for the extra entry
    n_kv = states.shape[1]
    lists = []
    for kind, outside in ((1, -1), (2, n_kv)):
        counts, indices = dense_to_lists((states == kind)[None, None])
        rows = torch.arange(indices.shape[-2], device=DEV)
        indices[0, 0, rows, counts[0, 0].long()] = outside
        lists += [counts + 1, indices]
    return TorchBlockMask.from_kv_blocks(*lists, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(L, L)), states


@gpu
@pytest.mark.parametrize("D", [64, 128])
def test_pytorch_lists_naming_blocks_outside_the_sequence_leave_them_out(D):
    """Blocks listed outside [0, n_kv) hold no keys: the kernels must not read K or V there, and the result is the
    mask of the blocks inside (PyTorch masks them through its paged mask_mod)."""
    seed = fresh_seed()
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    bm, states = _torch_lists_naming_blocks_outside(_random_states(128, 128), (128, 128), _causal)
    same = _same_as_lists(states, (128, 128), _causal)
    out, lse = run_flexgen(q, k, v, None, bm)
    assert_matches(out, lse, q, k, v, None, same, seed=seed, what=f"lists naming blocks outside D={D}")
    got = flexgen_grads(q, k, v, do, None, bm, False, ())
    _assert_grads_as_reference(got, q, k, v, do, same, f"lists naming blocks outside D={D} (seed {seed})")


@gpu
def test_compiled_calls_leave_out_blocks_listed_outside_the_sequence(isolated_kernel_cache):
    """Under torch.compile the lists hold no values while the graph is traced: the graph itself must drop the
    blocks outside [0, n_kv), forward and backward, or the kernels would read K and V at block -1."""
    seed = fresh_seed()
    D = 64
    q, k, v, do = (torch.randn(B, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
    bm, states = _torch_lists_naming_blocks_outside(_random_states(128, 128), (128, 128), _causal)
    same = _same_as_lists(states, (128, 128), _causal)
    torch._dynamo.reset()
    compiled = torch.compile(flexgen.flex_attention, fullgraph=True)
    q1, k1, v1 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    poison(((B, H, L, D), q.dtype), ((B, H, L), torch.float32))
    out, aux = compiled(q1, k1, v1, block_mask=bm, return_aux=flexgen.AuxRequest(lse=True))
    out.backward(do)
    torch.cuda.synchronize()
    assert_matches(out.detach(), aux.lse, q, k, v, None, same, seed=seed,
                   what="compiled, lists naming blocks outside")
    _assert_grads_as_reference([q1.grad, k1.grad, v1.grad], q, k, v, do, same,
                               f"compiled, lists naming blocks outside (seed {seed})")
