"""Random plain-Python mask_mods, valid and invalid (tests/ir_strategies.py: mask_programs): tracing
gives either a flexgen error (never an internal exception) or a Mod on which three things agree
exactly, at index positions up to int32's limits: the IR's evaluation, plain torch running the
function per element with int32 indices (vmap, as PyTorch's FlexAttention does), and the static
block-mask analysis (a tile it calls full is all True, one it calls empty all False)."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexgen
from flexgen.dsl.errors import FlexgenTraceError
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.mask_analysis import TileClass, classify_blocks, classify_tile

from ir_strategies import mask_programs, program_mod, wide_boxes


def eager(fn, ranges):
    """fn per element, by torch alone: vmap over kv_idx, q_idx, h and b, int32 indices."""
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=dims)
    return fn(*(torch.arange(lo, hi, dtype=torch.int64).to(torch.int32) for lo, hi in ranges))


def traced_values(mod, ranges):
    b, h, q, kv = (torch.arange(lo, hi, dtype=torch.int64).to(torch.int32) for lo, hi in ranges)
    grid = {"b": b[:, None, None, None], "h": h[None, :, None, None], "q_idx": q[None, None, :, None],
            "kv_idx": kv[None, None, None, :]}
    shape = tuple(hi - lo for lo, hi in ranges)
    return evaluate(mod.expr, grid, mod.buffers, mod.params, torch.float32).expand(shape)


def truth(values):
    return TileClass.FULL if bool(values.all()) else TileClass.EMPTY if not bool(values.any()) else TileClass.PARTIAL


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=mask_programs(depth=3), box=wide_boxes(max_size=8), grid=st.tuples(st.integers(1, 40), st.integers(1, 40),
       st.integers(1, 9), st.integers(1, 9)))
def test_random_mask_mods(case, box, grid):
    program, valid = case
    fn = program_mod(program)
    try:
        mod = flexgen.mask_mod(fn)
    except FlexgenTraceError as e:
        assert not valid, (program, e)
        assert str(e).strip()
        return
    assert valid, f"tracing accepted an invalid mod: {program}"
    qr, kr, br, hr = box
    ranges = (br, hr, qr, kr)
    ir_values = traced_values(mod, ranges)
    torch_values = eager(fn, ranges)
    assert torch_values.dtype == torch.bool and torch.equal(ir_values, torch_values), (program, box)
    claim = classify_tile(mod.expr, qr, kr, br, hr, mod.params)
    assert claim is TileClass.PARTIAL or claim is truth(ir_values), (program, box, claim)
    q_len, kv_len, bq, bkv = grid
    full, partial = classify_blocks(mod.expr, q_len, kv_len, bq, bkv, mod.params, b_range=br, h_range=hr)
    values = traced_values(mod, (br, hr, (0, q_len), (0, kv_len)))
    for i in range(full.shape[0]):
        for j in range(full.shape[1]):
            tile = values[..., i * bq : (i + 1) * bq, j * bkv : (j + 1) * bkv]
            assert not full[i, j] or tile.all(), (program, grid, i, j)
            assert full[i, j] or partial[i, j] or not tile.any(), (program, grid, i, j)
