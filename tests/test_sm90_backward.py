"""The Hopper backward (templates/sm90/bwd.cu.j2): flex_attention's default backward on sm_90 at every head dim
(at D = 256 the head dim split across the warpgroups) except deterministic buffer gradients, buffer gradients with
dropout and deterministic mode at 32 and 96 (runtime/families.py), or kernel_options={"family": "sm90"}.

CPU: it renders and compiles for sm_90a, runs all five products on wgmma, its BwdParams has the
host mirror's size and the launcher reads its exported shared-memory size from the cubin; the
family choice and its refusals. GPU (marked; needs a Hopper): gradients against float64 autograd
with the bar of tests/test_gpu_backward.py.
"""
from __future__ import annotations

import ctypes
import math
import re

import pytest
import torch

import flexgen
from flexgen import variants as V
from flexgen.cache import jit
from flexgen.codegen.api import make_spec
from flexgen.codegen.cstruct import pack_mod_args
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.params import BWD_PARAMS
from flexgen.codegen.render import render
from flexgen.runtime import families
from flexgen.runtime.families import Call, choose
from flexgen.runtime.kernel_symbols import shared_memory_bytes
from sm90_cases import SM90, assert_tma_fed_and_unserialised, cpu_variants, hopper, needs_nvrtc

gpu = pytest.mark.gpu


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("name", list(cpu_variants()))
def test_compiles_and_matches_host_layouts(name, D):
    score, mask = cpu_variants()[name]
    spec = make_spec("bwd", score, mask, head_dim=D, dtype="bf16", arch="sm_90a", **SM90)
    # Query rows per step: 128 at D = 64 (families.SM90.BWD_WIDE) unless mask_mod reads buffers or score_mod
    # loads an element per score. D = 32 and 96 load 64 and 128 columns (zero-filled by the TMA loads). D = 256: both
    # warpgroups on 64 keys, each with half the step's queries in S^T and dP^T and half of D in dK, dV and dQ.
    width = -(-D // 64) * 64
    rows = (128 if width == 64 and name not in ("document", "relative_bias") else
            80 if width == 128 and name == "none" else 64)
    keys = 64 if width == 256 else 128
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == (rows, keys, 8, 2)
    assert families.of(spec).threads_per_cta(spec) == 384  # a producer warpgroup beside two consumer ones
    kernel = jit.get_kernel(spec)
    assert "sm90 family" in kernel.source
    # NVRTC 13.5: spill-free except relative_bias (its table pointer next to dK and dV), at D = 64 over 128-row
    # steps softcap with a mask (on the partial tiles), and at D = 128 the folded soft cap with a mask (6 B: still
    # faster, docs/backward.md); more is a regression.
    limit = {("softcap_causal", 64): 48, ("softcap_causal", 128): 8}.get((name, width), 256 if name == "relative_bias" else 0)
    # (.get: NVRTC 13.0, on the GPU machine, returns no ptxas report.)
    assert kernel.resources.get("spill_stores_bytes", 0) <= limit, f"{name} D={D} spills: {kernel.resources}"
    # The five products: S^T and dP^T as m64n{rows} (shared A, B; over D / 16 k-steps), dK and dV as m64n{D} (A in
    # registers; the head's own columns, not the panels'),
    # each warpgroup's 64 x 64 share of dQ as m64n64. D = 256: S^T and dP^T m64n32, dK, dV and dQ m64n128, all from
    # shared memory (P and dX read transposed: imm-trans-a = 1).
    wgmma = r"wgmma\.mma_async\.sync\.aligned\.m64n{}k16\.f32\.bf16\.bf16\s+\{{[^}}]*\}}, "
    if width == 256:
        assert re.search(wgmma.format(32) + r"%rd", kernel.ptx)
        assert re.search(wgmma.format(128) + r"%rd\d+, %rd\d+, p, 1, 1, 1, 1;", kernel.ptx)  # dK, dV
        assert re.search(wgmma.format(128) + r"%rd\d+, %rd\d+, p, 1, 1, 0, 1;", kernel.ptx)  # dQ
        assert not re.search(wgmma.format(r"\d+") + r"\{", kernel.ptx)
    else:
        assert re.search(wgmma.format(rows), kernel.ptx)
        assert re.search(wgmma.format(D) + r"\{", kernel.ptx)
        if rows == 80:  # dQ^T: A (K) read MN-major, B (dS) K-major
            assert re.search(wgmma.format(80) + r"%rd\d+, %rd\d+, p, 1, 1, 1, 0;", kernel.ptx)
        else:
            assert re.search(wgmma.format(64), kernel.ptx)
    assert "mma.sync" not in kernel.ptx
    assert_tma_fed_and_unserialised(kernel)
    # lse and delta of a step by two 1-D bulk copies (from bwd_preprocess's padded buffers), on the stage's barrier
    assert kernel.ptx.count("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [") >= 2
    m = re.search(r"flexgen_bwd_smem_bytes\s*=\s*(\d+)", kernel.ptx)
    assert m and int(m.group(1)) == shared_memory_bytes(kernel)  # what the launcher reads from the cubin
    # A second K / V buffer (the next KV tile loaded during this one's last steps) only where it fits: 64-row
    # steps at D = 32 and 64; the second buffer starts past the first layout, on a 1 KB boundary.
    bufs = int(re.search(r"\.u32 KV_BUFS = (\d+);", kernel.ptx).group(1))
    assert bufs == (2 if width == 64 and rows == 64 else 1), (name, D, bufs)
    if bufs == 2:
        second = int(re.search(r"\.u32 KV2_OFFSET = (\d+);", kernel.ptx).group(1))
        one_buffer = int(re.search(r"\.u32 SMEM_ONE_KV = (\d+);", kernel.ptx).group(1))
        assert second % 1024 == 0 and second >= one_buffer - 1024
        assert int(m.group(1)) == 1024 + second + 2 * 2 * spec.block_n * width <= 232448
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    mod_args = pack_mod_args(lower_mods(spec), buffers, params, check_device=False)
    p = re.search(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{spec.entry_name}_param_0\[(\d+)\]", kernel.ptx)
    assert p and int(p.group(1)) == ctypes.sizeof(BWD_PARAMS.ctypes_type(type(mod_args), tensor_maps=True))


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
def test_fp16_and_deterministic_compile():
    spec = make_spec("bwd", None, V.causal, head_dim=128, dtype="fp16", arch="sm_90a", deterministic=True, **SM90)
    kernel = jit.get_kernel(spec)
    assert kernel.resources.get("spill_stores_bytes", 0) == 0
    assert "m64n128k16.f32.f16.f16" in kernel.ptx
    assert "red.global.add" not in kernel.ptx  # deterministic dQ: ordered read-add-write into the split's partial


def test_backward_family_default_and_refusals():
    def pick(arch="sm_90a", D=128, dropout=False, grads=False, tiles=False, block=(128, 128), requested=None,
             deterministic=False):
        call = Call("bwd", arch, D, "bf16", dropout=dropout, buffer_grads=grads, deterministic=deterministic,
                    tiles=(("block_m", 64),) if tiles else (), mask_block=block)
        return choose(call, requested).name

    assert pick() == "sm90" and pick(D=64) == "sm90" and pick(block=None) == "sm90"
    assert pick(block=(256, 512)) == "sm90"
    assert pick(arch="sm_80") == "sm80" and pick(D=96) == pick(D=32) == pick(D=256) == "sm90"
    assert pick(D=256, deterministic=True) == pick(D=256, dropout=True) == "sm90"
    assert pick(D=256, block=(64, 64)) == "sm90" and pick(D=256, block=(32, 64)) == "sm80"  # (its tile: 64 x 64)
    assert pick(D=96, deterministic=True) == "sm80" and pick(D=64, deterministic=True) == "sm90"
    assert pick(dropout=True) == "sm90" and pick(grads=True) == "sm90" and pick(tiles=True) == "sm80"
    assert pick(grads=True, deterministic=True) == "sm80" and pick(grads=True, dropout=True) == "sm80"
    assert pick(deterministic=True) == "sm90"
    assert pick(block=(64, 64)) == "sm80" and pick(block=(128, 64)) == "sm80"  # blocks smaller than the tile
    assert pick(requested="sm80") == "sm80"
    with pytest.raises(ValueError, match="buffer gradients only in non-deterministic mode"):
        pick(requested="sm90", grads=True, deterministic=True)
    with pytest.raises(ValueError, match="buffer gradients with dropout"):
        pick(requested="sm90", grads=True, dropout=True)
    with pytest.raises(ValueError, match="at head dim 96 its deterministic backward"):
        pick(requested="sm90", D=96, deterministic=True)
    with pytest.raises(ValueError, match="allowed"):
        pick(requested="sm75")
    assert "multiple of its tile" in families.named("sm90").refusal(Call("bwd", "sm_90a", 128, "bf16", mask_block=(32, 128)))


def test_backward_query_rows_per_step():
    """128 query rows per step at D = 64 (families.SM90.BWD_WIDE), except under a block mask of 64-row blocks or
    for a mask_mod reading buffers or a score_mod loading an element per score; 80 or 64 at D = 128."""
    def rows(score=None, mask=None, D=64, block=None, **options):
        return make_spec("bwd", score, mask, head_dim=D, arch="sm_90a", mask_block=block, **SM90, **options).block_m

    assert rows() == 128 and rows(mask=V.causal) == 128 and rows(mask=V.causal, block=(128, 128)) == 128
    assert rows(mask=V.sliding_window(256), block=(256, 128)) == 128
    assert rows(mask=V.causal, block=(64, 128)) == 64
    assert rows(V.softcap(30.0), V.causal) == 128 and rows(V.alibi(8)) == 128
    doc_ids = torch.zeros(256, dtype=torch.int32)
    assert rows(mask=V.document(doc_ids)) == 64
    assert rows(V.relative_bias(torch.zeros(2, 511))) == 64
    # D = 128: 80 rows without a mask or score_mod (families.SM90.BWD_TALL), else 64, and with dropout
    assert rows(D=128) == rows(D=96) == 80 and rows(mask=V.causal, D=128) == 64
    # an ALiBi-like score_mod folds into affine terms over 80 rows too, unless its slopes learn or fold_score is off
    assert rows(V.alibi(4), D=128) == rows(V.alibi(4), D=96) == 80 and rows(V.alibi(4), V.causal, D=128) == 64
    learnable = V.alibi(V.alibi_slopes(4).requires_grad_())
    assert rows(learnable, D=128, grad_buffers=tuple(learnable.buffer_names)) == 64
    assert rows(V.alibi(4), D=128, fold_score=False) == 64 and rows(V.softcap(30.0), D=128) == 64
    assert rows(D=128, dropout=True) == 64 and rows(D=128, deterministic=True) == 64
    assert rows(V.relative_bias(torch.zeros(2, 511)), D=128) == 64
    # under a block mask: 80 rows where its query blocks are multiples of 80 or its lists follow the mask_mod (the
    # steps walk the unions of the blocks they touch: runtime/coarse_rows.py), not for a mask reading buffers
    def blocked(score=None, mask=V.causal, block=(128, 128), follow=True, **options):
        return make_spec("bwd", score, mask, head_dim=128, arch="sm_90a", mask_block=block, blocks_follow_mask=follow,
                         **SM90, **options).block_m

    assert blocked() == blocked(V.alibi(4)) == blocked(mask=V.sliding_window(1024)) == blocked(block=(64, 128)) == 80
    assert blocked(follow=False) == 64 and blocked(block=(640, 128), follow=False) == 80
    assert blocked(mask=V.document(doc_ids)) == blocked(V.softcap(30.0)) == blocked(dropout=True) == 64


def test_planning_refuses_what_the_sm90_backward_does_not_cover():
    with pytest.raises(ValueError, match="tile"):
        make_spec("bwd", None, None, head_dim=128, arch="sm_90a", block_n=64, **SM90)
    with pytest.raises(ValueError, match="only"):
        make_spec("bwd_preprocess", None, None, head_dim=128, arch="sm_90a", **SM90)


# ---------------------------------------------------------------- on a Hopper GPU



GPU_VARIANTS = ["none", "causal", "sliding_window", "document", "alibi_causal", "softcap_causal", "per_head_mask",
                "alibi_causal_learnable", "relative_bias_learnable"]


@gpu
@hopper
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_sm90_backward_variants(name, D):
    from test_gpu_backward import Shape, check_variant

    # (At D = 32 a mask that reads buffers keeps its forward on sm80, so family="sm90" is refused: the default plan
    # runs this backward there.)
    options = None if (D, name) == (32, "document") else SM90
    assert make_spec("bwd", None, V.causal, head_dim=D, arch="sm_90a").family == "sm90"
    check_variant(name, Shape(2, 3, 1000, 1000), D, torch.bfloat16, kernel_options=options)


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
def test_score_mods_fold_into_the_backwards_own_terms():
    """An ALiBi-like score_mod (dsl/affine.py) folds into the backward's exponent (a term per key row and one per
    query column), a soft cap (dsl/softcap.py) into one tanh per score for P and its derivative (64-row steps, not
    in deterministic mode); neither with its buffers learnable (score_mod_bwd sums their gradients), with dropout,
    or with kernel_options fold_score=False. Unserialised, and spill-free but for the masked soft cap's 6 B."""
    slopes = V.alibi_slopes(4)

    def spec_of(score, **kw):
        return make_spec("bwd", score, V.causal, head_dim=128, dtype="bf16", arch="sm_90a", **SM90, **kw)

    for D in (64, 128):
        kernel = jit.get_kernel(make_spec("bwd", V.alibi(slopes), V.causal, head_dim=D, dtype="bf16", arch="sm_90a",
                                          **SM90))
        assert "score_mod_affine(b, h, p.mod" in kernel.source and "row_term[c >> 1] + col_term[c & 1]" in kernel.source
        assert_tma_fed_and_unserialised(kernel)
        assert kernel.resources.get("spill_stores_bytes", 0) == 0, kernel.resources
    for D in (96, 128):  # without a mask, over 80-row steps
        spec = make_spec("bwd", V.alibi(slopes), None, head_dim=D, dtype="bf16", arch="sm_90a", **SM90)
        kernel = jit.get_kernel(spec)
        assert spec.block_m == 80 and "row_term[c >> 1] + col_term[c & 1]" in kernel.source
        assert_tma_fed_and_unserialised(kernel)
        assert kernel.resources.get("spill_stores_bytes", 0) == 0, kernel.resources
    for mask, most in ((None, 0), (V.causal, 8)):  # a soft cap folds over 64-row steps (D = 128)
        kernel = jit.get_kernel(make_spec("bwd", V.softcap(20.0), mask, head_dim=128, dtype="bf16", arch="sm_90a",
                                          **SM90))
        assert "score_mod_softcap(b, h, p.mod" in kernel.source and "fmaf(-t, t, 1.f)" in kernel.source
        assert_tma_fed_and_unserialised(kernel)
        assert kernel.resources.get("spill_stores_bytes", 0) <= most, kernel.resources
    assert "tanh_step" not in render(spec_of(V.softcap(20.0), deterministic=True))
    learnable = V.alibi(slopes.clone().requires_grad_())
    unfolded = [spec_of(learnable, grad_buffers=tuple(learnable.buffer_names)), spec_of(V.alibi(slopes), dropout=True),
                spec_of(V.alibi(slopes), fold_score=False)]
    for spec in unfolded:
        assert "row_term" not in render(spec)


@gpu
@hopper
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["alibi_causal", "softcap_causal"])
def test_folded_backward_with_gqa_and_odd_lengths(name, D, fold):
    """The folded backwards (ALiBi's per-row and per-column terms, a soft cap's one tanh per score) and the unfolded
    ones, under GQA and with query and key lengths that differ and end mid-tile, against float64 autograd."""
    from test_gpu_backward import Shape, check_variant

    options = {**SM90, "fold_score": fold}
    check_variant(name, Shape(2, 4, 777, 1001), D, torch.bfloat16, gqa_kv_heads=2, kernel_options=options)
    check_variant(name, Shape(1, 3, 300, 300), D, torch.float16, kernel_options=options)


@gpu
@hopper
@pytest.mark.parametrize("lq,lkv", [(1, 1), (17, 17), (1, 1000), (1000, 17), (700, 1100), (2049, 300)])
@pytest.mark.parametrize("name", ["none", "causal"])
@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_sm90_backward_lengths(name, lq, lkv, D):
    from test_gpu_backward import Shape, check_variant

    check_variant(name, Shape(1, 2, lq, lkv), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D,name,block", [(64, "causal", (64, 128)), (64, "sliding_window", (256, 128)),
                                          (64, "causal", (128, 256)), (256, "causal", (64, 64)),
                                          (256, "sliding_window", (128, 64)), (256, "document", (64, 128)),
                                          (256, "causal", (256, 256))])
