"""A Hugging Face transformers model on flexgen kernels: attn_implementation="flexgen".

    pip install -e ".[cuda13,transformers]"
    python examples/transformers_flexgen.py

Builds a tiny random-weight Llama (grouped-query attention) from its config on the GPU, runs a
training step with a left-padded batch, and greedy-decodes a few tokens. Any transformers model
that uses the attention interface works the same way, from_pretrained included.
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import flexgen.integrations.transformers as flexgen_hf

flexgen_hf.register()  # adds "flexgen" to transformers' AttentionInterface and AttentionMaskInterface

config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(config, attn_implementation="flexgen", dtype=torch.bfloat16).cuda()

ids = torch.randint(0, config.vocab_size, (2, 128), device="cuda")
attention_mask = torch.ones_like(ids)
attention_mask[1, :20] = 0  # row 1 is left-padded

model.train()
loss = model(input_ids=ids, attention_mask=attention_mask, labels=ids).loss
loss.backward()
print(f"loss {loss.item():.4f}, q_proj grad norm {model.model.layers[0].self_attn.q_proj.weight.grad.norm():.4f}")

model.eval()
with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
print("generated:", out[:, -8:].tolist())
