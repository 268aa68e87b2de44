"""The `flexgen` command: emit, build (ahead of time, into the JIT cache), cache ls/info/clear."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flexgen import cli
from flexgen.cache import jit, store
from flexgen.cache.build import expand, load_variants
from flexgen.codegen.api import compile_spec

HERE = Path(__file__).resolve().parent
FIXTURES = str(HERE / "fixtures" / "templates")
needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")

NODE_VARIANT = """
from flexgen.dsl import ir
S, Q, KV = ir.input_("score"), ir.input_("q_idx"), ir.input_("kv_idx")
score_mod = ir.binary("add", S, ir.binary("mul", ir.cast(ir.binary("sub", KV, Q), ir.DType.FLOAT32), ir.param("slope", ir.DType.FLOAT32)))
mask_mod = ir.binary("ge", Q, KV)
"""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(d))
    for var in ("FLEXGEN_TEMPLATE_DIR", "FLEXGEN_NO_JIT", "FLEXGEN_COMPILER", "FLEXGEN_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    jit.clear_memory()
    yield d
    jit.clear_memory()


def write(tmp_path, name, text) -> str:
    f = tmp_path / name
    f.write_text(textwrap.dedent(text))
    return str(f)


def test_emit_from_file_to_output(tmp_path):
    variant = write(tmp_path, "variant.py", NODE_VARIANT)
    out = tmp_path / "k.cu"
    assert cli.main(["emit", "--file", variant, "--head-dim", "64", "--arch", "sm_80", "-o", str(out),
                     "--template-dir", FIXTURES]) == 0
    text = out.read_text()
    assert "// score_mod: score + float32(kv_idx - q_idx) * slope" in text and "// mask_mod: q_idx >= kv_idx" in text


def test_emit_from_text_to_stdout(capsys):
    assert cli.main(["emit", "--score", "cap * tanh(score / cap)", "--param", "cap=30.0", "--mask", "q_idx >= kv_idx",
                     "--kind", "fwd", "--dtype", "fp16", "--template-dir", FIXTURES]) == 0
    text = capsys.readouterr().out
    assert "float cap;" in text and "tanhf(" in text and "// mask_mod: q_idx >= kv_idx" in text


def test_emit_real_template(capsys):
    assert cli.main(["emit", "--mask", "q_idx >= kv_idx", "--head-dim", "128", "--arch", "sm_90a"]) == 0
    text = capsys.readouterr().out
    assert "flexgen_fwd" in text and "mask_mod" in text and "#include" not in text


def test_variants_file_formats(tmp_path):
    listed = write(tmp_path, "listed.py", NODE_VARIANT + """
VARIANTS = [
    dict(name="alibi", score_mod=score_mod, mask_mod=mask_mod, head_dims=(64, 128), kinds=("fwd", "bwd_preprocess")),
    dict(mask_mod="q_idx >= kv_idx", dtypes=("bf16", "fp16"), block_n=32),
]
""")
    variants = load_variants(listed)
    assert [v["name"] for v in variants] == ["alibi", "variant1"]
    specs = [s for v in variants for s in expand(v, ["sm_80", "sm_90a"])]
    assert len(specs) == 2 * 2 * 2 + 2 * 2
    assert {s.block_n for s in specs if s.mask_expr is not None and s.score_expr is None} == {32}
    module_level = write(tmp_path, "mods.py", "from flexgen import score_mod\nscore_mod = score_mod('score * 2.0')\nHEAD_DIMS = (64,)\n")
    (only,) = load_variants(module_level)
    assert only["head_dims"] == (64,) and only["mask_mod"] is None
    nothing = write(tmp_path, "nothing.py", "from flexgen import score_mod, mask_mod\n")
    with pytest.raises(ValueError, match="neither VARIANTS nor"):
        load_variants(nothing)


@needs_nvrtc
def test_build_fills_the_jit_cache(tmp_path, monkeypatch, capsys):
    variants = write(tmp_path, "variants.py", NODE_VARIANT + """
VARIANTS = [dict(name="alibi", score_mod=score_mod, mask_mod=mask_mod, head_dim=64, tag="build")]
""")
    assert cli.main(["build", variants, "--arch", "sm_80,sm_90", "-j", "2", "--template-dir", FIXTURES]) == 0
    assert "built 2, cached 0, failed 0" in capsys.readouterr().out
    assert sorted(e.arch for e in store.entries()) == ["sm_80", "sm_90a"]
    # JIT finds exactly these kernels: no compile allowed
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    for spec in expand(load_variants(variants)[0], ["sm_80", "sm_90a"]):
        kernel = compile_spec(spec, FIXTURES)
        assert kernel.cubin[:4] == b"\x7fELF" and kernel.resources["registers"] > 0
    assert cli.main(["build", variants, "--arch", "sm_80", "--template-dir", FIXTURES]) == 0
    assert "built 0, cached 1" in capsys.readouterr().out


@needs_nvrtc
def test_build_reports_compile_errors(tmp_path, capsys):
    variants = write(tmp_path, "bad.py", "VARIANTS = [dict(mask_mod='q_idx >= kv_idx', head_dim=64, break_it=True)]\n")
    assert cli.main(["build", variants, "--arch", "sm_80", "--template-dir", FIXTURES]) == 1
    out = capsys.readouterr().out
    assert "failed 1" in out and "this line is not C++" in out and "Source saved to:" in out


@needs_nvrtc
def test_cache_commands(tmp_path, capsys):
    variant = write(tmp_path, "variant.py", NODE_VARIANT)
    for arch in ("sm_80", "sm_90a"):
        assert cli.main(["compile", "--file", variant, "--head-dim", "64", "--arch", arch, "--template-dir", FIXTURES]) == 0
    capsys.readouterr()
    assert cli.main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    assert "2 kernel(s)" in out and "score=score + float32(kv_idx - q_idx) * slope" in out
    key = store.entries()[0].key
    assert cli.main(["cache", "info", key[:12]]) == 0
    info = capsys.readouterr().out
    assert key in info and '"registers"' in info and '"cubin_sha256"' in info
    assert cli.main(["cache", "clear", "--arch", "sm_80"]) == 0
    assert "removed 1 kernel(s)" in capsys.readouterr().out
    assert [e.arch for e in store.entries()] == ["sm_90a"]
    assert cli.main(["cache", "size"]) == 0 and str(store.total_size()) != ""
    assert cli.main(["cache", "clear"]) == 0 and store.entries() == []


def test_python_dash_m_flexgen():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "flexgen", "--help"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "emit" in proc.stdout and "build" in proc.stdout and "cache" in proc.stdout
