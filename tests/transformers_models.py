"""Tiny random-weight transformers models for the integration tests (CPU and GPU): a Llama with
grouped-query attention and a Gemma2 with logit softcapping and a sliding window that matters
(window 16, sequence 64), built from configs; nothing is downloaded."""
from __future__ import annotations

import copy

import torch

SEQ = 64
PAD_ROW1 = 7  # left padding: row 1 starts with this many padding tokens


def configs(head_dim: int) -> dict:
    from transformers import Gemma2Config, LlamaConfig

    common = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256)
    return {
        "llama": LlamaConfig(**common),
        "gemma2": Gemma2Config(**common, sliding_window=16, attn_logit_softcapping=20.0,
                               query_pre_attn_scalar=head_dim, final_logit_softcapping=None),
    }


# transformers' own path each is compared with: Gemma2 has no SDPA path (SDPA has no softcap).
REFERENCE_IMPL = {"llama": "sdpa", "gemma2": "eager"}


def build(name: str, head_dim: int, impl: str, dtype, device, seed: int = 0):
    from transformers import Gemma2ForCausalLM, LlamaForCausalLM

    cls = {"llama": LlamaForCausalLM, "gemma2": Gemma2ForCausalLM}[name]
    torch.manual_seed(seed)
    # a copy of the config each: from_config writes the attention implementation into it
    model = cls._from_config(copy.deepcopy(configs(head_dim)[name]), attn_implementation=impl, dtype=torch.float32)
    return model.to(device=device, dtype=dtype).train()


def batch(device, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    attention_mask = torch.ones(2, SEQ, dtype=torch.long)
    attention_mask[1, :PAD_ROW1] = 0
    return ids.to(device), attention_mask.to(device)


def logits_and_grads(model, ids, attention_mask):
    """Logits at the real (non-padding) positions, in float32, and every parameter's gradient of a
    loss over those positions (padding rows never reach a real position, so they cannot differ)."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=attention_mask).logits
    real = logits[attention_mask.bool()].float()
    torch.nn.functional.cross_entropy(real, ids[attention_mask.bool()]).backward()
    return real.detach(), {n.removeprefix("_orig_mod."): p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
