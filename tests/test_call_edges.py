"""flex_attention at PyTorch's edges, on the CPU: what is decided before any launch (inputs the kernels
cannot read as they are, kernel_options, grid limits, return_aux, a key/value batch of 1, output layouts,
misplaced BlockMasks), the lse gradient's wiring and its algebra, and the fake kernels' checks.
tests/test_gpu_edges.py runs the same calls through the kernels."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flexgen
from flexgen import ops, warnings_once
from flexgen.codegen.options import OptionError, call_options
from flexgen.runtime.arguments import kernel_ready
from flexgen.runtime.backward import fold_lse_grad
from flexgen.runtime.call_checks import MAX_GRID_YZ, dim_order, empty_like_layout
from flexgen.runtime.plan import make_spec
from flexgen.variant import variant_key
from reference_launches import reference_backward, reference_forward, reference_launches

META = "meta"
B, H, L, D = 2, 4, 256, 64


def meta(*shape, requires_grad=False):
    return torch.empty(*shape, device=META, dtype=torch.bfloat16, requires_grad=requires_grad)


@pytest.fixture
def hopper(monkeypatch):
    """make_spec asks the device for its architecture; a CPU tensor stands in for an sm_90 one."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")


@pytest.fixture
def spy_ops(monkeypatch):
    """The arguments each flexgen op was called with (the ops still run, on meta tensors)."""
    calls = {"fwd": [], "bwd": []}
    real_fwd, real_bwd = torch.ops.flexgen.attention_fwd.default, torch.ops.flexgen.attention_bwd.default

    def fwd(*args):
        calls["fwd"].append(args)
        return real_fwd(*args)

    def bwd(*args):
        calls["bwd"].append(args)
        return real_bwd(*args)

    monkeypatch.setattr(ops, "attention_bwd", bwd)
    monkeypatch.setattr(ops, "attention_fwd", fwd)
    return calls


# ---------------------------------------------------------------- 1. inputs the kernels cannot read as they are


def test_kernel_ready_copies_misaligned_views_and_keeps_aligned_ones():
    buf = torch.randn(1 << 16, dtype=torch.bfloat16)
    shape, strides = (2, 3, 40, 64), (3 * 40 * 64, 40 * 64, 64, 1)
    misaligned = torch.as_strided(buf, shape, strides, 997)  # base pointer 1994 bytes in
    aligned = torch.as_strided(buf, shape, strides, 1024)
    odd_rows = torch.randn(2, 3, 40, 70, dtype=torch.bfloat16)[..., :64]  # row stride 70: not 16 bytes
    strided_last = torch.randn(2, 3, 64, 40, dtype=torch.bfloat16).transpose(2, 3)
    assert misaligned.data_ptr() % 16 and not aligned.data_ptr() % 16
    for bad in (misaligned, odd_rows, strided_last):
        ready = kernel_ready(bad)
        assert ready.is_contiguous() and ready.data_ptr() % 16 == 0 and torch.equal(ready, bad)
    assert kernel_ready(aligned) is aligned
    kv1 = torch.randn(1, 3, 40, 64, dtype=torch.bfloat16).expand(4, 3, 40, 64)  # stride 0 is whole rows
    assert kernel_ready(kv1) is kv1


class _Stop(Exception):
    pass


def test_backward_hands_grad_out_through_kernel_ready(monkeypatch):
    """grad_out is a user tensor too (any view): the backward makes it kernel-ready before planning."""
    from flexgen.runtime import backward

    import contextlib

    seen = []
    monkeypatch.setattr(backward, "kernel_ready", lambda t: seen.append(t) or kernel_ready(t))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(backward, "current_stream_ptr", lambda *a, **k: (_ for _ in ()).throw(_Stop()))  # before any launch
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    grad_out = torch.as_strided(torch.randn(1 << 14, dtype=torch.bfloat16), q.shape, q.stride(), 997)
    launch = object.__new__(backward.BackwardLaunch)  # (planned for aligned inputs; the gradient's layout is free)
    launch.want, launch.copies, launch.dtype, launch.device = (True, True, True), (False,) * 4, q.dtype, q.device
    with pytest.raises(_Stop):
        launch.run(q, q, q, q, torch.zeros(1, 2, 40), grad_out)
    assert any(t is grad_out for t in seen) and kernel_ready(grad_out).data_ptr() % 16 == 0


