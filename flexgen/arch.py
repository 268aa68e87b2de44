"""Target architectures: names, detection, and what a target offers a kernel.

Targets are spelled like nvcc's `sm_XX`. sm_90 always becomes "sm_90a" so that
Hopper-only instructions are allowed (a cubin for sm_90a runs on every sm_90 GPU).
Later targets keep the name they are given ("sm_100" or the arch-specific "sm_100a");
a GPU's own target is the plain one, whose cubins run on every GPU of its major version
from that minor on. Which template family serves a target is runtime/families.py's business.
"""
from __future__ import annotations

import re

from .cache import paths

# Compute capability major -> the minors with a target of their own (a cubin for one runs on the later
# minors of its major too).
_MINORS = {8: (0, 6, 9), 9: (0,), 10: (0, 3), 11: (0,), 12: (0, 1)}
# Majors whose targets also come in an arch-specific "a" form (accepted when named).
_ARCH_SPECIFIC = (10, 11, 12)


def _name(major: int, minor: int, arch_specific: bool = False) -> str:
    if major == 9:
        return "sm_90a"
    return f"sm_{major}{minor}" + ("a" if arch_specific else "")


SUPPORTED = tuple(_name(major, minor, a) for major, minors in _MINORS.items() for minor in minors
                  for a in ((False, True) if major in _ARCH_SPECIFIC else (False,)))

# Dynamic shared memory one CTA may use, per compute capability major.minor (the default: the smallest).
_SHARED_MEMORY_LIMIT = {(8, 0): 163 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024, (10, 3): 227 * 1024}
_SHARED_MEMORY_DEFAULT = 99 * 1024
# Per SM, by compute capability (the default: the smallest): resident threads and CTAs. Every target has 64k
# registers per SM in four quarters, allocated per warp in units of 256, and reserves 1 KB of shared memory per CTA.
_THREADS_PER_SM = {(8, 0): 2048, (9, 0): 2048, (10, 0): 2048, (10, 3): 2048}
_THREADS_PER_SM_DEFAULT = 1536
_CTAS_PER_SM = {(8, 0): 32, (8, 9): 24, (9, 0): 32, (10, 0): 32, (10, 3): 32}
_CTAS_PER_SM_DEFAULT = 16
_REGISTERS_PER_QUARTER = 16384
_REGISTER_UNIT = 256
_SHARED_RESERVED_PER_CTA = 1024


class UnsupportedArchError(RuntimeError):
    pass


class NoDeviceError(UnsupportedArchError):
    """No CUDA device to detect the architecture from."""


def normalize(arch: str | int | tuple[int, int]) -> str:
    """Accepts "sm_80", "sm80", "80", "8.0", 80, (8, 0), "sm_90"/"sm_90a", "sm_100a", "sm_120"; returns a
    SUPPORTED name."""
    arch_specific = False
    if isinstance(arch, tuple):
        major, minor = arch
    else:
        text = str(arch).strip().lower()
        m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)(?:\.(\d))?(a?)", text)
        if not m:
            raise UnsupportedArchError(f"cannot read {arch!r} as a GPU architecture; write it like 'sm_80' or 'sm_90a'")
        digits, dot_minor, suffix = m.groups()
        if dot_minor is not None:
            major, minor = int(digits), int(dot_minor)
        else:
            major, minor = divmod(int(digits), 10)
        arch_specific = suffix == "a"
    target = from_capability(major, minor)
    if arch_specific and major in _ARCH_SPECIFIC and capability(target) == (major, minor):
        return target + "a"  # what was asked for: the arch-specific form of this exact target
    return target


def from_capability(major: int, minor: int) -> str:
    """The newest supported target whose cubins run on a GPU of compute capability major.minor."""
    if major < 8:
        raise UnsupportedArchError(
            f"compute capability {major}.{minor} is older than sm_80; flexgen kernels need an Ampere (sm_80) or newer GPU"
        )
    if major not in _MINORS:
        raise UnsupportedArchError(
            f"compute capability {major}.{minor} is newer than the targets flexgen knows; supported targets are "
            f"{', '.join(SUPPORTED)}"
        )
    return _name(major, max(m for m in _MINORS[major] if m <= minor))


def current(device_index: int | None = None) -> str:
    """Target of the current (or given) CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise NoDeviceError(
            "no CUDA device is visible; name the target (arch=... or --arch) or set FLEXGEN_ARCH_LIST (e.g. 'sm_80,sm_90a')"
        )
    index = torch.cuda.current_device() if device_index is None else device_index
    return from_capability(*torch.cuda.get_device_capability(index))


_cuda_available: bool | None = None


def current_key():
    """Cheap identity of "the current device" (its index; None without CUDA), for memo keys."""
    global _cuda_available
    if _cuda_available is None:
        import torch

        _cuda_available = torch.cuda.is_available()
    if not _cuda_available:
        return None
    import torch

    return torch.cuda.current_device()


def current_arch(device=None) -> str:
    """Target of a device given as None (current), an index, or a torch.device."""
    index = getattr(device, "index", device)
    if getattr(device, "type", "cuda") != "cuda":
        raise UnsupportedArchError(f"flexgen kernels run on CUDA devices, not on {device}")
    return current(index)


def targets() -> list[str]:
    """FLEXGEN_ARCH_LIST if set, else the current device's target."""
    listed = paths.arch_list()
    if listed:
        return list(dict.fromkeys(normalize(a) for a in listed))
    return [current()]


def jit_target() -> str:
    """The architecture a JIT compile targets: the current GPU, else the first FLEXGEN_ARCH_LIST entry."""
    try:
        return current()
    except NoDeviceError:
        listed = paths.arch_list()
        if listed:
            return normalize(listed[0])
        raise


def capability(arch: str) -> tuple[int, int]:
    """(major, minor) of a target name: "sm_90a" -> (9, 0), "sm_120" -> (12, 0)."""
    m = re.fullmatch(r"sm_(\d+)(\d)a?", arch)
    if not m:
        raise UnsupportedArchError(f"{arch!r} is not a target name like 'sm_80' or 'sm_90a'")
    return int(m.group(1)), int(m.group(2))


def shared_memory_limit(arch: str) -> int:
    """Dynamic shared memory one CTA may use on a target."""
    return _SHARED_MEMORY_LIMIT.get(capability(arch), _SHARED_MEMORY_DEFAULT)


def resident_ctas(arch: str, threads: int, registers: int, shared_bytes: int) -> int:
    """How many CTAs of a kernel (threads per CTA, registers per thread, dynamic shared memory per CTA) one SM
    holds at once on a target: the least of what its threads, registers and shared memory allow (at least 1)."""
    cap = capability(arch)
    warps = -(-threads // 32)
    by_threads = _THREADS_PER_SM.get(cap, _THREADS_PER_SM_DEFAULT) // (32 * warps)
    per_warp = -(-registers * 32 // _REGISTER_UNIT) * _REGISTER_UNIT
    by_registers = 4 * (_REGISTERS_PER_QUARTER // per_warp) // warps if per_warp else by_threads
    shared_per_sm = shared_memory_limit(arch) + _SHARED_RESERVED_PER_CTA
    by_shared = shared_per_sm // (shared_bytes + _SHARED_RESERVED_PER_CTA)
    return max(1, min(by_threads, by_registers, by_shared, _CTAS_PER_SM.get(cap, _CTAS_PER_SM_DEFAULT)))
