"""Lowering: IR -> CUDA C++.

There is no GPU in CI, so the key correctness test compiles the generated device
functions on the HOST (g++ with `__device__` shims) and compares them, value for
value, against the reference evaluator on random inputs.
"""
from __future__ import annotations

import ctypes
import importlib.util
import math
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flexgen
from flexgen.codegen.api import make_spec
from flexgen.codegen.cstruct import ModArgsError, pack_mod_args, struct_class
from flexgen.codegen.lower import LoweringError, c_name, float_literal, lower_mods
from flexgen.codegen.spec import KernelSpec
from flexgen.dsl import functional, ir
from flexgen.dsl.evaluate import evaluate
from flexgen.dsl.ir import BufferSpec, DType

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ is needed to run lowered code on the host")

S, B, H, Q, KV = (ir.input_(n) for n in ("score", "b", "h", "q_idx", "kv_idx"))
c = ir.const
bin_ = ir.binary
un = ir.unary
N_POINTS = 384

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
#define __noinline__
static inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
static inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
// deterministic mode's warp-wide flush, for one thread: add into the copy `shift` elements on
static inline void flexgen_grad_add(float* addr, float value, long long shift) { if (addr != nullptr) addr[shift] += value; }
"""


# ---------------------------------------------------------------- the host harness


@dataclass
class Case:
    kind: str  # "score" | "mask" | "bwd"
    expr: ir.Node
    buffers: dict = field(default_factory=dict)  # name -> (base tensor, view of it)
    params: dict = field(default_factory=dict)
    exact: bool = True
    grad_buffers: tuple = ()


def _bytes_literal(t: torch.Tensor) -> str:
    raw = t.contiguous().reshape(-1).view(torch.uint8).tolist()
    return ", ".join(map(str, raw)) or "0"


def _param_literal(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(np.float32(v))) + "f"
    return f"{v}LL"


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    pts = {
        "b": torch.randint(0, 4, (N_POINTS,), generator=g, dtype=torch.int32),
        "h": torch.randint(0, 8, (N_POINTS,), generator=g, dtype=torch.int32),
        "q_idx": torch.randint(0, 300, (N_POINTS,), generator=g, dtype=torch.int32),
        "kv_idx": torch.randint(0, 300, (N_POINTS,), generator=g, dtype=torch.int32),
        "score": (torch.randn(N_POINTS, generator=g) * 4).to(torch.float32),
    }
    pts["score"][:8] = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 7.0, -7.0])
    return pts


def run_on_host(cases: list[Case], tmp_path, seed: int = 0, deterministic: bool = False, points: dict | None = None):
    """Compile every case into one C++ program; return, per case, (host results, reference).
    Backward cases take grad_out = 1 + i / N at point i; `deterministic`: deterministic mode's
    gradient slots, and grad_out = 0 at every third point (what such a kernel passes for masked scores);
    the points are then grouped by (b, h) and the slots flushed between groups, as a kernel step does.
    `points`: the inputs (N_POINTS of each, as _inputs gives them) instead of random ones."""
    pts = _inputs(seed) if points is None else points
    if deterministic:
        order = torch.argsort(pts["b"] * 8 + pts["h"], stable=True)
        pts = {name: t[order] for name, t in pts.items()}
    src = [SHIM]
    lowered = []
    for i, case in enumerate(cases):
        kind = "bwd" if case.kind == "bwd" else "fwd"
        spec = KernelSpec(kind=kind, score_expr=case.expr if case.kind != "mask" else None,
                          mask_expr=case.expr if case.kind == "mask" else None, grad_buffers=case.grad_buffers,
                          deterministic=deterministic and kind == "bwd")
        low = lower_mods(spec)
        lowered.append(low)
        src.append(f"namespace c{i} {{\n{low.code}\n}}  // namespace c{i}")
        for name, (base, _) in case.buffers.items():
            src.append(f"alignas(16) static unsigned char c{i}_{name}[] = {{{_bytes_literal(base)}}};")
        for name in case.grad_buffers:
            numel = case.buffers[name][1].numel()
            src.append(f"static float c{i}_{name}_grad[{numel}];")
    for name, t in pts.items():
        ct = "unsigned int" if name == "score" else "int"
        vals = t.view(torch.int32).tolist() if name == "score" else t.tolist()
        src.append(f"static const {ct} in_{name}[{N_POINTS}] = {{{', '.join(str(v & 0xFFFFFFFF) + 'u' if name == 'score' else str(v) for v in vals)}}};")
    main = ["int main() {"]
    for i, (case, low) in enumerate(zip(cases, lowered)):
        main.append("  {")
        main.append(f"    c{i}::ModArgs args; std::memset(&args, 0, sizeof args);")
        for f in low.fields:
            kind = f.source[0]
            if kind == "buffer_ptr":
                base, view = case.buffers[f.source[1]]
                main.append(f"    args.{f.name} = reinterpret_cast<{f.ctype}>(c{i}_{f.source[1]}) + {view.storage_offset()};")
            elif kind == "buffer_stride":
                main.append(f"    args.{f.name} = {case.buffers[f.source[1]][1].stride(f.source[2])};")
            elif kind == "param":
                main.append(f"    args.{f.name} = {_param_literal(case.params[f.source[1]])};")
            elif kind == "grad_ptr":
                main.append(f"    args.{f.name} = c{i}_{f.source[1]}_grad;")
            elif kind == "grad_stride":
                view = case.buffers[f.source[1]][1]
                stride = torch.empty(view.shape).stride(f.source[2])  # the grad buffer is contiguous
                main.append(f"    args.{f.name} = {stride};")
        call = "(__uint_as_float(in_score[i]), in_b[i], in_h[i], in_q_idx[i], in_kv_idx[i]"
        grads = ", grads" if low.grad_sites else ""
        if low.grad_sites:  # one thread's slots across every point, flushed at the end, as a kernel step does
            main.append(f"    c{i}::FlexgenGradSlots grads = {{}};")
        main.append(f"    for (int i = 0; i < {N_POINTS}; ++i) {{")
        if low.grad_sites and deterministic:
            main.append("      if (i > 0 && (in_b[i] != in_b[i - 1] || in_h[i] != in_h[i - 1])) {")
            main.append(f"        for (int k = 0; k < c{i}::FLEXGEN_GRAD_SITES; ++k) flexgen_grad_add(grads.addr[k], grads.sum[k], 0);")
            main.append(f"        grads = c{i}::FlexgenGradSlots{{}};")
            main.append("      }")
        if case.kind == "score":
            main.append(f'      std::printf("%08x\\n", __float_as_uint(c{i}::score_mod{call}, args)));')
        elif case.kind == "mask":
            main.append(f'      std::printf("%d\\n", (int)c{i}::mask_mod(in_b[i], in_h[i], in_q_idx[i], in_kv_idx[i], args));')
        else:  # bwd with grad_out = 1 + i / N (deterministic: 0 at every third point)
            grad_out = f"1.0f + (float)i / {N_POINTS}"
            if deterministic:
                grad_out = f"(i % 3 == 0 ? 0.0f : {grad_out})"
            main.append(f'      std::printf("%08x\\n", __float_as_uint(c{i}::score_mod_bwd{call}, {grad_out}, args{grads})));')
        main.append("    }")
        if low.grad_sites:
            main.append(f"    for (int k = 0; k < c{i}::FLEXGEN_GRAD_SITES; ++k)")
            main.append("      if (grads.addr[k] != nullptr) atomicAdd(grads.addr[k], grads.sum[k]);" if not deterministic
                        else "      flexgen_grad_add(grads.addr[k], grads.sum[k], grads.shift);")
        for name in case.grad_buffers:
            numel = case.buffers[name][1].numel()
            main.append(f'    for (int j = 0; j < {numel}; ++j) std::printf("%08x\\n", __float_as_uint(c{i}_{name}_grad[j]));')
        main.append("  }")
    main.append("  return 0;\n}")
    src.append("\n".join(main))
    cpp = tmp_path / "harness.cpp"
    cpp.write_text("\n\n".join(src))
    exe = tmp_path / "harness"
    proc = subprocess.run([GXX, "-std=c++17", "-O1", "-fwrapv", "-fno-strict-aliasing", "-ffp-contract=off", "-w",
                           "-o", str(exe), str(cpp)], capture_output=True, text=True)
    assert proc.returncode == 0, f"host compile of lowered code failed ({cpp}):\n{proc.stderr[:6000]}"
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    results = []
    pos = 0
    for case in cases:
        chunk = lines[pos:pos + N_POINTS]
        pos += N_POINTS
        if case.kind == "mask":
            got = torch.tensor([int(x) for x in chunk], dtype=torch.bool)
        else:
            got = torch.from_numpy(np.array([int(x, 16) for x in chunk], dtype=np.uint32).view(np.float32))
        grads = {}
        for name in case.grad_buffers:
            numel = case.buffers[name][1].numel()
            raw = np.array([int(x, 16) for x in lines[pos:pos + numel]], dtype=np.uint32).view(np.float32)
            grads[name] = torch.from_numpy(raw.copy()).reshape(case.buffers[name][1].shape)
            pos += numel
        bufs = {n: v for n, (_, v) in case.buffers.items()}
        ref = evaluate(case.expr, pts, bufs, case.params, float_dtype=torch.float32)
        if case.kind == "score":
            ref = ref.to(torch.float32)
        results.append((got, ref.expand(N_POINTS) if ref.dim() == 0 else ref, grads, pts))
    assert pos == len(lines)
    return results


def check(cases, tmp_path, seed=0, points=None):
    for case, (got, ref, _, _) in zip(cases, run_on_host(cases, tmp_path, seed, points=points)):
        if case.kind == "mask" or case.exact:
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{case.kind}_mod {ir.Node.__repr__(case.expr)}: {m}")
        else:
            torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6, equal_nan=True,
                                       msg=lambda m: f"{case.kind}_mod {ir.Node.__repr__(case.expr)}: {m}")


# ---------------------------------------------------------------- buffers of every dtype


def _buffer(name: str, dtype: torch.dtype, shape: tuple[int, ...], seed: int, layout: str = "transposed"):
    """A (base, view) pair: the view is non-contiguous so strides and offsets are exercised."""
    g = torch.Generator().manual_seed(seed)
    big = tuple(s + 1 for s in shape)
    if dtype in (torch.float16, torch.bfloat16):
        bits = torch.randint(-(2**15), 2**15, big, generator=g, dtype=torch.int16)
        base = bits.view(dtype)
    elif dtype.is_floating_point:
        base = (torch.randn(big, generator=g) * 3).to(dtype)
    elif dtype is torch.bool:
        base = torch.rand(big, generator=g) > 0.5
    else:
        info = torch.iinfo(dtype)
        lo, hi = max(info.min, -1000), min(info.max, 1000)
        base = torch.randint(lo, hi + 1, big, generator=g).to(dtype)
    view = base[tuple(slice(1, None) for _ in shape)]
    if layout == "transposed" and len(shape) >= 2:
        base = base.transpose(0, 1).contiguous()  # storage holds the transpose...
        view = base.transpose(0, 1)[tuple(slice(1, None) for _ in shape)]  # ...so the view is column-major
    spec = BufferSpec(name, str(dtype).removeprefix("torch."), len(shape))
    return spec, (base, view)


def _idx(x: ir.Node, size: int) -> ir.Node:
    return bin_("mod", x, c(size))  # floored mod: always a valid index


# ---------------------------------------------------------------- hand-written cases


def hand_cases() -> list[Case]:
    cases: list[Case] = []
    # integer floor division / modulo with every sign combination (q - kv is often negative)
    d = bin_("sub", Q, KV)
    for divisor in (7, -7, 1, -1, 64):
        cases.append(Case("score", ir.cast(bin_("floordiv", d, c(divisor)), DType.FLOAT32)))
        cases.append(Case("score", ir.cast(bin_("mod", d, c(divisor)), DType.FLOAT32)))
    dyn = bin_("sub", H, c(4))  # run-time divisor in -4..3, never 0 after the where
    dyn = ir.where(bin_("eq", dyn, c(0)), c(3), dyn)
    cases.append(Case("score", ir.cast(bin_("floordiv", d, dyn), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(bin_("mod", d, dyn), DType.FLOAT32)))
    d64 = ir.cast(d, DType.INT64)
    cases.append(Case("score", ir.cast(bin_("floordiv", bin_("mul", d64, c(3_000_000_000)), c(-1_000_000_007)), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(bin_("mod", bin_("mul", d64, c(3_000_000_000)), c(-1_000_000_007)), DType.FLOAT32)))
    # float floor division / remainder, negative operands
    cases.append(Case("score", bin_("floordiv", S, c(0.75))))
    cases.append(Case("score", bin_("mod", S, c(-1.5))))
    cases.append(Case("score", bin_("mod", bin_("mul", S, c(100.0)), c(3.0))))
    # casts: float -> int truncates toward zero, int -> bool, bool -> float, int64 wrap to int32
    cases.append(Case("score", ir.cast(ir.cast(bin_("mul", S, c(10.0)), DType.INT32), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(ir.cast(bin_("mul", S, c(-3.3)), DType.INT64), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(ir.cast(d, DType.BOOL), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(ir.cast(bin_("mul", d64, c(2**40 + 12345)), DType.INT32), DType.FLOAT32)))
    cases.append(Case("mask", ir.cast(bin_("mod", d, c(3)), DType.BOOL)))
    QF = ir.cast(Q, DType.FLOAT32)
    cases.append(Case("mask", ir.cast(bin_("sub", bin_("mul", QF, c(0.25)), c(1.0)), DType.BOOL)))
    # where / min / max / abs / neg, mixed types
    cases.append(Case("score", ir.where(bin_("ge", Q, KV), S, c(float("-inf")))))
    cases.append(Case("score", bin_("min", S, ir.cast(bin_("sub", H, c(3)), DType.FLOAT32))))
    cases.append(Case("score", bin_("max", un("neg", S), c(-0.5))))
    cases.append(Case("score", ir.cast(bin_("max", bin_("min", d, c(5)), c(-5)), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(un("abs", d), DType.FLOAT32)))
    cases.append(Case("score", un("abs", S)))
    cases.append(Case("score", bin_("add", bin_("mul", S, c(0.1)), bin_("mul", ir.cast(Q, DType.FLOAT32), c(1e-3)))))
    cases.append(Case("score", bin_("div", S, bin_("add", un("abs", ir.cast(d, DType.FLOAT32)), c(1.0)))))
    cases.append(Case("score", bin_("sub", S, bin_("mul", bin_("mul", S, S), c(1 / 3)))))
    cases.append(Case("score", bin_("add", S, c(1e39))))  # rounds to float32 inf, like torch
    # scalar parameters of each type
    cases.append(Case("score", bin_("mul", S, ir.param("scale", DType.FLOAT32)), params={"scale": 0.125}))
    cases.append(Case("mask", bin_("le", bin_("sub", Q, KV), ir.param("window", DType.INT32)), params={"window": 17}))
    cases.append(Case("mask", bin_("lt", ir.cast(d, DType.INT64), ir.param("w64", DType.INT64)), params={"w64": -20}))
    cases.append(Case("mask", bin_("or", ir.param("causal", DType.BOOL), bin_("ge", Q, KV)), params={"causal": False}))
    cases.append(Case("score", ir.where(ir.param("on", DType.BOOL), S, c(0.0)), params={"on": True}))
    # boolean logic
    cases.append(Case("mask", bin_("xor", bin_("ge", Q, KV), bin_("eq", bin_("mod", B, c(2)), c(0)))))
    cases.append(Case("mask", un("not", bin_("and", bin_("gt", QF, c(10.0)), bin_("lt", QF, c(200.0))))))
    cases.append(Case("mask", bin_("eq", bin_("ge", Q, KV), bin_("ge", H, c(4)))))
    # transcendental functions (accurate to a few ulp, not bit-exact)
    for op in ("exp", "exp2", "tanh", "sigmoid", "sin", "cos", "erf"):
        cases.append(Case("score", un(op, bin_("mul", S, c(0.5))), exact=False))
    for op in ("log", "log2", "sqrt", "rsqrt"):
        cases.append(Case("score", un(op, bin_("add", un("abs", S), c(0.25))), exact=False))
    cases.append(Case("score", bin_("pow", bin_("add", un("abs", S), c(0.5)), c(1.5)), exact=False))
    cases.append(Case("score", bin_("pow", ir.cast(H, DType.FLOAT32), c(2.0)), exact=False))
    # a shared subexpression (becomes a temporary) used in several places
    t = bin_("mul", bin_("sub", Q, KV), c(3))
    cases.append(Case("score", ir.where(bin_("gt", t, c(0)), bin_("add", S, ir.cast(t, DType.FLOAT32)), ir.cast(bin_("mod", t, c(11)), DType.FLOAT32))))
    # an integer-valued score_mod (returns int; the kernel casts to float)
    cases.append(Case("score", bin_("floordiv", Q, c(16))))
    # buffer loads: every supported dtype, non-contiguous strides, computed indices
    for k, dt in enumerate((torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32,
                            torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool)):
        spec, pair = _buffer("buf", dt, (8, 11), seed=k)
        val = ir.load(spec, (H, _idx(bin_("sub", Q, KV), 11)))
        if val.dtype is DType.BOOL:
            cases.append(Case("mask", bin_("and", val, bin_("ge", Q, KV)), buffers={"buf": pair}))
        else:
            cases.append(Case("score", bin_("add", S, ir.cast(val, DType.FLOAT32)), buffers={"buf": pair}))
    # 1-d, 3-d and 0-d buffers, int64 indices, a buffer used twice, two buffers and a mask with loads
    spec1, pair1 = _buffer("offsets", torch.int64, (4,), seed=20, layout="sliced")
    spec3, pair3 = _buffer("table", torch.bfloat16, (4, 8, 5), seed=21)
    spec0 = BufferSpec("alpha", "float32", 0)
    pair0 = (torch.tensor([1.75]), torch.tensor([1.75])[0])
    off = ir.load(spec1, (B,))
    cases.append(Case("score", bin_("add", bin_("mul", S, ir.load(spec0, ())),
                                    ir.load(spec3, (B, H, _idx(bin_("add", ir.cast(Q, DType.INT64), off), 5)))),
                      buffers={"offsets": pair1, "table": pair3, "alpha": pair0}))
    doc, docpair = _buffer("doc", torch.int32, (4, 300), seed=22, layout="sliced")
    cases.append(Case("mask", bin_("and", bin_("eq", ir.load(doc, (B, Q)), ir.load(doc, (B, KV))), bin_("ge", Q, KV)),
                      buffers={"doc": docpair}))
    kw, kwpair = _buffer("float", torch.float32, (8,), seed=23, layout="sliced")  # a C++ keyword as a name
    cases.append(Case("score", bin_("add", S, ir.load(kw, (H,))), buffers={"float": kwpair}))
    return cases


@needs_gxx
def test_hand_written_cases_match_evaluator(tmp_path):
    check(hand_cases(), tmp_path)


# ---------------------------------------------------------------- random expressions


class RandomExprs:
    """Random well-typed IR; divisors are kept nonzero and indices in range, as a real variant would."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.buffers: dict = {}
        self.params: dict = {}
        self.seed = seed

    def buffer(self, dtype: torch.dtype, shape=(8, 13)):
        name = f"buf{len(self.buffers)}"
        spec, pair = _buffer(name, dtype, shape, seed=self.seed * 100 + len(self.buffers))
        self.buffers[name] = pair
        return spec

    def int_(self, depth: int) -> ir.Node:
        r = self.rng
        if depth <= 0 or r.random() < 0.25:
            choice = r.randrange(6)
            if choice < 3:
                return [B, H, Q, KV][r.randrange(4)]
            if choice == 3:
                return c(r.randint(-20, 20))
            if choice == 4:
                name = f"p{len(self.params)}"
                self.params[name] = r.randint(-9, 9)
                return ir.param(name, DType.INT32)
            spec = self.buffer(r.choice([torch.int32, torch.int64, torch.int8]))
            return ir.load(spec, (_idx(self.int_(depth - 1), 8), _idx(self.int_(depth - 1), 13)))
        op = r.choice(["add", "sub", "mul", "floordiv", "mod", "floordiv", "mod", "min", "max", "neg", "abs", "where", "cast64"])
        if op in ("neg", "abs"):
            return un(op, self.int_(depth - 1))
        if op == "cast64":
            return ir.cast(self.int_(depth - 1), DType.INT64)
        if op == "where":
            return ir.where(self.bool_(depth - 1), self.int_(depth - 1), self.int_(depth - 1))
        a, b = self.int_(depth - 1), self.int_(depth - 1)
        if op in ("floordiv", "mod"):
            b = ir.where(bin_("eq", b, c(0)), c(r.choice([-3, 5])), b)
        if op == "mul":
            b = _idx(b, 50)  # keep products well inside float32's exact integers
        return bin_(op, a, b)

    def float_(self, depth: int) -> ir.Node:
        r = self.rng
        if depth <= 0 or r.random() < 0.25:
            choice = r.randrange(5)
            if choice == 0:
                return S
            if choice == 1:
                return c(r.choice([0.5, -1.25, 3.0, 0.1, -7.5, 1e-3]))
            if choice == 2:
                name = f"p{len(self.params)}"
                self.params[name] = r.choice([0.125, -2.0, 1.5])
                return ir.param(name, DType.FLOAT32)
            if choice == 3:
                return ir.cast(self.int_(depth - 1), DType.FLOAT32)
            spec = self.buffer(r.choice([torch.float32, torch.bfloat16, torch.float16]))
            return ir.load(spec, (_idx(self.int_(depth - 1), 8), _idx(self.int_(depth - 1), 13)))
        op = r.choice(["add", "sub", "mul", "div", "floordiv", "mod", "min", "max", "neg", "abs", "where"])
        if op in ("neg", "abs"):
            return un(op, self.float_(depth - 1))
        if op == "where":
            return ir.where(self.bool_(depth - 1), self.float_(depth - 1), self.float_(depth - 1))
        a, b = self.float_(depth - 1), self.float_(depth - 1)
        if op in ("div", "floordiv", "mod"):
            b = bin_("add", un("abs", b), c(0.5))
        return bin_(op, a, b)

    def bool_(self, depth: int) -> ir.Node:
        r = self.rng
        if depth <= 0 or r.random() < 0.3:
            if r.random() < 0.5:
                return bin_(r.choice(["lt", "le", "gt", "ge", "eq", "ne"]), self.int_(depth - 1), self.int_(depth - 1))
            return bin_(r.choice(["lt", "le", "gt", "ge"]), self.float_(depth - 1), self.float_(depth - 1))
        op = r.choice(["and", "or", "xor", "not"])
        if op == "not":
            return un("not", self.bool_(depth - 1))
        return bin_(op, self.bool_(depth - 1), self.bool_(depth - 1))


