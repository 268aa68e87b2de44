"""Every tracing error: the right class, and a message that says what, where and what instead."""
from __future__ import annotations

import math

import warnings

import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen.dsl import ir
from flexgen.dsl import trace as trace_module
from flexgen.dsl.errors import (
    ControlFlowError,
    FlexgenSyntaxError,
    FlexgenTraceError,
    FlexgenTypeError,
    IndexingError,
    ReturnTypeError,
    SignatureError,
    UnsupportedBufferError,
    UnsupportedOperationError,
)


def _error(cls, make):
    with pytest.raises(cls) as info:
        make()
    assert isinstance(info.value, FlexgenTraceError)
    return str(info.value)


def _points_at(message: str, fn, line_offset: int) -> None:
    """The message names the function and the offending line of its source."""
    code = fn.__code__
    assert f"'{code.co_name}'" in message
    assert f'File "{code.co_filename}", line {code.co_firstlineno + line_offset}, in {code.co_name}' in message


# ---------------------------------------------------------------- control flow on traced values


def test_if_on_traced_value():
    def branchy(b, h, q_idx, kv_idx):
        if q_idx > kv_idx:
            return True
        return False

    message = _error(ControlFlowError, lambda: flexgen.mask_mod(branchy))
    assert "Python `if`" in message and "torch.where" in message
    _points_at(message, branchy, 1)
    assert "if q_idx > kv_idx:" in message


def test_while_on_traced_value():
    def loop(score, b, h, q_idx, kv_idx):
        while score > 0:
            score = score - 1
        return score

    message = _error(ControlFlowError, lambda: flexgen.score_mod(loop))
    assert "Python `while`" in message
    _points_at(message, loop, 1)


def test_bool_and_python_and():
    def explicit(b, h, q_idx, kv_idx):
        return bool(q_idx > kv_idx)

    def keyword_and(b, h, q_idx, kv_idx):
        return (q_idx > kv_idx) and (q_idx < 10)

    assert "bool()" in _error(ControlFlowError, lambda: flexgen.mask_mod(explicit))
    message = _error(ControlFlowError, lambda: flexgen.mask_mod(keyword_and))
    assert "`and` / `or` / `not`" in message and "& | ~" in message


def test_item():
    def item(score, b, h, q_idx, kv_idx):
        return score + h.item()

    message = _error(ControlFlowError, lambda: flexgen.score_mod(item))
    assert ".item()" in message
    _points_at(message, item, 1)


def test_python_int_and_float_conversions():
    def list_lookup(score, b, h, q_idx, kv_idx):
        return score + [0.0, 1.0][h]

    def math_call(score, b, h, q_idx, kv_idx):
        return math.tanh(score)

    assert "list/tuple index" in _error(ControlFlowError, lambda: flexgen.score_mod(list_lookup))
    assert "torch.exp rather than math.exp" in _error(ControlFlowError, lambda: flexgen.score_mod(math_call))


# ---------------------------------------------------------------- unsupported operations


def test_unsupported_torch_function_is_named_with_alternatives():
    def lgamma(score, b, h, q_idx, kv_idx):
        return torch.lgamma(score)

    message = _error(UnsupportedOperationError, lambda: flexgen.score_mod(lgamma))
    assert "torch.lgamma is not supported" in message
    assert "Supported torch functions:" in message and "tanh" in message and "where" in message
    assert "gelu" in message and "fmod" in message
    _points_at(message, lgamma, 1)


def test_unsupported_tensor_method():
    message = _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s.cumsum(0)))
    assert "Tensor.cumsum is not supported" in message and "clamp" in message


def test_reductions_and_one_argument_where():
    assert "reduction" in _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: torch.max(s)))
    assert "torch.where(condition, a, b)" in _error(
        UnsupportedOperationError, lambda: flexgen.mask_mod(lambda b, h, q, kv: torch.where(q > kv))
    )


def test_bitwise_on_a_float_is_a_type_error():
    def bits(score, b, h, q_idx, kv_idx):
        return score & 1

    message = _error(FlexgenTypeError, lambda: flexgen.score_mod(bits))
    assert "operator &" in message and "integer or bool operands" in message
    _points_at(message, bits, 1)


# ---------------------------------------------------------------- signatures and bindings


