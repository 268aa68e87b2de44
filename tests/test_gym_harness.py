"""benchmarks/gym_tests.sh and benchmarks/gym_check.py on a stand-in attention-gym checkout: the package's own
__init__ (which imports its Triton and CuTe kernels) is left out, and every flex_attention import points at flexgen."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

MASKS = '''from torch.nn.attention.flex_attention import _mask_mod_signature, or_masks


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window: int) -> _mask_mod_signature:
    def sliding(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    mask = or_masks(causal_mask, sliding)
    mask.__name__ = f"sliding_{window}"
    return mask
'''

TEST = '''import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attn_gym.masks as masks


def test_the_mask_runs_on_flexgen():
    assert flex_attention.__module__.startswith("flexgen")
    mask = masks.generate_sliding_window(3)
    assert mask.__name__ == "sliding_3"
    q = torch.randn(1, 2, 32, 16, dtype=torch.float64)
    block_mask = create_block_mask(masks.causal_mask, None, None, 32, 32, device="cpu")
    assert not flex_attention(q, q, q, block_mask=block_mask).isnan().any()


def test_a_failure_is_counted():
    assert False
'''


def _checkout(root: Path) -> Path:
    gym = root / "attention-gym"
    for package in ("attn_gym", "attn_gym/masks", "attn_gym/mods"):
        (gym / package).mkdir(parents=True)
    (gym / "attn_gym/__init__.py").write_text('raise ImportError("needs its kernels")\n')
    (gym / "attn_gym/masks/__init__.py").write_text(MASKS)
    (gym / "attn_gym/mods/__init__.py").write_text("")
    (gym / "attn_gym/utils.py").write_text("")
    (gym / "test").mkdir()
    (gym / "test/test_mods.py").write_text(TEST)
    (gym / "test/test_kda.py").write_text("def test_not_copied():\n    assert False\n")
    return gym


def test_gym_tests_runs_the_copied_tests_against_flexgen(tmp_path):
    gym, out = _checkout(tmp_path), tmp_path / "out"
    run = subprocess.run(["bash", str(BENCH / "gym_tests.sh"), str(gym), str(out), "-p", "no:cacheprovider"],
                         capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 1, run.stdout + run.stderr  # (one test fails on purpose)
    assert (out / "summary.txt").read_text().splitlines()[0] == "passed 1, failed 1, skipped 0"
    assert not (out / "test/test_kda.py").exists()
    assert "from flexgen import _mask_mod_signature, or_masks" in (out / "attn_gym/masks/__init__.py").read_text()


def test_gym_check_imports_masks_without_the_package_init(tmp_path):
    spec = importlib.util.spec_from_file_location("gym_check", BENCH / "gym_check.py")
    gym_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gym_check)
    saved = {name: module for name, module in sys.modules.items() if name.startswith("attn_gym")}
    try:
        masks, mods = gym_check.import_gym(_checkout(tmp_path))
        assert masks.generate_sliding_window(2).__name__ == "sliding_2"
    finally:
        for name in [n for n in sys.modules if n.startswith("attn_gym")]:
            del sys.modules[name]
        sys.modules.update(saved)
