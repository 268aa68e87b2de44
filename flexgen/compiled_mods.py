"""A score_mod / mask_mod function under torch.compile: its token and buffers from code that dynamo traces.

Dynamo must not run flexgen's tracer (it would try to trace it), yet the token must be a constant of the graph and the
buffers graph inputs, so that gradients reach a learnable buffer. So:
- a function is traced by `_function_token` / `_buffer_paths`, marked assume_constant_result: dynamo calls them once,
  at trace time, on the real function, and the buffers are fetched again in traced code along the recorded paths
  (closure cell, module global, attribute);
- a comptime hook (`_classify`) tells the traced code how dynamo holds the function before it touches it: a function
  made inside the compiled region whose closure holds values of the trace (tensors made there, traced sizes) has no
  Python value dynamo can hand over, so another hook (`_capture_closure`) builds a stand-in over plain values of the
  same dtypes and shapes for the tracer, and hands the traced code the closure's contents as dynamo holds them, from
  which the buffers are taken (a functools.partial goes the same way); a cell holding the forward's own module or an
  object of a user class is handed over as the object itself, and the plain values the trace read in it are guarded;
  where a cell holds what it cannot stand in for, flex_attention graph-breaks into eager (an error under
  fullgraph=True, with the reason);
- a number in a closure that dynamo made symbolic (dynamic=True) is specialised by another hook
  (`_specialise_numbers`), or read by the kernel at run time where the function allows it;
- a captured tensor is guarded on its dtype and number of dimensions, and on its shape where the trace reads it
  (`_reads_captured_shapes`), not on its identity.
"""
from __future__ import annotations

import functools
import types
from typing import Any

import torch

from .captures import GLOBAL_MODULES, buffer_paths, follow, is_plain_object, path_to, plain_values, step, traced
from .dynamo_marks import assume_constant_result
from .warnings_once import warn_once_key


def _for_ident(func, ident: tuple):
    """func, or with the cells `ident` marks as read at run time holding 0-dim int32 tensors."""
    cells = _run_time_cells(ident)
    return _with_buffers_for(func, cells) if cells else func


def _bound(func, owner):
    """func, or the method of `owner` (for an owner dynamo could not hand over as a constant, its site in _OWNERS)."""
    owner = _OWNERS[owner] if isinstance(owner, str) else owner
    return func if owner is None else types.MethodType(func, owner)


# Function code site -> the owner of a bound method whose owner dynamo holds as a variable with no constant value
# (an nn.Module under torch 2.11), written by _classify: the trace-time functions below take the site in its place.
_OWNERS: dict[str, Any] = {}


@assume_constant_result
def _function_token(kind: str, func, owner, ident: tuple) -> str:
    """`ident`: ids of what the function captures, only so that dynamo guards on them (and the integers read at
    run time)."""
    mod = traced(_bound(_for_ident(func, ident), owner), kind)
    return "" if mod is None else mod.token


@assume_constant_result
def _plain_value_paths(func, owner) -> tuple:
    return tuple(path for path, _ in plain_values(_bound(func, owner)))


@assume_constant_result
def _buffer_paths(kind: str, func, owner, ident: tuple) -> tuple | None:
    """For each buffer of the function's Mod, how to reach the tensor from it (see follow); None where a buffer is
    none of the tensors it reaches (one it computed while traced, `torch.log(mass[0])`): that call runs eagerly."""
    fn = _bound(_for_ident(func, ident), owner)
    mod = traced(fn, kind)
    if mod is None:
        return ()
    paths = []
    for name, tensor in zip(mod.buffer_names, mod.buffer_tensors):
        path = path_to(fn, tensor)
        if path is None:
            warn_once_key(
                f"unreachable buffer {kind} {mod.name} {name}",
                f"flex_attention under torch.compile: {kind}_mod {mod.name!r} reads a tensor '{name}' that is none "
                "of the tensors it captures (closures, nested closures, defaults, partials, tuples, globals, "
                "attributes), such as one it computes from them, so this call runs eagerly (a graph break); compute "
                f"it outside the {kind}_mod, or pass the variant as a flexgen Mod (flexgen.{kind}_mod(fn)) built "
                "outside the compiled function", stacklevel=2)
            return None
        paths.append(path)
    return tuple(paths)


