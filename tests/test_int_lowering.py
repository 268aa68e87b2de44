"""The kernels' integer arithmetic is the IR evaluator's: int32 / int64 `+ - *`, negation and abs wrap
around, `//` and `%` floor (INT_MIN // -1 and INT_MIN % -1 as torch gives them), floats cast to integers
saturate. Checked on the host (g++ running the lowered code), through NVRTC (random programs compile
for sm_90a) and, on a GPU, in the attention kernel itself (mask pattern bit for bit)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexgen
from flexgen.codegen.api import make_spec
from flexgen.codegen.lower import lower_mods
from flexgen.codegen.spec import KernelSpec
from flexgen.dsl import ir
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import DType

from ir_strategies import make_buffers, mask_programs, program_mod, wide_masks
from test_lower import HAS_NVRTC, Case, check, needs_gxx

Q, KV = ir.input_("q_idx"), ir.input_("kv_idx")
INT_MIN = ir.const(-(2**31))
LL_MIN = ir.const(-(2**63), DType.INT64)


def _torch_int(op, a: int, b: int, dtype) -> int:
    """torch's own answer on the CPU (not a guess)."""
    x, y = torch.tensor([a], dtype=dtype), torch.tensor([b], dtype=dtype)
    return int({"floordiv": lambda: torch.div(x, y, rounding_mode="floor"), "mod": lambda: torch.remainder(x, y),
                "fmod": lambda: torch.fmod(x, y), "mul": lambda: x * y, "add": lambda: x + y}[op]()[0])


@pytest.mark.parametrize("op", ["floordiv", "mod", "fmod"])
@pytest.mark.parametrize("dtype", [DType.INT32, DType.INT64])
def test_int_min_by_minus_one_is_torchs(op, dtype):
    lo = -(2**31) if dtype is DType.INT32 else -(2**63)
    e = ir.binary(op, ir.const(lo, dtype), ir.cast(ir.binary("sub", ir.const(0), ir.const(1)), dtype))
    tdt = torch.int32 if dtype is DType.INT32 else torch.int64
    want = _torch_int(op, lo, -1, tdt)
    assert int(evaluate(e, {})) == want
    assert want == (lo if op == "floordiv" else 0)


@needs_gxx
def test_wrapping_corner_cases_run_on_the_host(tmp_path):
    """Each would be undefined behaviour as plain signed C arithmetic; the host build (g++ -O2) would
    then be free to fold them."""
    minus_one = ir.binary("sub", ir.cast(Q, DType.INT32), ir.binary("add", Q, ir.const(1)))  # -1, not a constant
    int_max = ir.const(2**31 - 1)
    exprs = [
        ir.binary("gt", ir.binary("add", Q, ir.const(2147483000)), Q),
        ir.binary("ge", ir.binary("mul", ir.binary("mul", Q, KV), ir.const(4096)), ir.const(0)),
        ir.binary("eq", ir.binary("floordiv", ir.binary("add", INT_MIN, Q), minus_one), ir.binary("sub", ir.const(0), ir.binary("add", INT_MIN, Q))),
        ir.binary("eq", ir.binary("mod", ir.binary("sub", INT_MIN, Q), minus_one), KV),
        ir.binary("eq", ir.binary("fmod", ir.binary("sub", INT_MIN, Q), minus_one), KV),
        ir.binary("lt", ir.unary("abs", ir.binary("sub", INT_MIN, Q)), KV),
        ir.binary("lt", ir.unary("neg", ir.binary("sub", INT_MIN, KV)), Q),
        ir.binary("gt", ir.binary("sub", ir.binary("sub", ir.const(0), int_max), ir.binary("add", Q, ir.const(2))), KV),
        ir.binary("lt", ir.binary("add", ir.cast(Q, DType.INT64), ir.const(2**63 - 100, DType.INT64)), ir.cast(KV, DType.INT64)),
        ir.binary("ge", ir.binary("mul", ir.cast(Q, DType.INT64), ir.const(2**60, DType.INT64)), ir.const(0, DType.INT64)),
        ir.binary("ge", ir.cast(ir.binary("mul", ir.cast(Q, DType.FLOAT32), ir.const(3e7)), DType.INT32), ir.const(2**31 - 1)),
        ir.binary("le", ir.cast(ir.binary("mul", ir.cast(ir.binary("sub", ir.const(0), Q), DType.FLOAT32), ir.const(1e17)), DType.INT64), ir.const(-(2**63), DType.INT64)),
    ]
    check([Case("mask", e) for e in exprs], tmp_path, seed=3)


