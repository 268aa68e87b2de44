"""What the sm90 (Hopper) template tests share: the variants they compile on the CPU, and the
markers that keep the GPU tests to a Hopper with NVRTC present."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from flexgen import variants as V

SM90 = {"family": "sm90"}
HAS_NVRTC = importlib.util.find_spec("cupy_backends") is not None
needs_nvrtc = pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed")


def cpu_variants() -> dict:
    doc = torch.zeros(64, dtype=torch.int32)
    return {
        "none": (None, None),
        "causal": (None, V.causal),
        "softcap_causal": (V.softcap(30.0), V.causal),
        "alibi_causal": (V.alibi(4), V.causal),
        "document": (None, V.document(doc)),  # a buffer-reading mask: its bits are evaluated ahead of use
        "relative_bias": (V.relative_bias(torch.randn(4, 63)), None),  # a per-element buffer load in score_mod
    }


def is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper = pytest.mark.skipif(not is_hopper(), reason="the sm90 templates need a Hopper (sm_90) GPU")


# ptxas warnings that leave a kernel correct but slow: C7510 to C7516, the wgmmas serialised (a branch around one,
# accumulators that do not fit, an instruction reading an accumulator still in flight, ...); C7508, setmaxnreg
# ignored.
SLOW_BUILD_WARNINGS = ("C7508", "C7510", "C7511", "C7512", "C7513", "C7514", "C7515", "C7516")


def assert_tma_fed_and_unserialised(kernel) -> None:
    """The sm90 kernels' tiles come by TMA (no per-thread cp.async left), and ptxas kept the wgmma overlap."""
    import re

    assert "cp.async.bulk.tensor.4d" in kernel.ptx, "no TMA tile load in the PTX"
    assert not re.search(r"cp\.async\.(ca|cg)\.", kernel.ptx), "a per-thread cp.async is back in an sm90 kernel"
    log = kernel.meta.get("compiler_log", "")
    found = [w for w in SLOW_BUILD_WARNINGS if w in log]
    assert not found, f"ptxas warned {found}: {log}"
    # The emitted source is read by people: the compiler finds nothing to say about it (an unused name, say).
    assert "warning #" not in log, f"the compiler warned about the emitted source: {log}"
