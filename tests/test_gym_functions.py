"""attention-gym style functions, written for torch's flex_attention, traced unchanged.

For each: trace, evaluate the IR on a broadcast (b, h, q, kv) grid of index
tensors (and a fresh random float32 score), and compare with calling the same
Python function directly on those tensors.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

import flexgen
from flexgen import variants

B, H = 2, 4


def grid(q_len: int, kv_len: int, seed: int):
    """Index tensors shaped to broadcast over (B, H, q_len, kv_len), and a random score."""
    gen = torch.Generator().manual_seed(seed)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(q_len).view(1, 1, q_len, 1)
    kv = torch.arange(kv_len).view(1, 1, 1, kv_len)
    score = torch.randn(B, H, q_len, kv_len, generator=gen, dtype=torch.float32) * 4
    return score, b, h, q, kv


def check(fn, kind: str, q_len: int = 33, kv_len: int = 41, seed: int = 0, mod=None):
    mod = mod if mod is not None else (flexgen.score_mod(fn) if kind == "score" else flexgen.mask_mod(fn))
    score, b, h, q, kv = grid(q_len, kv_len, seed)
    args = (score, b, h, q, kv) if kind == "score" else (b, h, q, kv)
    expected = torch.as_tensor(fn(*args))
    inputs = dict(zip(mod.arg_names, args))
    got = mod.evaluate(float_dtype=torch.float32, **inputs)
    shape = (B, H, q_len, kv_len)
    expected, got = expected.expand(shape), got.expand(shape)
    if kind == "mask":
        assert got.dtype == torch.bool
        assert torch.equal(got, expected.bool()), f"{mod.name}: {int((got != expected).sum())} mismatches"
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=1e-5, atol=1e-5)
    # A Mod is also a plain FlexAttention-style callable.
    called = mod(*args).expand(shape)
    assert torch.equal(called.bool(), expected.bool()) if kind == "mask" else torch.allclose(
        called.float(), expected.float(), rtol=1e-5, atol=1e-5, equal_nan=True
    )
    return mod


# ---------------------------------------------------------------- attention-gym masks


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def generate_sliding_window(window_size):
    def sliding_window(b, h, q_idx, kv_idx):
        causal = q_idx >= kv_idx
        window = q_idx - kv_idx <= window_size
        return causal & window

    return sliding_window


def generate_prefix_lm_mask(prefix_length):
    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx < prefix_length

    return flexgen.or_masks(prefix_mask, causal_mask)


def generate_batch_prefix_lm(prefix_lengths):
    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx <= prefix_lengths[b]) | (q_idx >= kv_idx)

    return prefix_lm


def _offsets_to_doc_ids_tensor(offsets):
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts)


def generate_doc_mask_mod(mask_mod, offsets):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


def generate_natten(canvas_w, canvas_h, kernel_w, kernel_h):
    def get_x_y(idx):
        return idx // canvas_w, idx % canvas_w

    def natten_mask_mod(b, h, q_idx, kv_idx):
        q_x, q_y = get_x_y(q_idx)
        kv_x, kv_y = get_x_y(kv_idx)
        kernel_center_x = q_x.clamp(kernel_w // 2, (canvas_w - 1) - kernel_w // 2)
        kernel_center_y = q_y.clamp(kernel_h // 2, (canvas_h - 1) - kernel_h // 2)
        hori_mask = (kernel_center_x - kv_x).abs() <= kernel_w // 2
        vert_mask = (kernel_center_y - kv_y).abs() <= kernel_h // 2
        return hori_mask & vert_mask

    return natten_mask_mod


def generate_dilated_sliding_window(window_size, dilation):
    def dilated_sliding_window(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        in_window = diff <= window_size
        is_dilated = (diff % dilation) == 0
        return in_window & is_dilated

    return dilated_sliding_window


def generate_longformer(global_tokens, window):
    def longformer(b, h, q_idx, kv_idx):
        is_global = (q_idx < global_tokens) | (kv_idx < global_tokens)
        local = torch.abs(q_idx - kv_idx) <= window
        return torch.logical_or(is_global, local)

    return longformer


def block_diff_mask(block_size, b, h, q_idx, kv_idx, n):
    """BD3-LM block diffusion mask (noisy half then clean half of length n each)."""
    x0_flag_q = q_idx >= n
    x0_flag_kv = kv_idx >= n
    block_q = torch.where(x0_flag_q == 1, (q_idx - n) // block_size, q_idx // block_size)
    block_kv = torch.where(x0_flag_kv == 1, (kv_idx - n) // block_size, kv_idx // block_size)
    block_diagonal = (block_q == block_kv) & (x0_flag_q == x0_flag_kv)
    offset_block_causal = (block_q > block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 0)
    block_causal = (block_q >= block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 1)
    return block_diagonal | offset_block_causal | block_causal


def generate_head_windows(windows):
    def head_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < windows[h])

    return head_window


def noop(b, h, q_idx, kv_idx):
    return b.new_ones(size=(), dtype=torch.bool)


def stripe_mask(b, h, q_idx, kv_idx):
    """Every 4th key is visible to all queries; otherwise causal within a 8-token block."""
    same_block = (q_idx // 8) == (kv_idx // 8)
    return ~(kv_idx % 4 != 0) | (same_block & (kv_idx <= q_idx))


# ---------------------------------------------------------------- attention-gym score mods


def checkerboard(score, batch, head, token_q, token_kv):
    score = torch.where(torch.abs(token_kv - token_q) % 2 == 1, score * 0.5, score)
    score = torch.where(torch.abs(token_kv - token_q) % 2 == 0, score * 2.0, score)
    return score


def relative_positional(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def generate_alibi_bias(num_heads):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / num_heads))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


def generate_alibi_slopes(slopes):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi_mod


def generate_tanh_softcap(soft_cap, approx=False):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    return tanh_softcap


def generate_t5_bias(table, max_distance):
    def t5_bias(score, b, h, q_idx, kv_idx):
        rel = (q_idx - kv_idx).clamp(-max_distance, max_distance) + max_distance
        return score + table[h, rel]

    return t5_bias


def generate_log_distance(scale):
    def log_distance(score, b, h, q_idx, kv_idx):
        dist = (q_idx - kv_idx).abs().float() + 1.0
        return score - scale * torch.log2(dist) + torch.sqrt(dist) * 0.01 - torch.rsqrt(dist)

    return log_distance


def causal_in_score(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx >= kv_idx, score, -float("inf"))


def smooth_gate(score, b, h, q_idx, kv_idx):
    gate = torch.sigmoid((kv_idx - q_idx).to(torch.float32) / 8.0)
    return score * gate + torch.erf(score) * 0.1 + torch.sin(score) * torch.cos(score) - 2.0 ** (-h)


# ---------------------------------------------------------------- cases

_OFFSETS = torch.tensor([0, 5, 6, 17, 30, 33])
_PREFIX = torch.tensor([3, 11])
_SLOPES = torch.rand(H) * 0.5
_T5 = torch.randn(H, 2 * 7 + 1)
_WINDOWS = torch.tensor([1, 4, 9, 64], dtype=torch.int32)

# ---------------------------------------------------------------- attention-gym's newer masks and mods


def generate_global_window(radius, is_global):
    """Longformer's symmetric window and global tokens, combined with torch's or_masks."""
    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= radius

    def global_tokens(b, h, q_idx, kv_idx):
        return is_global[q_idx] | is_global[kv_idx]

    return torch_flex.or_masks(window, global_tokens)


def generate_shared_prefix(offsets, prefix_of):
    """Packed prompt / continuation documents: a continuation also sees its whole prompt (nested gathers)."""
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def shared_prefix(b, h, q_idx, kv_idx):
        doc = document_id[q_idx]
        prefix = prefix_of[doc]
        own = (kv_idx >= offsets[doc]) & (q_idx >= kv_idx)
        prompt = (doc != prefix) & (kv_idx >= offsets[prefix]) & (kv_idx < offsets[prefix + 1])
        return own | prompt

    return shared_prefix


def generate_tree_verify(prefix_length, ancestors):
    """Speculative tree verification: the prefix, then the query node's ancestors (a 2-D bool table, keyword clamp)."""
    nodes = ancestors.shape[0]

    def tree(b, h, q_idx, kv_idx):
        node = (kv_idx - prefix_length).clamp(min=0, max=nodes - 1)
        in_tree = (kv_idx >= prefix_length) & (kv_idx < prefix_length + nodes)
        return (kv_idx < prefix_length) | (in_tree & ancestors[q_idx, node])

    return tree