# Function code site -> how dynamo holds the function (written at trace time by _classify, read by the traced code
# right after): "outside" (a Python function made outside the compiled region: traced code reads its closure),
# "rebuilt" (made inside, over constants only: dynamo rebuilds it as a Python function) or "opaque" (made inside
# over values that exist only in the trace: tensors made there, sizes of traced tensors). Decided before traced code
# touches the function: reading __closure__ of a function made inside breaks the trace on some torch versions.
_HELD: dict[str, str] = {}
# Function code site -> the value of each closure cell that dynamo made a symbolic number, as its repr (None for the
# others), written by _specialise_numbers. (A string: a float read back from here would be made symbolic again.)
_SPECIALISED: dict[str, tuple] = {}


def _traced_variable(ctx, name: str):
    return ctx.get_local(name)._i_will_not_complain_if_bc_breaks_VariableTracker()


def _classify(ctx) -> None:
    site = ctx.get_local("site").as_python_constant()
    owner = _traced_variable(ctx, "owner")
    _OWNERS.pop(site, None)
    if not owner.is_python_constant() and getattr(owner, "value", None) is not None:
        _OWNERS[site] = owner.value
    if getattr(_traced_variable(ctx, "func"), "source", None) is not None:  # (read from outside the trace)
        _HELD[site] = "outside"
        return
    try:
        ctx.get_local("func").as_python_constant()
        _HELD[site] = "rebuilt"
    except Exception:  # a closure over tensors or numbers of the trace: dynamo holds no Python value for it
        _HELD[site] = "opaque"


# _SPECIALISED's entry for an integer the function captured that the kernel reads at run time.
_AT_RUN_TIME = "run time"


def _specialise_numbers(ctx) -> None:
    """A number the function captured, which dynamo made symbolic (dynamic=True, or a value that changed between
    calls): an integer becomes a 0-dim int32 buffer that the kernel reads at run time (as PyTorch passes such a
    symbol to its kernel), so that another value runs the same graph, where the function traces with a tensor in
    its place; any other such number is part of the kernel's code: take its value and make dynamo guard on it
    (guard_scalar), so that another value recompiles instead of running a kernel built for this one."""
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    cells = _traced_variable(ctx, "cells").items
    fn = getattr(_traced_variable(ctx, "func"), "fn", None)
    kind = ctx.get_local("kind").as_python_constant()
    ints = tuple(i for i, cell in enumerate(cells) if isinstance(getattr(cell, "sym_num", None), torch.SymInt))
    if ints:
        owner = ctx.get_local("owner")
        plain = owner.is_python_constant() and owner.as_python_constant() is None  # (not a bound method)
        if not (plain and _traces_with_buffers(fn, kind, ints)):
            ints = ()
    tensors = tuple(i for i, cell in enumerate(cells) if _plain_tensor(cell) is not None)
    shapes_read = bool(tensors) and _reads_captured_shapes(fn, kind, tensors)
    values = []
    for i, cell in enumerate(cells):
        sym = getattr(cell, "sym_num", None)
        if sym is None and not _typed(cell):
            values.append(("untyped",))  # (dynamo reads it from the closure and guards it there)
            continue
        values.append(_tensor_ident(cell, shapes_read) if sym is None else _AT_RUN_TIME if i in ints else
                      repr(guard_scalar(sym)))
    _SPECIALISED[ctx.get_local("site").as_python_constant()] = tuple(values)


# Function code site -> the plain values its function reaches inside captured objects, written by _specialise_values.
_VALUES: dict[str, tuple] = {}


def _specialise_values(ctx) -> None:
    """(comptime) The values traced code read along captures.plain_values' paths, as Python values: a number that
    dynamo made symbolic is specialised (guard_scalar), so that dynamo guards on every one of them."""
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    values = []
    for vt in _traced_variable(ctx, "values").items:
        sym = getattr(vt, "sym_num", None)
        values.append(repr(guard_scalar(sym)) if sym is not None else repr(vt.as_python_constant()))
    _VALUES[ctx.get_local("site").as_python_constant()] = tuple(values)