def random_cases(seed: int, count: int) -> list[Case]:
    cases = []
    for i in range(count):
        gen = RandomExprs(seed * 1000 + i)
        which = i % 3
        if which == 0:
            expr = gen.float_(4)
            kind = "score"
        elif which == 1:  # a mask_mod cannot read the score: use a float made from kv_idx instead
            expr = ir.replace(gen.bool_(3), {S: bin_("mul", ir.cast(KV, DType.FLOAT32), c(0.03125))})
            kind = "mask"
        else:
            expr, kind = ir.cast(gen.int_(4), DType.FLOAT32), "score"
        cases.append(Case(kind, expr, buffers=gen.buffers, params=gen.params))
    return cases


def _band_cases() -> list[tuple[Case, bool]]:
    """(case, whether it lowers to fg_band): band masks `0 <= d < w` / `<= w` in each written form, over bounds
    that are negative, zero, small, past every index and the type's largest; and near misses that must not."""
    d = bin_("sub", Q, KV)
    Q64, KV64 = ir.cast(Q, DType.INT64), ir.cast(KV, DType.INT64)
    d64 = bin_("sub", Q64, KV64)
    w, w64 = ir.param("w", DType.INT32), ir.param("w64", DType.INT64)
    forms = [
        (bin_("and", bin_("ge", Q, KV), bin_("lt", d, w)), "w", True),
        (bin_("and", bin_("le", d, w), bin_("le", KV, Q)), "w", True),
        (bin_("and", bin_("gt", w, d), bin_("ge", d, c(0))), "w", True),
        (bin_("and", bin_("le", c(0), d), bin_("ge", w, d)), "w", True),
        (bin_("and", bin_("ge", Q64, KV64), bin_("lt", d64, w64)), "w64", True),
        (bin_("and", bin_("ge", Q64, KV64), bin_("le", d64, w64)), "w64", True),
        # not a band of d: the lower bound is on another difference, or not at 0
        (bin_("and", bin_("ge", KV, Q), bin_("lt", d, w)), "w", False),
        (bin_("and", bin_("gt", Q, KV), bin_("lt", d, w)), "w", False),
        (bin_("and", bin_("ge", d, c(1)), bin_("lt", d, w)), "w", False),
    ]
    cases = []
    for expr, name, band in forms:
        top = 2**31 - 1 if name == "w" else 2**63 - 1
        for bound in (-7, -1, 0, 1, 17, 299, top):
            cases.append((Case("mask", expr, params={name: bound}), band))
    # a difference that can overflow (an int32 buffer's values minus q_idx) keeps the two compares
    spec, base = _buffer("offsets", torch.int32, (8,), seed=61)
    far = bin_("sub", ir.load(spec, (H,)), Q)
    cases.append((Case("mask", bin_("and", bin_("ge", ir.load(spec, (H,)), Q), bin_("lt", far, c(40))),
                       buffers={"offsets": base}), False))
    return cases