def generate_block_draft(prefix_length, block):
    """Draft-head training: the prefix, then causal within the query's own block of keys after it."""
    def draft(b, h, q_idx, kv_idx):
        key = kv_idx - prefix_length
        same = (q_idx // block == key // block) & (key % block <= q_idx % block)
        return (kv_idx < prefix_length) | ((kv_idx >= prefix_length) & same)

    return draft


def generate_grouped(mask_mod, group):
    """A mask applied within groups of `group` tokens only, on the in-group positions."""
    def grouped(b, h, q_idx, kv_idx):
        return (q_idx // group == kv_idx // group) & mask_mod(b, h, q_idx % group, kv_idx % group)

    return grouped


def generate_frame_masks(prompt, per_frame, width):
    """Video: the prompt row and column, plus a band over positions (spatial) or within-frame offsets (temporal)."""
    def spatial(b, h, q_idx, kv_idx):
        return (kv_idx < prompt) | (q_idx < prompt) | (torch.abs(q_idx - kv_idx) < width * per_frame)

    def temporal(b, h, q_idx, kv_idx):
        q_in, kv_in = (q_idx - prompt) % per_frame, (kv_idx - prompt) % per_frame  # (negative before the prompt's end)
        return (kv_idx < prompt) | (q_idx < prompt) | (torch.abs(q_in - kv_in) < width)

    return spatial, temporal


def generate_distance_bias(table, distances):
    """Graph attention: a per-head bias looked up at a gathered shortest-path distance."""
    def distance_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, distances[b, q_idx, kv_idx]]

    return distance_bias


def generate_path_bias(tables, path_types, path_lengths):
    """Graph attention: the mean over a path's edges of per-position tables (views of one 3-D table)."""
    def path_bias(score, b, h, q_idx, kv_idx):
        length = path_lengths[b, q_idx, kv_idx]
        total = 0.0
        for n, table in enumerate(tables):
            total = total + torch.where(length > n, table[h, path_types[b, q_idx, kv_idx, n]], 0.0)
        return score + total / torch.clamp(length, min=1)

    return path_bias


def generate_relative_table_bias(table, per_head, offset):
    def relative_table(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + offset] * per_head[h]

    return relative_table


def generate_activation(activation, offset):
    """Softmax replaced by another activation: score_mod = log(f(score) + offset)."""
    def activation_mod(score, b, h, q_idx, kv_idx):
        return torch.log(activation(score) + offset)

    return activation_mod


_GEN = torch.Generator().manual_seed(7)
_GLOBAL = torch.zeros(41, dtype=torch.bool)
_GLOBAL[[0, 17]] = True
_PREFIX_OF = torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32)
_ANCESTORS = torch.eye(7, dtype=torch.bool)
for _node, _parent in enumerate([-1, 0, 1, 1, 3, 3, 0][1:], start=1):
    _ANCESTORS[_node] |= _ANCESTORS[_parent]
