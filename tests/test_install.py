"""What an install promises: the distribution's name and version, the torch floor CI tests, and a
base install (no CUDA extra) that says what to install when it reaches for cupy."""
from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import flexgen

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "flexgen-attention"


def test_installed_distribution_matches_the_package():
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{DISTRIBUTION} is not installed here (the tests run from the source tree)")
    assert dist.version == flexgen.__version__
    assert dist.metadata["License-Expression"] == "Apache-2.0"
    assert "flexgen = flexgen.cli:main" in (dist.read_text("entry_points.txt") or "")


def test_messages_name_the_distribution():
    """No message or doc tells people to install `flexgen` (another project on PyPI)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    wrong = re.compile(r"install\s+['\"]?flexgen(\[|\s|['\"]|$)")
    offenders = [f for f in tracked if Path(ROOT, f).suffix in (".py", ".md", ".toml", ".sh", "")
                 and Path(ROOT, f).is_file() and wrong.search(Path(ROOT, f).read_text(errors="replace"))]
    assert offenders == []


def _without_cupy(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where cupy cannot be imported (a base install)."""
    prelude = "import sys\nfor m in ('cupy', 'cupy.cuda', 'cupy_backends', 'cupy_backends.cuda.libs'):\n    sys.modules[m] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_base_install_says_what_to_install_for_nvrtc():
    proc = _without_cupy("from flexgen.cache import nvrtc\nnvrtc.version()")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("flexgen.cache.errors.CompilerUnavailableError: NVRTC is not available")
    assert "pip install 'flexgen-attention[cuda13]'" in last and "flexgen-attention[cuda12]" in last


def test_base_install_says_what_to_install_to_launch():
    proc = _without_cupy("from flexgen.cache.kernel import _cupy_cuda\n_cupy_cuda()")
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: launching flexgen kernels needs cupy")
    assert "pip install 'flexgen-attention[cuda13]'" in last


def test_base_install_emits_without_cupy():
    proc = _without_cupy("import flexgen\nprint(flexgen.emit(mask_mod='q_idx >= kv_idx', head_dim=64, arch='sm_80')[:200])")
    assert proc.returncode == 0 and "flexgen" in proc.stdout, proc.stderr
