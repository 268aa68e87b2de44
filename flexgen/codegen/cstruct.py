"""Host side of `struct ModArgs`: a ctypes mirror with the same layout, and packing.

ctypes lays out a Structure with the platform C ABI (natural alignment, padding),
which is also how nvcc/NVRTC lay out a struct passed to a kernel, so the bytes of
an instance are exactly what the generated kernel reads.
"""
from __future__ import annotations

import ctypes
from typing import Mapping

from ..dsl.ir import DType
from .lower import ArgField, LoweredMods

_CTYPES = {
    "int": ctypes.c_int32,
    "unsigned": ctypes.c_uint32,
    "long long": ctypes.c_int64,
    "unsigned long long": ctypes.c_uint64,
    "float": ctypes.c_float,
}


class ModArgsError(ValueError):
    pass


def ctype_of(ctype: str):
    if ctype.endswith("*"):
        return ctypes.c_void_p
    if ctype == "TensorMap":  # templates/sm90/tma.cuh: 128 opaque bytes (aligned by ParamStruct.ctypes_type)
        return ctypes.c_uint64 * 16
    return _CTYPES[ctype]


_STRUCT_CACHE: dict[tuple[tuple[str, str], ...], type] = {}


def struct_class(fields: tuple[ArgField, ...] | list[ArgField], name: str = "ModArgs") -> type[ctypes.Structure]:
    """ctypes.Structure subclass whose layout matches the generated C struct (cached per layout)."""
    layout = tuple((f.name, f.ctype) for f in fields)
    cls = _STRUCT_CACHE.get(layout)
    if cls is None:
        cls = type(name, (ctypes.Structure,), {"_fields_": [(n, ctype_of(t)) for n, t in layout]})
        _STRUCT_CACHE[layout] = cls
    return cls


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _check_tensor(what: str, tensor, want_dtype: str, want_ndim: int, check_device: bool) -> None:
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise ModArgsError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if _dtype_name(tensor) != want_dtype:
        raise ModArgsError(f"{what} has dtype {_dtype_name(tensor)}, but the kernel was generated for {want_dtype}")
    if tensor.dim() != want_ndim:
        raise ModArgsError(f"{what} has {tensor.dim()} dimension(s), but the kernel indexes it with {want_ndim}")
    if check_device and not tensor.is_cuda:
        raise ModArgsError(f"{what} is on {tensor.device}; kernel arguments must live on a CUDA device")


def pack_mod_args(
    lowered: LoweredMods,
    buffers: Mapping[str, object],
    params: Mapping[str, bool | int | float],
    grads: Mapping[str, object] | None = None,
    check_device: bool = True,
) -> ctypes.Structure:
    """Fill a ModArgs instance from tensors and scalar values, checking every one against the spec.

    The tensors must stay alive while a kernel launched with the result runs."""
    grads = grads or {}
    specs = {b.name: b for b in lowered.buffers}
    missing = [n for n in specs if n not in buffers]
    if missing:
        raise ModArgsError(f"no tensor given for buffer(s) {missing}; the variant reads {sorted(specs)}")
    missing = [n for n, _ in lowered.params if n not in params]
    if missing:
        raise ModArgsError(f"no value given for scalar parameter(s) {missing}")
    missing = [n for n in lowered.grad_buffers if n not in grads]
    if missing:
        raise ModArgsError(f"no gradient tensor given for buffer(s) {missing}")
    for name in specs:
        _check_tensor(f"buffer {name!r}", buffers[name], specs[name].dtype, specs[name].ndim, check_device)
    for name in lowered.grad_buffers:
        g, b = grads[name], buffers[name]
        _check_tensor(f"gradient of buffer {name!r}", g, "float32", specs[name].ndim, check_device)
        if tuple(g.shape) != tuple(b.shape):
            raise ModArgsError(f"gradient of buffer {name!r} has shape {tuple(g.shape)}, the buffer {tuple(b.shape)}")
    param_types = dict(lowered.params)

    out = struct_class(lowered.fields)()
    for f in lowered.fields:
        kind = f.source[0]
        if kind == "buffer_ptr":
            value = buffers[f.source[1]].data_ptr()
        elif kind == "buffer_stride":
            value = buffers[f.source[1]].stride(f.source[2])
        elif kind == "grad_ptr":
            value = grads[f.source[1]].data_ptr()
        elif kind == "grad_stride":
            value = grads[f.source[1]].stride(f.source[2])
        elif kind == "param":
            value = _scalar(f.source[1], params[f.source[1]], param_types[f.source[1]])
        else:  # padding
            value = 0
        setattr(out, f.name, value)
    return out


def _scalar(name: str, value, dtype: DType):
    if hasattr(value, "item"):  # a 0-d tensor or numpy scalar
        value = value.item()
    if dtype is DType.FLOAT32:
        return float(value)
    if dtype is DType.BOOL:
        return int(bool(value))
    if isinstance(value, float) and not value.is_integer():
        raise ModArgsError(f"parameter {name!r} is {dtype.value} but got the non-integer value {value}")
    value = int(value)
    bits = 32 if dtype is DType.INT32 else 64
    if not -(2 ** (bits - 1)) <= value < 2 ** (bits - 1):
        raise ModArgsError(f"parameter {name!r} = {value} does not fit in {dtype.value}")
    return value
