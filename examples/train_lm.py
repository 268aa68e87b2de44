"""Train a small causal language model with a custom attention variant, through flexgen or a peer.

The variant is ALiBi + sliding window + packed documents: a score_mod with a learnable slope
table, and a mask that no fused SDPA backend expresses. The same model, data and seed run with
`--impl flexgen` (generated kernels), `--impl flex` (torch.compile'd FlexAttention) or
`--impl sdpa` (scaled_dot_product_attention with a dense additive bias: the reference, memory
hungry); the loss curves should coincide up to bf16 noise.

    python examples/train_lm.py --impl flexgen --steps 300        # on a GPU
    python examples/train_lm.py --impl sdpa --steps 20 --device cpu --dtype float32   # harness check

Data: a synthetic "copy" language (random documents that repeat their first half), packed into
fixed-length rows, so learning is visible within a few hundred steps and nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def make_batch(batch: int, seq: int, vocab: int, gen: torch.Generator):
    """Rows of packed documents; each document is a random half followed by its copy."""
    tokens = torch.empty(batch, seq, dtype=torch.long)
    doc_ids = torch.empty(batch, seq, dtype=torch.int32)
    for row in range(batch):
        pos, doc = 0, 0
        while pos < seq:
            half = int(torch.randint(8, 64, (1,), generator=gen))
            body = torch.randint(1, vocab, (half,), generator=gen)
            piece = torch.cat([body, body])[: seq - pos]
            tokens[row, pos : pos + len(piece)] = piece
            doc_ids[row, pos : pos + len(piece)] = doc
            pos, doc = pos + len(piece), doc + 1
    return tokens, doc_ids


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, impl: str):
        super().__init__()
        self.heads, self.window, self.impl = heads, window, impl
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        # Learnable ALiBi slopes, initialised to the usual geometric sequence.
        self.slopes = nn.Parameter(torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)]))

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor, block_mask=None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        slopes, window = self.slopes, self.window

        def alibi(score, bi, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)

        if self.impl == "sdpa":
            idx = torch.arange(n, device=x.device)
            rel = (idx[None, :] - idx[:, None]).to(x.dtype)
            bias = slopes.to(x.dtype)[:, None, None] * rel  # (H, n, n)
            allowed = (idx[:, None] >= idx[None, :]) & (idx[:, None] - idx[None, :] < window)
            allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])  # (b, n, n)
            bias = bias[None].masked_fill(~allowed[:, None], float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            attend = _library(self.impl).flex_attention if self.impl == "flexgen" else _compiled_flex()
            y = attend(q, k, v, score_mod=alibi, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def _library(impl: str):
    if impl == "flexgen":
        import flexgen as lib
    else:
        from torch.nn.attention import flex_attention as lib
    return lib


def document_window_mask(doc_ids: torch.Tensor, window: int):
    """Causal sliding window inside each packed document; rows of doc_ids laid end to end."""
    n = doc_ids.shape[1]
    flat_docs = doc_ids.reshape(-1)

    def mask(bi, h, q_idx, kv_idx):
        same_doc = flat_docs[bi * n + q_idx] == flat_docs[bi * n + kv_idx]
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window) & same_doc

    return mask


_FLEX = None


def _compiled_flex():
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class Block(nn.Module):
    def __init__(self, dim, heads, window, impl):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, window, impl)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, doc_ids, block_mask):
        x = x + self.attn(self.norm1(x), doc_ids, block_mask)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, vocab, dim, heads, layers, window, impl):
        super().__init__()
        self.window, self.impl = window, impl
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, window, impl) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, doc_ids):
        x = self.embed(tokens)
        block_mask = None
        if self.impl != "sdpa":  # one block mask per batch, shared by every layer
            b, n = tokens.shape
            mask = document_window_mask(doc_ids, self.window)
            block_mask = _library(self.impl).create_block_mask(mask, b, None, n, n, device=tokens.device)
        for blk in self.blocks:
            x = blk(x, doc_ids, block_mask)
        return self.head(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", choices=("flexgen", "flex", "sdpa"), default="flexgen")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="write the loss curve here as JSON")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    model = LM(args.vocab, args.dim, args.heads, args.layers, args.window, args.impl).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    curve = []
    start = time.time()
    for step in range(1, args.steps + 1):
        tokens, doc_ids = make_batch(args.batch, args.seq + 1, args.vocab, gen)
        tokens, doc_ids = tokens.to(args.device), doc_ids.to(args.device)
        inputs, targets, docs = tokens[:, :-1], tokens[:, 1:], doc_ids[:, :-1].contiguous()
        with torch.autocast(device_type=torch.device(args.device).type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(inputs, docs)
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.append(loss.item())
        if step % max(1, args.steps // 20) == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  ({time.time() - start:.1f} s)", flush=True)
    print(f"final loss {sum(curve[-10:]) / min(10, len(curve)):.4f} (mean of the last 10 steps); "
          f"uniform-guess loss is {math.log(args.vocab):.4f}")
    if args.log:
        with open(args.log, "w") as f:
            json.dump({"impl": args.impl, "args": vars(args), "loss": curve}, f)


if __name__ == "__main__":
    main()
