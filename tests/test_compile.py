"""torch.compile and the flexgen::attention_fwd / attention_bwd ops, on the CPU.

The kernels need CUDA, so most of these run on meta tensors: the ops' fake kernels give shapes, and
what is checked is the traced graph (no graph break, the flexgen ops in it, buffers as graph
inputs, the gradient flags the backward gets). Those that compare values with eager run float64
CPU tensors, for which the ops run flexgen's unfused path. tests/test_gpu_compile.py runs the kernels.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import flexgen
from flexgen import ops  # noqa: F401  (registers the ops)
from flexgen.variant import variant

B, H, L, D = 2, 4, 256, 64
META = "meta"


def qkv(requires_grad=(True, True, True), heads_kv=H):
    shapes = ((B, H, L, D), (B, heads_kv, L, D), (B, heads_kv, L, D))
    return [torch.randn(s, device=META, dtype=torch.bfloat16, requires_grad=g) for s, g in zip(shapes, requires_grad)]


class Recorder:
    """A dynamo backend that keeps the forward graphs and, through AOTAutograd, the backward ones."""

    def __init__(self, aot: bool = False):
        self.graphs, self.fw, self.bw = [], [], []
        self.aot = aot

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        if not self.aot:
            return gm.forward

        def keep(store):
            def compiler(g, _):
                store.append(g)
                return make_boxed_func(g.forward)
            return compiler

        return aot_autograd(fw_compiler=keep(self.fw), bw_compiler=keep(self.bw))(gm, example_inputs)


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def compiled(module, backend=None, fullgraph=True):
    torch._dynamo.reset()
    backend = backend or Recorder()
    return torch.compile(module, backend=backend, fullgraph=fullgraph), backend


def softcap_in_forward():
    class M(nn.Module):
        def forward(self, q, k, v):
            cap = 30.0
            return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: cap * torch.tanh(s / cap))
    return M()


class Alibi(nn.Module):
    """ALiBi with learnable slopes, the score_mod spelled `how`."""

    def __init__(self, how: str):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H))
        self.how = how
        if how == "init_lambda":
            self.score_mod = lambda s, b, h, qi, ki: s + self.slopes[h] * (ki - qi)
        elif how == "mod":
            self.score_mod = flexgen.variants.alibi(self.slopes)

    def method(self, s, b, h, qi, ki):
        return s + self.slopes[h] * (ki - qi)

    def forward(self, q, k, v):
        if self.how == "in_forward":
            slopes = self.slopes

            def alibi(s, b, h, qi, ki):
                return s + slopes[h] * (ki - qi)
            return flexgen.flex_attention(q, k, v, score_mod=alibi)
        fn = self.method if self.how == "method" else self.score_mod
        return flexgen.flex_attention(q, k, v, score_mod=fn)


class Masked(nn.Module):
    def forward(self, q, k, v, block_mask):
        return flexgen.flex_attention(q, k, v, block_mask=block_mask)


# ---------------------------------------------------------------- fake kernels and schema


def test_fake_kernels_shapes_and_dtypes():
    with FakeTensorMode():
        q = torch.empty(B, H, L, D, dtype=torch.bfloat16)
        k = torch.empty(B, 2, 128, D, dtype=torch.bfloat16)
        buf = torch.empty(H, 7, dtype=torch.float16)
        masks = [None] * 8
        out, lse, row_max = torch.ops.flexgen.attention_fwd(q, k, k, *masks, [buf], 0.1, "unused", 0.0, None, False, False)
        assert row_max.numel() == 0  # max_scores only when asked for
        assert out.shape == q.shape and out.dtype == q.dtype
        assert lse.shape == (B, H, L) and lse.dtype == torch.float32
        dq, dk, dv, grads = torch.ops.flexgen.attention_bwd(
            q, k, k, out, lse, out, None, *masks, [buf], 0.1, "unused", 0.0, None, True, False, True, [0], False)
        assert dq.shape == q.shape and dk.numel() == 0 and dv.shape == k.shape and dv.dtype == q.dtype
        assert len(grads) == 1 and grads[0].shape == buf.shape and grads[0].dtype == torch.float32
        assert grads[0].device == q.device


def test_opcheck_on_meta():
    q, k, v = qkv()
    slopes = torch.rand(H, device=META, requires_grad=True)
    args = (q, k, v, *([None] * 8), [slopes], 0.125, "unused", 0.0, None, False)
    torch.library.opcheck(torch.ops.flexgen.attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_eager_meta_backward_respects_needs_input_grad(monkeypatch):
    calls = []
    real = torch.ops.flexgen.attention_bwd.default

    def spy(*args):
        calls.append(args[-5:-1])  # need_q, need_k, need_v, buffer_grads (then `unfused`)
        return real(*args)

    monkeypatch.setattr(ops, "attention_bwd", spy)
    q, k, v = qkv(requires_grad=(True, False, False))
    flexgen.flex_attention(q, k, v).sum().backward()
    assert calls == [(True, False, False, [])]
    assert q.grad is not None and k.grad is None


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_p_range(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dropout_p"):
        flexgen.flex_attention(q, k, v, dropout_p=p)


# ---------------------------------------------------------------- torch.compile, fullgraph


@pytest.mark.parametrize("make", [lambda: Masked(), softcap_in_forward], ids=["no_score_mod", "softcap_lambda"])
def test_fullgraph_simple(make):
    module = make()
    fn, rec = compiled(module)
    q, k, v = qkv()
    out = fn(q, k, v, None) if isinstance(module, Masked) else fn(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape and q.grad is not None
    assert targets(rec.graphs[0]).count("flexgen.attention_fwd.default") == 1


@pytest.mark.parametrize("how", ["init_lambda", "method", "mod"])
def test_fullgraph_learnable_alibi(how):
    module = Alibi(how)
    fn, rec = compiled(module, Recorder(aot=True))
    q, k, v = qkv()
    fn(q, k, v).sum().backward()
    (node,) = [n for n in rec.graphs[0].graph.nodes if str(n.target) == "flexgen.attention_fwd.default"]
    (buffer,) = node.args[11]
    assert buffer.op == "placeholder"  # the slopes are a graph input, so their gradient flows
    assert module.slopes.grad is not None and module.slopes.grad.shape == (H,)
    assert "flexgen.attention_bwd.default" in targets(rec.bw[0])


def test_score_mod_made_inside_forward_over_a_tensor_of_the_trace_is_one_graph():
    """A score_mod defined in forward over a tensor read there (the slopes, through a local): dynamo holds no Python
    function for it; flexgen traces a stand-in over the tensor's dtype and shape and takes the tensor from the
    closure as dynamo holds it, so fullgraph=True works, the tensor is a buffer of the op and gets gradients."""
    module = Alibi("in_forward")
    fn, rec = compiled(module, Recorder(aot=True))
    for _ in range(3):
        fn(*qkv()).sum().backward()
    assert module.slopes.grad is not None
    assert len(rec.graphs) == 1 and "flexgen.attention_fwd.default" in targets(rec.graphs[0])
    assert "flexgen.attention_bwd.default" in targets(rec.bw[0])


class InnerHelper(nn.Module):
    """A score_mod made in forward that calls another function made there, over a tensor made there."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H))

    def forward(self, q, k, v):
        slopes = self.slopes * 2

        def slope(h):
            return slopes[h]

        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + slope(h) * (ki - qi))


