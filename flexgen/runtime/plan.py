"""Planning: which kernel serves a call, as a KernelSpec.

`plan` is the one planning function: it asks runtime/families.py for the template family and its
tile and records both in the spec. flex_attention's forward and backward reach it through
`make_spec` below (from tensors and kernel_options), `flexgen.emit` / `flexgen.compile` and
`flexgen build` through codegen/api.py's make_spec (from keyword arguments). Both are memoized:
every step of a model plans again, and the same spec object then hashes once in the kernel cache.
"""
from __future__ import annotations

import functools

import torch

from ..codegen.options import CALL_BWD_TILES, CALL_FLAGS, CALL_FWD_TILES, call_options
from ..codegen.spec import KINDS, KernelSpec, with_dq_layout
from ..dsl.affine import AffineScore
from ..dsl.folds import score_fold
from ..dsl.graph import postorder
from ..dsl.ir import DType, Node, buffers_of, has_positional_loads, params_of
from ..dsl.mask_analysis import TileClass, classify_tile
from ..dsl.mod import Mod
from ..warnings_once import warn_once
from .families import TILE_FIELDS, Call, TileError, choose
from .schedule import sm_count

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# kernel_options come checked from codegen/options.py's one table (names, values, PyTorch's ignored names).


def plan(kind: str, arch: str, head_dim: int, dtype: str, score_expr: Node | None = None, mask_expr: Node | None = None,
         *, family: str | None = None, tiles: tuple[tuple[str, int], ...] = (), dropout: bool = False,
         grad_buffers: tuple[str, ...] = (), deterministic: bool = False, debug: bool = False,
         mask_block: tuple[int, int] | None = None, blocks_follow_mask: bool = False,
         extra: tuple[tuple[str, object], ...] = ()) -> KernelSpec:
    """The spec of one kernel. `arch` is a normalized target (flexgen.arch); `family` the family asked for
    (None: the first that takes the call); `tiles` the tile fields the caller fixed, as sorted pairs;
    `mask_block` the block mask's BLOCK_SIZE, which the tile must divide unless `blocks_follow_mask` (its lists
    were computed from mask_expr, BlockMask.blocks_follow_mask_mod) lets a taller tile walk several query blocks;
    `extra` sorted template options."""
    blocks_follow_mask = bool(blocks_follow_mask) and mask_block is not None
    args = (kind, arch, head_dim, dtype, score_expr, mask_expr, family, tuple(tiles), dropout, tuple(grad_buffers),
            deterministic, debug, mask_block, blocks_follow_mask, extra)
    try:
        hash(args)
    except TypeError:  # a value that cannot be a key (refused below, or used uncached)
        return _plan(*args)
    return _plan_cached(*args)


def _plan(kind, arch, head_dim, dtype, score_expr, mask_expr, family, tiles, dropout, grad_buffers, deterministic,
          debug, mask_block, blocks_follow_mask, extra) -> KernelSpec:
    if kind not in KINDS:
        raise ValueError(f"kernel kind {kind!r} is not one of {KINDS}")
    unknown = sorted({name for name, _ in tiles} - set(TILE_FIELDS))
    if unknown:
        raise TypeError(f"unknown tile field(s) {unknown}; tile fields are {TILE_FIELDS}")
    score_loads = score_expr is not None and bool(buffers_of(score_expr))
    mask_loads = mask_expr is not None and bool(buffers_of(mask_expr))
    fold = _score_fold(score_expr, extra)
    call = Call(kind, arch, head_dim, dtype, dropout=dropout, buffer_grads=bool(grad_buffers),
                deterministic=deterministic,
                score_loads_per_element=score_expr is not None and has_positional_loads(score_expr),
                tiles=tuple((name, int(value)) for name, value in tiles), mask_block=mask_block,
                blocks_follow_mask=blocks_follow_mask,
                masked=mask_expr is not None, scored=score_expr is not None,
                mod_loads=score_loads or mask_loads, mask_loads=mask_loads,
                banded=kind == "fwd" and _banded(mask_expr),
                score_folds=kind == "fwd" and fold is not None,
                score_affine=kind == "bwd" and isinstance(fold, AffineScore),
                mod_ops=sum(_operations(e) for e in (score_expr, mask_expr) if e is not None),
                max_scores=bool(dict(extra).get("max_scores", False)),
                split_kv=bool(dict(extra).get("split_kv", False)),
                split_tall=int(dict(extra).get("split_rows", 0)) > SPLIT_BLOCK_M)
    chosen = choose(call, family)
    return KernelSpec(kind=kind, head_dim=head_dim, dtype=dtype, arch=arch, family=chosen.name, **chosen.tiles(call),
                      score_expr=score_expr, mask_expr=mask_expr, grad_buffers=grad_buffers, dropout=dropout,
                      deterministic=deterministic, debug=debug, extra=extra)


