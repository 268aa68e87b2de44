"""Host side of the TMA descriptors (runtime/tensor_maps.py): what is handed to cuTensorMapEncodeTiled for
each input layout, and the refusals that come before the driver is called. The encoded maps are exercised
by every sm90 forward test on the GPU."""
from __future__ import annotations

import pytest
import torch

from flexgen.runtime import tensor_maps
from flexgen.runtime.tensor_maps import TensorMapError, encode_args, tile_map


def test_contiguous_layout_gives_innermost_first_dims_and_byte_strides():
    t = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    dims, strides, box = encode_args(t, 128)
    assert dims == (128, 100, 3, 2)
    assert strides == (256, 256 * 100, 256 * 100 * 3)
    assert box == (64, 128, 1, 1)  # one 128-byte panel of 16-bit values
    assert encode_args(torch.empty(1, 1, 8, 128), 64)[2] == (32, 64, 1, 1)  # of fp32 (the dQ accumulator)


def test_sequence_major_layout_keeps_its_strides():
    # (B, L, H, D) memory seen as (B, H, L, D): a permuted view, as transformers passes.
    t = torch.empty(2, 50, 4, 64, dtype=torch.float16).transpose(1, 2)
    dims, strides, _ = encode_args(t, 64)
    assert dims == (64, 50, 4, 2)
    assert strides == (4 * 64 * 2, 64 * 2, 50 * 4 * 64 * 2)


def test_size_one_dims_get_valid_strides_and_broadcast_stays_zero():
    base = torch.empty(1, 1, 10, 64, dtype=torch.bfloat16)
    # A size-1 dim may report any stride (here 1, not a multiple of 16 bytes): it is replaced.
    odd = base.as_strided((1, 1, 10, 64), (1, 1, 64, 1))
    dims, strides, _ = encode_args(odd, 64)
    assert dims == (64, 10, 1, 1) and strides == (128, 1280, 1280)
    wide = base.expand(3, 1, 10, 64)  # a K/V batch of 1 broadcast over the query batch
    assert encode_args(wide, 64)[1][2] == 0


def test_refusals_come_before_the_driver():
    with pytest.raises(TensorMapError, match="float16 and bfloat16"):
        tile_map(torch.empty(1, 1, 8, 64, dtype=torch.float64), 64)
    rows_136_bytes_apart = torch.empty(1, 1, 8, 68, dtype=torch.bfloat16)[..., :64]
    with pytest.raises(TensorMapError, match="16-byte aligned"):
        tile_map(rows_136_bytes_apart, 64)


def test_cached_maps_are_keyed_by_everything_the_encoding_reads(monkeypatch):
    """A repeated call hits the cache without encoding; the same memory seen with other strides or another box
    height is encoded anew, with that layout's arguments."""
    encoded = []

    def fake_encode(out, dtype, rank, ptr, dims, strides, box, elem_strides, *flags):
        encoded.append((tuple(dims), tuple(strides), tuple(box)))
        return 0

    monkeypatch.setattr(tensor_maps, "_encoder", lambda: fake_encode)
    monkeypatch.setattr(tensor_maps, "make_context_current", lambda: 0)  # (the fake driver needs no context)
    monkeypatch.setattr(tensor_maps, "_layouts", type(tensor_maps._layouts)())
    memory = torch.empty(2 * 3 * 64 * 128, dtype=torch.bfloat16)
    bhld = memory.view(2, 3, 64, 128)
    blhd = memory.view(2, 64, 3, 128).transpose(1, 2)  # same pointer and shape, other strides
    first = tile_map(bhld, 128)
    assert tile_map(bhld, 128) is first and len(encoded) == 1
    tile_map(blhd, 128)
    tile_map(bhld, 64)
    dims, strides, box = encode_args(blhd, 128)
    assert encoded[1] == (dims, strides, box) and encoded[2][2] == (64, 64, 1, 1)
    assert len(encoded) == 3


def test_a_layout_encodes_each_address_once(monkeypatch):
    """A planned launch's outputs come at new addresses: each is encoded with the layout's arguments, once."""
    encoded = []

    def fake_encode(out, dtype, rank, ptr, dims, strides, box, elem_strides, *flags):
        encoded.append((ptr.value, tuple(dims), tuple(strides), tuple(box)))
        return 0

    monkeypatch.setattr(tensor_maps, "_encoder", lambda: fake_encode)
    monkeypatch.setattr(tensor_maps, "make_context_current", lambda: 0)
    monkeypatch.setattr(tensor_maps, "_layouts", type(tensor_maps._layouts)())
    a, b = (torch.empty(1, 2, 64, 128, dtype=torch.float16) for _ in range(2))
    layout = tensor_maps.map_layout(a, 64)
    assert tensor_maps.map_layout(b, 64) is layout  # same shape, strides, dtype and box height
    first = layout.at(a.data_ptr())
    assert layout.at(a.data_ptr()) is first and tile_map(a, 64) is first
    layout.at(b.data_ptr())
    dims, strides, box = encode_args(a, 64)
    assert encoded == [(a.data_ptr(), dims, strides, box), (b.data_ptr(), dims, strides, box)]
    with pytest.raises(TensorMapError, match="16-byte aligned"):
        layout.at(a.data_ptr() + 8)