def test_score_mod_calling_a_function_made_inside_is_one_graph():
    module = InnerHelper()
    fn, rec = compiled(module, Recorder(aot=True))
    for _ in range(3):
        fn(*qkv()).sum().backward()
    assert module.slopes.grad is not None
    assert len(rec.graphs) == 1 and "flexgen.attention_bwd.default" in targets(rec.bw[0])


class Holder:
    def __init__(self, slopes):
        self.slopes = slopes


class ObjectClosure(nn.Module):
    """A score_mod made in forward over an object made there (a plain class's instance holding a tensor of the
    trace): no stand-in, so flex_attention breaks the graph, with its reason under fullgraph=True."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(H))

    def forward(self, q, k, v):
        held = Holder(self.slopes * 2)
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + held.slopes[h] * (ki - qi))


def test_score_mod_over_an_object_made_inside_breaks_the_graph_clearly():
    fn, _ = compiled(ObjectClosure())
    with pytest.raises(Exception, match="define it outside"):
        fn(*qkv())
    module = ObjectClosure()  # without fullgraph: a graph break, correct gradients
    fn, rec = compiled(module, fullgraph=False)
    fn(*qkv()).sum().backward()
    assert module.slopes.grad is not None
    assert any("flexgen.attention_fwd.default" in targets(g) for g in rec.graphs)


def test_a_score_mod_over_a_fresh_tensor_each_call_runs_one_graph():
    """The trace reads a captured tensor's dtype and shape, not its identity: a function made anew each call over a
    new tensor (a batch's document ids) runs the graph compiled for the first; a strided view recompiles."""
    def make(t):
        return lambda s, b, h, qi, ki: s + t[h]

    rec = Recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, sm: flexgen.flex_attention(q, k, v, score_mod=sm), backend=rec, fullgraph=True)
    for _ in range(4):
        fn(*qkv(), make(torch.rand(H)))
    assert len(rec.graphs) == 1
    fn(*qkv(), make(torch.rand(H, 3)[:, 0]))
    assert len(rec.graphs) == 2


def _bias_rows(t):
    return lambda s, b, h, qi, ki: s + t[h, ki]


def _bias_scaled_by_rows(t):
    return lambda s, b, h, qi, ki: s + t[h, ki] * t.shape[0]


def _row_sums(t):
    return lambda s, b, h, qi, ki: s + (t[ki] * 2).sum()


