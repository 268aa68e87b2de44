"""Random masks and scores in the shapes the integer lowering rewrites (codegen/lower.py: two bounds on one
difference, `abs(d)` against a bound, a comparison beside a bound on the same operands' difference, divisions of
values it proves non-negative), with constants and parameters at the edges of int32 and int64 and indices up to
2**31 - 1, run on the host against the IR evaluator (tests/test_lower.py's harness). Whether a case is rewritten
or kept is the lowering's choice; the test asks only that every one computes what the IR says."""
from __future__ import annotations

import math
import random

import pytest
import torch

from flexgen.codegen.lower import INT_RANGE, _division_range, lower_mods
from flexgen.codegen.spec import KernelSpec
from flexgen.dsl import ir
from flexgen.dsl.ir import DType
from test_lower import B, H, KV, N_POINTS, Q, Case, _buffer, bin_, c, check, needs_gxx, un

EDGES_32 = [-2**31, -2**31 + 1, -2**30, -300, -129, -128, -2, -1, 0, 1, 2, 127, 128, 255, 299, 300, 2**30,
            2**31 - 2, 2**31 - 1]
EDGES_64 = EDGES_32 + [-2**63, -2**63 + 1, -2**62, 2**32, 2**62, 2**63 - 2, 2**63 - 1]
LARGE_INDICES = [0, 1, 2, 127, 128, 299, 2**30, 2**31 - 3, 2**31 - 2, 2**31 - 1]
# Bounds of windows, and the offsets kv_idx - q_idx of a third of the points: each bound and its neighbours, so that
# the points land on the edges of the windows, where a wrong constant shows.
SMALL = [-130, -129, -128, -3, -2, -1, 0, 1, 2, 3, 127, 128, 129]
OFFSETS = sorted({s + e for s in SMALL + [-512, -384, -256, 256, 384, 512] for e in (-1, 0, 1)})
TILES = [2, 3, 64, 128]


def edge_points(seed: int) -> dict:
    """Indices in [0, 300) with every fifth one from LARGE_INDICES, and a third of the key indices OFFSETS away from
    their query's."""
    g = torch.Generator().manual_seed(seed)
    r = random.Random(seed)

    def indices():
        t = torch.randint(0, 300, (N_POINTS,), generator=g, dtype=torch.int32)
        for i in range(0, N_POINTS, 5):
            t[i] = r.choice(LARGE_INDICES)
        return t

    pts = {"b": torch.randint(0, 4, (N_POINTS,), generator=g, dtype=torch.int32),
           "h": torch.randint(0, 8, (N_POINTS,), generator=g, dtype=torch.int32),
           "q_idx": indices(), "kv_idx": indices(),
           "score": (torch.randn(N_POINTS, generator=g) * 4).to(torch.float32)}
    for i in range(1, N_POINTS, 3):
        pts["kv_idx"][i] = max(0, min(2**31 - 1, int(pts["q_idx"][i]) + r.choice(OFFSETS)))
    return pts


