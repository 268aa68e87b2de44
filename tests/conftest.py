import os

import pytest
import torch
from hypothesis import settings

# CI (.ci/run) loads this profile: the property tests draw the same examples at every run there, so that a CI result
# depends on the code alone; other runs draw fresh ones and keep exploring.
settings.register_profile("ci", derandomize=True)
if os.environ.get("FLEXGEN_HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["FLEXGEN_HYPOTHESIS_PROFILE"])


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with compute capability 8.0 or newer; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


FLEXGEN_ENV = ("FLEXGEN_TEMPLATE_DIR", "FLEXGEN_NO_JIT", "FLEXGEN_COMPILER", "FLEXGEN_ARCH_LIST")


@pytest.fixture
def isolated_kernel_cache(tmp_path_factory, monkeypatch):
    """One scratch kernel cache per test session, and none of the user's flexgen settings."""
    path = tmp_path_factory.getbasetemp() / "flexgen-kernel-cache"
    monkeypatch.setenv("FLEXGEN_CACHE_DIR", str(path))
    for var in FLEXGEN_ENV:
        monkeypatch.delenv(var, raising=False)
    return path


@pytest.fixture(autouse=True)
def no_planned_calls_across_tests():
    """Each test plans its own eager calls (flexgen/eager_plans.py): a plan made under another test's patches
    would otherwise serve a call of the same signature."""
    from flexgen import eager_plans

    eager_plans.clear()
    yield
    eager_plans.clear()