# ---------------------------------------------------------------- 2. a differentiable lse


def test_lse_carries_a_gradient_into_the_backward_op(spy_ops):
    q, k, v = (meta(B, H, L, D, requires_grad=True) for _ in range(3))
    out, lse = flexgen.flex_attention(q, k, v, return_lse=True)
    assert lse.requires_grad and lse.grad_fn is not None
    (out.sum() * 0.5 + (lse ** 2).sum()).backward()
    (args,) = spy_ops["bwd"]
    grad_out, grad_lse = args[5], args[6]
    assert grad_out.shape == out.shape and grad_lse is not None and grad_lse.shape == lse.shape
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_only_lse_used_gives_zero_grad_out(spy_ops):
    q, k, v = (meta(B, H, L, D, requires_grad=True) for _ in range(3))
    _, lse = flexgen.flex_attention(q, k, v, return_lse=True)
    lse.sum().backward()
    (args,) = spy_ops["bwd"]
    assert args[5].shape == (B, H, L, D) and args[6].shape == (B, H, L)


def test_output_alone_passes_no_lse_gradient(spy_ops):
    q, k, v = (meta(B, H, L, D, requires_grad=True) for _ in range(3))
    flexgen.flex_attention(q, k, v).sum().backward()
    (args,) = spy_ops["bwd"]
    assert args[6] is None  # no zeros tensor to subtract: the delta stays the kernels' own


def _kernel_style_grads(q, k, v, do, dlse, scale):
    """The kernels' backward in float64 (FlashAttention-2: delta = rowsum(dO * O), dS = P (dP - delta)),
    with fold_lse_grad applied to delta: dq, dk, dv."""
    s = scale * q @ k.transpose(-1, -2)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = p @ v
    delta = (do * o).sum(-1)
    fold_lse_grad(delta, lse, dlse)
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - delta[..., None])
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


@pytest.mark.parametrize("loss", ["linear", "z_loss"])
def test_lse_gradient_folded_into_delta_matches_autograd(loss):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 33, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 0.3
    s = scale * q @ k.transpose(-1, -2)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ v
    a, b = torch.randn(()).item(), torch.randn(()).item()
    total = out.sum() * a + (lse.sum() * b if loss == "linear" else (lse ** 2).sum() * b)
    want = torch.autograd.grad(total, (q, k, v))
    do = torch.full_like(out, a)
    dlse = torch.full_like(lse, b) if loss == "linear" else 2 * b * lse.detach()
    got = _kernel_style_grads(q.detach(), k.detach(), v.detach(), do, dlse, scale)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_lse_gradient_of_a_row_that_saw_nothing_is_dropped():
    delta = torch.zeros(1, 1, 2)
    lse = torch.tensor([[[-math.inf, 1.0]]])
    fold_lse_grad(delta, lse, 2 * lse)  # z-loss: 2 lse is -inf on the empty row
    assert delta.tolist() == [[[0.0, -2.0]]]


