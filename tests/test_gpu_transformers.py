"""flexgen as transformers' attention implementation on the GPU: tiny random-weight Llama (GQA) and
Gemma2 (softcap, sliding window 16 over 64 tokens), bf16, one row left-padded.

Tolerance: bf16 against transformers' own path in bf16 would compare two rounding patterns, so both
are measured against the float32 run of transformers' own path (SDPA for Llama; eager for Gemma2,
which has no SDPA path since SDPA has no softcap), with the same weights. flexgen's bf16 error (a norm over
each tensor) must stay within 2x the error of transformers' eager path in bf16 plus a small floor: the
kernels keep fp32 accumulators, so their rounding error is of the same size, not smaller."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import flexgen.integrations.transformers as flexgen_hf  # noqa: E402
from transformers_models import REFERENCE_IMPL, batch, build, logits_and_grads  # noqa: E402

gpu = pytest.mark.gpu
DEV = "cuda"


def _err(got, want):
    """The error as a norm over the whole tensor: a max over single entries swings with one rounding step
    (a layer-norm weight's gradient sums over every token), the norm is stable from run to run."""
    return (got.double() - want.double()).norm().item()


def _assert_as_close_as_transformers(got, own_lowp, want, what):
    bound = 2 * _err(own_lowp, want) + 1e-3 * want.double().norm().item()
    assert not torch.isnan(got).any(), what
    assert not torch.isnan(own_lowp).any(), f"{what}: transformers' own bf16 run gave NaN; it cannot set the bound"
    assert _err(got, want) <= bound, f"{what}: flexgen error {_err(got, want):.3g} > {bound:.3g}"


@gpu
@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_model_matches_transformers(isolated_kernel_cache, name, head_dim, compiled):
    flexgen_hf.register()
    ids, attention_mask = batch(DEV)
    want = logits_and_grads(build(name, head_dim, REFERENCE_IMPL[name], torch.float32, DEV), ids, attention_mask)
    # transformers' own bf16 error, from its eager path: its bf16 SDPA path gives NaN gradients through the
    # padded row on the GPU (every q_proj gradient of the Llama), which cannot set a bound.
    own = logits_and_grads(build(name, head_dim, "eager", torch.bfloat16, DEV), ids, attention_mask)
    model = build(name, head_dim, "flexgen", torch.bfloat16, DEV)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model)
    got = logits_and_grads(model, ids, attention_mask)
    _assert_as_close_as_transformers(got[0], own[0], want[0], "logits")
    assert got[1].keys() == want[1].keys()
    for n in want[1]:
        _assert_as_close_as_transformers(got[1][n], own[1][n], want[1][n], f"grad of {n}")


@gpu
def test_generate_matches_transformers_greedy(isolated_kernel_cache):
    """Greedy decoding with the KV cache (one-token queries, offsets): the same tokens as SDPA's in float32."""
    flexgen_hf.register()
    ids, attention_mask = batch(DEV)
    out = {}
    for impl, dtype in (("sdpa", torch.float32), ("flexgen", torch.bfloat16)):
        model = build("llama", 64, impl, dtype, DEV).eval()
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=attention_mask).logits.float()
            gen = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)
        assert gen.shape == (2, ids.shape[1] + 4)
    real = attention_mask.bool()
    assert (out["flexgen"][real].argmax(-1) == out["sdpa"][real].argmax(-1)).float().mean() > 0.95
