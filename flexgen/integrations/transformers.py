"""Hugging Face transformers on flexgen kernels: `attn_implementation="flexgen"`.

    import flexgen.integrations.transformers as flexgen_hf
    flexgen_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="flexgen")

register() adds flexgen through transformers' own extension points, nothing patched:
- AttentionMaskInterface["flexgen"]: transformers composes its mask as closures (causal, sliding
  window, padding over the 2D attention_mask, packed sequences, offsets); this traces that
  composition once per forward into a flexgen Mod and builds a flexgen BlockMask from it;
- AttentionInterface["flexgen"]: each attention layer calls flexgen.flex_attention with that
  BlockMask, the model's scale, its logit softcap as a score_mod, GQA and dropout.

Under torch.compile the mask is built outside the graph (one graph break per forward, before the
first layer; flexgen's mask builder classifies tiles in Python), and every attention layer traces
into the graph as the flexgen ops, since the BlockMask carries a Mod.
"""
from __future__ import annotations

import torch

NAME = "flexgen"


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` ("flexgen") available to every transformers model that uses
    the attention interface (`from_pretrained(..., attn_implementation="flexgen")`, `from_config`,
    `model.set_attn_implementation("flexgen")`)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "flexgen.integrations.transformers needs Hugging Face transformers 5 or newer: "
            "pip install 'flexgen-attention[transformers]'"
        ) from e
    AttentionInterface.register(name, flexgen_attention_forward)
    AttentionMaskInterface.register(name, flexgen_block_mask)


# ---------------------------------------------------------------- the mask


def flexgen_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset=0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    device="cpu",
    **kwargs,
):
    """transformers' mask interface: the same arguments its flex_attention_mask gets, a flexgen BlockMask back."""
    from transformers.masking_utils import causal_mask_function

    return _build_block_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                             mask_function or causal_mask_function, attention_mask, device)


@torch.compiler.disable(reason="flexgen builds a BlockMask in Python (it traces the mask and classifies tiles); "
                               "the attention layers that use it stay in the graph")
def _build_block_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, device):
    import flexgen
    from transformers.masking_utils import (add_offsets_to_mask_function, and_masks, padding_mask_function,
                                            prepare_padding_mask)

    # As transformers' flex_attention_mask: padding over the 2D mask, then the offsets.
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = prepare_padding_mask(attention_mask.to(torch.bool), kv_length, kv_offset)
        mask_function = and_masks(mask_function, padding_mask_function(padding))
    mask_function = add_offsets_to_mask_function(mask_function, _as_int(q_offset), _as_int(kv_offset))
    # Traced here, once: the BlockMask carries a Mod (a token and its buffer tensors), which
    # flex_attention reads without tracing again, also inside a compiled graph.
    mod = flexgen.mask_mod(mask_function)
    return flexgen.create_block_mask(mod, batch_size, None, q_length, kv_length, device=device)


def _as_int(offset):
    """Offsets are ints or 0-d tensors (cache positions); a constant traces into a smaller mask."""
    return int(offset) if isinstance(offset, torch.Tensor) and offset.numel() == 1 else offset


# ---------------------------------------------------------------- the attention


def flexgen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. query (B, Hq, Lq, D), key/value (B, Hkv, Lkv, D) ->
    ((B, Lq, Hq, D), None): flexgen computes no attention weights (as SDPA's path).

    `sliding_window` needs no handling here: transformers puts the window into the mask it asks
    flexgen_block_mask for, so it arrives in the BlockMask."""
    import flexgen

    if position_bias is not None:
        raise NotImplementedError(
            "flexgen attention: an additive position_bias tensor is not supported; use attn_implementation='sdpa' "
            "for this model"
        )
    block_mask = _as_block_mask(attention_mask, query, key)
    score_mod = None
    if softcap is not None:
        cap = float(softcap)
        # A closure over a float only: dynamo rebuilds it inside a compiled graph.
        score_mod = lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)  # noqa: E731
    result = flexgen.flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], dropout_p=float(dropout), return_lse=s_aux is not None,
    )
    out = result if s_aux is None else _with_sinks(*result, s_aux)
    return out.transpose(1, 2).contiguous(), None


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention sinks (GPT-OSS): one more logit per query head that takes part in the softmax and
    adds nothing to the output, so each row keeps the share exp(lse) / (exp(lse) + exp(sink)) =
    sigmoid(lse - sink) of its weight. lse carries a gradient, so the sinks and the scores train
    through it. A row that sees nothing (lse = -inf) stays 0."""
    keep = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


def _as_block_mask(attention_mask, query, key):
    """The BlockMask from flexgen_block_mask; a 4D boolean mask passed by the caller becomes one; None
    (no mask: full attention) stays None."""
    from flexgen import BlockMask

    if attention_mask is None or isinstance(attention_mask, BlockMask):
        return attention_mask
    if hasattr(attention_mask, "kv_num_blocks"):  # torch's BlockMask, e.g. built by transformers' flex path
        return attention_mask
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
        return _dense_block_mask(attention_mask[:, :, :, : key.shape[-2]], query.shape[-2], key.shape[-2])
    raise TypeError(
        "flexgen attention: attention_mask must be the BlockMask transformers builds with the 'flexgen' mask "
        f"interface, a 4D boolean tensor or None; got {type(attention_mask).__name__}"
        + (f" of dtype {attention_mask.dtype} and shape {tuple(attention_mask.shape)}"
           if isinstance(attention_mask, torch.Tensor) else "")
        + "; an additive float mask has no flexgen equivalent, pass it as booleans (True = attend)"
    )


@torch.compiler.disable(reason="flexgen builds a BlockMask in Python")
def _dense_block_mask(mask: torch.Tensor, q_length: int, kv_length: int):
    import flexgen

    heads = mask.shape[1]
    mod = flexgen.mask_mod(lambda b, h, q_idx, kv_idx: mask[b, h if heads > 1 else 0, q_idx, kv_idx])
    return flexgen.create_block_mask(mod, mask.shape[0], heads if heads > 1 else None, q_length, kv_length,
                                     device=mask.device)
