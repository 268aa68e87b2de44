"""benchmarks/host_ab.sh alternates host_path.py between a base tree and this checkout, each run told its tree by
FLEXGEN_TREE, and keeps only the figures' lines (run here with a stand-in for Python)."""
import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _stand_in(tmp_path) -> Path:
    py = tmp_path / "python"
    py.write_text('#!/usr/bin/env bash\necho "host path on a stand-in"\n'
                  'echo "  flexgen          forward    30.0 / 30.0 tree=$FLEXGEN_TREE script=$1"\n'
                  'echo "  sdpa             forward    18.0 / 18.0"\necho "decoding step"\n')
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def _run(tmp_path, *args):
    env = {**os.environ, "PYTHON": str(_stand_in(tmp_path))}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "host_ab.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_the_trees_alternate_each_round(tmp_path):
    base = tmp_path / "base"
    (base / "flexgen").mkdir(parents=True)
    (base / "flexgen" / "__init__.py").write_text("")
    out = _run(tmp_path, str(base), "2", "0")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [x for x in lines if x.startswith("==")] == ["== base, round 1", "== this, round 1", "== base, round 2",
                                                        "== this, round 2"]
    trees = [x.split("tree=")[1].split()[0] for x in lines if "tree=" in x]
    assert trees == [str(base), str(ROOT)] * 2
    assert all(x.split("script=")[1] == str(ROOT / "benchmarks" / "host_path.py") for x in lines if "script=" in x)
    assert not any("decoding" in x or "stand-in" in x for x in lines)


def test_a_base_without_flexgen_is_refused(tmp_path):
    out = _run(tmp_path, str(tmp_path / "nothing"))
    assert out.returncode != 0 and "holds no flexgen package" in out.stderr
