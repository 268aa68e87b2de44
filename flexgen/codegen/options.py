"""Options of one kernel as the command line (`--set`) and build files give them: checked, and
PyTorch's kernel_options names (BLOCK_M, BLOCK_N, num_warps, num_stages; BLOCK_M1, BLOCK_N1,
num_warps1 for the backward) mapped onto KernelSpec fields, so an unknown or misspelled name is
an error instead of a template knob nothing reads.
"""
from __future__ import annotations

import difflib

from ..warnings_once import warn_once

_TILE_FIELDS = ("block_m", "block_n", "num_warps", "num_stages")
_FLAGS = ("dropout", "debug", "fast_math", "device_debug", "precise_math", "pingpong", "persistent", "fold_score",
          "split_kv")
_FAMILIES = ("sm80", "sm90")
# PyTorch's names, per pass: the forward's apply to every kernel but the backward's main one.
_FORWARD_NAMES = {"BLOCK_M": "block_m", "BLOCK_N": "block_n"}
_BACKWARD_NAMES = {"BLOCK_M1": "block_m", "BLOCK_N1": "block_n", "num_warps1": "num_warps", "deterministic": "deterministic"}
KNOWN = sorted({*_TILE_FIELDS, *_FLAGS, "family", "grad_buffers", *_FORWARD_NAMES, *_BACKWARD_NAMES})


class OptionError(ValueError):
    """An option name or value no kernel takes."""


def _did_you_mean(name: str) -> str:
    close = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.6)
    if not close:  # a name in another case: the first spelling that matches it
        lowered = {}
        for k in KNOWN:
            lowered.setdefault(k.lower(), k)
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]!r}?" if close else ""


def _pass_of(name: str) -> str | None:
    """"bwd" for the backward's names, "fwd" for the forward's, None for names every kind takes."""
    return "bwd" if name in _BACKWARD_NAMES else "fwd" if name in _FORWARD_NAMES else None


def _value(name: str, value):
    field = _FORWARD_NAMES.get(name) or _BACKWARD_NAMES.get(name) or name
    if field in _TILE_FIELDS:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OptionError(f"option {name} must be a positive int, got {value!r}")
    elif field in _FLAGS or field == "deterministic":
        if not isinstance(value, bool):
            raise OptionError(f"option {name} must be True or False, got {value!r}")
    elif field == "family" and value not in _FAMILIES:
        raise OptionError(f"option family must be one of {_FAMILIES}, got {value!r}")
    elif field == "grad_buffers":
        value = (value,) if isinstance(value, str) else value
        if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) for v in value):
            raise OptionError(f"option grad_buffers must name buffers (a string or a list of them), got {value!r}")
        value = tuple(value)
    return field, value


def spec_options(options: dict, kind: str, kinds: tuple[str, ...] | None = None, templates_take_others: bool = False) -> dict:
    """`options` as make_spec keywords for a kernel of `kind`.

    `kinds`: every kind the same options are given for (a build file's variant); a name of a pass
    none of them runs is refused, a name of another listed pass is left to that pass.
    `templates_take_others`: pass unknown names on as template options (a --template-dir's own knobs).
    """
    kinds = tuple(kinds or (kind,))
    this_pass = "bwd" if kind == "bwd" else "fwd"
    out: dict = {}
    given_as: dict = {}  # field -> the name it came under
    for name, value in options.items():
        owner = _pass_of(name)
        if name not in KNOWN:
            if templates_take_others:
                out[name] = value
                continue
            raise OptionError(f"unknown option {name!r}{_did_you_mean(name)} (known: {', '.join(KNOWN)})")
        if owner is not None and owner != this_pass:
            if any(("bwd" if k == "bwd" else "fwd") == owner for k in kinds):
                continue  # another kind of this variant takes it
            hint = {"BLOCK_M": "BLOCK_M1", "BLOCK_N": "BLOCK_N1", "BLOCK_M1": "BLOCK_M", "BLOCK_N1": "BLOCK_N"}.get(name)
            which = "the backward's (kind bwd)" if owner == "bwd" else "the forward's"
            raise OptionError(f"option {name} sets {which} kernel, not a {kind} kernel" + (f"; use {hint}" if hint else ""))
        field, value = _value(name, value)
        if field in given_as:
            raise OptionError(f"option {field} is given twice, as {given_as[field]} and as {name}")
        out[field], given_as[field] = value, name
    return out


# ---------------------------------------------------------------- flex_attention's kernel_options
#
# The one table of the names flex_attention's kernel_options take (the command line's --set above
# shares the flags and the tile names). Values are checked here, before any planning; whether a tile
# suits the chosen family is the family's check (runtime/families.py), also before anything compiles.

