"""The driver's current context, asked once per thread (cache/kernel.make_context_current): a thread with no current
context gets the device's primary one made current before its first launch (PyTorch's autograd worker can reach
flexgen first); later launches of that thread skip the question."""
from __future__ import annotations

import threading
from types import SimpleNamespace

from at_once import at_once
from flexgen.cache import kernel as kernel_mod


def _fake_cuda(current: dict, asked: list, made: list):
    """A cupy.cuda stand-in whose context is current per thread once setDevice ran there."""
    def ctx_get_current():
        asked.append(threading.get_ident())
        return current.get(threading.get_ident(), 0)

    def set_device(index):
        made.append((threading.get_ident(), index))
        current[threading.get_ident()] = 1

    return SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: 3, setDevice=set_device),
                           driver=SimpleNamespace(ctxGetCurrent=ctx_get_current))


def test_each_thread_is_given_a_context_once(monkeypatch):
    current, asked, made = {}, [], []
    monkeypatch.setattr(kernel_mod, "_cupy_cuda", lambda: _fake_cuda(current, asked, made))
    monkeypatch.setattr(kernel_mod, "_this_thread", threading.local())

    def launches(_):
        return threading.get_ident(), [kernel_mod.make_context_current() for _ in range(3)]

    ran = at_once(launches, 2)  # (both threads alive at once: two idents)
    idents = sorted(ident for ident, _ in ran)
    assert [indices for _, indices in ran] == [[3, 3, 3]] * 2
    assert sorted(made) == [(i, 3) for i in idents]  # the primary context made current once in each fresh thread
    assert sorted(asked) == idents  # and the driver asked once per thread, not per launch


def test_a_thread_that_has_a_context_keeps_it(monkeypatch):
    me = threading.get_ident()
    current, asked, made = {me: 1}, [], []
    monkeypatch.setattr(kernel_mod, "_cupy_cuda", lambda: _fake_cuda(current, asked, made))
    monkeypatch.setattr(kernel_mod, "_this_thread", threading.local())
    assert kernel_mod.make_context_current() == 3 and kernel_mod.make_context_current() == 3
    assert made == [] and asked == [me]
