"""Resource usage of a compiled kernel, read from ptxas's verbose report (`-v`).

The report looks the same from NVRTC (`--ptxas-options=-v`) and nvcc (`-Xptxas -v`):

    ptxas info    : Compiling entry function 'flexgen_fwd' for 'sm_80'
    ptxas info    : Function properties for flexgen_fwd
    ptxas         .     48 bytes stack frame, 124 bytes spill stores, 124 bytes spill loads
    ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem, 680 bytes cmem[0]
"""
from __future__ import annotations

import re

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPS = re.compile(r"Function properties for (\S+)\s*\n\s*ptxas\s+\.\s+(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(.*)")


def parse_resources(log: str, entry: str) -> dict:
    """Resources of `entry`: registers, static shared memory, stack frame, and spill bytes
    (spills summed over the entry and every non-inlined function it calls)."""
    sections = _ENTRY.split(log)
    # sections = [preamble, name1, body1, name2, body2, ...]
    body = next((sections[i + 1] for i in range(1, len(sections) - 1, 2) if sections[i] == entry), None)
    if body is None:
        raise ValueError(f"the ptxas report has no entry function {entry!r}; is the kernel named so? report:\n{log}")
    out = {"registers": 0, "shared_static_bytes": 0, "stack_frame_bytes": 0, "spill_stores_bytes": 0,
           "spill_loads_bytes": 0, "barriers": 0}
    for name, stack, stores, loads in _PROPS.findall(body):
        if name == entry:
            out["stack_frame_bytes"] = int(stack)
        out["spill_stores_bytes"] += int(stores)
        out["spill_loads_bytes"] += int(loads)
    used = _USED.search(body)
    if used:
        out["registers"] = int(used.group(1))
        rest = used.group(2)
        smem = re.search(r"(\d+) bytes smem", rest)
        bars = re.search(r"used (\d+) barriers", rest)
        out["shared_static_bytes"] = int(smem.group(1)) if smem else 0
        out["barriers"] = int(bars.group(1)) if bars else 0
    return out


def has_spills(resources: dict) -> bool:
    return resources["spill_stores_bytes"] > 0 or resources["spill_loads_bytes"] > 0