@needs_gxx
def test_band_masks_lower_to_one_compare(tmp_path):
    """A band (a sliding window's `q_idx >= kv_idx and q_idx - kv_idx < window`) is one unsigned compare in the
    emitted code, with the same answers as the IR evaluator at every bound, negative and extreme ones included."""
    cases = _band_cases()
    for case, band in cases:
        code = lower_mods(KernelSpec(kind="fwd", mask_expr=case.expr)).code
        assert ("fg_band_" in code) == band, (ir.Node.__repr__(case.expr), code)
    check([case for case, _ in cases], tmp_path)


# ---------------------------------------------------------------- inputs at the edges of index arithmetic

INT_MAX = 2**31 - 1


def _edge_inputs(seed: int) -> dict:
    """N_POINTS inputs at the edges of index arithmetic: q_idx - kv_idx around 0, small windows and 128 and 300,
    queries and keys at 0 and near 2**31 - 1 (where q_idx - w and q_idx + 1 overflow), and a few heads near it."""
    pts = _inputs(seed)
    pairs = []
    for q in (0, 1, 17, 128, 300, 2**30, INT_MAX - 300, INT_MAX - 18, INT_MAX - 1, INT_MAX):
        for off in (-300, -18, -2, -1, 0, 1, 2, 16, 17, 18, 127, 128, 129, 299, 300):
            if 0 <= q - off <= INT_MAX:
                pairs.append((q, q - off))
        pairs += [(q, 0), (q, INT_MAX)]
    rng = random.Random(seed)
    while len(pairs) < N_POINTS:
        pairs.append((rng.randrange(400), rng.randrange(400)))
    pts["q_idx"] = torch.tensor([q for q, _ in pairs], dtype=torch.int32)
    pts["kv_idx"] = torch.tensor([kv for _, kv in pairs], dtype=torch.int32)
    pts["h"][-24:] = torch.arange(INT_MAX - 23, INT_MAX + 1, dtype=torch.int64).to(torch.int32)
    return pts


def _range_cases() -> list[tuple[Case, bool]]:
    """(case, whether it lowers to fg_band): ranges `low <= x - y <= high` with constant ends and windows
    `abs(d) <= c`, over tiles of 64 indices (NATTEN's and STA's shape) and plain differences, int32 and int64; and
    those that must keep their compares (an end past what x - y - low can hold, a difference of unknown range)."""
    tq, tk = bin_("floordiv", Q, c(64)), bin_("floordiv", KV, c(64))
    dt = bin_("sub", tq, tk)
    d = bin_("sub", Q, KV)
    Q64, KV64 = ir.cast(Q, DType.INT64), ir.cast(KV, DType.INT64)
    d64 = bin_("sub", Q64, KV64)
    spec, base = _buffer("offsets", torch.int32, (8,), seed=62)
    loaded = ir.load(spec, (bin_("mod", H, c(8)),))
    forms = [
        (bin_("and", bin_("ge", tk, bin_("sub", tq, c(1))), bin_("le", tk, bin_("add", tq, c(1)))), True),
        (bin_("and", bin_("ge", dt, c(-2)), bin_("lt", dt, c(3))), True),
        (bin_("and", bin_("gt", tk, bin_("add", tq, c(3))), bin_("le", tk, bin_("add", tq, c(1)))), True),  # empty
        (bin_("and", bin_("ge", d64, c(-5, DType.INT64)), bin_("le", d64, c(7, DType.INT64))), True),
        (bin_("and", bin_("ge", d, c(-5)), bin_("le", d, c(7))), False),  # d + 5 can overflow in int32
        (bin_("and", bin_("ge", d, c(2)), bin_("le", d, c(9))), False),  # d - 2 can overflow in int32
        (bin_("and", bin_("ge", d64, c(2, DType.INT64)), bin_("le", d64, c(2**63 - 1, DType.INT64))), True),  # the end
        (bin_("le", un("abs", dt), c(1)), True),
        (bin_("lt", un("abs", dt), c(3)), True),
        (bin_("ge", c(2), un("abs", dt)), True),
        (bin_("gt", c(1), un("abs", dt)), True),
        (bin_("le", un("abs", dt), c(0)), True),
        (bin_("lt", un("abs", dt), c(0)), False),  # never: left as written
        (bin_("le", un("abs", d64), c(7, DType.INT64)), True),
        (bin_("le", un("abs", d), c(7)), False),  # d + 7 can overflow in int32
        (bin_("le", un("abs", loaded), c(3)), False),  # abs of the type's least value wraps: unknown range
        (bin_("le", un("abs", bin_("sub", d, c(1))), c(0)), False),  # q - kv - 1 reaches it (q 0, kv 2**31 - 1)
    ]
    return [(Case("mask", expr, buffers={"offsets": base} if "offsets" in repr(expr) else {}), band)
            for expr, band in forms]


