"""flexgen attention as torch.library custom ops, so torch.compile(fullgraph=True) traces through it.

    flexgen::attention_fwd  (q, k, v, <8 block-mask tensors>, buffers, scale, variant, dropout_p, rng,
                             return_max, unfused) -> (out, lse, max_scores (empty unless return_max))
    flexgen::attention_bwd  (q, k, v, out, lse, grad_out, grad_lse, <8 block-mask tensors>, buffers, scale,
                             variant, dropout_p, rng, need_q, need_k, need_v, buffer_grads, unfused)
                            -> (dq, dk, dv, [d buffer for each index in buffer_grads])

Ops carry only tensors and primitives: `variant` names an entry of flexgen.variant's registry
(traced Mods, BLOCK_SIZE, kernel_options; a block mask's lengths are the inputs'); a negative `scale` (default_scale()) stands for 1/sqrt(D). `rng` is a CPU int64 tensor
(seed, offset) for dropout, or None. Gradients nobody needs come back as empty tensors,
and the kernels do no work for them.

Inputs the kernels do not take (call_checks.unfused_reason: CPU tensors, float32 / float64, other head
dims) reach the ops only under torch.compile, so that the graph has no break, with `unfused` set: the
implementation then runs the unfused float64 path, and the backward differentiates that path.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .blockmask import BlockMask
from .codegen.options import call_options
from .runtime import backward as _backward_pass, forward as _forward_pass
from .runtime.call_checks import (check_block_grid, check_grid, check_scale, empty_like_layout, row_major,
                                  unfused_notice, unfused_reason)
from .runtime.plan import make_spec
from .variant import _VARIANTS, variant


def default_scale() -> float:
    """The `scale` an op gets for "1/sqrt(head dim)", which flex_attention passes when the caller gave none. A
    negative scale never reaches the ops otherwise: flex_attention moves its sign onto the query. (A function
    rather than a module constant: under torch.compile(dynamic=True) a global float becomes a symbolic input.)"""
    return -1.0


def resolve_scale(scale: float, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale < 0 else scale


MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
               "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


def mask_tensors(bm: BlockMask | None) -> tuple:
    return tuple(getattr(bm, f) for f in MASK_FIELDS) if bm is not None else (None,) * len(MASK_FIELDS)


def _block_mask(v, tensors, q: Tensor, k: Tensor, mask_mod=None) -> BlockMask | None:
    """The call's block mask; its lengths are the inputs' (flex_attention checked them against the mask's)."""
    if tensors[0] is None:
        return None
    bm = BlockMask((q.shape[2], k.shape[2]), *tensors, v.block_size, mask_mod)
    return bm.derived_from_mask_mod() if v.blocks_follow_mask else bm


def _reference(q, k, v, masks, buffers, scale, var):
    """(out, lse, max_scores) of the unfused path for the op's arguments."""
    from .dsl.reference import reference_outputs

    score, mask = var.bind(buffers)
    bm = _block_mask(var, masks, q, k, mask)
    return reference_outputs(q, k, v, score, None if bm is not None else mask, scale, q.shape[1] != k.shape[1], bm)


def _dropout_kwargs(dropout_p: float, rng: Tensor | None) -> dict:
    """Passed on only when dropout is on, so the dropout-free kernels and calls stay as they are."""
    if dropout_p == 0.0:
        return {}
    seed, offset = rng.tolist()
    return {"dropout_p": dropout_p, "philox": (int(seed), int(offset))}


@torch.library.custom_op("flexgen::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor, k: Tensor, v: Tensor,
    kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
    full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
    q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor],
    full_q_num_blocks: Optional[Tensor], full_q_indices: Optional[Tensor],
    buffers: list[Tensor], scale: float, variant_key: str, dropout_p: float, rng: Optional[Tensor],
    return_max: bool, unfused: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    masks = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
             q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    return _forward(q, k, v, masks, buffers, scale, variant_key, dropout_p, rng, return_max, unfused)


def _forward(q, k, v, masks, buffers, scale, variant_key, dropout_p, rng, return_max, unfused=False):
    scale = resolve_scale(scale, q)
    var = variant(variant_key)
    if unfused:
        unfused_notice(unfused_reason(q, v) or "these inputs")
        out, lse, row_max = _reference(q, k, v, masks, buffers, scale, var)
        return _in_layout_of(out, q), lse, row_max if return_max else q.new_empty(0, dtype=lse.dtype)
    score, mask = var.bind(buffers)
    bm = _block_mask(var, masks, q, k)
    extra = {"max_scores": True} if return_max else {}
    outputs = _forward_pass.forward_call(q, k, v, score, bm, mask, scale, var.kernel_options,
                                         **_dropout_kwargs(dropout_p, rng), **extra)
    out = _in_layout_of(outputs[0], q)
    return out, outputs[1], outputs[2] if return_max else q.new_empty(0, dtype=torch.float32)


def _in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """t laid out as the fake kernels promise (like's dimension order): the launchers allocate it so; a
    result that is not (a stand-in implementation's, say) is copied, so compiled code reading the fake
    strides reads the right elements."""
    if t.numel() == 0 or (row_major(like) and row_major(t)):
        return t
    want = empty_like_layout(like, t.shape, t.dtype)
    if t.stride() == want.stride():
        return t
    return want.copy_(t)


@attention_fwd.register_fake
def _(q, k, v, *mask_and_rest):
    return_max, unfused = mask_and_rest[13], mask_and_rest[14]
    check_traced_call(q, k, mask_and_rest[:8], mask_and_rest[9], mask_and_rest[10], return_max, mask_and_rest[11] > 0,
                      unfused)
    b, h, lq, _ = q.shape
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # (the unfused path's, for float64)
    row_max = q.new_empty((b, h, lq) if return_max else (0,), dtype=lse_dtype)
    # (v's head dim: the kernels take only v's equal to q's; the unfused path any)
    return empty_like_layout(q, (b, h, lq, v.shape[-1])), q.new_empty((b, h, lq), dtype=lse_dtype), row_max


def check_traced_call(q: Tensor, k: Tensor, mask_tensors: tuple, scale: float, variant_key: str,
                      return_max: bool = False, dropout: bool = False, unfused: bool = False) -> None:
    """What the eager call checks before any launch, checked again where torch.compile traces the op (its fake
    kernel): the scale, the grid, the block mask against the inputs, the kernel options, and where the device
    has an architecture (a real or fake CUDA tensor, not a meta one) the kernel's plan itself."""
    check_scale(scale)
    check_grid(q.shape[0], q.shape[1])
    var = _VARIANTS.get(variant_key)
    if var is None:  # a key not made by flex_attention (the op called directly): nothing more to check
        return
    bm = _block_mask(var, mask_tensors, q, k)
    if bm is not None:
        check_block_grid(bm, q, k)
    options = call_options(var.kernel_options)
    if q.device.type == "cuda" and not unfused:
        spec = make_spec("fwd", q, var.score, var.mask, options, dropout=dropout, mask_block=var.block_size,
                         max_scores=return_max, blocks_follow_mask=var.blocks_follow_mask, kv_heads=k.shape[1],
                         kv_len=k.shape[2])
        if bm is not None:
            _forward_pass.check_block_tiles(bm, spec)  # (the grid was checked above)


@torch.library.custom_op("flexgen::attention_bwd", mutates_args=())
def attention_bwd(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, grad_lse: Optional[Tensor],
    kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
    full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor],
    q_num_blocks: Optional[Tensor], q_indices: Optional[Tensor],
    full_q_num_blocks: Optional[Tensor], full_q_indices: Optional[Tensor],
    buffers: list[Tensor], scale: float, variant_key: str, dropout_p: float, rng: Optional[Tensor],
    need_q: bool, need_k: bool, need_v: bool, buffer_grads: list[int], unfused: bool,
) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
    masks = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
             q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    dq, dk, dv, grads = _backward_impl(q, k, v, out, lse, grad_out, grad_lse, masks, buffers, scale, variant_key,
                                       dropout_p, rng, (need_q, need_k, need_v), buffer_grads, unfused)
    return (_or_empty(dq, q), _or_empty(dk, q), _or_empty(dv, q), grads)


