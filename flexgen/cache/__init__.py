"""The kernel cache: content-addressed cubins on disk, an in-memory map in front.

`get_kernel(spec)` is the one entry point the runtime needs; submodules load lazily.
"""
from __future__ import annotations


def get_kernel(spec, template_dir=None, compiler=None):
    """The CompiledKernel for a KernelSpec (memory -> disk -> compile)."""
    from .jit import get_kernel as _get

    globals()["get_kernel"] = _get  # later calls skip this wrapper
    return _get(spec, template_dir, compiler)
