"""TMA descriptors (CUtensorMap) of the (B, H, L, D) inputs, for kernels whose tiles the copy engine loads
(templates/sm90/tma.cuh).

Each map is encoded by the driver's cuTensorMapEncodeTiled, reached through ctypes in the libcuda that torch
has already loaded: 4 dimensions innermost first (D, L, H, B), byte strides, a box of 64 columns (one
128-byte swizzle panel) by the tile's rows, 128-byte swizzle, zeros for rows past L. Encoding is pure host
work; the maps of the last few addresses of each of the last few layouts are kept, so that a training loop that
reuses its buffers encodes nothing.
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
_layouts: "OrderedDict[tuple, MapLayout]" = OrderedDict()
_ADDRESSES = 16  # maps kept per layout: a call's inputs and output, and the next call's output


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
    return map_layout(t, rows).at(t.data_ptr())


def map_layout(t: torch.Tensor, rows: int) -> "MapLayout":
    """The MapLayout of `t`'s layout (kept for the last few layouts: a map is a function of the layout and the
    address alone, encode_args)."""
    key = (t.dtype, tuple(t.shape), t.stride(), rows)
    with _lock:
        hit = _layouts.get(key)
        if hit is not None:
            _layouts.move_to_end(key)
            return hit
    made = MapLayout(t, rows)
    with _lock:
        _layouts[key] = made
        if len(_layouts) > _CACHED:
            _layouts.popitem(last=False)
    return made


class MapLayout:
    """Everything a tensor's map depends on but its address, checked and converted once, with the maps of the
    last few addresses: a planned launch (runtime/forward.ForwardLaunch) looks up or encodes the maps of its
    tensors without working out their layout again."""

    __slots__ = ("dtype", "args", "_by_address")

    def __init__(self, t: torch.Tensor, rows: int):
        if t.dtype not in _DTYPES:
            raise TensorMapError(f"no TMA data type for {t.dtype}; the kernels take float16 and bfloat16 (and a "
                                 "float32 dQ accumulator)")
        dims, strides, box = encode_args(t, rows)
        bad = [s for s in strides if s % 16 or s >= 1 << 40]
        if bad or t.stride(-1) != 1:  # (the base address is checked where a map is encoded for it)
            raise TensorMapError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} cannot be read by the "
                                 "copy engine: rows must be contiguous and every stride and the base 16-byte aligned")
        self.dtype = _DTYPES[t.dtype]
        self.args = ((ctypes.c_uint64 * 4)(*dims), (ctypes.c_uint64 * 3)(*strides), (ctypes.c_uint32 * 4)(*box),
                     (ctypes.c_uint32 * 4)(1, 1, 1, 1))
        self._by_address: dict[int, ctypes.Array] = {}

    def at(self, address: int) -> ctypes.Array:
        """The map of this layout at `address` (16-byte aligned, as the tensor the layout was made from)."""
        hit = self._by_address.get(address)
        if hit is not None:
            return hit
        out = self._encode(address)
        if len(self._by_address) >= _ADDRESSES:
            self._by_address.clear()
        self._by_address[address] = out
        return out

    def _encode(self, address: int) -> ctypes.Array:
        if address % 16:
            raise TensorMapError(f"a tensor at address {address:#x} cannot be read by the copy engine: its base must "
                                 "be 16-byte aligned")
        make_context_current()  # (the encoder is a driver call, which needs one)
        out = (ctypes.c_uint64 * MAP_WORDS)()
        dims, strides, box, element_strides = self.args
        rc = _encoder()(ctypes.addressof(out), self.dtype, 4, ctypes.c_void_p(address), dims, strides, box,
                        element_strides, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZEROS)
        if rc != 0:
            raise TensorMapError(f"cuTensorMapEncodeTiled returned CUDA error {rc} for dims {tuple(dims)}, byte "
                                 f"strides {tuple(strides)}, box {tuple(box)}")
        return out
