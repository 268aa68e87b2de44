"""Inline PTX in score_mods and mask_mods (PyTorch's inline_asm_elementwise, dsl/inline_asm.py): traced and parsed to
one IR node, checked before anything is compiled, written into the kernels as CUDA asm statements that NVRTC accepts,
refused where it cannot run (a CPU, a backward through it); on a GPU, the kernels and the evaluator against plain
torch math."""
from __future__ import annotations

import importlib.util
import math
import re

import pytest
import torch

import flexgen
from flexgen.cache import jit
from flexgen.cache.ptxas import has_spills
from flexgen.codegen.api import emit, make_spec
from flexgen.dsl import inline_asm, ir
from flexgen.dsl.errors import FlexgenTraceError, UnsupportedOperationError
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import DType
from flexgen.dsl.printer import pretty

HOP = getattr(torch.ops.higher_order, "inline_asm_elementwise", None) if hasattr(torch.ops, "higher_order") else None
needs_hop = pytest.mark.skipif(HOP is None, reason="this torch has no torch.ops.higher_order.inline_asm_elementwise")
needs_nvrtc = pytest.mark.skipif(importlib.util.find_spec("cupy_backends") is None, reason="NVRTC (cupy) is not installed")
gpu = pytest.mark.gpu

FMA = "fma.rn.f32 $0, $1, 0f40000000, $2;"  # 2 * $1 + $2
GE = "{\n.reg .pred p;\nsetp.ge.s32 p, $1, $2;\nselp.u32 $0, 1, 0, p;\n}"  # $1 >= $2 as 1 / 0
DOUBLE_PACKED = "add.f32 $0, $2, $2; add.f32 $1, $3, $3;"
S, H, Q, KV = (ir.input_(n) for n in ("score", "h", "q_idx", "kv_idx"))


def asm_score_text(bias_name="bias"):
    return f"inline_asm_elementwise(score, {bias_name}[kv_idx], asm_str={FMA!r}, constraints='=f,f,f', dtype=torch.float32)"


GE_MASK_TEXT = f"inline_asm_elementwise(q_idx, kv_idx, asm_str={GE!r}, constraints='=r,r,r', dtype=torch.int32) != 0"


@pytest.fixture(autouse=True)
def _isolated(isolated_kernel_cache):
    yield


# ---------------------------------------------------------------- tracing and the text form


@needs_hop
def test_the_torch_op_traces_to_one_node_with_its_operands():
    bias = torch.randn(64)

    def score_mod(score, b, h, q_idx, kv_idx):
        return HOP(score, bias[kv_idx], asm_str=FMA, constraints="=f,f,f", dtype=torch.float32)

    mod = flexgen.trace(score_mod)
    node = mod.expr
    assert node.op == "inline_asm" and node.dtype is DType.FLOAT32
    assert node.attr == (FMA, "=f,f,f", 1)
    assert node.args[0] == S and node.args[1].op == "load" and node.args[1].args == (KV,)


def test_text_and_python_give_the_same_node_and_print_back():
    bias = torch.randn(32)
    text = flexgen.trace(asm_score_text(), kind="score", bias=bias)
    again = flexgen.trace(pretty(text.expr), kind="score", bias=bias)
    assert again.expr == text.expr
    mask = flexgen.trace(GE_MASK_TEXT, kind="mask")
    assert "\n" in mask.expr.args[0].attr[0]  # Python's escapes in the text form's strings
    assert flexgen.trace(pretty(mask.expr), kind="mask").expr == mask.expr


def test_asm_text_cannot_forge_another_nodes_key():
    """The same characters split differently between the assembly and the constraints make two nodes."""
    first = ir.Node("inline_asm", DType.FLOAT32, (S,), ("x,s:y", "z", 1))
    second = ir.Node("inline_asm", DType.FLOAT32, (S,), ("x", "y,s:z", 1))
    assert first.digest != second.digest


def test_asm_mods_compose_and_inline_into_other_mods():
    asm_mask = flexgen.mask_mod(GE_MASK_TEXT)
    window = flexgen.mask_mod("q_idx - kv_idx < 64")
    composed = flexgen.and_masks(asm_mask, window).expr
    written = flexgen.trace(f"({GE_MASK_TEXT}) and q_idx - kv_idx < 64", kind="mask").expr
    assert composed == written

    def shifted(b, h, q_idx, kv_idx):  # a Python mask calling the asm mod at other positions
        return asm_mask(b, h, q_idx + 1, kv_idx)

    node = flexgen.trace(shifted, kind="mask").expr.args[0]
    assert node.op == "inline_asm" and node.args[0].op == "add" and node.args[1] == KV


