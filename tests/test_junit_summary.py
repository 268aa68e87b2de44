"""benchmarks/junit_summary.py: counts and grouped failures of a JUnit report; benchmarks/pytorch_tests.sh, which
writes that report for PyTorch's FlexAttention test file run against flexgen."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "junit_summary.py"

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="t.TestA" name="test_ok"/>
<testcase classname="t.TestA" name="test_bad1"><failure message="ValueError: no&#10;more">tb</failure></testcase>
<testcase classname="t.TestB" name="test_bad2"><failure message="ValueError: no">tb</failure></testcase>
<testcase classname="t.TestB" name="test_err"><error message="">boom</error></testcase>
<testcase classname="t.TestB" name="test_skip"><skipped message="why"/></testcase>
</testsuite></testsuites>
"""


def test_counts_and_groups_failures_by_their_first_line(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(REPORT)
    out = subprocess.run([sys.executable, str(SCRIPT), str(report)], capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "passed 1, failed 3, skipped 1"
    assert lines[2] == "2 x ValueError: no" and lines[3:5] == ["    TestA.test_bad1", "    TestB.test_bad2"]
    assert "1 x boom" in lines and "    TestB.test_err" in lines


PYTORCH_TESTS = SCRIPT.parent / "pytorch_tests.sh"

TEST_FILE = '''from torch.nn.attention.flex_attention import flex_attention
import torch


class Paged:  # PagedAttention.assign of the installed torch takes positions of shape (B, S)
    def assign(self, batch_idx, input_pos, k, v, k_cache, v_cache):
        assert input_pos.shape == (batch_idx.shape[0], 5), input_pos.shape


def test_the_import_is_flexgens():
    assert flex_attention.__module__.startswith("flexgen")


def test_older_one_dimensional_positions_are_broadcast():
    batch_idx, input_pos = torch.arange(3), torch.arange(5)
    Paged().assign(batch_idx, input_pos, None, None, None, None)


def test_two_dimensional_positions_pass_as_they_are():
    batch_idx, input_pos = torch.arange(3), torch.arange(5).expand(3, 5)
    Paged().assign(batch_idx, input_pos, None, None, None, None)
'''


def test_pytorch_tests_points_the_file_at_flexgen_and_adapts_paged_positions(tmp_path):
    """benchmarks/pytorch_tests.sh on a stand-in for PyTorch's file: its flex_attention import becomes flexgen's,
    an older file's 1-D positions for PagedAttention.assign reach it as (B, S), and the summary counts the tests."""
    src = tmp_path / "test_flex_attention.py"
    src.write_text(TEST_FILE)
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(PYTORCH_TESTS), str(src), str(out), "-p", "no:cacheprovider"],
                         capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 0, run.stdout + run.stderr
    assert (out / "summary.txt").read_text().splitlines()[0] == "passed 3, failed 0, skipped 0"
