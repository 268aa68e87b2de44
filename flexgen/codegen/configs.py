"""Tile configurations: (block_m, block_n, num_warps, num_stages) per kernel kind and head dim.

One small table, to be tuned on hardware. A row is (kind, max_head_dim, family); the
first row whose kind and family match and whose max_head_dim >= head_dim wins;
family None matches every family.
"""
from __future__ import annotations

from ..arch import SM90_BACKWARD_TILE, family

CONFIG_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")

# kind, max head_dim, family (None: any) -> block_m, block_n, num_warps, num_stages
TABLE: list[tuple[str, int, str | None, tuple[int, int, int, int]]] = [
    # sm90 (Hopper's default forward where it applies, arch.resolve_forward_family): two consumer
    # warpgroups x 64 query rows (+ a producer warpgroup), double-buffered K/V.
    ("fwd", 128, "sm90", (128, 128, 8, 2)),
    # The sm90 backward: KV tile 128 (two consumer warpgroups x 64 keys), 64 query rows per step.
    ("bwd", 128, "sm90", (*SM90_BACKWARD_TILE, 8, 2)),
    ("fwd", 64, None, (128, 64, 4, 2)),
    ("fwd", 96, None, (128, 32, 4, 2)),  # 12 chunks per row: the general tile copy needs more registers
    ("fwd", 128, None, (128, 64, 4, 1)),  # one K/V stage: 348 vs 330 TFLOP/s on full attention (H200, NOTES.md)
    ("fwd", 256, None, (64, 32, 4, 2)),  # 64 x 64 double-buffered spills at D=256
    ("bwd", 128, None, (64, 128, 8, 2)),  # FlashAttention-2's tile: 32 x 32 to 32 x 64 per warp in all five products
    ("bwd", 256, None, (64, 64, 8, 2)),
]
DEFAULT = (64, 64, 4, 2)  # kinds without a row (pre/post-processing, block masks)
# A score_mod that loads a different buffer element for every score (relative bias tables) needs address
# registers next to the 128 x 64 tile's O and S, which then spills (sm_80 at D=64, every target above):
# such forward kernels take 32-column KV tiles instead.
SCORE_LOAD_FWD_BLOCK_N = 32

# Kernels that hold extra state next to the tile (dropout's Philox state, the backward's
# buffer-gradient addresses and sums): where the default sits at the register limit, a smaller
# tile, so that they compile without spills. Consulted before TABLE; head dims past its rows
# fall through.
LEAN_TABLE: list[tuple[str, int, str | None, tuple[int, int, int, int]]] = [
    ("fwd", 64, None, (128, 64, 4, 2)),
    ("fwd", 128, None, (128, 64, 8, 2)),  # one 16-row MMA tile per warp
    ("bwd", 32, None, (64, 128, 8, 2)),  # (64 x 64 at D=32 makes ptxas stop at 128 registers and spill)
    ("bwd", 128, None, (64, 64, 8, 2)),  # half the dK, dV registers of TABLE's tile
    ("bwd", 256, None, (32, 64, 8, 2)),
]


def choose_config(kind: str, head_dim: int, dtype: str, arch: str, score_loads_per_element: bool = False,
                  dropout: bool = False, buffer_grads: bool = False, family_override: str | None = None,
                  **overrides) -> dict:
    """Config for one kernel; keyword overrides (e.g. block_n=32) win over the table. `dropout`
    and `buffer_grads` (a backward that accumulates score_mod buffer gradients) pick LEAN_TABLE.
    `family_override` is the spec option "family" (e.g. "sm90"), when set."""
    fam = family_override or family(arch)
    chosen = DEFAULT
    for row_kind, max_d, row_family, values in (LEAN_TABLE + TABLE if dropout or buffer_grads else TABLE):
        if row_kind == kind and head_dim <= max_d and row_family in (None, fam):
            chosen = values
            break
    cfg = dict(zip(CONFIG_FIELDS, chosen))
    if kind == "fwd" and score_loads_per_element:  # sm90: 64 is the smallest wgmma N it has
        cfg["block_n"] = min(cfg["block_n"], SCORE_LOAD_FWD_BLOCK_N if fam != "sm90" else 64)
    unknown = set(overrides) - set(CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"unknown config field(s) {sorted(unknown)}; config fields are {CONFIG_FIELDS}")
    cfg.update({k: int(v) for k, v in overrides.items() if v is not None})
    return cfg
