"""Between the wire and the block store: a fetched packed run of KV blocks (``shared/kv/block_pack.py``) <->
``StoredBlock``s.

Invariants: a put's payload must be exactly the packed shape its header describes (``block_shape``,
``window_mask``, ``full_layers``) in the message's dtype (its handle says so before anything is fetched); each
stored block owns a copy of its rows only (a block without its window rows is stored with ``full_layers`` rows:
released window KV never takes room on DRAM or SSD) and carries the put's digest and model fingerprint, so it is
only ever served to a get naming both (``StoredBlock.matches``). A get serves only blocks whose dtype and layout
the requester can take (whole blocks of its ``block_shape``, or its ``full_layers`` rows when it names them); a
block of another layout ends the run, exactly like a miss, so an engine never imports KV it cannot use.
"""
from __future__ import annotations

import math

import torch

from shared import protocol
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_pack
from services.cache_tier.store import StoredBlock
from shared.kv.transport import handle_meta, parse_dtype, write_parts


def _has_window(put: protocol.CachePut) -> list[bool]:
    return block_pack.decode_mask(put.window_mask, len(put.block_hashes))


def check_put_handle(put: protocol.CachePut, max_block_bytes: int) -> None:
    """Refuse a put whose handle disagrees with its header, or whose blocks exceed the store's bound."""
    dtype, shape, nbytes = handle_meta(put.handle)
    want = block_pack.packed_shape(_has_window(put), put.block_shape, put.full_layers)
    if shape != want or dtype != parse_dtype(put.dtype):
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"put handle {shape} {dtype} disagrees with its "
                             f"header {want} {put.dtype}")
    whole = nbytes * put.block_shape[0] // block_pack.packed_rows(_has_window(put), put.block_shape[0],
                                                                   put.full_layers)   # one block, every layer
    if whole > max_block_bytes:
        raise DeepinferError(ErrorCode.PAYLOAD_TOO_LARGE, f"blocks of {whole} bytes exceed the tier's "
                             f"max_block_bytes {max_block_bytes}")


def to_blocks(put: protocol.CachePut, kv: torch.Tensor, writer: str) -> list[StoredBlock]:
    """Split the fetched packed run ``kv`` (``check_put_handle``'s shape) into one ``StoredBlock`` per hash (its
    rows only), each carrying its digest, the put's model fingerprint (what a get must name to be served it) and
    its ``writer``."""
    rows = kv.reshape(-1, math.prod(put.block_shape[1:]))                   # [layer rows, 2 * kvh * bs * D]
    rows = rows.view(torch.uint8) if kv.dtype != torch.uint8 else rows      # [layer rows, row bytes]
    counts = block_pack.split_rows(_has_window(put), put.block_shape[0], put.full_layers)
    bs, digests, tail = put.block_size, put.digests(), tuple(put.block_shape[1:])
    out, start = [], 0
    for i, h in enumerate(put.block_hashes):
        n = counts[i]
        out.append(StoredBlock(block_hash=h, token_ids=tuple(put.token_ids[i * bs:(i + 1) * bs]), dtype=put.dtype,
                               shape=(n, *tail), payload=rows[start:start + n].numpy().tobytes(),
                               digest=digests[i], fingerprint=put.model_fingerprint, writer=writer))
        start += n
    return out


def fits(block: StoredBlock, get: protocol.CacheGet) -> bool:
    """Whether ``block`` has a layout the requester takes: whole, or without window rows if it names
    ``full_layers``."""
    if block.dtype != get.dtype or list(block.shape[1:]) != list(get.block_shape[1:]):
        return False
    return block.shape[0] == get.block_shape[0] or (get.full_layers > 0 and block.shape[0] == get.full_layers)


def window_mask(blocks: list[StoredBlock], get: protocol.CacheGet) -> bytes:
    """The reply's bitmap: which served blocks carry every layer's rows."""
    return block_pack.encode_mask([b.shape[0] == get.block_shape[0] for b in blocks])


def payload_parts(blocks: list[StoredBlock], get: protocol.CacheGet) -> tuple[list[bytes], torch.dtype, list[int]]:
    """``(parts, dtype, shape)``: the blocks' bytes in order and the packed run they make
    (``block_pack.packed_shape``), for a transport to stage straight into its staging (``stage_parts``)."""
    has_window = [b.shape[0] == get.block_shape[0] for b in blocks]
    shape = block_pack.packed_shape(has_window, get.block_shape, get.full_layers)
    return [b.payload for b in blocks], parse_dtype(blocks[0].dtype), shape


def to_payload(blocks: list[StoredBlock], get: protocol.CacheGet) -> torch.Tensor:
    """One contiguous packed run (``payload_parts``' shape) holding the blocks' bytes in order (one copy each)."""
    parts, dtype, shape = payload_parts(blocks, get)
    out = torch.empty(shape, dtype=dtype)
    write_parts(out.view(-1).view(torch.uint8) if dtype != torch.uint8 else out.view(-1), parts)
    return out