_plan_cached = functools.lru_cache(maxsize=4096)(_plan)


def _score_fold(score_expr: Node | None, extra):
    """The per-head terms a score_mod reduces to (an AffineScore or SoftcapScore, dsl/folds.py), which the templates
    compute themselves where the `fold_score` option (on by default) lets them; the planner gives such a forward its
    tiles, and an affine one the backward's 80-row steps."""
    if score_expr is None or not dict(extra).get("fold_score", True):
        return None
    return score_fold(score_expr)


# A tile of keys this far behind its queries: where the mask hides all of it, with its integer parameters at a
# window's usual size (they are run-time values; this only picks a tile), each query sees a band of keys.
BAND_PROBE_DISTANCE, BAND_PROBE_PARAM = 1 << 20, 1024


def _banded(mask_expr: Node | None) -> bool:
    if mask_expr is None:
        return False
    params = {name: BAND_PROBE_PARAM for name, dtype in params_of(mask_expr).items()
              if dtype in (DType.INT32, DType.INT64)}
    far = classify_tile(mask_expr, (BAND_PROBE_DISTANCE, BAND_PROBE_DISTANCE + 256), (0, 256), params=params)
    return far is TileClass.EMPTY


def _operations(expr: Node) -> int:
    return sum(1 for n in postorder(expr) if n.op not in ("input", "const", "param"))


def make_spec(kind: str, query: torch.Tensor, score: Mod | None, mask: Mod | None, kernel_options: dict | None,
              dropout: bool = False, grad_buffers: tuple[str, ...] = (),
              mask_block: tuple[int, int] | None = None, max_scores: bool = False,
              blocks_follow_mask: bool = False, kv_heads: int | None = None, kv_len: int | None = None) -> KernelSpec:
    """The spec of one kernel of a flex_attention call. Memoized on what it reads: the kind, the query's
    dtype, head dim and device, the expressions, the options, dropout, the buffers that get gradients,
    the block mask's BLOCK_SIZE and whether its lists follow its mask_mod, whether a forward writes
    max_scores, and whether it is a decoding-shaped call (split_block_m, against `kv_heads` heads of `kv_len` keys:
    the query's heads and length where not given)."""
    options = tuple(sorted((kernel_options or {}).items()))
    split_rows = split_block_m(query, kv_heads, kv_len) if kind == "fwd" and query.dim() == 4 else 0
    # (int: under torch.compile with dynamic shapes the head dim is a SymInt; a kernel is specialised on it)
    args = (kind, query.dtype, int(query.shape[-1]), query.device, score.expr if score is not None else None,
            mask.expr if mask is not None else None, options, dropout, tuple(grad_buffers), mask_block, max_scores,
            bool(blocks_follow_mask), split_rows)
    try:
        hash(options)
    except TypeError:  # an option value that cannot be a key (checked and refused, or used, uncached)
        return _make_spec(*args)
    return _make_spec_cached(*args)


