"""attention-gym style masks and score_mods (test_gym_functions.py's tables), traced, lowered to CUDA C and run on the
host with g++ (test_lower.py's harness), against calling the same Python function at the same points: the integer
rewrites of the lowering (bands, unsigned division, flat conjunctions) on the functions users bring."""
from __future__ import annotations

import pytest
import torch

import flexgen
from test_gym_functions import MASKS, NEWER_MASKS, NEWER_SCORES, SCORES, B, H
from test_lower import N_POINTS, Case, needs_gxx, run_on_host

_SHAPE = dict(q_len=33, kv_len=41)  # test_gym_functions.check's default grid


def _points(q_len: int, kv_len: int, seed: int) -> dict:
    """N_POINTS inputs on the function's grid: a third near the diagonal, the corners, the rest uniform."""
    g = torch.Generator().manual_seed(seed)
    pts = {
        "b": torch.randint(0, B, (N_POINTS,), generator=g, dtype=torch.int32),
        "h": torch.randint(0, H, (N_POINTS,), generator=g, dtype=torch.int32),
        "q_idx": torch.randint(0, q_len, (N_POINTS,), generator=g, dtype=torch.int32),
        "kv_idx": torch.randint(0, kv_len, (N_POINTS,), generator=g, dtype=torch.int32),
        "score": (torch.randn(N_POINTS, generator=g) * 4).to(torch.float32),
    }
    near = N_POINTS // 3
    offset = torch.randint(-9, 10, (near,), generator=g)
    pts["kv_idx"][:near] = (pts["q_idx"][:near] + offset).clamp(0, kv_len - 1).to(torch.int32)
    pts["q_idx"][near:near + 4] = torch.tensor([0, 0, q_len - 1, q_len - 1], dtype=torch.int32)
    pts["kv_idx"][near:near + 4] = torch.tensor([0, kv_len - 1, 0, kv_len - 1], dtype=torch.int32)
    return pts


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under a (possibly strided) view, flat: the harness copies it and applies the view's offset
    and strides."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())


def _cases(table: dict, kind: str):
    return [pytest.param(table[name][0], kind, {**_SHAPE, **table[name][1]}, id=name) for name in sorted(table)]


@needs_gxx
@pytest.mark.parametrize("fn, kind, shape", _cases(MASKS, "mask") + _cases(NEWER_MASKS, "mask") +
                         _cases(SCORES, "score") + _cases(NEWER_SCORES, "score"))
def test_lowered_gym_function_matches_python(fn, kind, shape, tmp_path):
    mod = flexgen.mask_mod(fn) if kind == "mask" else flexgen.score_mod(fn)
    pts = _points(shape["q_len"], shape["kv_len"], seed=len(mod.expr.digest))
    case = Case(kind, mod.expr, buffers={name: (_storage(t), t) for name, t in mod.buffers.items()},
                params=dict(mod.params), exact=kind == "mask")
    (got, _, _, _), = run_on_host([case], tmp_path, points=pts)
    index = [pts[name].long() for name in ("b", "h", "q_idx", "kv_idx")]
    with torch.no_grad():
        want = torch.as_tensor(fn(*index) if kind == "mask" else fn(pts["score"], *index)).expand(N_POINTS)
    if kind == "mask":
        assert torch.equal(got, want.to(torch.bool)), f"{int((got != want).sum())} of {N_POINTS} points differ"
    else:
        torch.testing.assert_close(got, want.to(torch.float32), rtol=2e-5, atol=2e-5)
