"""flex_attention's kernel_options inside a compiled region. torch.compile(dynamic=True) makes the ints of a dict
argument symbolic, but a tile size is part of the kernel's code: each is taken as its value here, with a guard on
it (another value compiles again, as another tile builds another kernel in eager calls)."""
from __future__ import annotations

from .dynamo_marks import assume_constant_result

# The options the comptime hook read, as (name, value) pairs: written by _take_values, read right after.
_TAKEN: list[tuple] = [()]


def constant_options(kernel_options: dict) -> dict:
    """Traced by dynamo: kernel_options with every symbolic int replaced by its value (guarded)."""
    from torch._dynamo.comptime import comptime  # traced only under torch.compile, where dynamo is loaded

    comptime(_take_values)
    return dict(_taken())


def _take_values(ctx) -> None:
    """(comptime) The dict's entries as Python values; a symbolic int's value through guard_scalar."""
    from torch.fx.experimental.symbolic_shapes import guard_scalar

    variable = ctx.get_local("kernel_options")._i_will_not_complain_if_bc_breaks_VariableTracker()
    pairs = []
    for key, value in variable.items.items():
        name, sym = key.vt.as_python_constant(), getattr(value, "sym_num", None)
        if sym is None and not value.is_python_constant():
            raise TypeError(f"flex_attention: kernel_options {name!r} must be a Python number, bool or string, got "
                            f"{value.python_type().__name__}")
        pairs.append((name, guard_scalar(sym) if sym is not None else value.as_python_constant()))
    _TAKEN[0] = tuple(pairs)


@assume_constant_result
def _taken() -> tuple:
    return _TAKEN[0]
