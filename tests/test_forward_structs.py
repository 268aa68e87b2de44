"""The forward kernel renders and compiles for every built-in variant (no GPU needed), and the
host's ctypes mirror of FwdParams has exactly the size of the kernel's parameter in the PTX."""
from __future__ import annotations

import ctypes
import importlib.util
import re

import pytest
import torch

from flexgen import and_masks, variants as V
from flexgen.cache import jit
from flexgen.cache.ptxas import has_spills
from flexgen.codegen.api import make_spec
from flexgen.codegen.cstruct import pack_mod_args
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.params import FWD_PARAMS
from flexgen.runtime import families

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed"), pytest.mark.usefixtures("isolated_kernel_cache")]


def _variants():
    doc = torch.zeros(64, dtype=torch.int32)
    return {
        "none": (None, None),
        "causal": (None, V.causal),
        "sliding_window": (None, V.sliding_window(256)),
        "prefix_lm": (None, V.prefix_lm(32)),
        "document": (None, V.document(doc)),
        "alibi_causal": (V.alibi(4), V.causal),
        "softcap_causal": (V.softcap(30.0), V.causal),
        "relative_bias": (V.relative_bias(torch.randn(4, 63)), None),
        "window_and_document": (None, and_masks(V.sliding_window(128), V.document(doc))),
    }


def _param_bytes(ptx: str, entry: str) -> int:
    m = re.search(rf"\.param\s+\.align\s+\d+\s+\.b8\s+{entry}_param_0\[(\d+)\]", ptx)
    assert m, f"no by-value struct parameter found for {entry} in the PTX"
    return int(m.group(1))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("name", list(_variants()))
def test_fwd_compiles_and_struct_matches(name, arch):
    score, mask = _variants()[name]
    # The sm80 family at both targets (tests/test_sm90_forward.py covers the Hopper forward).
    spec = make_spec("fwd", score, mask, head_dim=64, dtype="bf16", arch=arch, family="sm80")
    kernel = jit.get_kernel(spec)
    assert kernel.cubin[:4] == b"\x7fELF"
    # The user's expression is visible in the emitted source.
    for mod in (score, mask):
        if mod is not None:
            assert mod.pretty().split("[")[0][:12] in kernel.source
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    mod_args = pack_mod_args(lower_mods(spec), buffers, params, check_device=False)
    fwd = FWD_PARAMS.ctypes_type(type(mod_args))
    assert ctypes.sizeof(fwd) == _param_bytes(kernel.ptx, spec.entry_name)
    assert not has_spills(kernel.resources), f"{name} on {arch} spills: {kernel.resources}"
    log = kernel.meta.get("compiler_log", "")
    assert "warning #" not in log, f"the compiler warned about the emitted {name} forward: {log}"


@pytest.mark.parametrize("family,dropout", [(None, False), (None, True), ("sm90", False)])
def test_fwd_params_field_offsets_match_the_host_mirror(family, dropout):
    """Every FwdParams field sits at the same offset in the template's struct as in the ctypes mirror
    the launcher fills (a size check alone would miss two swapped fields)."""
    from flexgen.cache import nvrtc
    from flexgen.codegen.render import render

    score, mask = V.alibi(4), V.document(torch.zeros(64, dtype=torch.int32))
    options = {"family": family} if family else {}
    spec = make_spec("fwd", score, mask, head_dim=128, dtype="bf16", arch="sm_90a", dropout=dropout, **options)
    mod_args = pack_mod_args(lower_mods(spec), {**mask.buffers, **score.buffers}, {**mask.params, **score.params},
                             check_device=False)
    host = FWD_PARAMS.ctypes_type(type(mod_args), dropout, tensor_maps=families.of(spec).tensor_maps)
    names = [name for name, _ in host._fields_ if name != "_tail"]
    # (offset + 1: a zero-initialised constant has no initializer in the PTX)
    probe = "\n".join(f'extern "C" __device__ const unsigned long long flexgen_offset_{n} = __builtin_offsetof(FwdParams, {n}) + 1;'
                      for n in names)
    ptx = nvrtc.ptx(render(spec) + "\n" + probe, ["--gpu-architecture=sm_90a", "-std=c++17", "-default-device"])
    for n in names:
        m = re.search(rf"flexgen_offset_{n}\s*=\s*(\d+)", ptx)
        assert m and int(m.group(1)) - 1 == getattr(host, n).offset, (n, m and m.group(1), getattr(host, n).offset)


def test_fwd_head_dims_and_dtypes_compile():
    for head_dim, dtype in ((32, "fp16"), (96, "bf16"), (128, "fp16"), (256, "bf16")):
        spec = make_spec("fwd", V.softcap(20.0), V.causal, head_dim=head_dim, dtype=dtype, arch="sm_80")
        assert jit.get_kernel(spec).resources["registers"] > 0


