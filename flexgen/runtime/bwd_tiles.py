"""Tile arithmetic of the sm80 backward kernel (templates/sm80/bwd.cu.j2): its warp layout, the shared
memory a tile needs, and the search for the largest tile that fits a target. Used by the sm80 family
(runtime/families.py) before anything is compiled."""
from __future__ import annotations

# dK and dV of a warp's rows and columns stay in registers all along: 128 registers at most.
MAX_DKV_FLOATS_PER_WARP = 128 * 32  # 128 registers x 32 lanes


def warp_layout(head_dim: int, block_m: int, block_n: int, num_warps: int) -> tuple[int, int]:
    """(key warps, other warps) of bwd.cu.j2 (key_warps()): key rows in groups of 32 where that
    leaves every warp whole 16-wide steps of the query and D columns, else of 16."""
    def whole_steps(other: int) -> bool:
        return block_m % (16 * other) == 0 and head_dim % (16 * other) == 0

    key_warps = min(max(block_n // 32, 1), num_warps)
    while key_warps < num_warps and key_warps < block_n // 16 and not whole_steps(num_warps // key_warps):
        key_warps *= 2
    return key_warps, num_warps // key_warps


def layout_fits(head_dim: int, block_m: int, block_n: int, num_warps: int) -> bool:
    """Whether bwd.cu.j2's static_asserts hold for this tile and warp count."""
    key_warps, other = warp_layout(head_dim, block_m, block_n, num_warps)
    return (key_warps * other == num_warps and block_n % (16 * key_warps) == 0
            and block_m % (16 * other) == 0 and head_dim % (16 * other) == 0)


def shared_memory_bytes(head_dim: int, block_m: int, block_n: int, num_stages: int) -> int:
    """Dynamic shared memory of bwd.cu.j2's layout (kv_tile_backward; the kernel exports the same number
    as flexgen_bwd_smem_bytes): K, V; Q and dO per stage; P^T and dX^T; lse and delta per stage."""
    d, bm, bn = head_dim, block_m, block_n
    stages = 2 if num_stages >= 2 else 1
    halves = 2 * bn * (d + 8) + 2 * stages * bm * (d + 8) + 2 * bn * (bm + 8)
    return 2 * halves + 2 * stages * bm * 4


def fit(head_dim: int, start: dict, mask_block: tuple[int, int] | None, smem_limit: int, arch: str) -> dict:
    """The tile to run, from `start` (block_m, block_n, num_warps, num_stages; num_warps an upper bound):
    block-mask blocks must be whole multiples of the tile; then the first that fits `smem_limit` of
    fewer query rows (down to 32), one Q/dO stage instead of two, fewer key rows; then as many warps
    as the layout gives work to."""
    bm, bn = start["block_m"], start["block_n"]
    if mask_block is not None:
        bq, bkv = mask_block
        if bq % 16 or bkv % 16:
            raise ValueError(f"flex_attention backward: block mask BLOCK_SIZE {mask_block} must be a multiple of 16")
        while bq % bm:
            bm //= 2
        while bkv % bn:
            bn //= 2
    stage_options = (2, 1) if start["num_stages"] >= 2 else (1,)
    rows = [bm >> i for i in range(8) if (bm >> i) >= min(bm, 32)]
    for n in [bn >> i for i in range(8) if (bn >> i) >= 16]:
        for stages in stage_options:
            for m in rows:
                warps = _warps_for(head_dim, m, n, start["num_warps"])
                if shared_memory_bytes(head_dim, m, n, stages) <= smem_limit and warps:
                    return {"block_m": m, "block_n": n, "num_warps": warps, "num_stages": stages}
    raise NotImplementedError(
        f"flex_attention backward: head dim {head_dim} has no tile that fits {arch}'s {smem_limit} bytes of shared "
        "memory per block and its registers; it is not supported on this GPU"
    )


def _warps_for(head_dim: int, block_m: int, block_n: int, warps: int) -> int:
    """The most warps, up to `warps`, whose layout gives each one whole MMA steps and at most
    MAX_DKV_FLOATS_PER_WARP of dK, dV; 0 if there are none."""
    while warps >= 1:
        if layout_fits(head_dim, block_m, block_n, warps) and 2 * block_n * head_dim <= MAX_DKV_FLOATS_PER_WARP * warps:
            return warps
        warps //= 2
    return 0
