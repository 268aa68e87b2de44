"""Target architectures: names, detection, and which template family serves each.

Targets are spelled like nvcc's `sm_XX`. sm_90 always becomes "sm_90a" so that
Hopper-only instructions are allowed (a cubin for sm_90a runs on every sm_90 GPU).
"""
from __future__ import annotations

import re

from .cache import paths

SUPPORTED = ("sm_80", "sm_86", "sm_89", "sm_90a")


class UnsupportedArchError(RuntimeError):
    pass


class NoDeviceError(UnsupportedArchError):
    """No CUDA device to detect the architecture from."""


def normalize(arch: str | int | tuple[int, int]) -> str:
    """Accepts "sm_80", "sm80", "80", "8.0", 80, (8, 0), "sm_90"/"sm_90a"; returns a SUPPORTED name."""
    if isinstance(arch, tuple):
        major, minor = arch
    else:
        text = str(arch).strip().lower()
        m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)(?:\.(\d))?(a?)", text)
        if not m:
            raise UnsupportedArchError(f"cannot read {arch!r} as a GPU architecture; write it like 'sm_80' or 'sm_90a'")
        digits, dot_minor, _ = m.groups()
        if dot_minor is not None:
            major, minor = int(digits), int(dot_minor)
        else:
            major, minor = divmod(int(digits), 10)
    return from_capability(major, minor)


def from_capability(major: int, minor: int) -> str:
    """The newest supported target whose cubins run on a GPU of compute capability major.minor."""
    if major < 8:
        raise UnsupportedArchError(
            f"compute capability {major}.{minor} is older than sm_80; flexgen kernels need an Ampere (sm_80) or newer GPU"
        )
    if major == 8:
        # cubins are forward compatible within a major version: sm_86 code runs on sm_87.
        return max((a for a in ("sm_80", "sm_86", "sm_89") if int(a[4]) <= minor), key=lambda a: int(a[4]))
    if major == 9:
        return "sm_90a"
    raise UnsupportedArchError(
        f"compute capability {major}.{minor} has no flexgen template family yet; supported targets are {', '.join(SUPPORTED)}"
    )


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


def family(arch: str) -> str:
    """Base template family for an architecture: sm80 (mma.sync, cp.async) serves every GPU from
    sm_80 on and every kernel kind. Hopper's forward can take the sm90 family instead: see
    forward_family."""
    sm = int(re.sub(r"\D", "", arch)[:2])
    if sm < 80:
        raise UnsupportedArchError(f"{arch} is older than sm_80")
    return "sm80"


# Head dims the sm90 templates cover (forward: templates/sm90/fwd.cu.j2, tile 128 x {64, 128}, two
# consumer warpgroups, two K/V stages, no dropout; backward: below).
SM90_HEAD_DIMS = (64, 128)


def forward_family(arch: str, head_dim: int, dropout: bool = False, tile_overrides: bool = False) -> str:
    """Template family the forward pass uses by default: sm90 (wgmma, a producer warpgroup,
    mbarriers) on Hopper where that template covers the call, else the base family. Tile
    overrides (BLOCK_M, BLOCK_N, num_warps, num_stages) are sm80 tile choices, so they keep sm80."""
    sm = int(re.sub(r"\D", "", arch)[:2])
    if sm == 90 and head_dim in SM90_HEAD_DIMS and not dropout and not tile_overrides:
        return "sm90"
    return family(arch)


# What the sm90 backward template covers (templates/sm90/bwd.cu.j2): KV tile 128 (two consumer
# warpgroups x 64 keys), 64 query rows per step, head dims SM90_HEAD_DIMS; no dropout, no buffer
# gradients, no backward tile options, block masks whose blocks are whole tiles.
SM90_BACKWARD_TILE = (64, 128)  # (query rows per step, key rows per CTA); codegen/configs.py's row


def sm90_backward_refusal(arch: str, head_dim: int, dropout: bool, buffer_grads: bool, tile_overrides: bool,
                          mask_block: tuple[int, int] | None) -> str | None:
    """Why the sm90 backward cannot take this call (None: it can)."""
    sm = int(re.sub(r"\D", "", arch)[:2])
    if sm != 90:
        return f"it needs an sm_90 GPU (wgmma), not {arch}"
    if head_dim not in SM90_HEAD_DIMS:
        return f"head dim {head_dim} is not one of {SM90_HEAD_DIMS}"
    if dropout:
        return "it has no dropout"
    if buffer_grads:
        return "it computes no score_mod buffer gradients"
    if tile_overrides:
        return "BLOCK_M1 / BLOCK_N1 / num_warps1 are sm80 backward tiles"
    if mask_block is not None and (mask_block[0] % SM90_BACKWARD_TILE[0] or mask_block[1] % SM90_BACKWARD_TILE[1]):
        return f"block mask BLOCK_SIZE {tuple(mask_block)} is not a multiple of its tile {SM90_BACKWARD_TILE}"
    return None


def resolve_backward_family(requested: str | None, arch: str, head_dim: int, dropout: bool, buffer_grads: bool,
                            tile_overrides: bool, mask_block: tuple[int, int] | None) -> str | None:
    """The backward's spec option "family": "sm90" where the Hopper backward covers the call (or
    where the user asked for it: an error says why it cannot), None for the base family."""
    if _checked_request(requested) == "sm80":
        return None
    why = sm90_backward_refusal(arch, head_dim, dropout, buffer_grads, tile_overrides, mask_block)
    if requested == "sm90" and why is not None:
        raise ValueError(f"kernel option family='sm90': the Hopper backward cannot run this call: {why}; "
                         "use family='sm80'")
    return "sm90" if why is None else None


FAMILY_CHOICES = ("sm80", "sm90")


def _checked_request(requested: str | None) -> str | None:
    """The kernel option "family" as given, once it is one of FAMILY_CHOICES (or None)."""
    if requested is not None and requested not in FAMILY_CHOICES:
        raise ValueError(f"kernel option family={requested!r}; allowed: {list(FAMILY_CHOICES)}")
    return requested


def resolve_forward_family(kind: str, requested: str | None, arch: str, head_dim: int, dropout: bool,
                           tile_overrides: bool) -> str | None:
    """The spec option "family" of a kernel: None for the base (sm80) family, "sm90" for the Hopper
    forward. requested "sm80" keeps the base family; "sm90" asks for the Hopper one (render.py refuses
    it where it does not apply); None picks forward_family's default for forward kernels."""
    if _checked_request(requested) == "sm80":
        return None
    if requested == "sm90" or kind != "fwd":
        return requested
    chosen = forward_family(arch, head_dim, dropout=dropout, tile_overrides=tile_overrides)
    return "sm90" if chosen == "sm90" else None
