"""`flexgen.flex_attention`: a drop-in for torch.nn.attention.flex_attention.flex_attention.

Validation happens here, before any kernel is looked up or launched; everything the
kernel needs to know at compile time goes into a KernelSpec, everything else into
its run-time parameters.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch

from .blockmask import BlockMask
from .codegen.spec import HEAD_DIMS, KernelSpec
from .dsl.ir import has_positional_loads
from .dsl.mod import Mod

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_KERNEL_OPTION_NAMES = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps", "num_stages": "num_stages"}
# The backward's tile, under PyTorch's names: query rows (BLOCK_M1) per step of a KV tile of BLOCK_N1 rows;
# num_warps1 (flexgen's): the backward's warps per CTA, at most (fewer if the tile's warp layout needs).
_BWD_OPTION_NAMES = {"BLOCK_M1": "block_m", "BLOCK_N1": "block_n", "num_warps1": "num_warps"}
# deterministic: bitwise reproducible backward; precise_math: libm tanh/exp/log and IEEE division in score_mod.
# pingpong: the sm90 forward's warpgroup turns (default on); persistent: the sm90 grids of one CTA per SM
# (default on).
_FLAG_OPTIONS = ("deterministic", "precise_math", "pingpong", "persistent")

# Traced score_mods, keyed by the function and what its closure holds right now, so a
# training loop traces once; rebinding a closure variable to a new tensor retraces.
_trace_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _closure_key(fn) -> tuple:
    cells = getattr(fn, "__closure__", None) or ()
    out = []
    for c in cells:
        try:
            out.append(id(c.cell_contents))
        except ValueError:  # empty cell
            out.append(None)
    return tuple(out)


def _traced(fn, kind: str) -> Mod | None:
    if fn is None or isinstance(fn, Mod):
        return fn
    from .dsl.api import mask_mod as trace_mask, score_mod as trace_score

    trace = trace_score if kind == "score" else trace_mask
    if isinstance(fn, str):
        return trace(fn)
    try:
        per_fn = _trace_cache.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: trace every time
        return trace(fn)
    key = _closure_key(fn)
    if key not in per_fn:
        per_fn.clear()
        per_fn[key] = trace(fn)
    return per_fn[key]


class DtypeMismatchError(ValueError, TypeError):
    """Query, key and value of different dtypes: a ValueError, as PyTorch's FlexAttention raises
    (its message too); also a TypeError, which flexgen raised before."""


def _check_inputs(query, key, value, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must have shape (B, H, L, D), got {tuple(t.shape)}")
    if query.device.type not in ("cuda", "meta"):  # meta: shapes only (the ops' fake kernels)
        raise ValueError(
            "flex_attention runs generated CUDA kernels and needs CUDA tensors, got tensors on "
            f"{query.device}; for a CPU (float64) computation use flexgen.reference_attention"
        )
    if not (query.device == key.device == value.device):
        raise ValueError(f"flex_attention: query, key and value must be on one device, got {query.device}, {key.device}, {value.device}")
    if not (query.dtype == key.dtype == value.dtype):
        raise DtypeMismatchError(
            "flex_attention: Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {query.dtype}, key.dtype: {key.dtype}, and value.dtype: {value.dtype} instead."
        )
    if query.dtype not in _DTYPES:
        raise TypeError(f"flex_attention: dtype {query.dtype} is not supported; use torch.bfloat16 or torch.float16")
    bq, hq, _, d = query.shape
    bk, hk, lk, dk = key.shape
    bv, hv, lv, dv = value.shape
    if not (bq == bk == bv):
        raise ValueError(f"flex_attention: batch sizes differ: query {bq}, key {bk}, value {bv}")
    if hk != hv or lk != lv:
        raise ValueError(f"flex_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must agree in heads and length")
    if d != dk or d != dv:
        raise ValueError(f"flex_attention: head dims differ: query {d}, key {dk}, value {dv}; flexgen needs them equal")
    if d not in HEAD_DIMS:
        raise ValueError(f"flex_attention: head dim {d} is not supported; supported head dims are {HEAD_DIMS}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(f"flex_attention: query has {hq} heads and key/value {hk}; pass enable_gqa=True for grouped-query attention")
        if hq % hk:
            raise ValueError(f"flex_attention: query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA")
    if query.shape[2] == 0 or lk == 0:
        raise ValueError("flex_attention: sequence lengths must be at least 1")


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernel reads 16-byte rows: last dim contiguous, other strides and the base 16-byte aligned."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1])
    return t if ok else t.contiguous()


def _check_block_mask(bm: BlockMask, query, key, spec: KernelSpec) -> None:
    q_len, kv_len = query.shape[2], key.shape[2]
    if tuple(bm.seq_lengths) != (q_len, kv_len):
        raise ValueError(
            f"flex_attention: the block mask was built for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)} but the inputs "
            f"have ({q_len}, {kv_len}); build it with create_block_mask(..., Q_LEN={q_len}, KV_LEN={kv_len})"
        )
    if bm.device != query.device:
        raise ValueError(f"flex_attention: the block mask is on {bm.device} but the inputs are on {query.device}; use block_mask.to(device)")
    bq, bkv = bm.BLOCK_SIZE
    if bq % spec.block_m or bkv % spec.block_n:
        raise ValueError(
            f"flex_attention: block mask BLOCK_SIZE {bm.BLOCK_SIZE} must be a multiple of the kernel tile "
            f"({spec.block_m}, {spec.block_n}); use BLOCK_SIZE=128 or set kernel_options BLOCK_M/BLOCK_N"
        )
    b, h = query.shape[0], query.shape[1]
    mb, mh = bm.kv_num_blocks.shape[0], bm.kv_num_blocks.shape[1]
    if mb not in (1, b) or mh not in (1, h):
        raise ValueError(f"flex_attention: block mask has B={mb}, H={mh}; it must be 1 or match the query's B={b}, H={h}")
    if bm.kv_indices.shape[-2] < -(-q_len // bq):
        raise ValueError(f"flex_attention: block mask covers {bm.kv_indices.shape[-2]} query blocks, {-(-q_len // bq)} needed")


def make_spec(kind: str, query: torch.Tensor, score: Mod | None, mask: Mod | None, kernel_options: dict | None,
              dropout: bool = False) -> KernelSpec:
    """The kernel for a call. Memoized on what it reads (kind, the query's dtype, head dim and device, the
    expressions, the options): every step of a model calls it, and the same spec object then hashes once in
    the kernel cache."""
    options = tuple(sorted((kernel_options or {}).items()))
    args = (kind, query.dtype, query.shape[-1], query.device, score.expr if score is not None else None,
            mask.expr if mask is not None else None, options, dropout)
    try:
        hash(options)
    except TypeError:  # an option value that cannot be a key (checked and refused, or used, uncached)
        return _make_spec(*args)
    return _make_spec_cached(*args)


def _make_spec(kind: str, query_dtype: torch.dtype, head_dim: int, device: torch.device, score_expr, mask_expr,
               kernel_options: tuple, dropout: bool) -> KernelSpec:
    from .arch import current_arch, resolve_forward_family
    from .codegen.configs import choose_config

    options = dict(kernel_options)
    overrides = {}
    for user_name, field in _KERNEL_OPTION_NAMES.items():
        if user_name in options:
            overrides[field] = int(options.pop(user_name))
    bwd_tile_overrides(options)  # checked now, before any launch; read by the backward
    for name in _BWD_OPTION_NAMES:
        options.pop(name, None)
    extra = tuple(sorted((k, bool(options.pop(k))) for k in list(options) if k in _FLAG_OPTIONS and k != "deterministic"))
    deterministic = bool(options.pop("deterministic", False))
    arch = current_arch(device)
    family_override = resolve_forward_family(kind, options.pop("family", None), arch, head_dim=head_dim,
                                             dropout=dropout, tile_overrides=bool(overrides))
    if family_override is not None:
        extra = tuple(sorted(extra + (("family", family_override),)))
    if options:
        raise ValueError(
            f"flex_attention: unknown kernel_options {sorted(options)}; known: "
            f"{sorted(_KERNEL_OPTION_NAMES) + sorted(_BWD_OPTION_NAMES) + sorted(_FLAG_OPTIONS) + ['family']}"
        )
    dtype = _DTYPES[query_dtype]
    cfg = choose_config(kind, head_dim, dtype, arch, score_loads_per_element=score_expr is not None and has_positional_loads(score_expr),
                        dropout=dropout, family_override=family_override, **overrides)
    return KernelSpec(
        kind=kind, head_dim=head_dim, dtype=dtype, arch=arch,
        block_m=cfg["block_m"], block_n=cfg["block_n"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        score_expr=score_expr,
        mask_expr=mask_expr,
        deterministic=deterministic and kind.startswith("bwd"),
        dropout=dropout,
        extra=extra,
    )


_make_spec_cached = functools.lru_cache(maxsize=1024)(_make_spec)


def bwd_tile_overrides(kernel_options: dict | None) -> dict:
    """kernel_options BLOCK_M1 / BLOCK_N1 / num_warps1 as backward config fields."""
    options = kernel_options or {}
    out = {}
    for name, field in _BWD_OPTION_NAMES.items():
        if name not in options:
            continue
        allowed = (16, 32, 64, 128, 256) if field != "num_warps" else (1, 2, 4, 8, 16)
        if isinstance(options[name], bool) or options[name] not in allowed:
            raise ValueError(f"flex_attention: kernel_options {name}={options[name]!r}; allowed values are {allowed}")
        out[field] = int(options[name])
    return out


# Device copies of captured buffers that live elsewhere (e.g. a variant built on the CPU),
# refreshed when the source tensor is modified in place (its version counter moves).
# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys themselves.
_device_copies: dict[int, tuple] = {}


def _on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    hit = _device_copies.get(id(t))
    if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == device:
        return hit[3]
    copy = t.detach().to(device)
    key = id(t)
    _device_copies[key] = (weakref.ref(t, lambda _: _device_copies.pop(key, None)), t._version, device, copy)
    return copy


def mod_arguments(score: Mod | None, mask: Mod | None, device: torch.device) -> tuple[dict, dict]:
    """Buffers (on `device`) and scalar parameters of the variant, keyed by their IR names."""
    buffers = {**(mask.buffers if mask else {}), **(score.buffers if score else {})}
    params = {**(mask.params if mask else {}), **(score.params if score else {})}
    return {n: _on_device(t, device) for n, t in buffers.items()}, params


def forward_call(query, key, value, score: Mod | None, bm: BlockMask | None, mask: Mod | None, scale: float, kernel_options,
                 dropout_p: float = 0.0, philox: tuple[int, int] | None = None):
    """Validated inputs -> (out, lse) through the generated forward kernel.

    dropout_p > 0: attention dropout with the keep mask drawn from philox = (seed, offset)
    (flexgen/dropout.py); lse stays that of the un-dropped softmax."""
    from .cache import get_kernel
    from .codegen.cstruct import pack_mod_args
    from .codegen.lower import lower_mods
    from .dropout import check_dropout
    from .runtime.forward import launch_forward

    dropout_p, philox = check_dropout(dropout_p, philox)
    spec = make_spec("fwd", query, score, mask, kernel_options, dropout=dropout_p > 0)
    if bm is not None:
        _check_block_mask(bm, query, key, spec)
    kernel = get_kernel(spec)
    buffers, params = mod_arguments(score, mask, query.device)
    mod_args = pack_mod_args(lower_mods(spec), buffers, params)
    q, k, v = _kernel_ready(query), _kernel_ready(key), _kernel_ready(value)
    b, h, lq, d = q.shape
    out = torch.empty(b, h, lq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    launch_forward(kernel, spec, mod_args, q, k, v, out, lse, scale, bm, dropout_p, philox)
    return out, lse


def _dropout_rng(dropout_p: float) -> torch.Tensor | None:
    """(seed, offset) for the dropout kernels, from torch's default (CPU) generator: reproducible
    under torch.manual_seed, no device sync, and an ordinary graph op under torch.compile."""
    if dropout_p == 0.0:
        return None
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    return torch.cat([seed, torch.zeros(1, dtype=torch.int64)])


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod=None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
    dropout_p: float = 0.0,
):
    """Attention with a user score_mod and block mask, through generated FlashAttention kernels.

    Same arguments, shapes (B, H, L, D) and semantics as torch's flex_attention:
    score = q.k * scale (default 1/sqrt(D)), then score_mod(score, b, h, q_idx, kv_idx),
    then the block mask's mask_mod, softmax, times value. Returns out, or (out, lse)
    with lse in natural log. Fully masked rows give 0 and lse = -inf. `dropout_p` drops
    attention probabilities as given (pass 0.0 for evaluation), like SDPA's.

    Runs through the torch.library ops flexgen::attention_fwd / attention_bwd
    (flexgen/ops.py), so torch.compile(fullgraph=True) traces through it.

    >>> from flexgen import flex_attention, create_block_mask
    >>> causal = lambda b, h, q, kv: q >= kv
    >>> mask = create_block_mask(causal, None, None, 4096, 4096)
    >>> out = flex_attention(q, k, v, score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30), block_mask=mask)
    """
    from .dropout import check_dropout_range
    from .ops import attention_fwd, mask_tensors
    from .variant import mod_parts, variant_key

    _check_inputs(query, key, value, enable_gqa)
    check_dropout_range(dropout_p)
    bm = BlockMask.from_torch(block_mask) if block_mask is not None else None
    score_parts = mod_parts(score_mod, "score")
    mask_parts = mod_parts(bm.mask_mod, "mask") if bm is not None else ("", ())
    if score_parts is None or mask_parts is None:
        return _flex_attention_eager(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                     kernel_options, dropout_p)
    (score_token, score_buffers), (mask_token, mask_buffers) = score_parts, mask_parts
    variant = variant_key(score_token, mask_token, tuple(bm.BLOCK_SIZE) if bm is not None else None,
                          tuple(bm.seq_lengths) if bm is not None else None, kernel_options)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if scale < 0:
        # The kernels fold a positive scale into exp2 after the row max; (-q).k * -scale is the same score.
        query, scale = -query, -scale
    out, lse = attention_fwd(query, key, value, *mask_tensors(bm), [*score_buffers, *mask_buffers], float(scale),
                             variant, float(dropout_p), _dropout_rng(dropout_p))
    return (out, lse) if return_lse else out


_flex_attention_eager = torch.compiler.disable(
    flex_attention,
    reason="flexgen.flex_attention: a score_mod/mask_mod defined inside the compiled function captures tensors or "
    "modules, which dynamo cannot hand to flexgen's tracer; define it outside (in __init__ or at module level) or "
    "pass a flexgen Mod (flexgen.score_mod(fn) built outside) to trace it with fullgraph=True",
)
