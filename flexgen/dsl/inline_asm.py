"""Inline PTX in a score_mod or mask_mod: PyTorch's `inline_asm_elementwise` (torch 2.13 and newer) as one IR node.

The node keeps the assembly and its constraints as PyTorch takes them (Triton's operand syntax: `$0` the first
output, then the inputs; LLVM constraint letters), so that the kernel cache key covers them. Its operands are the
traced inputs; its type is the result's. What the kernel gets is `asm_statement`: a CUDA `asm(...)` statement,
the same one that `flexgen.dsl.evaluate` runs through PyTorch's Jiterator on a CUDA device.

`pack` > 1 asks for that many elements per asm instance (pack outputs, pack copies of each input, input by input,
as Triton orders them). flexgen's mods compute one element at a time, so every copy of an input is bound to the
same element and the first output is kept: PyTorch's contract leaves it unspecified which elements an instance
gets, so an asm that is correct there computes each lane from its own inputs.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from .errors import UnsupportedOperationError
from .ir import DType, IRTypeError, Node
from .printer import pretty

OP = "inline_asm"

# constraint letter -> the IR type of its operand (32- and 64-bit registers; the IR has no 16-bit values)
LETTER_TYPES = {"f": DType.FLOAT32, "r": DType.INT32, "l": DType.INT64}
C_TYPES = {DType.FLOAT32: "float", DType.INT32: "int", DType.INT64: "long long"}
RESULT_TYPES = {"float32": DType.FLOAT32, "int32": DType.INT32, "int64": DType.INT64}
# Triton's packs serve 8- and 16-bit elements, up to four per 32-bit register. flexgen's operands are 32- or 64-bit,
# where every lane repeats the one element: a larger pack would only compute it more times, and is refused.
MAX_PACK = 4

_OPERAND = re.compile(r"\$(\d+)")
_ALLOWED_CHARS = re.compile(r"[\x20-\x7e\n\t]*")  # printable ASCII, newlines and tabs: it becomes a C string


@dataclass(frozen=True)
class AsmSpec:
    """The parts of an inline-asm node that are not its operands: what `Node.attr` holds, as a tuple."""

    asm_str: str
    constraints: str
    pack: int

    @classmethod
    def of(cls, node: Node) -> "AsmSpec":
        return cls(*node.attr)

    @property
    def letters(self) -> tuple[list[str], list[str]]:
        """(output letters, input letters), in operand order."""
        parts = [p.strip() for p in self.constraints.split(",")]
        return [p[1:] for p in parts if p.startswith("=")], [p for p in parts if not p.startswith("=")]


def inline_asm(args: tuple[Node, ...], asm_str: object, constraints: object, dtype: DType, pack: object = 1) -> Node:
    """The node, checked: every operand's type matches its constraint letter, the result type the outputs' letter,
    and the assembly names no operand that is not there."""
    if not isinstance(asm_str, str) or not asm_str.strip():
        raise IRTypeError(f"inline_asm_elementwise: asm_str must be a non-empty string of PTX, got {asm_str!r}")
    if not _ALLOWED_CHARS.fullmatch(asm_str):
        raise IRTypeError("inline_asm_elementwise: asm_str may hold printable ASCII, newlines and tabs only "
                          "(it is written into the kernel as a C string)")
    if not isinstance(constraints, str) or not _ALLOWED_CHARS.fullmatch(constraints) or "\n" in constraints:
        raise IRTypeError(f"inline_asm_elementwise: constraints must be a one-line string such as '=f,f,f', "
                          f"got {constraints!r}")
    if isinstance(pack, bool) or not isinstance(pack, int) or not 1 <= pack <= MAX_PACK:
        raise IRTypeError(f"inline_asm_elementwise: pack must be an int from 1 to {MAX_PACK}, got {pack!r}")
    if not args:
        raise IRTypeError("inline_asm_elementwise needs at least one input")
    spec = AsmSpec(asm_str, constraints, pack)
    outs, ins = spec.letters
    allowed = ", ".join(f"'{k}' ({v.value})" for k, v in LETTER_TYPES.items())
    for letter in outs + ins:
        if letter not in LETTER_TYPES:
            raise IRTypeError(f"inline_asm_elementwise: constraint {letter!r} in {constraints!r} is not supported; "
                              f"operands are 32- or 64-bit registers: {allowed} (outputs prefixed with '=')")
    if len(outs) != pack:
        raise IRTypeError(f"inline_asm_elementwise: constraints {constraints!r} name {len(outs)} output(s); with "
                          f"pack={pack} there must be {pack} (one result per packed element)")
    if len(ins) != pack * len(args):
        raise IRTypeError(f"inline_asm_elementwise: constraints {constraints!r} name {len(ins)} input(s) for "
                          f"{len(args)} tensor(s) with pack={pack}; there must be {pack * len(args)} "
                          f"({pack} per tensor)")
    if dtype not in C_TYPES:
        raise IRTypeError(f"inline_asm_elementwise: dtype {dtype.value} is not supported; the result is float32, "
                          "int32 or int64 (for a bool, return an int32 and compare it with 0)")
    for letter in set(outs):
        if LETTER_TYPES[letter] is not dtype:
            raise IRTypeError(f"inline_asm_elementwise: output constraint '={letter}' holds a "
                              f"{LETTER_TYPES[letter].value}, but dtype is {dtype.value}")
    for k, arg in enumerate(args):
        for letter in ins[k * pack:(k + 1) * pack]:
            if LETTER_TYPES[letter] is not arg.dtype:
                raise IRTypeError(
                    f"inline_asm_elementwise: input {k} is a {arg.dtype.value} value but its constraint is "
                    f"'{letter}' ({LETTER_TYPES[letter].value}); convert it first (.float(), .int(), .long())")
    used = [int(m) for m in _OPERAND.findall(asm_str)]
    if any(u >= len(outs) + len(ins) for u in used):
        raise IRTypeError(f"inline_asm_elementwise: asm_str names ${max(used)}, but the constraints give operands "
                          f"$0 to ${len(outs) + len(ins) - 1}")
    return Node(OP, dtype, tuple(args), (asm_str, constraints, pack))


def c_string(text: str) -> str:
    """`text` as a C string literal that nothing in it can end early (quotes, backslashes, trigraphs)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("?", "\\?").replace("\t", "\\t")
    return '"' + escaped.replace("\n", "\\n") + '"'


