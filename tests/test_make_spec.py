"""runtime.plan.make_spec, the per-call spec of flex_attention: memoized on what it reads, so a model's steps reuse
one spec object (and its cached hash in the kernel cache); refusals still raise every time."""
from __future__ import annotations

import pytest
import torch

import flexgen.arch
from flexgen import variants as V
from flexgen.runtime.plan import make_spec


@pytest.fixture
def hopper(monkeypatch):
    """make_spec asks the device for its architecture; a CPU tensor stands in for an sm_90 one."""
    monkeypatch.setattr(flexgen.arch, "current_arch", lambda device=None: "sm_90a")


def _q(dtype=torch.bfloat16, d=128):
    return torch.empty(1, 1, 128, d, dtype=dtype)  # (longer than a decoding query)


def test_same_inputs_give_the_same_spec(hopper):
    a = make_spec("fwd", _q(), V.softcap(30.0), V.causal, {"pingpong": True})
    b = make_spec("fwd", _q(), V.softcap(20.0), V.causal, {"pingpong": True})  # the cap is a run-time argument
    assert a is b and a.family == "sm90"


@pytest.mark.parametrize("change", ["dtype", "head_dim", "score", "mask", "options", "kind", "dropout"])
def test_what_it_reads_changes_the_spec(hopper, change):
    base = dict(kind="fwd", query=_q(), score=V.softcap(30.0), mask=V.causal, kernel_options=None, dropout=False)
    other = dict(base)
    other.update({
        "dtype": {"query": _q(torch.float16)}, "head_dim": {"query": _q(d=64)}, "score": {"score": None},
        "mask": {"mask": None}, "options": {"kernel_options": {"family": "sm80"}}, "kind": {"kind": "bwd"},
        "dropout": {"dropout": True},
    }[change])
    a, b = make_spec(**base), make_spec(**other)
    assert a is not b and a != b


def test_refusals_raise_every_time(hopper):
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown kernel_options"):
            make_spec("fwd", _q(), None, V.causal, {"BLOCK_Q": 64})


def test_unhashable_option_values_are_not_cached(hopper):
    with pytest.raises((ValueError, TypeError)):
        make_spec("fwd", _q(), None, V.causal, {"family": ["sm90"]})


def test_a_symbolic_head_dim_plans_the_kernel_of_its_value(hopper):
    """torch.compile(dynamic=True) marks every dim dynamic, the head dim too: the fake kernel plans with its value."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    q = mode.from_tensor(torch.empty(2, 4, 256, 64, dtype=torch.bfloat16, device="meta"),
                         symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4))
    assert isinstance(q.shape[-1], torch.SymInt)
    spec = make_spec("fwd", q, None, V.causal, None, mask_block=(128, 128))
    assert spec.head_dim == 64 and spec.family == "sm90"
