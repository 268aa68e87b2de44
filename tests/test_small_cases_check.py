"""benchmarks/small_cases_check.py: its harness on the CPU (the float64 path) and its grid cut."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import small_cases_check  # noqa: E402


def test_the_harness_runs_each_named_case_on_the_float64_path(capsys):
    assert small_cases_check.main(["--device", "cpu", "--cases", "64:causal,32:alibi-causal", "--seqlen", "70"]) == 0
    out = capsys.readouterr().out
    assert "D64 causal: float64 path ran" in out and "D32 alibi-causal: float64 path ran" in out
    assert out.strip().endswith("0 failed")


def test_the_grid_cut_reaches_every_module_that_sizes_a_persistent_grid(monkeypatch):
    import flexgen.runtime.backward as backward
    import flexgen.runtime.families as families
    import flexgen.runtime.plan as plan

    for module in (families, backward, plan):
        monkeypatch.setattr(module, "sm_count", module.sm_count)  # restored after the test
    small_cases_check.cut_grid(3)
    assert [m.sm_count(None) for m in (families, backward, plan)] == [3, 3, 3]


def test_an_unknown_case_is_refused_by_name():
    with pytest.raises(Exception, match="nonsense"):
        small_cases_check.main(["--device", "cpu", "--cases", "64:nonsense", "--seqlen", "70"])
