"""What the kernel cache tells the user: a log line for each compile (logger "flexgen.cache", INFO:
which kernel and template, for which GPU arch, how long), and one warning per process when compiled
kernels cannot be saved (a read-only or full cache): they are then kept in memory."""
from __future__ import annotations

import logging
import warnings

from . import paths

log = logging.getLogger("flexgen.cache")
_unsaved_warned = False


def _kernel(spec, key: str) -> str:
    from ..codegen.render import template_name

    return (f"{spec.kind} kernel {template_name(spec)} (head_dim={spec.head_dim}, {spec.dtype}, key {key[:16]}) "
            f"for {spec.arch}")


def compiling(spec, key: str, backend) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("compiling %s with %s", _kernel(spec, key), backend.NAME)


def compiled(spec, key: str, backend, seconds: float) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("compiled %s with %s in %.2f s", _kernel(spec, key), backend.NAME, seconds)


def not_saved(error: Exception) -> None:
    """Warn, once per process, that a compiled kernel could not be written to the cache."""
    global _unsaved_warned
    if _unsaved_warned:
        return
    _unsaved_warned = True
    warnings.warn(f"flexgen: cannot save compiled kernels in the cache {paths.cache_root()} ({error}); this process "
                  "keeps them in memory, and later processes compile them again. Make the folder writable, free "
                  "some space, or set FLEXGEN_CACHE_DIR to another folder.", stacklevel=5)
