"""benchmarks/profile_one.py: FA4's options for the variants it runs without a CuTe-DSL mod."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import profile_one  # noqa: E402


def test_fa4_takes_the_benchmarks_window_as_its_own_left_window():
    # bench_attention.py's sliding<W> keeps q - kv < W; FA4 keeps q - window_size[0] <= kv <= q
    assert profile_one.fa4_options("sliding1024") == {"causal": True, "window_size": (1023, 0)}
    assert profile_one.fa4_options("sliding256") == {"causal": True, "window_size": (255, 0)}
    assert profile_one.fa4_options("causal") == {"causal": True}
    assert profile_one.fa4_options("full") == profile_one.fa4_options("none") == {"causal": False}


def test_a_variant_fa4_needs_a_mod_for_is_refused_by_name():
    with pytest.raises(SystemExit, match="document-causal"):
        profile_one.fa4_options("document-causal")
