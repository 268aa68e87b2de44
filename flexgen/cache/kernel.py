"""CompiledKernel: one cached cubin, and the few lines needed to launch it on a GPU.

Launching goes through the CUDA driver API (via cupy): the cubin is loaded once
per device, and a launch passes ONE argument, the kernel's params struct, by value.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from . import store
from .errors import CUDA_EXTRA_HINT


_cupy_cuda_module = None


def _cupy_cuda():
    """cupy.cuda (the driver API flexgen launches through), or an error saying what to install."""
    global _cupy_cuda_module
    if _cupy_cuda_module is None:
        try:
            import cupy.cuda
        except ImportError as e:
            raise ImportError(f"launching flexgen kernels needs cupy ({e}): {CUDA_EXTRA_HINT}") from None
        _cupy_cuda_module = cupy.cuda
    return _cupy_cuda_module

MAX_STATIC_SHARED = 48 * 1024  # above this, dynamic shared memory must be opted into per function
_CU_FUNC_ATTRIBUTE_NUM_REGS = 4
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CompiledKernel:
    def __init__(self, spec, key: str, path: Path, source: str, cubin: bytes, meta: dict, backend):
        self.spec = spec
        self.key = key
        self.path = Path(path)
        self.source = source
        self.cubin = cubin
        self.meta = meta
        self._backend = backend
        self._ptx: str | None = None
        self._functions: dict[int, object] = {}  # device index -> cupy Function (keeps its Module alive)
        self._smem_opt_in: dict[int, int] = {}  # device index -> dynamic shared bytes allowed so far
        self._lock = threading.Lock()

    @property
    def entry_name(self) -> str:
        return self.spec.entry_name

    @property
    def resources(self) -> dict:
        """registers, shared_static_bytes, stack_frame_bytes, spill_stores_bytes, spill_loads_bytes, barriers."""
        return self.meta["resources"]

    def registers(self) -> int:
        """Registers per thread: ptxas's report, or where the compiler gave none (NVRTC, at times, under concurrent
        compiles: resources then holds report_missing) the loaded function's own count, from the driver."""
        count = self.resources.get("registers")
        if count is None:
            count = _cupy_cuda().driver.funcGetAttribute(_CU_FUNC_ATTRIBUTE_NUM_REGS, self.function().ptr)
        return int(count)

    @property
    def flags(self) -> list[str]:
        return self.meta["compiler"]["flags"]

    @property
    def ptx(self) -> str:
        """PTX of the same source, generated on first use and kept next to the cubin (checksummed
        in meta.json, like the cubin) when the cache can be written."""
        if self._ptx is None:
            ptx = store.load_ptx(self.spec.arch, self.key, self.meta)
            if ptx is None:
                ptx = self._backend.ptx(self.source, self.flags)
                self.meta = store.save_ptx(self.spec.arch, self.key, self.meta, ptx)
            self._ptx = ptx
        return self._ptx

    def __repr__(self) -> str:
        return f"CompiledKernel({self.spec.kind}, {self.spec.arch}, key={self.key[:16]}, path={self.path})"

    # ------------------------------------------------------------ GPU side (needs cupy and a device)

    def function(self, device_index: int | None = None):
        """The kernel as a cupy Function on the device; the cubin is loaded once per device."""
        cuda = _cupy_cuda()
        Device, function, runtime = cuda.Device, cuda.function, cuda.runtime

        index = runtime.getDevice() if device_index is None else device_index
        fn = self._functions.get(index)
        if fn is None:
            with self._lock:
                fn = self._functions.get(index)
                if fn is None:
                    with Device(index):
                        module = function.Module()
                        module.load(self.cubin)
                        fn = module.get_function(self.entry_name)
                    self._functions[index] = fn
        return fn

    def launch(self, grid, block, shared_mem: int, stream_ptr: int, params) -> None:
        """Launch on the current device. `params` is the kernel's params struct as a ctypes
        Structure (or bytes), passed by value as the kernel's single argument."""
        if isinstance(params, (bytes, bytearray)):
            params = ctypes.create_string_buffer(bytes(params), len(params))
        self.launch_dim3(dim3(grid), dim3(block), int(shared_mem), int(stream_ptr), params)

    def launch_dim3(self, grid: tuple[int, int, int], block: tuple[int, int, int], shared_mem: int, stream_ptr: int,
                    params: ctypes.Structure) -> None:
        """launch, for a planned call: grid and block as three ints each, params a ctypes Structure."""
        cuda = _cupy_cuda()
        driver = cuda.driver
        index = make_context_current()
        fn = self._functions.get(index) or self.function(index)
        if shared_mem > MAX_STATIC_SHARED and self._smem_opt_in.get(index, 0) < shared_mem:
            driver.funcSetAttribute(fn.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_mem)
            self._smem_opt_in[index] = shared_mem
        arg_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))  # kernelParams: one pointer, to the struct
        driver.launchKernel(fn.ptr, *grid, *block, shared_mem, stream_ptr, ctypes.addressof(arg_ptrs), 0)


def make_context_current() -> int:
    """The current device's index, its primary context (PyTorch's) made current in this thread if none is. The
    driver API works in the calling thread's current context, and a thread that has made no CUDA runtime call yet
    has none: PyTorch's autograd worker, where the backward runs, when nothing before flexgen's first driver call
    touched the device there. cudaSetDevice makes the primary context current."""
    cuda = _cupy_cuda()
    index = cuda.runtime.getDevice()
    if not getattr(_this_thread, "has_context", False):  # (a thread that has a current context keeps one)
        if cuda.driver.ctxGetCurrent() == 0:
            cuda.runtime.setDevice(index)
        _this_thread.has_context = True
    return index


_this_thread = threading.local()


def dim3(d) -> tuple[int, int, int]:
    """A grid or block size (an int or up to three) as three ints."""
    if isinstance(d, int):
        return d, 1, 1
    d = tuple(int(x) for x in d)
    return (d + (1, 1, 1))[:3]
