"""The score_mods a kernel may compute by terms of its own instead of calling score_mod per score.

Two shapes: affine in the indices (ALiBi and its relatives, dsl/affine.py) and a soft cap (dsl/softcap.py). Lowering
emits their per-head coefficients (codegen/lower.py), the planner gives such forwards the tiles they earn
(runtime/plan.py), and each template decides where it uses them (its `fold` conditions).
"""
from __future__ import annotations

from .affine import AffineScore, affine_score
from .ir import Node
from .softcap import SoftcapScore, softcap_score


def score_fold(expr: Node | None) -> AffineScore | SoftcapScore | None:
    """The terms of a score_mod of either shape; None for any other score_mod, or none."""
    if expr is None:
        return None
    return affine_score(expr) or softcap_score(expr)
