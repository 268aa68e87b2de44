"""The forward kernels that write max_scores (AuxRequest(max_scores=True)) compile with NVRTC without spills.
Kept apart from tests/test_call_edges.py: importing NVRTC's bindings (cupy, with lazily importing submodules)
before the torch.compile tests of tests/test_compile.py run in the same process upsets dynamo there."""
from __future__ import annotations

import importlib.util

import pytest

import flexgen


@pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")
@pytest.mark.parametrize("family,head_dim,dropout", [("sm80", 64, False), ("sm80", 128, False), ("sm80", 256, False),
                                                     ("sm80", 128, True), ("sm90", 64, False), ("sm90", 128, False)])
def test_max_scores_kernels_compile_without_spills(tmp_path, monkeypatch, family, head_dim, dropout):
    from flexgen.cache import jit
    from flexgen.cache.ptxas import has_spills
    from flexgen.codegen.api import make_spec as emit_spec

    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(tmp_path))
    for var in ("FLEXGEN_TEMPLATE_DIR", "FLEXGEN_NO_JIT", "FLEXGEN_COMPILER", "FLEXGEN_ARCH_LIST"):
        monkeypatch.delenv(var, raising=False)
    spec = emit_spec("fwd", flexgen.variants.softcap(20.0), flexgen.variants.causal, head_dim=head_dim, dtype="bf16",
                     arch="sm_90a", family=family, max_scores=True, dropout=dropout)
    kernel = jit.get_kernel(spec)
    assert kernel.cubin[:4] == b"\x7fELF" and not has_spills(kernel.resources), kernel.resources

