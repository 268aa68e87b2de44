"""Counts of a pytest JUnit XML report, and its failures grouped by the first line of their message.

    python3 benchmarks/junit_summary.py junit.xml
"""
from __future__ import annotations

import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
    counts = collections.Counter()
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            counts["failed"] += 1
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            groups[first[0][:160] if first else "(no message)"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    print(f"passed {counts['passed']}, failed {counts['failed']}, skipped {counts['skipped']}")
    for message, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"\n{len(names)} x {message}")
        for name in names[:6]:
            print(f"    {name}")
        if len(names) > 6:
            print(f"    ... and {len(names) - 6} more")


if __name__ == "__main__":
    main(sys.argv[1])
