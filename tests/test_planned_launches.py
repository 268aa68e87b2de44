"""The planned launch objects (runtime/forward.ForwardLaunch, runtime/backward.BackwardLaunch) run on the CPU with
the device's pieces stubbed: the kernels record the parameter struct each launch hands them, and tensor maps
encode the address they are made for. Each run must allocate fresh outputs in the layout PyTorch gives (the
query's dimension order; dK and dV in key's and value's), and hand the kernels this run's addresses, never those a
layout worked out at the first run remembered."""
from __future__ import annotations

import contextlib
import ctypes
import types

import pytest
import torch

from flexgen import variants as V
from flexgen.runtime import backward as bw, families, forward as fw
from flexgen.runtime.call_checks import empty_like_layout

B, H, L, D = 2, 2, 256, 64


class RecordingKernel:
    """Records (params type, a copy of the params' bytes, grid, threads, shared memory, stream) per launch."""

    def __init__(self, log, kind):
        self.log, self.kind = log, kind

    def launch_dim3(self, grid, threads, shared_memory, stream, params):
        self.log.append((self.kind, type(params), bytes(params), grid, threads, shared_memory, stream))


class AddressMap:
    """A MapLayout stand-in: the 'map' of an address holds the address and the box rows."""

    def __init__(self, t, rows):
        self.rows = rows

    def at(self, address):
        return (ctypes.c_uint64 * 16)(address, self.rows)


@pytest.fixture
def launches(monkeypatch):
    """The device's pieces stubbed for an sm_90a kernel (no compile: kernels are recorders); the launch log."""
    import flexgen.arch as arch
    import flexgen.cache.jit as jit
    import flexgen.runtime.schedule as schedule

    log = []
    kinds = {"fwd": "fwd", "bwd": "bwd", "bwd_preprocess": "pre", "bwd_postprocess": "post"}
    monkeypatch.setattr(arch, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setattr(fw, "get_kernel", lambda spec: RecordingKernel(log, kinds[spec.kind]))
    monkeypatch.setattr(jit, "get_kernel", lambda spec: RecordingKernel(log, kinds[spec.kind]))
    for module in (fw, bw):
        monkeypatch.setattr(module, "shared_memory_bytes", lambda kernel: 123456)
        monkeypatch.setattr(module, "map_layout", AddressMap)
        monkeypatch.setattr(module, "current_stream_ptr", lambda device: 77)
    for module in (families, schedule):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)
    monkeypatch.setattr(families, "l2_bytes", lambda device: 50 << 20)
    counter = torch.zeros(1, dtype=torch.int32)
    monkeypatch.setattr(families, "tile_counter", lambda device, stream: counter)
    cuda = types.SimpleNamespace(device=lambda device: contextlib.nullcontext())
    monkeypatch.setattr(bw, "torch", types.SimpleNamespace(**{n: getattr(torch, n) for n in ("empty", "empty_permuted",
                                                                                            "zeros", "float32")},
                                                          cuda=cuda))
    return log


def _inputs(layout: str, requires_grad=False):
    if layout == "bhld":
        q, k, v = (torch.randn(B, H, L, D, dtype=torch.bfloat16) for _ in range(3))
    elif layout == "blhd":  # (B, L, H, D) memory, as a model's projections give them
        q, k, v = (torch.randn(B, L, H, D, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    else:  # one key / value shared across the batch (stride-0 batch)
        q = torch.randn(B, H, L, D, dtype=torch.bfloat16)
        k, v = (torch.randn(1, H, L, D, dtype=torch.bfloat16).expand(B, H, L, D) for _ in range(2))
    return [t.requires_grad_(requires_grad) if t.is_leaf else t for t in (q, k, v)]


def _fields(entry):
    _, params_type, raw, *_ = entry
    return params_type.from_buffer_copy(raw)


@pytest.mark.parametrize("layout", ["bhld", "blhd", "shared_kv"])
def test_each_forward_run_allocates_and_launches_with_its_own_addresses(launches, layout):
    q0, k0, v0 = _inputs(layout)
    launch = fw.prepare_forward(q0, k0, v0, None, None, V.causal, D ** -0.5, {})
    assert families.of(launch.spec).tensor_maps  # (the sm90 family: its maps are checked too)
    outs = []
    for _ in range(3):  # fresh inputs of the planned layout each run
        q, k, v = _inputs(layout)
        out, lse, row_max = launch.run(q, k, v)
        p = _fields(launches[-1])
        assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr())
        for name, t in (("q_map", q), ("k_map", k), ("v_map", v), ("o_map", out)):
            assert getattr(p, name)[0] == t.data_ptr(), name
        assert out.shape == q.shape and out.stride() == empty_like_layout(q).stride() and out.dtype == q.dtype
        assert lse.shape == (B, H, L) and lse.dtype == torch.float32 and lse.is_contiguous() and row_max is None
        outs.append((out, lse))
    assert len(launches) == 3 and all(e[0] == "fwd" and e[6] == 77 and e[5] == 123456 for e in launches)
    addresses = {t.data_ptr() for pair in outs for t in pair}
    assert len(addresses) == 6  # (all alive: each run allocated its own)


@pytest.mark.parametrize("layout", ["bhld", "blhd", "shared_kv"])
@pytest.mark.parametrize("need", [(True, True, True), (False, True, False)])
def test_each_backward_run_allocates_and_launches_with_its_own_addresses(launches, layout, need):
    q0, k0, v0 = _inputs(layout)
    out0, grad0 = empty_like_layout(q0), torch.randn_like(q0)
    launch = bw.prepare_backward(q0, k0, v0, out0, grad0, None, None, V.causal, D ** -0.5, {}, need)
    for _ in range(2):
        q, k, v = _inputs(layout)
        out, grad_out = torch.randn(q.shape, dtype=q.dtype), torch.randn(q.shape, dtype=q.dtype)
        out, grad_out = out.as_strided(q.shape, out0.stride()), grad_out.as_strided(q.shape, grad0.stride())
        lse = torch.randn(B, H, L)
        launches.clear()
        dq, dk, dv, buffer_grads = launch.run(q, k, v, out, lse, grad_out)
        kinds = [e[0] for e in launches]
        assert kinds == ["pre", "bwd", "post"] if need[0] else kinds == ["pre", "bwd"]
        pre, main = _fields(launches[0]), _fields(launches[1])
        assert (pre.o, pre.dout, pre.lse) == (out.data_ptr(), grad_out.data_ptr(), lse.data_ptr())
        assert (main.q, main.k, main.v, main.dout) == (q.data_ptr(), k.data_ptr(), v.data_ptr(), grad_out.data_ptr())
        assert (main.delta, main.lse_log2) == (pre.delta, pre.lse_log2) and main.delta != main.lse_log2
        assert main.do_map[0] == grad_out.data_ptr() and main.q_map[0] == q.data_ptr()
        for grad, like, field, wanted in ((dk, k, "dk", need[1]), (dv, v, "dv", need[2])):
            if not wanted:
                assert grad is None and getattr(main, field) is None
                continue
            assert grad.shape == like.shape and grad.stride() == empty_like_layout(like).stride()
            assert getattr(main, field) == grad.data_ptr() and getattr(main, field + "_map")[0] == grad.data_ptr()
        if need[0]:
            post = _fields(launches[2])
            assert post.dq == dq.data_ptr() and post.dq_accum == main.dq_accum == pre.dq_accum
            assert dq.shape == q.shape and dq.stride() == empty_like_layout(q).stride()
        else:
            assert dq is None and main.dq_accum is None
        assert buffer_grads == {}
