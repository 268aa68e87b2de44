"""TMA descriptors (CUtensorMap) of the (B, H, L, D) inputs, for kernels whose tiles the copy engine loads
(templates/sm90/tma.cuh).

Each map is encoded by the driver's cuTensorMapEncodeTiled, reached through ctypes in the libcuda that torch
has already loaded: 4 dimensions innermost first (D, L, H, B), byte strides, a box of 64 columns (one
128-byte swizzle panel) by the tile's rows, 128-byte swizzle, zeros for rows past L. Encoding is pure host
work; the last few maps are kept, keyed by everything they depend on, so that a training loop that reuses
its buffers encodes nothing.
"""
from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import torch

from ..cache.kernel import make_context_current

MAP_WORDS = 16  # sizeof(CUtensorMap) / 8
# CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16, _FLOAT32 (the backward's dQ accumulator)
_DTYPES = {torch.float16: 6, torch.bfloat16: 9, torch.float32: 7}
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_INTERLEAVE_NONE = 0
_OOB_FILL_ZEROS = 0
BOX_BYTES = 128  # one 128-byte swizzle panel per row: the widest box row the 128-byte swizzle allows
_CACHED = 64

_lock = threading.Lock()
_encode = None
_cache: OrderedDict[tuple, ctypes.Array] = OrderedDict()


class TensorMapError(RuntimeError):
    pass


def _encoder():
    global _encode
    if _encode is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise TensorMapError(f"the CUDA driver library (libcuda.so.1) could not be loaded: {e}") from None
        fn = lib.cuTensorMapEncodeTiled
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = ctypes.c_int
        _encode = fn
    return _encode


def encode_args(t: torch.Tensor, rows: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(dims, byte strides, box) of the map of `t` (B, H, L, D) with a box of `rows` rows by one 128-byte panel,
    innermost first.

    A dimension of size 1 has no meaningful stride (torch may report any): it gets its inner neighbour's
    extent, which the driver accepts. Broadcast dimensions (stride 0) stay 0."""
    b, h, l, d = t.shape
    elem = t.element_size()
    sb, sh, sl, _ = (s * elem for s in t.stride())
    row_bytes = d * elem
    sl = sl if l > 1 else row_bytes
    sh = sh if h > 1 else sl * l
    sb = sb if b > 1 else sh * h
    return (d, l, h, b), (sl, sh, sb), (BOX_BYTES // elem, rows, 1, 1)


def tile_map(t: torch.Tensor, rows: int) -> ctypes.Array:
    """The TMA descriptor of `t` (B, H, L, D; 16-bit inputs or the fp32 dQ accumulator; last dim contiguous,
    16-byte aligned rows and base: runtime/arguments.kernel_ready) for tiles of `rows` rows."""
    if t.dtype not in _DTYPES:
        raise TensorMapError(f"no TMA data type for {t.dtype}; the kernels take float16 and bfloat16 (and a float32 "
                             "dQ accumulator)")
    # The map is a function of these alone (encode_args), so a hit costs no arithmetic.
    key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), rows)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    dims, strides, box = encode_args(t, rows)
    bad = [s for s in strides if s % 16 or s >= 1 << 40]
    if bad or t.data_ptr() % 16 or t.stride(-1) != 1:
        raise TensorMapError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} cannot be read by the copy "
                             "engine: rows must be contiguous and every stride and the base 16-byte aligned")
    make_context_current()  # (the encoder is a driver call, which needs one)
    out = (ctypes.c_uint64 * MAP_WORDS)()
    rc = _encoder()(
        ctypes.addressof(out), _DTYPES[t.dtype], 4, ctypes.c_void_p(t.data_ptr()),
        (ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*strides), (ctypes.c_uint32 * 4)(*box),
        (ctypes.c_uint32 * 4)(1, 1, 1, 1), _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
    if rc != 0:
        raise TensorMapError(f"cuTensorMapEncodeTiled returned CUDA error {rc} for dims {dims}, byte strides "
                             f"{strides}, box {box}")
    with _lock:
        _cache[key] = out
        if len(_cache) > _CACHED:
            _cache.popitem(last=False)
    return out
