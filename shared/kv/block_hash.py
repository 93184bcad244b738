"""The one block-hash function of deepinfer: router, workers, cache tier and simulator all call this.

A block's identity is chained: ``H(parent_hash, token_ids, extra)``. The first block of a prompt carries
``extra = (model_id, cache_salt)`` so blocks never collide across models or tenants; later blocks inherit
that through the chain. Hashes are 64-bit unsigned ints (msgpack-friendly), stable across processes and
machines (blake2b, never Python's salted ``hash``).

Invariant: a hash is only a hint. Every consumer confirms a hit by comparing token ids.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT = 0  # parent value used for the first block of a sequence


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: tuple[str, ...] = ()) -> int:
    """Hash one block given its parent's hash, its tokens and (first block only) its extra keys."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<QI", parent_hash, len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    for item in extra:
        encoded = item.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return int.from_bytes(h.digest(), "little")


def first_block_extra(model_id: str, cache_salt: str = "") -> tuple[str, ...]:
    """Extra keys of a sequence's first block: the model and the tenant's cache salt."""
    return (model_id, cache_salt)


def hash_prompt_blocks(
    token_ids: Sequence[int], block_size: int, model_id: str, cache_salt: str = "",
    parent_hashes: Sequence[int] = (),
) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids`` (a partial last block has no hash).

    ``parent_hashes`` may hold already-computed hashes of a prefix of the blocks (extend incrementally):
    the result starts with them and hashes only the remaining full blocks.
    """
    hashes = list(parent_hashes)
    num_full = len(token_ids) // block_size
    extra = first_block_extra(model_id, cache_salt)
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else ROOT_PARENT
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else ()))
    return hashes
