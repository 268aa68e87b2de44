"""A plain value a mod reads through an object it captures (a bound method's owner's float, a captured object's
attribute, a dict entry) is baked into the kernel: changing it must trace the mod again, eager (the trace cache and
planned calls) and under torch.compile (dynamo guards on it), never run the kernel built for the old value."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import flexgen
from test_eager_plans import expected, made, qkv  # noqa: F401  (made: the fixture)


class Temperature(nn.Module):
    """A score_mod that is a bound method reading a float attribute (an annealed temperature)."""

    def __init__(self):
        super().__init__()
        self.temperature = 1.0

    def score_mod(self, s, b, h, q_idx, kv_idx):
        return s / self.temperature + (kv_idx - q_idx) * 0.01

    def forward(self, q, k, v):
        return flexgen.flex_attention(q, k, v, score_mod=self.score_mod)


class Settings:
    def __init__(self):
        self.slope = 0.5


def _over_object(settings):
    return lambda s, b, h, q_idx, kv_idx: s + settings.slope * (kv_idx - q_idx) / 16


def _over_dict(table):
    return lambda s, b, h, q_idx, kv_idx: s + table["slope"] * (kv_idx - q_idx) / 16


def test_eager_plans_follow_a_changed_value(made):  # noqa: F811
    q, k, v = qkv()
    module = Temperature()
    settings, table = Settings(), {"slope": 0.5}
    over_object, over_dict = _over_object(settings), _over_dict(table)
    for value in (1.0, 3.0, 1.0):
        module.temperature, settings.slope, table["slope"] = value, value, value
        torch.testing.assert_close(module(q, k, v), expected(q, k, v, score_mod=module.score_mod), rtol=2e-2,
                                   atol=2e-2)
        for fn in (over_object, over_dict):
            torch.testing.assert_close(flexgen.flex_attention(q, k, v, score_mod=fn), expected(q, k, v, score_mod=fn),
                                       rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("holder", ["method", "object", "dict"])
def test_compiled_calls_follow_a_changed_value(holder):
    """Float64 on the CPU (the ops' unfused path): after the value changes, the compiled call equals eager's."""
    module, settings, table = Temperature(), Settings(), {"slope": 0.5}
    if holder == "method":
        call = module
    else:
        fn = _over_object(settings) if holder == "object" else _over_dict(table)
        call = lambda q, k, v: flexgen.flex_attention(q, k, v, score_mod=fn)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the unfused path's notice)
        for value in (1.0, 3.0, 1.0):
            module.temperature, settings.slope, table["slope"] = value, value, value
            q, k, v = (torch.randn(2, 2, 48, 16, dtype=torch.float64) for _ in range(3))
            torch.testing.assert_close(compiled(q, k, v), call(q, k, v), atol=1e-12, rtol=0)
