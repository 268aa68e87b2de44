"""A kernel's registers per thread, which the launch planning reads (families.ctas_per_sm): ptxas's report where the
compiler gave one, else the loaded function's count from the driver, so that a missing report (NVRTC, at times,
under concurrent compiles) costs nothing but a lookup."""
from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flexgen.cache import jit
from flexgen.cache import kernel as kernel_mod
from flexgen.cache.kernel import CompiledKernel

gpu = pytest.mark.gpu


def _kernel(resources: dict) -> CompiledKernel:
    meta = {"resources": resources, "compiler": {"flags": []}}
    return CompiledKernel(SimpleNamespace(entry_name="flexgen_fwd", arch="sm_90a"), "k" * 64, Path("/nonexistent"),
                          "", b"", meta, backend=None)


def test_registers_come_from_the_report_without_touching_the_driver(monkeypatch):
    monkeypatch.setattr(kernel_mod, "_cupy_cuda", lambda: pytest.fail("the driver was asked"))
    assert _kernel({"registers": 168, "spill_stores_bytes": 0}).registers() == 168


def test_registers_without_a_report_come_from_the_loaded_function(monkeypatch):
    asked = []

    def get_attribute(attribute, function_ptr):
        asked.append((attribute, function_ptr))
        return 96

    monkeypatch.setattr(kernel_mod, "_cupy_cuda", lambda: SimpleNamespace(driver=SimpleNamespace(
        funcGetAttribute=get_attribute)))
    kernel = _kernel({"report_missing": True})
    monkeypatch.setattr(kernel, "function", lambda device_index=None: SimpleNamespace(ptr=0xBEEF))
    assert kernel.registers() == 96
    assert asked == [(4, 0xBEEF)]  # CU_FUNC_ATTRIBUTE_NUM_REGS of that function


def test_a_compile_log_without_a_report_is_noted_not_fatal():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resources = jit._resources_or_note("", "flexgen_fwd")
    assert resources == {"report_missing": True}
    assert any("no ptxas resource report for flexgen_fwd" in str(w.message) for w in caught)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_drivers_count_is_the_reports(monkeypatch):
    """On a GPU both sources agree (where the compiler reported), and the launch planning takes the driver's where
    the report is missing."""
    from flexgen.codegen.api import make_spec
    from flexgen.runtime import families

    spec = make_spec("fwd", None, None, head_dim=64, dtype="bf16", arch=None, family="sm80")
    kernel = jit.get_kernel(spec)
    from_driver = kernel_mod._cupy_cuda().driver.funcGetAttribute(4, kernel.function().ptr)
    if "registers" in kernel.resources:
        assert kernel.registers() == kernel.resources["registers"] == from_driver
    planned = families.ctas_per_sm(spec)
    monkeypatch.setitem(kernel.meta, "resources", {"report_missing": True})
    assert kernel.registers() == from_driver
    assert families.ctas_per_sm(spec) == planned
