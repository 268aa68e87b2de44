"""Tensors a mask_mod / score_mod reaches through nested closures (a closure over a closure over a
tensor, transformers' and_masks over a tuple of closures, functools.partial, default arguments):
found in eager, and passed to the flexgen ops as graph inputs under torch.compile (on meta
tensors, as tests/test_compile.py; the buffers hold real CPU data)."""
from __future__ import annotations

import dataclasses
import functools
import warnings

import pytest
import torch
import torch.nn as nn

import flexgen
from flexgen.captures import find_path, follow
from flexgen.dsl import trace as trace_module
from flexgen.variant import mod_parts
from test_compile import META, Recorder, compiled, qkv, B, H, L


def and_masks(*fns):
    """transformers.masking_utils.and_masks, as written there: a closure over a tuple of closures."""
    def and_mask(b, h, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for fn in fns:
            result = result & fn(b, h, q_idx, kv_idx).to(result.device)
        return result
    return and_mask


def padding(pad):
    def inner_mask(b, h, q_idx, kv_idx):
        return pad[b, kv_idx]
    return inner_mask


def offsets(fn, q_off, kv_off):
    def inner_mask(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx + q_off, kv_idx + kv_off)
    return inner_mask


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _pad_tensor():
    pad = torch.ones(B, L, dtype=torch.bool)
    pad[1, : int(torch.randint(1, L // 2, ()))] = False
    return pad


def _with_default(b, h, q_idx, kv_idx, table=None):
    return table[b, kv_idx]


def _partial_target(pad, b, h, q_idx, kv_idx):
    return pad[b, kv_idx]


def shapes(pad):
    """Each way of capturing the same padding tensor, nested."""
    return {
        "closure_of_closure": offsets(padding(pad), 0, 0),
        "and_masks_tuple": offsets(and_masks(causal, padding(pad)), 0, 0),
        "partial": and_masks(causal, functools.partial(_partial_target, pad)),
        "default": and_masks(functools.partial(_with_default, table=pad)),
        "defaults_tuple": and_masks(_bind_default(pad)),
    }


def _bind_default(pad):
    def inner(b, h, q_idx, kv_idx, t=pad):
        return t[b, kv_idx]
    return inner


@pytest.mark.parametrize("how", list(shapes(torch.ones(1, 1))))
def test_find_follows_nested_captures_to_the_tensor(how):
    pad = _pad_tensor()
    fn = shapes(pad)[how]
    path = find_path(fn, pad, 0, set())
    assert path is not None and follow(fn, path) is pad
    assert find_path(fn, torch.ones(1), 0, set()) is None  # a tensor it does not hold is not found


@pytest.mark.parametrize("how", list(shapes(torch.ones(1, 1))))
def test_eager_mod_parts_and_mask_values(how):
    pad = _pad_tensor()
    fn = shapes(pad)[how]
    token, buffers = mod_parts(fn, "mask")
    assert token and len(buffers) == 1 and buffers[0] is pad
    want = torch.stack([pad[b][None, :].expand(L, L) for b in range(B)])[:, None]
    if how in ("and_masks_tuple", "partial"):
        want = want & torch.ones(L, L, dtype=torch.bool).tril()
    torch.testing.assert_close(flexgen.create_mask(fn, B, None, L, L, device="cpu"), want)


def _meta_mask(fn):
    base = flexgen.create_block_mask(causal, B, None, L, L, device="cpu").to(META)
    return dataclasses.replace(base, mask_mod=fn)


@pytest.mark.parametrize("how", list(shapes(torch.ones(1, 1))))
def test_compiled_nested_closure_made_outside_passes_its_tensor_as_a_graph_input(how):
    pad = _pad_tensor()
    mask = _meta_mask(shapes(pad)[how])

    class M(nn.Module):
        def forward(self, q, k, v):
            return flexgen.flex_attention(q, k, v, block_mask=mask)

    fn, rec = compiled(M(), Recorder())
    q, k, v = qkv()
    fn(q, k, v).sum().backward()
    assert q.grad is not None
    (node,) = [n for n in rec.graphs[0].graph.nodes if str(n.target) == "flexgen.attention_fwd.default"]
    (buffer,) = node.args[11]
    assert buffer.op == "placeholder"
    # the graph input is the padding tensor itself, not a copy made at trace time
    assert rec.graphs[0].graph.find_nodes(op="placeholder", target=buffer.target)[0].meta["example_value"].shape == pad.shape


def test_compiled_passes_each_steps_tensor(monkeypatch):
    """A new padding tensor each step (transformers builds its closures per forward): the op gets
    that step's tensor, whatever the trace saw first (CPU inputs, the kernel replaced by a spy)."""
    from flexgen import attention
    from flexgen.runtime import forward

    got = []

    def spy(q, k, v, score, bm, mask, *args, **kwargs):
        got.append(mask.buffer_tensors[0])
        return torch.zeros_like(q), q.new_zeros(q.shape[:3], dtype=torch.float32)

    monkeypatch.setattr(attention, "_check_inputs", lambda *a: None)
    monkeypatch.setattr(attention, "unfused_reason", lambda *a: None)  # CPU tensors through the ops, not the unfused path
    monkeypatch.setattr(forward, "forward_call", spy)
    fn, _ = compiled(lambda q, k, v, mask: flexgen.flex_attention(q, k, v, block_mask=mask), Recorder())
    q = torch.randn(B, 4, L, 64)
    base = flexgen.create_block_mask(causal, B, None, L, L, device="cpu")
    pads = [_pad_tensor() for _ in range(3)]
    for pad in pads:
        fn(q, q, q, dataclasses.replace(base, mask_mod=offsets(and_masks(causal, padding(pad)), 0, 0)))
    assert len(got) == 3 and all(g is p for g, p in zip(got, pads))
    # (dynamo guards on the identity of what the outer closure captures, so new closures retrace;
    # transformers' adapter avoids that by handing flex_attention a Mod)


def test_nested_closure_made_inside_the_compiled_function_traces_whole():
    """transformers' closures built inside the compiled forward (and_masks over a padding mask over the input's
    tensor): flexgen traces stand-ins of the functions dynamo holds, and the op reads the input's tensor itself."""
    pad = _pad_tensor()

    class Inside(nn.Module):
        def forward(self, q, k, v, pad):
            mask = dataclasses.replace(base, mask_mod=offsets(and_masks(causal, padding(pad)), 0, 0))
            return flexgen.flex_attention(q, k, v, block_mask=mask)

    base = flexgen.create_block_mask(causal, B, None, L, L, device="cpu").to(META)
    fn, rec = compiled(Inside(), Recorder(), fullgraph=True)
    q, k, v = qkv()
    out = fn(q, k, v, pad)
    out.sum().backward()
    assert out.shape == q.shape and q.grad is not None
    (graph,) = rec.graphs
    (node,) = [n for n in graph.graph.nodes if str(n.target) == "flexgen.attention_fwd.default"]
    buffers = node.args[11]
    assert len(buffers) == 1 and buffers[0].op == "placeholder"
    assert buffers[0].meta["example_value"].shape == pad.shape


class _Temperature(nn.Module):
    """A score_mod made in forward over a parameter it reads detached (no gradient for it) or as it is."""

    def __init__(self, detach: bool):
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.detach = detach

    def forward(self, q, k, v):
        temp = self.temp

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + temp.detach() * (q_idx - kv_idx) if self.detach else score * temp + temp

        return flexgen.flex_attention(q, k, v, score_mod=score_mod)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("detach", [True, False])
def test_a_parameter_detached_inside_the_score_mod_is_reached_and_gets_no_gradient(detach):
    """temp.detach() inside the score_mod makes a new tensor while it is traced: its path is the parameter's and a
    detach, so compiled calls read the parameter's current value, and no gradient reaches it (as in eager)."""
    torch.manual_seed(0)
    leaves = [torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    copies = [t.detach().clone().requires_grad_() for t in leaves]
    eager, compiled_module = _Temperature(detach), _Temperature(detach)
    torch._dynamo.reset()
    run = torch.compile(compiled_module, backend="aot_eager")
    for step in range(2):  # the second call after the parameter changed: no stale value
        want, got = eager(*leaves), run(*copies)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        grad = torch.randn_like(want)
        want.backward(grad)
        got.backward(grad)
        for a, b in zip(copies, leaves):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
        if detach:
            assert eager.temp.grad is None and compiled_module.temp.grad is None
        else:
            # (a buffer's gradient is summed in float32 by the kernels' reduction)
            torch.testing.assert_close(compiled_module.temp.grad, eager.temp.grad, rtol=1e-6, atol=0)
        with torch.no_grad():
            for m in (eager, compiled_module):
                m.temp.add_(0.5)
    # eager reuse: the traced Mod is found again along the detach path, not retraced with a stale tensor
    assert _Temperature(detach)(*leaves).isfinite().all()


def test_a_tensor_the_score_mod_computes_while_traced_runs_eagerly_under_compile(monkeypatch):
    """torch.log(mass[0]) inside the score_mod is a tensor made while it is traced, none of those it captures: a
    compiled call cannot hand it over, so it runs eagerly (a graph break, with one warning saying why) and gives
    eager's result; under fullgraph=True it is an error."""
    from flexgen import warnings_once

    monkeypatch.setattr(warnings_once, "_WARNINGS_SHOWN", set())
    mass = torch.tensor([2.0, 3.0], dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + torch.log(mass[0]) * (q_idx - kv_idx)

    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the CPU's unfused-path notice)
        want = flexgen.flex_attention(q, k, v, score_mod=score_mod)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"reads a tensor 'buf\w*' that is none of the tensors it captures"):
        got = torch.compile(flexgen.flex_attention)(q, k, v, score_mod=score_mod)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(flexgen.flex_attention, fullgraph=True)(q, k, v, score_mod=score_mod)


class _CutoffBias(nn.Module):
    """A score_mod made in forward over a table computed there and the module's own 0-dim buffer."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, H)
        self.register_buffer("cutoff", torch.tensor(3, dtype=torch.long))

    def forward(self, q, k, v, points):
        table = self.proj(points)  # (n, H), made inside the compiled region

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + ((q_idx >= self.cutoff) & (kv_idx >= self.cutoff)).to(score.dtype) * table[kv_idx, h]

        return flexgen.flex_attention(q, k, v, score_mod=score_mod)


def test_a_score_mod_over_a_table_made_inside_and_a_module_scalar_on_the_inputs_device(monkeypatch):
    """While traced, a table made inside the compiled region stands in as a CPU tensor, beside the module's 0-dim
    buffer on the inputs' device (meta here, as CUDA on a GPU): a 0-dim buffer goes with any device, so the compile
    goes through and the kernel gets both as graph inputs."""
    monkeypatch.setattr(trace_module, "BUFFER_DEVICES", ("cpu", "cuda", "meta"))
    module = _CutoffBias().to(META)
    q, k, v = qkv(requires_grad=(False, False, False))
    points = torch.randn(L, 2, device=META)
    recorder = Recorder()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(module, backend=recorder, fullgraph=True)(q, k, v, points)
    assert out.shape == q.shape and out.device.type == "meta"
    assert len(recorder.graphs) == 1
