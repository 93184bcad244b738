"""Between the wire and the block store: a fetched KV payload ``[n, *block_shape]`` <-> ``StoredBlock``s.

Invariants: a put's payload must be exactly ``[len(block_hashes), *block_shape]`` of the message's dtype
(its handle says so before anything is fetched); each stored block owns a copy of its bytes and carries the
put's digest and model fingerprint, so it is only ever served to a get naming both (``StoredBlock.matches``).
A get serves only blocks whose dtype and shape equal the requester's (a block of another layout ends the run,
exactly like a miss), so an engine never imports KV it cannot use.
"""
from __future__ import annotations

import numpy as np
import torch

from shared import protocol
from shared.errors import DeepinferError, ErrorCode
from shared.kv.store import StoredBlock
from shared.kv.transport import handle_meta, parse_dtype


def check_put_handle(put: protocol.CachePut, max_block_bytes: int) -> None:
    """Refuse a put whose handle disagrees with its header, or whose blocks exceed the store's bound."""
    dtype, shape, nbytes = handle_meta(put.handle)
    want = [len(put.block_hashes), *put.block_shape]
    if shape != want or dtype != parse_dtype(put.dtype):
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"put handle {shape} {dtype} disagrees with its "
                             f"header {want} {put.dtype}")
    if nbytes // max(1, len(put.block_hashes)) > max_block_bytes:
        raise DeepinferError(ErrorCode.PAYLOAD_TOO_LARGE, f"blocks of {nbytes // len(put.block_hashes)} bytes "
                             f"exceed the tier's max_block_bytes {max_block_bytes}")


def to_blocks(put: protocol.CachePut, kv: torch.Tensor, writer: str) -> list[StoredBlock]:
    """Split the fetched ``kv`` ([n, *block_shape]) into one ``StoredBlock`` per hash, each carrying its digest
    and the put's model fingerprint (what a get must name to be served it) and its ``writer``."""
    flat = kv.reshape(len(put.block_hashes), -1).view(torch.uint8) if kv.dtype != torch.uint8 else \
        kv.reshape(len(put.block_hashes), -1)
    bs, digests = put.block_size, put.digests()
    return [StoredBlock(block_hash=h, token_ids=tuple(put.token_ids[i * bs:(i + 1) * bs]), dtype=put.dtype,
                        shape=tuple(put.block_shape), payload=flat[i].numpy().tobytes(), digest=digests[i],
                        fingerprint=put.model_fingerprint, writer=writer)
            for i, h in enumerate(put.block_hashes)]


def fits(block: StoredBlock, get: protocol.CacheGet) -> bool:
    """Whether ``block`` has the requester's layout."""
    return block.dtype == get.dtype and list(block.shape) == list(get.block_shape)


def to_payload(blocks: list[StoredBlock]) -> torch.Tensor:
    """One contiguous tensor ``[n, *block_shape]`` holding the blocks' bytes in order (one copy each)."""
    first = blocks[0]
    dtype = parse_dtype(first.dtype)
    out = torch.empty((len(blocks), *first.shape), dtype=dtype)          # [n, *block_shape]
    rows = out.view(len(blocks), -1).view(torch.uint8) if dtype != torch.uint8 else out.view(len(blocks), -1)
    dst = rows.numpy()
    for i, block in enumerate(blocks):
        dst[i] = np.frombuffer(block.payload, dtype=np.uint8)
    return out