def _typed(vt) -> bool:
    """Whether dynamo knows the Python type of what the variable holds (torch 2.11's cannot say it for a custom
    autograd Function's `apply`, and then refuses isinstance() on it, which _guard_ident asks)."""
    try:
        vt.python_type()
    except NotImplementedError:
        return False
    return True


def _plain_tensor(vt):
    """(trace time) The example value of a closure cell holding a plain tensor (not a Parameter), else None."""
    from torch._dynamo.variables import TensorVariable

    if not isinstance(vt, TensorVariable) or vt.python_type() is not torch.Tensor:
        return None
    return vt.as_proxy().node.meta.get("example_value")


def _tensor_ident(vt, with_shape: bool) -> tuple | None:
    """(trace time) For a plain tensor in a closure cell, what the function's trace reads of it: its dtype and number
    of dimensions, and its shape where the trace reads a captured tensor's shape (a symbolic size is then specialised,
    so dynamo guards on it); not its identity, so that a function made anew at each step over that step's tensor runs
    one graph. None for anything else (guarded by identity)."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    fake = _plain_tensor(vt)
    if fake is None:
        return None
    if not with_shape:
        return ("tensor", str(fake.dtype), fake.dim())
    return ("tensor", str(fake.dtype), tuple(guard_int(n) if isinstance(n, torch.SymInt) else int(n) for n in fake.shape))


class _ShapeWatch(torch.Tensor):
    """A captured tensor while a function's trace is probed for reading a captured tensor's shape: the function's
    Python code or the tracer asking for .shape, .size(), len(), .numel() or iterating over it (views made from it
    count too)."""

    reads = 0

    @property
    def shape(self):
        _ShapeWatch.reads += 1
        return super().shape


def _counting_read(name: str):
    def read(self, *args):
        _ShapeWatch.reads += 1
        return getattr(torch.Tensor, name)(self, *args)

    return read


for _name in ("size", "__len__", "numel", "nelement", "__iter__"):
    setattr(_ShapeWatch, _name, _counting_read(_name))


def _reads_captured_shapes(fn, kind: str, cells: tuple[int, ...]) -> bool:
    """Whether tracing fn reads the shape of a tensor in those closure cells (True where it cannot tell)."""
    before = _ShapeWatch.reads
    try:
        traced(_with_cells(fn, {i: fn.__closure__[i].cell_contents.as_subclass(_ShapeWatch) for i in cells}), kind)
    except Exception:  # (not a plain function, or one the tracer refuses: it says so where the token is made)
        return True
    return _ShapeWatch.reads != before


# Function code site -> a Python stand-in for a function made inside the compiled region (held "opaque"), written by
# _capture_closure at trace time: the function's code over cells holding plain values in place of the trace's (an
# unwritten tensor of a captured tensor's dtype and shape, a 0-dim int32 tensor for a symbolic integer read at run time,
# a stand-in of a helper function made there too; a module or an object of a user class as itself), which flexgen's
# tracer takes; None where a cell holds something else, and flex_attention then breaks the graph.
_STAND_INS: dict[str, Any] = {}


class _NoStandIn(Exception):
    pass


def _stand_in(tx, vt, ints_at_run_time: bool) -> tuple[Any, Any]:
    """(trace time) A plain value standing in for what a closure cell holds, and what traced code reaches it by: the
    variable itself, or for a function (whose __closure__ traced code cannot read) the tuple of its cells' contents,
    so that a path's "closure" steps become indices (_follow_captured)."""
    from torch._dynamo.variables import (ConstantVariable, ConstDictVariable, FunctoolsPartialVariable, ListVariable,
                                         NestedUserFunctionVariable, SymNodeVariable, TensorVariable, TupleVariable)
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    if isinstance(vt, FunctoolsPartialVariable):  # held as ("partial", function, args, keywords)
        func, func_held = _stand_in(tx, vt.func, ints_at_run_time)
        args = [_stand_in(tx, a, ints_at_run_time) for a in vt.args]
        keywords = {k: _stand_in(tx, a, ints_at_run_time) for k, a in vt.keywords.items()}
        held = TupleVariable([ConstantVariable.create("partial"), func_held, TupleVariable([h for _, h in args]),
                              ConstDictVariable({ConstantVariable.create(k): h for k, (_, h) in keywords.items()})])
        return functools.partial(func, *(a for a, _ in args), **{k: a for k, (a, _) in keywords.items()}), held
    if type(vt) is ConstDictVariable:  # (keys as _children has them: str or int)
        pairs = {}
        for key, value in vt.items.items():
            name = getattr(key, "vt", key).as_python_constant()
            if not isinstance(name, (str, int)):
                raise _NoStandIn
            pairs[name] = _stand_in(tx, value, ints_at_run_time)
        held = ConstDictVariable({ConstantVariable.create(k): h for k, (_, h) in pairs.items()})
        return {k: value for k, (value, _) in pairs.items()}, held
    if type(vt) in (ListVariable, TupleVariable):
        pairs = [_stand_in(tx, item, ints_at_run_time) for item in vt.items]
        values = [value for value, _ in pairs]
        return (values if type(vt) is ListVariable else tuple(values)), type(vt)([held for _, held in pairs])
    if isinstance(vt, NestedUserFunctionVariable):
        cells = [tx.output.side_effects.load_cell(cell) for cell in vt.closure.items] if vt.closure else []
        pairs = [_stand_in(tx, cell, ints_at_run_time) for cell in cells]
        code = vt.get_code()
        defaults = vt.defaults.as_python_constant() if vt.defaults is not None else None
        fn = types.FunctionType(code, vt.f_globals, code.co_name, defaults,
                                tuple(types.CellType(value) for value, _ in pairs) or None)
        return fn, TupleVariable([held for _, held in pairs])
    if isinstance(vt, TensorVariable):
        fake = vt.as_proxy().node.meta.get("example_value")
        if fake is None or fake.layout != torch.strided:
            raise _NoStandIn
        shape = tuple(int(n) for n in fake.shape)  # (a symbolic size is specialised: the trace may unroll over it)
        # (contiguous, so that a view the function takes of it is found by its offset; never written, so a large
        # bias costs address space, not memory)
        return torch.empty(shape, dtype=fake.dtype), vt
    if isinstance(vt, SymNodeVariable):
        sym = vt.sym_num
        if isinstance(sym, torch.SymInt) and ints_at_run_time:
            return torch.zeros((), dtype=torch.int32).as_subclass(_RunTimeInt), vt
        return guard_scalar(sym), vt
    held = getattr(vt, "value", None)
    if isinstance(held, torch.nn.Module) or (is_plain_object(held) and not callable(held)):
        # `self` of the forward, or an object of a user class, made outside the compiled region and not written to
        # in it: the object itself, which traced code reads attributes of (the plain values the trace reads in it
        # are guarded by compiled_parts). One made inside holds its attributes only in dynamo's records.
        if getattr(vt, "source", None) is None or _written_in_trace(tx, held):
            raise _NoStandIn
        return held, vt
    try:
        value = vt.as_python_constant()
    except Exception:
        raise _NoStandIn from None
    if value is None or isinstance(value, (bool, int, float, str, tuple)) or callable(value):
        return value, vt
    raise _NoStandIn