def test_the_assembly_is_part_of_the_kernel_key():
    a = flexgen.trace(asm_score_text(), kind="score", bias=torch.randn(8)).expr
    b = flexgen.trace(asm_score_text().replace("0f40000000", "0f40400000"), kind="score", bias=torch.randn(8)).expr
    assert a.digest != b.digest


@pytest.mark.parametrize("call, expected", [
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=h,h', dtype=torch.float32)",
     "constraint 'h'"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,f,f', dtype=torch.float32)",
     "name 2 input(s) for 1 tensor"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,=f,f', dtype=torch.float32)",
     "with pack=1 there must be 1"),
    ("inline_asm_elementwise(q_idx, asm_str='mov.b32 $0, $1;', constraints='=f,f', dtype=torch.float32)",
     "input 0 is a int32 value but its constraint is 'f'"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,f', dtype=torch.int32)",
     "output constraint '=f' holds a float32, but dtype is int32"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,f', dtype=torch.bool)",
     "compare it with 0"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $3;', constraints='=f,f', dtype=torch.float32)",
     "names $3, but the constraints give operands $0 to $1"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,f', dtype=torch.float32, pack=0)",
     "pack must be an int from 1 to 4"),
    ("inline_asm_elementwise(score, asm_str='mov.b32 $0, $1;', constraints='=f,f', dtype=torch.float32, "
     "is_pure=False)", "is_pure=True"),
    ("inline_asm_elementwise(score, asm_str='  ', constraints='=f,f', dtype=torch.float32)", "non-empty"),
])
def test_bad_asm_is_refused_when_traced_with_the_reason(call, expected):
    with pytest.raises(FlexgenTraceError, match=re.escape(expected)):
        flexgen.trace(call, kind="score")


def test_only_printable_ascii_reaches_the_kernel_source():
    with pytest.raises(ir.IRTypeError, match="printable ASCII"):
        inline_asm.inline_asm((S,), "mov.b32 $0, $1;\x00", "=f,f", DType.FLOAT32)


# ---------------------------------------------------------------- the CUDA it becomes


def test_the_statement_renames_operands_and_escapes_the_string():
    node = inline_asm.inline_asm((S,), 'mov.u32 %r1, %laneid; // "quoted" ??= \\ $0 $1', "=f,f", DType.FLOAT32)
    text = inline_asm.asm_statement(node, ["x"], "y")
    assert "%%laneid" in text and "%%r1" in text and "%0 %1" in text and "$" not in text
    literal = re.search(r'asm\((".*")\n', text).group(1)
    # one C string literal, ending where it should: every quote and backslash inside it is escaped
    assert re.fullmatch(r'"(?:[^"\\]|\\.)*"', literal)
    assert '\\"quoted\\"' in literal and "\\?\\?=" in literal and "\\\\" in literal
    assert ': "=f"(y)' in text and ': "f"(x)' in text


def test_packed_asm_binds_every_lane_to_the_element_and_keeps_the_first():
    node = inline_asm.inline_asm((S, H), "op $0, $1, $2, $3, $4, $5;", "=f,=f,f,f,r,r", DType.FLOAT32, pack=2)
    text = inline_asm.asm_statement(node, ["s", "h"], "out")
    assert '"=f"(out_lanes[0]), "=f"(out_lanes[1])' in text
    assert '"f"(s), "f"(s), "r"(h), "r"(h)' in text  # input by input, as Triton orders the packed operands
    assert "const float out = out_lanes[0];" in text


def test_the_emitted_kernel_shows_the_asm_as_a_helper_the_mods_call():
    source = emit("fwd", flexgen.trace(asm_score_text(), kind="score", bias=torch.randn(8)),
                  flexgen.trace(GE_MASK_TEXT, kind="mask"), head_dim=64, arch="sm_90a")
    helpers = re.findall(r"__device__ __forceinline__ (?:float|int) (fg_asm_\w+)\(", source)
    assert len(helpers) == 2
    assert "fma.rn.f32 %0, %1, 0f40000000, %2;" in source
    assert "return fg_asm_" in source and "(q_idx, kv_idx) != 0;" in source


@needs_nvrtc
@pytest.mark.parametrize("kind, arch, family", [("fwd", "sm_90a", "sm90"), ("fwd", "sm_80", "sm80"),
                                                ("bwd", "sm_90a", "sm90")])
def test_kernels_with_asm_compile_with_nvrtc_without_spills(kind, arch, family):
    """The backward takes the asm mask and an asm term of the head alone: its derivative by score is plain."""
    mask = flexgen.trace(GE_MASK_TEXT, kind="mask")
    if kind == "fwd":
        score = flexgen.trace(asm_score_text(), kind="score", bias=torch.randn(8))
    else:
        score = flexgen.trace("score + inline_asm_elementwise(h, asm_str='cvt.rn.f32.s32 $0, $1;', "
                              "constraints='=f,r', dtype=torch.float32)", kind="score")
    kernel = jit.get_kernel(make_spec(kind, score, mask, head_dim=64, dtype="bf16", arch=arch, family=family))
    assert kernel.cubin[:4] == b"\x7fELF"
    assert not has_spills(kernel.resources), kernel.resources
    assert "setp.ge.s32" in kernel.ptx


