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


@pytest.mark.parametrize("lookup", ["installed", "torch 2.11"])
def test_a_fresh_thread_after_cudagraph_trees_were_imported(monkeypatch, lookup):
    """PyTorch's own module, imported (as any CUDA-graph mode of torch.compile does): a plain Python thread has none
    of its thread-local state, which torch 2.11's lookup asserts (newer ones make it); no graph is warmed up there,
    and flexgen's first launch in such a thread must not fail on the check."""
    import threading

    import torch._inductor.cudagraph_trees as trees

    if lookup == "torch 2.11":
        def get_obj(local, attr_name):  # (that release's lookup of the state, which asserts it exists)
            if hasattr(local, attr_name):
                return getattr(local, attr_name)
            assert torch._C._is_key_in_tls(attr_name)
            return torch._C._get_obj_in_tls(attr_name)
        monkeypatch.setattr(trees, "get_obj", get_obj)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = {}

    def check():
        try:
            seen["answer"] = cuda_graphs.allocating_for_a_graph()
        except BaseException as error:  # (re-raised below, in the test's own thread)
            seen["error"] = error

    assert not cuda_graphs.allocating_for_a_graph()  # the importing thread: no manager for the device
    thread = threading.Thread(target=check)
    thread.start()
    thread.join()
    assert "error" not in seen, repr(seen.get("error"))
    assert seen["answer"] is False