def backward_helpers(bwd: KernelSpec, query: torch.Tensor) -> tuple[KernelSpec, KernelSpec]:
    """The preprocess and postprocess kernels of a backward whose main kernel is `bwd`, told the layout in which it
    adds dQ (codegen.spec.with_dq_layout)."""
    return (with_dq_layout(bwd, make_spec("bwd_preprocess", query, None, None, None)),
            with_dq_layout(bwd, make_spec("bwd_postprocess", query, None, None, None)))


def _make_spec(kind: str, query_dtype: torch.dtype, head_dim: int, device: torch.device, score_expr, mask_expr,
               kernel_options: tuple, dropout: bool, grad_buffers: tuple, mask_block, max_scores: bool = False,
               blocks_follow_mask: bool = False, split_rows: int = 0) -> KernelSpec:
    from ..arch import current_arch

    options = call_options(dict(kernel_options))
    backward_tiles = bwd_tile_overrides(options)  # checked by every call, before any launch
    if kind == "fwd":
        tiles = {field: int(options[name]) for name, field in CALL_FWD_TILES.items() if name in options}
    else:
        tiles = backward_tiles if kind == "bwd" else {}

    def planned(tiles: dict) -> KernelSpec:
        flags = [(k, bool(v)) for k, v in options.items() if k in CALL_FLAGS and k not in ("deterministic", "split_kv")]
        if max_scores and kind == "fwd":  # a template option only where set: other kernels' source stays as it was
            flags.append(("max_scores", True))
        if kind == "fwd" and splits_keys(options, tiles, split_rows > 0, max_scores):
            flags.append(("split_kv", True))
            if split_rows > SPLIT_BLOCK_M and not tiles:  # (the family's tall split tile: families.SM80.FWD_SPLIT_TALL)
                flags.append(("split_rows", split_rows))
        return plan(kind, current_arch(device), head_dim, DTYPES[query_dtype], score_expr, mask_expr,
                    family=options.get("family"), tiles=tuple(sorted(tiles.items())), dropout=dropout,
                    grad_buffers=grad_buffers,
                    deterministic=bool(options.get("deterministic", False)) and kind == "bwd",
                    mask_block=mask_block, blocks_follow_mask=blocks_follow_mask, extra=tuple(sorted(flags)))

    if tiles and options.get("family") is None:
        # PyTorch's tile options tune its Triton kernels; ported code carries them. Where the sm90 kernels (fixed
        # tiles) would run the call, they do: the options would otherwise buy a slower family. A tile the sm80
        # templates do not run (Triton's 32-row tiles of 4 warps, 3 stages) is a hint not taken. With the family
        # named, tiles are choices, and such a tile is an error.
        untiled = planned({})
        pass_tiles = CALL_FWD_TILES if kind == "fwd" else CALL_BWD_TILES
        names = ", ".join(sorted(name for name in options if name in pass_tiles))
        if untiled.family == "sm90":
            warn_once(f"flex_attention: kernel_options {names} choose tiles of the sm80 kernels (in PyTorch, of its "
                      "Triton kernels); on this GPU the sm90 kernels run, whose tiles are fixed, so they are "
                      "ignored; kernel_options={'family': 'sm80', ...} runs the sm80 kernels on them")
            return untiled
        try:
            return planned(tiles)
        except TileError as e:
            warn_once(f"{e}; taken as a tuning hint (PyTorch's, for its Triton kernels), so the default tile runs; "
                      "with kernel_options={'family': 'sm80', ...} such a tile is an error")
            return untiled
    return planned(tiles)  # (tiles the templates cannot run are refused here)


_make_spec_cached = functools.lru_cache(maxsize=1024)(_make_spec)


