"""Every mask and score_mod of attention-gym (its own functions, imported from a checkout), through flexgen, against
PyTorch's own flex_attention in float64 on the same inputs, eager and under torch.compile(fullgraph=True).

    python3 benchmarks/gym_check.py PATH/attention-gym [--device cuda] [--dtype bf16] [--length 1024] [--grad]

On a GPU flexgen runs its kernels in bf16 / fp16, and its error against the float64 result may be at most twice
PyTorch's own eager error in that dtype (its compiled one where its eager path refuses the case; plus 1e-3 absolute,
for outputs near zero); on the CPU (float64) the two must agree to 1e-6. With --grad the gradients of q, k and v for
a random output gradient count too, each as its error over its largest element, against a dense float64 reference
(dense_attention). A case that raises fails, named by the call that raised, with its traceback on stderr. Prints
one line per function and exits nonzero if any fails. Its tests are gym_tests.sh's.
"""
from __future__ import annotations

import argparse
import sys
import traceback
import types
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import flexgen  # noqa: E402

B, H, D = 2, 4, 64
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def import_gym(path: Path):
    """attn_gym's masks and mods, without its package __init__ (which imports its Triton and CuTe kernels)."""
    package = types.ModuleType("attn_gym")
    package.__path__ = [str(path / "attn_gym")]
    sys.modules["attn_gym"] = package
    import attn_gym.masks as masks
    import attn_gym.mods as mods

    return masks, mods


def gym_module(name: str):
    """One of attn_gym's modules that its packages' __init__ does not export (jetspec, natten, vsa, graphormer, ...)."""
    import importlib

    return importlib.import_module(f"attn_gym.{name}")