@pytest.mark.parametrize("route", ["eager", "compiled", "eager-route", "planned"])
def test_lse_gradient_reaches_the_backward_under_torch_compile(monkeypatch, route):
    """The kernels swapped for the float64 reference on the CPU: gradients of out * a + lse * b + lse**2 * c,
    through the ops eagerly, through torch.compile (AOTAutograd), through the ops' dispatcher-free twin that
    eager CUDA calls take (ops._EagerAttention), and through a planned call (eager_plans.py: its first and its
    second call) equal float64 autograd of the same loss."""
    from flexgen import attention, eager_plans, ops
    from flexgen.runtime import backward, forward

    if route in ("eager-route", "planned"):
        monkeypatch.setattr(ops, "eager_route_ok", lambda *a: True)
    if route == "eager-route":
        monkeypatch.setattr(eager_plans, "signature", lambda *a: None)
    made = reference_launches(monkeypatch) if route == "planned" else []
    monkeypatch.setattr(attention, "_check_inputs", lambda *a: None)
    monkeypatch.setattr(attention, "unfused_reason", lambda *a: None)  # CPU tensors through the ops, not the unfused path
    monkeypatch.setattr(forward, "forward_call", reference_forward)
    monkeypatch.setattr(backward, "backward_call", reference_backward)
    torch._dynamo.reset()
    torch.manual_seed(1)
    x = [torch.randn(1, 2, 64, 32, requires_grad=True) for _ in range(3)]

    def loss(q, k, v):
        out, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest(lse=True))
        return out.sum() * 0.7 + aux.lse.sum() * -1.3 + (aux.lse ** 2).sum() * 0.2

    fn = torch.compile(loss, backend="aot_eager", fullgraph=True) if route == "compiled" else loss
    x64 = [t.detach().double().requires_grad_() for t in x]
    out, lse = flexgen.reference_attention(*x64, return_lse=True)
    want = torch.autograd.grad(out.sum() * 0.7 + lse.sum() * -1.3 + (lse ** 2).sum() * 0.2, x64)
    for _ in range(2):
        got = torch.autograd.grad(fn(*x), x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4)
    if route == "planned":  # planned once, run twice (the backward with the first layout of grad_out)
        assert made == ["fwd", "bwd"]


# ---------------------------------------------------------------- 3. return_aux


def test_aux_classes_are_pytorchs():
    from torch.nn.attention import flex_attention as torch_flex

    if hasattr(torch_flex, "AuxRequest"):
        assert flexgen.AuxRequest is torch_flex.AuxRequest and flexgen.AuxOutput is torch_flex.AuxOutput


def test_return_aux_lse():
    q, k, v = (meta(B, H, L, D) for _ in range(3))
    out, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest(lse=True))
    assert isinstance(aux, flexgen.AuxOutput) and aux.max_scores is None
    assert out.shape == q.shape and aux.lse.shape == (B, H, L) and aux.lse.dtype == torch.float32
    out, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest())
    assert aux.lse is None and aux.max_scores is None
    out, lse = flexgen.flex_attention(q, k, v, return_lse=True)  # PyTorch's deprecated spelling still works
    assert lse.shape == (B, H, L)


def test_return_aux_max_scores():
    q, k, v = (meta(B, H, L, D, requires_grad=True) for _ in range(3))
    out, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (B, H, L) and aux.max_scores.dtype == torch.float32
    assert not aux.max_scores.requires_grad  # a max: no gradient, as PyTorch's
    out, aux = flexgen.flex_attention(q, k, v, return_aux=flexgen.AuxRequest(lse=True, max_scores=True))
    assert aux.lse.shape == aux.max_scores.shape == (B, H, L)
    out.sum().backward()


def test_max_scores_is_a_forward_option_of_both_families(hopper):
    q = torch.empty(1, 1, 128, 128, dtype=torch.bfloat16)  # (not a decoding query)
    spec = make_spec("fwd", q, None, flexgen.variants.causal, None, max_scores=True)
    assert spec.family == "sm90" and spec.option("max_scores") is True
    plain = make_spec("fwd", q, None, flexgen.variants.causal, None)
    assert plain.family == "sm90" and plain.option("max_scores") is None  # other kernels' specs stay as they were
    assert make_spec("bwd", q, None, None, None, max_scores=True).option("max_scores") is None
    sm80 = make_spec("fwd", q, None, None, {"family": "sm80"}, max_scores=True)
    assert sm80.family == "sm80" and sm80.option("max_scores") is True


