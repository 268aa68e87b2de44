"""cuda_graphs.allocating_for_a_graph, on CPU: cudagraph trees' warm-up is told by the current stream being
their manager's own (stand-ins for the CUDA calls; the real thing runs in test_gpu_compile.py)."""
import sys
import types

import pytest
import torch

from flexgen import cuda_graphs


@pytest.fixture
def fake_cuda(monkeypatch):
    state = types.SimpleNamespace(stream="user stream", capturing=False, manager=None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: state.stream)
    trees = types.ModuleType("torch._inductor.cudagraph_trees")

    def get_manager(index, create_if_none_exists=True):
        assert index == 0 and not create_if_none_exists
        return state.manager
    trees.get_manager = get_manager
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees)
    return state


def test_outside_any_graph(fake_cuda):
    assert not cuda_graphs.allocating_for_a_graph()
    fake_cuda.manager = types.SimpleNamespace(stream="trees' stream")
    assert not cuda_graphs.allocating_for_a_graph()


def test_while_capturing(fake_cuda):
    fake_cuda.capturing = True
    assert cuda_graphs.allocating_for_a_graph()


def test_while_cudagraph_trees_warm_up(fake_cuda):
    fake_cuda.manager = types.SimpleNamespace(stream="trees' stream")
    fake_cuda.stream = "trees' stream"
    assert cuda_graphs.allocating_for_a_graph()


def test_a_pytorch_without_those_internals(fake_cuda, monkeypatch):
    monkeypatch.delattr(sys.modules["torch._inductor.cudagraph_trees"], "get_manager")
    assert not cuda_graphs.allocating_for_a_graph()
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees")
    assert not cuda_graphs.allocating_for_a_graph()
