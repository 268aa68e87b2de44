"""Walking an expression DAG. Needs only a node's `args` and `digest`, so that both the IR (ir.py) and
its printer (printer.py) can use it without importing each other."""
from __future__ import annotations

from typing import Any, Iterator


def postorder(root: Any) -> Iterator[Any]:
    """Each distinct node once, operands before users (iterative: deep DAGs are fine)."""
    seen: set[str] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node.digest in seen:
            continue
        if expanded:
            seen.add(node.digest)
            yield node
        else:
            stack.append((node, True))
            for a in reversed(node.args):
                if a.digest not in seen:
                    stack.append((a, False))
