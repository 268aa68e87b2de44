"""The kernels' parameter structs, each written once, as a field list.

A kernel takes one struct by value (`const __grid_constant__`), with the variant's ModArgs last.
From each list come both the C declaration the templates paste (through `cfg.params`, see
render.derived_constants: templates/common/{fwd,bwd}_params.j2, sm80/bwd_{pre,post}process.cu.j2)
and the ctypes type the launchers fill (runtime/forward.py, runtime/backward.py). ctypes lays a
Structure out with the platform C ABI, as NVRTC and nvcc lay out a kernel parameter, so the bytes
the host fills are the bytes the kernel reads.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

from .cstruct import ctype_of


@dataclass(frozen=True)
class Line:
    """One declaration: `ctype names...;`, with a comment after it."""

    ctype: str
    names: tuple[str, ...]
    comment: str = ""


def _line(ctype: str, *names: str, comment: str = "") -> Line:
    return Line(ctype, names, comment)


def _strides(prefix: str, last: str = "l", comment: str = "") -> Line:
    return Line("long long", tuple(f"{prefix}_stride_{d}" for d in ("b", "h", last)), comment)


# A str entry is a comment line above what follows.
Entry = Line | str


def _mask_lists(lists: str, by: str, about: tuple[str, ...]) -> tuple[Entry, ...]:
    """A block mask's count and index tensors (`lists`: "kv" for the forward's KV-block lists, "q" for
    the backward's transposed ones) and their strides over b, h and `by`, the blocks they are listed for."""
    return (*about,
            _line("const int*", f"{lists}_num_blocks"),
            _line("const int*", f"{lists}_indices"),
            _line("const int*", f"full_{lists}_num_blocks", comment="may be null"),
            _line("const int*", f"full_{lists}_indices"),
            *(_strides(prefix, by) for prefix in (f"{lists}n", f"{lists}i", f"f{lists}n", f"f{lists}i")))


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: ctypes_type's cache key stays cheap
class ParamStruct:
    name: str
    entries: tuple[Entry, ...]
    map_names: tuple[str, ...] = ()  # its TMA descriptors, in kernels built with tensor_maps

    def _maps(self, tensor_maps: bool) -> tuple[Entry, ...]:
        """TMA descriptors (CUtensorMap: 128 opaque bytes, 64-byte aligned), first, so that they sit at aligned
        offsets in the host mirror too; only in kernels whose tiles the copy engine loads (runtime/families.py)."""
        if not tensor_maps:
            return ()
        return ("TMA descriptors (runtime/tensor_maps.py): dims (D, L, H, B), box 128 bytes x the tile's rows.",
                _line("TensorMap", *self.map_names))

    @property
    def lines(self) -> tuple[Line, ...]:
        return tuple(e for e in self.entries if isinstance(e, Line))

    def declaration(self, dropout: bool = False, max_scores: bool = False, tensor_maps: bool = False,
                    split_kv: bool = False) -> str:
        """The C struct, ModArgs last; the dropout members before it in kernels built with dropout, then the
        row-max output in forward kernels that write it, then the partial outputs of forward kernels that split
        the keys. With tensor_maps, the TMA descriptors come first (templates/sm90/tma.cuh declares their type)."""
        out = [f"struct {self.name} {{"]
        for entry in self._maps(tensor_maps) + self.entries + _optional(dropout, max_scores, split_kv):
            if isinstance(entry, str):
                out.append(f"    // {entry}")
                continue
            text = f"    {entry.ctype} {', '.join(entry.names)};"
            out.append(f"{text:<37} // {entry.comment}" if entry.comment else text)
        out += ["    ModArgs mod;", "};"]
        return "\n".join(out)

    def field_names(self, dropout: bool = False, max_scores: bool = False, tensor_maps: bool = False,
                    split_kv: bool = False) -> list[str]:
        lines = _lines(self._maps(tensor_maps)) + self.lines + _lines(_optional(dropout, max_scores, split_kv))
        return [n for line in lines for n in line.names]

    @functools.lru_cache(maxsize=None)
    def ctypes_type(self, mod_args_type: type, dropout: bool = False, max_scores: bool = False,
                    tensor_maps: bool = False, split_kv: bool = False) -> type:
        """The ctypes mirror for one ModArgs layout (and the optional members the kernel was built with)."""
        lines = _lines(self._maps(tensor_maps)) + self.lines + _lines(_optional(dropout, max_scores, split_kv))
        fields = [(n, ctype_of(line.ctype)) for line in lines for n in line.names] + [("mod", mod_args_type)]
        struct = type(self.name, (ctypes.Structure,), {"_fields_": fields})
        if tensor_maps and ctypes.sizeof(struct) % TENSOR_MAP_ALIGN:
            # C pads a struct holding 64-byte-aligned members to a multiple of 64; the launch copies that many bytes.
            pad = TENSOR_MAP_ALIGN - ctypes.sizeof(struct) % TENSOR_MAP_ALIGN
            struct = type(self.name, (ctypes.Structure,), {"_fields_": fields + [("_tail", ctypes.c_uint8 * pad)]})
        return struct


