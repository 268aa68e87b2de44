"""`flexgen build` ahead of time, then a training step with FLEXGEN_NO_JIT=1: every kernel the forward
and the backward launch (the backward's pre- and post-processing included) must come from that cache."""
from __future__ import annotations

import textwrap

import pytest
import torch

import flexgen
from flexgen import cli
from flexgen import variants as V
from flexgen.cache import jit

pytestmark = pytest.mark.gpu


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_built_cache_serves_a_training_step(tmp_path, monkeypatch, head_dim):
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("FLEXGEN_NO_JIT", "FLEXGEN_ARCH_LIST", "FLEXGEN_COMPILER", "FLEXGEN_TEMPLATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    jit.clear_memory()
    variants = tmp_path / "train.py"
    variants.write_text(textwrap.dedent(f"""
        from flexgen import variants as V
        VARIANTS = [dict(score_mod=V.softcap(30.0), mask_mod=V.causal, head_dim={head_dim}, kinds=("fwd", "bwd"))]
    """))
    assert cli.main(["build", str(variants), "-j", "4"]) == 0

    jit.clear_memory()
    monkeypatch.setenv("FLEXGEN_NO_JIT", "1")  # a kernel missing from the cache is now an error
    torch.manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    q, k, v = (torch.randn(2, 4, 700, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    score, mask = V.softcap(20.0), V.causal  # another cap: a run-time argument, the same kernels
    block_mask = flexgen.create_block_mask(mask, None, None, 700, 700)
    out = flexgen.flex_attention(q, k, v, score_mod=score, block_mask=block_mask)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = flexgen.reference_attention(*ref, score_mod=score, mask_mod=mask)
    ref_out.backward(grad_out.double())
    assert _relative_error(out, ref_out.detach()) < 2e-2
    for got, want in zip((q.grad, k.grad, v.grad), (r.grad for r in ref)):
        assert torch.isfinite(got).all() and _relative_error(got, want) < 3e-2
