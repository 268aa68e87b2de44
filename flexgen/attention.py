"""`flexgen.flex_attention`: a drop-in for torch.nn.attention.flex_attention.flex_attention.

The public entry point: arguments are checked here, before any kernel is looked up or launched, and
the call goes to the custom op flexgen::attention_fwd (flexgen/ops.py). Planning (the kernel's spec)
and launching live in flexgen/runtime.
"""
from __future__ import annotations

import sys

import torch

from . import eager_plans
from .blockmask import LARGE_BLOCK_SIZE, BlockMask, sliced_mask_mod
from .blockmask_follow import adopt_if_lists_follow
from .cache.paths import background_compile
from .codegen.options import call_options
from .codegen.spec import HEAD_DIMS
from .compiled_options import constant_options
from .dynamo_marks import assume_constant_result
from .runtime.call_checks import (UNFUSED_DTYPES, check_block_mask_shape, check_grid, check_scale, hand_made_blocks_reason,
                                  unfused_notice, unfused_reason)
from .runtime.plan import DTYPES
from .warnings_once import warn_once_key

try:  # PyTorch's own classes where the installed torch has them, so isinstance and field access match
    from torch.nn.attention.flex_attention import AuxOutput, AuxRequest
except ImportError:  # torch before 2.9
    from typing import NamedTuple

    class AuxRequest(NamedTuple):
        """Which auxiliary outputs flex_attention returns beside out."""

        lse: bool = False
        max_scores: bool = False

    class AuxOutput(NamedTuple):
        """flex_attention's auxiliary outputs; None where not requested."""

        lse: torch.Tensor | None = None
        max_scores: torch.Tensor | None = None


class DtypeMismatchError(ValueError, TypeError):
    """Query, key and value of different dtypes: a ValueError, as PyTorch's FlexAttention raises
    (its message too); also a TypeError, which flexgen raised before."""


def _check_inputs(query, key, value, enable_gqa: bool) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:  # (as PyTorch's flex_attention, which dropped them)
            raise NotImplementedError(f"flex_attention does not support NestedTensor inputs ({name} is one): it takes "
                                      "dense (B, H, L, D) tensors; pack the sequences into one and mask across them "
                                      "(a document mask)")
        if t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must have shape (B, H, L, D), got {tuple(t.shape)}")
    if query.device.type not in ("cuda", "meta", "cpu"):  # meta: shapes only (the ops' fake kernels)
        raise ValueError(f"flex_attention: tensors on {query.device}; flexgen runs on CUDA devices (and, unfused, on the CPU)")
    if not (query.device == key.device == value.device):
        raise ValueError(f"flex_attention: Expected query, key, and value to have the same device type, but got "
                         f"query.device: {query.device}, key.device: {key.device}, and value.device: {value.device} "
                         "instead (they must be on one device)")
    mixed = not (query.dtype == key.dtype == value.dtype)
    if mixed and (key.dtype != value.dtype or not key.dtype.is_floating_point):
        # (PyTorch takes key / value of another precision than the query's, float8 among them; flexgen runs such
        # calls on its unfused path, and the output has the query's dtype)
        raise DtypeMismatchError(
            "flex_attention: Expected query, key, and value to have the same dtype, but got "
            f"query.dtype: {query.dtype}, key.dtype: {key.dtype}, and value.dtype: {value.dtype} instead "
            "(or key and value of one floating dtype unlike the query's, which run unfused)"
        )
    if query.dtype not in DTYPES and query.dtype not in UNFUSED_DTYPES:
        raise TypeError(f"flex_attention: dtype {query.dtype} is not supported; use torch.bfloat16 or torch.float16 "
                        "(the generated kernels), or torch.float32 / torch.float64 (the unfused path)")
    bq, hq, _, d = query.shape
    bk, hk, lk, dk = key.shape
    bv, hv, lv, dv = value.shape
    if bk != bv or not (bk == 1 or bk == bq):  # (not `in`: dynamo misjudges it on symbolic sizes)
        raise ValueError(f"flex_attention: batch sizes differ: query {bq}, key {bk}, value {bv}; key and value need "
                         "the query's batch size, or 1 to share one key/value across the batch")
    if hk != hv or lk != lv:
        raise ValueError(f"flex_attention: key {tuple(key.shape)} and value {tuple(value.shape)} must agree in heads and length")
    if d != dk:
        raise ValueError(f"flex_attention: query and key head dims differ: {d} and {dk}")
    if hq != hk:
        if not enable_gqa:
            raise ValueError(f"flex_attention: query has {hq} heads and key/value {hk}; pass enable_gqa=True for grouped-query attention")
        if hq % hk:
            raise ValueError(f"flex_attention: query heads ({hq}) must be a multiple of key/value heads ({hk}) for GQA")
    if query.shape[2] == 0 or lk == 0:
        raise ValueError(f"flex_attention: Query length must be greater than 0, and so must the key / value length "
                         f"(as in PyTorch); got {query.shape[2]} and {lk}")
    check_grid(bq, hq)


