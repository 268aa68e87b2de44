"""Readable text for an IR expression, in the DSL's own text syntax."""
from __future__ import annotations

from .graph import postorder  # not from ir.py: ir.py imports this module (Node.__repr__)

_INFIX = {
    "add": ("+", 4), "sub": ("-", 4), "mul": ("*", 5), "div": ("/", 5), "floordiv": ("//", 5),
    "mod": ("%", 5), "pow": ("**", 7), "lt": ("<", 2), "le": ("<=", 2), "gt": (">", 2),
    "ge": (">=", 2), "eq": ("==", 2), "ne": ("!=", 2), "and": ("and", 1), "or": ("or", 0),
    "xor": ("xor", 0), "bitor": ("|", 3), "bitxor": ("^", 3.3), "bitand": ("&", 3.6),  # (as Python binds them)
}
_ATOM = 9


def pretty(root, limit: int | None = None) -> str:
    """One-line text of the expression; shared subexpressions are written out where used.
    With `limit`, text past `limit` characters is cut and ends in "..." (a DAG that shares
    subexpressions can have a text exponentially longer than itself)."""
    text: dict[str, tuple[str, int]] = {}
    for n in postorder(root):
        text[n.digest] = format_node(n, [text[a.digest] for a in n.args], limit)
    return text[root.digest][0]


def format_node(n, args: list[tuple[str, int]], limit: int | None = None) -> tuple[str, int]:
    """(text, precedence) of `n` from its operands'; with `limit`, cut to limit characters + "..."."""
    s, prec = _format(n, args)
    if limit is not None and len(s) > limit:
        return s[:limit] + "...", _ATOM
    return s, prec


def _paren(arg: tuple[str, int], prec: int, right: bool = False) -> str:
    s, p = arg
    return f"({s})" if p < prec or (right and p == prec) else s


def _format(n, args: list[tuple[str, int]]) -> tuple[str, int]:
    op = n.op
    if op == "input":
        return n.attr, _ATOM
    if op == "param":
        return n.attr, _ATOM
    if op == "const":
        v = n.attr
        if isinstance(v, bool):
            return ("True" if v else "False"), _ATOM
        if isinstance(v, float):
            return repr(v), (_ATOM if v >= 0 else 6)
        return str(v), (_ATOM if v >= 0 else 6)
    if op == "load":
        return f"{n.attr.name}[{', '.join(a[0] for a in args)}]", _ATOM
    if op == "cast":
        return f"{n.attr.value}({args[0][0]})", _ATOM
    if op == "where":
        return f"where({args[0][0]}, {args[1][0]}, {args[2][0]})", _ATOM
    if op == "neg":
        return f"-{_paren(args[0], 6)}", 6
    if op == "not":
        return f"not {_paren(args[0], 2)}", 1
    if op in ("min", "max"):
        return f"{op}imum({args[0][0]}, {args[1][0]})", _ATOM
    if op == "inline_asm":
        asm_str, constraints, pack = n.attr
        extra = f", pack={pack}" if pack != 1 else ""
        return (f"inline_asm_elementwise({', '.join(a[0] for a in args)}, asm_str={asm_str!r}, "
                f"constraints={constraints!r}, dtype=torch.{n.dtype.value}{extra})"), _ATOM
    if op in _INFIX:
        sym, prec = _INFIX[op]
        if op == "pow":
            return f"{_paren(args[0], prec + 1)} ** {_paren(args[1], prec)}", prec
        return f"{_paren(args[0], prec)} {sym} {_paren(args[1], prec, right=True)}", prec
    return f"{op}({', '.join(a[0] for a in args)})", _ATOM


def pretty_lines(root) -> str:
    """Multi-line SSA form, one named temporary per node that is used more than once."""
    uses: dict[str, int] = {}
    for n in postorder(root):
        for a in n.args:
            uses[a.digest] = uses.get(a.digest, 0) + 1
    names: dict[str, str] = {}
    lines: list[str] = []
    text: dict[str, tuple[str, int]] = {}
    for n in postorder(root):
        t = _format(n, [text[a.digest] for a in n.args])
        for a in n.args:  # a single-use operand's text now lives on inside t: keep memory linear
            if uses.get(a.digest, 0) == 1:
                text.pop(a.digest, None)
        if uses.get(n.digest, 0) > 1 and n.op not in ("input", "const", "param"):
            name = f"t{len(names)}"
            names[n.digest] = name
            lines.append(f"{name} = {t[0]}")
            t = (name, _ATOM)
        text[n.digest] = t
    lines.append(f"return {text[root.digest][0]}")
    return "\n".join(lines)
