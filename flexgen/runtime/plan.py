"""Planning: the KernelSpec of one flex_attention call, from the query's dtype, head dim and device, the
traced variant and kernel_options. Memoized, since every step of a model asks again."""
from __future__ import annotations

import functools

import torch

from ..codegen.spec import KernelSpec
from ..dsl.ir import has_positional_loads
from ..dsl.mod import Mod

DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_KERNEL_OPTION_NAMES = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps", "num_stages": "num_stages"}
# The backward's tile, under PyTorch's names: query rows (BLOCK_M1) per step of a KV tile of BLOCK_N1 rows;
# num_warps1 (flexgen's): the backward's warps per CTA, at most (fewer if the tile's warp layout needs).
_BWD_OPTION_NAMES = {"BLOCK_M1": "block_m", "BLOCK_N1": "block_n", "num_warps1": "num_warps"}
# deterministic: bitwise reproducible backward; precise_math: libm tanh/exp/log and IEEE division in score_mod.
# pingpong: the sm90 forward's warpgroup turns (default on); persistent: the sm90 grids of one CTA per SM
# (default on).
_FLAG_OPTIONS = ("deterministic", "precise_math", "pingpong", "persistent")


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
    from ..arch import current_arch, resolve_forward_family
    from ..codegen.configs import choose_config

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
    dtype = DTYPES[query_dtype]
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