def test_sm90_backward_block_sizes(D, name, block):
    """At D = 64 the backward steps over 128 query rows, or 64 under a block mask of 64-row blocks; at D = 256 its
    tile is 64 x 64, so block masks of 64-key blocks run on it too. A larger block is walked in several steps (and
    at D = 256 by several CTAs)."""
    from test_gpu_backward import Shape, check_variant

    assert make_spec("bwd", None, V.causal, head_dim=D, arch="sm_90a", mask_block=block).family == "sm90"
    shape = Shape(2, 3, 1000, 1000) if D == 64 else Shape(1, 3, 700, 700)
    check_variant(name, shape, D, torch.bfloat16, kernel_options=SM90, bm_kwargs={"BLOCK_SIZE": block})


@gpu
@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_sm90_forward_and_its_backward_under_32_row_blocks(D):
    """Query blocks of 32 rows: the sm90 forward walks their union over its taller tile; the backward's 80-row steps
    (D = 128) walk unions too, its 128-row steps (D = 64) need whole blocks and run on sm80, from the forward's
    output and log-sum-exp."""
    from test_gpu_backward import Shape, check_variant

    assert make_spec("fwd", None, V.causal, head_dim=D, arch="sm_90a", mask_block=(32, 128)).family == "sm90"
    bwd = make_spec("bwd", None, V.causal, head_dim=D, arch="sm_90a", mask_block=(32, 128))
    assert bwd.family == ("sm90" if D == 128 else "sm80") and (D == 64 or bwd.block_m == 80)
    check_variant("causal", Shape(2, 3, 1000, 1000), D, torch.bfloat16, bm_kwargs={"BLOCK_SIZE": (32, 128)})


