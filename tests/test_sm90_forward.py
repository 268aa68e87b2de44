"""The Hopper forward (templates/sm90/fwd.cu.j2): flex_attention's default forward on sm_90 for head
dims 64, 128 and 256 (runtime/families.py), or kernel_options={"family": "sm90"}.

CPU: it renders and compiles for sm_90a without spills, uses wgmma for both products, its
FwdParams has the host mirror's size, and the launcher reads its exported shared-memory size from
the cubin; the family option is refused where there is no such kernel.
GPU (marked, skipped without one; needs a Hopper): outputs against the float64 reference,
with the bar of tests/test_gpu_forward.py.
"""
from __future__ import annotations

import ctypes
import re

import pytest
import torch

import flexgen
from flexgen import variants as V
from flexgen.cache import jit
from flexgen.cache.ptxas import has_spills
from flexgen.codegen.api import make_spec
from flexgen.codegen.cstruct import pack_mod_args
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.params import FWD_PARAMS
from flexgen.codegen.render import render
from flexgen.runtime.families import Call, choose
from flexgen.runtime.kernel_symbols import shared_memory_bytes
from flexgen.runtime.plan import plan
from sm90_cases import SM90, assert_tma_fed_and_unserialised, cpu_variants, hopper, needs_nvrtc

gpu = pytest.mark.gpu