def _refuse_sliced_mask(block_mask) -> None:
    """A sliced BlockMask (flexgen's or PyTorch's) has a stub for its mask_mod: say so before any length check, as
    PyTorch does."""
    stub = getattr(block_mask, "mask_mod", None)
    if stub is sliced_mask_mod or getattr(stub, "__name__", "") == "_sliced_mask_mod_error":
        raise RuntimeError("flex_attention: Cannot use mask_mod from a sliced BlockMask: this BlockMask was sliced "
                           "(block_mask[...]); set its mask_mod to one written for the slice, or build a new mask")


def _leaves_for_unfused(reason: str, dropout_p: float) -> bool:
    """For a call that `reason` keeps off the generated kernels: refuses dropout, which the unfused path has not,
    and says whether the call takes that path now (eager calls; under torch.compile the ops run it)."""
    if dropout_p > 0.0:
        raise ValueError(f"flex_attention: dropout needs the generated kernels (bf16 / fp16 CUDA tensors, head dims "
                         f"{HEAD_DIMS}); {reason} run on the unfused path, which has none")
    return not torch.compiler.is_compiling()


def _unfused_attention(reason: str, query, key, value, score_mod, block_mask, scale, enable_gqa: bool, return_lse: bool,
                       dropout_p: float, return_aux):
    bm = BlockMask.from_torch(block_mask).for_batch_and_heads(*query.shape[:2]) if block_mask is not None else None
    if bm is not None:  # the checks the kernels' path makes, with the same messages
        check_block_mask_shape(bm.seq_lengths, bm.kv_num_blocks, query, key)
    unfused_notice(reason, stacklevel=4)
    from .dsl.reference import reference_outputs

    run = reference_outputs
    if torch.compiler.is_compiling():  # a graph break: dynamo need not trace the chunked loops
        run = torch.compiler.disable(reference_outputs, reason="flexgen's unfused path runs eagerly")
    out, lse, row_max = run(query, key, value, score_mod, None, scale, enable_gqa, bm)
    from .ops import _in_layout_of

    out = _in_layout_of(out, query)  # the query's dimension order, as the kernels' output and PyTorch's have it
    return _as_requested(out, lse, row_max, return_lse, return_aux)


def _as_requested(out, lse, row_max, return_lse: bool, return_aux):
    """flex_attention's result: out; (out, lse) with return_lse; (out, AuxOutput) with return_aux."""
    if return_aux is not None:
        return out, AuxOutput(lse=lse if return_aux.lse else None, max_scores=row_max if return_aux.max_scores else None)
    return (out, lse) if return_lse else out


def _check_mods(score_mod, block_mask) -> None:
    """A BlockMask in score_mod's place, or a function in block_mask's: say where each belongs."""
    if _is_block_mask(score_mod):
        raise TypeError("flex_attention: a BlockMask was passed as score_mod; pass it as block_mask=")
    if block_mask is not None and not _is_block_mask(block_mask):
        raise TypeError(
            f"flex_attention: block_mask must be a BlockMask, got {type(block_mask).__name__}; build one with "
            "create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN), or pass a score-modifying function as score_mod="
        )


