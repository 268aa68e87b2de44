"""flexgen: a code-generating FlashAttention compiler for score_mod / mask_mod variants.

Porting FlexAttention code is one import:

    from flexgen import flex_attention, create_block_mask

Names are imported lazily so that `import flexgen` stays cheap and each stage
loads only when it is used.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "score_mod": ".dsl.api",
    "mask_mod": ".dsl.api",
    "and_masks": ".dsl.api",
    "or_masks": ".dsl.api",
    "noop_mask": ".dsl.api",
    "trace": ".dsl.api",
    "Mod": ".dsl.mod",
    "reference_attention": ".dsl.reference",
    "variants": ".dsl.variants",
    "emit": ".codegen.api",
    "compile": ".codegen.api",
    "KernelSpec": ".codegen.spec",
    "flex_attention": ".attention",
    "AuxRequest": ".attention",
    "AuxOutput": ".attention",
    "create_block_mask": ".make_block_mask",
    "create_mask": ".blockmask",
    "block_sparse_mask": ".blockmask",
    "BlockMask": ".blockmask",
    "FlexKernelOptions": ".torch_names",
}

# PyTorch's private flex_attention names that ported code imports (flexgen/torch_names.py); not in __all__.
_PRIVATE_EXPORTS = dict.fromkeys(
    ("_score_mod_signature", "_mask_mod_signature", "_identity", "_create_empty_block_mask",
     "_DEFAULT_SPARSE_BLOCK_SIZE", "_LARGE_SPARSE_BLOCK_SIZE", "_apply_kernel_options", "_WARNINGS_SHOWN",
     "flex_attention_hop"), ".torch_names")

__all__ = sorted(_EXPORTS) + ["__version__"]
_MISSING = object()


def __getattr__(name: str):
    if name in _EXPORTS or name in _PRIVATE_EXPORTS:
        module = importlib.import_module(_EXPORTS.get(name) or _PRIVATE_EXPORTS[name], __name__)
        value = module if name == "variants" else getattr(module, name)
    elif name.startswith("_") and not name.startswith("__"):
        # Any other private name of PyTorch's module is its machinery (scheduling metadata for its own kernels,
        # test helpers): handed through, so that code importing it with the operator keeps importing.
        value = getattr(importlib.import_module("torch.nn.attention.flex_attention"), name, _MISSING)
        if value is _MISSING:
            raise AttributeError(f"module 'flexgen' has no attribute {name!r}")
    else:  # (submodules too: `from . import x` asks here first)
        raise AttributeError(f"module 'flexgen' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return __all__