_DISTANCES = torch.randint(0, 6, (B, 33, 41), generator=_GEN, dtype=torch.int32)
_EDGE = torch.randn(H, 3, 5, generator=_GEN)
_PATH_TYPES = torch.randint(0, 5, (B, 33, 41, 3), generator=_GEN, dtype=torch.int32)
_PATH_LENGTHS = torch.randint(0, 4, (B, 33, 41), generator=_GEN, dtype=torch.int32)
_SPATIAL, _TEMPORAL = generate_frame_masks(3, 5, 2)

NEWER_MASKS = {
    "global_window": (generate_global_window(3, _GLOBAL), {}),
    "shared_prefix": (generate_shared_prefix(_OFFSETS, _PREFIX_OF), dict(q_len=33, kv_len=33)),
    "tree_verify": (generate_tree_verify(5, _ANCESTORS), dict(q_len=7, kv_len=12)),
    "block_draft": (generate_block_draft(5, 4), dict(q_len=12, kv_len=17)),
    "grouped_noop": (generate_grouped(torch_flex.noop_mask, 4), {}),
    "grouped_causal": (generate_grouped(causal_mask, 4), {}),
    "frames_spatial": (_SPATIAL, {}),
    "frames_temporal": (_TEMPORAL, {}),
}

NEWER_SCORES = {
    "distance_bias": (generate_distance_bias(torch.randn(H, 6, generator=_GEN), _DISTANCES), {}),
    "path_bias": (generate_path_bias([_EDGE[:, n] for n in range(3)], _PATH_TYPES, _PATH_LENGTHS), {}),
    "relative_table": (generate_relative_table_bias(torch.randn(96, generator=_GEN), torch.rand(H, generator=_GEN), 40),
                       {}),
    "activation_gelu": (generate_activation(F.gelu, 1.0), {}),
    "activation_relu": (generate_activation(F.relu, 1.0), {}),
    "activation_silu": (generate_activation(F.silu, 1.0), {}),
}


