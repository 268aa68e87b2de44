"""Planned eager calls: flex_attention's checks, tracing and planning done once per kind of call.

A model calls flex_attention with the same mask, mods, options and input layouts at every layer and every step.
The first such call takes the whole path (the input checks, tracing the mods, adopting the mask, the kernel's
spec and its parameter struct: runtime/forward.ForwardLaunch) and leaves a plan here. A later call whose
`signature` matches (what those steps read: the mods and the mask by identity and what their closures hold, the
mask's tensors and their in-place versions, the scalars, the options, the inputs' shapes, strides, dtypes,
devices, alignment and whether they need gradients, the grad mode) runs the plan: two allocations, the addresses
and one launch.

Plans are made for eager calls on plain CUDA tensors without dropout (ops.eager_route_ok) and hold their mods and
mask weakly: a plan goes when its mask or score_mod is freed, and the least recently used past MAX_PLANS.
"""
from __future__ import annotations

import threading
import types
import weakref
from collections import OrderedDict

import torch
from torch import Tensor

from .captures import closure_key, plain_values

MAX_PLANS = 64

_plans: "OrderedDict[tuple, EagerPlan]" = OrderedDict()
_lock = threading.Lock()


def _layout(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16


def _callable_identity(fn) -> tuple:
    """What a score_mod / mask_mod is, for the key: the function and what its closure holds now (a rebound closure
    variable is another variant, as captures._trace has it). A bound method is made anew at each attribute access:
    its function and owner instead."""
    if isinstance(fn, types.MethodType):  # (plain_values: the owner's attributes the method may read)
        return id(fn.__func__), id(fn.__self__), closure_key(fn.__func__), plain_values(fn.__self__)
    return id(fn), closure_key(fn)


def _mask_state(block_mask) -> tuple:
    """The mask's list tensors by identity and in-place version (a mask updated in place, as paged attention
    does, is planned again)."""
    if block_mask is None:
        return ()
    kv_num, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
    full_num, full_idx = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    state = (id(kv_num), kv_num._version, id(kv_idx), kv_idx._version)
    if full_num is None:
        return state
    return state + (id(full_num), full_num._version, id(full_idx), full_idx._version)


def signature(query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options, dropout_p,
              return_aux) -> tuple | None:
    """The key of a call that a plan may serve; None for a call that always takes the whole path (tensor
    subclasses, dropout, a negative scale, a mask or options of unexpected types, a nested tensor)."""
    if type(query) is not Tensor or type(key) is not Tensor or type(value) is not Tensor:
        return None
    if dropout_p or (scale is not None and not (type(scale) in (float, int) and scale > 0)):
        return None  # (a negative or zero scale moves onto the query, a copy per call)
    try:
        options = ()
        if kernel_options:
            options = tuple(sorted(kernel_options.items()))
            hash(options)
        mask_mod = None if block_mask is None else getattr(block_mask, "mask_mod", None)
        return (_callable_identity(score_mod), id(block_mask), _callable_identity(mask_mod), _mask_state(block_mask),
                scale, enable_gqa, return_lse, return_aux, options, torch.is_grad_enabled(),
                _layout(query), _layout(key), _layout(value))
    except (TypeError, RuntimeError, AttributeError):  # options that do not sort, a nested tensor's strides, ...
        return None


def find(sig: tuple, score_mod, block_mask) -> "EagerPlan | None":
    """The plan made for `sig`, if its mods and mask are these very objects and its buffers unchanged."""
    try:
        plan = _plans.get(sig)
    except TypeError:  # a value that cannot be a key (a return_aux that is no AuxRequest: the whole path says so)
        return None
    if plan is None or not plan.serves(score_mod, block_mask):
        return None
    return plan


def keep(sig: tuple, plan: "EagerPlan", score_mod, block_mask) -> None:
    """Keep `plan` for `sig` while `score_mod` and `block_mask` live (weakly: a plan never keeps them alive)."""
    try:
        plan.refs = tuple(weakref.ref(_owner(x), lambda _, s=sig: _drop(s)) for x in (score_mod, block_mask)
                          if x is not None)
    except TypeError:  # an object without weak references: no plan
        return
    with _lock:
        _plans[sig] = plan
        _plans.move_to_end(sig)
        while len(_plans) > MAX_PLANS:
            _plans.popitem(last=False)


def clear() -> None:
    with _lock:
        _plans.clear()


def _drop(sig: tuple) -> None:
    with _lock:
        _plans.pop(sig, None)


def _owner(fn):
    """What a plan's weak reference follows: a bound method's owner (the method itself is made per access)."""
    return fn.__self__ if isinstance(fn, types.MethodType) else fn


def buffer_paths(fn, tensors) -> tuple | None:
    """For each buffer tensor a traced score_mod / mask_mod `fn` read, the steps from fn to it (captures.find_path:
    closures, globals, attributes, a bound method's owner, ...), so that a plan can check that fn still reaches the
    same tensors; () for a Mod (its tensors are its own) or no buffers; None where one cannot be found (such a call
    is not planned)."""
    from .dsl.mod import Mod
    from .captures import buffer_paths as paths_from

    if fn is None or isinstance(fn, Mod) or not tensors:
        return ()
    paths = paths_from(fn, tensors)
    return None if any(p is None for p in paths) else paths


class EagerPlan:
    """One planned kind of call: its forward launch and the arguments of its autograd node.
    `paths`: buffer_paths of the score_mod's buffers and of the mask_mod's, which are `buffers` in that order."""

    def __init__(self, launch, call: tuple, buffers: tuple, records_grad: bool, route_ok,
                 paths: tuple[tuple, tuple] = ((), ()), score_buffers: int = 0):
        self.launch, self.call, self.buffers = launch, call, buffers
        self.route_ok = route_ok  # ops.no_modes_active: whether the call may bypass the ops, checked per call
        self.buffer_state = _buffer_state(buffers)
        self.records_grad = records_grad
        score_paths, mask_paths = (p or () for p in paths)  # (None: not found; such a plan is not kept)
        self.reached = tuple(r for r in (("score", score_paths, buffers[:score_buffers]),
                                         ("mask", mask_paths, buffers[score_buffers:])) if r[1])
        self.refs: tuple = ()

    def serves(self, score_mod, block_mask) -> bool:
        """Whether the signature's ids still name the objects the plan was made for (an id is reused once its
        object is freed), the mods still reach the buffers it holds (an attribute or a nested closure variable
        rebound to another tensor is another variant), and those are where they were."""
        refs = self.refs
        if len(refs) != (score_mod is not None) + (block_mask is not None):
            return False
        if score_mod is not None and refs[0]() is not _owner(score_mod):
            return False
        if block_mask is not None and refs[-1]() is not block_mask:
            return False
        if not self.buffers:
            return True
        if self.reached:
            from .captures import reaches_buffers

            for kind, paths, tensors in self.reached:
                if not reaches_buffers(score_mod if kind == "score" else block_mask.mask_mod, paths, tensors):
                    return False
        return _buffer_state(self.buffers) == self.buffer_state

    def run(self, query, key, value):
        """(out, lse, max_scores) for these inputs, of the planned layouts (key and value broadcast to the query's
        batch, as flex_attention does); max_scores None unless the plan writes it."""
        if self.records_grad:
            from .ops import _EagerAttention

            return _EagerAttention.apply(self.call, query, key, value, *self.buffers)
        return self.launch.run(query, key, value)


def _buffer_state(buffers) -> tuple:
    """Where each buffer lives and whether it needs a gradient: a buffer moved (`.data = ...`) or switched to
    requires_grad is planned again."""
    return tuple((t.data_ptr(), t.requires_grad) for t in buffers)