def _lines(entries: tuple[Entry, ...]) -> tuple[Line, ...]:
    return tuple(e for e in entries if isinstance(e, Line))


# Only in kernels built with spec.dropout, just before ModArgs (forward and backward alike).
DROPOUT: tuple[Entry, ...] = (
    "Dropout (common/philox.cuh): keep an element iff its 16-bit Philox half >= dropout_threshold; the",
    "backward draws the same words again.",
    _line("unsigned long long", "philox_seed", "philox_offset"),
    _line("float", "dropout_p"),
    _line("unsigned", "dropout_threshold", comment="round(dropout_p * 2^16)"),
    _line("float", "dropout_scale", comment="2^16 / (2^16 - dropout_threshold)"),
)

# Only in forward kernels built to write max_scores (spec option "max_scores"), after any dropout members.
MAX_SCORES: tuple[Entry, ...] = (
    _line("float*", "max_scores", comment="(B, H, q_len): row max of the modded scores, natural units; -inf: none"),
)


# Only in forward kernels built to split the keys of a query tile over several CTAs (spec option "split_kv",
# templates/sm80/fwd.cu.j2), after the members above.
SPLIT_KV: tuple[Entry, ...] = (
    "Split keys (runtime/split_kv.py): CTA x walks the part x % kv_splits of its query tile's KV tiles and, with",
    "more than one part, writes its O (normalised by its own row sums) and lse there; fwd_combine merges them.",
    "A tile's row R is query row R % q_len of head blockIdx.y * packed_heads + R / q_len.",
    _line("int", "kv_splits", comment="parts per query tile; 1: O and lse written directly"),
    _line("int", "packed_heads", comment="query heads whose rows share a tile (GQA: up to kv_group; else 1)"),
    _line("float*", "o_part", comment="(kv_splits, B, H, q_len, D) fp32"),
    _line("float*", "lse_part", comment="(kv_splits, B, H, q_len), natural log; -inf: the part saw nothing"),
)

TENSOR_MAP_ALIGN = 64  # alignof(TensorMap), templates/sm90/tma.cuh


def _optional(dropout: bool, max_scores: bool, split_kv: bool = False) -> tuple[Entry, ...]:
    return (DROPOUT if dropout else ()) + (MAX_SCORES if max_scores else ()) + (SPLIT_KV if split_kv else ())


# The inputs (pointers each: one declaration per line) and the score scale, in both main kernels.
_QKV = (_line("const half_bits*", "q"), _line("const half_bits*", "k"), _line("const half_bits*", "v"))
_SCALES = (_line("float", "scale", comment="applied to q.k before score_mod"),
           _line("float", "scale_log2", comment="scale * log2(e), used when there is no score_mod"))

# The forward kernels' parameter (both families).
FWD_PARAMS = ParamStruct("FwdParams", (
    *_QKV,
    _line("half_bits*", "o"),
    _line("float*", "lse", comment="(B, H, q_len), natural log"),
    _strides("q"), _strides("k"), _strides("v"), _strides("o"),
    _line("int", "q_len", "kv_len", "num_heads", "kv_group", comment="kv_group = query heads per KV head (GQA)"),
    *_SCALES,
    *_mask_lists("kv", "q", ("Block mask in PyTorch's layout: per (b, h, q block) a count and a list of KV blocks,",
                             "\"partial\" ones (mask_mod applies) and \"full\" ones (it does not). A zero stride broadcasts.")),
    _line("int", "has_block_mask", comment="0: every KV tile is visited, as a full tile"),
    _line("int", "mask_q_block", "mask_kv_block", comment="block-mask granularity in tokens"),
    _line("int", "batch", comment="B (the sm90 forward walks B x H x query tiles, sm90/work_order.cuh)"),
    _line("int", "head_chunk", comment="sm90: (batch, head) pairs whose tiles interleave (their K/V fit in L2)"),
    _line("const int*", "m_order", comment="sm90: query tiles heaviest first (null: later ones are heavier)"),
    _line("int*", "tile_counter", comment="sm90: work tiles drawn so far; zero between launches"),
), map_names=("q_map", "k_map", "v_map", "o_map"))

