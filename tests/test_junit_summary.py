"""benchmarks/junit_summary.py: counts and grouped failures of a JUnit report."""
from __future__ import annotations

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