def _written_in_trace(tx, obj) -> bool:
    """Whether the traced code so far assigned an attribute of obj (dynamo applies that after the graph runs: the
    object itself still holds the old value)."""
    mutations = getattr(tx.output.side_effects, "store_attr_mutations", None)
    if mutations is None:
        return True  # (another torch's records: do not trust the object)
    return any(getattr(key, "value", None) is obj and attrs for key, attrs in mutations.items())


def _capture_closure(ctx) -> None:
    """(comptime) For a function made inside the compiled region over values of the trace: a stand-in Python
    function for the tracer (_STAND_INS) and, as the local `captured` of the traced code, its closure's contents as
    dynamo holds them (graph tensors and symbolic numbers), from which the buffers are taken. Integers are first
    tried as values the kernel reads at run time, as for a function made outside (_specialise_numbers)."""
    site = ctx.get_local("site").as_python_constant()
    kind = ctx.get_local("kind").as_python_constant()
    _STAND_INS[site] = None
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()  # (comptime has no setter for a local)
    for ints_at_run_time in (True, False):
        try:
            stand_in, held = _stand_in(tx, _traced_variable(ctx, "func"), ints_at_run_time)
        except Exception:  # _NoStandIn, or another torch version's variables
            return
        if not ints_at_run_time or _traces_with_buffers(stand_in, kind, ()):
            break
    try:
        mod = traced(stand_in, kind)
    except Exception:  # (the tracer's own error is raised where the token is made, with its message)
        mod = None
    if mod is not None and not all(_followable(path) for path in buffer_paths(stand_in, mod.buffer_tensors)):
        return
    _STAND_INS[site] = stand_in
    tx.symbolic_locals["captured"] = held


