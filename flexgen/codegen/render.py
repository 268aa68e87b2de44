"""Rendering: KernelSpec -> complete CUDA source, through Jinja2 templates.

`render(spec)` picks `<spec.family>/<kind>.cu.j2` from the template search path (a
user folder from FLEXGEN_TEMPLATE_DIR or `template_dir=`, then the packaged
flexgen/templates) and renders it with:
  spec  the KernelSpec
  mods  the LoweredMods (mods.mod_args_decl, mods.score_mod_fn, mods.mask_mod_fn, ...)
  cfg   derived constants (see `derived_constants`), and the parameter structs (cfg.params)
and the global `include_raw(path)`, which pastes a file of the search path verbatim.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jinja2

from ..cache import paths
from .lower import LoweredMods, lower_mods
from .params import PARAM_STRUCTS
from .spec import panel_width


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


def template_name(spec) -> str:
    """The template of a spec: its family's folder, its kind's file (the planner chose the family)."""
    return f"{spec.family}/{spec.kind}.cu.j2"


DTYPE_INFO = {"bf16": ("bfloat16", True), "fp16": ("float16", False)}


def derived_constants(spec) -> dict:
    torch_name, is_bf16 = DTYPE_INFO[spec.dtype]
    return {
        "elem_ctype": "unsigned short",  # 16-bit values travel as raw bits (no CUDA headers)
        "dtype_name": torch_name,
        "is_bf16": is_bf16,
        "num_threads": spec.num_warps * 32,
        "sm": spec.sm,
        "family": spec.family,
        "entry": spec.entry_name,
        "has_score_mod": spec.score_expr is not None,
        "has_mask_mod": spec.mask_expr is not None,
        "options": dict(spec.extra),
        "panel_width": panel_width(spec.head_dim),
        "k_steps": spec.head_dim // 16,  # the 16-column k-steps over the head's own columns (the sm90 kernels' S)
        "params": PARAM_STRUCTS,  # the parameter structs' C declarations (codegen/params.py)
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