def _without_unbounded_block(block_mask, query, key):
    """PyTorch's empty block mask (one block of LARGE_BLOCK_SIZE tokens, built for lengths (1, 1)) holds at any
    length: without an element mask it is no block mask at all, and with one it is rebuilt for these lengths."""
    if block_mask is None or tuple(block_mask.BLOCK_SIZE) != (LARGE_BLOCK_SIZE, LARGE_BLOCK_SIZE):
        return block_mask
    from .make_block_mask import create_block_mask
    from .variant import mod_parts

    mask_mod = getattr(block_mask, "mask_mod", None)
    parts = mod_parts(mask_mod, "mask", query.device) if mask_mod is not None else ("", ())
    if parts is not None and parts[0] == "":
        return None
    return create_block_mask(mask_mod, query.shape[0], query.shape[1], query.shape[-2], key.shape[-2],
                             device=query.device)


def _is_block_mask(x) -> bool:
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    return isinstance(x, (BlockMask, TorchBlockMask))


@assume_constant_result
def _checked_options(kernel_options) -> tuple:
    """kernel_options checked (codegen/options.py), as sorted pairs; run at trace time under torch.compile,
    so that the one warning for an option PyTorch has and flexgen ignores is Python's, not dynamo's. Also
    where the eager fallback is made: this runs for real before any trace of flex_attention reaches it."""
    if _flex_attention_eager is None and "torch._dynamo" in sys.modules:
        _make_eager_fallback()
    return tuple(sorted(call_options(kernel_options).items()))