def cuda_asm_text(asm_str: str) -> str:
    """Triton's operand syntax in CUDA's: `$N` becomes `%N`, and a literal `%` (PTX's special registers,
    `%laneid`) is doubled as CUDA's asm statement requires."""
    return _OPERAND.sub(r"%\1", asm_str.replace("%", "%%"))


def asm_statement(node: Node, inputs: list[str], output: str, indent: str = "    ") -> str:
    """Lines that declare `output` and compute it with the node's asm from the C expressions `inputs`
    (one per operand node, each already of the operand's C type)."""
    spec = AsmSpec.of(node)
    outs, ins = spec.letters
    ctype = C_TYPES[node.dtype]
    lanes = [output] if spec.pack == 1 else [f"{output}_lanes[{j}]" for j in range(spec.pack)]
    out_list = ", ".join(f'"={letter}"({lane})' for letter, lane in zip(outs, lanes))
    in_list = ", ".join(f'"{letter}"({inputs[i // spec.pack]})' for i, letter in enumerate(ins))
    declare = f"{ctype} {output}" if spec.pack == 1 else f"{ctype} {output}_lanes[{spec.pack}]"
    keep = "" if spec.pack == 1 else f"\n{indent}const {ctype} {output} = {output}_lanes[0];  // (the other lanes repeat it)"
    return (f"{indent}{declare};\n"
            f"{indent}asm({c_string(cuda_asm_text(spec.asm_str))}\n"
            f"{indent}    : {out_list}\n"
            f"{indent}    : {in_list});{keep}")


