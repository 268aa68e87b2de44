"""Compile a call's backward kernels in the background while its forward compiles and runs
(FLEXGEN_BACKGROUND_COMPILE=1; off by default: see docs/host-path.md for what was measured).

A new variant's first training step needs four kernels: the forward, and the backward's main,
pre- and postprocess kernels. Compiled one after the other, the step waits for all four; the
backward's three are known as soon as the forward is called with inputs that need gradients, so
they are handed to a few worker threads then, each of which runs NVRTC in a child process
(cache/nvrtc_child.py): NVRTC on worker threads of the same process was measured slower than no
background compile at all on the H200's host. Only compiling happens there: modules are loaded (on
the launching thread) at the first launch, as for any kernel.

A kernel that fails to compile in the background is not reported there: the backward asks
jit.get_kernel for it again, which compiles it in the foreground and raises the error where it
belongs.
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..cache import paths
from ..dsl.mod import Mod
from .plan import backward_helpers, make_spec

log = logging.getLogger("flexgen.cache")

_submitted: set = set()  # specs handed to the workers
seen: set = set()  # the callers' cheap keys, so a repeated call plans nothing
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=min(3, os.cpu_count() or 1), thread_name_prefix="flexgen-compile")
    return _pool


def _compile_quietly(spec) -> None:
    from ..cache.jit import get_kernel

    try:
        get_kernel(spec, child_process=True)
    except Exception as e:  # the backward compiles it again in the foreground and raises there
        log.debug("background compile of the %s kernel failed: %s", spec.kind, e)


def backward_kernels(call_key, query: torch.Tensor, score: Mod | None, mask: Mod | None,
                     kernel_options: dict | None, dropout: bool, grad_buffers: tuple[str, ...],
                     mask_block: tuple[int, int] | None) -> list[Future]:
    """Start compiling the backward kernels of this call (bwd, bwd_preprocess, bwd_postprocess),
    each at most once per process; returns the futures of those started now. `call_key` (hashable)
    stands for everything the specs depend on: a key seen before returns at once. Planning errors
    are left to the backward itself."""
    if call_key in seen or not paths.background_compile():
        return []
    seen.add(call_key)
    try:
        bwd = make_spec("bwd", query, score, mask, kernel_options, dropout=dropout, grad_buffers=grad_buffers,
                        mask_block=mask_block)
        specs = (bwd, *backward_helpers(bwd, query))
    except Exception:
        return []
    with _lock:
        new = [s for s in specs if s not in _submitted]
        _submitted.update(new)
    return [_executor().submit(_compile_quietly, s) for s in new]
