"""The template families (flexgen/runtime/families.py) and the one planning function: what each family
takes and refuses, that every kind a family claims has a template, that flex_attention, emit and
`flexgen build` plan the same spec, and that the sm80 family serves Blackwell and later targets."""
from __future__ import annotations

import importlib.util
import re
import types

import pytest
import torch

import flexgen.arch
from flexgen import variants as V, warnings_once
from flexgen.cache.build import expand
from flexgen.codegen.api import make_spec as emit_spec
from flexgen.codegen.render import available_templates
from flexgen.runtime import families, plan as planning
from flexgen.runtime.families import FAMILIES, Call, choose

needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")


def test_every_kind_a_family_claims_has_a_template():
    have = set(available_templates())
    for family in FAMILIES:
        for kind in family.kinds:
            assert f"{family.name}/{kind}.cu.j2" in have, (family.name, kind)
    assert [f.name for f in FAMILIES] == ["sm90", "sm80"]  # preference order: Hopper's where it applies


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_100a", "sm_103", "sm_110",
                                  "sm_120", "sm_121a"])
def test_sm80_serves_every_target_and_kind(arch):
    sm80 = families.named("sm80")
    for kind in ("fwd", "bwd", "bwd_preprocess", "bwd_postprocess"):
        for head_dim in (32, 64, 96, 128, 256):
            assert sm80.refusal(Call(kind, arch, head_dim, "bf16", dropout=True, buffer_grads=True)) is None
    expected = "sm90" if arch == "sm_90a" else "sm80"
    assert choose(Call("fwd", arch, 128, "bf16")).name == expected


@pytest.mark.parametrize("call,reason", [
    (Call("bwd_preprocess", "sm_90a", 128, "bf16"), r"only \('fwd', 'bwd'\) kernels"),
    (Call("fwd", "sm_80", 128, "bf16"), "needs arch sm_90a"),
    (Call("fwd", "sm_100a", 128, "bf16"), "needs arch sm_90a"),
    (Call("bwd", "sm_90a", 96, "bf16", deterministic=True), "at head dim 96 its deterministic backward"),
    (Call("fwd", "sm_90a", 128, "fp32"), "dtype fp32"),
    (Call("fwd", "sm_90a", 32, "bf16", mask_loads=True), "head dim 32 it leaves masks that read buffers to sm80"),
    (Call("bwd", "sm_90a", 128, "bf16", buffer_grads=True, deterministic=True), "non-deterministic mode"),
    (Call("bwd", "sm_90a", 64, "bf16", buffer_grads=True, dropout=True), "buffer gradients with dropout"),
    (Call("fwd", "sm_90a", 128, "bf16", tiles=(("num_warps", 8),)), "tiles are fixed"),
    (Call("fwd", "sm_90a", 128, "bf16", mask_block=(64, 64)), r"not a multiple of its tile \(128, 128\)"),
    (Call("bwd", "sm_90a", 128, "bf16", mask_block=(32, 128)), r"not a multiple of its tile \(64, 128\)"),
    (Call("bwd", "sm_90a", 128, "bf16", mask_block=(128, 64)), r"not a multiple of its tile \(64, 128\)"),
], ids=lambda x: x if isinstance(x, str) else x.kind)
def test_sm90_refusals(call, reason):
    why = families.named("sm90").refusal(call)
    assert why is not None and re.search(reason, why), why
    if call.dtype == "bf16" and call.head_dim in (32, 64, 96, 128, 256):
        assert choose(call).name == "sm80"  # the base family takes what sm90 refuses
    with pytest.raises(ValueError, match="kernel option family='sm90'"):
        choose(call, "sm90")


def test_sm90_takes_what_it_covers():
    sm90 = families.named("sm90")
    for kind in ("fwd", "bwd"):
        for head_dim in (64, 128):
            for dtype in ("bf16", "fp16"):
                assert sm90.refusal(Call(kind, "sm_90a", head_dim, dtype, mask_block=(256, 256))) is None


def test_no_family_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no template family .* head dim 48"):
        choose(Call("fwd", "sm_80", 48, "bf16"))
    with pytest.raises(ValueError, match=r"family='sm70'; allowed: \['sm80', 'sm90'\]"):
        choose(Call("fwd", "sm_80", 64, "bf16"), "sm70")