@pytest.mark.parametrize("family", ["sm80", "sm90"])
def test_max_scores_kernel_source(family):
    """The row-max output is in the source only where asked for; the others render as before."""
    plain = flexgen.emit("fwd", score_mod=flexgen.variants.softcap(20.0), mask_mod=flexgen.variants.causal,
                         head_dim=64, family=family)
    with_max = flexgen.emit("fwd", score_mod=flexgen.variants.softcap(20.0), mask_mod=flexgen.variants.causal,
                            head_dim=64, family=family, max_scores=True)
    assert "float* max_scores;" not in plain and "p.max_scores[" not in plain
    assert "float* max_scores;" in with_max and "p.max_scores[" in with_max


def test_return_aux_errors():
    q = meta(B, H, L, D)
    with pytest.raises(ValueError, match="not both"):
        flexgen.flex_attention(q, q, q, return_lse=True, return_aux=flexgen.AuxRequest(lse=True))
    with pytest.raises(TypeError, match="AuxRequest"):
        flexgen.flex_attention(q, q, q, return_aux={"lse": True})


# ---------------------------------------------------------------- 4. a key/value batch of 1


def test_kv_batch_of_one_is_broadcast_without_a_copy(spy_ops):
    q = meta(3, H, L, D, requires_grad=True)
    k, v = meta(1, 2, L, D, requires_grad=True), meta(1, 2, L, D, requires_grad=True)
    out = flexgen.flex_attention(q, k, v, enable_gqa=True)
    (args,) = spy_ops["fwd"]
    for t in args[1:3]:
        assert t.shape == (3, 2, L, D) and t.stride(0) == 0  # a view of the batch-1 tensor
    out.sum().backward()
    assert k.grad.shape == k.shape and v.grad.shape == v.shape  # summed over the query batch


def test_kv_batch_must_be_one_or_the_querys():
    q, kv = meta(3, H, L, D), meta(2, H, L, D)
    with pytest.raises(ValueError, match="batch sizes differ"):
        flexgen.flex_attention(q, kv, kv)
    with pytest.raises(ValueError, match="batch sizes differ"):
        flexgen.flex_attention(q, meta(1, H, L, D), meta(3, H, L, D))


# ---------------------------------------------------------------- 5. output layouts


def test_output_keeps_the_querys_dimension_order():
    q = meta(B, L, H, D).transpose(1, 2)  # (B, L, H, D) memory, as a (B, H, L, D) view
    k = meta(B, H, L, D)
    out = flexgen.flex_attention(q, k, k)
    assert out.shape == q.shape and out.stride() == q.stride()
    out = flexgen.flex_attention(k, k, k)
    assert out.is_contiguous()


def test_gradients_keep_their_inputs_dimension_order():
    q = meta(B, L, H, D).transpose(1, 2).requires_grad_()
    k = meta(H, B, L, D).transpose(0, 1).requires_grad_()
    v = meta(B, H, L, D, requires_grad=True)
    dq, dk, dv, _ = torch.ops.flexgen.attention_bwd(q, k, v, q, meta(B, H, L), q, None, *([None] * 8), [], 0.1,
                                                    "unused", 0.0, None, True, True, True, [], False)
    assert dq.stride() == q.stride() and dk.stride() == k.stride() and dv.is_contiguous()


def test_dim_order():
    t = torch.empty(2, 5, 3, 8).permute(0, 2, 1, 3)  # (2, 3, 5, 8) with strides (120, 8, 24, 1)
    assert dim_order(t) == [0, 2, 1, 3]
    expanded = torch.empty(1, 5, 3, 8).expand(4, 5, 3, 8)  # stride-0 batch: outermost, not innermost
    assert dim_order(expanded) == [0, 1, 2, 3]
    d_strided = torch.empty(2, 3, 8, 5).transpose(2, 3)  # the head dim stays innermost all the same
    assert dim_order(d_strided)[-1] == 3
    made = empty_like_layout(t)
    assert made.shape == t.shape and made.stride() == t.stride()


# ---------------------------------------------------------------- 6. kernel_options


@pytest.mark.parametrize("flag", ["deterministic", "precise_math", "pingpong", "persistent", "fold_score"])
@pytest.mark.parametrize("value", ["False", 0, 1, None])
def test_flags_must_be_bools(flag, value):
    with pytest.raises(OptionError, match=f"{flag} must be True or False"):
        call_options({flag: value})


