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