@pytest.mark.parametrize("name", sorted(NEWER_MASKS))
def test_newer_gym_mask(name):
    fn, shape = NEWER_MASKS[name]
    check(fn, "mask", **shape)


@pytest.mark.parametrize("name", sorted(NEWER_SCORES))
def test_newer_gym_score(name):
    fn, shape = NEWER_SCORES[name]
    check(fn, "score", **shape)


def test_latent_attention_rope_dot():
    """MLA's decoupled RoPE term: torch.dot of two gathered rows, unrolled over the row; checked against the same
    sum written elementwise (torch.dot itself needs 1-D tensors outside a trace)."""
    q_rope = torch.randn(B, H, 33, 4, generator=_GEN)
    k_rope = torch.randn(B, 1, 41, 4, generator=_GEN)
    mod = flexgen.score_mod(lambda score, b, h, q_idx, kv_idx:
                            score + 0.5 * torch.dot(q_rope[b, h, q_idx], k_rope[b, h // H, kv_idx]))
    score, b, h, q, kv = grid(33, 41, 0)
    got = mod.evaluate(float_dtype=torch.float32, **dict(zip(mod.arg_names, (score, b, h, q, kv))))
    want = score + 0.5 * (q_rope[b, h, q] * k_rope[b, h // H, kv]).sum(-1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


MASKS = {
    "causal": (causal_mask, {}),
    "sliding_window": (generate_sliding_window(7), {}),
    "prefix_lm": (generate_prefix_lm_mask(9), {}),
    "batch_prefix_lm": (generate_batch_prefix_lm(_PREFIX), {}),
    "document_causal": (generate_doc_mask_mod(causal_mask, _OFFSETS), dict(q_len=33, kv_len=33)),
    "document_window": (generate_doc_mask_mod(generate_sliding_window(2), _OFFSETS), dict(q_len=33, kv_len=33)),
    "natten": (generate_natten(6, 5, 3, 3), dict(q_len=30, kv_len=30)),
    "dilated_sliding_window": (generate_dilated_sliding_window(8, 3), {}),
    "longformer": (generate_longformer(3, 4), {}),
    "block_diffusion": (functools.partial(block_diff_mask, 4, n=16), dict(q_len=32, kv_len=32)),
    "head_windows": (generate_head_windows(_WINDOWS), {}),
    "noop": (noop, {}),
    "stripe": (stripe_mask, {}),
    # torch's own helpers, traced as plain functions
    "torch_and_masks": (torch_flex.and_masks(causal_mask, generate_dilated_sliding_window(8, 2)), {}),
    "torch_or_masks": (torch_flex.or_masks(generate_prefix_lm_mask(3), generate_longformer(2, 1)), {}),
    "torch_noop_mask": (torch_flex.noop_mask, {}),
}

SCORES = {
    "checkerboard": (checkerboard, {}),
    "relative_positional": (relative_positional, {}),
    "alibi_exp2": (generate_alibi_bias(H), {}),
    "alibi_slopes": (generate_alibi_slopes(_SLOPES), {}),
    "tanh_softcap": (generate_tanh_softcap(20.0), {}),
    "t5_bias": (generate_t5_bias(_T5, 7), {}),
    "log_distance": (generate_log_distance(0.3), {}),
    "causal_in_score": (causal_in_score, {}),
    "smooth_gate": (smooth_gate, {}),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_gym_mask(name):
    fn, shape = MASKS[name]
    for seed in range(2):
        check(fn, "mask", seed=seed, **shape)


@pytest.mark.parametrize("name", sorted(SCORES))
def test_gym_score(name):
    fn, shape = SCORES[name]
    for seed in range(2):
        check(fn, "score", seed=seed, **shape)


def test_document_mask_names_its_buffers():
    mod = flexgen.mask_mod(generate_doc_mask_mod(causal_mask, _OFFSETS))
    assert sorted(mod.buffers) == ["document_id", "offsets"]
    assert mod.buffers["offsets"] is _OFFSETS


def test_block_diffusion_partial_traces_with_int_compare():
    mod = flexgen.mask_mod(functools.partial(block_diff_mask, 4, n=16))
    assert mod.name == "block_diff_mask"
    assert not mod.buffers and not mod.params


# ---------------------------------------------------------------- built-in variants


def _doc_ids():
    return torch.tensor([0] * 7 + [1] * 3 + [2] * 20 + [3] * 3)


BUILTIN_MASKS = {
    "causal": (lambda: variants.causal, lambda b, h, q, kv: q >= kv),
    "sliding_window": (lambda: variants.sliding_window(5), lambda b, h, q, kv: (q >= kv) & (q - kv < 5)),
    "prefix_lm": (lambda: variants.prefix_lm(6), lambda b, h, q, kv: (q >= kv) | (kv < 6)),
    "document": (
        lambda: variants.document(_doc_ids()),
        lambda b, h, q, kv: (_doc_ids()[q] == _doc_ids()[kv]) & (q >= kv),
    ),
    "document_noncausal": (
        lambda: variants.document(_doc_ids(), causal=False),
        lambda b, h, q, kv: _doc_ids()[q] == _doc_ids()[kv],
    ),
    "noop": (lambda: flexgen.noop_mask, lambda b, h, q, kv: torch.ones((), dtype=torch.bool)),
    "and_masks": (
        lambda: flexgen.and_masks(variants.sliding_window(9), variants.document(_doc_ids())),
        lambda b, h, q, kv: (q >= kv) & (q - kv < 9) & (_doc_ids()[q] == _doc_ids()[kv]),
    ),
    "or_masks": (
        lambda: flexgen.or_masks(variants.sliding_window(3), variants.prefix_lm(4), lambda b, h, q, kv: kv % 5 == 0),
        lambda b, h, q, kv: ((q >= kv) & (q - kv < 3)) | (q >= kv) | (kv < 4) | (kv % 5 == 0),
    ),
}


def _alibi_reference(score, b, h, q, kv):
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float64) / H).float()
    return score + slopes[h] * (kv - q)


_TABLE = torch.randn(H, 2 * 33 - 1)

BUILTIN_SCORES = {
    "alibi_heads": (lambda: variants.alibi(H), _alibi_reference),
    "alibi_slopes": (lambda: variants.alibi(_SLOPES), lambda s, b, h, q, kv: s + _SLOPES[h] * (kv - q)),
    "softcap": (lambda: variants.softcap(15.0), lambda s, b, h, q, kv: 15.0 * torch.tanh(s / 15.0)),
    "relative_bias": (lambda: variants.relative_bias(_TABLE), lambda s, b, h, q, kv: s + _TABLE[h, q - kv + 32]),
}


@pytest.mark.parametrize("name", sorted(BUILTIN_MASKS))
def test_builtin_mask(name):
    make, reference = BUILTIN_MASKS[name]
    for seed in range(2):
        check(reference, "mask", q_len=33, kv_len=33, seed=seed, mod=make())


@pytest.mark.parametrize("name", sorted(BUILTIN_SCORES))
def test_builtin_score(name):
    make, reference = BUILTIN_SCORES[name]
    for seed in range(2):
        check(reference, "score", q_len=33, kv_len=33, seed=seed, mod=make())


def test_builtin_mod_used_inside_a_python_function():
    window = variants.sliding_window(4)

    def doc_window(b, h, q_idx, kv_idx):
        return window(b, h, q_idx, kv_idx) & (kv_idx % 2 == 0)

    mod = check(doc_window, "mask")
    assert mod.params == {"window": 4}