def _backward_impl(q, k, v, out, lse, grad_out, grad_lse, masks, buffers, scale, variant_key, dropout_p, rng,
                   need, buffer_grads, unfused=False):
    """(dq, dk, dv, [gradient of buffers[i] for i in buffer_grads]); None for a gradient not needed."""
    scale = resolve_scale(scale, q)
    var = variant(variant_key)
    if unfused:
        return _unfused_backward(q, k, v, grad_out, grad_lse, masks, buffers, scale, var, need, buffer_grads)
    score, mask = var.bind(buffers)
    bm = _block_mask(var, masks, q, k)
    wanted = _wanted_names(score, mask, buffer_grads)
    grads = _backward_pass.backward_call(
        q, k, v, out, lse, grad_out, score, bm, mask, scale, var.kernel_options, need,
        grad_buffers=wanted, grad_lse=grad_lse, **_dropout_kwargs(dropout_p, rng),
    )
    return _as_returned(grads, q, k, v, wanted)


def _wanted_names(score, mask, buffer_grads) -> tuple[str, ...]:
    """The names of the buffers whose gradients are wanted (buffer_grads: their indices among the mods' buffers)."""
    names = _buffer_names(score, mask)
    return tuple(names[i] for i in buffer_grads)


def _as_returned(grads: tuple, q: Tensor, k: Tensor, v: Tensor, wanted: tuple[str, ...]):
    """A backward's (dq, dk, dv, {name: buffer gradient}) as the ops return it: each gradient in its input's layout,
    the buffers' gradients as a list in `wanted`'s order."""
    dq, dk, dv, by_name = grads
    dq, dk, dv = (None if g is None else _in_layout_of(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
    return dq, dk, dv, [by_name[n] for n in wanted]


def _unfused_backward(q, k, v, grad_out, grad_lse, masks, buffers, scale, var, need, buffer_grads):
    """The unfused path's gradients: the vector-Jacobian product of its forward (torch.func, which differentiates
    inside an op's implementation, where autograd itself is switched off)."""
    wrt = [i for i, n in enumerate(need) if n]
    n_qkv = len(wrt)

    def forward(*xs):
        qkv, bufs = [q, k, v], list(buffers)
        for i, x in zip(wrt, xs[:n_qkv]):
            qkv[i] = x
        for i, x in zip(buffer_grads, xs[n_qkv:]):
            bufs[i] = x
        out, lse, _ = _reference(*qkv, masks, bufs, scale, var)
        return out, lse

    primals = [(q, k, v)[i] for i in wrt] + [buffers[i] for i in buffer_grads]
    (out, lse), vjp = torch.func.vjp(forward, *primals)
    got = list(vjp((grad_out.to(out.dtype), torch.zeros_like(lse) if grad_lse is None else grad_lse.to(lse.dtype))))
    dqkv = [None, None, None]
    for i in wrt:
        dqkv[i] = _in_layout_of(got.pop(0), (q, k, v)[i])
    grads = [g.float().to(q.device) for g in got]
    return (*dqkv, grads)


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """Op outputs cannot be None, nor alias each other: a fresh empty tensor stands for "not computed"."""
    return like.new_empty(0) if t is None else t


@attention_bwd.register_fake
def _(q, k, v, out, lse, grad_out, grad_lse, *rest):
    buffers, need_q, need_k, need_v, buffer_grads = rest[8], rest[13], rest[14], rest[15], rest[16]
    none = q.new_empty(0)
    return (empty_like_layout(q) if need_q else none, empty_like_layout(k, dtype=q.dtype) if need_k else q.new_empty(0),
            empty_like_layout(v, dtype=q.dtype) if need_v else q.new_empty(0),
            [q.new_empty(buffers[i].shape, dtype=torch.float32) for i in buffer_grads])  # on q's device, fp32


def _buffer_names(score, mask) -> tuple[str, ...]:
    return (score.buffer_names if score is not None else ()) + (mask.buffer_names if mask is not None else ())


# ---------------------------------------------------------------- autograd


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    masks, buffers, scale, key, dropout_p, rng = rest[:8], rest[8], rest[9], rest[10], rest[11], rest[12]
    out, lse, row_max = output
    ctx.mark_non_differentiable(row_max)  # a max: no gradient, as PyTorch's max_scores has none
    ctx.save_for_backward(q, k, v, out, lse, *masks, *buffers)
    ctx.n_buffers = len(buffers)
    ctx.extra = (scale, key, dropout_p, rng, rest[14])
    ctx.set_materialize_grads(False)  # an unused output (out or lse) brings None, not a tensor of zeros


def _backward(ctx, grad_out, grad_lse, grad_max=None):
    """lse is differentiable: its gradient folds into the backward's delta (runtime/backward.py)."""
    q, k, v, out, lse, *rest = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    masks, buffers = rest[:8], rest[8:]
    scale, key, dropout_p, rng, unfused = ctx.extra
    need = ctx.needs_input_grad
    need_buffers = need[11] if isinstance(need[11], (list, tuple)) else [need[11]] * ctx.n_buffers
    wanted = [i for i, n in enumerate(need_buffers) if n]
    dq, dk, dv, grads = attention_bwd(
        q, k, v, out, lse, grad_out, grad_lse, *masks, list(buffers), scale, key, dropout_p, rng,
        bool(need[0]), bool(need[1]), bool(need[2]), wanted, unfused,
    )
    return ((dq if need[0] else None), (dk if need[1] else None), (dv if need[2] else None),
            *([None] * 8), _buffer_grads(wanted, grads, buffers), None, None, None, None, None, None)


def _buffer_grads(wanted: list[int], grads, buffers) -> list:
    """Each buffer's gradient (grads holds those of buffers[i] for i in wanted) in the buffer's device and
    dtype; None for a buffer that needs none."""
    by_index = dict(zip(wanted, grads))
    return [_like(by_index[i], b) if i in by_index else None for i, b in enumerate(buffers)]


def _like(grad: Tensor, buffer: Tensor) -> Tensor:
    """The kernels' fp32 gradient, on the buffer's device (it may live on the CPU) in its dtype."""
    if grad.device.type == "meta":  # a shapes-only run: nothing to copy, the values are undefined anyway
        return buffer.new_empty(grad.shape)
    return grad.to(buffer.device, buffer.dtype)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- eager calls without the dispatcher


class _EagerAttention(torch.autograd.Function):
    """The two ops' eager twin: the same forward and backward (`_forward`, `_backward_impl`), as an
    autograd.Function. The ops' Python argument handling (defaults, pytrees, redispatch) costs more
    than the rest of a small call's host path; flex_attention takes this route when nothing needs the
    ops themselves (see `eager_route_ok`)."""

    @staticmethod
    def forward(ctx, call, q, k, v, *buffers):
        masks, scale, key, dropout_p, rng, return_max, unfused, planned = call
        if planned is not None:  # a planned call (eager_plans.py)
            out, lse, row_max = planned.forward.run(q, k, v)
            row_max = q.new_empty(0, dtype=torch.float32) if row_max is None else row_max
        else:
            out, lse, row_max = _forward(q, k, v, masks, list(buffers), scale, key, dropout_p, rng, return_max, unfused)
        ctx.mark_non_differentiable(row_max)
        ctx.save_for_backward(q, k, v, out, lse, *buffers)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse, row_max

    @staticmethod
    def backward(ctx, grad_out, grad_lse, grad_max):
        q, k, v, out, lse, *buffers = ctx.saved_tensors
        if grad_out is None:  # only lse was used
            grad_out = torch.zeros_like(out)
        masks, scale, key, dropout_p, rng, _, unfused, planned = ctx.call
        need = ctx.needs_input_grad
        wanted = [i for i, n in enumerate(need[4:]) if n]
        need_qkv = tuple(bool(n) for n in need[1:4])
        if planned is not None:
            dq, dk, dv, grads = planned.backward(q, k, v, out, lse, grad_out, grad_lse, masks, buffers, scale, key,
                                                 need_qkv, wanted)
        else:
            dq, dk, dv, grads = _backward_impl(q, k, v, out, lse, grad_out, grad_lse, masks, buffers, scale, key,
                                               dropout_p, rng, need_qkv, wanted, unfused)
        return (None, dq, dk, dv, *_buffer_grads(wanted, grads, buffers))


def eager_route_ok(q: Tensor, k: Tensor, v: Tensor, buffers) -> bool:
    """True where the ops' dispatcher has nothing to do: not tracing, plain CUDA tensors (no subclass,
    fake or meta tensor), no torch function or dispatch mode and no functorch transform active."""
    return (not torch.compiler.is_compiling() and type(q) is Tensor and type(k) is Tensor and type(v) is Tensor
            and q.device.type == "cuda" and all(type(b) is Tensor for b in buffers) and no_modes_active())


def no_modes_active() -> bool:
    """No torch function or dispatch mode and no functorch transform active: the part of eager_route_ok that a
    planned call checks per call (its tensors' types and device are in its signature, eager_plans.py)."""
    return (torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


def records_grad(q: Tensor, k: Tensor, v: Tensor, buffers) -> bool:
    """Whether autograd records this call."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or any(b.requires_grad for b in buffers))


def attention_eager(q, k, v, masks, buffers, scale: float, variant_key: str, dropout_p: float, rng, return_max: bool,
                    unfused: bool = False):
    """attention_fwd's result, without the dispatcher: through _EagerAttention where autograd records, else
    the forward alone."""
    if records_grad(q, k, v, buffers):
        return _EagerAttention.apply((tuple(masks), scale, variant_key, dropout_p, rng, return_max, unfused, None), q, k,
                                     v, *buffers)
    return _forward(q, k, v, tuple(masks), list(buffers), scale, variant_key, dropout_p, rng, return_max, unfused)


class PlannedCall:
    """The launches of a planned eager call without dropout (eager_plans.py): its forward
    (runtime/forward.ForwardLaunch), made with the plan, and its backwards (runtime/backward.BackwardLaunch), made
    at the first backward of each layout of the output gradient and set of gradients wanted."""

    MAX_BACKWARDS = 8

    def __init__(self, q, k, v, masks, buffers, scale: float, variant_key: str, return_max: bool):
        var = variant(variant_key)
        score, mask = var.bind(buffers)
        bm = _block_mask(var, masks, q, k)
        extra = {"max_scores": True} if return_max else {}
        self.forward = _forward_pass.prepare_forward(q, k, v, score, bm, mask, resolve_scale(scale, q),
                                                     var.kernel_options, **extra)
        self.backwards: dict[tuple, tuple] = {}  # key -> (BackwardLaunch, names of the gradients wanted)

    def backward(self, q, k, v, out, lse, grad_out, grad_lse, masks, buffers, scale, variant_key, need: tuple,
                 buffer_grads: list):
        """_backward_impl's result, through the BackwardLaunch of this output gradient's layout."""
        key = (grad_out.shape, grad_out.stride(), grad_out.dtype, grad_out.data_ptr() % 16, need, tuple(buffer_grads))
        hit = self.backwards.get(key)
        if hit is None:  # (the variant is bound and the names found once per key, not per step)
            var = variant(variant_key)
            score, mask = var.bind(buffers)
            wanted = _wanted_names(score, mask, buffer_grads)
            bm = _block_mask(var, masks, q, k)
            launch = _backward_pass.prepare_backward(q, k, v, out, grad_out, score, bm, mask, resolve_scale(scale, q),
                                                     var.kernel_options, need, wanted)
            if len(self.backwards) >= self.MAX_BACKWARDS:
                self.backwards.clear()
            hit = self.backwards[key] = (launch, wanted)
        launch, wanted = hit
        return _as_returned(launch.run(q, k, v, out, lse, grad_out, grad_lse), q, k, v, wanted)


def eager_plan_parts(q, k, v, masks, buffers, scale: float, variant_key: str, return_max: bool):
    """For a planned eager call without dropout (eager_plans.py): its PlannedCall and the call tuple of its
    autograd node, which runs it."""
    planned = PlannedCall(q, k, v, masks, buffers, scale, variant_key, return_max)
    return planned.forward, (tuple(masks), scale, variant_key, 0.0, None, return_max, False, planned)
