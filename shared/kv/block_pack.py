"""Packed KV blocks: how a run of logical blocks travels (hand-off, pre-copy, migration) and is stored (cache
tier) when the sender keeps sliding-window layers' KV only for the blocks their window can still see.

A logical block is ``[L, 2, kvh, block_size, D]`` (``shared/engine/kv_port.py``). A *packed run* of ``n`` blocks
is one tensor ``[rows, 2, kvh, block_size, D]``: block ``j`` contributes, in layer order, all ``L`` layer rows
when it carries its window rows (``has_window[j]``), else only the rows of its full-attention layers, so a window
layer's released rows never travel or take room on SSD. A run whose blocks all carry every layer is the
logical ``[n, L, 2, kvh, block_size, D]`` itself (same bytes; what a sender without KV groups stages straight
from its cache).

``window_mask`` (the wire field) is the bitmap of ``has_window``: bit ``j % 8`` of byte ``j // 8``; ``b""``
means every block carries every layer (a sender without KV groups). A model without window layers always
sends ``b""``. Sender and receiver agree on which layers are window layers because both serve the same model
build (the hand-off's and the tier's fingerprint check); the cache tier, which knows no model, is told how many
rows a block without window rows has (``full_layers``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.errors import DeepinferError, ErrorCode


def _failed(message: str) -> DeepinferError:
    return DeepinferError(ErrorCode.TRANSFER_FAILED, message)


def encode_mask(has_window: Sequence[bool]) -> bytes:
    """The wire bitmap of ``has_window`` (``b""`` when every block carries its window rows)."""
    if all(has_window):
        return b""
    out = bytearray(-(-len(has_window) // 8))
    for j, present in enumerate(has_window):
        if present:
            out[j // 8] |= 1 << (j % 8)
    return bytes(out)


def check_mask(mask: bytes, n: int) -> str | None:
    """Why ``mask`` cannot describe ``n`` blocks (wrong length, bits past block ``n - 1``), or None."""
    if not mask:
        return None
    if len(mask) != -(-n // 8):
        return f"{len(mask)} mask bytes for {n} blocks"
    if n % 8 and mask[-1] >> (n % 8):
        return f"mask bits set past block {n - 1}"
    return None


def decode_mask(mask: bytes, n: int) -> list[bool]:
    """``has_window`` of ``n`` blocks from the wire bitmap; ``transfer_failed`` if it cannot describe them."""
    problem = check_mask(mask, n)
    if problem:
        raise _failed(f"window mask: {problem}")
    if not mask:
        return [True] * n
    return [bool(mask[j // 8] >> (j % 8) & 1) for j in range(n)]


def packed_rows(has_window: Sequence[bool], num_layers: int, full_layers: int) -> int:
    """Layer rows of a packed run: ``num_layers`` per block with window rows, ``full_layers`` per other block."""
    carried = sum(1 for present in has_window if present)
    return carried * num_layers + (len(has_window) - carried) * full_layers


def packed_shape(has_window: Sequence[bool], block_shape: Sequence[int], full_layers: int) -> list[int]:
    """``[rows, 2, kvh, block_size, D]`` of a packed run (``block_shape`` is the logical block's), or
    ``[n, *block_shape]`` when every block carries every layer."""
    if all(has_window):
        return [len(has_window), *block_shape]
    return [packed_rows(has_window, block_shape[0], full_layers), *block_shape[1:]]


def _keep(has_window: Sequence[bool], window_layers: Sequence[int], num_layers: int,
          device: torch.device) -> torch.Tensor:
    """``[n * L]`` bool: which (block, layer) rows of the logical run are in the packed one."""
    is_window = torch.zeros(num_layers, dtype=torch.bool, device=device)
    is_window[list(window_layers)] = True
    carries = torch.tensor(list(has_window), dtype=torch.bool, device=device)
    return (~is_window[None, :] | carries[:, None]).reshape(-1)


def pack(blocks: torch.Tensor, has_window: Sequence[bool], window_layers: Sequence[int]) -> torch.Tensor:
    """The packed run (``packed_shape``) of logical ``blocks: [n, L, 2, kvh, bs, D]``."""
    n, num_layers = blocks.shape[0], blocks.shape[1]
    if all(has_window):
        return blocks
    keep = _keep(has_window, window_layers, num_layers, blocks.device)
    return blocks.reshape(n * num_layers, *blocks.shape[2:])[keep]


def check_packed(packed: torch.Tensor, has_window: Sequence[bool], block_shape: Sequence[int],
                 num_window_layers: int) -> None:
    """``transfer_failed`` unless ``packed`` is the packed run of ``has_window`` blocks of ``block_shape``."""
    want = packed_shape(has_window, block_shape, block_shape[0] - num_window_layers)
    if list(packed.shape) != want:
        raise _failed(f"packed KV {list(packed.shape)} does not match {want} for {len(has_window)} blocks")


def unpack(packed: torch.Tensor, has_window: Sequence[bool], window_layers: Sequence[int],
           block_shape: Sequence[int]) -> torch.Tensor:
    """``[n, L, 2, kvh, bs, D]`` logical blocks of a packed run; a window row that did not travel reads as
    zeros (an importer never reads it: ``shared/engine/hybrid_kv.py``). ``transfer_failed`` on a shape that
    does not match ``has_window``."""
    num_layers, n = block_shape[0], len(has_window)
    check_packed(packed, has_window, block_shape, len(window_layers))
    if all(has_window):
        return packed
    out = torch.zeros(n * num_layers, *block_shape[1:], dtype=packed.dtype, device=packed.device)
    out[_keep(has_window, window_layers, num_layers, packed.device)] = packed
    return out.reshape(n, *block_shape)


def split_rows(has_window: Sequence[bool], num_layers: int, full_layers: int) -> list[int]:
    """Rows each block of a packed run takes, in order (for cutting a run into stored blocks)."""
    return [num_layers if present else full_layers for present in has_window]