def _spec(name, D):
    score, mask = cpu_variants()[name]
    # As flex_attention plans it: a mask_mod comes with a block mask (of the default 128 x 128 blocks).
    mask_block = (128, 128) if mask is not None else None
    return make_spec("fwd", score, mask, head_dim=D, dtype="bf16", arch="sm_90a", mask_block=mask_block, **SM90), score, mask


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("name", list(cpu_variants()))
def test_compiles_without_spills_and_matches_host_layouts(name, D):
    if D == 32 and name == "document":  # (masks that read buffers stay on sm80 at D = 32)
        with pytest.raises(ValueError, match="at head dim 32 it leaves masks that read buffers to sm80"):
            _spec(name, D)
        return
    spec, score, mask = _spec(name, D)
    # Per-element score loads (relative_bias) and D = 256 (O's accumulator is 128 registers) keep the KV tile at
    # 64 columns; D = 32 and 64 take three consumer warpgroups on 192-row tiles unless a mod reads a buffer in its
    # loop (document ids, bias tables; ALiBi's slopes are read once per work tile, as its score_mod folds), D = 96
    # without a buffer read in its loop, D = 128 without a score_mod (and for both, masks but a band of keys, a
    # sliding window's).
    # Head dims 32 and 96 load 64 and 128 columns (zero-filled past the tensors' own by the TMA loads) and compute
    # their own.
    width = -(-D // 64) * 64
    block_n = 64 if name == "relative_bias" or D == 256 else 128
    three = (width == 64 and name in ("none", "causal", "softcap_causal", "alibi_causal")
             or D in (96, 128) and name in ("none", "causal")
             or D == 96 and name in ("softcap_causal", "alibi_causal"))
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == ((192, 128, 12, 2) if three else (128, block_n, 8, 2))
    kernel = jit.get_kernel(spec)
    assert kernel.cubin[:4] == b"\x7fELF"
    assert "sm90 family" in kernel.source
    # At D = 96 and 128 over three warpgroups P goes through shared memory: O += P V takes A by descriptor. So it
    # does at D = 32 and 64 beside a score_mod called per score (the soft cap; ALiBi folds into affine terms).
    p_in_smem = three and (width == 128 or name == "softcap_causal")
    assert ("store_p(s_p_rows, s)" in kernel.source) == p_in_smem
    a_operands = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{D}k16\.f32\.bf16\.bf16\s*\{{[^}}]*\}},\s*(\S)", kernel.ptx)
    assert ("{" not in a_operands) == p_in_smem, "P V's A operand: a descriptor with P in shared memory, else registers"
    # A few bytes spill where buffer reads keep pointers across the KV loop (NVRTC 13.5: document at
    # D=128 16 B, relative_bias at D=64 144 B, reloaded once per KV tile); more is a regression.
    # ALiBi with a causal mask on three warpgroups spills 352 B and still runs 7% faster than on two
    # (docs/forward-sm90.md); more is a regression there too.
    limit = 400 if (name, width) == ("alibi_causal", 64) else 160
    assert kernel.resources.get("spill_stores_bytes", 0) <= limit, f"{name} D={D} spills: {kernel.resources}"
    # Both products are wgmma: S = QK^T as m64n{BLOCK_N}k16 (A, B from shared memory) over D / 16 k-steps, O += PV
    # as m64n{D}k16: the head's own columns, not the panels'.
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16", kernel.ptx)
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{D}k16\.f32\.bf16\.bf16", kernel.ptx)
    assert "mma.sync" not in kernel.ptx
    assert_tma_fed_and_unserialised(kernel)
    # O leaves by TMA tensor stores from the spent Q rows, not by a bulk copy per row.
    assert "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group" in kernel.ptx
    assert not re.search(r"cp\.async\.bulk\.global\.shared::cta", kernel.ptx)
    m = re.search(r"flexgen_fwd_smem_bytes\s*=\s*(\d+)", kernel.ptx)
    assert m, "the kernel no longer exports flexgen_fwd_smem_bytes"
    assert int(m.group(1)) == shared_memory_bytes(kernel)  # what the launcher reads from the cubin
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    mod_args = pack_mod_args(lower_mods(spec), buffers, params, check_device=False)
    p = re.search(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{spec.entry_name}_param_0\[(\d+)\]", kernel.ptx)
    assert p and int(p.group(1)) == ctypes.sizeof(FWD_PARAMS.ctypes_type(type(mod_args), tensor_maps=True))


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
def test_fp16_compiles():
    spec = make_spec("fwd", None, V.causal, head_dim=128, dtype="fp16", arch="sm_90a", **SM90)
    kernel = jit.get_kernel(spec)
    assert not has_spills(kernel.resources)
    assert "m64n128k16.f32.f16.f16" in kernel.ptx


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
def test_a_score_mod_with_a_dot_product_compiles_as_a_call():
    """MLA's RoPE term (attention-gym's generate_mla_rope_score_mod): 128 reads per score. Called, not inlined
    at each of a thread's scores, the forward and backward build with at most a few spilled bytes (inlined: over
    a minute of NVRTC and 400-500 B of spills) and keep the wgmma overlap."""
    import flexgen

    q_rope, k_rope = torch.randn(1, 4, 64, 64), torch.randn(1, 1, 64, 64)
    rope = flexgen.score_mod(lambda s, b, h, q, kv: s + 0.5 * torch.dot(q_rope[b, h, q], k_rope[b, h // 4, kv]))
    for kind in ("fwd", "bwd"):
        kernel = jit.get_kernel(make_spec(kind, rope, V.causal, head_dim=128, dtype="bf16", arch="sm_90a", **SM90))
        assert "__noinline__ float score_mod(" in kernel.source
        assert_tma_fed_and_unserialised(kernel)
        assert kernel.resources["spill_stores_bytes"] <= 64, kernel.resources  # (NVRTC 13.5: 48 B forward)


def test_family_option_is_checked():
    with pytest.raises(ValueError, match="only"):
        make_spec("bwd_postprocess", None, None, head_dim=64, arch="sm_90a", **SM90)
    with pytest.raises(ValueError, match="sm_90a"):
        make_spec("fwd", None, None, head_dim=64, arch="sm_80", **SM90)
    with pytest.raises(ValueError, match="allowed"):
        make_spec("fwd", None, None, head_dim=64, arch="sm_90a", family="sm70")


def test_sm80_family_on_request():
    spec = make_spec("fwd", None, None, head_dim=128, arch="sm_90a", family="sm80")
    assert spec.family == "sm80" and spec.option("family") is None  # a spec field, not a template option
    assert "mma_16816" in render(spec)


def test_tile_choice():
    def tile(D, **kw):
        spec = plan("fwd", "sm_90a", D, "bf16", family="sm90", **kw)
        return spec.block_m, spec.block_n, spec.num_warps, spec.num_stages

    def derived(D, **kw):  # under a mask from create_block_mask
        return tile(D, blocks_follow_mask=True, **kw)

    # D = 128 (and 96) without a score_mod: three consumer warpgroups, P through shared memory; on two under
    # hand-made lists of 128-row blocks, which a 192-row tile cannot walk.
    assert tile(128) == (192, 128, 12, 2) and tile(128, mask_block=(128, 128)) == (128, 128, 8, 2)
    # Any tile under smaller query blocks of a mask whose lists follow its mask_mod: it walks their union
    # (runtime/coarse_rows.py). Hand-made lists need blocks the tile divides.
    causal, document = V.causal.expr, V.document(torch.zeros(64, dtype=torch.int32)).expr
    assert derived(128, mask_expr=causal, mask_block=(64, 128)) == derived(128, mask_block=(32, 256)) == (192, 128, 12, 2)
    assert derived(128, score_expr=V.alibi(4).expr, mask_expr=causal, mask_block=(64, 128)) == (128, 128, 8, 2)
    with pytest.raises(ValueError, match="create_block_mask"):
        tile(128, mask_expr=causal, mask_block=(64, 128))
    # D = 64: three consumer warpgroups on 192 query rows, also under a block mask of smaller query blocks
    # that follow its mask_mod, but not where a mod reads a buffer, nor for a mask_mod without its block mask.
    assert tile(64) == (192, 128, 12, 2)
    for block in ((128, 128), (64, 128), (256, 256)):
        assert derived(64, mask_expr=causal, mask_block=block) == (192, 128, 12, 2)
    assert tile(64, mask_expr=causal, mask_block=(128, 128)) == (128, 128, 8, 2)  # hand-made lists
    assert plan("fwd", "sm_90a", 64, "bf16", None, causal, mask_block=(64, 128)).family == "sm80"
    assert tile(64, mask_expr=causal, mask_block=(384, 128)) == (192, 128, 12, 2)  # no union to walk
    assert plan("fwd", "sm_90a", 64, "bf16", None, causal, mask_block=(128, 64), blocks_follow_mask=True).family \
        == "sm80"  # KV blocks below the tile
    assert derived(64, mask_expr=document, mask_block=(128, 128)) == (128, 128, 8, 2)
    # A score_mod that reads buffers keeps two warpgroups, unless it folds into per-head terms (ALiBi's slopes are
    # then read once per work tile): not with fold_score off.
    alibi = V.alibi(4).expr
    assert derived(64, score_expr=alibi, mask_expr=causal, mask_block=(128, 128)) == (192, 128, 12, 2)
    assert derived(64, score_expr=alibi, mask_expr=causal, mask_block=(128, 128),
                   extra=(("fold_score", False),)) == (128, 128, 8, 2)
    caps = torch.full((4,), 30.0)
    capped = flexgen.score_mod(lambda s, b, h, q, kv: caps[h] * torch.tanh(s / caps[h])).expr
    assert derived(64, score_expr=capped, mask_expr=causal, mask_block=(128, 128)) == (192, 128, 12, 2)
    scaled = flexgen.score_mod(lambda s, b, h, q, kv, w=torch.ones(4): s * w[h]).expr  # (does not fold)
    assert derived(64, score_expr=scaled, mask_expr=causal, mask_block=(128, 128)) == (128, 128, 8, 2)
    assert derived(64, mask_expr=causal) == (128, 128, 8, 2)
    long = V.causal
    for i in range(12):  # 25 operations: the 160 registers of a consumer would spill
        long = flexgen.and_masks(long, flexgen.mask_mod(lambda b, h, q, kv, i=i: (q - kv) % (i + 2) != 1))
    assert derived(64, mask_expr=long.expr, mask_block=(128, 128)) == (128, 128, 8, 2)
    # Dropout takes the three warpgroups too, but not beside a score_mod (Philox's state and its terms would spill).
    assert tile(64, dropout=True) == derived(64, mask_expr=causal, mask_block=(128, 128), dropout=True) \
        == (192, 128, 12, 2)
    assert derived(64, score_expr=capped, mask_expr=causal, mask_block=(128, 128), dropout=True) == (128, 128, 8, 2)
    # Per-element score loads do not shrink the KV tile below the smallest wgmma N the template has.
    score, _ = cpu_variants()["relative_bias"]
    assert plan("fwd", "sm_90a", 128, "bf16", score.expr, family="sm90").block_n == 64


@pytest.mark.parametrize("name, dropout, want", [
    ("softcap_causal", False, True), ("alibi_causal", False, True), ("relative_bias", False, True),
    ("none", False, False), ("causal", False, False),  # no score_mod: the loop is near the tensor cores' bound
    ("document", False, False),  # a mask that reads buffers keeps the FADDs (the consumers' spills rose)
    ("softcap_causal", True, False),  # dropout's normaliser is the sum of the P before dropping
])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_which_forwards_sum_rows_on_the_tensor_cores(name, dropout, want, D):
    """The forward sums P's rows by a product with a tile of ones beside P V where it has a score_mod, but with
    dropout or a mask that reads buffers, without a score_mod, and where P goes through shared memory at D = 96 and
    128 (three warpgroups), by FADDs (docs/forward-sm90.md)."""
    score, mask = cpu_variants()[name]
    spec = make_spec("fwd", score, mask, head_dim=D, dtype="bf16", arch="sm_90a", dropout=dropout,
                     mask_block=(128, 128) if mask is not None else None, **SM90)
    source = render(spec)
    p_in_smem = "store_p(s_p_rows, s)" in source
    assert p_in_smem == (not dropout and (D in (96, 128) and name in ("none", "causal")
                                          or D == 96 and name in ("softcap_causal", "alibi_causal")
                                          or D == 64 and name == "softcap_causal"))
    assert f"constexpr bool TENSOR_ROW_SUMS = {'true' if want and not (p_in_smem and D > 64) else 'false'};" in source


# ---------------------------------------------------------------- on a Hopper GPU



GPU_VARIANTS = ["none", "causal", "softcap_causal", "alibi_causal", "document", "sliding_window", "relative_bias",
                "per_head_mask", "padding_mask"]


@gpu
@hopper
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_sm90_variants_match_reference(name, D):
    from test_gpu_forward import Shape, check_variant

    if D == 32 and name in ("document", "padding_mask"):  # (masks that read buffers stay on sm80 at D = 32)
        with pytest.raises(ValueError, match="at head dim 32 it leaves masks that read buffers to sm80"):
            check_variant(name, Shape(2, 3, 1000, 1000), D, torch.bfloat16, kernel_options=SM90)
        return
    check_variant(name, Shape(2, 3, 1000, 1000), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [32, 96, 128, 256])
@pytest.mark.parametrize("lq,lkv", [(1, 1), (17, 17), (1, 4097), (4097, 1000), (1000, 17)])
@pytest.mark.parametrize("name", ["none", "causal"])
def test_sm90_lengths(name, lq, lkv, D):
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(1, 2, lq, lkv), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("lq,lkv", [(1, 1), (191, 300), (193, 193), (1000, 17), (4097, 2049)])
@pytest.mark.parametrize("name", ["none", "alibi", "softcap"])
def test_sm90_three_warpgroups(name, lq, lkv):
    """D = 64 without a block mask: 192-row tiles over three consumer warpgroups, ragged last tiles included."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 3, lq, lkv), 64, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [96, 128])
@pytest.mark.parametrize("lq,lkv", [(1, 1), (191, 300), (193, 193), (1000, 17), (777, 1100), (4097, 2049)])
@pytest.mark.parametrize("name", ["none", "causal", "prefix_lm", "per_head_mask", "sliding_window"])
def test_sm90_p_through_shared_memory(name, lq, lkv, D):
    """D = 96 and 128 without a score_mod: 192-row tiles over three warpgroups, P through shared memory (O += P V
    reads it there), O out through P's rows and the one Q buffer handed back after each tile's last S = Q K^T. (A
    sliding window keeps 128-row tiles: the planner's choice is checked with the rest.)"""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 3, lq, lkv), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [96, 128])
def test_sm90_p_through_shared_memory_without_turns_fp16_gqa_and_grid(D):
    """Without the warpgroup turns, whose barrier otherwise orders a warpgroup's P stores before its P V, a barrier
    of the warpgroup's own does."""
    from test_gpu_forward import Shape, check_variant

    check_variant("causal", Shape(2, 4, 777, 777), D, torch.float16, gqa_kv_heads=2,
                  kernel_options={**SM90, "pingpong": False})
    check_variant("none", Shape(2, 3, 1000, 1000), D, torch.bfloat16, kernel_options={**SM90, "pingpong": False})
    check_variant("none", Shape(3, 2, 1500, 1500), D, torch.bfloat16, kernel_options={**SM90, "persistent": False})


@gpu
@hopper
@pytest.mark.parametrize("lq,lkv", [(1000, 1000), (777, 1100), (2049, 2049), (100, 3000)])
@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "softcap_causal", "per_head_mask", "or_masks"])
def test_sm90_three_warpgroups_under_a_block_mask(name, lq, lkv):
    """D = 64 under a mask of 128-row blocks: each 192-row tile walks the union of the query blocks it touches
    (runtime/coarse_rows.py), and mask_mod decides the elements of every block not full for all of them."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 3, lq, lkv), 64, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D,name", [(64, "causal"), (64, "document"), (128, "causal"), (128, "sliding_window")])
@pytest.mark.parametrize("q_block", [32, 64])
def test_sm90_under_smaller_query_blocks(D, name, q_block):
    """A mask of query blocks below the tile's rows (192 at D = 64 unless a mod reads buffers, else 128): the
    tile walks their union (runtime/coarse_rows.py)."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 3, 1000, 1000), D, torch.bfloat16, kernel_options=SM90,
                  bm_kwargs={"BLOCK_SIZE": (q_block, 128)})


@gpu
@hopper
def test_sm90_coarse_rows_in_a_graph():
    # Under CUDA-graph capture the union is computed inside the graph, not taken from the cache.
    q, k, v = (torch.randn(1, 2, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bm = flexgen.create_block_mask(lambda b, h, qi, kv: qi >= kv, None, None, 1000, 1000, device="cuda")
    eager = flexgen.flex_attention(q, k, v, block_mask=bm)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(flexgen.flex_attention(q, k, v, block_mask=bm))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
@hopper
@pytest.mark.parametrize("name", ["none", "softcap"])
def test_sm90_three_warpgroups_fp16_gqa_and_grid(name):
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 4, 777, 777), 64, torch.float16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(3, 2, 1500, 1500), 64, torch.bfloat16, kernel_options={**SM90, "persistent": False})


@gpu
@hopper
@pytest.mark.parametrize("name", ["late_causal", "nothing"])
def test_sm90_fully_masked_rows(name):
    """Rows that see nothing: O = 0 and lse = -inf (checked by assert_matches)."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(1, 2, 600, 600), 64, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("name", ["none", "causal", "document"])
def test_sm90_fp16_and_gqa(name):
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(2, 4, 777, 777), 128, torch.float16, kernel_options=SM90)
    check_variant(name, Shape(2, 4, 777, 777), 64, torch.bfloat16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(1, 4, 555, 601), 256, torch.float16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(1, 4, 555, 601), 96, torch.float16, gqa_kv_heads=2, kernel_options=SM90)
    if name != "document":  # (at D = 32 sm80's)
        check_variant(name, Shape(2, 2, 300, 333), 32, torch.float16, kernel_options=SM90)


def test_forward_family_default():
    def pick(arch="sm_90a", D=128, dropout=False, tiles=(), requested=None, kind="fwd"):
        return choose(Call(kind, arch, D, "bf16", dropout=dropout, tiles=tiles), requested).name

    assert pick() == "sm90" and pick(D=64) == "sm90"
    assert pick(D=32) == pick(D=96) == pick(D=256) == "sm90" and pick(dropout=True) == "sm90"
    assert pick(D=256, kind="bwd") == "sm90"  # (the sm90 backward: every head dim of its forward)
    assert pick(D=128, kind="bwd") == pick(D=96, kind="bwd") == "sm90"
    assert pick(tiles=(("block_n", 128),)) == "sm80"  # forward tile options are sm80 tile choices
    assert pick(arch="sm_80") == "sm80" and pick(arch="sm_89", D=64) == "sm80"
    assert pick(arch="sm_100a") == "sm80" and pick(arch="sm_120") == "sm80"  # wgmma is sm_90a's alone
    assert pick(requested="sm80") == "sm80"
    assert pick(kind="bwd_preprocess") == "sm80"
    with pytest.raises(ValueError, match="allowed"):
        pick(requested="sm100")


def test_emit_shows_what_flex_attention_runs():
    """make_spec / emit / the CLI plan the kernel as flex_attention does: the Hopper forward on sm_90a
    where it applies, sm80 elsewhere or on request."""
    assert make_spec("fwd", None, V.causal, head_dim=128, arch="sm_90a").family == "sm90"
    assert make_spec("fwd", None, V.causal, head_dim=128, arch="sm_90a", family="sm80").family == "sm80"
    assert make_spec("fwd", None, V.causal, head_dim=96, arch="sm_90a").family == "sm90"
    assert make_spec("bwd", None, V.causal, head_dim=96, arch="sm_90a").family == "sm90"
    assert make_spec("bwd", None, V.causal, head_dim=256, arch="sm_90a").family == "sm90"
    assert make_spec("fwd", None, V.causal, head_dim=128, arch="sm_90a", block_n=32).family == "sm80"
    assert make_spec("fwd", None, V.causal, head_dim=128, arch="sm_80").family == "sm80"
    assert make_spec("bwd", None, V.causal, head_dim=128, arch="sm_90a").family == "sm90"
    assert make_spec("bwd", None, V.causal, head_dim=128, arch="sm_90a", family="sm80").family == "sm80"


def test_sm90_refuses_what_it_does_not_cover():
    with pytest.raises(ValueError, match="at head dim 96 its deterministic backward"):
        make_spec("bwd", None, None, head_dim=96, arch="sm_90a", deterministic=True, **SM90)
    with pytest.raises(ValueError, match="tile"):
        make_spec("fwd", None, None, head_dim=128, arch="sm_90a", block_n=32, **SM90)


@gpu
@hopper
@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "softcap_causal"])
def test_sm90_persistent_many_tiles_per_cta(name):
    """With a block mask the sm90 grid is persistent: at 4 x 8 heads x 17 query tiles (544 work tiles)
    every CTA of an H200 (132 SMs) walks about four, carrying its pipeline's stages and phases from
    one to the next."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(4, 8, 2049, 2049), 128, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("name,persistent", [("none", True), ("causal", False)])
def test_sm90_persistent_option(name, persistent):
    """kernel_options persistent overrides the grid choice both ways (dense attention persistent,
    a block-masked one with one tile per CTA)."""
    from test_gpu_forward import Shape, check_variant

    check_variant(name, Shape(4, 8, 2049, 2049), 64, torch.bfloat16, kernel_options={**SM90, "persistent": persistent})


@gpu
@hopper
def test_sm90_tile_counter_is_left_zero():
    """CTAs draw work tiles from a per-stream counter; the last draw resets it, so the next launch (here
    with a different tile count) sees every tile. Unbalanced document tiles make CTAs draw unequally."""
    from flexgen.runtime.schedule import tile_counter
    from test_gpu_forward import Shape, check_variant

    check_variant("document", Shape(4, 8, 2049, 2049), 128, torch.bfloat16, kernel_options=SM90)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    assert int(tile_counter(s.device, s.cuda_stream).item()) == 0
    check_variant("causal", Shape(3, 5, 1500, 1500), 64, torch.bfloat16, kernel_options=SM90)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream()
    assert int(tile_counter(s.device, s.cuda_stream).item()) == 0


@gpu
@hopper
def test_sm90_concurrent_streams():
    """Launches in flight on two streams at once draw from counters of their own: every output is whole."""
    import flexgen

    dev = torch.device("cuda")
    mask = flexgen.create_block_mask(V.causal, None, None, 2049, 2049, device=dev)
    inputs = [[torch.randn(4, 8, 2049, 128, device=dev, dtype=torch.bfloat16) for _ in range(3)] for _ in range(4)]
    want = [flexgen.flex_attention(*t, block_mask=mask, kernel_options=SM90) for t in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    got = []
    for i, t in enumerate(inputs):
        with torch.cuda.stream(streams[i % 2]):
            got.append(flexgen.flex_attention(*t, block_mask=mask, kernel_options=SM90))
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@gpu
@hopper
def test_sm90_cuda_graph_replay():
    """Captured in a CUDA graph (the counter's zeroing is captured with it), replays give eager's output."""
    import flexgen

    dev = torch.device("cuda")
    mask = flexgen.create_block_mask(V.causal, None, None, 2049, 2049, device=dev)
    q, k, v = (torch.randn(2, 8, 2049, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options=SM90)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options=SM90)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options=SM90))


@gpu
@hopper
@pytest.mark.parametrize("name", ["none", "causal", "softcap_causal"])
def test_sm90_bf16_probabilities_carry_no_bias(name):
    """bf16 P is truncated from exponentials scaled by 1 + TRUNC_BIAS (templates/common/numeric.cuh): O and lse stay
    unbiased against float64. Without the scale O shrinks by about 0.26%; with it but left on the fp32 row sums
    (full, causal; softcap sums P itself on the tensor cores) O shrinks and lse grows by 0.28%."""
    score, mask = cpu_variants()[name]
    L, D = 2048, 128
    q, k, v = (torch.randn(2, 4, L, D, device="cuda").bfloat16() for _ in range(3))
    bm = flexgen.create_block_mask(mask, None, None, L, L, device="cuda") if mask is not None else None
    out, lse = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=bm, return_lse=True, kernel_options=SM90)
    s = (q.double() @ k.double().transpose(-1, -2)) * D ** -0.5
    if name == "softcap_causal":
        s = 30.0 * torch.tanh(s / 30.0)
    if mask is not None:
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    ref, ref_lse = torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    slope = ((out.double() - ref) * ref).sum() / (ref * ref).sum()  # O = (1 + slope) ref + noise
    assert abs(slope.item()) < 5e-4, slope.item()
    assert abs((lse.double() - ref_lse).mean().item()) < 5e-4, (lse.double() - ref_lse).mean().item()