@gpu
@hopper
@pytest.mark.parametrize("name", ["none", "causal", "document"])
def test_sm90_backward_fp16_and_gqa(name):
    from test_gpu_backward import Shape, check_variant

    check_variant(name, Shape(2, 4, 777, 777), 128, torch.float16, kernel_options=SM90)
    check_variant(name, Shape(2, 4, 777, 777), 64, torch.bfloat16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(1, 4, 555, 601), 96, torch.float16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(2, 2, 300, 333), 32, torch.bfloat16, kernel_options=None if name == "document" else SM90)
    check_variant(name, Shape(1, 4, 430, 390), 256, torch.float16, gqa_kv_heads=2, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [64, 128, 256])
def test_sm90_backward_deterministic(D):
    from test_gpu_backward import Shape, block_mask_for, flexgen_grads, fresh_seed, _variant

    seed = fresh_seed()
    s = Shape(2, 4, 1000, 900)
    q = torch.randn(s.B, s.H, s.Lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, 2, s.Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    score, mask, uses_bh, learn = _variant("causal", s)
    bm = block_mask_for(mask, uses_bh, s)
    opts = {"deterministic": True, **SM90}
    first = flexgen_grads(q, k, v, do, score, bm, True, learn, opts)
    for _ in range(2):
        again = flexgen_grads(q, k, v, do, score, bm, True, learn, opts)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), f"not bitwise repeatable (seed {seed})"
    plain = flexgen_grads(q, k, v, do, score, bm, True, learn, {**SM90})
    for a, b in zip(first, plain):
        assert (a.float() - b.float()).norm() <= 1e-2 * b.float().norm(), f"deterministic differs (seed {seed})"