def _followable(path: tuple | None) -> bool:
    """Whether _follow_captured takes the path: closure cells, a partial's parts, items and attributes, or a global
    first."""
    return path is not None and all(kind in ("closure", "item", "attr", "partial_arg", "partial_kw", "detach") or
                                    (kind == "global" and n == 0) for n, (kind, _) in enumerate(path))


@assume_constant_result
def _stand_in_token(kind: str, site: str) -> str:
    mod = traced(_STAND_INS[site], kind)
    return "" if mod is None else mod.token


@assume_constant_result
def _stand_in_value_paths(site: str) -> tuple:
    return tuple(path for path, _ in plain_values(_STAND_INS[site]))


@assume_constant_result
def _stand_in_buffer_paths(kind: str, site: str) -> tuple:
    """For each buffer of the stand-in's Mod, the module of its globals and how to reach the tensor (see
    _follow_captured)."""
    fn = _STAND_INS[site]
    return tuple((fn.__module__, *path) for path in _buffer_paths(kind, fn, None, ()))


def _captured_values(captured: tuple, paths: tuple) -> tuple:
    """Traced by dynamo (a function of its own, as _captured_buffers)."""
    return tuple(_follow_captured(captured, ("", *path)) for path in paths)


def _captured_buffers(captured: tuple, paths: tuple, device) -> tuple:
    """Traced by dynamo. (A function of its own: a generator over `captured` in compiled_parts would make it a
    closure cell there, which _capture_closure does not set.)"""
    return tuple(_as_buffer(_follow_captured(captured, path), device) for path in paths)


def _follow_captured(captured, path: tuple):
    """Traced by dynamo: from the stand-in's function as dynamo holds it (_stand_in), where a function made inside
    is the tuple of its cells' contents and a partial ("partial", function, args, keywords)."""
    module, *steps = path
    obj = captured
    for kind, arg in steps:
        partial = isinstance(obj, tuple) and len(obj) == 4 and isinstance(obj[0], str) and obj[0] == "partial"
        if partial and kind in ("attr", "partial_arg", "partial_kw"):
            obj = obj[1] if kind == "attr" else obj[2][arg] if kind == "partial_arg" else obj[3][arg]
        elif kind == "closure" and isinstance(obj, tuple):
            obj = obj[arg]
        else:  # (a function made outside, which dynamo reads as it is, takes ordinary steps)
            obj = step(obj, kind, arg, module)
    return obj


class _ValueUnknown(Exception):
    pass


class _RunTimeInt(torch.Tensor):
    """A captured integer's stand-in while the function is traced for a kernel that reads it at run time: Python
    may not look at its value (a branch, a size, an index), which the trace would otherwise bake in."""

    def _refuse(self, *args, **kwargs):
        raise _ValueUnknown("the function uses this integer's value in Python")

    __bool__ = __index__ = __int__ = __float__ = item = tolist = _refuse