@pytest.mark.parametrize("make,shapes,graphs", [
    (_bias_rows, [(5, 48), (6, 48), (7, 48)], 1),  # (the trace reads no shape: one graph)
    (_bias_scaled_by_rows, [(5, 48), (6, 48), (7, 48)], 3),  # (Python reads t.shape[0]: one graph per size)
    (_row_sums, [(48, 3), (48, 5)], 2),  # (the tracer unrolls over a row: one graph per row length)
])
def test_captured_tensors_of_other_shapes_under_dynamic_shapes(make, shapes, graphs):
    """A function made outside over a new tensor of another shape at each call, under dynamic=True: one graph where
    the trace reads no captured tensor's shape, a graph per shape where it does (the function's own Python or the
    tracer unrolling over a row), and every call's output equals eager's (float64, the unfused path through the
    ops on the CPU)."""
    import warnings

    rec = Recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, sm: flexgen.flex_attention(q, k, v, score_mod=sm), backend=rec,
                       fullgraph=True, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for shape in shapes:
            q, k, v = (torch.randn(2, 4, 48, 16, dtype=torch.float64) for _ in range(3))
            score_mod = make(torch.randn(shape, dtype=torch.float64))
            out = fn(q, k, v, score_mod)
            torch.testing.assert_close(out, flexgen.flex_attention(q, k, v, score_mod=score_mod), atol=1e-12, rtol=0)
    assert len(rec.graphs) == graphs


def _biased(s, b, h, qi, ki, bias, scale):
    return s + bias[h, ki] * scale


class PartialInside(nn.Module):
    """A functools.partial made in forward over a tensor made there."""

    def forward(self, q, k, v, bias):
        return flexgen.flex_attention(q, k, v, score_mod=functools.partial(_biased, bias=bias * 2, scale=0.5))


def test_partial_score_mods_under_compile():
    """functools.partial score_mods: made outside over a new tensor at each call (one graph; another scale
    recompiles, as the scale is part of the kernel), and made inside the compiled function over a tensor made there
    (fullgraph); every output equals eager's (float64, the unfused path through the ops on the CPU)."""
    import warnings

    rec = Recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, sm: flexgen.flex_attention(q, k, v, score_mod=sm), backend=rec, fullgraph=True)
    inside = torch.compile(PartialInside(), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for n, scale in enumerate((2.0, 2.0, 2.0, 3.0)):
            q, k, v = (torch.randn(2, 4, 48, 16, dtype=torch.float64) for _ in range(3))
            bias = torch.randn(4, 48, dtype=torch.float64)
            score_mod = functools.partial(_biased, bias=bias, scale=scale)
            torch.testing.assert_close(fn(q, k, v, score_mod), flexgen.flex_attention(q, k, v, score_mod=score_mod),
                                       atol=1e-12, rtol=0)
            assert len(rec.graphs) == (1 if n < 3 else 2)
            torch.testing.assert_close(inside(q, k, v, bias), PartialInside()(q, k, v, bias), atol=1e-12, rtol=0)


def _outer(inner):
    return lambda s, b, h, qi, ki: s + inner(h, ki)


def _slope(h, ki):
    return ki * 0.1


def _offset(h, ki):
    return -ki * 0.3 + h


def _activation(f):
    return lambda s, b, h, qi, ki: f(s)


@pytest.mark.parametrize("inners,graphs", [
    ((_slope, _offset, _slope, _offset), 2),  # (a Python function in the closure: one graph per function)
    ((torch.nn.functional.relu, torch.nn.functional.gelu, torch.nn.functional.silu, torch.nn.functional.relu), 3),
])
def test_a_function_in_the_closure_is_guarded(inners, graphs):
    """A mod made outside over another function (a helper, or torch's own such as F.gelu): another function there
    recompiles, the same one reuses its graph, and every output equals eager's (float64, the unfused path)."""
    import warnings

    rec = Recorder()
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, sm: flexgen.flex_attention(q, k, v, score_mod=sm), backend=rec, fullgraph=True)
    make = _outer if inners[0] is _slope else _activation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for inner in inners:
            q, k, v = (torch.randn(2, 4, 40, 8, dtype=torch.float64) for _ in range(3))
            score_mod = make(inner)
            torch.testing.assert_close(fn(q, k, v, score_mod), flexgen.flex_attention(q, k, v, score_mod=score_mod),
                                       atol=1e-12, rtol=0)
    assert len(rec.graphs) == graphs


class SizeClosure(nn.Module):
    """PyTorch's test_symbol_closure_in_score_mod: a score_mod made in forward over a size of the input."""

    def __init__(self, dim=128, n_head=2):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, device=META, dtype=torch.bfloat16)
        self.n_head, self.head_dim = n_head, dim // n_head

    def forward(self, x):
        batch, length, _ = x.size()
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + batch)