# A forward of at most SHORT_QUERY_ROWS query rows per KV head (decoding: the query rows times the GQA group, which
# share a tile of the split-key forward) splits each query tile's keys over several CTAs. So does a short query
# against a long cache (a prefill chunk, speculative tokens: at most FEW_QUERY_ROWS rows per KV head, at least
# LONG_CACHE_KEYS keys and LONG_CACHE_RATIO times the query's rows) while the split's 64-row tiles, weighted by
# D / 64, are no more than the GPU's SMs: past that its mma.sync tiles, not memory, set the pace, and the usual
# forward's wgmma tiles win. (H200, split against usual, us: D = 128, 512 rows x 8 KV heads over 8k keys 95 against
# 101 and x 16 heads 163 against 103; 128 rows x 32 heads 91 against 104; 256 rows x 8 heads over 32k 175
# against 371; D = 64, 256 rows x 32 heads 90 against 105.)
SHORT_QUERY_ROWS = 64
FEW_QUERY_ROWS = 512
LONG_CACHE_KEYS = 4096
LONG_CACHE_RATIO = 8
SPLIT_BLOCK_M = 64
# Past SHORT_QUERY_ROWS rows per KV head the split forward takes 128-row tiles (four warps of two MMA tiles), which
# ran 1.1-1.2x faster than 64-row ones from 128 rows on (H200, D = 64 and 128, prefill chunks of 128-512 rows).
TALL_SPLIT_BLOCK_M = 128


def split_block_m(query: torch.Tensor, kv_heads: int | None = None, kv_len: int | None = None) -> int:
    """The split forward's query rows per tile for such a call (SPLIT_BLOCK_M, or TALL_SPLIT_BLOCK_M past
    SHORT_QUERY_ROWS rows per KV head), 0 where it is not decoding-shaped. A symbolic size under torch.compile's
    dynamic shapes counts as long: no guard on it is added here."""
    batch, heads, q_len = query.shape[:3]
    if not isinstance(q_len, int):
        return 0
    group = heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 else 1
    rows = q_len * group
    if rows <= SHORT_QUERY_ROWS:  # (whatever the cache's length: a decoding step compiled over a growing cache)
        return SPLIT_BLOCK_M
    kv_len = q_len if kv_len is None else kv_len
    if not all(isinstance(x, int) for x in (batch, heads, kv_len)) or query.device.type != "cuda":
        return 0
    if rows > FEW_QUERY_ROWS or kv_len < max(LONG_CACHE_KEYS, LONG_CACHE_RATIO * q_len):
        return 0
    split_tiles = -(-rows // SPLIT_BLOCK_M) * (heads // group) * batch
    fits = split_tiles * max(1, query.shape[3] // 64) <= sm_count(query.device)
    return TALL_SPLIT_BLOCK_M if fits else 0


def splits_keys(options: dict, tiles: dict, short_query: bool, max_scores: bool) -> bool:
    """Whether a forward runs the split-key kernel (sm80's fwd with split_kv, runtime/split_kv.py): where
    kernel_options say split_kv=True, or by default for a short query unless the call chose a family or a tile.
    Not with max_scores (its row max is not merged across parts)."""
    if max_scores:
        if options.get("split_kv", False):
            raise ValueError("flex_attention: kernel_options split_kv=True cannot be combined with "
                             "return_aux=AuxRequest(max_scores=True); drop one of them")
        return False
    if "split_kv" in options:
        return bool(options["split_kv"])
    return short_query and "family" not in options and not tiles


def bwd_tile_overrides(kernel_options: dict | None) -> dict:
    """kernel_options BLOCK_M1 / BLOCK_N1 / num_warps1 as backward tile fields."""
    options = kernel_options or {}
    out = {}
    for name, field in CALL_BWD_TILES.items():
        if name not in options:
            continue
        allowed = (16, 32, 64, 128, 256) if field != "num_warps" else (1, 2, 4, 8, 16)
        if isinstance(options[name], bool) or options[name] not in allowed:
            raise ValueError(f"flex_attention: kernel_options {name}={options[name]!r}; allowed values are {allowed}")
        out[field] = int(options[name])
    return out