@gpu
@hopper
@pytest.mark.parametrize("name", ["causal", "alibi_causal", "document", "alibi_causal_learnable",
                                  "relative_bias_learnable"])
def test_sm80_backward_on_request(name):
    """kernel_options family='sm80' keeps the mma.sync backward reachable (and tested) on Hopper."""
    from test_gpu_backward import Shape, check_variant

    check_variant(name, Shape(2, 3, 1000, 1000), 128, torch.bfloat16, kernel_options={"family": "sm80"})


@gpu
@hopper
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["none", "causal", "sliding_window", "document"])
def test_sm90_backward_persistent_many_tiles_per_cta(name, D):
    """The persistent grid: 4 x 8 KV heads x 17 KV tiles (544 work tiles) over an H200's 132 CTAs, each walking
    about four, with K, V, the stages and the dS buffers carried from one to the next (at D = 128 and 64, whose
    layouts differ)."""
    from test_gpu_backward import Shape, check_variant

    check_variant(name, Shape(4, 8, 2100, 2100), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D,name", [(64, "document"), (32, "document"), (64, "relative_bias_learnable"), (64, "causal"),
                                    (128, "none"), (128, "document")])
def test_sm90_backward_three_ctas_walk_every_tile(D, name, monkeypatch):
    """A grid of 3 CTAs, each walking about 21 of 64 work tiles: every K / V buffer turns over many times, its
    barriers' parities with it (two buffers in the 64-row kernels at D = 32 and 64: documents, learnable buffers;
    one elsewhere), as on a GPU with few SMs."""
    from test_gpu_backward import Shape, check_variant

    from flexgen.runtime import families

    monkeypatch.setattr(families, "sm_count", lambda device: 3)
    # (D = 32: a buffer-reading mask's forward runs on sm80, the backward on sm90 by default)
    check_variant(name, Shape(2, 4, 1000, 1000), D, torch.bfloat16,
                  kernel_options=None if (D, name) == (32, "document") else SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [96, 128])
