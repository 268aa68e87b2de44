"""Marks for torch.compile, set without importing torch._dynamo.

Importing dynamo takes a second or more (1.2 s of the 1.45 s `import flexgen.ops` took on a 2-core
CPU with a CPU-only torch), and an eager call needs none of it. What flexgen's modules need from
dynamo when they are imported is only a mark on some functions, which this sets the way dynamo's
own decorator does (tests/test_dynamo_marks.py checks that the two still agree)."""
from __future__ import annotations


def assume_constant_result(fn):
    """As torch._dynamo.assume_constant_result: under torch.compile, dynamo calls `fn` at trace time
    and keeps its result as a constant of the graph."""
    fn._dynamo_marked_constant = True
    return fn
