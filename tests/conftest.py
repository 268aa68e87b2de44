import pytest
import torch


def _has_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with compute capability 8.0 or newer; none found")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