def cases(masks, mods, n: int, device) -> list[tuple[str, dict, tuple[int, int]]]:
    """(name, {"mask": ..., "score": ...}, (Q_LEN, KV_LEN)) for each function, with arguments that fit n tokens."""
    # STA needs canvas and kernel to be whole numbers of tiles: a canvas of four tiles, a kernel of two
    tile_2d, tile_3d = max(1, int(n ** 0.5) // 4), max(1, round(n ** (1 / 3)) // 4)
    side, cube = 4 * tile_2d, 4 * tile_3d
    frames, prompt = 4, n // 8
    per_frame = (n - prompt) // frames
    images = torch.tensor([[0, n // 3], [n // 4, n // 2], [n // 2, n], [3 * n // 4, n]], device=device)
    rope = torch.float64 if device.type == "cpu" else torch.float32  # (the CPU's comparison is float64 throughout)
    q_rope = torch.randn(B, H, n, 32, device=device, dtype=rope)
    k_rope = torch.randn(B, 1, n, 32, device=device, dtype=rope)
    return [
        ("causal", {"mask": masks.causal_mask}, (n, n)),
        ("sliding_window", {"mask": masks.generate_sliding_window(n // 8)}, (n, n)),
        ("dilated_sliding_window", {"mask": masks.generate_dilated_sliding_window(n // 8, 2)}, (n, n)),
        ("prefix_lm", {"mask": masks.generate_prefix_lm_mask(n // 5)}, (n, n)),
        ("batchify_causal", {"mask": masks.batchify_mask_mod(masks.causal_mask, n // 4)}, (n, n)),
        ("sta_2d", {"mask": masks.generate_sta_mask_mod_2d(canvas_hw=(side, side), kernel_hw=(2 * tile_2d,) * 2,
                                                           tile_hw=(tile_2d,) * 2)}, (side * side,) * 2),
        ("sta_3d", {"mask": masks.generate_sta_mask_mod_3d(canvas_twh=(cube,) * 3, kernel_twh=(2 * tile_3d,) * 3,
                                                           tile_twh=(tile_3d,) * 3)}, (cube ** 3,) * 2),
        ("svg_spatial", {"mask": masks.generate_spatial_head_mask_mod(prompt_length=prompt, num_frames=frames,
                                                                       token_per_frame=per_frame, round_width=16)},
         (n, n)),
        ("svg_temporal", {"mask": masks.generate_temporal_head_mask_mod(prompt_length=prompt, num_frames=frames,
                                                                         token_per_frame=per_frame)}, (n, n)),
        ("vision_cross_attention", {"mask": masks.generate_vision_cross_attention_mask_mod(images, n // 8)},
         (n, n // 2)),
        ("alibi", {"score": mods.generate_alibi_bias(H)}, (n, n)),
        ("alibi_causal", {"score": mods.generate_alibi_bias(H), "mask": masks.causal_mask}, (n, n)),
        ("sandwich", {"score": mods.generate_sandwich_bias(H, n, device=device)}, (n, n)),
        ("tanh_softcap", {"score": mods.generate_tanh_softcap(30)}, (n, n)),
        ("tanh_softcap_approx", {"score": mods.generate_tanh_softcap(30, approx=True)}, (n, n)),
        ("activation_gelu", {"score": mods.generate_activation_score_mod(F.gelu)}, (n, n)),
        ("mla_rope", {"score": mods.generate_mla_rope_score_mod(q_rope, k_rope, num_heads=H)}, (n, n)),
        *more_cases(n, device, rope),
    ]


def more_cases(n: int, device, table_dtype) -> list[tuple[str, dict, tuple[int, int]]]:
    """The masks and mods of attention-gym's other modules: documents, block diffusion, Longformer, JetSpec, NATTEN,
    shared prefixes, VSA and Graphormer, with arguments that fit n tokens."""
    causal, docs = gym_module("masks.causal"), gym_module("masks.document_mask")
    gen = torch.Generator().manual_seed(n)
    lengths = [n // 4, n // 8, 3 * n // 8, n // 16]
    offsets = docs.length_to_offsets(lengths + [n - sum(lengths)], device)
    shared_offsets = docs.length_to_offsets([n // 4, n // 8, n // 8, n // 4, n // 4], device)
    prefix_of = torch.tensor([0, 0, 0, 3, 3], device=device, dtype=torch.int32)  # docs 1, 2 continue 0; 4 continues 3
    is_global = torch.zeros(n, dtype=torch.bool, device=device)
    is_global[:: max(1, n // 8)] = True
    jetspec = gym_module("masks.jetspec")
    nodes = n // 4
    tree = jetspec.build_tree_ancestor_matrix([-1] + [(i - 1) // 2 for i in range(1, nodes)], device)
    block = max(4, n // 64)
    draft_blocks = (n - n // 4) // block
    natten = gym_module("masks.natten")
    side = 1 << (max(1, int(n ** 0.5)).bit_length() - 1)  # (a power of two: the Morton layout's canvas)
    kernel, tile = (7, side // 4) if side >= 16 else (3, max(1, side // 4))
    vsa = gym_module("masks.vsa")
    tile_numel = max(4, n // 16)
    tiles = n // tile_numel
    topk = torch.rand(B, H, tiles, tiles, generator=gen).argsort(-1)[..., : max(1, tiles // 4)].to(device)
    block_map = (torch.rand(B, H, tiles, tiles, generator=gen) < 0.3).to(device)
    real_tokens = torch.randint(1, tile_numel + 1, (tiles,), generator=gen).to(device, torch.int32)
    graphormer = gym_module("mods.graphormer")
    upper = torch.rand(B, n, n, generator=gen).triu(1) < 4.0 / n
    adjacency = (upper | upper.transpose(1, 2)).to(device)
    distances = graphormer.shortest_path_distances(adjacency, max_distance=5)
    edge_types = torch.randint(0, 4, (B, n, n), generator=gen).to(device)
    path_types, path_lengths = graphormer.shortest_path_edge_types(adjacency, edge_types, max_path_len=3)
    return [
        ("document_causal", {"mask": docs.generate_doc_mask_mod(causal.causal_mask, offsets)}, (n, n)),
        ("packed_causal_documents", {"mask": docs.generate_packed_causal_doc_mask_mod(offsets)}, (n, n)),
        ("block_diffusion", {"mask": gym_module("masks.block_diffusion").generate_block_diffusion_mask(
            n // 2, max(1, n // 16))}, (n, n)),
        ("global_sliding_window", {"mask": gym_module("masks.global_sliding_window").generate_global_sliding_window(
            n // 16, is_global)}, (n, n)),
        ("jetspec_tree_causal", {"mask": jetspec.generate_jetspec_tree_causal_mask_mod(n - nodes, tree)}, (nodes, n)),
        ("jetspec_training", {"mask": jetspec.generate_jetspec_training_mask_mod(n // 4, block)},
         (draft_blocks * block, n // 4 + draft_blocks * block)),
        ("natten", {"mask": natten.generate_natten(side, side, kernel, kernel)}, (side * side,) * 2),
        ("tiled_natten", {"mask": natten.generate_tiled_natten(side, side, kernel, kernel, tile, tile)},
         (side * side,) * 2),
        ("morton_natten", {"mask": natten.generate_morton_natten(side, side, kernel, kernel)}, (side * side,) * 2),
        ("shared_prefix", {"mask": gym_module("masks.shared_prefix").generate_shared_prefix_mask_mod(
            shared_offsets, prefix_of)}, (n, n)),
        ("vsa_topk", {"mask": vsa.generate_vsa_mask_mod(topk, tile_numel)}, (n, n)),
        ("vsa_block_map_padded", {"mask": vsa.generate_vsa_block_map_mask_mod(block_map, tile_numel, real_tokens)},
         (n, n)),
        ("graphormer_spatial", {"score": graphormer.generate_graphormer_spatial_bias(
            torch.randn(H, 7, generator=gen).to(device, table_dtype), distances)}, (n, n)),
        ("graphormer_edge", {"score": graphormer.generate_graphormer_edge_bias(
            torch.randn(H, 3, 4, generator=gen).to(device, table_dtype), path_types, path_lengths)}, (n, n)),
    ]


def dense_attention(q, k, v, score, mask):
    """Attention with score_mod and mask_mod applied to the whole score matrix (PyTorch's own vmap over b, h, q_idx,
    kv_idx, as its create_mask does): the gradients' reference. Rows that see nothing give 0, as flex_attention's do."""
    batch, heads, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    idx = [torch.arange(n, device=q.device) for n in (batch, heads, q_len, kv_len)]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if score is not None:
        s = torch_flex._vmap_for_bhqkv(score, prefix=(0,))(s, *idx).to(s.dtype)  # (a float64 table: not wider)
    if mask is not None:
        s = s.masked_fill(~torch_flex.create_mask(mask, batch, heads, q_len, kv_len, device=q.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num()
    return p @ v


def outputs(attend, q, k, v, grad_out):
    """attend(q, k, v)'s output and, with grad_out, the gradients of (output * grad_out).sum() for q, k and v: all
    as float64, for comparison."""
    if grad_out is None:
        return [attend(q, k, v).double()]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return [t.double() for t in (out, *grads)]


def worst(got: list, gold: list) -> float:
    """The largest absolute difference over output and gradients (gradients over their own largest value, so that
    the one limit fits tensors of different scales)."""
    errors = [(got[0] - gold[0]).abs().max().item()]
    errors += [((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item() for a, b in zip(got[1:], gold[1:])]
    return max(errors)


class StageFailed(Exception):
    """A case's call that raised, named: the float64 reference, PyTorch's low-precision run, or flexgen's."""

    def __init__(self, stage: str):
        super().__init__(stage)
        self.stage = stage


def at_stage(stage: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        raise StageFailed(stage) from e


def run(name: str, fns: dict, lengths: tuple[int, int], dtype, device, grad: bool = False,
        head_dim: int = D) -> tuple[bool, str]:
    q_len, kv_len = lengths
    gen = torch.Generator(device=device).manual_seed(len(name))
    q, k, v = (torch.randn(B, H, n, head_dim, generator=gen, device=device, dtype=torch.float64)
               for n in (q_len, kv_len, kv_len))
    grad_out = torch.randn(B, H, q_len, head_dim, generator=gen, device=device, dtype=torch.float64) if grad else None
    mask, score = fns.get("mask"), fns.get("score")
    theirs = torch_flex.create_block_mask(mask, B, H, q_len, kv_len, device=device) if mask else None
    ours = flexgen.create_block_mask(mask, B, H, q_len, kv_len, device=device) if mask else None

    def dense(*qkv):
        return dense_attention(*qkv, score, mask)

    def pytorch(*qkv):
        if grad and device.type == "cpu":  # (PyTorch's flex_attention has no backward on the CPU)
            return dense(*qkv)
        return torch_flex.flex_attention(*qkv, score_mod=score, block_mask=theirs)

    def pytorch_compiled(*qkv):
        torch._dynamo.reset()
        return torch.compile(torch_flex.flex_attention, fullgraph=True)(*qkv, score_mod=score, block_mask=theirs)

    # The float64 gold: PyTorch's flex_attention, or for gradients the dense reference (PyTorch's flex_attention has
    # no backward on the CPU, and its eager backward cannot vmap every score_mod, e.g. an autograd.Function's).
    gold = [t.nan_to_num() for t in at_stage("float64 reference", outputs, dense if grad else pytorch, q, k, v,
                                            grad_out)]
    low = [t.to(dtype) for t in (q, k, v)]
    torch._dynamo.reset()
    compiled = torch.compile(flexgen.flex_attention, fullgraph=True)
    results = [at_stage(f"flexgen {label}", outputs, lambda *qkv: fn(*qkv, score_mod=score, block_mask=ours), *low,
                        grad_out)
               for label, fn in (("eager", flexgen.flex_attention), ("compiled", compiled))]
    bar_from = ""
    if dtype == torch.float64:
        bar, limit = 0.0, 1e-6
    else:  # PyTorch's own error in this dtype (compiled where its eager path cannot take the case)
        try:
            bar = worst(outputs(pytorch, *low, grad_out), gold)
        except Exception:
            bar = worst(at_stage("PyTorch compiled", outputs, pytorch_compiled, *low, grad_out), gold)
            bar_from = " (compiled)"
        limit = 2 * bar + 1e-3
    errors = [worst(got, gold) for got in results]
    nan = any(t.isnan().any().item() for got in results for t in got)
    ok = not nan and max(errors) <= limit
    return ok, (f"eager {errors[0]:.2e}  compiled {errors[1]:.2e}  PyTorch{bar_from} {bar:.2e}  limit {limit:.2e}"
                f"{'  NaN' if nan else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gym", type=Path, help="an attention-gym checkout")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="default: bf16 on a GPU, fp64 on the CPU")
    parser.add_argument("--length", type=int, default=None, help="tokens per sequence (default 1024 on a GPU, 64)")
    parser.add_argument("--only", default=None, help="comma list of case names (default: every case)")
    parser.add_argument("--head-dim", type=int, default=D, help=f"head dim of q, k and v (default {D})")
    parser.add_argument("--grad", action="store_true",
                        help="also compare dQ, dK and dV (each relative to its largest element) for a random dO")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp64")]
    n = args.length or (1024 if device.type == "cuda" else 64)
    masks, mods = import_gym(args.gym)
    warnings.simplefilter("ignore")  # (the unfused path's notice on the CPU)
    failed, checks = 0, cases(masks, mods, n, device)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {name for name, _, _ in checks}
        if unknown:
            parser.error(f"no case named {', '.join(sorted(unknown))}; the cases: {', '.join(c[0] for c in checks)}")
        checks = [case for case in checks if case[0] in wanted]
    for name, fns, lengths in checks:
        try:
            ok, line = run(name, fns, lengths, dtype, device, args.grad, args.head_dim)
        except Exception as e:  # a refusal is a failure too: report it (where, and its traceback) and go on
            cause = e.__cause__ if isinstance(e, StageFailed) else e
            where = f"{e.stage}: " if isinstance(e, StageFailed) else ""
            ok, line = False, f"{where}{type(cause).__name__}: {(str(cause).splitlines() or [''])[0][:200]}"
            traceback.print_exception(cause, file=sys.stderr)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:24s} {line}", flush=True)
    print(f"{failed} failed of {len(checks)} ({dtype}, {device}, {n} tokens, D = {args.head_dim}"
          f"{', with gradients' if args.grad else ''})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