def _broadcast_kv_batch(query, key, value):
    """A key/value batch of 1 beside a larger query batch: stride-0 views of the query's batch size, no
    copy. The kernels read K and V through their batch stride (0 here), and autograd sums dK, dV over
    the broadcast batch (expand's backward)."""
    if key.shape[0] == 1 and query.shape[0] > 1:
        b = query.shape[0]
        key, value = key.expand(b, *key.shape[1:]), value.expand(b, *value.shape[1:])
    return key, value


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
    dropout_p: float | None = None,
    *,
    return_aux: AuxRequest | None = None,
):
    """Attention with a user score_mod and block mask, through generated FlashAttention kernels.

    Same arguments, shapes (B, H, L, D) and semantics as torch's flex_attention:
    score = q.k * scale (default 1/sqrt(D)), then score_mod(score, b, h, q_idx, kv_idx),
    then the block mask's mask_mod, softmax, times value. Returns out; (out, lse) with
    return_lse=True; (out, AuxOutput(lse=..., max_scores=...)) with return_aux=AuxRequest(lse=...,
    max_scores=...). lse is in natural log and carries a gradient; max_scores is the row max of the
    modded, scaled scores (-inf for a row that sees nothing), without a gradient. Key and value may have batch size 1 beside a larger
    query batch (shared across it, without a copy). Outputs keep their input's dimension order. Fully masked rows give 0 and lse = -inf. `dropout_p` drops
    attention probabilities as given (pass 0.0 for evaluation), like SDPA's.

    bfloat16 / float16 CUDA tensors with a head dim the kernels have run on the generated kernels; other inputs
    (float32 / float64, CPU tensors, other head dims) on the unfused float64 path (reference_attention), with
    a warning (no dropout there).

    Runs through the torch.library ops flexgen::attention_fwd / attention_bwd
    (flexgen/ops.py), so torch.compile(fullgraph=True) traces through it; an eager call on
    plain CUDA tensors takes the ops' twin without the dispatcher (ops._EagerAttention).

    >>> from flexgen import flex_attention, create_block_mask
    >>> causal = lambda b, h, q, kv: q >= kv
    >>> mask = create_block_mask(causal, None, None, 4096, 4096)
    >>> out = flex_attention(q, k, v, score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30), block_mask=mask)
    """
    plan_key, user_mask = None, block_mask
    if not torch.compiler.is_compiling():  # a call planned before runs its plan (eager_plans.py)
        plan_key = eager_plans.signature(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                         kernel_options, dropout_p, return_aux)
        plan = None if plan_key is None else eager_plans.find(plan_key, score_mod, block_mask)
        if plan is not None and plan.route_ok():
            return _as_requested(*plan.run(query, *_broadcast_kv_batch(query, key, value)), return_lse, return_aux)
    from .dropout import check_dropout_range
    from .ops import attention_eager, attention_fwd, default_scale, eager_route_ok, mask_tensors
    from .variant import mod_parts, variant_key

    _check_inputs(query, key, value, enable_gqa)
    _check_mods(score_mod, block_mask)
    _refuse_sliced_mask(block_mask)
    block_mask = _without_unbounded_block(block_mask, query, key)
    check_scale(scale)
    # (None by default rather than 0.0: a float default becomes a symbolic input under torch.compile(dynamic=True),
    # and dynamo then traces the whole call a second time)
    dropout_p = 0.0 if dropout_p is None else dropout_p
    check_dropout_range(dropout_p)
    if return_lse and return_aux is not None:
        raise ValueError("flex_attention: Cannot specify both return_lse and return_aux: pass "
                         "return_aux=AuxRequest(lse=True) or return_lse=True, not both (return_lse is deprecated)")
    if return_lse and not torch.compiler.is_compiling():  # (a warning would break a compiled graph)
        warn_once_key("deprecated_return_lse", "flex_attention: return_lse is deprecated, as in PyTorch; use "
                      "return_aux=AuxRequest(lse=True)", FutureWarning, stacklevel=2)
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        raise TypeError(f"flex_attention: return_aux must be an AuxRequest, got {type(return_aux).__name__}")
    if kernel_options and torch.compiler.is_compiling():
        kernel_options = constant_options(kernel_options)
    kernel_options = dict(_checked_options(kernel_options))
    key, value = _broadcast_kv_batch(query, key, value)
    reason = unfused_reason(query, value)
    if reason is not None and _leaves_for_unfused(reason, dropout_p):
        return _unfused_attention(reason, query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                  dropout_p, return_aux)
    bm = BlockMask.from_torch(block_mask).for_batch_and_heads(*query.shape[:2]) if block_mask is not None else None
    if bm is not None:  # here, not only in the ops: they take the lengths from the inputs
        check_block_mask_shape(bm.seq_lengths, bm.kv_num_blocks, query, key)
    score_parts = mod_parts(score_mod, "score", query.device)
    mask_parts = mod_parts(bm.mask_mod, "mask", query.device) if bm is not None else ("", ())
    if bm is not None and mask_parts is not None:  # (PyTorch's create_block_mask's lists follow their mask_mod)
        bm = adopt_if_lists_follow(bm, *mask_parts)
    if bm is not None and reason is None:
        reason = hand_made_blocks_reason(_static_block_size(bm), bm.blocks_follow_mask_mod)
        if reason is not None and _leaves_for_unfused(reason, dropout_p):
            return _unfused_attention(reason, query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                      dropout_p, return_aux)
    if reason is not None:
        if score_parts is None or mask_parts is None:  # mods the tracer cannot take: a graph break
            return _unfused_attention(reason, query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                      dropout_p, return_aux)
        # traced mods: the custom ops below, whose implementation runs the unfused path (no graph break)
    elif score_parts is None or mask_parts is None:
        return _flex_attention_eager(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse,
                                     kernel_options, dropout_p, return_aux=return_aux)
    (score_token, score_buffers), (mask_token, mask_buffers) = score_parts, mask_parts
    variant = variant_key(score_token, mask_token, _static_block_size(bm), kernel_options,
                          bm is not None and bm.blocks_follow_mask_mod)
    buffers = [*score_buffers, *mask_buffers]
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and background_compile():
        _compile_backward_early(variant, query, key, value, buffers, bm, dropout_p)
    if scale is None:
        # The ops work out 1/sqrt(D) themselves: computed here, under torch.compile(dynamic=True) it would be a
        # symbolic float of the head dim, which makes dynamo trace the whole call a second time.
        scale = default_scale()
    elif scale < 0:
        # The kernels fold a positive scale into exp2 after the row max; (-q).k * -scale is the same score.
        query, scale = -query, -scale
    elif scale == 0:
        # (0 q).k * 1 is the same score, and a kernel may divide by the scale (an affine score_mod's column step).
        query, scale = query * 0, 1.0
    want_max = return_aux is not None and bool(return_aux.max_scores)
    args = (mask_tensors(bm), buffers, float(scale), variant, float(dropout_p), _dropout_rng(dropout_p), want_max,
            reason is not None)
    if eager_route_ok(query, key, value, buffers):
        if plan_key is not None and reason is None and dropout_p == 0.0 and query.numel() > 0:
            plan = _plan(plan_key, query, key, value, args, score_mod, user_mask, (score_buffers, mask_buffers))
            return _as_requested(*plan.run(query, key, value), return_lse, return_aux)
        out, lse, row_max = attention_eager(query, key, value, *args)
    else:
        masks, *rest = args
        out, lse, row_max = attention_fwd(query, key, value, *masks, *rest)
    return _as_requested(out, lse, row_max, return_lse, return_aux)


