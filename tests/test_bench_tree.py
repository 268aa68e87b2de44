"""The benchmarks that time flexgen (bench_attention.py, host_path.py, host_pieces.py) time the package that
FLEXGEN_TREE names, in place of this checkout's."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = ["bench_attention", "host_path", "host_pieces"]


def _run(tree: str | None, script: str = "bench_attention") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXGEN_TREE", "PYTHONPATH")}
    if tree is not None:
        env["FLEXGEN_TREE"] = tree
    probe = f"import {script}, flexgen; print(flexgen.__file__); print({script}.TREE)"
    return subprocess.run([sys.executable, "-c", probe], cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_flexgen_tree_selects_the_package_timed(tmp_path, script):
    (tmp_path / "flexgen").mkdir()
    (tmp_path / "flexgen" / "__init__.py").write_text("__version__ = 'another tree'\n")
    out = _run(str(tmp_path), script)
    assert out.returncode == 0, out.stderr
    package, tree = out.stdout.split()
    assert Path(package) == tmp_path / "flexgen" / "__init__.py"
    assert Path(tree) == tmp_path


def test_without_flexgen_tree_the_checkout_is_timed():
    out = _run(None)
    assert out.returncode == 0, out.stderr
    package, tree = out.stdout.split()
    assert Path(package) == BENCHMARKS.parent / "flexgen" / "__init__.py"
    assert Path(tree) == BENCHMARKS.parent


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_tree_without_flexgen_is_refused(tmp_path, script):
    out = _run(str(tmp_path), script)
    assert out.returncode != 0
    assert f"{script}: FLEXGEN_TREE=" in out.stderr and "holds no flexgen package" in out.stderr