def test_wrong_number_of_arguments():
    def mask(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def score(score, b, h, q_idx, kv_idx):
        return score

    message = _error(SignatureError, lambda: flexgen.score_mod(mask))
    assert "takes 4 positional argument(s)" in message and "use flexgen.mask_mod" in message
    assert f"{mask.__code__.co_filename}:{mask.__code__.co_firstlineno}" in message
    assert "use flexgen.score_mod" in _error(SignatureError, lambda: flexgen.mask_mod(score))
    assert "takes 2" in _error(SignatureError, lambda: flexgen.mask_mod(lambda q, kv: q >= kv))


def test_bindings_must_name_keyword_parameters():
    def softcap(score, b, h, q_idx, kv_idx, *, cap):
        return cap * torch.tanh(score / cap)

    assert "names no keyword parameter" in _error(SignatureError, lambda: flexgen.score_mod(softcap, cap=1.0, other=2))
    assert "keyword-only parameter 'cap'" in _error(SignatureError, lambda: flexgen.score_mod(softcap))
    assert "already traced" in _error(SignatureError, lambda: flexgen.score_mod(flexgen.score_mod(softcap, cap=1.0), cap=2.0))
    assert "is a mask_mod, not a score_mod" in _error(SignatureError, lambda: flexgen.score_mod(flexgen.variants.causal))


# ---------------------------------------------------------------- indexing


def test_float_index():
    table = torch.rand(8)

    def half(score, b, h, q_idx, kv_idx):
        return score + table[q_idx / 2]

    message = _error(IndexingError, lambda: flexgen.score_mod(half))
    assert "float value is used as an index into buffer 'table'" in message and "//" in message
    _points_at(message, half, 1)
    grid = torch.rand(4, 8)
    assert "float 1.5" in _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + grid[h, 1.5]))


def test_too_many_and_too_few_indices():
    bias = torch.rand(4, 9)
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + bias[h, q, kv]))
    assert "too many indices for buffer 'bias'" in message and "(4, 9)" in message
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + bias[h]))
    assert "has 2 dimensions but is used after indexing only 1" in message
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + bias))
    assert "used as a value" in message


def test_unsupported_index_kinds():
    table = torch.rand(8)
    grid = torch.rand(4, 8)
    assert "slices" in _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + grid[h, :]))
    assert "Python integer" in _error(ControlFlowError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h:]))
    assert "negative constant" in _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + grid[h, -1]))
    assert "cannot be indexed" in _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s[h]))


# ---------------------------------------------------------------- buffers


def test_buffer_dtype():
    table = torch.zeros(4, dtype=torch.complex64)
    message = _error(UnsupportedBufferError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h].real))
    assert "buffer 'table' has dtype complex64" in message
    assert "float32, float16, bfloat16" in message and "bool" in message


def test_buffer_device_meta():
    table = torch.zeros(4, device="meta")
    message = _error(UnsupportedBufferError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h]))
    assert "on device 'meta'" in message and "CPU or CUDA" in message


def test_buffers_on_different_devices(monkeypatch):
    monkeypatch.setattr(trace_module, "BUFFER_DEVICES", ("cpu", "cuda", "meta"))  # no second real device here
    a = torch.zeros(4)
    m = torch.zeros(4, device="meta")
    message = _error(UnsupportedBufferError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + a[h] + m[h]))
    assert "same device" in message and message.startswith("Buffers cannot be created across devices")


def test_a_scalar_buffer_goes_with_any_device(monkeypatch):
    """A 0-dim tensor mixes with tensors of another device, as in PyTorch's own ops (a module's 0-dim CUDA buffer
    beside a CPU table, or the CPU scalar that stands for an integer while a compiled function is traced)."""
    monkeypatch.setattr(trace_module, "BUFFER_DEVICES", ("cpu", "cuda", "meta"))
    table, scale = torch.zeros(4), torch.zeros((), device="meta")
    mod = flexgen.score_mod(lambda s, b, h, q, kv: s * scale + table[h])
    assert sorted(t.device.type for t in mod.buffer_tensors) == ["cpu", "meta"]


# ---------------------------------------------------------------- return types


def test_mask_must_return_bool():
    def not_a_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    message = _error(ReturnTypeError, lambda: flexgen.mask_mod(not_a_mask))
    assert "must return bool" in message and "int32" in message and "'not_a_mask'" in message
    assert "returned None" in _error(ReturnTypeError, lambda: flexgen.mask_mod(lambda b, h, q, kv: None))


