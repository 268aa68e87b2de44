"""flexgen as a Hugging Face transformers attention implementation, on the CPU.

The kernels need CUDA; here they are replaced by flexgen's float64 reference (what the GPU tests in
tests/test_gpu_transformers.py check the kernels against), so what is tested is everything around
them: registration, the masks the adapter builds from transformers' closures, the arguments each
layer passes (scale, GQA, softcap), padding, gradients, and the model under torch.compile."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("transformers")

import flexgen  # noqa: E402
import flexgen.integrations.transformers as flexgen_hf  # noqa: E402
from transformers_models import PAD_ROW1, REFERENCE_IMPL, SEQ, batch, build, logits_and_grads  # noqa: E402

flexgen_hf.register()


def _gqa(q, k):
    return q.shape[1] != k.shape[1]


def _reference_forward(q, k, v, score, bm, mask, scale, kernel_options, **_):
    # lse is in float32 in the kernels' output, whatever the inputs' dtype
    out, lse = flexgen.reference_attention(q, k, v, score_mod=score, mask_mod=mask, scale=scale, return_lse=True,
                                           enable_gqa=_gqa(q, k))
    return out.to(q.dtype), lse


def _reference_grads(q, k, v, out, lse, grad_out, score, bm, mask, scale, kernel_options, needs, grad_buffers=(),
                     grad_lse=None, **_):
    with torch.enable_grad():
        x = [t.detach().double().requires_grad_(bool(n)) for t, n in zip((q, k, v), needs)]
        ref, ref_lse = flexgen.reference_attention(*x, score_mod=score, mask_mod=mask, scale=scale,
                                                   enable_gqa=_gqa(q, k), return_lse=True)
        outputs, grads_in = [ref], [grad_out.double()]
        if grad_lse is not None:  # the lse's gradient: rows that see nothing have none
            outputs.append(ref_lse.masked_fill(torch.isneginf(ref_lse), 0.0))
            grads_in.append(grad_lse.double())
        grads = iter(torch.autograd.grad(outputs, [t for t in x if t.requires_grad], grads_in))
    return (*(next(grads).to(q.dtype) if n else None for n in needs), {})


def _reference_backward(*args, **kwargs):
    """Autograd is off inside an op's kernel (thread-local): differentiate on another thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_reference_grads, *args, **kwargs).result()


@pytest.fixture
def cpu_kernels(monkeypatch):
    from flexgen import attention
    from flexgen.runtime import backward, forward

    monkeypatch.setattr(attention, "_check_inputs", lambda *a: None)
    monkeypatch.setattr(attention, "unfused_reason", lambda *a: None)  # CPU tensors through the ops, not the unfused path
    monkeypatch.setattr(forward, "forward_call", _reference_forward)
    monkeypatch.setattr(backward, "backward_call", _reference_backward)


def test_register_adds_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert AttentionInterface()["flexgen"] is flexgen_hf.flexgen_attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["flexgen"] is flexgen_hf.flexgen_block_mask


def _mask_cases():
    from transformers import masking_utils as mu

    return {
        "causal": (mu.causal_mask_function, 0),
        "sliding": (mu.sliding_window_causal_mask_function(16), 0),
        "chunked": (mu.chunked_causal_mask_function(24, torch.tensor([0, PAD_ROW1])), 0),
        "causal_offset": (mu.causal_mask_function, 9),
    }