@pytest.mark.parametrize("head_dim", [96, 128, 256])
@pytest.mark.parametrize("name", list(_variants()))
def test_fwd_larger_head_dims_have_no_spills(name, head_dim):
    # At head_dim 128 the 128 x 64 tile sits at the 255-register limit: buffer-reading masks
    # are evaluated before QK^T and buffer-reading score_mods take 32-column tiles for this.
    score, mask = _variants()[name]
    spec = make_spec("fwd", score, mask, head_dim=head_dim, dtype="bf16", arch="sm_90a", family="sm80")
    resources = jit.get_kernel(spec).resources
    assert not has_spills(resources), f"{name} spills at head_dim {head_dim}: {resources}"


@pytest.mark.parametrize("name", ["none", "causal", "document", "softcap_causal"])
def test_fwd_double_buffered_kv_has_no_spills(name):
    # num_stages=2: K and V double-buffered (kernel_options={"num_stages": 2}).
    score, mask = _variants()[name]
    spec = make_spec("fwd", score, mask, head_dim=128, dtype="bf16", arch="sm_90a", num_stages=2)
    resources = jit.get_kernel(spec).resources
    assert not has_spills(resources), f"{name} with two K/V stages spills: {resources}"


# Dropout kernels (spec.dropout): their own tile (sm80: configs.LEAN_TABLE; sm90: two warpgroups), spill-free at
# every head dim.
DROPOUT_VARIANTS = {"none": (None, None), "causal": (None, V.causal), "alibi_causal": (V.alibi(4), V.causal)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(DROPOUT_VARIANTS))
def test_fwd_dropout_compiles_without_spills(name, head_dim, arch):
    score, mask = DROPOUT_VARIANTS[name]
    spec = make_spec("fwd", score, mask, head_dim=head_dim, dtype="bf16", arch=arch, dropout=True)
    kernel = jit.get_kernel(spec)
    assert "dropout_keep_bits" in kernel.source
    buffers = score.buffers if score else {}
    mod_args = pack_mod_args(lower_mods(spec), buffers, {}, check_device=False)
    maps = families.of(spec).tensor_maps  # (on sm_90a the sm90 forward, which takes TMA descriptors)
    with_dropout = FWD_PARAMS.ctypes_type(type(mod_args), True, tensor_maps=maps)
    assert ctypes.sizeof(with_dropout) == _param_bytes(kernel.ptx, spec.entry_name)
    plain = FWD_PARAMS.ctypes_type(type(mod_args), tensor_maps=maps)
    assert "philox_seed" in dict(with_dropout._fields_) and "philox_seed" not in dict(plain._fields_)
    assert not has_spills(kernel.resources), f"dropout {name} D={head_dim} on {arch} spills: {kernel.resources}"


@pytest.mark.parametrize("family,head_dim,dtype,spill", [
    ("sm80", 32, "fp16", 8), ("sm80", 96, "bf16", 0), ("sm80", 256, "bf16", 0),
    ("sm90", 32, "fp16", 0), ("sm90", 96, "bf16", 0), ("sm90", 256, "bf16", 16)])
def test_fwd_dropout_other_head_dims(family, head_dim, dtype, spill):
    """Both forwards with dropout at other head dims: the sm80 one spill-free but at D = 32, where ptxas has spilled
    8 B of the keep bits' state (168 registers, three CTAs per SM); the sm90 one at D = 256 spills 16 B (O's
    accumulator takes 128 of its 240 registers). More is a regression."""
    spec = make_spec("fwd", V.softcap(20.0), V.causal, head_dim=head_dim, dtype=dtype, arch="sm_90a", dropout=True,
                     family=family)
    assert spec.family == family
    resources = jit.get_kernel(spec).resources
    assert resources.get("spill_stores_bytes", 0) <= spill, f"dropout D={head_dim}: {resources}"


@pytest.mark.parametrize(
    "head_dim,config",
    [(64, {}), (96, {}), (128, {"num_stages": 2}), (256, {}), (128, {"block_m": 64, "block_n": 32, "num_warps": 4})],
    ids=str,
)
def test_fwd_launcher_reads_shared_memory_from_the_kernel(head_dim, config):
    # The kernel traps when given less than its layout needs; the launcher reads the size the kernel exports
    # from its cubin, the same number its PTX shows.
    from flexgen.runtime.kernel_symbols import shared_memory_bytes

    spec = make_spec("fwd", None, V.document(torch.zeros(8, dtype=torch.int32)), head_dim=head_dim, dtype="bf16",
                     arch="sm_90a", family="sm80", **config)
    kernel = jit.get_kernel(spec)
    m = re.search(r"flexgen_fwd_smem_bytes\s*=\s*(\d+)", kernel.ptx)
    assert m, "the kernel no longer exports flexgen_fwd_smem_bytes"
    # Q, both K/V stages and one mask bit per element of S per thread: at least the tiles themselves.
    stages = 2 if spec.num_stages >= 2 else 1
    assert int(m.group(1)) == shared_memory_bytes(kernel) >= (spec.block_m + 2 * stages * spec.block_n) * head_dim * 2
