"""KernelSpec: every compile-time choice of one generated kernel, as plain immutable data.

A spec plus the template it names determines the emitted CUDA source completely;
the cache key is derived from that source. Run-time values (sequence lengths,
strides, parameter values, buffer pointers) are never part of a spec.

Contract between stages
-----------------------
* `flexgen.codegen.lower.lower_mods(spec) -> LoweredMods` turns `score_expr`,
  `mask_expr` into CUDA text (see lower.py for the exact signatures).
* `flexgen.codegen.render.render(spec) -> str` picks
  `flexgen/templates/<spec.family>/<kind>.cu.j2` and renders it with `spec`,
  `mods` (the LoweredMods) and `cfg` (derived constants, render.derived_constants).
  Which family serves a call, with which tile, is decided by the planner
  (flexgen/runtime/plan.py, runtime/families.py); a spec only records it.
* Every template defines exactly one entry point, `extern "C" __global__`,
  named `spec.entry_name`, taking a single `const __grid_constant__` params
  struct that embeds `ModArgs mod;` as its last member.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields, replace

from ..arch import SUPPORTED, capability
from ..dsl.ir import Node

KINDS = ("fwd", "fwd_combine", "bwd", "bwd_preprocess", "bwd_postprocess", "block_mask")
DTYPES = ("bf16", "fp16")
ARCHS = ("sm_90",) + SUPPORTED
HEAD_DIMS = (32, 64, 96, 128, 256)


def panel_width(head_dim: int) -> int:
    """The columns the sm90 kernels load and keep in shared memory for a head dim: whole 64-column panels (their
    templates' D); their TMA loads zero-fill the columns past a narrower head's, which the products then skip."""
    return -(-head_dim // 64) * 64


def dq_fragments(bwd: "KernelSpec") -> tuple[int, int, int] | None:
    """(width, chunk columns, block rows) of the fp32 dQ accumulator in fragment order, where the main backward
    kernel `bwd` adds dQ so: the sm90 kernel's 80-row steps (templates/sm90/bwd.cu.j2, DQ_TRANSPOSED), whose
    warpgroups each compute a chunk of 80 rows x 64 columns transposed, as a m64n80 wgmma's accumulator. The width
    is the head dim: at D = 96 the second chunk keeps its 32 columns of the head only. Every other backward adds dQ
    row-major (None)."""
    if bwd.family != "sm90" or bwd.deterministic or bwd.block_m != 80:
        return None  # (row-major: by TMA reductions of swizzled panels, or from registers)
    return bwd.head_dim, panel_width(bwd.head_dim) // 2, 80


def with_dq_layout(bwd: "KernelSpec", helper: "KernelSpec") -> "KernelSpec":
    """The backward's preprocess or postprocess kernel `helper`, told the layout in which `bwd` adds dQ."""
    fragments = dq_fragments(bwd)
    if fragments is None:
        return helper
    name, value = ("dq_width", fragments[0]) if helper.kind == "bwd_preprocess" else ("dq_fragments", fragments)
    return helper.with_(extra=tuple(sorted({**dict(helper.extra), name: value}.items())))


@dataclass(frozen=True)
class KernelSpec:
    kind: str = "fwd"
    head_dim: int = 128
    dtype: str = "bf16"
    arch: str = "sm_80"
    family: str = "sm80"  # the template family: templates/<family>/<kind>.cu.j2
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    score_expr: Node | None = None  # None: identity score_mod
    mask_expr: Node | None = None  # None: no element mask (block mask may still skip tiles)
    grad_buffers: tuple[str, ...] = ()  # buffers of score_expr whose gradient the backward accumulates
    dropout: bool = False
    deterministic: bool = False
    debug: bool = False  # -G / -lineinfo builds
    extra: tuple[tuple[str, object], ...] = field(default=())  # template-specific knobs, sorted pairs

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kernel kind {self.kind!r} is not one of {KINDS}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; use one of {DTYPES}")
        if self.arch not in ARCHS:
            raise ValueError(f"architecture {self.arch!r} is not supported; use one of {ARCHS}")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.family):  # it names a template folder
            raise ValueError(f"template family {self.family!r} is not a folder name like 'sm80'")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim} is not supported; supported head dims are {HEAD_DIMS}")
        if self.score_expr is not None and self.score_expr.dtype.value == "bool":
            raise TypeError("score_expr must not be boolean")
        if self.mask_expr is not None and self.mask_expr.dtype.value != "bool":
            raise TypeError("mask_expr must be boolean")

    def __hash__(self) -> int:
        # Cached: the in-memory kernel cache hashes the spec on every lookup. Nodes hash
        # through their precomputed digest, so even the first hash is cheap.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        # str hashes differ between processes: never carry a cached hash across a pickle.
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def entry_name(self) -> str:
        return f"flexgen_{self.kind}"

    @property
    def sm(self) -> int:
        major, minor = capability(self.arch)
        return 10 * major + minor

    def with_(self, **changes) -> "KernelSpec":
        return replace(self, **changes)

    def option(self, name: str, default=None):
        return dict(self.extra).get(name, default)

    def describe(self) -> dict:
        """JSON-friendly summary (for cache metadata and `flexgen cache info`)."""
        from ..dsl.printer import pretty

        return {
            "kind": self.kind,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "arch": self.arch,
            "family": self.family,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
            "score_mod": pretty(self.score_expr, 2000) if self.score_expr is not None else None,
            "mask_mod": pretty(self.mask_expr, 2000) if self.mask_expr is not None else None,
            "grad_buffers": list(self.grad_buffers),
            "dropout": self.dropout,
            "deterministic": self.deterministic,
            "debug": self.debug,
            "extra": {k: v for k, v in self.extra},
        }
