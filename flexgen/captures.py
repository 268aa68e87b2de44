"""What a score_mod or mask_mod function captures: its Mod, traced once per function and per what its closure holds
(`traced`), and the path from the function to each tensor the Mod reads (`buffer_paths`, `follow`: closure cells,
module globals, defaults, a bound method's owner, a partial's arguments, containers, attributes), along which a
later call, or code traced by dynamo, finds the tensors again."""
from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Any

import torch

from .dsl.mod import Mod

# Steps from a function to a tensor it captures: transformers' masks nest four closures and a tuple deep.
_PATH_DEPTH = 8


# Traced score_mods, keyed by the function and what its closure holds right now, so a
# training loop traces once; rebinding a closure variable to a new tensor retraces.
_trace_cache: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def closure_key(fn) -> tuple:
    """What a traced function's Mod depends on besides its code: the objects its closure cells and the module
    globals it names hold now (a global tensor rebound, `bias = torch.randn(...)`, is another variant), by id, and
    the plain values it reaches inside objects it captures (plain_values)."""
    if fn is None:
        return ()
    cells = getattr(fn, "__closure__", None) or ()
    out, held = [], []
    for c in cells:
        try:
            held.append(c.cell_contents)
        except ValueError:  # empty cell
            out.append(None)
    code = getattr(fn, "__code__", None)
    if code is not None:
        g = fn.__globals__
        held.extend(g.get(name) for name in _global_names(code))
        held.extend(fn.__defaults__ or ())
    out.extend(id(x) for x in held)
    # (most mods capture only tensors, numbers and functions of torch: no object to look inside, no search)
    return (*out, plain_values(fn) if any(_holds_values(x) for x in held) else ())


# Types whose values a trace bakes into the kernel (a float attribute read by the mod becomes a constant of the IR).
_PLAIN = (bool, int, float, complex, str, bytes, type(None))
# Past this many plain values in what a function captures, plain_values gives up (a key that never matches).
_MAX_PLAIN_VALUES = 512


def plain_values(fn) -> tuple:
    """(path, value) of each plain value (number, string, None) that fn reaches inside an object or container it
    captures: a bound method's owner's attributes, a captured object's or module's, a dict's or list's items, a
    partial's arguments (along follow's steps, within _PATH_DEPTH). A trace bakes such a value into the kernel, and
    the object can change it in place (an annealed temperature), so it belongs in every key a trace is reused by.
    (Values held directly by a closure cell or a global are in closure_key by identity.) A key that matches nothing
    past _MAX_PLAIN_VALUES."""
    out: list[tuple[tuple, Any]] = []
    level, seen = [(fn, ())], {id(fn)}
    for _ in range(_PATH_DEPTH):
        deeper = []
        for obj, path in level:
            for step, child in _children(obj):
                if type(child) in _PLAIN:
                    if path or not hasattr(obj, "__code__"):
                        out.append((path + (step,), child))
                elif id(child) not in seen and _holds_values(child):
                    seen.add(id(child))
                    deeper.append((child, path + (step,)))
        if len(out) > _MAX_PLAIN_VALUES:
            return (object(),)
        level = deeper
        if not level:
            break
    return tuple(out)


def _holds_values(obj) -> bool:
    """Whether plain_values looks inside obj: functions, bound methods, partials, Modules, containers and objects of
    user classes (not tensors, classes or Python modules)."""
    if isinstance(obj, (torch.Tensor, type, types.ModuleType)) or type(obj) in _PLAIN or _of_torch(obj):
        return False
    return (isinstance(obj, (types.FunctionType, types.MethodType, functools.partial, torch.nn.Module, tuple, list,
                             dict)) or is_plain_object(obj))


