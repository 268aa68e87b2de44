"""Errors raised while turning a user's score_mod / mask_mod into IR.

Every error names what went wrong, where (the user's function and the line of
their code that did it, or a caret under the spot in the text form) and, where
there is one, what to write instead.
"""
from __future__ import annotations

import linecache
import os
import sys
from types import FrameType, FunctionType


class FlexgenTraceError(Exception):
    """A score_mod / mask_mod that flexgen cannot turn into IR.

    `detail` is the bare explanation; `location` says where (may be empty).
    """

    def __init__(self, detail: str, location: str = "") -> None:
        self.detail = detail
        self.location = location
        super().__init__(f"{detail}\n{location}" if location else detail)


class FlexgenSyntaxError(FlexgenTraceError):
    """The text form could not be parsed, or names something unknown."""

    def __init__(self, detail: str, text: str, line: int, column: int, context: str | None = None) -> None:
        self.line = line
        self.column = column
        self.text = text
        context = context if context is not None else caret_context(text, line, column)
        super().__init__(f"line {line}, column {column}: {detail}", context)


class ControlFlowError(FlexgenTraceError):
    """A traced value was used where Python needs a concrete value (if/while/bool/int/float)."""


class UnsupportedOperationError(FlexgenTraceError):
    """A torch function, tensor method or Python operation flexgen does not translate."""


class SignatureError(FlexgenTraceError, TypeError):
    """The function takes the wrong arguments, or a binding names no parameter."""


class IndexingError(FlexgenTraceError, IndexError):
    """A captured tensor was indexed with something other than integer index expressions."""


class UnsupportedBufferError(FlexgenTraceError, ValueError):
    """A captured or bound tensor has a dtype or device the kernels cannot read."""


class ReturnTypeError(FlexgenTraceError, TypeError):
    """A mask_mod that does not return bool, or a score_mod that does."""


class FlexgenTypeError(FlexgenTraceError, TypeError):
    """Operand types the IR does not allow (e.g. `&` on integers, a float used as a condition)."""


# ---------------------------------------------------------------- locations

_FLEXGEN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_dirs() -> tuple[str, ...]:
    """Frames in these directories are never the user's code."""
    dirs = [_FLEXGEN_DIR + os.sep]
    for mod_name in ("torch", "lark"):
        mod = sys.modules.get(mod_name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(mod.__file__)) + os.sep)
    return tuple(dirs)


def user_frame() -> FrameType | None:
    """The innermost stack frame that belongs to the user's code (not flexgen, torch or lark)."""
    skip = _library_dirs()
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(skip) and not frame.f_code.co_filename.startswith("<frozen"):
            return frame
        frame = frame.f_back
    return None


def frame_location(frame: FrameType | None) -> str:
    """Traceback-style text for a frame: file, line, function and the source line."""
    if frame is None:
        return ""
    code = frame.f_code
    text = f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}'
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"{text}\n    {line}" if line else text


def source_line(frame: FrameType | None) -> str:
    if frame is None:
        return ""
    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


def unwrap_function(fn: object) -> object:
    """The plain function under functools.partial / bound methods / decorators, for naming."""
    seen = 0
    while seen < 10:
        seen += 1
        if hasattr(fn, "func") and callable(getattr(fn, "func")):  # functools.partial
            fn = fn.func
        elif hasattr(fn, "__func__"):  # bound method
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
    return fn


def describe_function(fn: object) -> str:
    """`'name' (file:line)` for a user function, as precise as what it exposes."""
    inner = unwrap_function(fn)
    name = getattr(inner, "__name__", None) or type(fn).__name__
    code = getattr(inner, "__code__", None)
    if isinstance(inner, FunctionType) and code is not None:
        return f"'{name}' (defined at {code.co_filename}:{code.co_firstlineno})"
    return f"'{name}'"


def caret_context(text: str, line: int, column: int) -> str:
    """The offending line of `text` with a caret under `column` (both 1-based)."""
    lines = text.splitlines() or [""]
    row = lines[min(max(line, 1), len(lines)) - 1]
    return f"    {row}\n    {' ' * max(column - 1, 0)}^"
