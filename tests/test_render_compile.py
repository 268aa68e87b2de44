"""Rendering and compiling: every packaged template compiles with NVRTC (no register spills),
the fixture kernel compiles with each backend, errors are clear, and (on a GPU) it launches."""
from __future__ import annotations

import ctypes
import fnmatch
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import torch

import flexgen
from flexgen import arch as archmod
from flexgen.cache import jit, paths
from flexgen.cache.errors import FlexgenCompileError
from flexgen.cache.ptxas import has_spills, parse_resources
from flexgen.codegen.api import make_spec
from flexgen.codegen.render import TemplateNotFoundError, available_templates, render
from flexgen.codegen.spec import KernelSpec
from flexgen.dsl import ir
from flexgen.dsl.ir import DType

FIXTURES = str(Path(__file__).parent / "fixtures" / "templates")
S, H, Q, KV = (ir.input_(n) for n in ("score", "h", "q_idx", "kv_idx"))
HAS_NVRTC = importlib.util.find_spec("cupy_backends") is not None
needs_nvrtc = pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed")
HAS_DERIVATIVE = importlib.util.find_spec("flexgen.dsl.derivative") is not None


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("flexgen-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(cache_dir, monkeypatch):
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(cache_dir))
    for var in ("FLEXGEN_TEMPLATE_DIR", "FLEXGEN_NO_JIT", "FLEXGEN_COMPILER", "FLEXGEN_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)


def alibi_causal():
    """A typical variant: a per-head linear bias (scalar parameter) and a causal mask."""
    score = ir.binary("add", S, ir.binary("mul", ir.cast(ir.binary("sub", KV, Q), DType.FLOAT32), ir.param("slope", DType.FLOAT32)))
    return score, ir.binary("ge", Q, KV)


# ---------------------------------------------------------------- the real templates


PACKAGED = sorted(t for t in available_templates() if t.split("/")[0] == "sm80")


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("template", PACKAGED or ["(none yet)"])
def test_every_template_compiles_without_spills(template, arch):
    if template == "(none yet)":
        pytest.skip("no packaged templates yet")
    kind = template.split("/")[1].removesuffix(".cu.j2")
    score, mask = alibi_causal()
    if kind == "bwd" and not HAS_DERIVATIVE:
        score = None  # the backward of a score_mod needs flexgen.dsl.derivative
    spec = make_spec(kind, score, mask, head_dim=128, dtype="bf16", arch=arch)
    kernel = jit.get_kernel(spec)
    res = kernel.resources
    assert kernel.cubin[:4] == b"\x7fELF"
    assert res["registers"] > 0
    assert not has_spills(res), f"{template} on {arch} spills registers: {res} (tile {spec.block_m}x{spec.block_n})"


# ---------------------------------------------------------------- the fixture kernel


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_fixture_compiles_with_nvrtc(arch):
    score, mask = alibi_causal()
    k = flexgen.compile("fwd", score, mask, head_dim=64, arch=arch, template_dir=FIXTURES, tag="nvrtc")
    assert k.cubin[:4] == b"\x7fELF" and k.spec.arch == arch
    assert k.resources["registers"] > 0 and not has_spills(k.resources)
    assert k.path.is_dir() and (k.path / "kernel.cubin").read_bytes() == k.cubin
    assert "--gpu-architecture=" + arch in k.flags and "--use_fast_math" not in k.flags
    assert ".entry flexgen_fwd" in k.ptx  # generated on first use...
    assert (k.path / "kernel.ptx").exists()  # ...and kept


@needs_nvrtc
def test_fast_math_and_debug_flags():
    k = flexgen.compile("fwd", head_dim=64, arch="sm_80", template_dir=FIXTURES, fast_math=True, debug=True)
    assert "--use_fast_math" in k.flags and "-lineinfo" in k.flags


@pytest.mark.skipif(paths.nvcc_path() is None, reason="nvcc is not installed")
def test_fixture_compiles_with_nvcc_through_ninja():
    score, mask = alibi_causal()
    k = flexgen.compile("fwd", score, mask, head_dim=64, arch="sm_80", template_dir=FIXTURES, compiler="nvcc", tag="nvcc")
    assert k.cubin[:4] == b"\x7fELF"
    assert k.meta["compiler"]["name"] == "nvcc" and k.resources["registers"] > 0
    assert ".entry flexgen_fwd" in k.ptx


@needs_nvrtc
def test_compile_error_has_log_and_saved_source():
    with pytest.raises(FlexgenCompileError) as err:
        flexgen.compile("fwd", head_dim=64, arch="sm_80", template_dir=FIXTURES, break_it=True)
    msg = str(err.value)
    assert "this line is not C++" in msg and "error" in msg  # the compiler log
    saved = Path(err.value.source_path)
    assert saved.exists() and str(saved) in msg and "this line is not C++" in saved.read_text()


def test_template_tree_holds_only_packaged_files():
    """Everything under flexgen/templates ships with the package (pyproject's package-data), and is a
    template or a header: probes and scratch sources live elsewhere (benchmarks/probes)."""
    root = Path(flexgen.__file__).parent
    project = tomllib.loads((root.parent / "pyproject.toml").read_text())
    globs = [g.replace("**/", "*") for g in project["tool"]["setuptools"]["package-data"]["flexgen"]]
    files = [f.relative_to(root).as_posix() for f in (root / "templates").rglob("*") if f.is_file()]
    files = [f for f in files if "__pycache__" not in f]
    assert files, "no templates found"
    unpackaged = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not unpackaged, f"files under templates/ that the package would not ship: {unpackaged}"
    assert all(f.endswith((".j2", ".cuh")) for f in files), [f for f in files if not f.endswith((".j2", ".cuh"))]


KERNEL_TEMPLATES = ["sm80/fwd.cu.j2", "sm80/bwd.cu.j2", "sm90/fwd.cu.j2", "sm90/bwd.cu.j2"]


@pytest.mark.parametrize("template", KERNEL_TEMPLATES)
def test_kernels_reach_the_variant_only_through_the_common_step(template):
    """The per-element variant step, the mask-bit builder and the tile-kind dispatch live in
    common/variant_step.j2; a kernel template that calls the user's mods itself has grown its own."""
    root = Path(flexgen.__file__).parent / "templates"
    code = "\n".join(line.split("//")[0] for line in (root / template).read_text().splitlines())
    assert '{% import "common/variant_step.j2" as variant %}' in code
    for call in ("score_mod(", "mask_mod(", "score_mod_bwd("):
        assert call not in code, f"{template} calls {call[:-1]} outside common/variant_step.j2"
    for macro in ("variant.mask_bits(", "variant.dispatch_tile(", "variant.fwd_score(" if "fwd" in template
                  else "variant.bwd_prob("):
        assert macro in code, f"{template} does not use {macro[:-1]}"


@pytest.mark.parametrize("template", [t for t in KERNEL_TEMPLATES if t.startswith("sm90/")])
def test_sm90_kernels_take_their_wgmma_from_the_one_emitter(template):
    root = Path(flexgen.__file__).parent / "templates"
    source = (root / template).read_text()
    assert '{% import "sm90/wgmma_mma.j2" as wgmma %}' in source and "wgmma.mma(" in source
    assert "wgmma.mma_async" not in source, f"{template} writes its own wgmma.mma_async"


@pytest.mark.parametrize("family", ["sm80", "sm90"])
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_emitted_kernel_shows_the_users_variant_inline(family, kind):
    """The macros expand into the kernel's own loops: the emitted source calls score_mod and mask_mod
    (a buffer-reading mask: also in the mask-bit builder), and the four kinds of tile are spelled out."""
    score = flexgen.score_mod("score + alibi_slopes[h] * (kv_idx - q_idx)", alibi_slopes=torch.ones(4))
    mask = flexgen.mask_mod("doc_ids[q_idx] == doc_ids[kv_idx]", doc_ids=torch.zeros(64, dtype=torch.int32))
    text = flexgen.emit(kind, score, mask, head_dim=64, arch="sm_90a", family=family)
    assert "// mask_mod: doc_ids[q_idx] == doc_ids[kv_idx]" in text
    body = text[text.index("// ---------------------------------------------------------------- compile-time shape"):]
    body = "\n".join(line.split("//")[0] for line in body.splitlines())  # the code, not its comments
    folded = family == "sm90"  # ALiBi by terms of its own (sm90/fwd.cu.j2's ScoreTerms, sm90/bwd.cu.j2's row and column terms)
    assert len(re.findall(r"\bscore_mod\(x\b", body)) == (0 if folded else 1) and body.count("mask_mod(b, h, ") == 2
    assert body.count("score_mod_affine(b, h, ") == folded
    assert len(re.findall(r"\bscore_mod_bwd\(x\b", body)) == (kind == "bwd" and not folded)
    for kinds in ("<true, true>", "<true, false>", "<false, true>", "<false, false>"):
        assert kinds in body
    assert not re.search(r"\{\{|\{%-?\s|\{#", text), "Jinja syntax left in the emitted source"


def test_missing_template_lists_what_exists():
    with pytest.raises(TemplateNotFoundError, match=r"block_mask.*available templates: .*sm80/fwd.cu.j2"):
        render(KernelSpec(kind="block_mask", arch="sm_80"), template_dir=FIXTURES)


def test_emit_is_readable_source():
    score, mask = alibi_causal()
    text = flexgen.emit("fwd", score, mask, head_dim=64, arch="sm_90a", template_dir=FIXTURES)
    assert "// score_mod: score + float32(kv_idx - q_idx) * slope" in text
    assert "// mask_mod: q_idx >= kv_idx" in text
    assert "float slope;" in text and "#include" not in text
    assert 'extern "C" __global__' in text and "flexgen_fwd" in text


def test_emit_accepts_mods_text_and_callables():
    a = flexgen.emit(score_mod="score * 2.0", head_dim=64, template_dir=FIXTURES)
    b = flexgen.emit(score_mod=lambda score, b, h, q_idx, kv_idx: score * 2.0, head_dim=64, template_dir=FIXTURES)
    c = flexgen.emit(score_mod=flexgen.score_mod("score * 2.0"), head_dim=64, template_dir=FIXTURES, dtype=torch.bfloat16)
    assert a == b == c and "__fmul_rn(score, 2.0f)" in a
    with pytest.raises(TypeError, match="mask_mod was passed as score_mod"):
        flexgen.emit(score_mod=flexgen.mask_mod("q_idx >= kv_idx"), template_dir=FIXTURES)


def test_make_spec_options():
    spec = make_spec("fwd", head_dim=128, dtype=torch.float16, arch="sm_90", block_n=32, deterministic=True, fast_math=True)
    assert spec.arch == "sm_90a" and spec.dtype == "fp16" and spec.block_n == 32 and spec.block_m == 128
    assert spec.deterministic and spec.option("fast_math") is True


def test_parse_resources_multiple_functions():
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Function properties for helper
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Compiling entry function 'other' for 'sm_80'
ptxas info    : Function properties for other
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 1024 bytes smem, 368 bytes cmem[0]
ptxas info    : Compiling entry function 'flexgen_fwd' for 'sm_80'
ptxas info    : Function properties for flexgen_fwd
ptxas         .     48 bytes stack frame, 124 bytes spill stores, 120 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 48 bytes cumulative stack size, 2048 bytes smem, 680 bytes cmem[0]
"""
    r = parse_resources(log, "flexgen_fwd")
    assert r == {"registers": 255, "shared_static_bytes": 2048, "stack_frame_bytes": 48, "spill_stores_bytes": 124,
                 "spill_loads_bytes": 120, "barriers": 1}
    assert parse_resources(log, "other")["shared_static_bytes"] == 1024 and not has_spills(parse_resources(log, "other"))
    with pytest.raises(ValueError, match="no entry function"):
        parse_resources(log, "missing")


# ---------------------------------------------------------------- tiles and architectures


def test_tile_table_and_overrides():
    from flexgen.runtime.plan import plan

    def tile(*args, **kwargs):
        spec = plan(*args, **kwargs)
        return spec.block_m, spec.block_n, spec.num_warps, spec.num_stages

    assert tile("fwd", "sm_80", 64, "bf16") == (128, 64, 4, 2)
    assert tile("fwd", "sm_90a", 128, "bf16", family="sm80") == (128, 64, 4, 1)
    assert tile("fwd", "sm_86", 256, "fp16")[0] == 64
    assert tile("bwd", "sm_90a", 128, "bf16", family="sm80") == (64, 128, 8, 2)
    assert tile("bwd", "sm_80", 128, "bf16")[:2] == (32, 128)  # 64 query rows do not fit sm_80's shared memory
    assert tile("bwd", "sm_90a", 128, "bf16", family="sm80", grad_buffers=("bias",))[1] == 64
    assert tile("fwd", "sm_80", 128, "bf16", tiles=(("block_n", 32),))[1] == 32
    with pytest.raises(TypeError, match="unknown tile field"):
        plan("fwd", "sm_80", 128, "bf16", tiles=(("tile", 3),))


def test_score_mods_with_per_element_loads_take_narrow_forward_tiles():
    import torch

    from flexgen import variants
    from flexgen.codegen.api import make_spec
    from flexgen.dsl.ir import has_positional_loads

    alibi, rel = variants.alibi(4), variants.relative_bias(torch.randn(4, 63))
    assert not has_positional_loads(alibi.expr) and has_positional_loads(rel.expr)
    sm80 = {"family": "sm80"}
    assert make_spec("fwd", alibi, None, head_dim=128, arch="sm_90a", **sm80).block_n == 64  # slopes[h]: one value per head
    assert make_spec("fwd", rel, None, head_dim=128, arch="sm_90a", **sm80).block_n == 32  # a table element per score
    assert make_spec("fwd", rel, None, head_dim=128, arch="sm_90a", block_n=64).block_n == 64  # an explicit choice wins
    # The Hopper forward's narrowest S tile is one m64n64 wgmma.
    assert make_spec("fwd", rel, None, head_dim=128, arch="sm_90a").block_n == 64
    assert make_spec("bwd", rel, None, head_dim=128, arch="sm_90a").block_n == 128


def test_arch_names(monkeypatch):
    assert archmod.normalize("sm_90") == "sm_90a" and archmod.normalize("9.0") == "sm_90a"
    assert archmod.normalize("sm80") == "sm_80" and archmod.normalize(86) == "sm_86" and archmod.normalize((8, 7)) == "sm_86"
    assert archmod.normalize("sm_89") == "sm_89" and archmod.normalize("compute_80") == "sm_80"
    with pytest.raises(archmod.UnsupportedArchError, match="older than sm_80"):
        archmod.normalize("sm_75")
    # Blackwell and later: the GPU's own target runs on later minors of its major; "a" is kept where asked.
    assert archmod.normalize("sm_100") == "sm_100" and archmod.normalize((10, 3)) == "sm_103"
    assert archmod.normalize("sm_100a") == "sm_100a" and archmod.normalize("sm_101a") == "sm_100"
    assert archmod.normalize("12.0") == "sm_120" and archmod.normalize("sm_121") == "sm_121"
    with pytest.raises(archmod.UnsupportedArchError, match="newer than the targets flexgen knows"):
        archmod.normalize("sm_130")
    assert archmod.capability("sm_120a") == (12, 0) and archmod.capability("sm_90a") == (9, 0)
    assert archmod.shared_memory_limit("sm_90a") == archmod.shared_memory_limit("sm_100a") == 227 * 1024
    assert archmod.shared_memory_limit("sm_120") == archmod.shared_memory_limit("sm_86") == 99 * 1024
    monkeypatch.setenv("FLEXGEN_ARCH_LIST", "sm_80, sm_90,sm_90a")
    assert archmod.targets() == ["sm_80", "sm_90a"]
    if not torch.cuda.is_available():
        assert archmod.jit_target() == "sm_80"  # no GPU: the first listed target
        monkeypatch.delenv("FLEXGEN_ARCH_LIST")
        with pytest.raises(archmod.NoDeviceError, match="FLEXGEN_ARCH_LIST"):
            archmod.jit_target()


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_fixture_kernel_launches():
    from flexgen.codegen.cstruct import pack_mod_args
    from flexgen.codegen.lower import lower_mods
    from flexgen.dsl.evaluate import evaluate

    bias_spec = ir.BufferSpec("bias", "bfloat16", 1)
    score = ir.binary("add", ir.binary("mul", S, ir.param("scale", DType.FLOAT32)),
                      ir.load(bias_spec, (ir.binary("mod", ir.binary("sub", Q, KV), ir.const(16)),)))
    mask = ir.binary("ge", ir.binary("floordiv", Q, ir.const(3)), ir.binary("floordiv", KV, ir.const(5)))
    # The fixture directory has sm80 templates only (a missing one would come from the package).
    kernel = flexgen.compile("fwd", score, mask, head_dim=64, template_dir=FIXTURES, family="sm80")
    dev = torch.device("cuda")
    q_len, kv_len = 37, 53
    x = torch.randn(q_len * kv_len, device=dev)
    out = torch.empty_like(x)
    bias = torch.randn(32, device=dev).to(torch.bfloat16)[::2]  # strided
    mods = lower_mods(kernel.spec)
    mod_args = pack_mod_args(mods, {"bias": bias}, {"scale": 0.5})
    params_t = type("FixtureParams", (ctypes.Structure,), {"_fields_": [
        ("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("q_len", ctypes.c_int), ("kv_len", ctypes.c_int),
        ("mod", type(mod_args))]})
    p = params_t(x.data_ptr(), out.data_ptr(), q_len, kv_len, mod_args)
    threads = 128
    blocks = -(-x.numel() // threads)
    stream = torch.cuda.current_stream().cuda_stream
    kernel.launch((blocks, 1, 1), (threads, 1, 1), threads * 4, stream, p)
    kernel.launch(blocks, threads, 64 * 1024, stream, p)  # > 48 KB: the opt-in attribute path
    torch.cuda.synchronize()
    qi = torch.arange(q_len * kv_len, device=dev) // kv_len
    ki = torch.arange(q_len * kv_len, device=dev) % kv_len
    inputs = {"score": x, "b": 0, "h": 0, "q_idx": qi.int(), "kv_idx": ki.int()}
    want = evaluate(score, inputs, {"bias": bias}, {"scale": 0.5}, float_dtype=torch.float32)
    keep = evaluate(mask, inputs, {}, {})
    want = torch.where(keep, want, torch.full_like(want, float("-inf")))
    torch.testing.assert_close(out, want, rtol=0, atol=0)