class WindowShapes:
    """One random expression per call, of the shapes above; `indices_first`: differences mostly of q_idx and
    kv_idx (and their quotients), which the band rewrites take."""

    def __init__(self, seed: int, indices_first: bool):
        self.r = random.Random(seed)
        self.seed, self.indices_first = seed, indices_first
        self.params: dict = {}
        self.buffers: dict = {}

    def param(self, dtype: DType) -> ir.Node:
        name = f"p{len(self.params)}"
        self.params[name] = self.r.choice(EDGES_64 if dtype == DType.INT64 else EDGES_32)
        return ir.param(name, dtype)

    def index(self, wide: bool) -> ir.Node:
        r = self.r
        x = r.choice([Q, KV, Q, KV, bin_("floordiv", r.choice([Q, KV]), c(r.choice([1, 2, 3, 64, 128])))])
        return ir.cast(x, DType.INT64) if wide else x

    def atom(self, wide: bool) -> ir.Node:
        r = self.r
        kind = r.randrange(10)
        if kind < 5:
            x = [Q, KV, B, H][r.randrange(4)]
        elif kind == 5:
            x = bin_(r.choice(["floordiv", "mod"]), r.choice([Q, KV]), c(r.choice([1, 2, 3, 7, 128, -3, -128])))
        elif kind == 6:
            x = self.param(DType.INT64 if wide and r.random() < 0.5 else DType.INT32)
        elif kind == 7:
            name = f"buf{len(self.buffers)}"
            spec, pair = _buffer(name, r.choice([torch.int32, torch.int64, torch.int8]), (8,),
                                 seed=self.seed * 31 + len(self.buffers))
            self.buffers[name] = pair
            x = ir.load(spec, (H,))
        elif kind == 8:
            shift = c(r.choice(EDGES_32)) if r.random() < 0.5 else c(r.choice(SMALL))
            x = bin_(r.choice(["add", "sub"]), r.choice([Q, KV]), shift)
        else:
            x = bin_("floordiv", bin_("add", r.choice([Q, KV]), c(r.randint(0, 200))), c(r.choice([1, 64, 128, 200])))
        return ir.cast(x, DType.INT64) if wide and r.random() < 0.5 else x

    def operands(self, wide: bool) -> tuple[ir.Node, ir.Node]:
        pick = self.index if self.indices_first and self.r.random() < 0.7 else self.atom
        return pick(wide), pick(wide)

    def difference(self) -> tuple[ir.Node, bool]:
        r = self.r
        wide = r.random() < 0.25
        d = bin_(r.choice(["sub", "sub", "sub", "add"]), *self.operands(wide))
        if r.random() < 0.2:
            d = bin_("add", d, c(r.randint(-5, 5)))
        return d, wide

    def bound(self, wide: bool) -> ir.Node:
        r = self.r
        if r.random() < 0.3:
            return self.param(DType.INT64 if wide else DType.INT32)
        edges = EDGES_64 if wide else EDGES_32
        return c(r.choice(edges)) if r.random() < (0.25 if self.indices_first else 0.5) else c(r.choice(SMALL))

    def compare(self, x: ir.Node, wide: bool) -> ir.Node:
        op = self.r.choice(["lt", "le", "gt", "ge", "lt", "le", "gt", "ge", "eq", "ne"])
        k = self.bound(wide)
        return bin_(op, x, k) if self.r.random() < 0.5 else bin_(op, k, x)

    def mask(self) -> ir.Node:
        r = self.r
        d, wide = self.difference()
        form = r.randrange(6)
        if form >= 4:  # a tiled window: the tiles' indices q // T and kv // T within a few tiles of each other
            tile = c(r.choice(TILES))
            d = bin_("sub", bin_("floordiv", Q, tile), bin_("floordiv", KV, tile))
            d = bin_("sub", c(0), d) if r.random() < 0.3 else d
            near = lambda: c(r.choice([-2, -1, 0, 1, 2, 3]))  # noqa: E731
            if form == 4:
                op = r.choice(["le", "lt", "ge", "gt"])
                parts = [bin_(op, un("abs", d), near()) if op in ("le", "lt") else bin_(op, near(), un("abs", d))]
            else:
                parts = [bin_(r.choice(["le", "lt"]), near(), d), bin_(r.choice(["le", "lt"]), d, near())]
        elif form == 0:
            parts = [self.compare(d, wide), self.compare(d, wide)]
        elif form == 1:
            parts = [self.compare(un("abs", d), wide)]
        elif form == 2:  # x >= y beside a bound on x - y (and perhaps on y - x)
            x, y = self.operands(wide) if r.random() < 0.6 else (self.atom(wide), self.atom(wide))
            parts = [bin_(r.choice(["ge", "gt", "le", "lt"]), x, y), self.compare(bin_("sub", x, y), wide)]
            if r.random() < 0.5:
                parts.append(self.compare(bin_("sub", y, x), wide))
        else:
            parts = [self.compare(d, wide) for _ in range(3)]
        if r.random() < 0.3:
            parts.append(bin_("eq", bin_("mod", B, c(2)), c(0)))
        if r.random() < 0.2:
            parts.append(ir.const(True))
        r.shuffle(parts)
        expr = parts[0]
        for part in parts[1:]:
            expr = bin_("and", expr, part)
        if r.random() < 0.15:
            expr = bin_("or", expr, self.compare(*self.difference()))
        if r.random() < 0.1:
            expr = un("not", expr)
        return expr

    def division(self) -> ir.Node:
        r = self.r
        x, _ = self.difference()
        if r.random() < 0.6:  # dividends whose ranges start at or near 0
            x = r.choice([un("abs", x), bin_("max", x, c(r.choice([-2, -1, 0, 1]))),
                          bin_("sub", bin_("mod", x, c(r.choice([7, 128]))), c(r.choice([0, 1])))])
        expr = bin_(r.choice(["floordiv", "mod"]), x, c(r.choice([1, 2, 3, 7, 64, 128, -1, -3, 2**31 - 1])))
        if r.random() < 0.4:
            expr = bin_(r.choice(["add", "sub", "floordiv", "mod"]), expr, c(r.choice([1, 3, 5])))
        return ir.cast(expr, DType.FLOAT32)


