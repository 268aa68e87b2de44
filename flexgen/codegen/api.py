"""Public entry points: `flexgen.emit(...)` (CUDA source) and `flexgen.compile(...)` (a cubin).

score_mod / mask_mod may be a Mod, an IR Node, a Python callable or DSL text;
callables and text are traced through flexgen.dsl.api. Keyword options: `family` asks
for a template family; block_m, block_n, num_warps, num_stages fix the tile; grad_buffers,
dropout, deterministic, debug are KernelSpec fields; any other keyword becomes a template
option (spec.extra), e.g. fast_math=True, device_debug=True. The kernel is planned as
flex_attention plans it (flexgen/runtime/plan.py), so emit shows what a call would run.

This module is the public API layer, beside flexgen/attention.py: it sits above the runtime.
"""
from __future__ import annotations

from .. import arch as archmod
from ..dsl.ir import Node
from ..runtime.families import TILE_FIELDS
from ..runtime.plan import plan
from .spec import KernelSpec

_SPEC_FIELDS = ("grad_buffers", "dropout", "deterministic", "debug")
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
           "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


def dtype_name(dtype) -> str:
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise ValueError(f"dtype {dtype!r} is not supported; use torch.bfloat16 / 'bf16' or torch.float16 / 'fp16'")
    return name


def as_expr(mod, kind: str) -> Node | None:
    """The IR of a score_mod / mask_mod given in any accepted form."""
    if mod is None or isinstance(mod, Node):
        return mod
    from ..dsl.mod import Mod

    if not isinstance(mod, Mod):
        if type(mod).__name__ == "BlockMask" and hasattr(mod, "kv_num_blocks"):
            raise TypeError(
                f"a BlockMask was passed as {kind}_mod; pass its mask_mod (mask.mask_mod) as mask_mod= and its "
                "BLOCK_SIZE as mask_block= (flex_attention takes the BlockMask itself as block_mask=)"
            )
        if not (callable(mod) or isinstance(mod, str)):
            raise TypeError(f"{kind}_mod must be a Mod, an IR Node, a function or DSL text, got {type(mod).__name__}")
        from ..dsl import api as dsl_api

        mod = getattr(dsl_api, f"{kind}_mod")(mod)
    if mod.kind != kind:
        raise TypeError(f"a {mod.kind}_mod was passed as {kind}_mod")
    return mod.expr


def make_spec(kind: str = "fwd", score_mod=None, mask_mod=None, head_dim: int = 128, dtype="bf16",
              arch: str | None = "sm_90a", mask_block: tuple[int, int] | None = None, blocks_follow_mask: bool = True,
              **options) -> KernelSpec:
    """The KernelSpec of one kernel, planned as flex_attention plans it (see the module docstring);
    `mask_block` is the BLOCK_SIZE of the block mask the kernel will run with, which its tile must divide, except
    that an sm90 forward walks several query blocks of a mask whose lists follow its mask_mod
    (`blocks_follow_mask`: a mask from create_block_mask, BlockMask.blocks_follow_mask_mod)."""
    target = archmod.jit_target() if arch is None else archmod.normalize(arch)
    fixed = {k: options.pop(k) for k in TILE_FIELDS if k in options}
    tiles = tuple(sorted((k, v) for k, v in fixed.items() if v is not None))
    family = options.pop("family", None)
    fields = {k: options.pop(k) for k in _SPEC_FIELDS if k in options}
    extra = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))  # hashable
    return plan(kind, target, head_dim, dtype_name(dtype), as_expr(score_mod, "score"), as_expr(mask_mod, "mask"),
                family=family, tiles=tiles, dropout=bool(fields.get("dropout", False)),
                grad_buffers=tuple(fields.get("grad_buffers", ())), deterministic=bool(fields.get("deterministic", False)),
                debug=bool(fields.get("debug", False)), mask_block=mask_block, blocks_follow_mask=blocks_follow_mask,
                extra=extra)


def emit(kind: str = "fwd", score_mod=None, mask_mod=None, head_dim: int = 128, dtype="bf16", arch: str = "sm_90a",
         **options) -> str:
    """The complete CUDA source of one kernel (nothing is compiled)."""
    from .render import render

    template_dir = options.pop("template_dir", None)
    return render(make_spec(kind, score_mod, mask_mod, head_dim, dtype, arch, **options), template_dir)


# (arguments of compile) -> KernelSpec, so a repeated call skips spec construction. Mods and
# functions key by identity, Nodes by digest, text by value. Bounded: cleared when full.
_spec_memo: dict = {}
_SPEC_MEMO_MAX = 4096


def compile(kind: str = "fwd", score_mod=None, mask_mod=None, head_dim: int = 128, dtype="bf16",
            arch: str | None = None, **options):
    """The compiled kernel (flexgen.cache.kernel.CompiledKernel), from the cache when possible.

    arch=None targets the current GPU (or the first FLEXGEN_ARCH_LIST entry without one)."""
    template_dir = options.pop("template_dir", None)
    compiler = options.pop("compiler", None)
    try:
        memo_key = (kind, score_mod, mask_mod, head_dim, dtype, arch if arch is not None else archmod.current_key(),
                    tuple(sorted(options.items())))
        spec = _spec_memo.get(memo_key)
    except TypeError:  # an unhashable option value: no memo
        memo_key, spec = None, None
    if spec is None:
        spec = make_spec(kind, score_mod, mask_mod, head_dim, dtype, arch, **options)
        if memo_key is not None:
            if len(_spec_memo) >= _SPEC_MEMO_MAX:
                _spec_memo.clear()
            _spec_memo[memo_key] = spec
    return compile_spec(spec, template_dir, compiler)


_get_kernel = None


def compile_spec(spec: KernelSpec, template_dir=None, compiler: str | None = None):
    """Hot path: an in-memory dict lookup keyed by the spec."""
    global _get_kernel
    if _get_kernel is None:  # imported on first use (an import statement per call costs microseconds)
        from ..cache.jit import get_kernel as _get_kernel
    return _get_kernel(spec, template_dir, compiler)


__all__ = ["emit", "compile", "compile_spec", "make_spec"]  # `compile` shadows the builtin here, on purpose