@pytest.mark.parametrize("case", ["causal", "sliding", "chunked", "causal_offset"])
@pytest.mark.parametrize("padded", [False, True])
def test_block_mask_equals_transformers_mask(case, padded):
    from transformers.masking_utils import sdpa_mask

    fn, offset = _mask_cases()[case]
    q_len, kv_len = SEQ - offset, SEQ
    attention_mask = torch.ones(2, SEQ, dtype=torch.bool)
    if padded:
        attention_mask[1, : int(torch.randint(1, 20, ()))] = False
    kw = dict(batch_size=2, q_length=q_len, kv_length=kv_len, q_offset=offset, kv_offset=0, mask_function=fn,
              attention_mask=attention_mask, device="cpu")
    bm = flexgen_hf.flexgen_block_mask(**kw)
    assert isinstance(bm, flexgen.BlockMask) and isinstance(bm.mask_mod, flexgen.Mod)
    want = sdpa_mask(**kw, allow_is_causal_skip=False).expand(2, 1, q_len, kv_len)
    got = flexgen.create_mask(bm.mask_mod, 2, None, q_len, kv_len, device="cpu")
    assert torch.equal(got, want)
    # the blocks agree with the elements: every visible element is in a visited block, full blocks are all visible
    bq, bkv = bm.BLOCK_SIZE
    visited = bm.to_dense().bool().repeat_interleave(bq, -2).repeat_interleave(bkv, -1)[..., :q_len, :kv_len]
    assert not (want & ~visited).any()
    full = bm._dense(bm.full_kv_num_blocks, bm.full_kv_indices).repeat_interleave(bq, -2)
    full = full.repeat_interleave(bkv, -1)[..., :q_len, :kv_len]
    assert not (full & ~want).any()


@pytest.mark.parametrize("name", ["llama", "gemma2"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_matches_transformers_own_attention(cpu_kernels, name, compiled):
    """float32 on the CPU: flexgen (with the reference kernel) against transformers' SDPA (Llama) or
    eager (Gemma2) path, logits and every parameter's gradient, one row left-padded."""
    ids, attention_mask = batch("cpu")
    ref = build(name, 32, REFERENCE_IMPL[name], torch.float32, "cpu")
    model = build(name, 32, "flexgen", torch.float32, "cpu")
    assert model.config._attn_implementation == "flexgen"
    want_logits, want_grads = logits_and_grads(ref, ids, attention_mask)
    run = model
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(model, backend="aot_eager")
    logits, grads = logits_and_grads(run, ids, attention_mask)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys() and len(grads) > 10
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-3, atol=1e-6, msg=n)
    # the padding mattered: without it, row 1's logits differ
    unpadded = model(input_ids=ids, attention_mask=torch.ones_like(attention_mask)).logits[1, PAD_ROW1:]
    assert not torch.allclose(unpadded.float(), logits[SEQ:], atol=1e-3)


def test_compiled_model_keeps_every_attention_layer_in_the_graph(cpu_kernels):
    from torch._dynamo.utils import counters

    from test_compile import Recorder, targets

    ids, attention_mask = batch("cpu")
    model = build("gemma2", 32, "flexgen", torch.float32, "cpu")
    torch._dynamo.reset()
    counters.clear()
    rec = Recorder()
    torch.compile(model, backend=rec)(input_ids=ids, attention_mask=attention_mask)
    ops = sum(targets(g).count("flexgen.attention_fwd.default") for g in rec.graphs)
    assert ops == model.config.num_hidden_layers
    breaks = " ".join(counters["graph_break"])
    assert "_build_block_mask" in breaks  # the masks, built once per forward outside the graph


def test_gpt_oss_sinks_match_transformers_eager(cpu_kernels):
    """GPT-OSS's attention sinks (s_aux) through flexgen's differentiable lse: logits and every parameter's
    gradient, the sinks' own included, against transformers' eager path (float32, CPU, one row padded)."""
    import copy

    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ids, attention_mask = batch("cpu")
    results = []
    for impl in ("eager", "flexgen"):
        torch.manual_seed(0)
        model = GptOssForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:  # sinks that matter: as large as the scores
                layer.self_attn.sinks.normal_(0.0, 2.0)
        results.append(logits_and_grads(model.train(), ids, attention_mask))
    (want_logits, want_grads), (logits, grads) = results
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys() and any("sinks" in n for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-3, atol=1e-6, msg=n)


def test_attention_refuses_what_it_cannot_do():
    q = torch.zeros(1, 4, 16, 32, device="meta", dtype=torch.bfloat16)
    module = torch.nn.Module()
    with pytest.raises(TypeError, match="additive float mask"):
        flexgen_hf.flexgen_attention_forward(module, q, q, q, torch.zeros(1, 1, 16, 16))


def test_flexgen_imports_without_transformers():
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None; import flexgen.integrations.transformers as t\n"
            "try:\n    t.register()\nexcept ImportError as e:\n    print('refused:', e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused:" in out and "flexgen-attention[transformers]" in out
