"""The template families, one object each: which kernels a family has (templates/<name>/<kind>.cu.j2),
what it supports, which tile it runs, how it is launched, and why it refuses a call.

Every decision of the form "which family" is made here; the planner (plan.py) asks `choose`, the
launchers ask `of(spec)`, render.py only reads `spec.family`. Adding a family is adding one object to
FAMILIES (and its templates).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arch import capability, resident_ctas, shared_memory_limit
from ..cache.jit import get_kernel
from ..codegen.spec import HEAD_DIMS, KernelSpec, panel_width
from . import bwd_tiles
from .kernel_symbols import shared_memory_bytes
from .schedule import (TAIL_REACH, TailChoice, chunk_by_tail, head_chunk, kv_splits, kv_tile_turns, l2_bytes,
                       query_tile_order, sm_count, tile_counter)

TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")


class TileError(ValueError):
    """A tile kernel_options chose that the family's templates do not run."""


@dataclass(frozen=True)
class Call:
    """One kernel a caller wants, as a family sees it."""

    kind: str
    arch: str
    head_dim: int
    dtype: str
    dropout: bool = False
    buffer_grads: bool = False  # a backward that accumulates score_mod buffer gradients
    deterministic: bool = False  # a backward whose gradients are bitwise reproducible
    score_loads_per_element: bool = False  # score_mod reads a different buffer element for every score
    tiles: tuple[tuple[str, int], ...] = ()  # tile fields the caller fixed (TILE_FIELDS), sorted
    mask_block: tuple[int, int] | None = None  # the block mask's BLOCK_SIZE
    blocks_follow_mask: bool = False  # its lists were computed from the mask_mod (BlockMask.blocks_follow_mask_mod)
    masked: bool = False  # a mask_mod (which flex_attention runs under a block mask)
    scored: bool = False  # a score_mod
    mod_loads: bool = False  # score_mod or mask_mod reads a buffer
    score_folds: bool = False  # a forward's score_mod folds into per-head terms (dsl/affine.py, dsl/softcap.py)
    score_affine: bool = False  # a backward's score_mod folds into affine terms of the indices (ALiBi, dsl/affine.py)
    mask_loads: bool = False  # mask_mod reads a buffer
    banded: bool = False  # a forward's mask_mod hides keys far behind their query (a sliding window): a band
    mod_ops: int = 0  # operations in score_mod and mask_mod together
    max_scores: bool = False  # a forward that also writes the row max of the scores
    split_kv: bool = False  # a forward that splits each query tile's keys over several CTAs (runtime/split_kv.py)
    split_tall: bool = False  # ... of more than 64 query rows per KV head (a prefill chunk)


# A tile table row: (max head dim, (block_m, block_n, num_warps, num_stages)); the first row whose max head
# dim is at least the call's wins.
Rows = tuple[tuple[int, tuple[int, int, int, int]], ...]


def _row(rows: Rows, head_dim: int) -> tuple[int, int, int, int] | None:
    return next((tile for max_d, tile in rows if head_dim <= max_d), None)


