"""PyTorch's private flex_attention names that ported code (PyTorch's own tests among it) imports from the
module flexgen replaces, and PyTorch's "empty" block mask, which holds at any length."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex_module

import flexgen
from flexgen import torch_names


def _dense(q, k, v, keep=None):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v.double()


def _inputs(lq=100, lkv=90, d=64):
    gen = torch.Generator().manual_seed(torch.seed())
    return tuple(torch.randn(2, 3, n, d, generator=gen, dtype=torch.float64) for n in (lq, lkv, lkv))


def _flex(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unfused path's notice
        return flexgen.flex_attention(*args, **kwargs)


def test_the_names_pytorchs_tests_import_exist():
    from flexgen import (_apply_kernel_options, _create_empty_block_mask, _DEFAULT_SPARSE_BLOCK_SIZE,  # noqa: F401
                         _identity, _LARGE_SPARSE_BLOCK_SIZE, _mask_mod_signature, _score_mod_signature,
                         _WARNINGS_SHOWN, flex_attention_hop)

    assert _DEFAULT_SPARSE_BLOCK_SIZE == torch_flex_module._DEFAULT_SPARSE_BLOCK_SIZE
    assert _LARGE_SPARSE_BLOCK_SIZE == torch_flex_module._LARGE_SPARSE_BLOCK_SIZE
    assert isinstance(_WARNINGS_SHOWN, set)
    assert "_identity" not in flexgen.__all__  # private, as in PyTorch
    assert set(torch_flex_module.__all__) <= set(flexgen.__all__)  # and every public name
    assert flexgen.FlexKernelOptions is torch_flex_module.FlexKernelOptions
    with pytest.raises(AttributeError, match="no attribute '_no_such_name'"):
        flexgen._no_such_name  # noqa: B018


def test_any_other_private_name_of_pytorchs_module_is_handed_through():
    """Newer PyTorch test files import more of the module's private machinery with the operator (the dQ write
    order of its deterministic kernels, from PyTorch 2.12); the import must not fail on flexgen."""
    private = sorted(n for n in vars(torch_flex_module) if n.startswith("_") and not n.startswith("__")
                     and not hasattr(torch_names, n))
    assert private, "PyTorch's module has private names flexgen does not define itself"
    for name in private:
        assert getattr(flexgen, name) is getattr(torch_flex_module, name), name
    if hasattr(torch_flex_module, "_compute_dq_write_order_from_block_mask"):
        from flexgen import _compute_dq_write_order_from_block_mask as write_order

        mask = lambda b, h, q, kv: q >= kv  # noqa: E731
        ours = write_order(flexgen.create_block_mask(mask, 2, 2, 512, 512, device="cpu"))
        theirs = write_order(torch_flex_module.create_block_mask(mask, 2, 2, 512, 512, device="cpu"))
        for a, b in zip(ours, theirs):
            assert (a is None and b is None) or torch.equal(a, b)
    for name in ("_no_such_name", "__wrapped__", "no_such_name"):  # neither module's: still an AttributeError
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(flexgen, name)


def test_identity_score_mod_and_empty_block_masks_attend_everything():
    q, k, v = _inputs()
    want = _dense(q, k, v)
    for bm in (flexgen._create_empty_block_mask(q, k), torch_flex_module._create_empty_block_mask(q, k)):
        got = _flex(q, k, v, score_mod=flexgen._identity, block_mask=bm)
        assert (got - want).abs().max().item() < 1e-12


def test_an_unbounded_block_with_a_mask_mod_is_rebuilt_for_the_lengths():
    q, k, v = _inputs(lq=70, lkv=130)
    causal = lambda b, h, qi, ki: qi + 60 >= ki  # noqa: E731
    one = dict(dtype=torch.int32)
    bm = flexgen.BlockMask.from_kv_blocks(torch.ones(1, 1, 1, **one), torch.zeros(1, 1, 1, 1, **one),
                                          BLOCK_SIZE=flexgen._LARGE_SPARSE_BLOCK_SIZE, mask_mod=causal,
                                          seq_lengths=(1, 1))
    keep = torch.arange(70)[:, None] + 60 >= torch.arange(130)[None, :]
    assert (_flex(q, k, v, block_mask=bm) - _dense(q, k, v, keep)).abs().max().item() < 1e-12


def test_return_lse_warns_once_until_the_shown_set_is_cleared():
    """As PyTorch's deprecation test does it: clear _WARNINGS_SHOWN, call with return_lse=True, see the FutureWarning."""
    from flexgen import _WARNINGS_SHOWN

    q = torch.randn(1, 2, 16, 16)
    _WARNINGS_SHOWN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flexgen.flex_attention(q, q, q, return_lse=True)
        flexgen.flex_attention(q, q, q, return_lse=True)
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning) and "return_lse is deprecated" in str(w.message)]
    assert len(deprecations) == 1
    with pytest.raises(ValueError, match="Cannot specify both return_lse and return_aux"):
        flexgen.flex_attention(q, q, q, return_lse=True, return_aux=flexgen.AuxRequest(lse=True))
