"""Structural hashes are cache keys: stable across processes, blind to values, sensitive to structure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import flexgen
from flexgen import variants

REPO = Path(__file__).resolve().parents[1]

# Builds a set of variants and prints {name: structural_hash} as JSON. Run both in
# this process and in fresh interpreters with different hash seeds.
HASH_SCRIPT = r"""
import json, torch, flexgen
from flexgen import variants as v

ids = torch.tensor([0, 0, 1, 1, 2])
slopes = torch.rand(8)
table = torch.randn(8, 31)

def window_fn(b, h, q_idx, kv_idx, *, window):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

def doc_fn(b, h, q_idx, kv_idx):
    return ids[q_idx] == ids[kv_idx]

mods = {
    "causal": v.causal,
    "sliding_window": v.sliding_window(128),
    "prefix_lm": v.prefix_lm(16),
    "document": v.document(ids),
    "alibi": v.alibi(8),
    "softcap": v.softcap(30.0),
    "relative_bias": v.relative_bias(table),
    "text_softcap": flexgen.score_mod("cap * tanh(score / cap)", cap=30.0),
    "python_window": flexgen.mask_mod(window_fn, window=64),
    "python_doc": flexgen.mask_mod(doc_fn),
    "python_alibi": flexgen.score_mod(lambda score, b, h, q, kv: score + slopes[h] * (kv - q)),
    "combined": flexgen.and_masks(v.sliding_window(8), v.document(ids), v.prefix_lm(2)),
    "noop": flexgen.noop_mask,
}
print(json.dumps({name: mod.structural_hash for name, mod in mods.items()}, sort_keys=True))
"""


def _hashes_here() -> dict[str, str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(HASH_SCRIPT, "<hash-script>", "exec"), {})
    return json.loads(out.getvalue())


def _hashes_in_fresh_process(hash_seed: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", HASH_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_hashes_are_the_same_in_a_fresh_process():
    here = _hashes_here()
    assert _hashes_in_fresh_process("12345") == here
    # the text and Python forms of one variant are one variant; everything else differs
    assert here["text_softcap"] == here["softcap"]
    assert here["python_window"] == here["sliding_window"]
    assert len(set(here.values())) == len(here) - 2


def test_parameter_values_do_not_change_the_hash():
    assert variants.sliding_window(1).structural_hash == variants.sliding_window(4096).structural_hash
    assert variants.prefix_lm(0).structural_hash == variants.prefix_lm(999).structural_hash
    assert variants.softcap(1.0).structural_hash == variants.softcap(50.0).structural_hash
    assert variants.relative_bias(torch.randn(4, 7)).structural_hash == variants.relative_bias(torch.randn(16, 255)).structural_hash


def test_buffer_contents_do_not_change_the_hash():
    assert variants.alibi(8).structural_hash == variants.alibi(16).structural_hash
    a = variants.document(torch.tensor([0, 0, 1]))
    b = variants.document(torch.tensor([0, 1, 2, 3, 3, 3, 4]))
    assert a.structural_hash == b.structural_hash

    def make(table):
        return flexgen.score_mod(lambda score, b, h, q_idx, kv_idx: score + table[h])

    assert make(torch.zeros(4)).structural_hash == make(torch.randn(12)).structural_hash


def test_structure_does_change_the_hash():
    assert variants.sliding_window(8).structural_hash != variants.prefix_lm(8).structural_hash
    baked = flexgen.score_mod("cap * tanh(score / cap)", cap=30.0, specialize=True)
    assert baked.structural_hash != variants.softcap(30.0).structural_hash
    # closure constants are baked in, so they are structure
    k1 = flexgen.mask_mod(lambda b, h, q, kv: q - kv < 8)
    k2 = flexgen.mask_mod(lambda b, h, q, kv: q - kv < 9)
    assert k1.structural_hash != k2.structural_hash
    # mask and score kinds never collide
    assert flexgen.noop_mask.structural_hash != flexgen.score_mod("score").structural_hash


def test_equal_hash_across_forms():
    py = flexgen.score_mod(lambda score, b, h, q, kv: 30.0 * torch.tanh(score / 30.0))
    text = flexgen.score_mod("30.0 * tanh(score / 30.0)")
    assert py.structural_hash == text.structural_hash
