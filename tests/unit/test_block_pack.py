"""Packed KV runs (shared/kv/block_pack.py): the window bitmap, and pack/unpack of logical blocks whose window
layers' rows travel only where present."""
import pytest
import torch

from shared.errors import DeepinferError
from shared.kv import block_pack
from shared.wire_fields import check_window_mask

L, WINDOW_LAYERS, BLOCK = 6, [0, 1, 2, 3, 4], [6, 2, 1, 4, 3]   # five window layers, one full (layer 5)


@pytest.mark.parametrize("flags", [[True] * 9, [False] * 3, [False, True] * 5, [False] * 8 + [True], [True]])
def test_mask_round_trip_and_all_present_is_empty(flags):
    mask = block_pack.encode_mask(flags)
    assert (mask == b"") == all(flags)
    assert block_pack.decode_mask(mask, len(flags)) == flags
    if mask:
        assert len(mask) == -(-len(flags) // 8)


@pytest.mark.parametrize("mask,n", [(b"\x01", 9), (b"\x01\x00", 3), (b"\xff", 3)])
def test_a_mask_that_cannot_describe_the_blocks_is_refused(mask, n):
    assert block_pack.check_mask(mask, n)
    with pytest.raises(DeepinferError, match="transfer_failed"):
        block_pack.decode_mask(mask, n)
    with pytest.raises(DeepinferError, match="invalid_request"):
        check_window_mask(mask, n)


def test_pack_keeps_full_rows_and_only_carried_window_rows():
    blocks = torch.arange(5 * L * 24, dtype=torch.float32).reshape(5, *BLOCK) + 1   # [5, L, 2, 1, 4, 3]
    flags = [False, False, True, False, True]
    packed = block_pack.pack(blocks, flags, WINDOW_LAYERS)
    assert list(packed.shape) == block_pack.packed_shape(flags, BLOCK, 1) == [3 * 1 + 2 * L, *BLOCK[1:]]
    assert torch.equal(packed[0], blocks[0, 5]) and torch.equal(packed[2:2 + L], blocks[2])
    back = block_pack.unpack(packed, flags, WINDOW_LAYERS, BLOCK)
    for j, carried in enumerate(flags):
        assert torch.equal(back[j, 5], blocks[j, 5])
        assert torch.equal(back[j, :5], blocks[j, :5] if carried else torch.zeros_like(blocks[j, :5]))
    assert block_pack.split_rows(flags, L, 1) == [1, 1, L, 1, L]


def test_a_run_of_whole_blocks_is_the_logical_tensor():
    blocks = torch.randn(3, *BLOCK)
    assert block_pack.pack(blocks, [True] * 3, WINDOW_LAYERS) is blocks
    assert block_pack.packed_shape([True] * 3, BLOCK, 1) == [3, *BLOCK]
    assert block_pack.unpack(blocks, [True] * 3, WINDOW_LAYERS, BLOCK) is blocks


def test_unpack_refuses_a_payload_of_another_shape():
    with pytest.raises(DeepinferError, match="transfer_failed"):
        block_pack.unpack(torch.zeros(4, *BLOCK[1:]), [False, True], WINDOW_LAYERS, BLOCK)