# ---------------------------------------------------------------- evaluation (flexgen.dsl.evaluate)
# PyTorch's Jiterator compiles one elementwise function for a CUDA device. Its inputs share one type, so every
# operand travels as int64 bits (a float32 as its 32-bit pattern) and the function unpacks them into the
# operand types; the result comes back the same way. The asm statement is the one the kernels get.

MAX_EVAL_INPUTS = 8  # Jiterator's limit


def _jiterator_code(node: Node) -> str:
    names = [f"a{k}" for k in range(len(node.args))]
    lines = [f"template <typename T> T flexgen_inline_asm({', '.join(f'T in{k}' for k in range(len(names)))}) {{"]
    for k, arg in enumerate(node.args):
        value = f"__int_as_float((int)in{k})" if arg.dtype is DType.FLOAT32 else f"({C_TYPES[arg.dtype]})in{k}"
        lines.append(f"    const {C_TYPES[arg.dtype]} {names[k]} = {value};")
    lines.append(asm_statement(node, names, "r"))
    lines.append("    return (T)__float_as_int(r);" if node.dtype is DType.FLOAT32 else "    return (T)r;")
    lines.append("}")
    return "\n".join(lines)


@functools.lru_cache(maxsize=64)
def _jitted(node: Node):
    from torch.cuda.jiterator import _create_jit_fn

    return _create_jit_fn(_jiterator_code(node))


def evaluate(node: Node, args: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The node's value on its operands' values (tensors on one CUDA device), as `dtype`."""
    device = next((a.device for a in args if a.device.type != "cpu"), args[0].device)
    if device.type != "cuda":
        raise RuntimeError(
            f"inline_asm_elementwise ({AsmSpec.of(node).asm_str.strip()[:60]!r}) is PTX: it runs only on a CUDA "
            f"device, and here it was asked for on {device.type}. Build the block mask with device='cuda' and "
            "attend with CUDA tensors")
    if len(args) > MAX_EVAL_INPUTS:
        raise RuntimeError(f"inline_asm_elementwise with more than {MAX_EVAL_INPUTS} inputs runs inside the "
                           "kernels only; evaluated outside them (a block mask, the unfused path) it takes at most "
                           f"{MAX_EVAL_INPUTS}")
    bits = []
    for a, arg in zip(args, node.args):
        a = a.to(device)
        if arg.dtype is DType.FLOAT32:
            a = a.to(torch.float32).view(torch.int32)
        bits.append(a.to(torch.int64))
    out = _jitted(node)(*bits)
    if node.dtype is DType.FLOAT32:
        out = out.to(torch.int32).view(torch.float32)
    return refuse_gradient(out.to(dtype), args, node)


NO_DERIVATIVE = ("the backward needs the derivative of score_mod, which here goes through inline PTX ({}), and PTX "
                 "has none (PyTorch's inline_asm_elementwise has no autograd formula either). Run the forward under "
                 "torch.no_grad() or with inputs that do not require grad, or keep the asm off the path from score "
                 "and from buffers that require grad")


class _NoGradient(torch.autograd.Function):
    """The asm's value, joined to its operands in the autograd graph only to refuse a backward through it (the
    Jiterator's result has no gradient; without this, one through the unfused path would silently be zero)."""

    @staticmethod
    def forward(value, text, *operands):
        return value.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.text = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        raise UnsupportedOperationError(NO_DERIVATIVE.format(ctx.text))


def refuse_gradient(value: torch.Tensor, operands: list[torch.Tensor], node: Node) -> torch.Tensor:
    """`value`, made to raise on a backward through it where an operand carries a gradient."""
    tracked = [a for a in operands if isinstance(a, torch.Tensor) and a.requires_grad]
    if not tracked or not torch.is_grad_enabled():
        return value
    return _NoGradient.apply(value, pretty(node, 160), *tracked)
