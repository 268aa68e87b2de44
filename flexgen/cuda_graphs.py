"""Whether what is allocated now belongs to a CUDA graph, so that nothing made now may be kept for later calls:
while a graph is captured (a graph keeps the addresses it was captured with, and a kept tensor may be freed while
the graph lives), and while torch.compile's CUDA-graph modes (cudagraph trees) warm a graph up, when every
allocation goes to the graph's private pool and all that outlives the call there must be one of its outputs."""
from __future__ import annotations

import sys

import torch


def allocating_for_a_graph() -> bool:
    return torch.cuda.is_current_stream_capturing() or _warming_up_in_a_graph_pool()


def _warming_up_in_a_graph_pool() -> bool:
    """cudagraph trees run a warm-up on their manager's own stream; nothing else launches there."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:  # (never imported: no CUDA-graph mode has run)
        return False
    try:
        manager = trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        return manager is not None and torch.cuda.current_stream() == manager.stream
    # (a PyTorch whose internals moved: as before them; AssertionError: torch 2.11 asserts that the thread has the
    # trees' per-thread state, which a plain thread lacks, and where there is no graph either)
    except (AttributeError, TypeError, RuntimeError, AssertionError):
        return False