# Forward tile (BLOCK_M query rows, BLOCK_N key rows, num_warps, num_stages) and backward tile (BLOCK_M1,
# BLOCK_N1, num_warps1: flexgen's), under PyTorch's names, as KernelSpec fields.
CALL_FWD_TILES = {"BLOCK_M": "block_m", "BLOCK_N": "block_n", "num_warps": "num_warps", "num_stages": "num_stages"}
CALL_BWD_TILES = {"BLOCK_M1": "block_m", "BLOCK_N1": "block_n", "num_warps1": "num_warps"}
# deterministic: bitwise reproducible backward; precise_math: libm tanh/exp/log and IEEE division in score_mod;
# pingpong: the sm90 forward's warpgroup turns; persistent: the sm90 grids of one CTA per SM; fold_score: the sm90
# forward computes score_mods of two shapes (affine in the indices, a tanh soft cap) by terms of its own.
# split_kv: the forward splits each query tile's keys over several CTAs (by default for at most 64 query rows).
CALL_FLAGS = ("deterministic", "precise_math", "pingpong", "persistent", "fold_score", "split_kv")
CALL_KNOWN = sorted({*CALL_FWD_TILES, *CALL_BWD_TILES, *CALL_FLAGS, "family"})
# PyTorch's FlexKernelOptions that mean nothing to flexgen's kernels (Triton knobs, the dQ-only backward
# tile BLOCK_M2 / BLOCK_N2, TMA and backend choices, internal output flags): accepted like PyTorch, and
# ignored with one warning per name and process.
TORCH_IGNORED = (
    "BACKEND", "BLOCKS_ARE_CONTIGUOUS", "BLOCK_M2", "BLOCK_N2", "FORCE_USE_FLEX_ATTENTION", "IS_DIVISIBLE",
    "OUTPUT_LOGSUMEXP", "OUTPUT_MAX", "PRESCALE_QK", "ROWS_GUARANTEED_SAFE", "SAFE_HEAD_DIM", "USE_TMA", "WRITE_DQ",
    "fwd_num_stages", "fwd_num_warps", "bwd_num_stages", "bwd_num_warps", "kpack", "matrix_instr_nonkdim",
    "num_stages1", "waves_per_eu",
)


def _suggest(name: str, known) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if not close:
        lowered = {k.lower(): k for k in known}
        close = [lowered[c] for c in difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)]
    return f"; did you mean {close[0]!r}?" if close else ""


# PyTorch's BACKEND values: flexgen runs its own kernels whichever is named, but checks the option as PyTorch does.
TORCH_BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")


def _check_backend(options: dict) -> None:
    if "BACKEND" not in options:
        return
    if options.get("FORCE_USE_FLEX_ATTENTION", False):
        raise RuntimeError("flex_attention: BACKEND cannot be combined with legacy FORCE_USE_FLEX_ATTENTION "
                           "(as in PyTorch: BACKEND supersedes it; drop FORCE_USE_FLEX_ATTENTION)")
    if options["BACKEND"] not in TORCH_BACKENDS:
        raise ValueError(f"flex_attention: Invalid BACKEND value {options['BACKEND']!r}. Must be one of {TORCH_BACKENDS}")


# PyTorch's pass prefixes: fwd_X sets X for the forward only, bwd_X for the backward only, over an unprefixed X.
# flexgen's tile names already say their pass (BLOCK_M / BLOCK_N the forward's, BLOCK_M1 / BLOCK_N1 / num_warps1
# the backward's), so a prefix may only name its own pass's tile (or an option flexgen ignores: the prefixed
# num_warps / num_stages are Triton's, as TORCH_IGNORED says).
_PREFIXED = {"fwd": ("BLOCK_M", "BLOCK_N"), "bwd": (*CALL_BWD_TILES, "BLOCK_M2", "BLOCK_N2")}


def _unprefixed(options: dict) -> dict:
    """options with fwd_ / bwd_ names resolved to flexgen's, the prefixed value winning over a plain one."""
    out = {name: value for name, value in options.items()
           if not (isinstance(name, str) and name[:4] in ("fwd_", "bwd_") and name not in TORCH_IGNORED)}
    for name, value in options.items():
        if name in out or name in TORCH_IGNORED:
            continue
        pass_, base = name[:3], name[4:]
        if base not in _PREFIXED[pass_]:
            raise OptionError(f"flex_attention: kernel_options {name!r}: the {pass_}_ prefix takes "
                              f"{', '.join(pass_ + '_' + n for n in _PREFIXED[pass_])} (the "
                              f"{'forward' if pass_ == 'fwd' else 'backward'}'s tile under PyTorch's names)")
        out[base] = value
    return out


def call_options(options: dict | None) -> dict:
    """flex_attention's kernel_options checked: a name flexgen does not know is an error (with the closest
    name), a flag must be True or False (the string "False" is not), a tile value a positive int, family
    one of the families. PyTorch's fwd_ / bwd_ prefixes are taken for their pass's tile names. PyTorch's names
    that flexgen ignores are dropped with a warning, once per name. Returns the options flexgen uses."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"flex_attention: kernel_options must be a dict, got {type(options).__name__}")
    _check_backend(options)
    out = {}
    for name, value in _unprefixed(options).items():
        if name in TORCH_IGNORED:
            warn_once(f"flex_attention: kernel_options {name!r} is a PyTorch (Triton) option flexgen's kernels have "
                      "no use for; it is ignored", stacklevel=3)
            continue
        if name not in CALL_KNOWN:
            raise OptionError(f"flex_attention: unknown kernel_options {name!r}{_suggest(str(name), CALL_KNOWN + list(TORCH_IGNORED))} "
                              f"(known: {', '.join(CALL_KNOWN)}; PyTorch's {', '.join(TORCH_IGNORED)} are accepted and ignored)")
        if name in CALL_FLAGS:
            if not isinstance(value, bool):
                raise OptionError(f"flex_attention: kernel_options {name} must be True or False, got {value!r}")
        elif name == "family":
            if value not in _FAMILIES:
                raise OptionError(f"flex_attention: kernel_options family={value!r}; allowed: {list(_FAMILIES)}")
        elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise OptionError(f"flex_attention: kernel_options {name}={value!r}; it must be a positive int")
        out[name] = value
    return out
