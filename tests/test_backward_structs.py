"""The three backward kernels render and compile (no GPU needed), without register spills
at the tile configs the planner picks, the host's ctypes mirrors of their params structs
have exactly the size of the kernel's parameter in the PTX, and the sm80 family's shared-memory
estimate (its tile search's measure) is what the compiled kernel exports."""
from __future__ import annotations

import ctypes
import importlib.util
import re

import pytest
import torch

from flexgen import variants as V
from flexgen.arch import shared_memory_limit
from flexgen.cache import jit
from flexgen.cache.ptxas import has_spills
from flexgen.codegen.api import make_spec
from flexgen.codegen.cstruct import pack_mod_args
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.params import BWD_PARAMS, BWD_POST_PARAMS, BWD_PRE_PARAMS
from flexgen.codegen.spec import HEAD_DIMS, dq_fragments, with_dq_layout
from flexgen.runtime import backward as bw, bwd_tiles, families
from flexgen.runtime.kernel_symbols import shared_memory_bytes
from flexgen.runtime.plan import plan

HAS_NVRTC = importlib.util.find_spec("cupy_backends") is not None
pytestmark = [pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed"), pytest.mark.usefixtures("isolated_kernel_cache")]


def _variants():
    """name -> (score Mod or None, mask Mod or None, grad_buffers): CPU tensors are fine, nothing runs."""
    slopes = V.alibi_slopes(4)
    table = torch.randn(4, 63)
    return {
        "none": (None, None, ()),
        "causal": (None, V.causal, ()),
        "sliding_window": (None, V.sliding_window(48), ()),
        "prefix_lm": (None, V.prefix_lm(16), ()),
        "document": (None, V.document(torch.zeros(64, dtype=torch.int32)), ()),
        "softcap_causal": (V.softcap(20.0), V.causal, ()),
        "alibi_learnable": (V.alibi(slopes), V.causal, ("alibi_slopes",)),
        "relative_bias_learnable": (V.relative_bias(table), None, ("rel_bias",)),
    }


def _param_bytes(ptx: str, entry: str) -> int:
    """Size of the kernel's single by-value parameter, from `.param .align A .b8 <entry>_param_0[N]`."""
    m = re.search(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{entry}_param_0\[(\d+)\]", ptx)
    assert m, f"no by-value struct parameter found for {entry} in the PTX"
    return int(m.group(1))


def _mod_args_type(spec, score, mask, grad_buffers):
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    grads = {n: torch.zeros(buffers[n].shape, dtype=torch.float32) for n in grad_buffers}
    return type(pack_mod_args(lower_mods(spec), buffers, params, grads, check_device=False))


def _bwd_spec(score, mask, grad_buffers, head_dim, dtype, arch, deterministic=False, mask_block=None, dropout=False):
    """The sm80 backward as the planner picks it for a flex_attention call."""
    return plan("bwd", arch, head_dim, dtype, score.expr if score else None, mask.expr if mask else None,
                family="sm80", grad_buffers=grad_buffers, deterministic=deterministic, mask_block=mask_block,
                dropout=dropout)


def _fits(spec, kernel=None) -> bool:
    """The tile's shared memory fits the target, and the estimate is what the kernel exports."""
    estimate = families.of(spec).shared_memory_estimate(spec)
    return estimate <= shared_memory_limit(spec.arch) and (kernel is None or shared_memory_bytes(kernel) == estimate)


def _host_params(spec, mod_args_type, dropout=False):
    """The launcher's ctypes mirror of the kernel's BwdParams (with TMA descriptors in the sm90 family's)."""
    return BWD_PARAMS.ctypes_type(mod_args_type, dropout, tensor_maps=families.of(spec).tensor_maps)


@pytest.mark.parametrize("arch,head_dim", [("sm_80", 64), ("sm_90a", 64), ("sm_90a", 128)])
@pytest.mark.parametrize("name", list(_variants()))
def test_bwd_struct_size_and_no_spills(name, arch, head_dim):
    score, mask, grads = _variants()[name]
    spec = _bwd_spec(score, mask, grads, head_dim, "bf16", arch)
    kernel = jit.get_kernel(spec)
    assert not has_spills(kernel.resources), f"{name} on {arch} spills: {kernel.resources}"
    log = kernel.meta.get("compiler_log", "")
    assert "warning #" not in log, f"the compiler warned about the emitted {name} backward: {log}"
    params = _host_params(spec, _mod_args_type(spec, score, mask, grads))
    assert ctypes.sizeof(params) == _param_bytes(kernel.ptx, spec.entry_name)
    assert ctypes.alignment(params) == 8


@pytest.mark.parametrize("arch,dtype", [("sm_80", "fp16"), ("sm_90a", "bf16")])
@pytest.mark.parametrize("head_dim", list(HEAD_DIMS))
def test_bwd_head_dims_compile_without_spills(head_dim, dtype, arch):
    score, mask, grads = _variants()["softcap_causal"]
    spec = _bwd_spec(score, mask, grads, head_dim, dtype, arch)
    kernel = jit.get_kernel(spec)
    res = kernel.resources
    assert not has_spills(res), f"D={head_dim} {dtype} {arch} tile {spec.block_m}x{spec.block_n}: {res}"
    assert _fits(spec, kernel)


@pytest.mark.parametrize("mask_block", [(64, 64), (16, 32), (128, 16)])
def test_bwd_small_mask_blocks_and_deterministic(mask_block):
    """Tiles shrink to divide the mask's blocks; the deterministic variant compiles too."""
    score, mask, grads = _variants()["causal"]
    for det in (False, True):
        spec = _bwd_spec(score, mask, grads, 128, "bf16", "sm_90a", deterministic=det, mask_block=mask_block)
        assert mask_block[0] % spec.block_m == 0 and mask_block[1] % spec.block_n == 0
        kernel = jit.get_kernel(spec)
        assert not has_spills(kernel.resources), f"{mask_block} det={det}: {kernel.resources}"
        params = _host_params(spec, _mod_args_type(spec, score, mask, grads))
        assert ctypes.sizeof(params) == _param_bytes(kernel.ptx, spec.entry_name)


@pytest.mark.parametrize("name,arch,head_dim", [
    ("alibi_learnable", "sm_80", 64), ("alibi_learnable", "sm_90a", 128),
    # one relative-bias kernel: 15 s each here (a warp-wide merge, unrolled, at every score)
    ("relative_bias_learnable", "sm_90a", 128)])
def test_deterministic_buffer_grads_compile_without_spills(name, arch, head_dim):
    """Deterministic mode with buffer gradients: per-warp copies, adds sent out by the whole warp."""
    score, mask, grads = _variants()[name]
    spec = _bwd_spec(score, mask, grads, head_dim, "bf16", arch, deterministic=True)
    kernel = jit.get_kernel(spec)
    assert not has_spills(kernel.resources), f"deterministic {name} D={head_dim} on {arch} spills: {kernel.resources}"
    params = _host_params(spec, _mod_args_type(spec, score, mask, grads))
    assert ctypes.sizeof(params) == _param_bytes(kernel.ptx, spec.entry_name)
    src = kernel.source
    for text in ("long long shift;", "atomicAdd(addr + shift, sum);", "__syncwarp();",
                 "const float dx_any = score_mod_bwd(x, b, h, q_eval, kv_eval, ds, p.mod, grads);",
                 "flexgen_grad_add(grads.addr[k], grads.sum[k], grads.shift)", "__launch_bounds__(NUM_THREADS, 1)"):
        assert text in src, text
    assert "dx = ds != 0.f ? score_mod_bwd(" not in src  # every lane calls it: its flushes are warp-wide


def test_padded_rows_cover_every_backward_tile():
    """lse and delta reach the main kernels padded to ROWS_ALIGN rows per (b, h) (the sm90 backward bulk-copies a
    step's BLOCK_M rows of each: 16-byte aligned, never past the end; the preprocess grid covers the padding): a
    multiple of every backward BLOCK_M the families run and of the preprocess kernel's rows per CTA."""
    assert [bw.padded_rows(n) for n in (0, 1, 127, 128, 129, 1000)] == [0, 128, 128, 128, 256, 1024]
    # the unmasked D = 128 kernel's 80-row steps: a multiple of both
    assert [bw.padded_rows(n, 80) for n in (1, 640, 641, 1000)] == [640, 640, 1280, 1280]
    sm80, sm90 = families.named("sm80"), families.named("sm90")
    rows = {sm90.BWD[0], sm90.BWD_WIDE[0], sm80.PRE_POST[0]} | {tile[0] for _, tile in sm80.BWD + sm80.BWD_LEAN}
    assert all(bw.ROWS_ALIGN % m == 0 for m in rows), rows
    for mask_block in (None, (64, 64), (16, 32), (128, 16), (256, 128)):  # as the planner picks, either family
        for arch, head_dim in (("sm_80", 128), ("sm_90a", 64), ("sm_90a", 128)):
            spec = plan("bwd", arch, head_dim, "bf16", None, V.causal.expr, mask_block=mask_block)
            assert bw.ROWS_ALIGN % spec.block_m == 0, (arch, head_dim, mask_block, spec.family, spec.block_m)


def test_deterministic_grad_copies_bound():
    """Per-warp buffer-gradient copies: fewer splits past DETERMINISTIC_GRAD_BYTES, an error past one split."""
    limit = bw.DETERMINISTIC_GRAD_BYTES
    per_copy = 1024  # floats
    copies = limit // (per_copy * 4) // 3  # three splits fit
    assert bw.deterministic_grad_splits(8, copies, per_copy, ("t",)) == 3
    assert bw.deterministic_grad_splits(2, copies, per_copy, ("t",)) == 2
    assert bw.deterministic_grad_splits(5, 16, 0, ("t",)) == 5  # empty buffers
    with pytest.raises(NotImplementedError, match=r"deterministic.*\(rel_bias\).*DETERMINISTIC_GRAD_BYTES.*'deterministic': False"):
        bw.deterministic_grad_splits(4, 4 * copies, per_copy, ("rel_bias",))


@pytest.mark.parametrize("rows", [1, 2, 5, 7, 64])
def test_ordered_sum_and_buffer_views(rows):
    parts = torch.randn(rows, 10, dtype=torch.float64)
    want = parts.sum(0)
    got = bw._ordered_sum(parts.clone())
    torch.testing.assert_close(got, want)
    # a fixed pairwise order: the same bits on every call
    again = bw._ordered_sum(parts.clone())
    assert torch.equal(got, again)
    buffers = {"a": torch.empty(2, 3), "b": torch.empty(4)}
    va, vb = bw._buffer_views(got, ("a", "b"), buffers)
    assert va.shape == (2, 3) and vb.shape == (4,)
    assert torch.equal(va.reshape(-1), got[:6]) and torch.equal(vb, got[6:10])


@pytest.mark.parametrize("kind", ["bwd_preprocess", "bwd_postprocess"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_pre_post_struct_sizes(kind, head_dim):
    spec = make_spec(kind, None, None, head_dim=head_dim, dtype="fp16", arch="sm_80")
    assert (spec.family, spec.block_m, spec.num_warps) == ("sm80", 64, 4)
    kernel = jit.get_kernel(spec)
    mod_args = type(pack_mod_args(lower_mods(spec), {}, {}))
    params = (BWD_PRE_PARAMS if kind == "bwd_preprocess" else BWD_POST_PARAMS).ctypes_type(mod_args)
    assert ctypes.sizeof(params) == _param_bytes(kernel.ptx, spec.entry_name)
    assert not has_spills(kernel.resources)


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_fragment_order_helpers_compile_and_match_the_struct(head_dim):
    """Where the sm90 backward adds dQ in its fragment order, the preprocess and postprocess kernels are built for that
    layout (the kernel's width and its warpgroups' chunk), compile spill-free and keep the host's struct size."""
    for mask in (None, V.causal.expr):
        bwd = plan("bwd", "sm_90a", head_dim, "bf16", None, mask)
        width = -(-head_dim // 64) * 64
        assert dq_fragments(bwd) == ((head_dim, width // 2, 80) if bwd.block_m == 80 else None)
        assert (bwd.block_m == 80) == (mask is None and width == 128)
        if bwd.block_m == 80:
            _fragment_helpers_compile(bwd, head_dim)


def _fragment_helpers_compile(bwd, head_dim):
    for kind, struct in (("bwd_preprocess", BWD_PRE_PARAMS), ("bwd_postprocess", BWD_POST_PARAMS)):
        helper = with_dq_layout(bwd, make_spec(kind, None, None, head_dim=head_dim, dtype="bf16", arch="sm_90a"))
        assert helper.option("dq_width" if kind == "bwd_preprocess" else "dq_fragments") is not None
        kernel = jit.get_kernel(helper)
        mod_args = type(pack_mod_args(lower_mods(helper), {}, {}))
        assert ctypes.sizeof(struct.ctypes_type(mod_args)) == _param_bytes(kernel.ptx, helper.entry_name)
        assert not has_spills(kernel.resources)


def test_row_order_where_dq_leaves_from_registers():
    """Deterministic mode, D = 256 and the sm80 family add dQ row by row: their helpers stay as they are."""
    for bwd in (plan("bwd", "sm_90a", 128, "bf16", deterministic=True), plan("bwd", "sm_90a", 256, "bf16"),
                plan("bwd", "sm_80", 128, "bf16")):
        assert dq_fragments(bwd) is None
        helper = make_spec("bwd_postprocess", None, None, head_dim=bwd.head_dim, dtype="bf16", arch=bwd.arch)
        assert with_dq_layout(bwd, helper) is helper


def test_source_is_readable():
    """The emitted backward shows the user's expressions and the FlashAttention loop."""
    score, mask, grads = _variants()["alibi_learnable"]
    spec = _bwd_spec(score, mask, grads, 64, "bf16", "sm_90a")
    src = jit.plan(spec)[0]
    for text in ("score_mod_bwd(x, b, h, q_eval, kv_eval, ds, p.mod, grads)", "mask_mod(b, h, q_eval, kv_eval, p.mod)",
                 "grads.add(0, &args.alibi_slopes_grad[", "flexgen_grad_add(grads.addr[k], grads.sum[k])",
                 "dV += P^T dO", "dK += dX^T Q", "dQ[m0 : m0 + BLOCK_M] += dX K"):
        assert text in src
    # without learnable buffers: no gradient slots, the original call
    score, mask, grads = _variants()["softcap_causal"]
    src = jit.plan(_bwd_spec(score, mask, grads, 64, "bf16", "sm_90a"))[0]
    assert "score_mod_bwd(x, b, h, q_eval, kv_eval, ds, p.mod)" in src
    assert "FlexgenGradSlots" not in src and "flexgen_grad_add" not in src


def test_unsupported_head_dim_is_a_clear_error():
    with pytest.raises(ValueError, match="head dim 48"):
        plan("bwd", "sm_90a", 48, "bf16")


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120"])
@pytest.mark.parametrize("head_dim", list(HEAD_DIMS))
def test_tiles_fit_shared_memory(head_dim, arch):
    spec = _bwd_spec(None, None, (), head_dim, "bf16", arch)
    assert _fits(spec)
    assert bwd_tiles.layout_fits(head_dim, spec.block_m, spec.block_n, spec.num_warps)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", ["none", "causal", "alibi_learnable"])
def test_bwd_dropout_struct_size_and_no_spills(name, head_dim, arch):
    score, mask, grads = _variants()[name]
    spec = _bwd_spec(score, mask, grads, head_dim, "bf16", arch, dropout=True)
    kernel = jit.get_kernel(spec)
    assert "dropout_keep_bits" in kernel.source
    assert not has_spills(kernel.resources), f"dropout {name} D={head_dim} on {arch} spills: {kernel.resources}"
    params = _host_params(spec, _mod_args_type(spec, score, mask, grads), True)
    assert ctypes.sizeof(params) == _param_bytes(kernel.ptx, spec.entry_name)
    assert _fits(spec, kernel)


@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_bwd_dropout_other_head_dims(head_dim):
    score, mask, grads = _variants()["alibi_learnable"]
    spec = _bwd_spec(score, mask, grads, head_dim, "bf16", "sm_90a", dropout=True)
    resources = jit.get_kernel(spec).resources
    assert not has_spills(resources), f"dropout D={head_dim} tile {spec.block_m}x{spec.block_n}: {resources}"


def test_tile_overrides_and_warp_layouts():
    """BLOCK_M1 / BLOCK_N1 / num_warps1 reach the config; warps shrink to a layout that gives each
    one whole 16-wide steps and at most 128 registers of dK, dV."""
    spec = plan("bwd", "sm_90a", 128, "bf16", tiles=(("block_m", 64), ("block_n", 64), ("num_warps", 4)))
    assert (spec.family, spec.block_m, spec.block_n, spec.num_warps, spec.num_stages) == ("sm80", 64, 64, 4, 2)
    assert bwd_tiles.warp_layout(128, 64, 128, 8) == (4, 2)  # 32 keys x 32 queries of S^T, 32 keys x 64 of dK, dV
    assert bwd_tiles.warp_layout(128, 16, 32, 8) == (2, 4)   # too few queries: 16-row key groups
    assert not bwd_tiles.layout_fits(128, 16, 32, 8)
    assert _bwd_spec(None, None, (), 128, "bf16", "sm_90a", mask_block=(16, 32)).num_warps == 2
    # 8 warps of a 64 x 256 tile would need 256 registers each for dK and dV: the table's 64 x 64 holds
    spec = _bwd_spec(None, None, (), 256, "bf16", "sm_90a")
    assert 2 * spec.block_n * 256 <= bwd_tiles.MAX_DKV_FLOATS_PER_WARP * spec.num_warps


@pytest.mark.parametrize("options", [{"BLOCK_M1": 48}, {"BLOCK_N1": 8}, {"num_warps1": 3}, {"BLOCK_M1": "x"}])
def test_bad_backward_tile_options_are_clear_errors(options):
    from flexgen.runtime.plan import bwd_tile_overrides

    with pytest.raises(ValueError, match="allowed values"):
        bwd_tile_overrides(options)


def test_transposed_fragment_order_is_read_back_where_it_was_stored():
    """The 80-row kernel stores dQ^T's m64n80 accumulator as float4 i / 4 of thread t at float4 (i / 4) * 128 + t
    (sm90/bwd.cu.j2, store_dq); the postprocess (sm80/bwd_postprocess.cu.j2, block rows 80) reads element (q, d) of a
    chunk at float ((q / 8) * 128 + 32 (d / 16) + 4 (d % 8) + (q % 8) / 2) * 4 + 2 (d / 8 % 2) + q % 2. Every element
    once, each where the accumulator map (wgmma.cuh, wgmma_acc_coord: row d, column q) put it."""
    stored = {}
    for t in range(128):
        warp, lane = t // 32, t % 32
        for i in range(40):
            d = warp * 16 + lane // 4 + (i // 2 % 2) * 8
            q = (i // 4) * 8 + (lane % 4) * 2 + i % 2
            stored[(q, d)] = ((i // 4) * 128 + t) * 4 + i % 4
    assert len(stored) == 80 * 64 and sorted(stored.values()) == list(range(80 * 64))
    for (q, d), at in stored.items():
        d0, e = d - d % 8, d % 8
        read = ((q // 8) * 128 + 32 * (d0 // 16) + (q % 8) // 2) * 4 + 2 * (d0 // 8 % 2) + q % 2 + 16 * e
        assert read == at, (q, d)