def test_score_mod_made_inside_over_a_symbolic_size_runs_one_graph():
    """Under dynamic=True the captured size is symbolic: the kernel reads it at run time (a 0-dim int32 buffer made
    in the graph), so every batch size runs the one graph."""
    fn, rec = compiled(SizeClosure())
    fn = torch.compile(SizeClosure(), backend=rec, fullgraph=True, dynamic=True)
    for batch in (4, 16, 32):
        assert fn(torch.randn(batch, 64, 128, device=META, dtype=torch.bfloat16)).shape == (batch, 2, 64, 64)
    assert len(rec.graphs) == 1
    (node,) = [n for n in rec.graphs[0].graph.nodes if str(n.target) == "flexgen.attention_fwd.default"]
    (buffer,) = node.args[11]
    assert buffer.target is torch.full and buffer.kwargs["dtype"] == torch.int32


def _eager_and_compiled(module, *shapes, dynamic=False):
    """Outputs and input gradients of the module eager and compiled (fullgraph, aot_eager), float64 on the CPU,
    where both run flexgen's unfused path (the compiled one through the ops)."""
    torch._dynamo.reset()
    fn = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    results = []
    for shape in shapes:
        inputs = [torch.randn(shape, dtype=torch.float64) for _ in range(3)]
        pair = []
        for f in (module, fn):
            ins = [t.clone().requires_grad_() for t in inputs]
            out = f(*ins)
            out.backward(torch.ones_like(out))
            params = [p.grad.clone() for p in module.parameters()]
            module.zero_grad()
            pair.append((out.detach(), [t.grad for t in ins], params))
        results.append(pair)
    return results


class ViewBuffer(nn.Module):
    """PyTorch's test_load_from_view_buffer: the score_mod reads a view of a tensor computed from q in forward."""

    def __init__(self, heads=4, d=16, w=8):
        super().__init__()
        self.rel_pos = nn.Parameter(torch.randn(2 * heads - 1, d, dtype=torch.float64))
        self.heads, self.w = heads, w

    def forward(self, q, k, v):
        b, heads, w = q.shape[0], self.heads, self.w
        coords = torch.arange(heads)[:, None] - torch.arange(heads)[None, :] + heads - 1
        rel = torch.einsum("bhwc,hkc->bhwk", q.reshape(b * heads, heads, w, -1), self.rel_pos[coords])
        rel = rel.reshape(b, heads, heads * w, heads, 1).squeeze(-1)

        def score_mod(score, batch, head, q_idx, k_idx):
            return score + rel[batch, head, q_idx, k_idx // w]

        return flexgen.flex_attention(q, k, v, score_mod=score_mod)


class ListAndSize(nn.Module):
    """A list of tensors of the trace and a size, captured by a mask and a score_mod made in forward."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(4, dtype=torch.float64))

    def forward(self, q, k, v):
        length = q.shape[2]
        scales = [self.slopes * 0.5, self.slopes.flip(0)]

        def score_mod(s, b, h, qi, ki):
            return s + scales[0][h] * (ki - qi) / length + scales[1][h]

        mask = flexgen.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, length, length, device="cpu")
        return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=mask)


class RowOfInside(nn.Module):
    """A score_mod made in forward that takes a view of a tensor made there in its own code (rel[3]): the buffer is
    that row, found by its offset in the tensor."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 4, 40, dtype=torch.float64))

    def forward(self, q, k, v):
        rel = self.table * 2
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + rel[3][h, ki])


class DictInside(nn.Module):
    """A score_mod made in forward over a dict of tensors made there."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(4, dtype=torch.float64))

    def forward(self, q, k, v):
        table = {"slopes": self.slopes * 2, 0: self.slopes.flip(0)}
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table["slopes"][h] * (ki - qi)
                                      / 40 + table[0][h])


class LayersInside(nn.Module):
    """One score_mod site in a loop over layers, each over its own tensor and constant made in forward: every call
    gets its own stand-in and token."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.ParameterList([nn.Parameter(torch.rand(4, dtype=torch.float64)) for _ in range(3)])

    def forward(self, q, k, v):
        out = q
        for i, slopes in enumerate(self.slopes):
            scaled, n = slopes * (i + 1), i + 2
            out = flexgen.flex_attention(out, k, v, score_mod=lambda s, b, h, qi, ki: s + scaled[h] * (ki - qi) / n)
        return out