@pytest.mark.parametrize("lq,lkv", [(1, 300), (79, 81), (161, 1025), (640, 640), (641, 7)])
def test_sm90_backward_80_row_steps_over_ragged_lengths(D, lq, lkv):
    """The 80-row steps (no mask, no score_mod) where the last step is partial or the only one, at a multiple of
    the 640-row padding of lse, delta and dQ's accumulator and one row past it, with fewer keys than one tile and
    more than eight tiles."""
    from test_gpu_backward import Shape, check_variant

    assert make_spec("bwd", None, None, head_dim=D, arch="sm_90a", **SM90).block_m == 80
    check_variant("none", Shape(1, 2, lq, lkv), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [96, 128])
@pytest.mark.parametrize("name", ["alibi", "alibi_learnable"])
def test_sm90_backward_alibi_without_a_mask(name, D):
    """ALiBi without a mask: fixed slopes fold into the 80-row steps' own terms, learnable ones keep 64 rows and
    score_mod's gradient; under GQA, with lengths that end mid-step, and a step's worth of rows."""
    from test_gpu_backward import Shape, check_variant

    assert make_spec("bwd", V.alibi(4), None, head_dim=D, arch="sm_90a", **SM90).block_m == 80
    check_variant(name, Shape(2, 4, 777, 1001), D, torch.bfloat16, gqa_kv_heads=2, kernel_options=SM90)
    check_variant(name, Shape(1, 3, 80, 300), D, torch.float16, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("which", ["q", "kv", "v"])
def test_sm90_backward_80_row_steps_for_some_inputs(which):
    """Over 80-row steps with GQA: dQ alone (dK and dV not stored), dK and dV without dQ (nothing staged for the dQ
    warps), dV alone."""
    from test_gpu_backward import Shape, assert_grads_match, fresh_seed, lowp_grads, reference_grads

    seed = fresh_seed()
    s, D, kv_heads = Shape(2, 8, 333, 517), 128, 2
    q = torch.randn(s.B, s.H, s.Lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(s.B, kv_heads, s.Lkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    wanted = {"q": (True, False, False), "kv": (False, True, True), "v": (False, False, True)}[which]
    leaves = [t.clone().requires_grad_(w) for t, w in zip((q, k, v), wanted)]
    flexgen.flex_attention(*leaves, enable_gqa=True, kernel_options=SM90).backward(do)
    ref = reference_grads(q, k, v, do, None, None, 1 / math.sqrt(D), True, [])
    base = lowp_grads(q, k, v, do, None, None, 1 / math.sqrt(D), [])
    for leaf, w, r, b, name in zip(leaves, wanted, ref, base, ("dq", "dk", "dv")):
        if w:
            assert_grads_match([leaf.grad], [r], [b], [name], f"{which} (seed {seed})")
        else:
            assert leaf.grad is None


@gpu
@hopper
@pytest.mark.parametrize("name", ["causal", "document", "sliding_window"])
def test_sm90_backward_balanced_turns_with_a_short_odd_last_round(name):
    """Under a block mask each CTA takes the turns schedule.kv_tile_turns deals. 2 x 8 heads x 9 KV tiles = 144 work
    tiles over 132 CTAs: the second turn has 12, so 120 CTAs end their walk at a -1; with GQA (4 KV heads, 72 work
    tiles) every CTA takes one. The masks weigh the KV tiles unequally, so the CTAs take other tiles than in the
    static walk."""
    from test_gpu_backward import Shape, check_variant

    check_variant(name, Shape(2, 8, 1100, 1100), 128, torch.bfloat16, kernel_options=SM90)
    check_variant(name, Shape(2, 8, 1100, 1100), 64, torch.bfloat16, gqa_kv_heads=4, kernel_options=SM90)


@gpu
@hopper
@pytest.mark.parametrize("D", [64, 128])
def test_sm90_score_mod_called_not_inlined(D):
    """A score_mod reading 128 elements per score (MLA's RoPE term) is called from the kernels
    (codegen/lower.py CALL_ABOVE_LOADS): forward and backward against float64."""
    from test_gpu_backward import Shape, check_variant

    check_variant("rope_dot_causal", Shape(2, 4, 300, 300), D, torch.bfloat16, kernel_options=SM90)


@gpu
@hopper
def test_sm90_backward_in_a_cuda_graph():
    """A training step captured in a CUDA graph: under capture the backward walks its work tiles statically (a graph
    would keep the address of a cached list of turns); replays give eager's gradients, up to the order of the dQ
    reductions."""
    import flexgen

    dev = torch.device("cuda")
    mask = flexgen.create_block_mask(V.causal, None, None, 1500, 1500, device=dev)
    q, k, v = (torch.randn(2, 8, 1500, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 8, 1500, 128, device=dev, dtype=torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        flexgen.flex_attention(q, k, v, block_mask=mask, kernel_options=SM90).backward(do)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph_grads = [t.grad for t in (q, k, v)]  # the replays write these
    for _ in range(2):
        with torch.no_grad():
            for t in (q, k, v, do):
                t.copy_(torch.randn_like(t))
        graph.replay()
        got = [g.clone() for g in graph_grads]
        step()
        for g, want in zip(got, (q.grad, k.grad, v.grad)):
            assert not g.isnan().any()
            torch.testing.assert_close(g, want, rtol=2e-2, atol=2e-2)


@gpu
@hopper
def test_sm90_backward_persistent_option():
    """kernel_options persistent=False: one CTA per KV tile (grid (KV tiles, KV heads, batch))."""
    from test_gpu_backward import Shape, check_variant

    check_variant("causal", Shape(2, 4, 1500, 1500), 64, torch.bfloat16, kernel_options={**SM90, "persistent": False})



@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_dropout_kernels_compile(D):
    """Dropout runs on the sm90 family: the forward scales P by Z / (1 - p) before P V, the backward draws the same Z
    for dV and dP^T (common/philox.cuh); the backward on the two-warpgroup tiles (Philox's state spills 460-600 B on
    the 128-row backward at D = 64), the forward at D = 64 on three warpgroups where no score_mod is beside it. NVRTC 13.5: spill-free
    but for the D = 128 backward (22-46 B; the keep bits of two column groups live through a group's gradient math)
    and the D = 256 forward beside ALiBi (32 B); more is a regression."""
    for name, score, mask in (("none", None, None), ("alibi_causal", V.alibi(4), V.causal)):
        for kind in ("fwd", "bwd"):
            spec = make_spec(kind, score, mask, head_dim=D, dtype="bf16", arch="sm_90a", dropout=True, **SM90)
            # (the D = 64 forward without a score_mod on three warpgroups' 192 rows: families.SM90.FWD_THREE_WG)
            three = kind == "fwd" and D == 64 and score is None
            want = (192, 12) if three else (64 if kind == "bwd" else 128, 8)
            assert (spec.family, spec.block_m, spec.num_warps) == ("sm90", *want)
            kernel = jit.get_kernel(spec)
            assert "dropout_keep_bits" in kernel.source
            assert_tma_fed_and_unserialised(kernel)
            # (D = 256: the backward spill-free, the forward's ALiBi beside Philox's state 32 B)
            limit = 0 if (kind == "fwd" and D < 256) or D == 64 or (kind == "bwd" and D == 256) else 48
            assert kernel.resources.get("spill_stores_bytes", 0) <= limit, f"{kind} {name} D={D}: {kernel.resources}"


@needs_nvrtc
@pytest.mark.usefixtures("isolated_kernel_cache")
@pytest.mark.parametrize("D", [64, 128, 256])
def test_buffer_gradient_kernels_compile(D):
    """Learnable score_mod buffers on the sm90 backward (non-deterministic): score_mod_bwd sums each gradient site
    per thread and every step flushes them, warp-merged (common/grad_flush.j2), over 64-row steps. Spill-free."""
    slopes = V.alibi_slopes(4).requires_grad_()
    table = torch.zeros(4, 2 * 512 - 1, requires_grad=True)
    for score, mask, names in ((V.alibi(slopes), V.causal, ("alibi_slopes",)), (V.relative_bias(table), None, None)):
        names = names or tuple(score.buffer_names)
        spec = make_spec("bwd", score, mask, head_dim=D, dtype="bf16", arch="sm_90a", grad_buffers=names)
        assert (spec.family, spec.block_m) == ("sm90", 64)
        kernel = jit.get_kernel(spec)
        assert "flexgen_grad_add" in kernel.source and "atomicAdd" in kernel.source
        assert_tma_fed_and_unserialised(kernel)
        assert kernel.resources.get("spill_stores_bytes", 0) == 0, f"{names} D={D}: {kernel.resources}"