def _with_cells(func, values: dict[int, Any]):
    """func with those closure cells holding other values (func itself untouched)."""
    closure = [types.CellType(values[i]) if i in values else cell for i, cell in enumerate(func.__closure__)]
    return types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, tuple(closure))


def _with_buffers_for(func, cells: tuple[int, ...]):
    """func with each of those closure cells holding a 0-dim int32 tensor (what the kernel reads at run time)."""
    return _with_cells(func, {i: torch.zeros((), dtype=torch.int32).as_subclass(_RunTimeInt) for i in cells})


def _traces_with_buffers(fn, kind: str, cells: tuple[int, ...]) -> bool:
    """Whether the function traces with those integers as tensors the kernel reads: not where Python uses their
    values, nor where it computes a tensor of its own from them (the trace would keep what it computed)."""
    if not isinstance(fn, types.FunctionType):
        return False
    swapped = _with_buffers_for(fn, cells)
    try:
        mod = traced(swapped, kind)
    except Exception:  # the tracer's refusals, _ValueUnknown, or Python's own on a tensor where an int belongs
        return False
    return mod is None or None not in buffer_paths(swapped, mod.buffer_tensors)


def _run_time_cells(ident: tuple) -> tuple[int, ...]:
    return tuple(i for i, entry in enumerate(ident) if entry == (_AT_RUN_TIME,))


def _as_buffer(x, device):
    """Traced by dynamo: a captured symbolic integer as the 0-dim int32 tensor the kernel reads."""
    if isinstance(x, torch.Tensor):
        return x
    torch._check(-(2 ** 31) <= x)
    torch._check(x < 2 ** 31)
    return torch.full((), x, dtype=torch.int32, device=device)


def _guard_ident(x) -> tuple:
    """Traced by dynamo: what a captured object is guarded on. (A tuple, list or dict by its items, such as and_masks'
    tuple of functions, and a function by itself, which dynamo guards where it reads it from the closure: torch 2.11's
    dynamo takes no id() of them, nor of torch's own functions such as F.relu.)"""
    if x is None or isinstance(x, (bool, int, float, str)):
        return ("value", x)
    if isinstance(x, (tuple, list)):
        return ("items", tuple(_item_ident(item) for item in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _item_ident(item)) for k, item in x.items()))
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType)):
        return ("function", x)
    return ("id", id(x))


def _item_ident(x) -> tuple:
    """Traced by dynamo: _guard_ident of a container's item; a number or string in a container is guarded through
    captures.plain_values instead (read as dynamo may hold it, symbolic, it could not be a constant here)."""
    return ("plain",) if isinstance(x, (bool, int, float, str)) else _guard_ident(x)


@assume_constant_result
def _written_at_trace_time(table: str, site: str):
    """What a comptime hook wrote for the site (whether there is a stand-in, for "stand_in"), read when dynamo runs
    the traced code: a dict read there directly would come from dynamo's copy of the dict, made at its first read in
    the trace (before this site's entry, where one trace holds two functions)."""
    if table in ("stand_in", "owner"):
        return (_STAND_INS if table == "stand_in" else _OWNERS).get(site) is not None
    return {"held": _HELD, "specialised": _SPECIALISED, "values": _VALUES}[table][site]


