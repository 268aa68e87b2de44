"""The kernels' integer semantics, everywhere: index arithmetic in int32 (int64 after .long()) that
wraps around, in the IR evaluator, the static mask analysis (and so create_block_mask) and
reference_attention; integer constants that do not fit their type refused when a mod is traced;
infinite float constants in masks."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexgen
from flexgen.dsl import ir
from flexgen.dsl.errors import FlexgenTraceError, FlexgenTypeError
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import DType, postorder
from flexgen.dsl.mask_analysis import TileClass, classify_blocks, classify_tile
from flexgen.dsl.reference import reference_attention

from ir_strategies import make_buffers, wide_boxes, wide_masks

Q, KV = ir.input_("q_idx"), ir.input_("kv_idx")
PRODUCT_NONNEGATIVE = ir.binary("ge", ir.binary("mul", Q, KV), ir.const(0))


def grid(q_range, kv_range, b_range=(0, 1), h_range=(0, 1)):
    ar = lambda r: torch.arange(*r, dtype=torch.int64).to(torch.int32)  # noqa: E731
    return {"b": ar(b_range)[:, None, None, None], "h": ar(h_range)[None, :, None, None],
            "q_idx": ar(q_range)[None, None, :, None], "kv_idx": ar(kv_range)[None, None, None, :]}


def values(expr, q_range, kv_range, b_range=(0, 1), h_range=(0, 1), buffers=None):
    shape = tuple(r[1] - r[0] for r in (b_range, h_range, q_range, kv_range))
    return evaluate(expr, grid(q_range, kv_range, b_range, h_range), buffers or {}, {}, torch.float32).expand(shape)


# ---------------------------------------------------------------- the analysis never claims what int32 denies


def test_product_of_indices_at_64k_tokens():
    full, partial = classify_blocks(PRODUCT_NONNEGATIVE, 65536, 65536, 128, 128)
    last = values(PRODUCT_NONNEGATIVE, (65408, 65536), (65408, 65536))
    assert not last.all()  # 65535 * 65535 wraps negative in int32
    assert partial[-1, -1] and not full[-1, -1]
    # where the claim of "full" ends in each row of tiles, the tile is all True under int32
    rows = torch.arange(512)
    last_full = full.int().cumsum(1).argmax(1)  # every row starts with full tiles (kv = 0 is fine)
    assert full[:, 0].all()
    for i, j in zip(rows.tolist(), last_full.tolist()):
        q0, k0 = i * 128, j * 128
        assert values(PRODUCT_NONNEGATIVE, (q0, q0 + 128), (k0, k0 + 128)).all(), (i, j)
    assert not full.all()


def test_sum_that_the_compiler_could_fold():
    # q + c > q is "always true" to a compiler that assumes no overflow; in int32 it is not
    e = ir.binary("gt", ir.binary("add", Q, ir.const(2147483000)), Q)
    assert classify_tile(e, (0, 640), (0, 16)) is TileClass.FULL  # q + c <= 2**31 - 1 here
    assert classify_tile(e, (0, 2048), (0, 16)) is TileClass.PARTIAL
    assert classify_tile(e, (1000, 2048), (0, 16)) is TileClass.PARTIAL
    assert not values(e, (1000, 2048), (0, 16)).any()  # wrapped: every element is False


def test_narrowing_and_float_casts_are_left_to_elementwise_evaluation():
    narrowed = ir.binary("ge", ir.cast(ir.binary("mul", ir.cast(Q, DType.INT64), ir.const(65536, DType.INT64)), DType.INT32), ir.const(0))
    assert classify_tile(narrowed, (0, 32768), (0, 4)) is TileClass.FULL
    assert classify_tile(narrowed, (32000, 33000), (0, 4)) is TileClass.PARTIAL
    assert not values(narrowed, (32768, 32800), (0, 4)).all()  # 32768 * 65536 = 2**31: INT_MIN
    in_int64 = ir.binary("ge", ir.binary("mul", ir.cast(Q, DType.INT64), ir.const(2**40, DType.INT64)), ir.const(0, DType.INT64))
    assert classify_tile(in_int64, (0, 4096), (0, 4)) is TileClass.FULL  # 2**52 at most: no wrap
    assert classify_tile(in_int64, (2**23, 2**23 + 8), (0, 4)) is TileClass.PARTIAL  # 2**63: wraps
    assert not values(in_int64, (2**23, 2**23 + 8), (0, 4)).all()
    as_int = ir.binary("ge", ir.cast(ir.binary("mul", ir.cast(Q, DType.FLOAT32), ir.const(1e6)), DType.INT32), ir.const(0))
    assert classify_tile(as_int, (0, 2000), (0, 4)) is TileClass.FULL
    assert classify_tile(as_int, (0, 4000), (0, 4)) is TileClass.PARTIAL  # past 2**31: C leaves it undefined


def test_evaluator_casts_floats_like_the_gpu():
    x = ir.binary("mul", ir.cast(Q, DType.FLOAT32), ir.const(1e9))
    for dtype, top in ((DType.INT32, 2**31 - 1), (DType.INT64, None)):
        got = evaluate(ir.cast(ir.binary("sub", ir.const(0.0), x), dtype), {"q_idx": torch.tensor([0, 1, 3])})
        want = [0, -(10**9), -(3 * 10**9) if top is None else -(2**31)]
        assert got.tolist() == want
    nan = ir.binary("div", ir.const(0.0), ir.cast(Q, DType.FLOAT32))
    assert evaluate(ir.cast(nan, DType.INT32), {"q_idx": torch.tensor([0])}).tolist() == [0]


def test_create_block_mask_and_reference_follow_int32():
    # q * kv * 4096 wraps for q * kv >= 2**19, i.e. in the lower right part of a 1024 x 1024 grid
    def wraps(b, h, q_idx, kv_idx):
        return q_idx * kv_idx * 4096 >= 0

    n, blk = 1024, 64
    bm = flexgen.create_block_mask(wraps, None, None, n, n, device="cpu", BLOCK_SIZE=blk)
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    dense = ((qi * ki * 4096 + 2**31) % 2**32 - 2**31) >= 0  # int32 wrap-around, computed in int64
    assert not dense.all() and dense[:128, :128].all()
    tiles = dense.reshape(n // blk, blk, n // blk, blk).permute(0, 2, 1, 3).flatten(2)
    visited = bm.to_dense()[0, 0].bool()
    full = bm._dense(bm.full_kv_num_blocks, bm.full_kv_indices)[0, 0]
    assert torch.equal(full, tiles.all(-1))  # refined by int32 evaluation: exact
    assert torch.equal(visited, tiles.any(-1))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    want = reference_attention(q, k, v, mask_mod=lambda b, h, i, j: dense[i, j])
    torch.testing.assert_close(reference_attention(q, k, v, mask_mod=wraps), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference_attention(q, k, v, block_mask=bm), want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- random expressions at int32's limits


def oracle(expr, point: dict, buffers: dict):
    """One element, in Python integers wrapped by hand: an evaluator written independently of torch."""
    bits = {DType.INT32: 32, DType.INT64: 64}
    val = {}
    for n in postorder(expr):
        a = [val[x.digest] for x in n.args]
        wrap = (lambda v, nb=bits.get(n.dtype): (v + 2 ** (nb - 1)) % 2**nb - 2 ** (nb - 1)) if n.dtype.is_int else bool
        op = n.op
        if op == "input":
            out = point[n.attr]
        elif op == "const":
            out = n.attr
        elif op == "load":
            out = int(buffers[n.attr.name][a[0]])
        elif op == "cast":
            out = wrap(int(a[0]))
        elif op in ("add", "sub", "mul"):
            out = wrap({"add": a[0] + a[1], "sub": a[0] - a[1], "mul": a[0] * a[1]}[op])
        elif op in ("neg", "abs"):
            out = wrap(-a[0] if op == "neg" else abs(a[0]))
        elif op in ("floordiv", "mod"):
            out = wrap(a[0] // a[1] if op == "floordiv" else a[0] % a[1])
        elif op in ("min", "max"):
            out = min(a) if op == "min" else max(a)
        elif op == "where":
            out = a[1] if a[0] else a[2]
        elif op == "not":
            out = not a[0]
        else:
            out = {"lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y,
                   "eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "and": lambda x, y: x and y,
                   "or": lambda x, y: x or y, "xor": lambda x, y: x != y}[op](*a)
        val[n.digest] = out
    return val[expr.digest]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=wide_masks(max_depth=3), box=wide_boxes(), seed=st.integers(0, 2**16))
def test_wide_masks_evaluator_is_int32_and_analysis_is_sound(expr, box, seed):
    qr, kr, br, hr = box
    buffers = make_buffers(seed)
    vals = values(expr, qr, kr, br, hr, buffers)
    g = torch.Generator().manual_seed(seed)
    for _ in range(6):
        idx = [int(torch.randint(r[0], r[1], (), generator=g)) for r in (br, hr, qr, kr)]
        point = dict(zip(("b", "h", "q_idx", "kv_idx"), idx))
        want = oracle(expr, point, buffers)
        assert bool(vals[idx[0] - br[0], idx[1] - hr[0], idx[2] - qr[0], idx[3] - kr[0]]) == want, (expr, point)
    claim = classify_tile(expr, qr, kr, br, hr)
    assert claim is TileClass.PARTIAL or claim is (TileClass.FULL if vals.all() else TileClass.EMPTY if not vals.any() else None), (expr, box)


# ---------------------------------------------------------------- constants that do not fit


def test_ir_refuses_constants_outside_their_type():
    with pytest.raises(ir.IRTypeError, match=r"2\*\*70 does not fit in int64.*\[-2\*\*63, 2\*\*63 - 1\]"):
        ir.const(2**70)
    with pytest.raises(ir.IRTypeError, match=r"does not fit in int32.*\[-2\*\*31, 2\*\*31 - 1\]"):
        ir.const(2**40, DType.INT32)
    with pytest.raises(ir.IRTypeError, match="no inf"):
        ir.const(math.inf, DType.INT64)
    assert ir.const(2**63 - 1).dtype is DType.INT64 and ir.const(-(2**63)).dtype is DType.INT64
    assert ir.const(2**31 - 1).dtype is DType.INT32


@pytest.mark.parametrize("fn,where", [
    (lambda b, h, q_idx, kv_idx: q_idx < 2**70, "int32"),
    (lambda b, h, q_idx, kv_idx: q_idx + 2**31 > kv_idx, "int32"),
    (lambda b, h, q_idx, kv_idx: q_idx.long() - 2**64 < kv_idx, "int64"),
    (lambda b, h, q_idx, kv_idx: torch.full_like(q_idx, 2**40) > kv_idx, "int32"),
])
def test_tracing_refuses_constants_outside_int32_and_int64(fn, where):
    with pytest.raises(FlexgenTypeError, match=f"does not fit in {where}") as info:
        flexgen.mask_mod(fn)
    assert "allowed range" in str(info.value) and "test_int32_semantics.py" in str(info.value)


def test_constants_that_fit_after_long_are_int64():
    mod = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: q_idx.long() * 2**40 >= kv_idx)
    q = torch.tensor([0, 1, 2**23, 2**24 - 1], dtype=torch.int32)
    got = mod.evaluate(q_idx=q[:, None], kv_idx=torch.tensor([0], dtype=torch.int32)[None, :])
    assert got.flatten().tolist() == ((q.long() * 2**40) >= 0).tolist() == [True, True, False, False]  # int64 wraps


def test_text_form_and_parameters_refuse_constants_outside_int64():
    with pytest.raises(FlexgenTraceError, match="does not fit in int32"):
        flexgen.mask_mod("q_idx < 1180591620717411303424")
    with pytest.raises(FlexgenTypeError, match=r"parameter 'w' = 2\*\*70 does not fit in int64"):
        flexgen.mask_mod("q_idx - kv_idx < w", w=2**70)
    assert flexgen.mask_mod("q_idx - kv_idx < w", w=2**40).param_specs == {"w": DType.INT64}


# ---------------------------------------------------------------- infinite float constants


@pytest.mark.parametrize("bound", [math.inf, "param"])
def test_infinite_constants_in_masks(bound):
    if bound == "param":
        mod = flexgen.mask_mod("q_idx - kv_idx < w", w=math.inf)
    else:
        mod = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) * 0.5 < bound)
    bm = flexgen.create_block_mask(mod, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    assert bm.full_kv_num_blocks.eq(4).all() and bm.kv_num_blocks.eq(0).all()  # decided statically: all True
    never = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, 0.0, -math.inf) == -math.inf)
    bm = flexgen.create_block_mask(never, None, None, 256, 256, device="cpu", BLOCK_SIZE=64)
    full = bm._dense(bm.full_kv_num_blocks, bm.full_kv_indices)[0, 0]
    assert torch.equal(bm.to_dense()[0, 0].bool(), torch.ones(4, 4, dtype=torch.bool).triu())
    assert torch.equal(full, torch.ones(4, 4, dtype=torch.bool).triu(1))


# ---------------------------------------------------------------- the kernel's own evaluation


@pytest.mark.gpu
@pytest.mark.parametrize("source", [
    "q_idx * kv_idx * 4096 >= 0",  # wraps for q * kv >= 2**19
    "q_idx + 2147483000 > q_idx",  # False from q = 648 on; a compiler assuming no overflow makes it True
])
def test_kernel_mask_arithmetic_wraps_like_int32(source):
    """Every tile partial, so the kernel evaluates the mask at every element; with q = k = 0 each
    row's lse is log(number of visible keys), which must match the int32 evaluation exactly."""
    n, blk = 1024, 128
    mod = flexgen.mask_mod(source)
    ar = torch.arange(n, dtype=torch.int32)
    visible = mod.evaluate(torch.float32, q_idx=ar[:, None], kv_idx=ar[None, :]).expand(n, n)
    assert 0 < int(visible.sum()) < n * n
    rows = n // blk
    bm = flexgen.BlockMask.from_kv_blocks(
        torch.full((1, 1, rows), rows, dtype=torch.int32, device="cuda"),
        torch.arange(rows, dtype=torch.int32, device="cuda").expand(1, 1, rows, rows).contiguous(),
        BLOCK_SIZE=blk, mask_mod=mod, seq_lengths=(n, n),
    )
    q = torch.zeros(1, 2, n, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, n, 64, device="cuda", dtype=torch.bfloat16)
    out, lse = flexgen.flex_attention(q, q.clone(), v, block_mask=bm, return_lse=True)
    counts = visible.sum(-1).to(lse.device)
    lse = lse.float()
    assert torch.isneginf(lse[:, :, counts == 0]).all() and (out[:, :, counts == 0] == 0).all()
    seen = torch.exp(lse[:, :, counts > 0]).round()
    assert torch.equal(seen, counts[counts > 0].float().expand_as(seen))
    want = reference_attention(q.double().cpu(), q.double().cpu(), v.double().cpu(), block_mask=bm.to("cpu"))
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)