def _plan(plan_key: tuple, query, key, value, op_args: tuple, score_mod, block_mask, mod_buffers: tuple):
    """The plan of a checked eager call (op_args: attention_eager's arguments after q, k, v; mod_buffers: the
    score_mod's and the mask_mod's buffer tensors), kept for the calls with its signature where the mods' buffers
    can be found from them again."""
    from . import ops
    from .ops import eager_plan_parts, records_grad

    masks, buffers, scale, variant, _, _, want_max, _ = op_args
    launch, call = eager_plan_parts(query, key, value, masks, buffers, scale, variant, want_max)
    score_buffers, mask_buffers = mod_buffers
    paths = (eager_plans.buffer_paths(score_mod, score_buffers),
             eager_plans.buffer_paths(getattr(block_mask, "mask_mod", None), mask_buffers))
    plan = eager_plans.EagerPlan(launch, call, tuple(buffers), records_grad(query, key, value, buffers),
                                 route_ok=lambda: ops.no_modes_active(),  # (looked up per call)
                                 paths=paths, score_buffers=len(score_buffers))
    if None not in paths:
        eager_plans.keep(plan_key, plan, score_mod, block_mask)
    return plan


def _static_block_size(bm: BlockMask | None) -> tuple[int, int] | None:
    """The mask's BLOCK_SIZE as plain ints (kernels are built for one block size, and the variant key is a
    constant of the graph)."""
    return None if bm is None else (_constant_int(bm.BLOCK_SIZE[0]), _constant_int(bm.BLOCK_SIZE[1]))


def _constant_int(n) -> int:
    """n, specialized: under torch.compile(dynamic=True) the ints of a mask the compiled function captures are
    symbolic, and int() keeps them so. Each bit tested below is a guard on n, so the sum is a constant. (n is a
    block size, below 2**31.)"""
    if not torch.compiler.is_compiling():
        return int(n)
    return sum(1 << i for i in range(31) if n // (1 << i) % 2)


def _compile_backward_early(variant_key: str, query, key, value, buffers, bm, dropout_p: float) -> None:
    """A call that will need a backward: its backward kernels start compiling now, beside the
    forward (runtime/prefetch.py); a no-op once they have been started."""
    wants = [i for i, t in enumerate(buffers) if t.requires_grad]
    if not (wants or query.requires_grad or key.requires_grad or value.requires_grad):
        return
    from .runtime import prefetch
    from .variant import variant

    call_key = (variant_key, query.dtype, query.shape[-1], query.device, tuple(wants), dropout_p > 0)
    if call_key in prefetch.seen:
        return
    var = variant(variant_key)
    names = (var.score.buffer_names if var.score is not None else ()) + (var.mask.buffer_names if var.mask is not None else ())
    prefetch.backward_kernels(call_key, query, var.score, var.mask, var.kernel_options, dropout_p > 0,
                              tuple(names[i] for i in wants), tuple(bm.BLOCK_SIZE) if bm is not None else None)


# torch.compiler.disable(flex_attention): made by _checked_options once dynamo is loaded (making it at import
# would import dynamo, which an eager call does not need).
_flex_attention_eager = None


def _make_eager_fallback() -> None:
    global _flex_attention_eager
    _flex_attention_eager = torch.compiler.disable(flex_attention, reason=_EAGER_REASON)
    from .captures import keep_path_search_out_of_traces

    keep_path_search_out_of_traces()


_EAGER_REASON = (
    "flexgen.flex_attention: a score_mod/mask_mod defined inside the compiled function captures values made there "
    "(tensors, modules, sizes of traced tensors), which dynamo cannot hand to flexgen's tracer; define it outside "
    "(in __init__ or at module level, capturing numbers as plain Python values) or "
    "pass a flexgen Mod (flexgen.score_mod(fn) built outside) to trace it with fullgraph=True"
)
