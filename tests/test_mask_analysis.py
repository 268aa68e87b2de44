import time

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flexgen.dsl import ir
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import BufferSpec, DType
from flexgen.dsl.mask_analysis import TileClass, classify_blocks, classify_tile

from ir_strategies import affine_masks, bool_exprs, int_exprs, make_buffers, make_params

q = ir.input_("q_idx")
kv = ir.input_("kv_idx")
h = ir.input_("h")
W = ir.param("w", DType.INT32)
P = ir.param("p", DType.INT32)
DOC = BufferSpec("doc", "int32", 1)


def k(v):
    return ir.const(v)


def land(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = ir.binary("and", out, x)
    return out


def lor(a, b):
    return ir.binary("or", a, b)


CAUSAL = ir.binary("ge", q, kv)
SLIDING = land(CAUSAL, ir.binary("lt", ir.binary("sub", q, kv), W))
PREFIX_LM = lor(ir.binary("lt", kv, P), CAUSAL)
BAND = ir.binary("le", ir.unary("abs", ir.binary("sub", q, kv)), W)  # symmetric window
NOT_CAUSAL = ir.unary("not", CAUSAL)
SLIDING_PREFIX = lor(SLIDING, ir.binary("lt", kv, P))
BLOCK_CAUSAL = ir.binary("ge", ir.binary("floordiv", q, k(128)), ir.binary("floordiv", kv, k(128)))
OFFSET_CAUSAL = ir.binary("ge", ir.binary("add", q, k(37)), kv)  # bottom-right aligned causal, say
DOCUMENT = land(CAUSAL, ir.binary("eq", ir.load(DOC, (q,)), ir.load(DOC, (kv,))))
DECISIVE_MASKS = {
    "causal": CAUSAL,
    "sliding": SLIDING,
    "prefix_lm": PREFIX_LM,
    "band": BAND,
    "not_causal": NOT_CAUSAL,
    "sliding_or_prefix": SLIDING_PREFIX,
    "offset_causal": OFFSET_CAUSAL,
    "sliding_and_not_prefix": land(SLIDING, ir.unary("not", ir.binary("lt", kv, P))),
}
PARAMS = {"w": 100, "p": 300}


def brute(expr, q_range, kv_range, b_range=(0, 1), h_range=(0, 1), params=None, buffers=None, fdt=torch.float64):
    """The mask at every point of the box, with the kernels' int32 index arithmetic."""
    inputs = {
        "b": torch.arange(*b_range, dtype=torch.int32)[:, None, None, None],
        "h": torch.arange(*h_range, dtype=torch.int32)[None, :, None, None],
        "q_idx": torch.arange(*q_range, dtype=torch.int32)[None, None, :, None],
        "kv_idx": torch.arange(*kv_range, dtype=torch.int32)[None, None, None, :],
    }
    shape = (b_range[1] - b_range[0], h_range[1] - h_range[0], q_range[1] - q_range[0], kv_range[1] - kv_range[0])
    return evaluate(expr, inputs, buffers or {}, params or {}, fdt).expand(shape)


def truth(values: torch.Tensor) -> TileClass:
    if bool(values.all()):
        return TileClass.FULL
    if not bool(values.any()):
        return TileClass.EMPTY
    return TileClass.PARTIAL


def sound(claim: TileClass, values: torch.Tensor) -> bool:
    return claim is TileClass.PARTIAL or claim is truth(values)


def tile_truth(expr, q_len, kv_len, bq, bkv, params, buffers=None):
    """Brute-force FULL/EMPTY for every tile of the grid."""
    vals = brute(expr, (0, q_len), (0, kv_len), params=params, buffers=buffers)[0, 0]
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    full = torch.zeros(nq, nkv, dtype=torch.bool)
    empty = torch.zeros(nq, nkv, dtype=torch.bool)
    for i in range(nq):
        for j in range(nkv):
            t = vals[i * bq : (i + 1) * bq, j * bkv : (j + 1) * bkv]
            full[i, j] = bool(t.all())
            empty[i, j] = not bool(t.any())
    return full, empty


# ---------------------------------------------------------------- single tiles


def test_causal_tiles():
    assert classify_tile(CAUSAL, (128, 256), (0, 128)) is TileClass.FULL  # strictly below the diagonal
    assert classify_tile(CAUSAL, (0, 128), (128, 256)) is TileClass.EMPTY  # strictly above
    assert classify_tile(CAUSAL, (0, 128), (0, 128)) is TileClass.PARTIAL  # on it
    assert classify_tile(CAUSAL, (127, 128), (0, 128)) is TileClass.FULL  # touching the diagonal
    assert classify_tile(CAUSAL, (100, 150), (150, 151)) is TileClass.EMPTY


def test_params_are_bound_values():
    assert classify_tile(SLIDING, (1000, 1064), (0, 64), params={"w": 100}) is TileClass.EMPTY
    assert classify_tile(SLIDING, (1000, 1064), (936, 937), params={"w": 100}) is TileClass.PARTIAL
    assert classify_tile(SLIDING, (1000, 1064), (964, 1000), params={"w": 100}) is TileClass.FULL
    # unbound: the window may be anything, but the causal half still decides
    assert classify_tile(SLIDING, (1000, 1064), (0, 64)) is TileClass.PARTIAL
    assert classify_tile(SLIDING, (0, 64), (1000, 1064)) is TileClass.EMPTY


def test_document_mask_decided_by_causal_part():
    assert classify_tile(DOCUMENT, (0, 64), (64, 128)) is TileClass.EMPTY
    assert classify_tile(DOCUMENT, (64, 128), (0, 64)) is TileClass.PARTIAL
    assert classify_tile(lor(ir.load(BufferSpec("m", "bool", 1), (q,)), CAUSAL), (64, 128), (0, 64)) is TileClass.FULL


def test_block_causal_on_aligned_tiles():
    assert classify_tile(BLOCK_CAUSAL, (128, 256), (128, 256)) is TileClass.FULL
    assert classify_tile(BLOCK_CAUSAL, (128, 256), (256, 384)) is TileClass.EMPTY
    assert classify_tile(BLOCK_CAUSAL, (128, 256), (64, 192)) is TileClass.FULL
    assert classify_tile(BLOCK_CAUSAL, (64, 192), (128, 256)) is TileClass.PARTIAL


def test_mod_and_heads():
    # within one period the remainder is affine, so this is decided exactly
    e = ir.binary("ge", ir.binary("mod", q, k(64)), ir.binary("mod", kv, k(64)))
    assert classify_tile(e, (64 + 32, 128), (64, 64 + 32)) is TileClass.FULL
    assert classify_tile(e, (0, 128), (0, 64)) is TileClass.PARTIAL
    per_head = ir.binary("lt", ir.binary("sub", q, kv), ir.binary("mul", ir.binary("add", h, k(1)), k(16)))
    assert classify_tile(per_head, (100, 110), (95, 100), h_range=(0, 4)) is TileClass.FULL
    assert classify_tile(per_head, (100, 110), (60, 70), h_range=(0, 1)) is TileClass.EMPTY
    assert classify_tile(per_head, (100, 110), (60, 70), h_range=(0, 4)) is TileClass.PARTIAL


def test_float_masks():
    qf, kf = ir.cast(q, DType.FLOAT32), ir.cast(kv, DType.FLOAT32)
    e = ir.binary("le", ir.binary("sub", qf, kf), k(5.0))
    assert classify_tile(e, (10, 15), (10, 20)) is TileClass.FULL
    assert classify_tile(e, (100, 110), (0, 50)) is TileClass.EMPTY
    assert classify_tile(ir.binary("lt", ir.unary("exp", ir.unary("neg", qf)), k(2.0)), (0, 10), (0, 1)) is TileClass.FULL


def test_correlated_atoms_are_resolved_by_constraint_propagation():
    # each atom is mixed on the tile; only their combination is decided
    e = lor(ir.binary("lt", q, kv), ir.binary("ge", q, kv))
    assert classify_tile(e, (0, 64), (0, 64)) is TileClass.FULL
    e = land(ir.binary("ge", q, kv), ir.binary("gt", kv, ir.binary("add", q, k(2))))
    assert classify_tile(e, (0, 64), (0, 64)) is TileClass.EMPTY
    e = land(CAUSAL, ir.unary("not", ir.binary("lt", kv, P)))  # kv >= p and q >= kv, with q < p
    assert classify_tile(e, (0, 300), (250, 350), params={"p": 300}) is TileClass.EMPTY
    # 2q == 2kv + 1 has no integer solution
    odd = ir.binary("eq", ir.binary("mul", k(2), q), ir.binary("add", ir.binary("mul", k(2), kv), k(1)))
    assert classify_tile(land(odd, CAUSAL), (0, 64), (0, 64)) is TileClass.EMPTY


def test_errors():
    with pytest.raises(TypeError):
        classify_tile(q, (0, 1), (0, 1))
    with pytest.raises(ValueError):
        classify_tile(CAUSAL, (5, 5), (0, 1))


# ---------------------------------------------------------------- grids of tiles


@pytest.mark.parametrize("name", sorted(DECISIVE_MASKS))
@pytest.mark.parametrize("q_len,kv_len,bq,bkv", [(1024, 1024, 128, 128), (1000, 777, 64, 48), (300, 500, 33, 17)])
def test_blocks_are_exact_for_affine_masks(name, q_len, kv_len, bq, bkv):
    expr = DECISIVE_MASKS[name]
    full, partial = classify_blocks(expr, q_len, kv_len, bq, bkv, params=PARAMS)
    want_full, want_empty = tile_truth(expr, q_len, kv_len, bq, bkv, PARAMS)
    assert torch.equal(full, want_full)
    assert torch.equal(~full & ~partial, want_empty)


def test_blocks_block_causal_aligned():
    full, partial = classify_blocks(BLOCK_CAUSAL, 1024, 1024, 128, 128)
    assert torch.equal(full, torch.ones(8, 8, dtype=torch.bool).tril())
    assert not partial.any()


def test_blocks_document_mask_is_sound():
    doc = torch.arange(512, dtype=torch.int32) // 100
    full, partial = classify_blocks(DOCUMENT, 512, 512, 64, 64)
    want_full, want_empty = tile_truth(DOCUMENT, 512, 512, 64, 64, {}, {"doc": doc})
    assert not (full & ~want_full).any()
    empty = ~full & ~partial
    assert not (empty & ~want_empty).any()
    assert torch.equal(empty, torch.ones(8, 8, dtype=torch.bool).triu(1))


def test_blocks_fast_at_128k():
    t0 = time.perf_counter()
    for expr in (CAUSAL, SLIDING_PREFIX, BAND):
        full, partial = classify_blocks(expr, 131072, 131072, 128, 128, params={"w": 4096, "p": 1000})
        assert full.shape == (1024, 1024)
    assert time.perf_counter() - t0 < 10.0
    full, partial = classify_blocks(CAUSAL, 131072, 131072, 128, 128)
    assert int(partial.sum()) == 1024 and int(full.sum()) == 1024 * 1023 // 2


# ---------------------------------------------------------------- property: never wrong


@st.composite
def boxes(draw):
    q0, kv0 = draw(st.integers(0, 60)), draw(st.integers(0, 60))
    b0, h0 = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    return (
        (q0, q0 + draw(st.integers(1, 12))),
        (kv0, kv0 + draw(st.integers(1, 12))),
        (b0, b0 + draw(st.integers(1, 2))),
        (h0, h0 + draw(st.integers(1, 2))),
    )


def _check_sound(expr, box, seed):
    qr, kr, br, hr = box
    params = make_params(seed)
    claims = [
        classify_tile(expr, qr, kr, br, hr, params),
        classify_tile(expr, qr, kr, None, None, params),  # b, h anywhere: a superset of the box
        classify_tile(expr, qr, kr, br, hr, None),  # parameters unknown: any value is possible
    ]
    for fdt in (torch.float32, torch.float64):
        try:
            vals = brute(expr, qr, kr, br, hr, params, make_buffers(seed, fdt), fdt)
        except RuntimeError:  # an integer division by zero somewhere in the grid
            assume(False)
        for claim in claims:
            assert sound(claim, vals), (expr, box, params, claims, truth(vals))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(expr=bool_exprs(max_depth=3), box=boxes(), seed=st.integers(0, 2**16))
def test_random_masks_never_misclassified(expr, box, seed):
    _check_sound(expr, box, seed)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(expr=affine_masks(max_depth=3), box=boxes(), seed=st.integers(0, 2**16))
def test_random_affine_masks_never_misclassified(expr, box, seed):
    _check_sound(expr, box, seed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    expr=affine_masks(max_depth=2),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    bq=st.integers(1, 9),
    bkv=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_random_block_grids_never_misclassified(expr, q_len, kv_len, bq, bkv, seed):
    params = make_params(seed)
    full, partial = classify_blocks(expr, q_len, kv_len, bq, bkv, params=params, h_range=(0, 1))
    want_full, want_empty = tile_truth(expr, q_len, kv_len, bq, bkv, params)
    assert not (full & ~want_full).any()
    assert not (~full & ~partial & ~want_empty).any()
    # the grid pass agrees with the single-tile entry point
    i, j = (seed % full.shape[0]), (seed // 7 % full.shape[1])
    one = classify_tile(expr, (i * bq, min((i + 1) * bq, q_len)), (j * bkv, min((j + 1) * bkv, kv_len)), h_range=(0, 1), params=params)
    grid = TileClass.FULL if full[i, j] else TileClass.PARTIAL if partial[i, j] else TileClass.EMPTY
    assert one is grid or one is not TileClass.PARTIAL or grid is not TileClass.PARTIAL


# ---------------------------------------------------------------- buffer reads proven in range


def _doc_read(index):
    return ir.load(DOC, (index,))


@pytest.mark.parametrize("index, size, proven", [
    (q, 64, True),                                            # a document id per query position
    (ir.binary("add", q, k(1)), 64, False),                   # one past the end on the last row
    (ir.binary("sub", kv, k(64)), 64, True),                  # -64..-1: torch counts from the end
    (ir.binary("sub", kv, k(65)), 64, False),
    (ir.binary("floordiv", q, k(8)), 8, True),                # a page per 8 positions
    (ir.binary("floordiv", q, k(8)), 7, False),
    (_doc_read(q), 64, False),                                # an index read from a buffer: any value
    (ir.binary("mod", ir.binary("mul", q, k(2**30)), k(64)), 64, False),  # int32 wraps: not proven
])
def test_buffer_reads_in_range(index, size, proven):
    from flexgen.dsl.mask_analysis import buffer_reads_in_range

    expr = ir.binary("eq", ir.load(DOC, (index,)), k(0))
    assert buffer_reads_in_range(expr, {"doc": (size,)}, 64, 64, (0, 1), (0, 1)) is proven


def test_buffer_reads_in_range_of_batch_and_head():
    from flexgen.dsl.mask_analysis import buffer_reads_in_range

    offsets = BufferSpec("offsets", "int32", 2)
    expr = ir.binary("ge", q, ir.load(offsets, (ir.input_("b"), h)))
    assert buffer_reads_in_range(expr, {"offsets": (3, 4)}, 16, 16, (0, 3), (0, 4))
    assert not buffer_reads_in_range(expr, {"offsets": (3, 4)}, 16, 16, (0, 4), (0, 4))
    assert not buffer_reads_in_range(expr, {"offsets": (3,)}, 16, 16, (0, 3), (0, 4))  # a dimension short
    assert not buffer_reads_in_range(expr, {}, 16, 16, (0, 3), (0, 4))  # no shape known


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    index=st.deferred(lambda: RAW_INDICES),
    size=st.integers(1, 40),
    q_len=st.integers(1, 40),
    kv_len=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_buffer_reads_proven_in_range_are(index, size, q_len, kv_len, seed):
    """Where the analysis proves a read in range, evaluating the mask over the whole grid (with the check) never
    finds one outside."""
    from flexgen.dsl.mask_analysis import buffer_reads_in_range

    params = make_params(seed)
    expr = ir.binary("ne", ir.load(DOC, (index,)), k(-1))
    if not buffer_reads_in_range(expr, {"doc": (size,)}, q_len, kv_len, (0, 1), (0, 2), params):
        return
    doc = torch.zeros(size, dtype=torch.int32)
    try:
        brute(expr, (0, q_len), (0, kv_len), (0, 1), (0, 2), params, {"doc": doc})
    except RuntimeError:  # an integer division by zero somewhere in the grid
        assume(False)



RAW_INDICES = st.one_of(  # reads that may fall outside the buffer
    st.builds(lambda c: ir.binary("add", q, k(c)), st.integers(-45, 45)),
    st.builds(lambda c: ir.binary("sub", kv, k(c)), st.integers(-45, 45)),
    st.builds(lambda a, b: ir.binary("floordiv", ir.binary("add", q, k(a)), k(b)), st.integers(-5, 5), st.integers(1, 9)),
    st.builds(lambda c: ir.binary("sub", q, ir.binary("mul", h, k(c))), st.integers(-20, 20)),
    int_exprs(max_depth=2, allow_loads=False),
)