def test_misspelled_options_get_the_closest_name():
    for wrong, right in (("BLOCK_MM", "BLOCK_M"), ("deterministc", "deterministic"), ("block_m1", "BLOCK_M1"),
                         ("USE_TMAA", "USE_TMA")):
        with pytest.raises(OptionError, match=f"unknown kernel_options '{wrong}'; did you mean '{right}'"):
            call_options({wrong: 1})


def test_pytorch_options_are_ignored_with_one_warning_per_name(monkeypatch):
    monkeypatch.setattr(warnings_once, "_seen", set())
    given = {"USE_TMA": True, "BACKEND": "TRITON", "BLOCK_M2": 32, "num_warps": 4, "WRITE_DQ": False}
    with pytest.warns(UserWarning) as record:
        assert call_options(given) == {"num_warps": 4}
    assert sorted(str(w.message).split("'")[1] for w in record) == ["BACKEND", "BLOCK_M2", "USE_TMA", "WRITE_DQ"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call_options(given)  # warned once per process already


def test_pass_prefixes_set_their_pass_tile_over_the_plain_name(monkeypatch):
    """Newer PyTorch's fwd_ / bwd_ prefixes: fwd_BLOCK_M is the forward's BLOCK_M, bwd_BLOCK_M1 the backward's
    BLOCK_M1, each winning over the plain name whatever the order; Triton's prefixed knobs are ignored."""
    monkeypatch.setattr(warnings_once, "_seen", set())
    with pytest.warns(UserWarning) as record:
        got = call_options({"fwd_BLOCK_M": 64, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_N1": 32, "bwd_BLOCK_N1": 128,
                            "bwd_BLOCK_M1": 64, "bwd_BLOCK_M2": 32, "fwd_num_stages": 3})
    assert got == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_M1": 64, "BLOCK_N1": 128}
    assert sorted(str(w.message).split("'")[1] for w in record) == ["BLOCK_M2", "fwd_num_stages"]
    with pytest.raises(OptionError, match="BLOCK_M=0; it must be a positive int"):
        call_options({"fwd_BLOCK_M": 0})


@pytest.mark.parametrize("wrong", ["fwd_BLOCK_M1", "bwd_BLOCK_M", "fwd_deterministic", "bwd_family"])
def test_a_prefix_takes_only_its_own_pass_tile(wrong):
    with pytest.raises(OptionError, match=f"'{wrong}': the {wrong[:3]}_ prefix takes {wrong[:3]}_BLOCK_"):
        call_options({wrong: 64})


def test_pytorch_options_pass_through_flex_attention(monkeypatch):
    monkeypatch.setattr(warnings_once, "_seen", set())
    q = meta(B, H, L, D)
    with pytest.warns(UserWarning, match="ROWS_GUARANTEED_SAFE"):
        flexgen.flex_attention(q, q, q, kernel_options={"ROWS_GUARANTEED_SAFE": True, "PRESCALE_QK": False})


@pytest.mark.parametrize("options,match", [
    ({"BLOCK_M": 16}, r"BLOCK_M=16 with num_warps=4; allowed values are \(64, 128\)"),
    ({"BLOCK_M": 3}, r"BLOCK_M=3 .*allowed values are \(64, 128\)"),
    ({"BLOCK_M": 64, "num_warps": 8}, r"allowed values are \(128, 256\)"),
    ({"BLOCK_N": 48}, r"BLOCK_N=48; allowed values are \(16, 32, 64, 128\)"),
    ({"num_warps": 3}, r"num_warps=3; allowed values are \(4, 8\)"),
    ({"num_stages": 3}, r"num_stages=3; allowed values are \(1, 2\)"),
    ({"BLOCK_M": 0}, "positive int"),
    ({"BLOCK_N": 64.0}, "positive int"),
])
def test_forward_tiles_are_checked_before_compiling(hopper, options, match):
    q = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        make_spec("fwd", q, None, None, {"family": "sm80", **options})


def test_good_forward_tiles_plan(hopper):
    q = torch.empty(1, 1, 4, 128, dtype=torch.bfloat16)
    spec = make_spec("fwd", q, None, None, {"family": "sm80", "BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8})
    assert (spec.family, spec.block_m, spec.block_n, spec.num_warps) == ("sm80", 128, 32, 8)


# ---------------------------------------------------------------- 7. grid limits


@pytest.mark.parametrize("shape", [(MAX_GRID_YZ + 1, 1, 8, 64), (1, MAX_GRID_YZ + 1, 8, 64)], ids=["batch", "heads"])
def test_grid_limits_are_refused_before_launch(shape):
    q = meta(*shape)
    with pytest.raises(ValueError, match="65535"):
        flexgen.flex_attention(q, q, q)


def test_grid_limit_edge_is_accepted():
    q = meta(MAX_GRID_YZ, 1, 8, 64)
    assert flexgen.flex_attention(q, q, q).shape == q.shape


# ---------------------------------------------------------------- 8. the fake kernels check what eager checks


def _fake_fwd(q, k, key, scale=0.125, mask=None):
    masks = ops.mask_tensors(mask)
    return torch.ops.flexgen.attention_fwd(q, k, k, *masks, [], scale, key, 0.0, None, False, False)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf])
def test_non_finite_scale(scale):
    q = meta(B, H, L, D)
    with pytest.raises(ValueError, match="scale must be a finite number"):
        flexgen.flex_attention(q, q, q, scale=scale)
    with FakeTensorMode(), pytest.raises(ValueError, match="scale must be a finite number"):
        x = torch.empty(B, H, L, D, dtype=torch.bfloat16)
        _fake_fwd(x, x, variant_key("", "", None, None), scale=scale)


def test_fake_kernel_checks_kernel_options():
    key = variant_key("", "", None, {"pingpong": "False"})  # as a variant registered by another route
    with FakeTensorMode(), pytest.raises(OptionError, match="pingpong must be True or False"):
        x = torch.empty(B, H, L, D, dtype=torch.bfloat16)
        _fake_fwd(x, x, key)


def test_fake_kernel_checks_the_block_mask_against_the_inputs():
    mask = flexgen.create_block_mask(flexgen.variants.causal, None, None, 2 * L, 2 * L, device="cpu").to(META)
    key = variant_key("", flexgen.variants.causal.token, tuple(mask.BLOCK_SIZE), None)
    q = meta(B, H, L, D)
    with pytest.raises(ValueError, match="Q_LEN"):
        _fake_fwd(q, q, key, mask=mask)  # meta tensors run the fake kernel
    with pytest.raises(ValueError, match="Q_LEN"):
        flexgen.flex_attention(q, q, q, block_mask=mask)


@pytest.mark.parametrize("options,match", [({"family": "sm80", "BLOCK_M": 16}, "allowed values"),
                                           ({"family": "sm90", "BLOCK_N": 64}, "tiles are fixed")])
def test_fake_kernel_on_a_cuda_device_plans_the_kernel(hopper, options, match):
    """Fake CUDA tensors (what torch.compile traces on a GPU) have an architecture: the fake kernel plans."""
    key = variant_key("", "", None, options)
    with FakeTensorMode():
        x = torch.empty(B, H, L, D, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(ValueError, match=match):
            _fake_fwd(x, x, key)
        _fake_fwd(x, x, variant_key("", "", None, {"BLOCK_M": 64}))  # a tile the family takes


def test_fake_kernel_checks_the_grid():
    q = meta(1, MAX_GRID_YZ + 1, 8, 64)
    with pytest.raises(ValueError, match="65535"):
        _fake_fwd(q, q, "unused")


# ---------------------------------------------------------------- 9. a BlockMask where a mask_mod belongs


def test_block_mask_passed_as_a_mod():
    bm = flexgen.create_block_mask(flexgen.variants.causal, None, None, L, L, device="cpu").to(META)
    q = meta(B, H, L, D)
    with pytest.raises(TypeError, match="pass it as block_mask="):
        flexgen.flex_attention(q, q, q, bm)
    for make in (lambda: flexgen.mask_mod(bm), lambda: flexgen.score_mod(bm),
                 lambda: flexgen.create_block_mask(bm, None, None, L, L, device=META)):
        with pytest.raises(TypeError, match="block_mask="):
            make()
    with pytest.raises(TypeError, match="mask_block="):
        flexgen.emit(mask_mod=bm)
    with pytest.raises(TypeError, match="create_block_mask"):
        flexgen.flex_attention(q, q, q, block_mask=lambda b, h, qi, ki: qi >= ki)


def test_torch_block_mask_passed_as_a_mod():
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device="cpu")
    with pytest.raises(TypeError, match="pass it as block_mask="):
        flexgen.mask_mod(bm)
    q = meta(B, H, 128, D)
    with pytest.raises(TypeError, match="pass it as block_mask="):
        flexgen.flex_attention(q, q, q, score_mod=bm)


@pytest.mark.parametrize("shape", [(2, 1, 128, 16), (4, 2, 64, 16)])
@pytest.mark.parametrize("order", [(0, 1, 2, 3), (1, 0, 2, 3), (0, 2, 1, 3), (2, 0, 1, 3)])
def test_output_strides_order_as_the_querys_with_size_one_dims(shape, order):
    """PyTorch's test compares the ranks of the strides; a size-1 dimension's stride ties with another's."""
    def ranks(strides):  # inner first; of equal strides the inner dimension first (PyTorch's fill order)
        fill = sorted(range(4), key=lambda i: (strides[i], -i))
        return [fill.index(i) for i in range(4)]

    q = torch.empty(shape).permute(order)
    assert ranks(empty_like_layout(q).stride()) == ranks(q.stride())


def test_the_unfused_output_strides_order_as_the_querys_with_a_size_one_dim():
    q = torch.randn(2, 1, 128, 16).permute(0, 2, 1, 3)  # (2, 128, 1, 16), strides (2048, 16, 2048, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        out = flexgen.flex_attention(q, q, q)
    assert out.stride() == q.stride()


def _row_major_by_definition(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != expected:
            return False
        expected *= size
    return True


@pytest.mark.parametrize("shape", [(1, 2, 5, 8), (2, 1, 5, 8), (1, 1, 1, 8), (3, 2, 5, 8), (2, 3, 1, 1)])
def test_row_major_is_exactly_the_row_major_strides(shape):
    """row_major (its strides cached per shape) against the definition, on layouts whose size-1 dims carry any
    stride: permuted, expanded, sliced, restrided."""
    from flexgen.runtime.call_checks import row_major

    base = torch.empty(shape)
    layouts = [base, base.transpose(1, 2).contiguous().transpose(1, 2), base[..., ::2], base.expand(*shape),
               base[:1].expand(4, *shape[1:]), base.as_strided(shape, (1,) * len(shape)),
               torch.empty_permuted(shape, (0, 2, 1, 3))]
    for t in layouts:
        assert row_major(t) == _row_major_by_definition(t), (t.shape, t.stride())
        assert row_major(t) == _row_major_by_definition(t)  # (the second time from the cache)


def test_layout_allocator_allocates_like_empty_like_layout():
    """The allocator a planned launch keeps makes, at every call, a fresh tensor of the layout empty_like_layout
    gives."""
    from flexgen.runtime.call_checks import layout_allocator

    likes = [torch.empty(2, 3, 5, 8), torch.empty(2, 5, 3, 8).transpose(1, 2), torch.empty(1, 3, 5, 8).expand(4, 3, 5, 8),
             torch.empty(1, 3, 5, 8).transpose(1, 2)]
    for like in likes:
        for shape, dtype in ((None, None), ((like.shape[0], like.shape[1], 7, 8), torch.float32)):
            make = layout_allocator(like, shape, dtype)
            a, b = make(), make()
            want = empty_like_layout(like, shape, dtype)
            assert a.shape == want.shape and a.stride() == want.stride() and a.dtype == want.dtype
            assert a.data_ptr() != b.data_ptr()
