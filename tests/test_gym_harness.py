"""benchmarks/gym_tests.sh and benchmarks/gym_check.py on a stand-in attention-gym checkout: the package's own
__init__ (which imports its Triton and CuTe kernels) is left out, and every flex_attention import points at flexgen."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _gym_check():
    """benchmarks/gym_check.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("gym_check", BENCH / "gym_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gym_check_imports_masks_without_the_package_init(tmp_path):
    gym_check = _gym_check()
    saved = {name: module for name, module in sys.modules.items() if name.startswith("attn_gym")}
    try:
        masks, mods = gym_check.import_gym(_checkout(tmp_path))
        assert masks.generate_sliding_window(2).__name__ == "sliding_2"
    finally:
        for name in [n for n in sys.modules if n.startswith("attn_gym")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_gym_check_dense_reference_is_pytorchs_flex_attention():
    """gym_check --grad's gradient reference (PyTorch's flex_attention has no backward on the CPU): its forward
    is PyTorch's flex_attention in float64, a row that sees nothing included, and it has gradients."""
    import torch
    from torch.nn.attention import flex_attention as torch_flex

    gym_check = _gym_check()
    slopes = torch.rand(3, dtype=torch.float64)

    def score(s, b, h, q_idx, kv_idx):
        return s + slopes[h] * (kv_idx - q_idx)

    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx != 5)  # row 5 sees nothing

    q, k, v = (torch.randn(2, 3, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = torch_flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=score,
                                     block_mask=torch_flex.create_block_mask(mask, 2, 3, 40, 40, device="cpu"))
    got = gym_check.dense_attention(q, k, v, score, mask)
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=1e-12)
    assert torch.count_nonzero(got[:, :, 5]) == 0
    got.square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gym_check_names_the_call_that_raised():
    """A case whose call raises is reported with the call's name (the float64 reference, PyTorch's or flexgen's run)
    and the original error as its cause, not as an anonymous failure."""
    gym_check = _gym_check()

    def refuse(x):
        raise ValueError(f"cannot take {x}")

    with pytest.raises(gym_check.StageFailed) as raised:
        gym_check.at_stage("flexgen compiled", refuse, 3)
    assert raised.value.stage == "flexgen compiled"
    assert isinstance(raised.value.__cause__, ValueError) and "cannot take 3" in str(raised.value.__cause__)
    assert gym_check.at_stage("float64 reference", lambda x: x + 1, 3) == 4


@pytest.mark.filterwarnings("ignore")
def test_gym_check_runs_a_case_at_the_head_dim_asked_for(monkeypatch):
    """--head-dim sets the head dim of q, k and v (the kernels differ by head dim: 80-row backward steps at 96 / 128)."""
    import torch

    gym_check = _gym_check()
    seen = []
    original = gym_check.flexgen.flex_attention

    def spy(q, *args, **kwargs):
        seen.append(q.shape[-1])
        return original(q, *args, **kwargs)

    monkeypatch.setattr(gym_check.flexgen, "flex_attention", spy)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ok, line = gym_check.run("causal", {"mask": causal}, (40, 40), torch.float64, torch.device("cpu"), head_dim=24)
    assert ok, line
    assert seen and set(seen) == {24}