@needs_gxx
def test_ranges_and_abs_windows_lower_to_one_compare(tmp_path):
    """`low <= x - y <= high` with constant ends and `abs(d) <= c` are one unsigned compare where every
    intermediate is exact, with the IR evaluator's answers at the index edges (differences around each end, indices
    near 2**31 - 1)."""
    cases = _range_cases()
    for case, band in cases:
        code = lower_mods(KernelSpec(kind="fwd", mask_expr=case.expr)).code
        assert ("fg_band_" in code) == band, (ir.Node.__repr__(case.expr), code)
    for seed in (0, 1):
        check([case for case, _ in cases], tmp_path, points=_edge_inputs(seed))


# ---------------------------------------------------------------- division of nonnegative integers


def _division_cases() -> list[tuple[ir.Node, bool]]:
    """(integer expression, whether its division is written unsigned): `//`, `%` and fmod of a dividend >= 0 by a
    divisor >= 1, constant or not, int32 and int64; and near misses that keep the floored helpers."""
    Q64, KV64 = ir.cast(Q, DType.INT64), ir.cast(KV, DType.INT64)
    small = bin_("add", bin_("mod", H, c(4)), c(1))  # 1..4, not a constant
    wide = bin_("add", bin_("mul", Q64, c(2**32, DType.INT64)), KV64)  # up to 2**63 - 1
    some_zero = ir.where(bin_("eq", bin_("mod", H, c(4)), c(0)), c(-1), bin_("mod", H, c(4)))  # -1..3: 0 in the range
    out = []
    for op in ("floordiv", "mod", "fmod"):
        out += [
            (bin_(op, Q, c(128)), True), (bin_(op, KV, c(200)), True), (bin_(op, Q, c(INT_MAX)), True),
            (bin_(op, KV, small), True), (bin_(op, H, c(7)), True),
            (bin_(op, wide, c(3_000_000_007, DType.INT64)), True), (bin_(op, wide, ir.cast(small, DType.INT64)), True),
            (bin_(op, Q64, c(2**40, DType.INT64)), True),
            # may be negative, a negative or unknown divisor, a range that holds 0, a dividend that wraps
            (bin_(op, bin_("sub", Q, KV), c(128)), False), (bin_(op, Q, c(-7)), False),
            (bin_(op, Q, ir.param("p", DType.INT32)), False), (bin_(op, KV, some_zero), False),
            (bin_(op, bin_("add", Q, c(5)), c(3)), False),
        ]
    return out


@needs_gxx
def test_nonnegative_division_lowers_to_unsigned(tmp_path):
    """`//`, `%` and fmod where the dividend's range is >= 0 and the divisor's >= 1 are C's unsigned division,
    cast back to the signed type, with the evaluator's answers at indices up to 2**31 - 1 and int64 dividends up to
    2**63 - 1 (low 20 bits and magnitude both compared); near misses keep the helpers."""
    cases = []
    for expr, unsigned in _division_cases():
        fn = lower_mods(KernelSpec(kind="fwd", mask_expr=bin_("ne", expr, c(-1, expr.dtype)))).mask_mod_fn
        result = fn.split("return ", 1)[1]
        assert result.startswith(("(int)((unsigned)", "(long long)((unsigned long long)")) == unsigned, fn
        params = {name: 5 for name in ir.params_of(expr)}
        low = bin_("bitand", expr, c(0xFFFFF, expr.dtype))
        cases += [Case("score", ir.cast(e, DType.FLOAT32), params=params) for e in (low, expr)]
    for seed in (0, 1):
        check(cases, tmp_path, seed=seed, points=_edge_inputs(seed))


def test_division_ranges_reach_later_expressions():
    """A nonnegative quotient and remainder have exact ranges, so the arithmetic on them keeps C's operators:
    NATTEN-like tiles `(q_idx // T) * T`, `abs(q_idx // T - kv_idx // T)`, chunked causal."""
    def text(source):
        return lower_mods(KernelSpec(kind="fwd", mask_expr=flexgen.mask_mod(source).expr)).mask_mod_fn

    assert "((int)((unsigned)q_idx / 64u) * 64) <= kv_idx" in text("(q_idx // 64) * 64 <= kv_idx")
    tiles = text("abs(q_idx // 64 - kv_idx // 64) <= 1")
    assert "fg_band_le((int)((unsigned)q_idx / 64u) - (int)((unsigned)kv_idx / 64u) + 1, 2)" in tiles
    chunked = text("q_idx // 200 == kv_idx // 200 and q_idx >= kv_idx")
    assert "((int)((unsigned)q_idx / 200u) == (int)((unsigned)kv_idx / 200u)) & (q_idx >= kv_idx)" in chunked
    assert "(int)((unsigned)q_idx % 3u) + (int)((unsigned)kv_idx / 2u)" in text("q_idx % 3 + kv_idx // 2 < 7")
    sixty_four = text("(q_idx.long() * 4294967296 + kv_idx) // 3 > 5")
    assert "(long long)((unsigned long long)" in sixty_four and "fg_floordiv" not in sixty_four
    assert "fg_floordiv(q_idx - kv_idx, 64)" in text("(q_idx - kv_idx) // 64 < 2")


# ---------------------------------------------------------------- sliding windows in every spelling, and chains


def _and_masks(*terms: ir.Node) -> ir.Node:
    """A conjunction as transformers' and_masks traces it: True & a & b & ..."""
    out = c(True)
    for term in terms:
        out = bin_("and", out, term)
    return out


def _window_cases() -> list[tuple[Case, int]]:
    """(case, how many fg_band compares it lowers to): sliding windows spelled as transformers
    (`kv_idx > q_idx - w` and `kv_idx <= q_idx` in and_masks' chain from True), `q_idx - w < kv_idx`,
    `kv_idx >= q_idx - w + 1` and inside longer chains, with windows negative, zero, small and at the type's largest,
    int32 and int64; and near misses, which keep the general form (among them each spelling where q_idx - w or
    q_idx - w + 1 can overflow: a negative or run-time window)."""
    Q64, KV64 = ir.cast(Q, DType.INT64), ir.cast(KV, DType.INT64)
    causal, causal64 = bin_("le", KV, Q), bin_("le", KV64, Q64)
    even_b = bin_("eq", bin_("mod", B, c(2)), c(0))
    forms: list[tuple[ir.Node, dict, int]] = []
    for w in (-7, -1, 0, 1, 17, 128, 299, INT_MAX):
        W, fits = c(w), int(w >= 0)  # q_idx - w cannot overflow
        overlay = bin_("gt", KV, bin_("sub", Q, W))  # transformers' sliding_window_overlay
        forms += [
            (_and_masks(overlay, causal), {}, fits),  # sliding_window_causal_mask_function
            (_and_masks(causal, overlay), {}, fits),
            (bin_("and", bin_("lt", bin_("sub", Q, W), KV), bin_("ge", Q, KV)), {}, fits),
            (bin_("and", bin_("ge", KV, bin_("add", bin_("sub", Q, W), c(1))), causal), {}, int(w >= 1)),
            (bin_("and", causal, bin_("ge", KV, bin_("sub", Q, W))), {}, fits),  # <= w
            (_and_masks(bin_("ge", Q, KV), even_b, bin_("lt", bin_("sub", Q, KV), W)), {}, 1),
            (_and_masks(even_b, bin_("gt", KV, bin_("sub", Q, W)), bin_("ne", H, c(3)), causal), {}, fits),
            # int64: q_idx - w fits for every int32 window, and for 2**40
            (_and_masks(causal64, bin_("gt", KV64, bin_("sub", Q64, c(w, DType.INT64)))), {}, 1),
            (_and_masks(causal64, bin_("gt", KV64, bin_("sub", Q64, c(w * 2**9 + 2**40, DType.INT64)))), {}, 1),
        ]
    w, w64 = ir.param("w", DType.INT32), ir.param("w64", DType.INT64)
    for value in (-(2**31), -7, 0, 17, INT_MAX):
        forms += [
            (_and_masks(causal, bin_("lt", bin_("sub", Q, KV), w)), {"w": value}, 1),
            (_and_masks(bin_("gt", KV, bin_("sub", Q, w)), causal), {"w": value}, 0),  # q_idx - w may overflow
            (_and_masks(causal64, bin_("gt", KV64, bin_("sub", Q64, w64))), {"w64": value * 2**32}, 0),
        ]
    t = bin_("mod", H, c(8))  # a bound that is an expression, moved across: q_idx - kv_idx < t + 3, < 100 - t
    forms += [
        (bin_("and", causal, bin_("gt", KV, bin_("sub", bin_("sub", Q, t), c(3)))), {}, 1),
        (bin_("and", causal, bin_("gt", bin_("sub", KV, t), bin_("sub", Q, c(100)))), {}, 1),
        (bin_("and", causal, bin_("lt", bin_("sub", Q, t), bin_("add", KV, c(-(2**31))))), {}, 1),  # < t - 2**31
        (bin_("and", causal, bin_("ge", KV, bin_("add", bin_("sub", Q, t), c(1)))), {}, 0),  # q - t + 1 may overflow
    ]
    # two bands in one chain (a 2-D window over rows of 8), and a conjunction used twice
    rq, rkv, cq, ckv = bin_("floordiv", Q, c(8)), bin_("floordiv", KV, c(8)), bin_("mod", Q, c(8)), bin_("mod", KV, c(8))
    forms.append((_and_masks(bin_("ge", rq, rkv), bin_("le", ckv, cq), bin_("lt", bin_("sub", rq, rkv), c(3)),
                             bin_("gt", ckv, bin_("sub", cq, c(2)))), {}, 2))
    shared = _and_masks(causal, bin_("gt", KV, bin_("sub", Q, c(17))))
    forms.append((bin_("or", bin_("and", shared, bin_("eq", H, c(0))), bin_("and", even_b, shared)), {}, 1))
    others = [bin_("ne", H, c(k)) for k in range(40)]  # a chain past _MAX_CONJUNCTS terms is written in parts
    forms.append((_and_masks(*others[:20], causal, bin_("gt", KV, bin_("sub", Q, c(17))), *others[20:]), {}, 1))
    # a strict or shifted lower bound beside a constant upper one is a range (one compare); near misses: the other
    # difference, `or`, int32 against int64, a difference that can overflow, constants in the chain
    overlay = bin_("gt", KV, bin_("sub", Q, c(17)))
    spec, base = _buffer("offsets", torch.int32, (8,), seed=62, layout="sliced")
    far = ir.load(spec, (bin_("mod", H, c(8)),))
    forms += [
        (_and_masks(bin_("lt", KV, Q), overlay), {}, 1),
        (_and_masks(bin_("ge", bin_("sub", Q, c(1)), KV), overlay), {}, 1),
        (_and_masks(bin_("ge", KV, Q), overlay), {}, 0),
        (bin_("or", causal, overlay), {}, 0),
        (_and_masks(bin_("ge", Q, KV), bin_("lt", bin_("sub", Q64, KV64), c(17, DType.INT64))), {}, 0),
        (_and_masks(bin_("le", KV, far), bin_("gt", KV, bin_("sub", far, c(17)))), {}, 0),
        (_and_masks(c(True), overlay, c(True), causal), {}, 1),
        (bin_("and", bin_("and", overlay, c(False)), causal), {}, 1),
        (bin_("and", c(True), c(True)), {}, 0),
    ]
    cases = []
    for expr, params, bands in forms:
        buffers = {"offsets": base} if "offsets" in repr(expr) else {}
        cases.append((Case("mask", expr, params=params, buffers=buffers), bands))
    return cases