def test_score_must_not_return_bool():
    message = _error(ReturnTypeError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: q >= kv))
    assert "returns bool" in message and "flexgen.mask_mod" in message
    assert "requires the output of score_mod to depend on score" in message  # (PyTorch's words for it)


def test_combining_a_score_mod_as_mask():
    with pytest.raises(SignatureError, match="is a score_mod, not a mask_mod"):
        flexgen.and_masks(flexgen.variants.softcap(2.0))


# ---------------------------------------------------------------- text form


def test_text_syntax_error_with_caret():
    with pytest.raises(FlexgenSyntaxError) as info:
        flexgen.mask_mod("q_idx >= kv_idx and and kv_idx")
    message = str(info.value)
    assert "line 1, column 21" in message and "unexpected 'and'" in message
    source, caret = message.splitlines()[-2:]
    assert caret.index("^") == source.index("and and") + 4


def test_text_unknown_name_and_type_error():
    with pytest.raises(FlexgenSyntaxError, match="unknown name 'foo'"):
        flexgen.score_mod("score + foo")
    with pytest.raises(FlexgenSyntaxError, match="where\\(\\) needs a bool condition"):
        flexgen.score_mod("where(q_idx, score, 0.0)")
    with pytest.raises(ReturnTypeError, match="must return bool"):
        flexgen.mask_mod("q_idx + 1")


def test_user_errors_keep_their_type_with_a_note():
    def broken(score, b, h, q_idx, kv_idx):
        raise KeyError("mine")

    with pytest.raises(KeyError) as info:
        flexgen.score_mod(broken)
    assert any("while flexgen was tracing score_mod 'broken'" in note for note in info.value.__notes__)


# ---------------------------------------------------------------- errors that name the fix


def test_python_min_max_name_the_torch_functions():
    def clipped(score, b, h, q_idx, kv_idx):
        return min(score, 3.0)

    def widest(b, h, q_idx, kv_idx):
        return max(q_idx, kv_idx) < 100

    message = _error(ControlFlowError, lambda: flexgen.score_mod(clipped))
    assert "built-in min()" in message and "torch.minimum(a, b)" in message
    _points_at(message, clipped, 1)
    message = _error(ControlFlowError, lambda: flexgen.mask_mod(widest))
    assert "built-in max()" in message and "torch.maximum(a, b)" in message


def test_python_rounding_names_the_torch_function():
    assert "torch.round(x)" in _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: round(s)))
    assert "torch.floor(x)" in _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: math.floor(s)))
    assert "torch.trunc(x)" in _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: math.trunc(s)))


def test_shifts_and_matmul():
    def traced_count(b, h, q_idx, kv_idx):
        return (1 << h) > kv_idx

    message = _error(UnsupportedOperationError, lambda: flexgen.mask_mod(traced_count))
    assert "bit shift by a traced value" in message and "constant Python int" in message
    _points_at(message, traced_count, 1)
    message = _error(FlexgenTypeError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s << 1))
    assert "operator <<" in message and "integer" in message
    assert "constant" in _error(UnsupportedOperationError, lambda: flexgen.mask_mod(lambda b, h, q, kv: (q >> 1.5) > kv))
    message = _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s @ s))
    assert "torch.mul" in message and "`@`" in message
    assert "torch.mul" in _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: torch.matmul(s, s)))


def test_bad_arguments_of_new_functions():
    assert "'none' or 'tanh'" in _error(
        UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: F.gelu(s, approximate="erf")))
    assert "Python int" in _error(
        UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s.round(decimals=1.5)))
    assert "needs a float" in _error(
        FlexgenTypeError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + torch.round(q, decimals=2)))


# ---------------------------------------------------------------- rows of captured tensors


def test_arrays_used_as_one_value_or_too_large():
    table = torch.rand(4, 9)
    other = torch.rand(4, 5)
    wide = torch.rand(4, 65)
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h] * 2))
    assert "used after indexing only 1" in message and "9 values (shape (9,))" in message and ".sum(-1)" in message
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + wide[h].sum(-1)))
    assert "(65,)" in message and "up to 64 elements" in message and message.startswith("Buffers cannot be created")
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + (table[h] * 2)[kv]))
    assert "only be indexed with constants" in message and "table[h, q_idx]" in message
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + (table[h] * other[h]).sum()))
    assert "(9,), (5,) do not broadcast" in message


