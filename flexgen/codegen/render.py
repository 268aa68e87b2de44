"""Rendering: KernelSpec -> complete CUDA source, through Jinja2 templates.

`render(spec)` picks `<family>/<kind>.cu.j2` from the template search path (a
user folder from FLEXGEN_TEMPLATE_DIR or `template_dir=`, then the packaged
flexgen/templates) and renders it with:
  spec  the KernelSpec
  mods  the LoweredMods (mods.mod_args_decl, mods.score_mod_fn, mods.mask_mod_fn, ...)
  cfg   derived constants (see `derived_constants`)
and the global `include_raw(path)`, which pastes a file of the search path verbatim.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from ..arch import SM90_HEAD_DIMS
from ..cache import paths
from .lower import LoweredMods, lower_mods


class TemplateNotFoundError(LookupError):
    pass


@lru_cache(maxsize=None)
def _environment(search: tuple[str, ...]) -> jinja2.Environment:
    # No bytecode cache on disk: Jinja would load it with marshal, so whoever can write that folder
    # could run code here. The Environment keeps compiled templates in memory for the process.
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(list(search)),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )

    def include_raw(name: str) -> str:
        source, _, _ = env.loader.get_source(env, name)
        return source

    env.globals["include_raw"] = include_raw
    return env


def environment(template_dir: str | Path | None = None) -> jinja2.Environment:
    dirs = ([Path(template_dir)] if template_dir else []) + paths.template_dirs()
    return _environment(tuple(str(d) for d in dirs))


def available_templates(template_dir: str | Path | None = None) -> list[str]:
    """Every `<family>/<kind>.cu.j2` on the search path."""
    env = environment(template_dir)
    return sorted(t for t in env.list_templates() if t.endswith(".cu.j2") and t.count("/") == 1)


# Template families that can be chosen through the spec option "family" instead of arch.family(),
# with the kinds each one has. sm90 is the Hopper forward and backward (wgmma); flex_attention picks
# it by default on sm_90 where it applies (arch.forward_family, arch.resolve_backward_family).
SELECTABLE_FAMILIES = {"sm90": ("fwd", "bwd")}


def template_name(spec) -> str:
    forced = spec.option("family")
    if forced is None:
        return f"{spec.family}/{spec.kind}.cu.j2"
    if forced not in SELECTABLE_FAMILIES:
        raise ValueError(f"kernel option family={forced!r}: selectable families are {sorted(SELECTABLE_FAMILIES)}")
    if spec.kind not in SELECTABLE_FAMILIES[forced]:
        raise ValueError(f"kernel option family={forced!r} has only {SELECTABLE_FAMILIES[forced]} kernels, not {spec.kind!r}")
    if forced == "sm90":
        if spec.arch not in ("sm_90", "sm_90a"):
            raise ValueError(f"kernel option family='sm90' needs arch sm_90a (wgmma), not {spec.arch}")
        if spec.dropout:
            raise ValueError("kernel option family='sm90': the Hopper kernels have no dropout yet; use family='sm80'")
        if spec.head_dim not in SM90_HEAD_DIMS:
            raise ValueError(f"kernel option family='sm90': head dim {spec.head_dim} not supported "
                             f"{SM90_HEAD_DIMS}; use family='sm80'")
        tile = (spec.block_m, spec.block_n, spec.num_warps, spec.num_stages)
        if spec.kind == "bwd":
            if spec.grad_buffers:
                raise ValueError("kernel option family='sm90': the Hopper backward has no buffer gradients; use family='sm80'")
            if tile != (64, 128, 8, 2):
                raise ValueError(f"kernel option family='sm90': backward tile (BLOCK_M, BLOCK_N, num_warps, num_stages) "
                                 f"= {tile} not supported; it takes (64, 128, 8, 2)")
        elif spec.block_m != 128 or spec.block_n not in (64, 128) or spec.num_warps != 8 or spec.num_stages != 2:
            raise ValueError(f"kernel option family='sm90': tile (BLOCK_M, BLOCK_N, num_warps, num_stages) = {tile} "
                             "not supported; it takes (128, 64 or 128, 8, 2)")
    return f"{forced}/{spec.kind}.cu.j2"


DTYPE_INFO = {"bf16": ("bfloat16", True), "fp16": ("float16", False)}


def derived_constants(spec) -> dict:
    torch_name, is_bf16 = DTYPE_INFO[spec.dtype]
    return {
        "elem_ctype": "unsigned short",  # 16-bit values travel as raw bits (no CUDA headers)
        "dtype_name": torch_name,
        "is_bf16": is_bf16,
        "num_threads": spec.num_warps * 32,
        "sm": spec.sm,
        "family": spec.option("family") or spec.family,
        "entry": spec.entry_name,
        "has_score_mod": spec.score_expr is not None,
        "has_mask_mod": spec.mask_expr is not None,
        "options": dict(spec.extra),
    }


def render(spec, template_dir: str | Path | None = None, mods: LoweredMods | None = None) -> str:
    """The complete CUDA source of one kernel."""
    env = environment(template_dir)
    name = template_name(spec)
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound:
        have = available_templates(template_dir) or ["(none)"]
        raise TemplateNotFoundError(
            f"no template {name!r} for kind {spec.kind!r} on {spec.arch}; available templates: {', '.join(have)}"
        ) from None
    return template.render(spec=spec, mods=mods or lower_mods(spec), cfg=derived_constants(spec))