@needs_gxx
def test_window_spellings_and_chains_lower_to_bands(tmp_path):
    """Sliding windows in the spellings of transformers, attention-gym and FlexAttention's docs become one unsigned
    compare each wherever the rewrite is exact, inside chains of other terms too; every case gives the IR
    evaluator's answers at the edges (q_idx - kv_idx around each window, indices near 2**31 - 1)."""
    cases = _window_cases()
    for case, bands in cases:
        fn = lower_mods(KernelSpec(kind="fwd", mask_expr=case.expr)).mask_mod_fn
        body = fn.split("{", 1)[1]
        assert body.count("fg_band_") == bands, (ir.Node.__repr__(case.expr), fn)
    for seed in (0, 1):
        check([case for case, _ in cases], tmp_path, seed=seed, points=_edge_inputs(seed))


def _hf_and_masks(*masks):
    """A conjunction built the way transformers' and_masks builds it (what its tracing meets): a True scalar made
    from q_idx, then each mask `&`-ed onto it in turn."""
    def conjunction(b, h, q_idx, kv_idx):
        visible = q_idx.new_ones((), dtype=torch.bool)
        for mask in masks:
            visible = visible & mask(b, h, q_idx, kv_idx)
        return visible

    return conjunction


def test_window_spellings_emit_one_compare():
    """The emitted mask_mod of traced sliding windows: transformers' sliding_window_causal_mask_function (its
    overlay `kv_idx > q_idx - sliding_window` and causal_mask_function in its and_masks), torch's and flexgen's
    and_masks, attention-gym's window; the general form where the window is a run-time parameter of that spelling."""
    from torch.nn.attention import flex_attention as torch_flex

    def text(fn, **bindings):
        return lower_mods(KernelSpec(kind="fwd", mask_expr=flexgen.mask_mod(fn, **bindings).expr)).mask_mod_fn

    def overlay(b, h, q_idx, kv_idx):
        return kv_idx > q_idx - 128

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    for fn in (_hf_and_masks(overlay, causal), _hf_and_masks(causal, overlay), torch_flex.and_masks(causal, overlay),
               flexgen.and_masks(flexgen.variants.causal, overlay),
               lambda b, h, q, kv: (q - 128 < kv) & (q >= kv), lambda b, h, q, kv: (q >= kv) & (q - kv < 128)):
        assert "    return fg_band_lt(q_idx - kv_idx, 128);\n" in text(fn)
    assert "return fg_band_le(q_idx - kv_idx, 127);" in text(lambda b, h, q, kv: (kv >= q - 128 + 1) & (kv <= q))
    assert "return fg_band_le(q_idx - kv_idx, 16);" in text(lambda b, h, q, kv: (q >= kv) & (q - kv <= 16))  # gym's
    chain = text(_hf_and_masks(causal, lambda b, h, q, kv: b % 2 == 0, overlay))
    assert "return fg_band_lt(q_idx - kv_idx, 128) & ((int)((unsigned)b % 2u) == 0);" in chain
    assert "fg_band_lt(q_idx - kv_idx, args.window)" in text(flexgen.variants.sliding_window(64))
    general = text("kv_idx > q_idx - w and kv_idx <= q_idx", w=64)
    assert "return (kv_idx > fg_sub(q_idx, args.w)) & (kv_idx <= q_idx);" in general


@needs_gxx
@pytest.mark.parametrize("seed", [1, 2])
def test_random_expressions_match_evaluator(tmp_path, seed):
    check(random_cases(seed, 45), tmp_path, seed=seed)


# ---------------------------------------------------------------- backward