@needs_gxx
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.data_too_large])
@given(exprs=st.lists(wide_masks(max_depth=3), min_size=25, max_size=25), seed=st.integers(0, 2**16))
def test_random_wide_masks_run_on_the_host_like_the_evaluator(tmp_path, exprs, seed):
    buffers = {name: (t, t) for name, t in make_buffers(seed).items()}
    check([Case("mask", e, buffers={b.name: buffers[b.name] for b in ir.buffers_of(e)}) for e in exprs], tmp_path, seed)


def test_plain_operators_where_no_overflow_is_possible():
    """Index differences and small offsets keep C's operators (readable, and the same PTX as before);
    whatever may overflow goes through the wrapping helpers."""
    def mask_fn(source):
        return lower_mods(make_spec("fwd", None, flexgen.mask_mod(source), 64, "bf16", "sm_90a")).mask_mod_fn

    assert "return (q_idx - kv_idx) <= 256;" in mask_fn("q_idx - kv_idx <= 256")
    assert "(q_idx - kv_idx) * 2" in mask_fn("(q_idx - kv_idx) * 2 < 7")
    assert "fg_add(q_idx, 2147483000) > q_idx" in mask_fn("q_idx + 2147483000 > q_idx")
    assert "fg_mul(fg_mul(q_idx, kv_idx), 4096)" in mask_fn("q_idx * kv_idx * 4096 >= 0")
    assert "(-(q_idx - 5)) < kv_idx" in mask_fn("-(q_idx - 5) < kv_idx")
    assert "fg_neg(fg_sub(kv_idx, fg_mul(q_idx, 3)))" in mask_fn("-(kv_idx - q_idx * 3) < 0")
    assert "fg_float_to_int(" in mask_fn("(q_idx * 1.5).int() < kv_idx")
    assert "((q_idx - kv_idx) % 7)" in mask_fn("torch.fmod(q_idx - kv_idx, 7) < kv_idx")


def _valid_programs(draw, count):
    mods = []
    while len(mods) < count:
        program, valid = draw(mask_programs(depth=3))
        if valid:
            mods.append((program, flexgen.mask_mod(program_mod(program))))
    return mods


@pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed")
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_int_programs_compile_for_sm90(data):
    from flexgen.cache import nvrtc

    mods = _valid_programs(data.draw, 6)
    for i, (program, mod) in enumerate(mods):
        low = lower_mods(KernelSpec(kind="fwd", mask_expr=mod.expr))
        kernel = low.code + """
extern "C" __global__ void probe(const ModArgs args, int* out) {
    const int i = threadIdx.x, j = blockIdx.x;
    out[i] = mask_mod(j, 0, 2147483000 + i, i * 7919, args) ? 1 : 0;
}
"""
        ptx = nvrtc.ptx(kernel, ["--gpu-architecture=sm_90a", "-std=c++17", "-default-device"], name=f"probe{i}.cu")
        assert ".entry probe" in ptx, program


# ---------------------------------------------------------------- in the attention kernel


def _kernel_visible(mod, n: int, family: str):
    """Which (q, kv) pairs the kernel lets through: q = k = 0 and v = identity, one partial tile, so
    row i of the output is (visible pairs of row i) / (their count), exactly representable in bf16.
    precise_math: the programs' float divisions are then IEEE, as in the evaluator (this test is
    about integers; the fast division's last-bit differences are covered elsewhere)."""
    rows = 1
    bm = flexgen.BlockMask.from_kv_blocks(
        torch.ones((1, 1, rows), dtype=torch.int32, device="cuda"),
        torch.zeros((1, 1, rows, rows), dtype=torch.int32, device="cuda"),
        BLOCK_SIZE=n, mask_mod=mod, seq_lengths=(n, n),
    )
    q = torch.zeros(1, 1, n, n, device="cuda", dtype=torch.bfloat16)
    v = torch.eye(n, device="cuda", dtype=torch.bfloat16)[None, None]
    out = flexgen.flex_attention(q, q.clone(), v, block_mask=bm, kernel_options={"precise_math": True, "family": family})
    return (out[0, 0].float() > 0).cpu()


@pytest.mark.gpu
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_random_int_programs_in_the_kernel_match_the_evaluator(data):
    n = 128
    (program, mod), = _valid_programs(data.draw, 1)
    ar = torch.arange(n, dtype=torch.int32)
    want = evaluate(mod.expr, {"b": torch.tensor(0, dtype=torch.int32), "h": torch.tensor(0, dtype=torch.int32),
                               "q_idx": ar[:, None], "kv_idx": ar[None, :]}, mod.buffers, mod.params,
                    torch.float32).expand(n, n)
    family = data.draw(st.sampled_from(["sm80", "sm90"]))
    got = _kernel_visible(mod, n, family)
    assert torch.equal(got, want), (program, family, int((got != want).sum()))
