"""Which flexgen package a benchmark times: this checkout's, or with FLEXGEN_TREE=DIR the one under DIR (an
end-to-end A/B of two trees, e.g. `git archive REV flexgen | tar -x -C DIR`). PYTHONPATH cannot choose it, as a
script puts the checkout first. Import this before flexgen."""
from __future__ import annotations

import os
import sys

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def select(script: str) -> str:
    """Puts the chosen tree first on sys.path and returns it; exits with a message naming `script` where
    FLEXGEN_TREE holds no flexgen package."""
    tree = os.path.abspath(os.environ.get("FLEXGEN_TREE") or CHECKOUT)
    if not os.path.isfile(os.path.join(tree, "flexgen", "__init__.py")):
        sys.exit(f"{script}: FLEXGEN_TREE={tree} holds no flexgen package (flexgen/__init__.py)")
    if tree not in sys.path:
        sys.path.insert(0, tree)
    return tree
