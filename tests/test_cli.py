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
    for spec in expand(load_variants(variants)[0], ["sm_80", "sm_90a"], templates_take_others=True):
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


# ---------------------------------------------------------------- errors: one line, exit 2


@pytest.mark.parametrize("argv,message", [
    (["emit", "--mask", "q_idx >="], "flexgen: line 1, column 9: syntax error"),
    (["emit", "--mask", "q_idx >= kv_idx", "--head-dim", "48"], "head dim 48 is not one of (32, 64, 96, 128, 256)"),
    (["emit", "--kind", "forward"], "flexgen: kernel kind 'forward' is not one of"),
    (["emit", "--file", "/nonexistent/variants.py"], "flexgen: /nonexistent/variants.py: no such file"),
    (["emit", "--arch", "sm_70"], "flexgen: compute capability 7.0 is older than sm_80"),
    (["emit", "--set", "blok_n=32"], "flexgen: unknown option 'blok_n'; did you mean 'block_n'?"),
    (["emit", "--set", "Block_N=32"], "did you mean 'block_n'?"),
    (["emit", "--set", "BLOCK_M1=64"], "flexgen: option BLOCK_M1 sets the backward's (kind bwd) kernel, not a fwd kernel; use BLOCK_M"),
    (["emit", "--kind", "bwd", "--set", "BLOCK_N=64"], "not a bwd kernel; use BLOCK_N1"),
    (["emit", "--set", "BLOCK_N=32", "--set", "block_n=64"], "option block_n is given twice, as BLOCK_N and as block_n"),
    (["emit", "--set", "num_warps=four"], "flexgen: option num_warps must be a positive int, got 'four'"),
    (["emit", "--set", "pingpong=1"], "flexgen: option pingpong must be True or False, got 1"),
    (["emit", "--set", "family=sm100"], "option family must be one of ('sm80', 'sm90')"),
    (["emit", "--set", "BLOCK_N"], "flexgen: --set and --param expect NAME=VALUE, got 'BLOCK_N'"),
    (["cache", "info"], "flexgen: cache info needs a KEY"),
    (["cache", "info", "0123456789abcdef"], "flexgen: 0 entries match '0123456789abcdef'"),
    (["build", "/nonexistent/variants.py", "--arch", "sm_80"], "flexgen: /nonexistent/variants.py: no such file"),
])
def test_mistakes_print_one_clean_line(argv, message, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("flexgen: ") and message in captured.err
    assert captured.err.count("\n") == (3 if "syntax" in message else 1)  # the text form's error points a caret
    assert "Traceback" not in captured.err and "File \"" not in captured.err


@pytest.mark.parametrize("body,message", [
    ("VARIANTS = [dict(mask_mod=undefined_name)]\n", ", line 1: NameError: name 'undefined_name' is not defined"),
    ("x = 1\nVARIANTS = [dict(mask_mod='q_idx >= kv_idx'),\n", ", line 2: SyntaxError"),
    ("VARIANTS = 3\n", ": VARIANTS must be a non-empty list of dicts"),
    ("VARIANTS = [dict(mask_mod='q_idx >= kv_idx', BLOCK_Q=64)]\n", "unknown option 'BLOCK_Q'; did you mean 'BLOCK_N'?"),
    ("VARIANTS = [dict(mask_mod='q_idx >= kv_idx', kinds=('fwd',), BLOCK_N1=64)]\n", "option BLOCK_N1 sets the backward's"),
    ("VARIANTS = [dict(mask_mod='q_idx >', kinds=('fwd',))]\n", "syntax error"),
])
def test_bad_build_files_print_one_clean_line(tmp_path, body, message, capsys):
    bad = write(tmp_path, "bad.py", body)
    assert cli.main(["build", bad, "--arch", "sm_80"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flexgen: ") and message in err and "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="head dim 48"):
        cli.main(["--debug", "emit", "--head-dim", "48"])


def test_internal_errors_say_so(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise AttributeError("a bug")

    monkeypatch.setattr("flexgen.codegen.api.emit", broken)
    assert cli.main(["emit"]) == 1
    assert capsys.readouterr().err == "flexgen: internal error: AttributeError: a bug (rerun with --debug for the traceback)\n"


def test_command_line_exit_status_and_version():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    run = lambda *a: subprocess.run([sys.executable, "-m", "flexgen", *a], capture_output=True, text=True, env=env)  # noqa: E731
    bad = run("emit", "--mask", "q_idx >= kv_idx and")
    assert bad.returncode == 2 and bad.stderr.startswith("flexgen: line 1") and "Traceback" not in bad.stderr
    debug = run("--debug", "emit", "--mask", "q_idx >= kv_idx and")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    import flexgen

    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"flexgen {flexgen.__version__}"


# ---------------------------------------------------------------- --set: PyTorch's names


@pytest.mark.parametrize("kind,torch_names,spec_names", [
    ("fwd", ["BLOCK_M=64", "BLOCK_N=32", "num_warps=4", "num_stages=1"], ["block_m=64", "block_n=32", "num_warps=4", "num_stages=1"]),
    ("bwd", ["BLOCK_M1=32", "BLOCK_N1=64", "num_warps1=4"], ["block_m=32", "block_n=64", "num_warps=4"]),
])
def test_set_honours_pytorch_tile_names(kind, torch_names, spec_names, capsys):
    def emit(names):
        argv = ["emit", "--kind", kind, "--mask", "q_idx >= kv_idx", "--head-dim", "64", "--arch", "sm_80"]
        assert cli.main(argv + [a for n in names for a in ("--set", n)]) == 0
        return capsys.readouterr().out

    default, with_torch_names, with_spec_names = emit([]), emit(torch_names), emit(spec_names)
    assert with_torch_names == with_spec_names != default
    block_n = dict(n.split("=") for n in spec_names)["block_n"]
    assert f"constexpr int BLOCK_N = {block_n};" in with_torch_names


def test_template_dir_options_reach_the_templates(tmp_path, capsys):
    argv = ["emit", "--file", write(tmp_path, "v.py", NODE_VARIANT), "--head-dim", "64", "--arch", "sm_80",
            "--template-dir", FIXTURES, "--set", "tag=from-the-command-line"]
    assert cli.main(argv) == 0
    assert "from-the-command-line" in capsys.readouterr().out


# ---------------------------------------------------------------- build: what a training step needs


def _runtime_specs(monkeypatch, arch, score, mask, head_dim, dtype, mask_block=(128, 128)):
    """The kernels flex_attention's forward and backward ask the cache for, for a query of this head
    dim and dtype on `arch`, with a block mask of mask_block blocks from create_block_mask."""
    import torch

    import flexgen.arch
    from flexgen.runtime.plan import _make_spec_cached, backward_helpers, make_spec

    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: arch)
    _make_spec_cached.cache_clear()  # memoized per device, which here stands for several archs
    query = torch.empty(1, 1, 128, head_dim, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype])
    bwd = make_spec("bwd", query, score, mask, None, mask_block=mask_block, blocks_follow_mask=True)
    return {make_spec("fwd", query, score, mask, None, mask_block=mask_block, blocks_follow_mask=True), bwd,
            *backward_helpers(bwd, query)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90a"])
def test_build_with_a_backward_makes_what_a_training_step_asks_for(tmp_path, monkeypatch, arch):
    from flexgen import variants as V

    variants = write(tmp_path, "train.py", """
        from flexgen import variants as V
        VARIANTS = [dict(name="train", score_mod=V.softcap(30.0), mask_mod=V.causal, head_dims=(64, 128),
                         dtypes=("bf16", "fp16"), kinds=("fwd", "bwd")),
                    dict(name="small blocks", mask_mod=V.causal, head_dim=128, kinds=("fwd", "bwd"), BLOCK_SIZE=64)]
    """)
    train, small = load_variants(variants)
    specs = expand(train, [arch])
    kinds = [s.kind for s in specs]
    assert kinds.count("fwd") == kinds.count("bwd") == kinds.count("bwd_preprocess") == kinds.count("bwd_postprocess") == 4
    for d in (64, 128):
        for dt in ("bf16", "fp16"):
            wanted = _runtime_specs(monkeypatch, arch, V.softcap(30.0), V.causal, d, dt)
            assert wanted == {s for s in specs if s.head_dim == d and s.dtype == dt}
    wanted = _runtime_specs(monkeypatch, arch, None, V.causal, 128, "bf16", mask_block=(64, 64))
    assert wanted == set(expand(small, [arch]))
    assert [s.kind for s in expand(dict(mask_mod="q_idx >= kv_idx", kinds=("fwd",)), [arch])] == ["fwd"]


def test_build_options_split_between_passes(tmp_path):
    variant = dict(mask_mod="q_idx >= kv_idx", kinds=("fwd", "bwd"), head_dim=64, BLOCK_N=32, BLOCK_N1=64,
                   deterministic=True)
    by_kind = {s.kind: s for s in expand(variant, ["sm_80"])}
    assert by_kind["fwd"].block_n == 32 and not by_kind["fwd"].deterministic
    assert by_kind["bwd"].block_n == 64 and by_kind["bwd"].deterministic


@needs_nvrtc
def test_ahead_of_time_cache_serves_a_training_step(tmp_path, monkeypatch, capsys):
    """Every kernel of forward + backward comes from a built cache with FLEXGEN_NO_JIT=1, and the
    progress callback sees each kernel finish."""
    variants = write(tmp_path, "variants.py", NODE_VARIANT + """
VARIANTS = [dict(name="alibi", score_mod=score_mod, mask_mod=mask_mod, head_dim=64, kinds=("fwd", "bwd"))]
""")
    from flexgen.cache.build import build

    seen = []
    result = build(variants, ["sm_80"], jobs=2, template_dir=FIXTURES, log=lambda *a: None,
                   progress=lambda done, total, what: seen.append((done, total)))
    assert result.ok and sorted(s.kind for s, _ in result.built) == ["bwd", "bwd_postprocess", "bwd_preprocess", "fwd"]
    assert seen[-1] == (4, 4) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")
    jit.clear_memory()
    for spec in expand(load_variants(variants)[0], ["sm_80"], templates_take_others=True):
        assert compile_spec(spec, FIXTURES).cubin[:4] == b"\x7fELF"


def test_progress_bar_only_on_a_terminal():
    import io

    from flexgen.cache.build import terminal_progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert terminal_progress(io.StringIO()) is None
    screen = Terminal()
    show = terminal_progress(screen)
    show(1, 4, "nvrtc fwd d=64")
    show(4, 4, "nvrtc bwd d=64")
    assert screen.getvalue() == ("\r\x1b[K[######..................] 1/4 nvrtc fwd d=64"
                                 "\r\x1b[K[########################] 4/4 nvrtc bwd d=64\n")


def test_readme_build_file_example(tmp_path):
    """The build file the README shows loads and expands into the kernels it describes."""
    readme = (HERE.parent / "README.md").read_text()
    example = readme.split("A build file is plain Python")[1].split("```python")[1].split("```")[0]
    variants = load_variants(write(tmp_path, "variants.py", example))
    softcap, window = (expand(v, ["sm_80"]) for v in variants)
    assert sorted(s.kind for s in softcap) == sorted(["fwd", "bwd", "bwd_preprocess", "bwd_postprocess"] * 2)
    assert [(s.kind, s.block_n, s.head_dim) for s in window] == [("fwd", 32, 128)]
