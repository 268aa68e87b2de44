"""bench_attention.py times the flexgen package that FLEXGEN_TREE names, in place of this checkout's."""
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PROBE = "import bench_attention, flexgen; print(flexgen.__file__); print(bench_attention.TREE)"


def _run(tree: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FLEXGEN_TREE", "PYTHONPATH")}
    if tree is not None:
        env["FLEXGEN_TREE"] = tree
    return subprocess.run([sys.executable, "-c", PROBE], cwd=BENCHMARKS, env=env, capture_output=True, text=True,
                          timeout=120)


def test_flexgen_tree_selects_the_package_timed(tmp_path):
    (tmp_path / "flexgen").mkdir()
    (tmp_path / "flexgen" / "__init__.py").write_text("__version__ = 'another tree'\n")
    out = _run(str(tmp_path))
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


def test_a_tree_without_flexgen_is_refused(tmp_path):
    out = _run(str(tmp_path))
    assert out.returncode != 0
    assert "holds no flexgen package" in out.stderr