def test_threads_and_grids():
    q = torch.empty(2, 6, 1000, 128, device="meta")
    k = torch.empty(2, 3, 700, 128, device="meta")
    sm80_fwd = planning.plan("fwd", "sm_80", 128, "bf16")
    assert families.of(sm80_fwd).threads_per_cta(sm80_fwd) == 32 * sm80_fwd.num_warps
    assert families.of(sm80_fwd).forward_grid(sm80_fwd, None, q, k, None)[0] == (-(-1000 // sm80_fwd.block_m), 6, 2)
    sm90_bwd = planning.plan("bwd", "sm_90a", 128, "bf16", extra=(("persistent", False),))
    family = families.of(sm90_bwd)
    assert family.name == "sm90" and family.threads_per_cta(sm90_bwd) == 3 * 128  # a producer warpgroup beside two
    assert family.backward_grid(sm90_bwd, None, q, k, 6, 1)[0] == (6, 3, 2)  # one CTA per KV tile without persistence
    deterministic = sm90_bwd.with_(deterministic=True, extra=())
    assert family.backward_grid(deterministic, None, q, k, 6, 4)[0] == (4, 3, 2)  # `splits` CTAs per (batch, KV head)


@pytest.mark.parametrize("kind,options,emit_options", [
    ("fwd", None, {}),
    ("fwd", {"family": "sm80"}, {"family": "sm80"}),
    ("fwd", {"family": "sm80", "BLOCK_N": 32, "num_warps": 4}, {"family": "sm80", "block_n": 32, "num_warps": 4}),
    ("fwd", {"precise_math": True}, {"precise_math": True}),
    ("bwd", None, {}),
    ("bwd", {"deterministic": True}, {"deterministic": True}),
    ("bwd", {"family": "sm80", "BLOCK_M1": 32, "num_warps1": 4}, {"family": "sm80", "block_m": 32, "num_warps": 4}),
    ("bwd_preprocess", None, {}),
], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_flex_attention_and_emit_plan_the_same_kernel(monkeypatch, kind, options, emit_options, head_dim):
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")  # a CPU tensor stands in
    query = torch.empty(1, 2, 300, head_dim, dtype=torch.float16)  # (longer than a decoding query: no split keys)
    score, mask = V.softcap(30.0), V.causal
    by_call = planning.make_spec(kind, query, score, mask, options)
    by_emit = emit_spec(kind, score, mask, head_dim=head_dim, dtype="fp16", arch="sm_90a", **emit_options)
    assert by_call == by_emit
    assert by_call is by_emit  # one memoized plan: the kernel cache hashes the spec once
    # `flexgen build` plans for the block mask a masked variant runs with (create_block_mask's, BLOCK_SIZE 128 by
    # default) and adds a backward's pre- and post-processing kernels.
    built = expand(dict(score_mod=score, mask_mod=mask, head_dim=head_dim, dtype="fp16", kinds=(kind,),
                        **emit_options), ["sm_90a"])
    [by_build] = [s for s in built if s.kind == kind]
    mask_block = (128, 128) if kind in ("fwd", "bwd") else None
    assert by_build == planning.make_spec(kind, query, score, mask, options, mask_block=mask_block,
                                          blocks_follow_mask=True)
    if kind == "bwd":
        assert sorted(s.kind for s in built) == ["bwd", "bwd_postprocess", "bwd_preprocess"]


@pytest.mark.parametrize("kind,options", [("fwd", {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2}),
                                          ("bwd", {"BLOCK_M1": 32, "BLOCK_N1": 64, "num_warps1": 4})])
def test_pytorch_tile_options_do_not_move_a_call_off_the_sm90_kernels(monkeypatch, kind, options):
    """Tile options tune PyTorch's Triton kernels, and ported code carries them: on Hopper the call keeps the sm90
    kernel it would get without them (they are ignored, with a warning that says how to use them: family='sm80',
    which takes them, and refuses a tile its templates do not run)."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(warnings_once, "_seen", set())
    query = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16)
    planning._make_spec_cached.cache_clear()
    with pytest.warns(UserWarning, match=r"sm90 kernels run, whose tiles are fixed, so they are ignored.*'family'"):
        spec = planning.make_spec(kind, query, V.softcap(30.0), V.causal, options)
    assert spec is planning.make_spec(kind, query, V.softcap(30.0), V.causal, None) and spec.family == "sm90"
    pinned = planning.make_spec(kind, query, V.softcap(30.0), V.causal, {"family": "sm80", **options})
    assert pinned.family == "sm80" and pinned.block_m == options.get("BLOCK_M", options.get("BLOCK_M1"))
    if kind == "fwd":  # (Triton runs 32-row tiles of 4 warps; the sm80 forward has 16 or 32 rows per warp)
        unrunnable = {"BLOCK_M": 32, "BLOCK_N": 32}
        assert planning.make_spec(kind, query, V.softcap(30.0), V.causal, unrunnable) is spec
        with pytest.raises(ValueError, match="allowed values"):
            planning.make_spec(kind, query, V.softcap(30.0), V.causal, {"family": "sm80", **unrunnable})


def test_a_tile_the_sm80_forward_does_not_run_is_a_hint_unless_the_family_is_named(monkeypatch):
    """On an sm_80 GPU, tile options are taken; one its forward does not run (Triton's 32-row tile of 4 warps, 3
    stages) is a PyTorch tuning hint not taken, with a warning, unless family='sm80' makes it a choice."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_80")
    monkeypatch.setattr(warnings_once, "_seen", set())
    planning._make_spec_cached.cache_clear()
    query = torch.empty(1, 2, 300, 128, dtype=torch.bfloat16)
    default = planning.make_spec("fwd", query, V.softcap(30.0), V.causal, None)
    taken = planning.make_spec("fwd", query, V.softcap(30.0), V.causal, {"BLOCK_M": 64, "BLOCK_N": 32})
    assert (taken.family, taken.block_m, taken.block_n) == ("sm80", 64, 32)
    for hint in ({"BLOCK_M": 32, "BLOCK_N": 32}, {"num_stages": 3}):
        with pytest.warns(UserWarning, match="taken as a tuning hint .* the default tile runs"):
            assert planning.make_spec("fwd", query, V.softcap(30.0), V.causal, hint) is default
        with pytest.raises(ValueError, match="allowed values"):
            planning.make_spec("fwd", query, V.softcap(30.0), V.causal, {"family": "sm80", **hint})


def test_backward_plans_with_what_the_call_has(monkeypatch):
    """Buffer gradients and the block mask's blocks reach the plan; emit takes the same."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")
    query = torch.empty(1, 2, 8, 128, dtype=torch.bfloat16)
    score = V.alibi(torch.ones(2))
    spec = planning.make_spec("bwd", query, score, V.causal, None, grad_buffers=("alibi_slopes",))
    assert spec.family == "sm90" and spec.grad_buffers == ("alibi_slopes",)
    assert spec == emit_spec("bwd", score, V.causal, head_dim=128, arch="sm_90a", grad_buffers=("alibi_slopes",))
    fixed = planning.make_spec("bwd", query, score, V.causal, {"deterministic": True}, grad_buffers=("alibi_slopes",))
    assert fixed.family == "sm80" and fixed.deterministic  # (the sm90 backward's buffer gradients are not ordered)
    small_blocks = planning.make_spec("bwd", query, None, V.causal, None, mask_block=(32, 64))
    assert small_blocks.family == "sm80" and (small_blocks.block_m, small_blocks.block_n) == (32, 64)
    assert planning.make_spec("bwd", query, None, V.causal, None, mask_block=(128, 128)).family == "sm90"
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        planning.make_spec("bwd", query, None, V.causal, {"family": "sm90"}, mask_block=(32, 64))


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("arch", ["sm_100a", "sm_120"])
def test_sm80_kernels_compile_for_blackwell_and_later(arch):
    """NVRTC compiles the sm80 family's forward and backward for these targets; the backward's tile fits
    the target's shared memory, and the estimate the tile search used is what the kernel exports."""
    from flexgen.cache import jit
    from flexgen.cache.ptxas import has_spills
    from flexgen.runtime.kernel_symbols import shared_memory_bytes

    for kind in ("fwd", "bwd"):
        spec = emit_spec(kind, V.softcap(30.0), V.causal, head_dim=64, arch=arch)
        assert spec.family == "sm80" and spec.arch == arch
        kernel = jit.get_kernel(spec)
        assert kernel.cubin[:4] == b"\x7fELF" and f"--gpu-architecture={arch}" in kernel.flags
        assert not has_spills(kernel.resources), f"{kind} on {arch}: {kernel.resources}"
        assert shared_memory_bytes(kernel) <= flexgen.arch.shared_memory_limit(arch)
        if kind == "bwd":
            assert shared_memory_bytes(kernel) == families.of(spec).shared_memory_estimate(spec)


def test_sm80_forward_tile_fits_the_mask_blocks():
    """The sm80 forward halves its default tile to divide the mask's KV blocks, and its query blocks where the
    lists were made by hand; under lists from the mask_mod it keeps its rows and walks their union."""
    from flexgen.runtime.plan import plan

    def tile(mask_block, follow=False, D=128):
        spec = plan("fwd", "sm_80", D, "bf16", None, V.causal.expr, mask_block=mask_block, blocks_follow_mask=follow)
        return spec.block_m, spec.block_n

    assert tile((128, 128)) == (128, 64) and tile((64, 128)) == (64, 64) and tile((64, 32)) == (64, 32)
    assert tile((32, 16)) == (64, 16)  # 16 rows per warp at least: kernel_block_mask refuses such a hand-made mask
    assert tile((64, 128), follow=True) == tile((32, 128), follow=True) == (128, 64)
    assert tile((64, 64), D=256) == (64, 32)
    # dropout's lean tile at D = 128 (8 warps of 16 rows) under 64-row blocks: 4 warps of 16 rows
    spec = plan("fwd", "sm_80", 128, "bf16", None, V.causal.expr, dropout=True, mask_block=(64, 128))
    assert (spec.block_m, spec.block_n, spec.num_warps) == (64, 64, 4)


def test_sm90_forward_rows_per_tile_by_head_dim_and_mask():
    """Three consumer warpgroups (192-row tiles) at D = 32 and 64, and at 96 and 128 but for a band of keys (a
    sliding window, its width a run-time parameter or a constant), where a 192-row tile walks more keys than its
    rows need, and at 128 a score_mod (whose softmax spills there); two warpgroups (128 rows) otherwise."""
    from flexgen.runtime.plan import plan

    band = V.mask_mod(lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 512))

    def rows(D, score=None, mask=None):
        block = (128, 128) if mask is not None else None
        return plan("fwd", "sm_90a", D, "bf16", score and score.expr, mask and mask.expr, mask_block=block,
                    blocks_follow_mask=True).block_m

    for D in (96, 128):
        assert rows(D) == rows(D, None, V.causal) == rows(D, None, V.prefix_lm(300)) == 192
        assert rows(D, None, V.sliding_window(1024)) == rows(D, None, band) == 128
        assert rows(D, V.alibi(16), V.causal) == rows(D, V.softcap(30.0)) == (192 if D == 96 else 128)
        assert plan("fwd", "sm_90a", D, "bf16", dropout=True).block_m == 128  # (Philox's state would spill)
    assert rows(64, None, V.sliding_window(1024)) == rows(64, V.alibi(16), V.causal) == rows(32, None, band) == 192
    assert rows(256) == 128


def test_sm90_forward_head_chunk_under_a_causal_mask(monkeypatch):
    """The forward's head chunk on an H200-sized device (132 SMs, 50 MB of L2), B = 2, H = 16, N = 8k: without a
    mask the wave bound (ctas // query tiles); under a causal mask the shortest modeled tail within it, which on
    192-row tiles (D = 64) may reach 4/3 of a wave (schedule.TAIL_REACH)."""
    import types

    from flexgen import create_block_mask

    monkeypatch.setattr(families, "sm_count", lambda device: 132)
    monkeypatch.setattr(families, "l2_bytes", lambda device: 50 << 20)
    causal = create_block_mask(V.causal, None, None, 8192, 8192, device="cpu")
    sm90 = families.named("sm90")
    chunks = {}
    for d, block_m in ((128, 128), (64, 192)):
        spec = planning.plan("fwd", "sm_90a", d, "bf16").with_(block_m=block_m)
        q = torch.empty(2, 16, 8192, d, device="meta")
        for name, mask in (("none", None), ("causal", causal)):
            p = types.SimpleNamespace()
            grid, _ = sm90.forward_grid(spec, p, q, q, mask)
            assert grid == (132, 1, 1)
            chunks[d, name] = p.head_chunk
    # 64 and 43 query tiles per pair: waves of 2 and 3 pairs; the causal tail is shortest at 2 and, reaching 4, at 4
    assert chunks == {(128, "none"): 2, (128, "causal"): 2, (64, "none"): 3, (64, "causal"): 4}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_decoding_query_plans_the_split_key_forward(monkeypatch, head_dim):
    """At most 64 query rows: the sm80 forward with split keys (sm90 refuses it), one 16-row MMA tile per warp;
    its plan equals emit's with split_kv=True. A family or tile the call chooses, split_kv=False, max_scores, a
    longer query or another kernel kind keep the usual plan."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")
    short, long_ = (torch.empty(2, 4, n, head_dim, dtype=torch.bfloat16) for n in (64, 65))
    spec = planning.make_spec("fwd", short, None, V.causal, None)
    assert spec.family == "sm80" and spec.option("split_kv") is True
    assert spec.block_m == 64 and spec.num_warps == 4 and spec.num_stages == 2
    assert spec == emit_spec("fwd", None, V.causal, head_dim=head_dim, arch="sm_90a", split_kv=True)
    usual = planning.make_spec("fwd", long_, None, V.causal, None)
    assert usual.option("split_kv") is None and usual.family == "sm90"  # (every head dim)
    for options in ({"split_kv": False}, {"family": "sm80"}, {"BLOCK_M": 128, "num_warps": 4}):
        assert planning.make_spec("fwd", short, None, V.causal, options).option("split_kv") is None, options
    assert planning.make_spec("fwd", short, None, V.causal, None, max_scores=True).option("split_kv") is None
    assert planning.make_spec("fwd", long_, None, V.causal, {"split_kv": True}).option("split_kv") is True
    assert planning.make_spec("bwd", short, None, V.causal, None).option("split_kv") is None
    # under GQA the rows per KV head count: 16 rows x 4 heads split, 17 x 4 do not
    gqa = torch.empty(2, 8, 16, head_dim, dtype=torch.bfloat16)
    assert planning.make_spec("fwd", gqa, None, None, None, kv_heads=2).option("split_kv") is True
    gqa = torch.empty(2, 8, 17, head_dim, dtype=torch.bfloat16)
    assert planning.make_spec("fwd", gqa, None, None, None, kv_heads=2).option("split_kv") is None
    with pytest.raises(ValueError, match="split_kv=True cannot be combined with"):
        planning.make_spec("fwd", short, None, None, {"split_kv": True}, max_scores=True)
    if head_dim in (64, 128):
        with pytest.raises(ValueError, match="does not split a query tile's keys"):
            planning.make_spec("fwd", short, None, None, {"split_kv": True, "family": "sm90"})


def test_a_short_query_against_a_long_cache_splits_where_the_usual_grid_is_small(monkeypatch):
    """Past 64 rows per KV head a forward splits only as a short query against a long cache (at most 512 rows per
    KV head, at least 4096 keys and 8 times the query's rows) whose split tiles of 64 rows, weighted by D / 64, are
    no more than the GPU's SMs; symbolic sizes and devices other than CUDA keep the 64-row rule."""
    import types as _types

    monkeypatch.setattr(planning, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")

    def query(b, h, lq, device=cuda):
        return _types.SimpleNamespace(shape=(b, h, lq, 128), device=device)

    def short(query, kv_heads, kv_len):
        return planning.split_block_m(query, kv_heads, kv_len) > 0

    assert short(query(1, 32, 1), 8, 32768) and short(query(64, 32, 16), 8, 128)  # <= 64 rows: any grid, any cache
    assert short(query(2, 32, 64), 4, 8192)  # 512 rows per KV head: 8 tiles x 4 heads x 2 sequences x 2 (D)
    assert short(query(4, 32, 32), 8, 8192)  # 128 rows per KV head: 2 x 8 x 4 x 2
    assert short(query(1, 16, 128), 16, 32768)
    assert not short(query(4, 32, 64), 4, 8192)  # 8 x 4 x 4 x 2 = 256 (measured: split 163 us, usual 103)
    assert not short(query(1, 32, 65), 4, 8192)  # 520 rows per KV head
    assert not short(query(1, 4, 300), 4, 300)  # a short cache
    assert not short(query(1, 4, 1024), 4, 4096)  # keys fewer than 8 times the query's rows
    assert short(query(1, 4, 300), 4, 5000)  # 300 rows, 5000 keys: 5 x 4 x 2
    assert not short(query(1, 4, 300, torch.device("meta")), 4, 5000)
    symbolic = _types.SimpleNamespace(shape=(1, 4, object(), 128), device=cuda)
    assert not short(symbolic, 4, 5000)
    growing = object()  # a decoding step compiled over a cache whose length is symbolic still splits
    assert short(query(1, 32, 1), 8, growing) and not short(query(1, 4, 300), 4, growing)


def test_the_split_key_grid_deals_each_query_tile_into_parts(monkeypatch):
    """The grid's x holds the parts of each query tile side by side and y the groups of query heads that share a
    tile (a KV head's, under GQA); the parts fill the CTAs the GPU holds at once (SMs times the kernel's CTAs per
    SM) without spilling into a second wave."""
    from flexgen.runtime import schedule

    monkeypatch.setattr(families, "sm_count", lambda device: 132)
    monkeypatch.setattr(families, "ctas_per_sm", lambda spec: 2)
    spec = planning.plan("fwd", "sm_90a", 128, "bf16", extra=(("split_kv", True),))
    p = types.SimpleNamespace()
    q = torch.empty(1, 32, 1, 128, device="meta")
    k = torch.empty(1, 8, 32768, 128, device="meta")
    grid, _ = families.of(spec).forward_grid(spec, p, q, k, None)
    assert p.packed_heads == 4  # one tile holds the 4 query heads of a KV head: 8 tiles
    assert p.kv_splits == schedule.kv_splits(8, 32768 // 64, 264) == 32  # 256 of the 264 CTAs, 16 tiles each
    assert grid == (32, 8, 1)
    mha = torch.empty(1, 32, 32768, 128, device="meta")  # (a KV head per query head)
    grid, _ = families.of(spec).forward_grid(spec, p, q, mha, None)
    assert p.packed_heads == 1 and grid == (8 * 1, 32, 1)  # 9 parts would put 24 CTAs into a second wave


def test_kv_splits_follows_the_wave_model():
    """Parts per query tile: one wave where that is fastest (rounding up to fill the GPU put a few CTAs into a
    second wave and doubled the time), none shorter than MIN_TILES_PER_PART KV tiles, at most MAX_SPLITS, and
    the fewest parts among equally fast counts."""
    from flexgen.runtime import schedule

    assert schedule.kv_splits(1024, 64, 264) == 1  # enough query tiles already
    assert schedule.kv_splits(1, 3, 264) == 1  # too few KV tiles to split
    assert schedule.kv_splits(4, 16, 264) == 16 // schedule.MIN_TILES_PER_PART
    assert schedule.kv_splits(1, 100_000, 264) == schedule.MAX_SPLITS
    for query_tiles, kv_tiles, slots in ((8, 512, 264), (32, 512, 264), (256, 64, 264), (3, 1000, 660),
                                         (133, 512, 264), (40, 4096, 528)):
        splits = schedule.kv_splits(query_tiles, kv_tiles, slots)

        def modeled(s):
            waves = -(-query_tiles * s // slots)
            return waves * (-(-kv_tiles // s) + schedule.PART_OVERHEAD_TILES)

        allowed = range(1, min(kv_tiles // schedule.MIN_TILES_PER_PART, schedule.MAX_SPLITS) + 1)
        assert modeled(splits) == min(modeled(s) for s in allowed)
        assert all(modeled(s) > modeled(splits) for s in allowed if s < splits)
    assert schedule.kv_splits(32, 512, 264) * 32 <= 264  # one wave


def test_the_merge_deals_many_parts_to_thread_groups():
    """fwd_combine's thread groups per row: powers of 2 with at least PARTS_PER_GROUP parts each, at most
    MAX_PART_GROUPS and no more than a CTA holds for one row (D / 8 threads per group)."""
    from flexgen.runtime.split_kv import MAX_PART_GROUPS, PARTS_PER_GROUP, part_groups

    assert [part_groups(s, 16) for s in (1, 7, 8, 15, 16, 31, 32, 128)] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert part_groups(128, 4) == 4 and part_groups(128, 10) == 8 and part_groups(128, 1) == 1  # D = 256, 96, 1024
    for splits in range(1, 200):
        for most in (1, 4, 8, 10, 16, 32):
            groups = part_groups(splits, most)
            assert groups & (groups - 1) == 0 and groups <= min(MAX_PART_GROUPS, most)
            assert groups == 1 or splits >= groups * PARTS_PER_GROUP


def test_the_merge_grid_covers_every_row_once_per_group_layout(monkeypatch):
    """Combine's grid: rows per CTA = threads / (D / 8 x groups), as the template computes them."""
    from flexgen.runtime import split_kv

    monkeypatch.setattr(split_kv, "get_kernel", lambda spec: None)
    monkeypatch.setattr(split_kv, "make_spec", lambda kind, query, *args: emit_spec(
        kind, head_dim=query.shape[-1], dtype="bf16", arch="sm_90a"))
    for b, h, lq, d, splits in ((1, 32, 1, 128, 66), (8, 32, 1, 128, 9), (2, 4, 7, 96, 40), (1, 2, 1, 256, 128)):
        combine = split_kv.Combine(torch.empty(b, h, lq, d, device="meta"), (h * lq * d, lq * d, d, 1), splits)
        rows_per_cta = 128 // (d // 8 * combine.groups)
        assert combine.params.part_groups == combine.groups == split_kv.part_groups(splits, 128 // (d // 8))
        assert combine.grid[0] == -(-b * h * lq // rows_per_cta)


def test_resident_ctas_counts_the_tightest_resource():
    """CTAs per SM from threads, registers (per warp in units of 256, in four quarters) and shared memory (1 KB
    reserved per CTA), per target; what the split-key forward's parts are sized by."""
    from flexgen.arch import resident_ctas

    assert resident_ctas("sm_90a", 128, 159, 87040) == 2  # shared memory: 228 KB / (85 + 1 KB)
    assert resident_ctas("sm_90a", 128, 32, 0) == 16  # threads: 2048 / 128
    assert resident_ctas("sm_90a", 128, 64, 0) == 8  # registers: 64k / (128 x 64)
    assert resident_ctas("sm_90a", 384, 168, 0) == 1  # registers: 3 warps of 168 per quarter, 12 warps a CTA
    assert resident_ctas("sm_90a", 32, 32, 0) == 32  # the CTA limit
    assert resident_ctas("sm_80", 128, 159, 87040) == 1  # 164 KB on sm_80
    assert resident_ctas("sm_86", 128, 32, 0) == 12  # 1536 threads on sm_86
    assert resident_ctas("sm_90a", 1024, 255, 0) == 1  # (never below one)


def test_a_prefill_chunk_takes_the_tall_split_tile(monkeypatch):
    """Past 64 rows per KV head the split forward takes 128-row tiles (two MMA tiles per warp, one K/V stage) at
    D = 64 and 128, and FWD_SPLIT's tile at other head dims; up to 64 rows it keeps 64-row tiles."""
    monkeypatch.setattr(planning, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    chunk = types.SimpleNamespace(shape=(1, 16, 128, 128), device=cuda)
    step = types.SimpleNamespace(shape=(1, 32, 1, 128), device=cuda)
    assert planning.split_block_m(chunk, 16, 32768) == planning.TALL_SPLIT_BLOCK_M == 128
    assert planning.split_block_m(step, 8, 32768) == planning.SPLIT_BLOCK_M == 64
    assert planning.split_block_m(chunk, 16, 1024) == 0  # a short cache: the usual forward
    for head_dim, tile in ((64, (128, 64, 4, 1)), (96, (64, 64, 4, 2)), (128, (128, 64, 4, 1)), (256, (64, 32, 4, 2))):
        spec = planning.plan("fwd", "sm_90a", head_dim, "bf16", extra=(("split_kv", True), ("split_rows", 128)))
        assert spec.family == "sm80" and (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == tile
        assert spec == emit_spec("fwd", head_dim=head_dim, arch="sm_90a", split_kv=True, split_rows=128)
    short = planning.plan("fwd", "sm_90a", 128, "bf16", extra=(("split_kv", True),))
    assert (short.block_m, short.num_stages) == (64, 2)


def test_split_keys_pack_a_kv_heads_query_heads_only_where_every_row_walks_the_same_tiles():
    plain = planning.plan("fwd", "sm_90a", 128, "bf16", extra=(("split_kv", True),))
    dropout = planning.plan("fwd", "sm_90a", 128, "bf16", dropout=True, extra=(("split_kv", True),))

    def mask(heads, q_block=128):
        return types.SimpleNamespace(kv_num_blocks=torch.empty(1, heads, 1), BLOCK_SIZE=(q_block, 128))

    assert families.packed_heads(plain, 4, 3, None) == 4
    assert families.packed_heads(plain, 1, 3, None) == 1  # no GQA
    assert families.packed_heads(dropout, 4, 3, None) == 1  # dropout draws per (head, row) of an MMA tile
    assert families.packed_heads(plain, 4, 3, mask(1)) == 4
    assert families.packed_heads(plain, 4, 3, mask(8)) == 1  # lists per head
    assert families.packed_heads(plain, 4, 64, mask(1, q_block=32)) == 1  # the query spans two query blocks


def test_a_build_file_variant_with_split_kv_builds_the_merge_too():
    built = expand(dict(mask_mod=V.causal, head_dim=128, kinds=("fwd",), split_kv=True), ["sm_90a"])
    assert [s.kind for s in built] == ["fwd", "fwd_combine"]
    assert built[0].family == built[1].family == "sm80" and built[0].option("split_kv") is True
    assert [s.kind for s in expand(dict(mask_mod=V.causal, head_dim=128, kinds=("fwd",)), ["sm_90a"])] == ["fwd"]


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_split_key_forward_and_its_merge_compile_without_spills(head_dim):
    """NVRTC builds the split-key forward (a score_mod, a buffer-reading mask, and dropout) and fwd_combine for
    sm_90a without spills; the forward's parameter struct carries the parts, other forwards' do not."""
    from flexgen.cache import jit
    from flexgen.cache.ptxas import has_spills
    from flexgen.codegen.render import render

    docs = V.document(torch.zeros(16, dtype=torch.int32))
    for score, mask, extra in ((V.softcap(30.0), V.causal, {}), (None, docs, {}), (None, V.causal, {"dropout": True})):
        spec = emit_spec("fwd", score, mask, head_dim=head_dim, arch="sm_90a", split_kv=True, **extra)
        kernel = jit.get_kernel(spec)
        assert not has_spills(kernel.resources), f"{spec.describe()}: {kernel.resources}"
        assert "float* o_part;" in render(spec)
    # The tall tile of prefill chunks: spill-free at D = 64; at D = 128 it spills 8-68 B (ALiBi the most), which the
    # measurements in families.SM80.FWD_SPLIT_TALL's comment include.
    if head_dim in (64, 128):
        for score, mask, extra in ((None, None, {}), (V.alibi(16), V.causal, {}), (None, V.causal, {"dropout": True})):
            spec = emit_spec("fwd", score, mask, head_dim=head_dim, arch="sm_90a", split_kv=True, split_rows=128,
                             **extra)
            resources = jit.get_kernel(spec).resources
            limit = 0 if head_dim == 64 else 72
            assert resources["spill_stores_bytes"] <= limit, f"{spec.describe()}: {resources}"
    merge = emit_spec("fwd_combine", head_dim=head_dim, arch="sm_90a")
    assert merge.family == "sm80" and not has_spills(jit.get_kernel(merge).resources)
    assert "o_part" not in render(emit_spec("fwd", None, V.causal, head_dim=head_dim, arch="sm_80"))
