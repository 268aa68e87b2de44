"""flexgen as transformers' attention implementation on the GPU: tiny random-weight Llama (GQA) and
Gemma2 (softcap, sliding window 16 over 64 tokens), bf16, one row left-padded.

Tolerance: bf16 against transformers' own path in bf16 would compare two rounding patterns, so both
are measured against the float32 run of transformers' own path (SDPA for Llama; eager for Gemma2,
which has no SDPA path since SDPA has no softcap), with the same weights. flexgen's bf16 error must
stay within 2x transformers' own bf16 error plus a small floor: the kernels keep fp32 accumulators
as SDPA's do, so their rounding error is of the same size, not smaller."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import flexgen.integrations.transformers as flexgen_hf  # noqa: E402
from transformers_models import REFERENCE_IMPL, batch, build, logits_and_grads  # noqa: E402

gpu = pytest.mark.gpu
DEV = "cuda"


def _err(got, want):
    return (got - want).abs().max().item()


def _err_where_finite(got, want):
    """The error over the entries that are numbers: transformers' own bf16 SDPA path gives NaN gradients
    through fully padded rows on the GPU (seen for Llama's embedding), which cannot set the bound."""
    d = (got - want).abs()
    d = d[torch.isfinite(d)]
    return d.max().item() if d.numel() else 0.0


def _assert_as_close_as_transformers(got, own_lowp, want, what):
    scale = want.abs().max().item()
    bound = 2 * _err_where_finite(own_lowp, want) + 1e-3 * scale
    assert not torch.isnan(got).any(), what
    assert _err(got, want) <= bound, f"{what}: flexgen error {_err(got, want):.3g} > {bound:.3g}"


@gpu
@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_model_matches_transformers(isolated_kernel_cache, name, head_dim, compiled):
    flexgen_hf.register()
    ids, attention_mask = batch(DEV)
    want = logits_and_grads(build(name, head_dim, REFERENCE_IMPL[name], torch.float32, DEV), ids, attention_mask)
    own = logits_and_grads(build(name, head_dim, REFERENCE_IMPL[name], torch.bfloat16, DEV), ids, attention_mask)
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