class Family:
    name: str
    kinds: tuple[str, ...]  # the kernels it has: templates/<name>/<kind>.cu.j2
    head_dims: tuple[int, ...]
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    producer_threads = 0  # threads beside the num_warps consumer warps of the main kernels
    tensor_maps = False  # its fwd and bwd kernels load tiles with TMA: their params carry the maps (codegen/params.py)

    def arch_refusal(self, arch: str) -> str | None:
        """Why this family's kernels do not run on `arch` (None: they do)."""
        raise NotImplementedError

    def refusal(self, call: Call) -> str | None:
        """Why this family cannot run `call` (None: it can)."""
        if call.kind not in self.kinds:
            return f"it has only {self.kinds} kernels, not {call.kind!r}"
        why = self.arch_refusal(call.arch)
        if why is not None:
            return why
        if call.head_dim not in self.head_dims:
            return f"head dim {call.head_dim} is not one of {self.head_dims}"
        if call.dtype not in self.dtypes:
            return f"dtype {call.dtype} is not one of {self.dtypes}"
        return self._refusal(call)

    def _refusal(self, call: Call) -> str | None:
        return None

    def tiles(self, call: Call) -> dict:
        """block_m, block_n, num_warps, num_stages of the kernel for `call` (which it does not refuse)."""
        raise NotImplementedError

    def threads_per_cta(self, spec: KernelSpec) -> int:
        return 32 * spec.num_warps + self.producer_threads

    def forward_grid(self, spec: KernelSpec, p, q, k, block_mask) -> tuple[tuple, tuple]:
        """The forward's grid, one CTA per query tile, and the tensors whose addresses it wrote into p (the
        caller keeps them while p is used) beside any field known only later (an object with `fill(p)`, called at
        each launch); fills the FwdParams fields the family's schedule reads, but for those of the stream
        (stream_fields)."""
        batch, heads, q_len, _ = q.shape
        return (-(-q_len // spec.block_m), heads, batch), ()

    def stream_fields(self, p, device, stream: int) -> None:
        """Fills the FwdParams fields that depend on the stream (a raw pointer) the forward launches on."""

    def backward_grid(self, spec: KernelSpec, p, q, k, num_kv_tiles: int, splits: int,
                      block_mask=None) -> tuple[tuple, tuple]:
        """The main backward kernel's grid: one CTA per KV tile, or `splits` per (batch, KV head) in
        deterministic mode, and the tensors whose addresses it wrote into p; fills the BwdParams fields the
        family's schedule reads."""
        return (splits if spec.deterministic else num_kv_tiles, k.shape[1], k.shape[0]), ()


class SM80(Family):
    """mma.sync, cp.async, ldmatrix: every GPU from sm_80 on, every kernel kind."""

    name = "sm80"
    kinds = ("fwd", "fwd_combine", "bwd", "bwd_preprocess", "bwd_postprocess")
    head_dims = HEAD_DIMS
    FWD: Rows = ((64, (128, 64, 4, 2)),
                 (96, (128, 32, 4, 2)),  # 12 chunks per row: the general tile copy needs more registers
                 (128, (128, 64, 4, 1)),  # one K/V stage
                 (256, (64, 32, 4, 2)))  # 64 x 64 double-buffered spills at D=256
    BWD: Rows = ((128, (64, 128, 8, 2)),  # FlashAttention-2's tile: 32 x 32 to 32 x 64 per warp in all five products
                 (256, (64, 64, 8, 2)))
    # Kernels that hold extra state next to the tile (dropout's Philox state, the backward's buffer-gradient
    # addresses and sums): where the default sits at the register limit, a smaller tile, so that they compile
    # without spills. Head dims past their rows take FWD's and BWD's.
    FWD_LEAN: Rows = ((64, (128, 64, 4, 2)),
                      (128, (128, 64, 8, 2)))  # one 16-row MMA tile per warp
    BWD_LEAN: Rows = ((32, (64, 128, 8, 2)),  # (64 x 64 at D=32 makes ptxas stop at 128 registers and spill)
                      (128, (64, 64, 8, 2)),  # half the dK, dV registers of BWD's tile
                      (256, (32, 64, 8, 2)))
    # The split-key forward (decoding: a few query rows, runtime/split_kv.py): one 16-row MMA tile per warp, since
    # rows past the query's are computed for nothing, and two K/V stages, since the loads are what it waits for.
    FWD_SPLIT: Rows = ((128, (64, 64, 4, 2)),
                       (256, (64, 32, 4, 2)))
    # Past 64 rows per KV head (plan.split_block_m) two MMA tiles per warp, one K/V stage, as the training tile; at
    # D = 128 it spills 8-68 B (ALiBi the most) and still ran 1.1-1.2x faster than FWD_SPLIT's tile. Other head
    # dims keep FWD_SPLIT's.
    FWD_SPLIT_TALL: Rows = ((64, (128, 64, 4, 1)),
                            (96, (64, 64, 4, 2)),
                            (128, (128, 64, 4, 1)),
                            (256, (64, 32, 4, 2)))
    PRE_POST = (64, 64, 4, 1)  # bwd_preprocess, bwd_postprocess: 64 rows per CTA, 4 warps; fwd_combine: 4 warps
    # A score_mod that loads a different buffer element for every score (relative bias tables) needs address
    # registers next to the 128 x 64 tile's O and S, which then spills: such forward kernels take 32-column
    # KV tiles instead.
    SCORE_LOAD_BLOCK_N = 32

    def arch_refusal(self, arch: str) -> str | None:
        return None if capability(arch) >= (8, 0) else f"it needs sm_80 or newer, not {arch}"

    def tiles(self, call: Call) -> dict:
        lean = call.dropout or call.buffer_grads
        if call.kind == "fwd" and call.split_kv:
            tile = _row(self.FWD_SPLIT_TALL if call.split_tall else self.FWD_SPLIT, call.head_dim)
        elif call.kind == "fwd":
            tile = (lean and _row(self.FWD_LEAN, call.head_dim)) or _row(self.FWD, call.head_dim)
        elif call.kind == "bwd":
            tile = (lean and _row(self.BWD_LEAN, call.head_dim)) or _row(self.BWD, call.head_dim)
        else:
            tile = self.PRE_POST
        cfg = dict(zip(TILE_FIELDS, tile))
        if call.kind == "fwd" and call.score_loads_per_element:
            cfg["block_n"] = min(cfg["block_n"], self.SCORE_LOAD_BLOCK_N)
        cfg.update(call.tiles)
        if call.kind == "fwd" and call.tiles:
            self.check_forward_tile(cfg)
        elif call.kind == "fwd" and call.mask_block is not None:
            self._fit_forward_tile(cfg, call)
        if call.kind == "bwd":  # num_warps is an upper bound; tiles shrink to divide mask blocks and fit
            cfg = bwd_tiles.fit(call.head_dim, cfg, call.mask_block, shared_memory_limit(call.arch), call.arch)
        return cfg

    def _fit_forward_tile(self, cfg: dict, call: Call) -> None:
        """Halve the default tile until it divides the mask's blocks (16 rows per warp, 4 warps and 16 columns at
        least): KV blocks always, query blocks unless the lists follow mask_mod, when a tile walks the union of
        the query blocks it touches (runtime/coarse_rows.py) and keeps its rows."""
        q_block, kv_block = call.mask_block
        while not call.blocks_follow_mask and q_block % cfg["block_m"]:
            if cfg["block_m"] > 16 * cfg["num_warps"]:
                cfg["block_m"] //= 2
            elif cfg["num_warps"] > min(self.FWD_WARPS):  # (the lean tiles' 8 warps of 16 rows: the same per warp)
                cfg["block_m"] //= 2
                cfg["num_warps"] //= 2
            else:
                break
        while kv_block % cfg["block_n"] and cfg["block_n"] > 16:
            cfg["block_n"] //= 2

    FWD_WARPS = (4, 8)  # the counts the tile tables and tests run
    FWD_BLOCK_N = (16, 32, 64, 128)
    FWD_STAGES = (1, 2)

    def check_forward_tile(self, cfg: dict) -> None:
        """The forward template's tile constraints (fwd.cu.j2's static_asserts: BLOCK_M is one or two 16-row
        MMA tiles per warp, BLOCK_N whole 16-wide steps), checked before anything is compiled."""
        warps = cfg["num_warps"]
        if warps not in self.FWD_WARPS:
            raise TileError(f"flex_attention: kernel_options num_warps={warps}; allowed values are {self.FWD_WARPS}")
        rows = (16 * warps, 32 * warps)
        if cfg["block_m"] not in rows:
            raise TileError(f"flex_attention: kernel_options BLOCK_M={cfg['block_m']} with num_warps={warps}; "
                            f"allowed values are {rows} (16 or 32 rows per warp) for the sm80 forward")
        if cfg["block_n"] not in self.FWD_BLOCK_N:
            raise TileError(f"flex_attention: kernel_options BLOCK_N={cfg['block_n']}; allowed values are "
                            f"{self.FWD_BLOCK_N} for the sm80 forward")
        if cfg["num_stages"] not in self.FWD_STAGES:
            raise TileError(f"flex_attention: kernel_options num_stages={cfg['num_stages']}; allowed values are "
                            f"{self.FWD_STAGES}")

    def forward_grid(self, spec: KernelSpec, p, q, k, block_mask) -> tuple[tuple, tuple]:
        if not spec.option("split_kv", False):
            return super().forward_grid(spec, p, q, k, block_mask)
        # Split keys: the query heads of a KV head share tiles where they can (packed_heads), and the parts of one
        # query tile are neighbours along x.
        batch, heads, q_len, _ = q.shape
        p.packed_heads = packed = packed_heads(spec, heads // k.shape[1], q_len, block_mask)
        query_tiles = -(-packed * q_len // spec.block_m)
        p.kv_splits = kv_splits(query_tiles * (heads // packed) * batch, -(-k.shape[2] // spec.block_n),
                                ctas_per_sm(spec) * sm_count(q.device))
        return (query_tiles * p.kv_splits, heads // packed, batch), ()

    def shared_memory_estimate(self, spec: KernelSpec) -> int:
        """The backward's shared memory before it is compiled (the tile search's measure)."""
        return bwd_tiles.shared_memory_bytes(spec.head_dim, spec.block_m, spec.block_n, spec.num_stages)


class SM90(Family):
    """Hopper: wgmma, a producer warpgroup beside two consumer warpgroups, mbarriers. The forward (head dims 32,
    64, 96, 128 and 256) and the main backward kernel (the same; 32 and 96 not deterministic); the
    backward's buffer gradients only in non-deterministic mode. Its tiles are fixed."""

    name = "sm90"
    kinds = ("fwd", "bwd")
    head_dims = (32, 64, 96, 128, 256)  # (32 and 96 run on 64 and 128 columns: codegen.spec.panel_width)
    producer_threads = 128
    tensor_maps = True
    FWD = (128, 128, 8, 2)  # two consumer warpgroups x 64 query rows, double-buffered K/V
    # At D = 64 the softmax of a tile costs as much as its two products: three consumer warpgroups take
    # turns on the tensor cores. Under a block mask whose query blocks a 192-row tile straddles, the forward
    # walks the union of the blocks' lists (runtime/coarse_rows.py), where those follow the mask_mod (a mask from
    # create_block_mask; hand-made lists keep the 128-row tile); not where a mod reads buffers per score (their
    # addresses spill at 160 registers: 200-390 B; a score_mod that folds into per-head terms, ALiBi with a
    # slopes tensor, reads them once per work tile and takes the 192 rows: 7% faster, docs/forward-sm90.md) or
    # is long (attention-gym's tiled NATTEN and STA masks, 31-44 operations, spill 44-256 B; its masks up to 16
    # operations spill nothing), nor for a mask_mod planned without its block mask, nor with dropout beside a
    # score_mod (Philox's state beside ALiBi's terms spills 156 B, beside a generic score_mod 8 B; dropout with no
    # score_mod, masked or not, spills nothing: docs/dropout.md).
    FWD_THREE_WG = (192, 128, 12, 2)
    THREE_WG_MAX_OPS = 24
    FWD_SCORE_LOAD_BLOCK_N = 64  # per-element score loads: the smallest wgmma N the template has
    # D = 256: O's accumulator takes 128 registers of a consumer's 240, so S is 64 keys wide (32 more), and one Q
    # buffer fits beside two K / V stages (192 KB). Spill-free without a mod; ALiBi 20 B, documents 92 B.
    FWD_WIDE_HEAD_BLOCK_N = 64
    BWD = (64, 128, 8, 2)  # KV tile 128 (two consumer warpgroups x 64 keys), 64 query rows per step
    # At D = 64 a step of 64 query rows is short: its fixed costs (the waits for its products, the dX barrier, the
    # dQ hand-off) weigh as much as its products. 128 rows halve them per FLOP and fit 240 registers there (not
    # at D = 128; softcap with a mask spills 40-44 B on the mask's partial tiles and still gains 2%). Not for a
    # mask_mod that reads buffers (documents spill 8 B per step and lost 3-34%) nor a score_mod that loads an
    # element per score (a relative-bias table spills 228 B), nor with dropout (520-610 B) or buffer gradients
    # (ALiBi's slopes: 128 B). A block mask's query blocks must be multiples of 128.
    BWD_WIDE = (128, 128, 8, 2)
    # D = 96 / 128: 80 query rows per step (FlashAttention-3's and FA4's non-causal tile), a step's fixed costs over
    # 25% more rows; dQ is computed transposed (templates/sm90/bwd.cu.j2, DQ_TRANSPOSED). Shared memory: 231,808 of
    # 232,448 bytes. A score_mod only where it folds into affine terms (ALiBi with fixed slopes: 1.4% less); a soft
    # cap over 80 rows ran 5% slower (unfolded: folded it spills), so it keeps 64-row steps. Under a block mask too
    # (causal 8.5% less), walking unions of its query blocks where they are not multiples of 80 (coarse_rows.py),
    # but not for a mask that reads buffers (documents spill 158 B).
    BWD_TALL = (80, 128, 8, 2)
    # D = 256: dK and dV of 64 keys over all of D would take 256 registers a thread, so both warpgroups work on the
    # same 64 keys and split the head dim (templates/sm90/bwd.cu.j2, WIDE_HEAD).
    BWD_WIDE_HEAD = (64, 64, 8, 2)

    def arch_refusal(self, arch: str) -> str | None:
        return None if arch in ("sm_90", "sm_90a") else f"it needs arch sm_90a (wgmma), not {arch}"

    def _refusal(self, call: Call) -> str | None:
        if call.kind == "bwd" and call.deterministic and call.head_dim != panel_width(call.head_dim):
            return f"at head dim {call.head_dim} its deterministic backward (plain stores, not TMA) is sm80's"
        if call.kind == "fwd" and call.head_dim == 32 and call.mask_loads:
            # (half of each 64-column product is padding: documents + causal ran 109 TFLOP/s against sm80's 116)
            return "at head dim 32 it leaves masks that read buffers to sm80, which runs them faster"
        if call.split_kv:
            return "it does not split a query tile's keys (split_kv: the sm80 forward's decoding path)"
        if call.buffer_grads and call.deterministic:
            # (ptxas fails on them at D = 64, C7600, and a relative-bias table spills 340 B at D = 128)
            return "it computes buffer gradients only in non-deterministic mode"
        if call.buffer_grads and call.dropout:
            return "it does not combine buffer gradients with dropout (328 B of spills at D = 128)"
        if call.tiles:
            return ("its tiles are fixed; BLOCK_M / BLOCK_N / num_warps / num_stages and BLOCK_M1 / BLOCK_N1 / "
                    "num_warps1 are sm80 tile choices")
        tile = self.tiles(call)
        if call.mask_block is None:
            return None
        if not self._walks_blocks(call, (tile["block_m"], tile["block_n"])):
            hint = "" if call.kind == "bwd" or call.mask_block[1] % tile["block_n"] else \
                " (it walks smaller query blocks of a mask from create_block_mask, whose lists follow its mask_mod)"
            return f"block mask BLOCK_SIZE {tuple(call.mask_block)} is not a multiple of its tile " \
                   f"{(tile['block_m'], tile['block_n'])}{hint}"
        return None

    def tiles(self, call: Call) -> dict:
        if call.kind == "fwd":
            small_mods = call.mod_ops <= self.THREE_WG_MAX_OPS and not call.score_loads_per_element
            unmasked = call.mask_block is None and not call.masked
            # (a folded score_mod reads its buffers once per work tile, not per score: no pointers across the loop)
            loads_in_loop = call.mask_loads or (call.mod_loads and not call.score_folds)
            blocked = not loads_in_loop and self._walks_blocks(call, self.FWD_THREE_WG)
            three = (self._three_warpgroup_head(call) and small_mods and (unmasked or blocked)
                     and not (call.dropout and call.scored))
            cfg = dict(zip(TILE_FIELDS, self.FWD_THREE_WG if three else self.FWD))
        else:
            cfg = dict(zip(TILE_FIELDS, self._backward_tile(call)))
        if call.kind == "fwd" and call.score_loads_per_element:
            cfg["block_n"] = self.FWD_SCORE_LOAD_BLOCK_N
        if call.kind == "fwd" and panel_width(call.head_dim) > 128:
            cfg["block_n"] = self.FWD_WIDE_HEAD_BLOCK_N
        return cfg

    @staticmethod
    def _three_warpgroup_head(call: Call) -> bool:
        """Whether a forward takes three consumer warpgroups for its head dim: at 32 and 64; at 96 and 128 without
        dropout or a band of keys, with P through shared memory (templates/sm90/fwd.cu.j2, P_IN_SMEM): 5-8% less
        kernel time on full and causal attention. There a sliding window ran 0.7% (D = 96) and 5% (128) slower: in
        a band W wide a tile of H rows walks about (H + 64) / W more keys than its rows need, a quarter for 192 rows
        at W = 1024 against a fifth for 128, in partial tiles. Dropout's Philox state spills 104-752 B there. A
        score_mod only at D = 96 (soft cap -3.4%, ALiBi level with two warpgroups); at 128 its softmax spills
        200-1100 B. docs/forward-sm90.md."""
        return panel_width(call.head_dim) == 64 or (call.head_dim in (96, 128) and not (call.banded or call.dropout)
                                                     and (not call.scored or call.head_dim == 96))

    @staticmethod
    def _merges_rows(call: Call) -> bool:
        """A forward tile may walk the union of the query blocks it touches (runtime/coarse_rows.py): exact only
        where the lists follow mask_mod, which then decides every element a union makes partial. The backward's
        steps at D = 96 / 128 walk such unions too (its launch coarsens a mask whose blocks are shorter than a step)."""
        return call.blocks_follow_mask and (call.kind == "fwd" or panel_width(call.head_dim) == 128)

    @classmethod
    def _walks_blocks(cls, call: Call, tile: tuple[int, ...]) -> bool:
        """Whether tiles of tile[0] query rows and tile[1] keys can walk the call's block mask: its KV blocks a
        multiple of the keys, its query blocks a multiple of the rows or walked in unions (_merges_rows)."""
        if call.mask_block is None:
            return False
        q_block, kv_block = call.mask_block
        return kv_block % tile[1] == 0 and (q_block % tile[0] == 0 or cls._merges_rows(call))

    def _backward_tile(self, call: Call) -> tuple[int, int, int, int]:
        if panel_width(call.head_dim) == 256:
            return self.BWD_WIDE_HEAD
        rows_fit = call.mask_block is None or call.mask_block[0] % self.BWD_WIDE[0] == 0
        wide = (panel_width(call.head_dim) == 64 and rows_fit and not call.mask_loads and not call.score_loads_per_element
                and not call.dropout and not call.buffer_grads)
        # (80-row steps: a score_mod only where it folds into affine terms, a soft cap lost 5%; a mask only under
        # a block mask whose query blocks are multiples of 80 rows or whose lists follow the mask_mod, which the
        # steps then walk in unions: runtime/coarse_rows.py)
        tall = (panel_width(call.head_dim) == 128 and not call.mask_loads
                and (call.mask_block is None and not call.masked or self._walks_blocks(call, self.BWD_TALL))
                and (not call.scored or (call.score_affine and not call.buffer_grads))
                and not call.deterministic and not call.dropout)
        return self.BWD_WIDE if wide else self.BWD_TALL if tall else self.BWD

    def forward_grid(self, spec: KernelSpec, p, q, k, block_mask) -> tuple[tuple, tuple]:
        # One CTA per SM draws work tiles, heaviest first, from a counter (templates/sm90/work_order.cuh: the
        # grid ends on light tiles, and the next tile's copies hide behind this one's epilogue);
        # kernel_options={"persistent": False} launches one CTA per work tile.
        batch, heads, q_len, d = q.shape
        query_tiles = -(-q_len // spec.block_m)
        work = query_tiles * heads * batch
        order = None if block_mask is None else query_tile_order(block_mask, spec.block_m)
        if order is not None:  # (without it the kernel takes later query tiles first)
            p.m_order = order.data_ptr()
        grid = (min(work, sm_count(q.device)) if spec.option("persistent", True) else work, 1, 1)
        reach = grid[0]  # (under a block mask on 192-row tiles the bound reaches further: TAIL_REACH)
        if block_mask is not None and spec.block_m == self.FWD_THREE_WG[0]:
            reach = grid[0] * TAIL_REACH[0] // TAIL_REACH[1]
        p.head_chunk = head_chunk(batch * heads, k.shape[2], d, q.element_size(), heads // k.shape[1],
                                  l2_bytes(q.device), query_tiles=query_tiles, ctas=reach)
        if block_mask is not None:  # (the tiles differ in cost: within that bound, the chunk with the shortest tail)
            chunk = chunk_by_tail(block_mask, spec.block_m, batch * heads, grid[0], p.head_chunk)
            if isinstance(chunk, TailChoice):  # (filled again at each launch: ForwardLaunch.run)
                chunk.fill(p)
                return grid, (order, chunk)
            p.head_chunk = chunk
        return grid, (order,)

    def stream_fields(self, p, device, stream: int) -> None:
        p.tile_counter = tile_counter(device, stream).data_ptr()

    def backward_grid(self, spec: KernelSpec, p, q, k, num_kv_tiles: int, splits: int,
                      block_mask=None) -> tuple[tuple, tuple]:
        if spec.deterministic or not spec.option("persistent", True):
            return super().backward_grid(spec, p, q, k, num_kv_tiles, splits, block_mask)
        # One CTA per SM walks the work tiles: the next tile's K and V copy behind this one's epilogue. Under a
        # block mask the tiles differ in cost, and each CTA's turns come from a balanced list (schedule.py).
        p.persistent = 1
        ctas = min(num_kv_tiles * k.shape[1] * k.shape[0], sm_count(k.device))
        turns = None if block_mask is None else kv_tile_turns(block_mask, spec.block_n, num_kv_tiles, k.shape[0],
                                                               q.shape[1], k.shape[1], ctas)
        if turns is not None:
            p.kv_turns = turns.data_ptr()
        return (ctas, 1, 1), (turns,)


def ctas_per_sm(spec: KernelSpec) -> int:
    """How many CTAs of the compiled kernel one SM holds at once (its registers and shared memory)."""
    kernel = get_kernel(spec)
    return resident_ctas(spec.arch, of(spec).threads_per_cta(spec), kernel.registers(),
                         shared_memory_bytes(kernel))


def packed_heads(spec: KernelSpec, kv_group: int, q_len: int, block_mask) -> int:
    """How many query heads share the rows of a split-key tile: a KV head's whole group (each KV tile is then read
    once for all of them), where the block mask's lists are the same for every head (made for H = 1) and the query
    lies in its first query block; not with dropout, whose draw is per (head, row) pair of a 16-row MMA tile."""
    if kv_group == 1 or spec.dropout:
        return 1
    if block_mask is not None and (block_mask.kv_num_blocks.shape[1] != 1 or q_len > block_mask.BLOCK_SIZE[0]):
        return 1
    return kv_group


# In order of preference: a call gets the first family that does not refuse it.
FAMILIES: tuple[Family, ...] = (SM90(), SM80())
_BY_NAME = {f.name: f for f in FAMILIES}


def named(name: str) -> Family:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"kernel option family={name!r}; allowed: {sorted(_BY_NAME)}") from None


def of(spec: KernelSpec) -> Family:
    """The family of a planned spec."""
    return _BY_NAME[spec.family]


def choose(call: Call, requested: str | None = None) -> Family:
    """The family that runs `call`: the one requested (an error says why where it cannot), else the first of
    FAMILIES that does not refuse it."""
    if requested is not None:
        family = named(requested)
        why = family.refusal(call)
        if why is not None:
            others = [f.name for f in FAMILIES if f is not family and f.refusal(call) is None]
            hint = f"; use family={others[0]!r}" if others else ""
            raise ValueError(f"kernel option family={requested!r}: the {requested} {call.kind} kernel cannot run this "
                             f"call: {why}{hint}")
        return family
    for family in FAMILIES:
        if family.refusal(call) is None:
            return family
    reasons = "; ".join(f"{f.name}: {f.refusal(call)}" for f in FAMILIES)
    raise ValueError(f"no template family has a {call.kind} kernel for this call ({reasons})")
