"""The sm_90a wgmma probe (benchmarks/probes/wgmma_probe.py): compiles for sm_90a without
spills and really uses wgmma (CPU); on a Hopper GPU, every shared-memory layout and
descriptor it exercises gives the product torch gives (A @ B.T, P @ V, A.T @ B)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

HAS_NVRTC = importlib.util.find_spec("cupy_backends") is not None
pytestmark = pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed")
gpu = pytest.mark.gpu

PROBE = Path(__file__).resolve().parents[1] / "benchmarks" / "probes" / "wgmma_probe.py"


def _probe(path=PROBE):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def probe():
    return _probe()


@pytest.fixture(scope="module")
def compiled(probe):
    return probe.compile_probe()


def test_compiles_for_sm90a_without_spills(probe, compiled):
    _, log, resources = compiled
    assert set(resources) == {m.entry for m in probe.MODES.values()}
    for entry, r in resources.items():
        assert r["spill_stores_bytes"] == 0 and r["spill_loads_bytes"] == 0, (entry, r)
        assert 0 < r["registers"] <= 128, (entry, r)
    assert "sm_90a" in log


def test_ptx_uses_wgmma(probe):
    ptx = probe.ptx()
    steps = sum(m.k // 16 for m in probe.MODES.values())
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == steps
    for op in ("wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned",
               "fence.proxy.async.shared::cta"):
        assert ptx.count(op) == len(probe.MODES), op
    # swizzle atoms must be 1024-byte aligned (the descriptors' base offset is 0)
    # (two tiles per A @ B.T probe, one (V) per P @ V probe)
    assert ptx.count(".shared .align 1024") == sum(1 if m.pv else 2 for m in probe.MODES.values())


def test_probe_runs_the_kernels_wgmma_wrappers(probe):
    """The probe's products are the kernels' own (sm90/wgmma_mma.j2), not hand-written copies."""
    assert "wgmma.mma_async" not in probe.PROBE_SOURCE.read_text()
    source = probe.source()
    for name in ("probe_mma_ss_first", "probe_mma_ss", "probe_mma_rs", "probe_mma_tt"):
        assert f"void {name}(" in source


@gpu
@pytest.mark.parametrize("name", ["sw128", "sw128-k128", "none", "pv-mn-sw128", "at-mn-sw128"])
def test_wgmma_matches_torch(probe, compiled, name):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("wgmma needs an sm_90 GPU")
    mode = probe.MODES[name]
    for seed in range(3):
        c, ref = probe.run(compiled[0], mode, mode.lbo, mode.sbo, seed)
        err = probe.rel_error(c, ref)
        assert err <= probe.TOLERANCE, f"{name} seed {seed}: max rel error {err:.3e}\n{probe.bad_blocks(c, ref)}"


ISSUE_PROBE = PROBE.with_name("wgmma_issue_probe.py")


def test_issue_probe_compiles_each_case_unserialised():
    """The issue-timing probe (benchmarks/probes/wgmma_issue_probe.py) times what it means to: every case it runs is
    an entry of the cubin, and ptxas kept the products in flight (a serialised build would time the serialisation)."""
    mod = _probe(ISSUE_PROBE)
    out = mod.compile_probe()
    assert "C75" not in out.log, out.log
    for filler, per_group in mod.CONFIGS:
        assert f"Compiling entry function 'wgmma_issue_probe_{filler}_{per_group}'" in out.log
    assert "wgmma.mma_async" not in mod.PROBE_SOURCE.read_text()  # the kernels' own wrappers
