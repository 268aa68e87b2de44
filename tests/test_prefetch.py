"""The backward's kernels compile in the background when a forward that needs gradients is called
(runtime/prefetch.py), and one kernel is built once per process however many threads ask for it."""
import threading

import pytest
import torch

import flexgen
import flexgen.arch
from flexgen.cache import jit
from flexgen.codegen.api import make_spec
from flexgen.runtime import prefetch


@pytest.fixture
def hopper(monkeypatch, isolated_kernel_cache):
    """Plan as if the current device were an H200; every test starts with nothing in memory."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")
    monkeypatch.setenv("FLEXGEN_BACKGROUND_COMPILE", "1")
    monkeypatch.setattr(prefetch, "seen", set())
    monkeypatch.setattr(prefetch, "_submitted", set())
    jit.clear_memory()
    yield
    jit.clear_memory()


def _count_compiles(monkeypatch) -> list:
    compiled = []
    real = jit.compile_and_store

    def counting(spec, *args, **kwargs):
        compiled.append(spec.kind)
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(jit, "compile_and_store", counting)
    return compiled


def test_backward_kernels_compile_in_background_once(hopper, monkeypatch):
    compiled = _count_compiles(monkeypatch)
    window = 96 + torch.randint(0, 1000, ()).item()  # a variant no other test has compiled
    mask = flexgen.mask_mod(lambda b, h, q, kv: (q >= kv) & (q - kv < window))
    query = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16, device="meta")
    key = ("window", window)
    futures = prefetch.backward_kernels(key, query, None, mask, None, False, (), (128, 128))
    assert len(futures) == 3
    for f in futures:
        f.result(timeout=300)
    assert sorted(compiled) == ["bwd", "bwd_postprocess", "bwd_preprocess"]
    # the backward finds them in memory: planning its specs compiles nothing more
    from flexgen.runtime.plan import make_spec as plan_call

    spec = plan_call("bwd", query, None, mask, None, mask_block=(128, 128))
    assert spec.kind == "bwd" and jit.get_kernel(spec) is jit.get_kernel(spec)
    assert prefetch.backward_kernels(key, query, None, mask, None, False, (), (128, 128)) == []
    assert len(compiled) == 3


def test_one_build_per_kernel_across_threads(hopper, monkeypatch):
    compiled = _count_compiles(monkeypatch)
    scale = 1.0 + torch.rand(()).item()
    spec = make_spec("fwd", score_mod=lambda s, b, h, q, kv: s * scale, head_dim=64, dtype="fp16", arch="sm_90a")
    got = [None] * 4
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, jit.get_kernel(spec))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert compiled == ["fwd"]
    assert all(k is got[0] for k in got)


def test_background_compile_is_off_unless_asked_for(hopper, monkeypatch):
    monkeypatch.delenv("FLEXGEN_BACKGROUND_COMPILE")
    query = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16, device="meta")
    assert prefetch.backward_kernels(("off",), query, None, None, None, False, (), None) == []


def test_a_plan_that_fails_is_left_to_the_backward(hopper):
    query = torch.empty(1, 2, 256, 64, dtype=torch.bfloat16, device="meta")
    assert prefetch.backward_kernels(("bad",), query, None, None, {"BLOCK_M1": 3}, False, (), None) == []


@pytest.mark.gpu
def test_forward_that_needs_gradients_starts_the_backward_kernels(isolated_kernel_cache, monkeypatch):
    monkeypatch.setenv("FLEXGEN_BACKGROUND_COMPILE", "1")
    offset = 0.25 + torch.rand(()).item()  # a variant no other test has compiled
    q, k, v = (torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    score_mod = lambda s, b, h, qi, kv: s + offset * (qi - kv)  # noqa: E731
    seen_before = set(prefetch.seen)
    out = flexgen.flex_attention(q, k, v, score_mod=score_mod)
    started = prefetch.seen - seen_before
    assert len(started) == 1, "the forward did not start its backward's kernels"
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_q, ref_k, ref_v = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = flexgen.reference_attention(ref_q, ref_k, ref_v, score_mod=score_mod)
    ref.backward(grad.cpu().double())
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=2e-2, rtol=0)
    for got, want in ((q.grad, ref_q.grad), (k.grad, ref_k.grad), (v.grad, ref_v.grad)):
        torch.testing.assert_close(got.cpu().double(), want, atol=5e-2, rtol=0)

    with torch.no_grad():  # nothing will need a backward: nothing starts
        flexgen.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s - offset)
    assert prefetch.seen - seen_before == started
