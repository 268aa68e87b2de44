"""Errors of compilation and of the kernel cache."""
from __future__ import annotations


# What a base install (no extra) lacks for compiling with NVRTC and launching: cupy and NVRTC.
CUDA_EXTRA_HINT = ("install the CUDA extra: pip install 'flexgen-attention[cuda13]' (cupy-cuda13x and "
                   "nvidia-cuda-nvrtc; 'flexgen-attention[cuda12]' for a CUDA 12 driver)")


class FlexgenCompileError(RuntimeError):
    """Generated code that the CUDA compiler rejected. The message holds the compiler log
    and the path of the saved source, so the failure can be reproduced by hand."""

    def __init__(self, message: str, log: str = "", source_path: str | None = None):
        super().__init__(message)
        self.log = log
        self.source_path = source_path


class KernelNotCachedError(RuntimeError):
    """FLEXGEN_NO_JIT is set and the requested kernel is not in the cache."""


class CompilerUnavailableError(RuntimeError):
    """The selected compiler backend (NVRTC or nvcc) cannot be found."""


class CompilerFailure(Exception):
    """Internal: a backend's compile failed; carries the log (turned into FlexgenCompileError)."""

    def __init__(self, log: str):
        super().__init__(log)
        self.log = log


class CacheSafetyError(RuntimeError):
    """The cache folder is not one flexgen may read from or write to (see flexgen.cache.safefs)."""


class UnsafeCacheError(CacheSafetyError):
    """A cache folder or file that another user owns or can write, or a symbolic link inside the cache."""


class NotAFlexgenCacheError(CacheSafetyError):
    """FLEXGEN_CACHE_DIR names a folder that flexgen did not create (it holds other files)."""


class LockTimeoutError(TimeoutError):
    """Waited longer than FLEXGEN_LOCK_TIMEOUT for another process's compile lock."""