def compiled_parts(fn, kind: str, device):
    """Traced by dynamo."""
    from torch._dynamo.comptime import comptime  # traced only under torch.compile, where dynamo is loaded

    if not isinstance(fn, (types.FunctionType, types.MethodType, functools.partial)) and _is_callable_object(fn):
        fn = fn.__call__  # (an instance of a class with __call__: its bound method, owner and all)
    func, owner = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn, None)
    partial = isinstance(func, functools.partial)
    code = func.func.__code__ if partial else func.__code__
    site = f"{'partial:' if partial else ''}{code.co_filename}:{code.co_firstlineno}:{code.co_name}"
    if partial:  # (its arguments may be tensors, which dynamo hands over only as the trace holds them)
        held = "opaque"
    else:
        comptime(_classify)
        held = _written_at_trace_time("held", site)
        if _written_at_trace_time("owner", site):
            owner = site  # (_bound finds the owner by it)
    if held == "opaque":
        captured = ()
        comptime(_capture_closure)  # (sets `captured` to the closure's values as the trace holds them)
        if not _written_at_trace_time("stand_in", site):
            return None  # (flex_attention runs it through the eager fallback)
        # The plain values the trace read inside captured objects (self.temperature): read here and made constants,
        # so that dynamo guards on each, as for a function made outside.
        values = _captured_values(captured, _stand_in_value_paths(site))  # (read by the hook below)
        comptime(_specialise_values)
        return _stand_in_token(kind, site), _captured_buffers(captured, _stand_in_buffer_paths(kind, site), device)
    ident = ()
    if held == "outside":
        # What the trace depends on, for dynamo to guard on (not the function object): a captured tensor's dtype and
        # dimensions (and shape, where read: _tensor_ident), a number or string by value, anything else by id().
        cells = tuple(cell.cell_contents for cell in func.__closure__ or ())
        comptime(_specialise_numbers)
        plain = _written_at_trace_time("specialised", site)
        ident = tuple(_guard_ident(x) if value is None else (value,) if value == _AT_RUN_TIME else
                      value if isinstance(value, tuple) else ("value", value) for x, value in zip(cells, plain))
        # The plain values it reaches inside objects (a bound method's owner's float): read here and made constants
        # of the trace, so that dynamo guards on each (another value traces again, as eager keys do:
        # captures.plain_values).
        values = tuple(follow(fn, path) for path in _plain_value_paths(func, owner))  # (read by the hook below)
        comptime(_specialise_values)
        ident += (("values", _written_at_trace_time("values", site)),)
    token = _function_token(kind, func, owner, ident)
    paths = _buffer_paths(kind, func, owner, ident)
    if paths is None:
        return None  # (flex_attention runs it through the eager fallback)
    global_values = ()
    comptime(_read_globals)  # (sets `global_values`: each path's global, with a source, for a global path)
    return token, _buffers_along(fn, paths, global_values, device)


def _is_callable_object(fn) -> bool:
    """Traced by dynamo: an object whose class defines __call__ in Python (not a Module: its __call__ runs hooks)."""
    return not isinstance(fn, torch.nn.Module) and isinstance(getattr(type(fn), "__call__", None), types.FunctionType)


def _buffers_along(fn, paths: tuple, global_values: tuple, device) -> tuple:
    """Traced by dynamo: the buffers along their paths, a path that starts at a module global from that global as
    _read_globals handed it over."""
    return tuple(_as_buffer(follow(global_values[i], path[1:]) if global_values and path[0][0] == "global" else
                            follow(fn, path), device) for i, path in enumerate(paths))


def _read_globals(ctx) -> None:
    """(comptime) For each buffer path that starts at a global of the function's module, that global as a variable
    with a source (the module imported into the frame's globals, as dynamo does for an import), so that dynamo
    guards on it and makes it a graph input: read through flexgen's table of modules, as `follow` does, torch 2.11's
    dynamo gives a global of a function made inside the compiled region no source, and cannot trace a tensor."""
    from torch._dynamo.source import AttrSource
    from torch._dynamo.variables import ConstantVariable, TupleVariable, VariableTracker

    paths = ctx.get_local("paths").as_python_constant()
    if not any(path and path[0][0] == "global" for path in paths):
        return
    tx = ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator()
    func = _traced_variable(ctx, "func")
    fn_globals = getattr(func, "f_globals", None) or getattr(getattr(func, "fn", None), "__globals__", None)
    name = (fn_globals or {}).get("__name__")
    if name not in GLOBAL_MODULES or GLOBAL_MODULES[name].__dict__ is not fn_globals:
        return  # (follow reads them through the table, as it can)
    values = []
    for path in paths:
        if path and path[0][0] == "global":
            source = AttrSource(tx.import_source(name), path[0][1])
            values.append(VariableTracker.build(tx, fn_globals[path[0][1]], source))
        else:
            values.append(ConstantVariable.create(None))
    tx.symbolic_locals["global_values"] = TupleVariable(values)