class SelfInside(nn.Module):
    """A score_mod made in forward that reads the module itself (ALiBi with `self.bias[h] * self.scale` slopes)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, dtype=torch.float64))
        self.scale = 0.5

    def forward(self, q, k, v):
        def score_mod(s, b, h, qi, ki):
            return s + self.bias[h] * self.scale * (ki - qi)

        return flexgen.flex_attention(q, k, v, score_mod=score_mod)


class _Config:
    def __init__(self):
        self.window = 4
        self.table = torch.randn(4, dtype=torch.float64)


class ObjectInside(nn.Module):
    """A mask and a score_mod made in forward over an object of a user class (a config with a window and a table)."""

    def __init__(self):
        super().__init__()
        self.config = _Config()

    def forward(self, q, k, v):
        config = self.config

        def mask_mod(b, h, qi, ki):
            return (qi - ki).abs() <= config.window

        def score_mod(s, b, h, qi, ki):
            return s + config.table[h] * ki

        block_mask = flexgen.create_block_mask(mask_mod, 1, 4, q.shape[2], k.shape[2], device=q.device)
        return flexgen.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)


class WritesThenReads(nn.Module):
    """forward assigns self.scale, then makes a score_mod that reads it: dynamo applies the assignment only after the
    graph, so the module still holds the old value while the mod is traced."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(4, dtype=torch.float64))
        self.scale = 1.0

    def forward(self, q, k, v):
        self.scale = self.scale + 2.0
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + self.slopes[h] * self.scale * (ki - qi))


def test_a_mod_over_the_module_written_in_forward_reads_the_written_value():
    import warnings

    q, k, v = (torch.randn(1, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    module = WritesThenReads()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        out = torch.compile(module, backend="aot_eager")(q, k, v)  # (a graph break: no stand-in for it)
        assert module.scale == 3.0
        module.scale = 1.0
        want = module(q, k, v)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def test_mods_made_inside_over_the_module_or_an_object_follow_their_attributes():
    """The trace reads self.scale and config.window: another value recompiles (dynamo guards on each) and computes
    eager's result; a tensor attribute rebound is read anew."""
    import warnings

    q, k, v = (torch.randn(1, 4, 40, 16, dtype=torch.float64) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for module, change in ((SelfInside(), lambda m, i: setattr(m, "scale", 0.5 + i)),
                               (ObjectInside(), lambda m, i: setattr(m.config, "window", 4 + 5 * i))):
            torch._dynamo.reset()
            compiled_module = torch.compile(module, backend="aot_eager", fullgraph=True)
            outs = []
            for i in range(3):
                change(module, i)
                if i == 2 and isinstance(module, SelfInside):
                    module.bias = nn.Parameter(torch.randn(4, dtype=torch.float64))
                out = compiled_module(q, k, v)
                assert not out.isnan().any()
                torch.testing.assert_close(out, module(q, k, v), atol=1e-12, rtol=1e-12)
                outs.append(out)
            assert not torch.allclose(outs[0], outs[1])


HEAD_OFFSETS = torch.randn(4, dtype=torch.float64)


class GlobalAndInside(nn.Module):
    """A score_mod made in forward over a tensor made there that also reads a module-global tensor (reached through
    the module of the function's globals, with a source, on every supported torch)."""

    def __init__(self):
        super().__init__()
        self.slopes = nn.Parameter(torch.rand(4, dtype=torch.float64))

    def forward(self, q, k, v):
        scaled = self.slopes * 3
        return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + scaled[h] + HEAD_OFFSETS[h])


@pytest.mark.parametrize("module,shapes,dynamic", [
    (ViewBuffer, [(2, 4, 32, 16)], False),
    (GlobalAndInside, [(2, 4, 40, 16)], False),
    (SelfInside, [(2, 4, 40, 16)], False),
    (ObjectInside, [(2, 4, 40, 16)], False),
    (LayersInside, [(2, 4, 40, 16)], False),
    (DictInside, [(2, 4, 40, 16)], False),
    (RowOfInside, [(2, 4, 40, 16)], False),
    (ListAndSize, [(2, 4, 40, 16), (2, 4, 56, 16)], False),
    (ListAndSize, [(2, 4, 40, 16), (2, 4, 56, 16)], True),
])
def test_score_mods_made_inside_compute_what_eager_does(module, shapes, dynamic):
    """Values, input gradients and parameter gradients (through the captured tensors) equal eager's."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        results = _eager_and_compiled(module(), *shapes, dynamic=dynamic)
    for (out_e, grads_e, params_e), (out_c, grads_c, params_c) in results:
        assert not out_c.isnan().any()
        torch.testing.assert_close(out_c, out_e, atol=1e-12, rtol=1e-12)
        # (the ops sum a buffer's gradient in fp32, and ViewBuffer's buffer is made from q)
        for a, b in zip(grads_c + params_c, grads_e + params_e):
            torch.testing.assert_close(a, b, atol=1e-5 * b.abs().max().item(), rtol=1e-5)
            assert a.abs().sum() > 0


BIAS = torch.rand(H, requires_grad=True)


def test_fullgraph_lambda_reading_a_global_tensor():
    class M(nn.Module):
        def forward(self, q, k, v):
            return flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + BIAS[h])

    BIAS.grad = None
    fn, _ = compiled(M())
    fn(*qkv()).sum().backward()
    assert BIAS.grad is not None


class WindowMask:
    """A mask_mod as an instance of a class with __call__ (PyTorch's test_callable_class_mask_mod)."""

    def __init__(self, window):
        self.window = window

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) | ((kv_idx - q_idx) < self.window)


class HeadBias:
    """A score_mod as an instance of a class with __call__, reading a tensor attribute."""

    def __init__(self, table):
        self.table = table

    def __call__(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h] * 0.5


def test_fullgraph_callable_objects_as_mods():
    """Values equal eager's, and changing the objects' attributes (a number, a rebound tensor) changes the result."""
    import warnings

    mask, bias = WindowMask(8), HeadBias(torch.randn(H, dtype=torch.float64))

    def attend(q, k, v):
        block_mask = flexgen.create_block_mask(mask, 1, H, 40, 40, device=q.device)
        return flexgen.flex_attention(q, k, v, score_mod=bias, block_mask=block_mask)

    torch._dynamo.reset()
    compiled_attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(1, H, 40, 16, dtype=torch.float64) for _ in range(3))
    outs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for window in (8, 3):
            mask.window, bias.table = window, torch.randn(H, dtype=torch.float64)
            out = compiled_attend(q, k, v)
            assert not out.isnan().any()
            torch.testing.assert_close(out, attend(q, k, v), atol=1e-12, rtol=1e-12)
            outs.append(out)
    assert not torch.allclose(outs[0], outs[1])


class _Tanh(torch.autograd.Function):
    """attention-gym's approximate tanh: a custom autograd Function (there, over a custom op), applied in a mod."""

    @staticmethod
    def forward(x):
        return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)

    @staticmethod
    def vmap(info, in_dims, x):
        return torch.tanh(x), 0