# The main backward kernel's parameter (both families).
BWD_PARAMS = ParamStruct("BwdParams", (
    *_QKV,
    _line("const half_bits*", "dout", comment="dO, same layout rules as q"),
    "lse and delta: (B, H, q_len_padded) fp32 from bwd_preprocess, rows past q_len 0 (the sm90 kernel copies a",
    "step's rows of each with one bulk copy, which wants 16-byte aligned addresses and sizes).",
    _line("const float*", "lse_log2", comment="the forward's lse times log2(e); +inf: row saw nothing"),
    _line("const float*", "delta", comment="rowsum(dO * O)"),
    "dQ's fp32 accumulator, not yet scaled; null: dQ not wanted. (splits, B, H, q_len, D), or in the sm90 kernel's",
    "80-row steps (B, H, q_len_padded, D) in the fragment order of sm90/bwd.cu.j2.",
    _line("float*", "dq_accum"),
    _line("half_bits*", "dk", comment="(B, H_kv, kv_len, D); null: not wanted"),
    _line("half_bits*", "dv", comment="(B, H_kv, kv_len, D); null: not wanted"),
    _strides("q"), _strides("k"), _strides("v"), _strides("do"), _strides("dk"), _strides("dv"),
    _line("long long", "dq_split_stride",
          comment="elements between the dQ partials of two splits (deterministic mode)"),
    _line("long long", "grad_slot_stride",
          comment="deterministic mode: elements between two warps' copies of the buffer gradients"),
    _line("int", "q_len", "kv_len", "num_heads", "kv_group",
          comment="num_heads = query heads; kv_group = query heads per KV head"),
    _line("int", "q_len_padded", comment="rows per (b, h) of lse and delta: q_len rounded up to 128"),
    *_SCALES,
    *_mask_lists("q", "kv", ("The block mask's transposed lists: per (b, h, KV block) a count and a list of query",
                             "blocks, \"partial\" ones (mask_mod applies) and \"full\" ones. A zero stride broadcasts.")),
    _line("int", "has_block_mask", comment="0: every query tile is visited, as a full tile"),
    _line("int", "mask_q_block", "mask_kv_block", comment="block-mask granularity in tokens"),
    _line("int", "num_kv_tiles", comment="CTA x handles KV tiles x, x + gridDim.x, ... (one, unless deterministic)"),
    _line("int", "persistent", comment="sm90: a 1-D grid; CTA x walks work tiles x, x + gridDim.x, ... of"),
    _line("int", "batch", "kv_heads", comment="  (KV tile, KV head, batch), the KV tile fastest"),
    _line("const int*", "kv_turns",
          comment="sm90 persistent, null or: the work tile of CTA c at turn t at [c + t * gridDim.x], -1: no more"),
), map_names=("q_map", "k_map", "v_map", "do_map", "dq_map", "dk_map", "dv_map"))

# sm80/bwd_preprocess.cu.j2: delta = rowsum(dO * O) and lse in log2 units, both padded (see BwdParams), and a zeroed
# dQ accumulator.
BWD_PRE_PARAMS = ParamStruct("BwdPreParams", (
    _line("const half_bits*", "o", comment="forward output (B, H, q_len, D)"),
    _line("const half_bits*", "dout", comment="its gradient, same shape"),
    _line("const float*", "lse", comment="the forward's (B, H, q_len), contiguous"),
    _line("float*", "lse_log2", comment="(B, H, q_len_padded) out: lse * log2(e), +inf for -inf, 0 past q_len"),
    _line("float*", "delta", comment="(B, H, q_len_padded) out, rows past q_len 0"),
    "dQ's accumulator, zeroed here; null: dQ not wanted. (splits, B, H, q_len, D) fp32, or with the option dq_width",
    "(B, H, q_len_padded, dq_width) (the sm90 backward's fragment order).",
    _line("float*", "dq_accum"),
    _strides("o"), _strides("do"),
    _line("long long", "dq_split_stride", comment="elements between two splits' dQ partials"),
    _line("int", "q_len", "q_len_padded", "num_heads", "num_splits"),
))

# sm80/bwd_postprocess.cu.j2: dQ = scale * the sum of the accumulator's partials, in the input dtype.
BWD_POST_PARAMS = ParamStruct("BwdPostParams", (
    "dQ's accumulator, unscaled: (splits, B, H, q_len, D) fp32, or with the option dq_fragments (B, H, q_len_padded,",
    "width) in the sm90 backward's fragment order.",
    _line("const float*", "dq_accum"),
    _line("half_bits*", "dq", comment="(B, H, q_len, D) out"),
    _strides("dq"),
    _line("long long", "dq_split_stride", comment="elements between two splits' partials"),
    _line("int", "q_len", "q_len_padded", "num_heads", "num_splits"),
    _line("float", "scale"),
))

# sm80/fwd_combine.cu.j2: O and lse of a forward whose keys were split (SPLIT_KV above), from the parts.
FWD_COMBINE_PARAMS = ParamStruct("FwdCombineParams", (
    _line("const float*", "o_part", comment="(splits, B, H, q_len, D) fp32, each part normalised by its own sums"),
    _line("const float*", "lse_part", comment="(splits, B, H, q_len), natural log"),
    _line("half_bits*", "o", comment="(B, H, q_len, D) out"),
    _line("float*", "lse", comment="(B, H, q_len) out"),
    _strides("o"),
    _line("long long", "part_rows", comment="B * H * q_len: rows between two parts"),
    _line("int", "q_len", "num_heads", "num_splits"),
    _line("int", "part_groups", comment="thread groups a row's parts are dealt to (a power of 2)"),
))

PARAM_STRUCTS = {s.name: s for s in (FWD_PARAMS, BWD_PARAMS, BWD_PRE_PARAMS, BWD_POST_PARAMS, FWD_COMBINE_PARAMS)}