def window_cases(seed: int, count: int, indices_first: bool) -> list[Case]:
    cases = []
    for i in range(count):
        shapes = WindowShapes(seed * 100003 + i, indices_first)
        expr, kind = (shapes.division(), "score") if i % 4 == 3 else (shapes.mask(), "mask")
        cases.append(Case(kind, expr, buffers=shapes.buffers, params=shapes.params))
    return cases


@needs_gxx
@pytest.mark.parametrize("seed,indices_first", [(1, False), (2, False), (3, False), (4, True), (5, True), (6, True)])
def test_window_shapes_match_the_evaluator(tmp_path, seed, indices_first):
    cases = window_cases(seed, 150, indices_first)
    rewritten = sum(any(f in lower_mods(KernelSpec(mask_expr=case.expr) if case.kind == "mask" else
                                        KernelSpec(score_expr=case.expr)).code for f in ("fg_band_", "(unsigned)"))
                    for case in cases)
    assert rewritten >= 10, f"only {rewritten} of {len(cases)} cases reach the rewrites: the generator drifted"
    check(cases, tmp_path, seed=seed, points=edge_points(seed))


def _floored_mod(a: int, b: int) -> int:
    return a - (a // b) * b


def _truncated_mod(a: int, b: int) -> int:
    return int(math.fmod(a, b))


@pytest.mark.parametrize("op", ["floordiv", "mod", "fmod"])
def test_division_ranges_hold_every_result(op):
    """_division_range against every dividend and divisor of small intervals: each result lies in the range it
    gives (a range too narrow would let a later rewrite take an overflow for exact); the floored quotient's is
    exact (its corners are reached). Over the type's whole range only INT_MIN // -1 has none."""
    compute = {"floordiv": lambda a, b: a // b, "mod": _floored_mod, "fmod": _truncated_mod}[op]
    ends = range(-9, 10)
    divisor_ends = [x for x in range(-6, 7) if x != 0]
    for alo in ends:
        for ahi in (x for x in ends if x >= alo):
            for blo in divisor_ends:
                for bhi in (x for x in divisor_ends if x >= blo and (x < 0) == (blo < 0)):
                    got = _division_range(op, (alo, ahi), (blo, bhi), DType.INT32)
                    values = [compute(a, b) for a in range(alo, ahi + 1) for b in range(blo, bhi + 1)]
                    assert got is not None and got[0] <= min(values) and max(values) <= got[1], (
                        op, (alo, ahi), (blo, bhi), got, (min(values), max(values)))
                    if op == "floordiv":
                        assert got == (min(values), max(values)), (op, (alo, ahi), (blo, bhi), got)
    assert _division_range(op, (0, 5), (-1, 1), DType.INT32) is None  # a divisor range holding 0
    lo, hi = INT_RANGE[DType.INT32]
    if op == "floordiv":
        assert _division_range(op, None, (-1, -1), DType.INT32) is None  # INT_MIN // -1 leaves the type
        assert _division_range(op, None, (2, 2), DType.INT32) == (lo // 2, hi // 2)