def _softcap_with(tanh, cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)
    return softcap


def test_fullgraph_score_mod_applying_a_custom_autograd_function():
    """The closure holds the Function's `apply`: its module's values are torch's, not the mod's (not looked into),
    and torch 2.11's dynamo, which cannot type it, guards it where it reads the cell."""
    import warnings

    torch._dynamo.reset()
    score_mod = _softcap_with(_Tanh.apply, 20.0)
    attend = torch.compile(lambda q, k, v: flexgen.flex_attention(q, k, v, score_mod=score_mod),
                           backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(1, H, 40, 16, dtype=torch.float64) * 8 for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        out = attend(q, k, v)
        want = flexgen.flex_attention(q, k, v, score_mod=_softcap_with(torch.tanh, 20.0))
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _document_mask():
    ids = torch.repeat_interleave(torch.arange(4), L // 4).to(torch.int32)
    return flexgen.create_block_mask(flexgen.variants.document(ids), None, None, L, L, device="cpu").to(META)


@pytest.mark.parametrize("kind", ["flexgen_causal", "flexgen_document", "torch_causal"])
def test_fullgraph_block_mask_made_outside(kind):
    if kind == "flexgen_causal":
        mask = flexgen.create_block_mask(_causal, None, None, L, L, device="cpu").to(META)
    elif kind == "flexgen_document":
        mask = _document_mask()
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        mask = create_block_mask(_causal, None, None, L, L, device="cpu").to(META)
    fn, rec = compiled(Masked(), Recorder(aot=True))
    q, k, v = qkv()
    fn(q, k, v, mask).sum().backward()
    assert q.grad is not None
    (node,) = [n for n in rec.graphs[0].graph.nodes if str(n.target) == "flexgen.attention_fwd.default"]
    key = node.args[13]
    assert variant(key).mask is not None and variant(key).block_size == (128, 128)
    if kind == "flexgen_document":
        assert len(node.args[11]) == 1  # the document ids are a graph input


def test_steps_do_not_retrace():
    module = Alibi("mod")
    fn, rec = compiled(module)
    for _ in range(4):
        fn(*qkv()).sum().backward()
    assert len(rec.graphs) == 1


def test_layers_with_their_own_mods_share_one_graph():
    layers = nn.ModuleList(Alibi("mod") for _ in range(3))

    class Stack(nn.Module):
        def forward(self, q, k, v):
            for layer in layers:
                q = layer(q, k, v)
            return q

    fn, rec = compiled(Stack())
    fn(*qkv()).sum().backward()
    (gm,) = rec.graphs
    assert targets(gm).count("flexgen.attention_fwd.default") == 3
    assert all(layer.slopes.grad is not None for layer in layers)


def test_only_query_grad_under_compile_asks_no_dk_dv():
    fn, rec = compiled(Masked(), Recorder(aot=True))
    q, k, v = qkv(requires_grad=(True, False, False))
    fn(q, k, v, None).sum().backward()
    (node,) = [n for n in rec.bw[0].graph.nodes if str(n.target) == "flexgen.attention_bwd.default"]
    assert node.args[-5:-2] == (True, False, False)  # need_q, need_k, need_v (then buffer_grads, unfused)


def test_dropout_under_compile_draws_rng_in_graph():
    class Drop(nn.Module):
        def forward(self, q, k, v):
            return flexgen.flex_attention(q, k, v, dropout_p=0.1)

    fn, rec = compiled(Drop())
    q, k, v = qkv()
    fn(q, k, v)
    names = targets(rec.graphs[0])
    assert any("randint" in t for t in names) and "flexgen.attention_fwd.default" in names


# ---------------------------------------------------------------- inductor, with a stand-in kernel


def _reference_forward(q, k, v, score, bm, mask, scale, kernel_options, **_):
    out, lse = flexgen.reference_attention(q, k, v, score_mod=score, mask_mod=mask, scale=scale, return_lse=True)
    return out.to(q.dtype), lse


def _reference_backward(*args, **kwargs):
    """Autograd is switched off inside an op's kernel (thread-local): run it on another thread."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_reference_grads, *args, **kwargs).result()


def _reference_grads(q, k, v, out, lse, grad_out, score, bm, mask, scale, kernel_options, needs, grad_buffers=(), **_):
    import dataclasses

    with torch.enable_grad():
        qkv64 = [t.detach().double().requires_grad_(bool(n)) for t, n in zip((q, k, v), needs)]
        bufs = {n: score.buffers[n].detach().double().requires_grad_() for n in grad_buffers}
        score64 = dataclasses.replace(score, buffers={**score.buffers, **bufs}) if score is not None else None
        ref = flexgen.reference_attention(*qkv64, score_mod=score64, mask_mod=mask, scale=scale)
        wrt = [t for t in qkv64 if t.requires_grad] + list(bufs.values())
        grads = iter(torch.autograd.grad(ref, wrt, grad_out.double()))
    dq, dk, dv = (next(grads).to(q.dtype) if n else None for n in needs)
    return dq, dk, dv, {n: next(grads).float() for n in grad_buffers}


@pytest.mark.parametrize("how,grads", [("mod", "all"), ("mod", "query_only"), ("init_lambda", "all")])
def test_inductor_end_to_end_with_a_cpu_stand_in_kernel(monkeypatch, how, grads):
    """The default backend (AOTAutograd + inductor) with the kernels swapped for the float64
    reference on the CPU: compiled forward and gradients (slopes included) equal eager's."""
    from flexgen import attention
    from flexgen.runtime import backward, forward

    monkeypatch.setattr(attention, "_check_inputs", lambda *a: None)
    monkeypatch.setattr(attention, "unfused_reason", lambda *a: None)  # CPU tensors through the ops, not the unfused path
    monkeypatch.setattr(forward, "forward_call", _reference_forward)
    monkeypatch.setattr(backward, "backward_call", _reference_backward)
    torch._dynamo.reset()
    module = Alibi(how)
    mask = flexgen.create_block_mask(_causal, None, None, 128, 128, device="cpu")
    x = [torch.randn(1, H, 128, 32, requires_grad=grads == "all" or i == 0) for i in range(3)]

    def run(fn):
        module.slopes.grad = None
        for t in x:
            t.grad = None
        out = fn(*x)
        out.sum().backward()
        return [out.detach(), *(t.grad for t in x), module.slopes.grad]

    masked = lambda q, k, v: flexgen.flex_attention(q, k, v, score_mod=module.score_mod, block_mask=mask)  # noqa: E731
    eager = run(masked)
    for got, want in zip(run(torch.compile(masked, fullgraph=True)), eager):
        torch.testing.assert_close(got, want)


def test_token_and_variant_registries_are_bounded_and_hold_no_tensors(monkeypatch):
    """A parameter value that changes on every call makes new tokens: the registries stay bounded,
    and a registered Mod's buffers are not kept alive by them."""
    import gc
    import weakref

    from flexgen import variant as variant_mod
    from flexgen.dsl import mod as mod_mod

    monkeypatch.setattr(mod_mod, "_BY_TOKEN", mod_mod.OrderedDict())
    monkeypatch.setattr(mod_mod, "_MAX_TOKENS", 8)
    monkeypatch.setattr(variant_mod, "_VARIANTS", variant_mod.OrderedDict())
    monkeypatch.setattr(variant_mod, "_MAX_VARIANTS", 8)
    slopes = torch.rand(H)
    alive = weakref.ref(slopes)
    for cap in range(1, 30):
        m = flexgen.variants.softcap(float(cap))
        variant_mod.variant_key(m.token, "", None, None)
    alibi = flexgen.variants.alibi(slopes)
    token = alibi.token
    assert len(mod_mod._BY_TOKEN) <= 8 and len(variant_mod._VARIANTS) <= 8
    rebuilt = mod_mod.mod_for_token(token)
    assert rebuilt.token == token and rebuilt.buffer_tensors == (None,)
    del alibi, slopes
    gc.collect()
    assert alive() is None


def test_compiled_create_block_mask_over_a_partial_reading_a_buffer_by_batch():
    """PyTorch's dynamic-batch test compiles create_block_mask (dynamic=True) over a functools.partial padding mask
    made anew with new lengths at each call: the partial reaches the flexgen::block_mask_lists op like any function,
    so the build is one graph (fullgraph=True), and the masks equal eager ones."""
    def padded(b, h, q_idx, kv_idx, lengths):
        return (q_idx < lengths[b]) & (kv_idx < lengths[b])

    torch._dynamo.reset()
    counters.clear()
    build = torch.compile(flexgen.create_block_mask, dynamic=True, fullgraph=True, backend="eager")
    for _ in range(3):
        mod = functools.partial(padded, lengths=torch.randint(100, 301, (3,)))
        made = build(mod, B=3, H=None, Q_LEN=300, KV_LEN=300, device="cpu")
        assert torch.equal(made.to_dense(), flexgen.create_block_mask(mod, 3, None, 300, 300, device="cpu").to_dense())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fullgraph_attention_under_a_mask_over_a_partial():
    """A block mask whose mask_mod is a functools.partial, built eagerly or by a compiled create_block_mask, goes
    through flex_attention compiled with fullgraph=True (dynamo cannot trace `is` between two partials, which the
    check whether the lists follow the mask_mod must therefore not use), and computes what eager does."""
    def padded(b, h, q_idx, kv_idx, lengths):
        return (q_idx < lengths[b]) & (kv_idx < lengths[b])

    torch._dynamo.reset()
    build = torch.compile(flexgen.create_block_mask, dynamic=True, fullgraph=False)
    attend = torch.compile(flexgen.flex_attention, dynamic=True, fullgraph=True, backend="eager")
    for n in (40, 56):
        lengths = torch.randint(n // 2, n + 1, (2,))
        mod = functools.partial(padded, lengths=lengths)
        q, k, v = (torch.randn(2, 2, n, 16) for _ in range(3))
        for mask in (flexgen.create_block_mask(mod, 2, None, n, n, device="cpu"),
                     build(mod, B=2, H=None, Q_LEN=n, KV_LEN=n, device="cpu")):
            assert mask.blocks_follow_mask_mod
            got = attend(q, k, v, block_mask=mask)
            want = flexgen.flex_attention(q, k, v, block_mask=mask)
            rows = torch.arange(n) < lengths[:, None]
            assert torch.allclose(got[rows[:, None].expand(-1, 2, -1)], want[rows[:, None].expand(-1, 2, -1)],
                                  atol=1e-5)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dynamic_true_takes_kernel_options_ints_as_their_values():
    """dynamic=True makes the ints of the kernel_options dict symbolic; each is taken as its value, guarded: another
    value compiles again (its own kernel), a bad one is still refused, and two calls in one graph keep their own."""
    from torch._dynamo.testing import CompileCounter

    q, k, v = (torch.randn(1, 2, 128, 16, dtype=torch.float64) for _ in range(3))
    want = flexgen.flex_attention(q, k, v)
    torch._dynamo.reset()
    counter = CompileCounter()
    call = torch.compile(flexgen.flex_attention, backend=counter, fullgraph=True, dynamic=True)
    for tile in (64, 64, 128):
        got = call(q, k, v, kernel_options={"BLOCK_M": tile, "BLOCK_N": 64, "precise_math": True})
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert counter.frame_count == 2
    with pytest.raises(Exception, match="BLOCK_M=0; it must be a positive int"):
        call(q, k, v, kernel_options={"BLOCK_M": 0, "BLOCK_N": 64, "precise_math": True})

    seen = []
    original = flexgen.attention._checked_options

    def two_calls(q, k, v):
        return (flexgen.flex_attention(q, k, v, kernel_options={"BLOCK_M": 32}) +
                flexgen.flex_attention(q, k, v, kernel_options={"BLOCK_M": 128}))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flexgen.attention, "_checked_options",
                      lambda options: seen.append(dict(options)) or original(options))
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(two_calls, fullgraph=True, dynamic=True)(q, k, v), 2 * want,
                                   rtol=0, atol=1e-12)
    assert {"BLOCK_M": 32} in seen and {"BLOCK_M": 128} in seen


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fullgraph_caller_reads_the_length_error():
    """Under fullgraph=True and dynamic sizes, an error raised while traced reaches the caller inside dynamo's own
    ("Observed exception"); the mask-length one is then a plain string, which older dynamo shows as text where it
    shows a message formatted over traced sizes as its records."""
    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    torch._dynamo.reset()
    attend = torch.compile(lambda q, k, v, m: flexgen.flex_attention(q, k, v, block_mask=m), fullgraph=True,
                           dynamic=True, backend="eager")
    for n in (256, 192):
        q = torch.randn(1, 1, n, 16)
        attend(q, q, q, flexgen.create_block_mask(causal, None, None, n, n, device="cpu"))
    q = torch.randn(1, 1, 512, 16)
    with pytest.raises(Exception, match="block_mask was created for a smaller length than it is used for: its "
                                        r"\(Q_LEN, KV_LEN\) differ"):
        attend(q, q, q, flexgen.create_block_mask(causal, None, None, 320, 320, device="cpu"))