@needs_nvrtc
def test_bad_ptx_fails_to_compile_with_a_hint_and_a_bounded_log():
    from flexgen.cache.errors import FlexgenCompileError

    score = flexgen.trace("inline_asm_elementwise(score, asm_str='frob.f32 $0, $1;', constraints='=f,f', "
                          "dtype=torch.float32)", kind="score")
    with pytest.raises(FlexgenCompileError) as err:
        jit.get_kernel(make_spec("fwd", score, None, head_dim=64, dtype="bf16", arch="sm_90a", family="sm90"))
    message = str(err.value)
    assert "holds inline PTX" in message and "'frob'" in message
    log_part = message.split("--- compiler log ---\n", 1)[1].splitlines()
    assert len(log_part) <= jit.MESSAGE_LOG_LINES + 1 and "more lines in" in log_part[-1]
    assert err.value.log.count("frob") > jit.MESSAGE_LOG_LINES  # the whole log is kept on the error and on disk


# ---------------------------------------------------------------- where it cannot run


def test_a_backward_through_the_asm_is_refused_with_the_reason():
    score = flexgen.trace(asm_score_text(), kind="score", bias=torch.randn(8))
    with pytest.raises(UnsupportedOperationError, match="inline PTX.*no autograd formula"):
        emit("bwd", score, None, head_dim=64, arch="sm_90a")


def test_a_buffer_read_through_the_asm_needs_no_derivative_unless_it_trains():
    from flexgen.dsl.derivative import grad_buffers, grad_score

    expr = flexgen.trace("score + inline_asm_elementwise(bias[kv_idx], asm_str='mul.f32 $0, $1, $1;', "
                         "constraints='=f,f', dtype=torch.float32)", kind="score", bias=torch.randn(8)).expr
    assert grad_score(expr) == ir.const(1.0)
    assert grad_buffers(expr, names=()) == []
    with pytest.raises(UnsupportedOperationError, match="inline PTX"):
        grad_buffers(expr, names=("bias",))


def test_evaluating_on_the_cpu_says_it_needs_cuda():
    expr = flexgen.trace(GE_MASK_TEXT, kind="mask").expr
    with pytest.raises(RuntimeError, match="runs only on a CUDA device.*cpu"):
        evaluate(expr, {"b": 0, "h": 0, "q_idx": torch.arange(4)[:, None], "kv_idx": torch.arange(4)})
    with pytest.raises(RuntimeError, match="runs only on a CUDA device"):
        flexgen.create_block_mask(flexgen.trace(GE_MASK_TEXT, kind="mask"), 1, 1, 256, 256, device="cpu")


def test_a_gradient_through_an_evaluated_asm_is_refused_not_zero():
    """The evaluator's value (the unfused path's score) has no derivative: a backward through it raises, under
    autograd and under torch.func (the compiled unfused path's backward), rather than giving zero."""
    node = inline_asm.inline_asm((S,), "mov.b32 $0, $1;", "=f,f", DType.FLOAT32)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    out = inline_asm.refuse_gradient((x * 1.0).detach(), [x], node)
    assert torch.equal(out, x.detach())
    with pytest.raises(UnsupportedOperationError, match="inline PTX .*mov.b32"):
        (out * 2).sum().backward()

    def through(y):
        return inline_asm.refuse_gradient(y.detach().clone(), [y], node) * 3

    value, vjp = torch.func.vjp(through, x.detach())
    with pytest.raises(UnsupportedOperationError, match="inline PTX"):
        vjp(torch.ones_like(value))
    with torch.no_grad():
        assert not inline_asm.refuse_gradient(x.detach(), [x], node).requires_grad


def test_simplify_leaves_asm_on_constants_alone():
    from flexgen.dsl.simplify import simplify

    node = inline_asm.inline_asm((ir.const(1.5),), "mov.b32 $0, $1;", "=f,f", DType.FLOAT32)
    assert simplify(node) == node


def test_the_evaluators_function_is_one_jiterator_accepts():
    from torch.cuda.jiterator import _CodeParser

    node = flexgen.trace(asm_score_text(), kind="score", bias=torch.randn(8)).expr
    code = inline_asm._jiterator_code(node)
    parsed = _CodeParser(code)
    assert parsed.function_name == "flexgen_inline_asm" and "__int_as_float((int)in0)" in code