def test_array_reduction_errors():
    table = torch.rand(4, 9)
    ids = torch.randint(0, 5, (4, 3))
    message = _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h].max(0)))
    assert "torch.amax(x, dim)" in message
    message = _error(IndexingError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table[h].sum(2)))
    assert "dim 2 is out of range" in message
    message = _error(FlexgenTypeError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + ids[h].mean()))
    assert "mean() of int64" in message and ".float().mean()" in message
    message = _error(UnsupportedOperationError, lambda: flexgen.score_mod(lambda s, b, h, q, kv: s + table @ table[h]))
    assert "dot product of two 1-d arrays" in message


# ---------------------------------------------------------------- names that reach generated C++


@pytest.mark.parametrize("name", ["a\n#error boom", "trailing\\", "x*/y", "caf\u00e9", "9lives", "lambda", "", "n" * 65, "a b"])
def test_buffer_and_parameter_names_are_checked_in_the_ir(name):
    with pytest.raises(ir.IRTypeError, match="ASCII Python identifiers"):
        ir.BufferSpec(name, "float32", 1)
    with pytest.raises(ir.IRTypeError, match="ASCII Python identifiers"):
        ir.param(name, ir.DType.FLOAT32)


def test_traced_names_are_made_valid():
    café = torch.rand(4)
    very_long_name_of_a_table_that_goes_on_and_on_well_past_what_a_c_member_name_should_be = torch.rand(4)
    mod = flexgen.score_mod(lambda s, b, h, q, kv: s + café[h]
                            + very_long_name_of_a_table_that_goes_on_and_on_well_past_what_a_c_member_name_should_be[h])
    names = [spec.name for spec in mod.buffer_specs]
    assert names[0] == "caf_" and len(names[1]) <= ir.MAX_NAME_LENGTH and names[1].startswith("very_long_name")


# ---------------------------------------------------------------- inputs of different dtypes


def test_key_and_value_of_different_dtypes_raise_value_error_like_pytorch():
    q = torch.empty(1, 2, 128, 64, device="meta", dtype=torch.float32)
    kv = torch.empty(1, 2, 128, 64, device="meta", dtype=torch.float16)
    with pytest.raises(ValueError, match="Expected query, key, and value to have the same dtype"):
        flexgen.flex_attention(q, kv, q)
    with pytest.raises(TypeError, match="same dtype"):  # what flexgen raised before, still caught
        flexgen.flex_attention(kv, kv, q)
    with pytest.raises(ValueError, match="same dtype"):
        flexgen.flex_attention(q, kv.to(torch.int32), kv.to(torch.int32))


@pytest.mark.parametrize("low", [torch.float16, torch.float8_e4m3fn])
def test_key_and_value_of_another_precision_run_unfused(low):
    """PyTorch takes key and value of a lower precision than the query (float8 K/V with an fp16 query); the output
    has the query's dtype."""
    q = torch.randn(1, 2, 128, 64, dtype=torch.float32)
    k, v = (torch.randn(1, 2, 128, 64).to(low) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flexgen.flex_attention(q, k, v)
    want = torch.softmax(q.double() @ k.double().transpose(-1, -2) / 8, -1) @ v.double()
    assert out.dtype == q.dtype and not torch.isnan(out).any()
    assert (out.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("lq, lk", [(0, 16), (16, 0)])
def test_empty_sequences_are_refused_with_pytorchs_words(lq, lk):
    q, kv = torch.ones(2, 2, lq, 64), torch.ones(2, 2, lk, 64)
    with pytest.raises(ValueError, match=f"Query length must be greater than 0, .* got {lq} and {lk}"):
        flexgen.flex_attention(q, kv, kv)


def test_nested_tensors_are_refused_before_any_work():
    parts = [torch.randn(2, 10, 64), torch.randn(2, 12, 64)]
    q = torch.nested.nested_tensor(parts, layout=torch.jagged)
    with pytest.raises(NotImplementedError,
                       match=r"flex_attention does not support NestedTensor inputs \(query is one\): it takes dense"):
        flexgen.flex_attention(q, q, q)
    dense = torch.randn(2, 2, 12, 64)
    with pytest.raises(NotImplementedError, match=r"\(value is one\)"):
        flexgen.flex_attention(dense, dense, torch.nested.nested_tensor([torch.randn(2, 12, 64)] * 2, layout=torch.jagged))