@needs_gxx
@pytest.mark.parametrize("deterministic", [False, True])
def test_score_mod_bwd_matches_derivative(tmp_path, deterministic):
    """score_mod_bwd and its buffer-gradient slots (deterministic mode's too: one thread's sums,
    grad_out = 0 adding nothing) against the derivative and float64 autograd."""
    derivative = pytest.importorskip("flexgen.dsl.derivative")
    spec, pair = _buffer("bias", torch.float32, (8, 11), seed=40)
    bias = ir.load(spec, (H, _idx(bin_("sub", Q, KV), 11)))
    exprs = [
        bin_("add", bin_("mul", S, ir.param("scale", DType.FLOAT32)), bias),
        un("tanh", bin_("mul", S, bias)),
        ir.where(bin_("ge", Q, KV), bin_("mul", S, S), c(float("-inf"))),
        # gradient slots: one element for every point (one running sum), then two sites, one of
        # them often on the same element as the point before (b has 4 values)
        bin_("mul", S, ir.load(spec, (c(3), c(5)))),
        bin_("add", un("tanh", bin_("mul", S, bias)), ir.load(spec, (B, c(2)))),
    ]
    cases = [Case("bwd", e, buffers={"bias": pair} if "bias" in repr(e) else {}, params={"scale": 0.5},
                  grad_buffers=("bias",) if "bias" in repr(e) else ()) for e in exprs]
    results = run_on_host(cases, tmp_path, deterministic=deterministic)
    for case, (got, _, grads, pts) in zip(cases, results):
        bufs = {n: v for n, (_, v) in case.buffers.items()}
        grad_out = 1.0 + torch.arange(N_POINTS, dtype=torch.float32) / N_POINTS
        if deterministic:
            grad_out[::3] = 0.0
        dscore = evaluate(derivative.grad_score(case.expr), pts, bufs, case.params, float_dtype=torch.float32)
        torch.testing.assert_close(got, (grad_out * dscore).expand(N_POINTS), rtol=1e-5, atol=1e-6, equal_nan=True)
        for name in case.grad_buffers:
            # reference: autograd of the float64 evaluation, summed over every point that read an element
            leaf = bufs[name].to(torch.float64).clone().requires_grad_(True)
            out = evaluate(case.expr, pts, {**bufs, name: leaf}, case.params, float_dtype=torch.float64)
            (out * grad_out.to(torch.float64)).sum().backward()
            torch.testing.assert_close(grads[name].to(torch.float64), leaf.grad, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- text and structure


def _spec(score=None, mask=None, **kw):
    return KernelSpec(score_expr=score, mask_expr=mask, **kw)


def test_identity_and_no_mask():
    low = lower_mods(_spec())
    assert "return score;" in low.score_mod_fn and "// score_mod: identity" in low.score_mod_fn
    assert "return true;" in low.mask_mod_fn
    assert "struct ModArgs {" in low.mod_args_decl and "int unused_;" in low.mod_args_decl  # never empty
    assert [f.source for f in low.fields] == [("padding",)]
    assert "score_mod_bwd" in low.score_mod_bwd_fn and "__device__" not in low.score_mod_bwd_fn
    bwd = lower_mods(_spec(kind="bwd"))
    assert "return grad_out;" in bwd.score_mod_bwd_fn


def test_buffer_gradient_sites():
    """With grad buffers, score_mod_bwd takes per-thread slots, one per read site, and each site
    names the element it adds into; without, the signature and body carry no trace of them."""
    pytest.importorskip("flexgen.dsl.derivative")
    spec = BufferSpec("bias", "float32", 2)
    score = bin_("add", bin_("mul", S, ir.load(spec, (H, _idx(bin_("sub", Q, KV), 11)))), ir.load(spec, (B, c(2))))
    low = lower_mods(_spec(score, kind="bwd", grad_buffers=("bias",)))
    fn = low.score_mod_bwd_fn
    assert low.grad_sites == 2 and "constexpr int FLEXGEN_GRAD_SITES = 2;" in fn
    assert "const ModArgs& args, FlexgenGradSlots& grads) {" in fn
    assert "grads.add(0, &args.bias_grad[(long long)h * args.bias_grad_stride0 + " in fn
    assert "grads.add(1, &args.bias_grad[(long long)b * args.bias_grad_stride0 + (long long)2 * args.bias_grad_stride1], " \
           "__fmul_rn(grad_out, 1.0f));" in fn
    assert "d/dbias[b, 2] = 1.0  (gradient site 1)" in fn
    plain = lower_mods(_spec(score, kind="bwd"))  # the buffer is not learnable
    assert plain.grad_sites == 0 and "FlexgenGradSlots" not in plain.score_mod_bwd_fn
    assert "float grad_out, const ModArgs& args) {" in plain.score_mod_bwd_fn and "grads" not in plain.score_mod_bwd_fn
    # deterministic mode: the same sites, given grad_out and the derivative (the slots skip grad_out == 0),
    # and a per-warp shift into the warp's own copy of the gradients
    det = lower_mods(_spec(score, kind="bwd", grad_buffers=("bias",), deterministic=True)).score_mod_bwd_fn
    assert "long long shift;" in det and "flexgen_grad_add(live && !same ? addr[k] : nullptr, sum[k], shift);" in det
    assert "grads.add(0, &args.bias_grad[(long long)h * args.bias_grad_stride0 + " in det
    # bias[b, 2]'s element is fixed for a kernel step (one b, h): no warp vote
    assert "grads.add_bh(1, &args.bias_grad[(long long)b * args.bias_grad_stride0 + (long long)2 * args.bias_grad_stride1], " \
           "grad_out, 1.0f);" in det
    assert "long long shift" not in fn and "atomicAdd" not in det


def test_text_is_readable():
    t = bin_("sub", Q, KV)
    expr = ir.where(bin_("ge", t, c(0)), bin_("mul", S, c(0.5)), bin_("add", S, ir.cast(t, DType.FLOAT32)))
    low = lower_mods(_spec(score=expr))
    fn = low.score_mod_fn
    assert fn.splitlines()[0] == "// score_mod: where(q_idx - kv_idx >= 0, score * 0.5, score + float32(q_idx - kv_idx))"
    assert "const int t0 = q_idx - kv_idx;" in fn  # one temporary for the shared subexpression
    assert fn.split("\n", 1)[1].count("q_idx - kv_idx") == 1  # computed once, in the temporary
    assert "__fmul_rn(score, 0.5f)" in fn  # no FMA contraction: rounds like torch
    assert low.helpers == ()  # no helper needed, none emitted


def test_signatures_and_helpers():
    d = bin_("sub", Q, KV)  # may be negative: the floored helpers
    low = lower_mods(_spec(score=bin_("floordiv", d, c(3)), mask=bin_("eq", bin_("mod", d, c(2)), c(0))))
    assert "__device__ __forceinline__ float score_mod(float score, int b, int h, int q_idx, int kv_idx, const ModArgs& args)" in low.score_mod_fn
    assert "__device__ __forceinline__ bool mask_mod(int b, int h, int q_idx, int kv_idx, const ModArgs& args)" in low.mask_mod_fn
    assert "return (float)fg_floordiv(q_idx - kv_idx, 3);" in low.score_mod_fn  # int score_mod cast to float
    assert set(low.helpers) == {"fg_floordiv", "fg_mod"}
    assert low.mod_args_decl.index("fg_floordiv") < low.mod_args_decl.index("struct ModArgs")
    assert "#include" not in low.code


def test_a_mod_reading_many_elements_is_called_not_inlined():
    # A dot product over captured rows (MLA's RoPE term): 2 x 24 reads per score, over the threshold.
    q_rope, k_rope = torch.randn(2, 3, 5, 24), torch.randn(2, 1, 7, 24)
    rope = flexgen.score_mod(lambda s, b, h, q, kv: s + 0.5 * torch.dot(q_rope[b, h, q], k_rope[b, h // 3, kv]))
    low = lower_mods(make_spec("bwd", rope, flexgen.variants.causal, head_dim=64, dtype="bf16", arch="sm_90a"))
    assert "__device__ __noinline__ float score_mod(" in low.score_mod_fn
    assert "__device__ __forceinline__ bool mask_mod(" in low.mask_mod_fn
    # a few reads stay inlined
    q_short, k_short = q_rope[..., :4].clone(), k_rope[..., :4].clone()
    few = flexgen.score_mod(lambda s, b, h, q, kv: s + torch.dot(q_short[b, h, q], k_short[b, 0, kv]))
    assert "__device__ __forceinline__ float score_mod(" in lower_mods(
        make_spec("fwd", few, None, head_dim=64, dtype="bf16", arch="sm_90a")).score_mod_fn
    # a backward whose gradient reads many elements is called too; one with buffer gradients stays inlined
    table = torch.randn(24, requires_grad=True)
    learn = flexgen.score_mod(lambda s, b, h, q, kv: s + torch.dot(table, k_rope[b, 0, kv]))
    low = lower_mods(make_spec("bwd", learn, None, head_dim=64, dtype="bf16", arch="sm_90a", grad_buffers=("table",)))
    assert "__device__ __forceinline__ float score_mod_bwd(" in low.score_mod_bwd_fn


def test_struct_fields_and_sources():
    bias = BufferSpec("bias", "bfloat16", 2)
    doc = BufferSpec("doc", "int32", 1)
    score = bin_("add", bin_("mul", S, ir.param("scale", DType.FLOAT32)), ir.load(bias, (H, Q)))
    mask = bin_("and", bin_("eq", ir.load(doc, (Q,)), ir.load(doc, (KV,))), ir.param("causal", DType.BOOL))
    low = lower_mods(_spec(score=score, mask=mask, grad_buffers=("bias",)))
    assert [(f.name, f.ctype, f.source) for f in low.fields] == [
        ("bias", "const unsigned short*", ("buffer_ptr", "bias")),
        ("bias_stride0", "long long", ("buffer_stride", "bias", 0)),
        ("bias_stride1", "long long", ("buffer_stride", "bias", 1)),
        ("doc", "const int*", ("buffer_ptr", "doc")),
        ("doc_stride0", "long long", ("buffer_stride", "doc", 0)),
        ("scale", "float", ("param", "scale")),
        ("causal", "int", ("param", "causal")),
        ("bias_grad", "float*", ("grad_ptr", "bias")),
        ("bias_grad_stride0", "long long", ("grad_stride", "bias", 0)),
        ("bias_grad_stride1", "long long", ("grad_stride", "bias", 1)),
    ]
    assert "const unsigned short* __restrict__ bias;" in low.mod_args_decl
    assert "float* bias_grad;" in low.mod_args_decl
    assert "(args.causal != 0)" in low.mask_mod_fn


def test_lowering_errors():
    with pytest.raises(LoweringError, match="complex64"):
        lower_mods(_spec(score=bin_("add", S, ir.load(BufferSpec("z", "complex64", 1), (Q,)))))
    with pytest.raises(LoweringError, match="grad_buffers"):
        lower_mods(_spec(score=S, grad_buffers=("nope",)))
    with pytest.raises(LoweringError, match="one name, one buffer"):
        a = ir.load(BufferSpec("x", "float32", 1), (Q,))
        m = bin_("gt", ir.load(BufferSpec("x", "int32", 1), (Q,)), c(0))
        lower_mods(_spec(score=bin_("add", S, a), mask=m))


def test_names_and_literals():
    assert c_name("bias") == "bias" and c_name("float") == "float_" and c_name("self.table") == "self_table"
    assert c_name("__x") == "v_x" and c_name("0abc") == "_0abc"
    assert float_literal(0.1) == "0.1f" and float_literal(-2.5) == "(-2.5f)" and float_literal(3.0) == "3.0f"
    assert float_literal(float("inf")) == "__uint_as_float(0x7f800000u)"
    assert float_literal(1 / 3) == "0.33333334f"


# ---------------------------------------------------------------- ctypes mirror


def _layout_cases():
    bias = BufferSpec("bias", "bfloat16", 2)
    score = bin_("add", bin_("mul", S, ir.param("scale", DType.FLOAT32)), ir.load(bias, (H, Q)))
    mask = bin_("and", bin_("lt", ir.cast(Q, DType.INT64), ir.param("n", DType.INT64)), ir.param("flag", DType.BOOL))
    m2 = bin_("gt", bin_("add", ir.param("a", DType.INT32), ir.param("c", DType.INT32)), Q)
    reserved = bin_("add", bin_("mul", S, ir.param("int", DType.FLOAT32)), ir.load(BufferSpec("NULL", "float16", 2), (H, Q)))
    return [_spec(), _spec(score=score, mask=mask, grad_buffers=("bias",)), _spec(mask=m2),
            _spec(score=bin_("mul", S, ir.param("f", DType.FLOAT32)), mask=mask), _spec(score=reserved)]


@needs_gxx
def test_ctypes_layout_matches_cpp(tmp_path):
    specs = _layout_cases()
    src = ["#include <cstdio>", "#include <cstddef>"]
    main = ["int main() {"]
    for i, spec in enumerate(specs):
        low = lower_mods(spec)
        struct = low.mod_args_decl[low.mod_args_decl.index("struct ModArgs"):]
        src.append(f"namespace c{i} {{\n{struct}\n}}")
        main.append(f'  std::printf("%zu %zu\\n", sizeof(c{i}::ModArgs), alignof(c{i}::ModArgs));')
        for f in low.fields:
            main.append(f'  std::printf("%zu\\n", offsetof(c{i}::ModArgs, {f.name}));')
    main.append("  return 0;\n}")
    (tmp_path / "layout.cpp").write_text("\n".join(src + main))
    subprocess.run([GXX, "-std=c++17", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.cpp")], check=True)
    out = iter(subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split("\n"))
    for spec in specs:
        low = lower_mods(spec)
        cls = struct_class(low.fields)
        size, align = map(int, next(out).split())
        assert (size, align) == (ctypes.sizeof(cls), ctypes.alignment(cls))
        for f in low.fields:
            assert int(next(out)) == getattr(cls, f.name).offset, f.name


def test_pack_mod_args_fills_and_validates():
    bias = BufferSpec("bias", "bfloat16", 2)
    score = bin_("add", bin_("mul", S, ir.param("scale", DType.FLOAT32)), ir.load(bias, (H, Q)))
    mask = bin_("and", bin_("lt", ir.cast(Q, DType.INT64), ir.param("n", DType.INT64)), ir.param("flag", DType.BOOL))
    low = lower_mods(_spec(score=score, mask=mask, grad_buffers=("bias",)))
    t = torch.zeros(6, 10, dtype=torch.bfloat16)[:, ::2]
    g = torch.zeros(6, 5)
    args = pack_mod_args(low, {"bias": t}, {"scale": 0.5, "n": 2**40, "flag": True}, {"bias": g}, check_device=False)
    assert args.bias == t.data_ptr() and (args.bias_stride0, args.bias_stride1) == (10, 2)
    assert args.scale == 0.5 and args.n == 2**40 and args.flag == 1
    assert args.bias_grad == g.data_ptr() and (args.bias_grad_stride0, args.bias_grad_stride1) == (5, 1)
    assert len(bytes(args)) == ctypes.sizeof(type(args))
    with pytest.raises(ModArgsError, match="CUDA"):
        pack_mod_args(low, {"bias": t}, {"scale": 0.5, "n": 2, "flag": True}, {"bias": g})
    with pytest.raises(ModArgsError, match="dtype float32"):
        pack_mod_args(low, {"bias": t.float()}, {"scale": 0.5, "n": 2, "flag": True}, {"bias": g}, check_device=False)
    with pytest.raises(ModArgsError, match="dimension"):
        pack_mod_args(low, {"bias": t[0]}, {"scale": 0.5, "n": 2, "flag": True}, {"bias": g}, check_device=False)
    with pytest.raises(ModArgsError, match="no value given"):
        pack_mod_args(low, {"bias": t}, {"scale": 0.5}, {"bias": g}, check_device=False)
    with pytest.raises(ModArgsError, match="does not fit"):
        pack_mod_args(low, {"bias": t}, {"scale": 0.5, "n": 2**70, "flag": 1}, {"bias": g}, check_device=False)
    with pytest.raises(ModArgsError, match="gradient"):
        pack_mod_args(low, {"bias": t}, {"scale": 0.5, "n": 2, "flag": 1}, {}, check_device=False)


# ---------------------------------------------------------------- more ops: rounding, fmod, isnan, 16-bit casts


def _ties(step: float, start: float = 1.0) -> ir.Node:
    """start + (2 * kv_idx + 1) * step: exact in float32, and a tie whenever 2 * step is the spacing there."""
    odd = ir.cast(bin_("add", bin_("mul", KV, c(2)), c(1)), DType.FLOAT32)
    return bin_("add", c(start), bin_("mul", odd, c(step)))


def new_op_cases() -> list[Case]:
    cases: list[Case] = []
    kvf = ir.cast(KV, DType.FLOAT32)
    d = bin_("sub", Q, KV)
    # rounding to an integral value; round's ties (x.5) go to even, on both signs
    for op in ("floor", "ceil", "round", "trunc"):
        cases.append(Case("score", un(op, bin_("mul", S, c(1.75)))))
        cases.append(Case("score", un(op, bin_("sub", c(-0.5), kvf))))
        cases.append(Case("score", un(op, bin_("add", kvf, c(0.5)))))
    cases.append(Case("score", un("round", un("log", S))))  # NaN and -inf pass through
    # sign: 0 for +-0 and NaN; integers too
    cases.append(Case("score", un("sign", S)))
    cases.append(Case("score", un("sign", un("log", S))))
    cases.append(Case("score", ir.cast(un("sign", d), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(un("sign", ir.cast(d, DType.INT64)), DType.FLOAT32)))
    # fmod keeps the dividend's sign (C's remainder), unlike % (torch.remainder)
    cases.append(Case("score", bin_("fmod", S, c(1.5))))
    cases.append(Case("score", bin_("fmod", bin_("mul", S, c(10.0)), c(-0.75))))
    for divisor in (7, -7, 1):
        cases.append(Case("score", ir.cast(bin_("fmod", d, c(divisor)), DType.FLOAT32)))
    dyn = bin_("sub", H, c(4))
    dyn = ir.where(bin_("eq", dyn, c(0)), c(-3), dyn)
    cases.append(Case("score", ir.cast(bin_("fmod", ir.cast(d, DType.INT64), ir.cast(dyn, DType.INT64)), DType.FLOAT32)))
    # isnan, in a mask (log of a negative number) and as a condition on the score
    cases.append(Case("mask", un("isnan", un("log", bin_("sub", kvf, c(150.0))))))
    cases.append(Case("score", ir.where(un("isnan", un("sqrt", S)), c(-1.0), S)))
    # rounding to float16 / bfloat16: ties to even, subnormals, overflow past 65504, NaN, both signs
    fp16, bf16 = (lambda x: un("round_to_fp16", x)), (lambda x: un("round_to_bf16", x))
    cases.append(Case("score", fp16(_ties(2.0 ** -11))))
    cases.append(Case("score", fp16(un("neg", _ties(2.0 ** -11, start=2.0)))))
    cases.append(Case("score", fp16(_ties(2.0 ** -25, start=0.0))))  # float16 subnormals: steps of 2^-24
    cases.append(Case("score", fp16(bin_("add", c(65504.0), bin_("mul", kvf, c(0.25))))))  # 65520 and up: inf
    cases.append(Case("score", fp16(bin_("mul", S, c(1e-6)))))
    cases.append(Case("score", fp16(bin_("mul", S, c(3e4)))))
    cases.append(Case("score", fp16(un("log", S))))
    cases.append(Case("score", bf16(_ties(2.0 ** -8))))
    cases.append(Case("score", bf16(un("neg", _ties(2.0 ** -9, start=0.5)))))
    cases.append(Case("score", bf16(bin_("mul", S, c(1e38)))))  # past bfloat16's largest: inf
    cases.append(Case("score", bf16(bin_("mul", S, c(1e-39)))))  # float32 subnormals
    cases.append(Case("score", bf16(un("log", S))))
    cases.append(Case("score", bin_("add", fp16(S), bf16(bin_("mul", S, c(3.3))))))
    # log1p, atan and the compositions (accurate to a few ulp, not bit-exact)
    cases.append(Case("score", un("log1p", bin_("mul", S, c(0.2))), exact=False))
    cases.append(Case("score", un("log1p", bin_("mul", S, c(1e-5))), exact=False))
    cases.append(Case("score", un("atan", S), exact=False))
    cases.append(Case("score", functional.gelu(S, "none"), exact=False))
    cases.append(Case("score", functional.gelu(S, "tanh"), exact=False))
    cases.append(Case("score", functional.silu(S), exact=False))
    cases.append(Case("score", functional.softplus(S, None, c(20.0)), exact=False))
    cases.append(Case("score", functional.softplus(bin_("mul", S, c(4.0)), c(2.0), c(5.0)), exact=False))
    cases.append(Case("score", functional.round_decimals(S, 2)))
    # bit shifts (as multiplications and floor divisions)
    for count in (0, 3, 31, 32):
        cases.append(Case("score", ir.cast(functional.shift_left(d, count), DType.FLOAT32)))
        cases.append(Case("score", ir.cast(functional.shift_right(d, count), DType.FLOAT32)))
    cases.append(Case("score", ir.cast(functional.shift_right(functional.shift_left(ir.cast(d, DType.INT64), 40), 38), DType.FLOAT32)))
    return cases


@needs_gxx
def test_new_ops_match_evaluator(tmp_path):
    check(new_op_cases(), tmp_path, seed=3)


@needs_gxx
def test_new_ops_backward_matches_derivative_and_autograd(tmp_path):
    """score_mod_bwd of the new ops: the lowered derivative against float64 autograd of evaluate()
    (the gradient of the divisor of fmod as a buffer gradient)."""
    derivative = pytest.importorskip("flexgen.dsl.derivative")
    spec, pair = _buffer("div", torch.float32, (8,), seed=50, layout="sliced")
    divisor = bin_("add", un("abs", ir.load(spec, (H,))), c(0.5))
    exprs = [
        un("log1p", un("abs", S)),
        bin_("mul", un("atan", S), S),
        functional.gelu(S, "none"),
        functional.gelu(S, "tanh"),
        functional.silu(S),
        functional.softplus(S, c(1.5), c(4.0)),
        bin_("add", un("round", S), bin_("mul", un("sign", S), S)),
        bin_("fmod", bin_("mul", S, c(3.0)), divisor),
    ]
    cases = [Case("bwd", e, buffers={"div": pair} if "div[" in repr(e) else {},
                  grad_buffers=("div",) if "div[" in repr(e) else ()) for e in exprs]
    for case, (got, _, grads, pts) in zip(cases, run_on_host(cases, tmp_path)):
        bufs = {n: v for n, (_, v) in case.buffers.items()}
        grad_out = 1.0 + torch.arange(N_POINTS, dtype=torch.float64) / N_POINTS
        leaves = {n: v.to(torch.float64).clone().requires_grad_(True) for n, v in bufs.items()}
        score = pts["score"].to(torch.float64).requires_grad_(True)
        out = evaluate(case.expr, {**pts, "score": score}, leaves, case.params, float_dtype=torch.float64)
        (out * grad_out).sum().backward()
        torch.testing.assert_close(got.to(torch.float64), score.grad, rtol=2e-5, atol=2e-5,
                                   msg=lambda m: f"{ir.Node.__repr__(case.expr)}: {m}")
        for name in case.grad_buffers:
            torch.testing.assert_close(grads[name].to(torch.float64), leaves[name].grad, rtol=1e-4, atol=1e-4)
        dscore = evaluate(derivative.grad_score(case.expr), pts, bufs, case.params, float_dtype=torch.float32)
        torch.testing.assert_close(got, (grad_out.float() * dscore).expand(N_POINTS), rtol=1e-5, atol=1e-6)


def test_new_ops_lower_to_the_expected_functions():
    text = lambda e, **kw: lower_mods(_spec(score=e, **kw)).code  # noqa: E731
    assert "rintf(score)" in text(un("round", S))  # the default rounding mode: ties to even
    assert "fmodf(score, 1.5f)" in text(bin_("fmod", S, c(1.5)))
    assert "((q_idx - kv_idx) % 7)" in text(ir.cast(bin_("fmod", bin_("sub", Q, KV), c(7)), DType.FLOAT32))
    assert "log1pf(" in text(un("log1p", S)) and "atanf(" in text(un("atan", S))
    low = lower_mods(_spec(score=bin_("add", un("round_to_fp16", S), un("round_to_bf16", un("sign", S)))))
    assert {"fg_round_fp16", "fg_round_bf16", "fg_sign"} <= set(low.helpers)
    assert "cvt.rn.f16.f32" in low.mod_args_decl and "cvt.rn.bf16.f32" in low.mod_args_decl
    # the compositions take the fast forms of exp, tanh and division unless precise_math is asked for
    gelu_tanh = lower_mods(_spec(score=functional.gelu(S, "tanh")))
    assert "fg_tanh(" in gelu_tanh.score_mod_fn and "#define FLEXGEN_PRECISE_MATH" not in gelu_tanh.mod_args_decl
    precise = lower_mods(_spec(score=functional.gelu(S, "tanh"), extra=(("precise_math", True),)))
    assert precise.mod_args_decl.startswith("#define FLEXGEN_PRECISE_MATH 1")
    softplus = text(functional.softplus(S, None, c(20.0)))
    assert "return (score > 20.0f) ? score : log1pf(fg_exp(score));" in softplus
    assert "fg_isnan(score)" in text(ir.where(un("isnan", S), c(0.0), S))


# ---------------------------------------------------------------- the helpers header


def test_helpers_come_from_the_header_sections():
    from flexgen.codegen import lower as lower_module

    header = (Path(lower_module.__file__).parents[1] / "templates" / "common" / "score_math.cuh").read_text()
    sections = lower_module.header_sections("score_math.cuh")
    assert {"fg_floordiv", "fg_tanh", "fg_round_fp16", "fg_fast"} <= set(sections)
    for name, (body, needs) in sections.items():
        assert body in header and body.strip(), name
    low = lower_mods(_spec(score=un("exp", S)))
    assert low.helpers == ("fg_exp",)
    assert sections["fg_fast"][0] in low.mod_args_decl and sections["fg_exp"][0] in low.mod_args_decl  # exp needs fg_fast
    assert sections["fg_tanh"][0] not in low.mod_args_decl


@needs_gxx
def test_whole_helpers_header_compiles_on_the_host(tmp_path):
    from flexgen.codegen import lower as lower_module

    header = Path(lower_module.__file__).parents[1] / "templates" / "common" / "score_math.cuh"
    cpp = tmp_path / "header.cpp"
    cpp.write_text(SHIM + header.read_text() + "\nint main() { return fg_round_fp16(1.0f) == 1.0f ? 0 : 1; }\n")
    proc = subprocess.run([GXX, "-std=c++17", "-Wall", "-Werror", "-Wno-unused-function", "-o", str(tmp_path / "h"), str(cpp)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[:3000]
    assert subprocess.run([str(tmp_path / "h")]).returncode == 0


HAS_NVRTC = importlib.util.find_spec("cupy_backends") is not None


@pytest.mark.skipif(not HAS_NVRTC, reason="NVRTC (cupy) is not installed")
@pytest.mark.parametrize("precise", [False, True])
def test_new_ops_compile_with_nvrtc(precise):
    """The device side of the helpers (inline PTX for the 16-bit roundings) compiles for sm_80, the fast
    and the precise_math forms, with the backward's gradient slots."""
    from flexgen.cache import nvrtc

    spec, _ = _buffer("div", torch.float32, (8, 2), seed=51)
    score = bin_("add", functional.gelu(un("round_to_bf16", S), "tanh"),
                 bin_("fmod", functional.softplus(un("round_to_fp16", S), None, c(20.0)),
                      bin_("add", un("abs", ir.load(spec, (H, c(0)))), c(1.0))))
    mask = bin_("or", un("isnan", un("log1p", ir.cast(Q, DType.FLOAT32))), bin_("ge", un("sign", Q), KV))
    low = lower_mods(KernelSpec(kind="bwd", score_expr=score, mask_expr=mask, grad_buffers=("div",),
                                extra=(("precise_math", precise),) if precise else ()))
    kernel = low.code + """
__device__ void flexgen_grad_add(float*, float, long long) {}
extern "C" __global__ void probe(const ModArgs args, float* out) {
    FlexgenGradSlots grads = {};
    const int i = threadIdx.x;
    const float s = out[i];
    out[i] = score_mod(s, 0, 1, i, 2, args) + score_mod_bwd(s, 0, 1, i, 2, 1.0f, args, grads)
             + (mask_mod(0, 1, i, 2, args) ? 1.0f : 0.0f);
}
"""
    ptx = nvrtc.ptx(kernel, ["--gpu-architecture=sm_80", "-std=c++17", "-default-device"], name="probe.cu")
    assert "cvt.rn.f16.f32" in ptx and "cvt.rn.bf16.f32" in ptx
    assert ("tanh.approx.f32" in ptx) is not precise


# ---------------------------------------------------------------- names that C++ claims


def test_reserved_names_become_distinct_members():
    assert c_name("NULL") == "NULL_" and c_name("min") == "min_" and c_name("int") == "int_"
    assert c_name("__global__") == "v_global__" and c_name("FG_FAST_MATH") == "FG_FAST_MATH_" and c_name("_Bool") == "v_Bool"
    names = {"int": torch.int32, "int_": torch.int32, "NULL": torch.float32, "__global__": torch.float32,
             "min": torch.float32, "FG_FAST_MATH": torch.float32, "bias": torch.float32}
    specs = {n: BufferSpec(n, str(dt).removeprefix("torch."), 1) for n, dt in names.items()}
    expr = S
    for n in names:
        expr = bin_("add", expr, ir.cast(ir.load(specs[n], (H,)), DType.FLOAT32))
    expr = bin_("mul", expr, ir.param("bias_stride0", DType.FLOAT32))
    low = lower_mods(_spec(score=expr, kind="bwd", grad_buffers=("bias",)))
    members = [f.name for f in low.fields]
    assert len(members) == len(set(members))
    assert {"int_", "int__2", "NULL_", "v_global__", "min_", "FG_FAST_MATH_", "bias", "bias_stride0_2"} <= set(members)
    assert "args.NULL_[" in low.score_mod_fn and "args.bias_stride0_2" in low.score_mod_fn


@needs_gxx
def test_reserved_names_compile_and_compute(tmp_path):
    """Buffers named like macros the host headers define (NULL, EOF, INFINITY) and C++ keywords."""
    cases, buffers = [], {}
    expr = S
    for k, name in enumerate(("NULL", "EOF", "INFINITY", "int", "int_", "__global__", "min", "FG_FAST_MATH")):
        spec, pair = _buffer(name, torch.float32, (8,), seed=60 + k, layout="sliced")
        buffers[name] = pair
        expr = bin_("add", expr, bin_("mul", ir.load(spec, (H,)), c(float(k + 1))))
    cases.append(Case("score", expr, buffers=buffers))
    check(cases, tmp_path)


def test_comments_stay_on_one_line():
    from flexgen.codegen.lower import _comment

    text = _comment("a\n#error boom \\\r\n*/ x \u00e9\\")
    assert "\n" not in text and "\r" not in text and "\\" not in text and "*/" not in text
    assert text.startswith("a?#error boom")


# ---------------------------------------------------------------- the new ops in real kernels (GPU)

GPU_ROWS = torch.randn(4, 12)
GPU_WEIGHTS = torch.randn(12)
GPU_SCORE_MODS = {
    "gelu_tanh": lambda s, b, h, q, kv: F.gelu(s * 2, approximate="tanh"),
    "softplus_silu": lambda s, b, h, q, kv: F.softplus(s, beta=2) - F.silu(s),
    "log1p_atan": lambda s, b, h, q, kv: torch.atan(s) * torch.log1p(s.abs()),
    "rounding": lambda s, b, h, q, kv: torch.round(s * 4) / 4 + torch.sign(s) * 0.5 + torch.fmod(s, 1.5),
    "precision_casts": lambda s, b, h, q, kv: (s * 3.3).half().float() - s.bfloat16(),
    "row_reduction": lambda s, b, h, q, kv: s + (GPU_ROWS_CUDA[h] * GPU_WEIGHTS_CUDA).sum(-1) * 0.3,
    # activations whose derivative is continuous (elu with alpha 1 and celu are C1 at 0), and those with kinks
    "smooth_activations": lambda s, b, h, q, kv: F.elu(s * 2) + F.mish(s) + F.logsigmoid(s * 3) - F.softsign(s * 4)
    + F.celu(s, 0.5),
    "piecewise_activations": lambda s, b, h, q, kv: F.hardswish(s * 3) * 0.5 + F.leaky_relu(s, 0.1)
    + F.hardtanh(s * 2, -1.5, 2.0) + F.selu(s) + F.relu6(s * 4) * 0.25 + F.hardsigmoid(s * 3),
}
GPU_BACKWARD = ("gelu_tanh", "softplus_silu", "precision_casts", "row_reduction", "smooth_activations")
GPU_ROWS_CUDA = GPU_WEIGHTS_CUDA = None


def _gpu_case(name):
    global GPU_ROWS_CUDA, GPU_WEIGHTS_CUDA
    GPU_ROWS_CUDA, GPU_WEIGHTS_CUDA = GPU_ROWS.cuda(), GPU_WEIGHTS.cuda()
    fn = GPU_SCORE_MODS[name]
    return fn, flexgen.score_mod(fn), flexgen.mask_mod(lambda b, h, q, kv: (q >> 4) >= (kv >> 4))  # block-causal


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_SCORE_MODS))
def test_new_ops_in_kernels_match_the_reference(name):
    """Forward (and for some, backward) of flex_attention with the new ops against the float64 reference;
    the bar is twice the error of PyTorch's own bf16 math on the same inputs."""
    from lowp_math import masked_scores

    fn, score, mask = _gpu_case(name)
    B, H, L, D = 2, 4, 200, 64
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1.0 / math.sqrt(D)
    bm = flexgen.create_block_mask(mask, None, None, L, L, device="cuda")
    torch.full((B, H, L, D), float("nan"), device="cuda", dtype=torch.bfloat16)  # poison the allocator's blocks
    learn = name in GPU_BACKWARD
    qg, kg, vg = (t.clone().requires_grad_(learn) for t in (q, k, v))
    out = flexgen.flex_attention(qg, kg, vg, score_mod=score, block_mask=bm, scale=scale)
    qr, kr, vr = (t.double().requires_grad_(learn) for t in (q, k, v))
    ref = flexgen.reference_attention(qr, kr, vr, score_mod=score, mask_mod=mask, scale=scale)
    ql, kl, vl = (t.clone().requires_grad_(learn) for t in (q, k, v))
    s, vv = masked_scores(ql, kl, vl, fn, lambda b, h, qi, ki: (qi >> 4) >= (ki >> 4), scale)
    low = torch.matmul(torch.softmax(s, dim=-1), vv)
    assert not torch.isnan(out).any()
    err, base = (out.double() - ref).norm().item(), (low.double() - ref.detach()).norm().item()
    assert err <= 2 * base + 1e-5, f"{name}: output error {err:.3e} > 2 x bf16 error {base:.3e} + 1e-5"
    if learn:
        out.backward(do)
        ref.backward(do.double())
        low.backward(do)
        for what, g, r, lg in zip("qkv", (qg, kg, vg), (qr, kr, vr), (ql, kl, vl)):
            err, base = (g.grad.double() - r.grad).norm().item(), (lg.grad.double() - r.grad).norm().item()
            assert err <= 2 * base + 1e-4, f"{name}: d{what} error {err:.3e} > 2 x bf16 error {base:.3e} + 1e-4"