# ---------------------------------------------------------------- on the GPU


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _gpu_asm_score_mod(pack, bias, through_torch):
    """2 * score + bias[kv_idx] in PTX: traced from PyTorch's op where this torch has it, else from the text form
    (the same node)."""
    if pack == 1:
        text, constraints, args = FMA, "=f,f,f", "score, bias[kv_idx]"
    else:
        text, constraints, args = DOUBLE_PACKED, "=f,=f,f,f", "score"
    if through_torch:
        def asm_mod(score, b, h, q_idx, kv_idx):
            operands = (score, bias[kv_idx]) if pack == 1 else (score,)
            out = HOP(*operands, asm_str=text, constraints=constraints, dtype=torch.float32, pack=pack)
            return out if pack == 1 else out + bias[kv_idx]
        return asm_mod
    call = f"inline_asm_elementwise({args}, asm_str={text!r}, constraints={constraints!r}, dtype=torch.float32, pack={pack})"
    return flexgen.score_mod(call if pack == 1 else call + " + bias[kv_idx]", bias=bias)


@gpu
@pytest.mark.parametrize("through_torch", [False, pytest.param(True, marks=needs_hop)])
@pytest.mark.parametrize("pack", [1, 2])
def test_gpu_asm_score_mod_matches_the_plain_one(pack, through_torch):
    from test_gpu_forward import assert_matches, fresh_seed, poison

    seed = fresh_seed()
    B, Hn, L, D = 2, 3, 300, 64
    q, k, v = (torch.randn(B, Hn, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    bias = torch.randn(L, device="cuda")
    asm_mod = _gpu_asm_score_mod(pack, bias, through_torch)

    def plain(score, b, h, q_idx, kv_idx):
        return score * 2.0 + bias[kv_idx]

    mask = flexgen.create_block_mask(_causal, None, None, L, L, device="cuda")
    poison(((B, Hn, L, D), q.dtype), ((B, Hn, L), torch.float32))
    out, lse = flexgen.flex_attention(q, k, v, score_mod=asm_mod, block_mask=mask, return_lse=True)
    assert_matches(out, lse, q, k, v, plain, _causal, seed=seed, what=f"asm score_mod pack={pack}")


@gpu
def test_gpu_asm_mask_builds_the_causal_lists_and_attends_as_causal():
    from test_gpu_forward import assert_matches, fresh_seed

    asm_causal = flexgen.mask_mod(GE_MASK_TEXT)
    L = 512
    bm = flexgen.create_block_mask(asm_causal, 1, 1, L, L, device="cuda", BLOCK_SIZE=64)
    ref = flexgen.create_block_mask(_causal, 1, 1, L, L, device="cuda", BLOCK_SIZE=64)
    assert torch.equal(bm.to_dense(), ref.to_dense())
    seed = fresh_seed()
    q, k, v = (torch.randn(1, 2, L, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse = flexgen.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert_matches(out, lse, q, k, v, None, _causal, seed=seed, what="asm mask_mod")


@gpu
def test_gpu_evaluator_agrees_with_the_plain_expression_and_with_torch():
    q_idx = torch.arange(200, device="cuda")[:, None]
    kv_idx = torch.arange(300, device="cuda")
    expr = flexgen.trace(GE_MASK_TEXT, kind="mask").expr
    got = evaluate(expr, {"b": 0, "h": 0, "q_idx": q_idx, "kv_idx": kv_idx})
    assert torch.equal(got, (q_idx >= kv_idx).expand(200, 300))
    score = torch.randn(200, 300, device="cuda")
    node = inline_asm.inline_asm((S,), FMA.replace("$2", "$1"), "=f,f", DType.FLOAT32)  # 2x + x
    mine = evaluate(node, {"score": score}, float_dtype=torch.float32)
    # 2x + x is exact in float64, so rounding it once to float32 is what one fused multiply-add gives
    assert torch.equal(mine, (3.0 * score.double()).float())
    if HOP is not None:
        theirs = HOP(score, asm_str=FMA.replace("$2", "$1"), constraints="=f,f", dtype=torch.float32)
        assert torch.equal(mine, theirs)


@gpu
def test_gpu_backward_through_asm_fails_at_backward_not_at_forward():
    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    asm_mod = flexgen.score_mod("inline_asm_elementwise(score, asm_str='mul.f32 $0, $1, 0f3F000000;', "
                                "constraints='=f,f', dtype=torch.float32)")
    out = flexgen.flex_attention(q, k, v, score_mod=asm_mod)
    assert not torch.isnan(out).any()
    with torch.no_grad():
        ref = flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * 0.5)
    assert (out.float() - ref.float()).abs().max().item() <= 2 * math.ldexp(1, -7) * ref.float().abs().max().item()
    with pytest.raises(UnsupportedOperationError, match="inline PTX"):
        out.sum().backward()
