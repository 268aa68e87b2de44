"""The kernels' parameter structs (flexgen/codegen/params.py): the C declaration the templates paste and
the ctypes type the launchers fill come from one field list, and NVRTC lays the C struct out exactly as
ctypes lays out its mirror (every member's offset, the size, the alignment)."""
from __future__ import annotations

import ctypes
import importlib.util
import re

import pytest

from flexgen.codegen.params import DROPOUT, PARAM_STRUCTS
from flexgen.codegen.render import render
from flexgen.runtime import families
from flexgen.runtime.plan import plan

needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")

# A ModArgs with a member of each alignment, so its own offset is checked too.
MOD_ARGS_C = "struct ModArgs { float cap; const float* table; long long stride; int flag; };"


class ModArgs(ctypes.Structure):
    _fields_ = [("cap", ctypes.c_float), ("table", ctypes.c_void_p), ("stride", ctypes.c_int64), ("flag", ctypes.c_int32)]


CASES = [(name, dropout, False) for name in PARAM_STRUCTS
         for dropout in ((False, True) if name in ("FwdParams", "BwdParams") else (False,))]
CASES += [("FwdParams", False, True), ("BwdParams", False, True)]  # the sm90 kernels', with TMA descriptors


def _tensor_map_c() -> str:
    """The TensorMap declaration of templates/sm90/tma.cuh."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "flexgen/templates/sm90/tma.cuh").read_text()
    m = re.search(r"struct __align__\(64\) TensorMap \{[^}]*\};", text)
    assert m, "tma.cuh no longer declares TensorMap"
    return m.group(0)


@needs_nvrtc
@pytest.mark.parametrize("name,dropout,tensor_maps", CASES, ids=str)
def test_c_layout_is_the_ctypes_layout(name, dropout, tensor_maps):
    from flexgen.cache import nvrtc

    struct = PARAM_STRUCTS[name]
    host = struct.ctypes_type(ModArgs, dropout, tensor_maps=tensor_maps)
    members = [n for n, _ in host._fields_ if n != "_tail"]
    assert members[-1] == "mod" and members[:-1] == struct.field_names(dropout, tensor_maps=tensor_maps)
    # (+ 1: a zero-initialised constant has no initializer in the PTX)
    probes = [f'extern "C" __device__ const unsigned long long probe_{n} = __builtin_offsetof({name}, {n}) + 1;'
              for n in members]
    probes += [f'extern "C" __device__ const unsigned long long probe_sizeof = sizeof({name}) + 1;',
               f'extern "C" __device__ const unsigned long long probe_alignof = alignof({name}) + 1;']
    source = "\n".join(["typedef unsigned short half_bits;", _tensor_map_c(), MOD_ARGS_C,
                        struct.declaration(dropout, tensor_maps=tensor_maps), *probes])
    ptx = nvrtc.ptx(source, ["--gpu-architecture=sm_80", "-std=c++17", "-default-device"], name="params.cu")
    device = {m.group(1): int(m.group(2)) - 1 for m in re.finditer(r"probe_(\w+)\s*=\s*(\d+)", ptx)}
    assert {n: device[n] for n in members} == {n: getattr(host, n).offset for n in members}
    # The launch copies sizeof(struct) bytes from the host mirror: the sizes must agree (with descriptors, the
    # mirror's tail pads to the C struct's 64-byte alignment, which ctypes cannot express).
    assert device["sizeof"] == ctypes.sizeof(host)
    assert device["alignof"] == (64 if tensor_maps else ctypes.alignment(host))


def test_dropout_members_come_last_and_only_when_asked():
    for name in ("FwdParams", "BwdParams"):
        struct = PARAM_STRUCTS[name]
        plain, with_dropout = struct.field_names(), struct.field_names(dropout=True)
        assert with_dropout[:len(plain)] == plain and with_dropout[len(plain):][0] == "philox_seed"
        assert "dropout_p" in struct.declaration(True) and "dropout_p" not in struct.declaration(False)
    assert sum(not isinstance(e, str) for e in DROPOUT) == 4


@pytest.mark.parametrize("kind,family,struct", [
    ("fwd", "sm80", "FwdParams"), ("fwd", "sm90", "FwdParams"), ("bwd", "sm80", "BwdParams"),
    ("bwd", "sm90", "BwdParams"), ("bwd_preprocess", "sm80", "BwdPreParams"), ("bwd_postprocess", "sm80", "BwdPostParams"),
])
def test_every_template_declares_its_struct_from_the_list(kind, family, struct):
    for dropout in ((False, True) if family == "sm80" and kind in ("fwd", "bwd") else (False,)):
        source = render(plan(kind, "sm_90a", 128, "bf16", family=family, dropout=dropout))
        assert source.count(f"struct {struct} {{") == 1
        tensor_maps = kind in ("fwd", "bwd") and families.named(family).tensor_maps
        assert PARAM_STRUCTS[struct].declaration(dropout, tensor_maps=tensor_maps) in source