def _of_torch(obj) -> bool:
    """A function or method of torch itself (a custom autograd Function's apply, torch.tanh's Python wrappers): the
    values its module holds are torch's settings, not the mod's."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    module = getattr(obj, "__module__", None) if isinstance(obj, types.FunctionType) else None
    return module is not None and (module == "torch" or module.startswith("torch."))


@functools.lru_cache(maxsize=1024)
def _global_names(code) -> tuple[str, ...]:
    """The names a code object (and the functions defined in it) may read as globals."""
    from .dsl.trace import _code_names

    return tuple(dict.fromkeys(_code_names(code)))


def _trace(fn, kind: str) -> Mod | None:
    if fn is None or isinstance(fn, Mod):
        return fn
    from .dsl.api import mask_mod as trace_mask, score_mod as trace_score

    trace = trace_score if kind == "score" else trace_mask
    if isinstance(fn, str):
        return trace(fn)
    try:
        per_fn = _trace_cache.setdefault(fn, {})
    except TypeError:  # not weak-referenceable: trace every time
        return trace(fn)
    key = closure_key(fn)
    hit = per_fn.get(key)
    if hit is not None:
        mod, paths = hit
        if paths is None:  # found at the first reuse (a function traced once never pays the search)
            paths = _untraced_buffer_paths(fn, mod.buffer_tensors)
            per_fn[key] = (mod, paths)
        if None not in paths and reaches_buffers(fn, paths, mod.buffer_tensors):
            return mod
    per_fn.clear()
    mod = trace(fn)
    per_fn[key] = (mod, None)
    return mod


def buffer_paths(fn, tensors) -> tuple:
    """For each tensor a traced function read, the steps from the function to it (find_path: closures, globals,
    attributes, a bound method's owner, containers), or None where there is none within _PATH_DEPTH."""
    return tuple(path_to(fn, t) for t in tensors)


def path_to(fn, tensor: torch.Tensor) -> tuple | None:
    """find_path's path to `tensor`, or to the tensor it is a view of by leading integer indices (`bias[0][b, h]` reads a
    view that bias[0] made while the function was traced; the path ends in that index), or to the tensor it is a
    detached alias of (`temp.detach()` inside the function: the path ends in a detach)."""
    path = find_path(fn, tensor, 0, set())
    base = getattr(tensor, "_base", None)
    if path is None and base is None and not tensor.requires_grad:
        path = find_path(fn, tensor, 0, set(), match=lambda child: _detached_from(tensor, child))
        return None if path is None else path + (("detach", None),)
    if path is not None or base is None:
        return path
    index = _leading_index(base, tensor)
    if index is None:
        return None
    path = find_path(fn, base, 0, set())
    return None if path is None else path + (("item", index),)


def _leading_index(base: torch.Tensor, view: torch.Tensor) -> tuple[int, ...] | None:
    """The integers i0..ik with base[i0, ..., ik] the same elements as `view`, if there are such."""
    k = base.dim() - view.dim()
    if k <= 0 or base.dtype != view.dtype or tuple(base.shape[k:]) != tuple(view.shape) or \
            tuple(base.stride()[k:]) != tuple(view.stride()):
        return None
    offset, index = view.storage_offset() - base.storage_offset(), []
    for size, stride in zip(base.shape[:k], base.stride()[:k]):
        i = offset // stride if stride > 0 else 0
        if not 0 <= i < size:
            return None
        index.append(int(i))
        offset -= i * stride
    return tuple(index) if offset == 0 else None


def _same_elements(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride())


def _detached_from(alias: torch.Tensor, tensor) -> bool:
    """alias is tensor.detach(): the same elements, tensor tracking gradients and alias not."""
    return tensor is not alias and isinstance(tensor, torch.Tensor) and tensor.requires_grad and \
        _same_elements(alias, tensor)


def _same_tensor(a, b) -> bool:
    """b is a, or (a path ending in an index or a detach) a view or alias of the same elements."""
    if a is b:
        return True
    return _same_elements(a, b) and (a._base is not None or not a.requires_grad)


# buffer_paths, or once dynamo is loaded (keep_path_search_out_of_traces) the same never traced: where a compiled
# call falls back to eager code after a graph break, dynamo compiles each function that code calls as a frame of its
# own, and the search would make it wrap all of sys.modules, which an import on another thread changes under it.
_untraced_buffer_paths = buffer_paths


def keep_path_search_out_of_traces() -> None:
    """Called once dynamo is loaded (importing it here would cost every eager user a second)."""
    global _untraced_buffer_paths
    _untraced_buffer_paths = torch.compiler.disable(buffer_paths, reason="flexgen's buffer path search is host code")


def reaches_buffers(fn, paths: tuple, tensors) -> bool:
    """Whether fn still reaches each of `tensors` along its path: an attribute, a nested closure variable or a
    container entry rebound to another tensor is another variant."""
    try:
        return all(_same_tensor(follow(fn, p), t) for p, t in zip(paths, tensors))
    except (AttributeError, IndexError, KeyError, TypeError, ValueError):  # the path itself is gone
        return False


def traced(fn, kind: str) -> Mod | None:
    """The Mod of a score_mod / mask_mod; None for no score_mod and for a mask that keeps everything."""
    from .dsl.api import as_mask_mod

    mod = _trace(fn, kind)
    return as_mask_mod(mod) if kind == "mask" else mod


def _children(obj) -> list[tuple[tuple, Any]]:
    """(step, value) pairs follow can take from obj: a closure's cells, the module globals its code
    names and its default arguments; a bound method's function and owner; a functools.partial's
    function and arguments; the items of a tuple, list or dict (a closure over several functions,
    such as and_masks'); a Module's parameters, buffers and attributes; a plain object's attributes."""
    if isinstance(obj, Mod):
        return [(("mod", i), t) for i, t in enumerate(obj.buffer_tensors)]
    if isinstance(obj, torch.nn.Module):
        names = list(obj._parameters) + list(obj._buffers) + list(vars(obj))
        return [(("attr", n), getattr(obj, n, None)) for n in names if not n.startswith("_")]
    if isinstance(obj, (tuple, list)):
        return [(("item", i), x) for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        return [(("item", k), x) for k, x in obj.items() if isinstance(k, (str, int))]
    if isinstance(obj, functools.partial):
        return ([(("attr", "func"), obj.func)] + [(("partial_arg", i), x) for i, x in enumerate(obj.args)]
                + [(("partial_kw", k), x) for k, x in obj.keywords.items()])
    if hasattr(obj, "__self__") and hasattr(obj, "__func__"):
        return [(("attr", "__self__"), obj.__self__), (("attr", "__func__"), obj.__func__)]
    if is_plain_object(obj):  # an instance of a user class (PyTorch's PagedAttention keeps its page tables so)
        return [(("attr", n), x) for n, x in vars(obj).items() if not n.startswith("__")]
    out: list[tuple[tuple, Any]] = []
    code = getattr(obj, "__code__", None)
    if code is not None:
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                out.append((("closure", i), cell.cell_contents))
            except ValueError:  # empty cell
                pass
        g = obj.__globals__
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        if getattr(module, "__dict__", None) is g:
            GLOBAL_MODULES[obj.__module__] = module
            out.extend((("global", n), g[n]) for n in _global_names(code) if n in g)
        out.extend((("default", i), x) for i, x in enumerate(obj.__defaults__ or ()))
        out.extend((("kwdefault", k), x) for k, x in (obj.__kwdefaults__ or {}).items())
    return out


def is_plain_object(obj) -> bool:
    """An instance with attributes of its own that is not a function, class or module."""
    return (hasattr(obj, "__dict__") and not hasattr(obj, "__code__")
            and not isinstance(obj, (type, types.ModuleType, torch.Tensor, functools.partial)))


def _may_hold_tensors(obj) -> bool:
    """Whether find_path looks inside obj (functions, Mods, Modules, plain objects and containers of them)."""
    return callable(obj) or isinstance(obj, (Mod, torch.nn.Module, tuple, list, dict)) or is_plain_object(obj)


def find_path(obj, target: torch.Tensor, depth: int, seen: set, match=None) -> tuple | None:
    """The steps from obj to target (or to the first object `match` accepts), breadth first (the shortest path), at
    most _PATH_DEPTH deep."""
    found = match or (lambda child: child is target)
    if found(obj):
        return ()
    level = [(obj, ())]
    seen.add(id(obj))
    for _ in range(depth, _PATH_DEPTH):
        deeper = []
        for parent, path in level:
            if isinstance(parent, (torch.Tensor, type)):
                continue
            for step, child in _children(parent):
                if found(child):
                    return path + (step,)
                if id(child) not in seen and _may_hold_tensors(child):
                    seen.add(id(child))
                    deeper.append((child, path + (step,)))
        level = deeper
    return None


# The modules whose globals a path reads, by name (filled where the paths are found). Traced code reads them from
# here, not from sys.modules: dynamo would wrap all of sys.modules, thousands of entries, on every trace, and an
# import while it walks them (a lazily loaded submodule) breaks the trace.
GLOBAL_MODULES: dict[str, types.ModuleType] = {}


def follow(obj, path: tuple):
    """Traced by dynamo: each step is an ordinary attribute or item access."""
    for kind, arg in path:
        obj = step(obj, kind, arg, obj.__module__ if kind == "global" else None)
    return obj


def step(obj, kind: str, arg, module: str | None = None):
    """One step of a path from `obj` (traced by dynamo); a "global" one reads `module`'s global `arg`, through
    the module: dynamo cannot read __globals__ of every function."""
    if kind == "closure":
        return obj.__closure__[arg].cell_contents
    if kind == "global":
        return getattr(GLOBAL_MODULES[module], arg)
    if kind == "mod":
        return obj.buffer_tensors[arg]
    if kind == "item":
        return obj[arg]
    if kind == "partial_arg":
        return obj.args[arg]
    if kind == "partial_kw":
        return obj.keywords[arg]
    if kind == "default":
        return obj.__defaults__[arg]
    if kind == "kwdefault":
        return obj.__kwdefaults__[arg]
    if kind == "detach":
        return obj.detach()
    return getattr(obj, arg)
