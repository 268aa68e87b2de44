"""Deep and large expressions: every pass is linear in the expression's size (no recursion, shared
subexpressions stay shared), and past ir.MAX_NODES a clear error says what the limit is."""
import time
import tracemalloc

import pytest
import torch

import flexgen
from flexgen.codegen.lower import LoweringError, lower_mods
from flexgen.codegen.spec import KernelSpec
from flexgen.dsl import ir
from flexgen.dsl.errors import FlexgenTraceError


def deep_score(depth: int):
    def score_mod(score, b, h, q_idx, kv_idx):
        s = score
        for _ in range(depth):  # every level uses the previous one twice (through tanh and its derivative)
            s = torch.tanh(s) * 1.01 + 0.1
        return s

    return score_mod


def test_text_chain_of_500_operations_parses_evaluates_and_emits():
    mod = flexgen.mask_mod("q_idx" + " + 1" * 500 + " > kv_idx")
    kv = torch.arange(495, 505, dtype=torch.int32)
    assert mod.evaluate(q_idx=torch.tensor(0, dtype=torch.int32), kv_idx=kv).tolist() == (kv < 500).tolist()
    src = flexgen.emit("fwd", mask_mod=mod, head_dim=64)
    assert "mask_mod" in src and src.count("\n") < 2000
    score = flexgen.score_mod("score" + " * 1.01 + 0.5" * 300)
    assert "score_mod" in flexgen.emit("fwd", score_mod=score, head_dim=64)


def test_1000_deep_score_mod_forward_and_backward_emit_in_linear_memory():
    mod = flexgen.score_mod(deep_score(1000))
    start = time.perf_counter()
    tracemalloc.start()
    try:
        fwd = flexgen.emit("fwd", score_mod=mod, head_dim=64)
        bwd = flexgen.emit("bwd", score_mod=mod, head_dim=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200e6, f"{peak / 1e6:.0f} MB"
    assert time.perf_counter() - start < 60
    assert len(bwd) < 2e6 and "score_mod_bwd" in bwd and "fg_tanh" in fwd
    # no line is a 1000-deep C expression: long expressions are split into named temporaries
    assert max(len(line) for line in bwd.splitlines() if not line.lstrip().startswith("//")) < 1000


def test_expressions_past_the_size_limit_are_refused_clearly():
    with pytest.raises(FlexgenTraceError, match=f"at most {ir.MAX_NODES}"):
        flexgen.score_mod(deep_score(ir.MAX_NODES // 3 + 10))
    with pytest.raises(FlexgenTraceError, match=f"at most {ir.MAX_NODES}"):
        flexgen.mask_mod("q_idx" + " + kv_idx" * (ir.MAX_NODES + 10) + " > 0")
    big = ir.input_("kv_idx")
    for k in range(ir.MAX_NODES):  # IR built by hand, not traced: refused when lowered
        big = ir.binary("add", big, ir.const(k))
    with pytest.raises(LoweringError, match=f"mask_mod has {2 * ir.MAX_NODES + 2} distinct operations.*at most {ir.MAX_NODES}"):
        lower_mods(KernelSpec(kind="fwd", mask_expr=ir.binary("gt", big, ir.const(0))))


def test_shared_subexpressions_do_not_blow_up_the_comments():
    def doubling(score, b, h, q_idx, kv_idx):
        s = score
        for _ in range(60):  # written out as text, 2**60 copies of score
            s = s * s + 0.5
        return s

    src = flexgen.emit("bwd", score_mod=flexgen.score_mod(doubling), head_dim=64)
    assert len(src) < 1e6 and "score_mod_bwd" in src
