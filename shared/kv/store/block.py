"""The value the block store keeps: one KV block's bytes plus the metadata that identifies and describes them.

``StoredBlock`` is frozen and validated at construction, so every tier can trust it:
- ``block_hash`` is the chained hash of ``shared/kv/block_hash.py`` (unsigned 64-bit; the model id and the
  tenant's cache salt are already inside it, so tenants never share a block).
- ``token_ids`` are the block's tokens: a hit is confirmed by comparing them, never by hash alone.
- ``payload`` is the block's K and V for every layer as raw bytes, laid out as ``dtype[shape]``
  (e.g. shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``); ``len(payload)`` equals
  ``prod(shape) * itemsize(dtype)``. The store never interprets it beyond that check (no torch needed).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import invalid

MAX_HASH = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 32) - 1     # block_hash packs token ids as uint32
MAX_BLOCK_TOKENS = 1024          # bounds a record's metadata (a block is 16 tokens by default)
MAX_SHAPE_DIMS = 8

# Wire names as in shared/kv/transport.py (handles' "dtype"), with their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
    "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def check_hash(block_hash: object) -> int:
    """``block_hash`` as an int, or ``invalid_request`` (bools and out-of-range ints are rejected)."""
    if type(block_hash) is not int or not 0 <= block_hash <= MAX_HASH:
        raise invalid(f"block hash must be an unsigned 64-bit int, got {block_hash!r:.40}")
    return block_hash


def check_token_ids(token_ids: object) -> tuple[int, ...]:
    """``token_ids`` as a tuple of uint32 ints (at most ``MAX_BLOCK_TOKENS``), or ``invalid_request``."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise invalid(f"token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    if not 0 < len(token_ids) <= MAX_BLOCK_TOKENS:
        raise invalid(f"a block holds 1..{MAX_BLOCK_TOKENS} tokens, got {len(token_ids)}")
    for t in token_ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise invalid(f"token ids must be uint32 ints, got {t!r:.40}")
    return tuple(token_ids)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One KV block as kept by the store. Invariant: ``len(payload) == prod(shape) * DTYPE_SIZES[dtype]``."""

    block_hash: int
    token_ids: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]
    payload: bytes               # dtype[shape], C order

    def __post_init__(self) -> None:
        check_hash(self.block_hash)
        object.__setattr__(self, "token_ids", check_token_ids(self.token_ids))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_SIZES:
            raise invalid(f"unknown KV dtype {self.dtype!r:.40}")
        if isinstance(self.shape, (str, bytes)) or not isinstance(self.shape, Sequence):
            raise invalid("shape must be a list of ints")
        if not 0 < len(self.shape) <= MAX_SHAPE_DIMS or any(type(s) is not int or s <= 0 for s in self.shape):
            raise invalid(f"shape must be 1..{MAX_SHAPE_DIMS} positive ints, got {list(self.shape)!r:.80}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise invalid(f"payload must be bytes, got {type(self.payload).__name__}")
        if not isinstance(self.payload, bytes):
            object.__setattr__(self, "payload", bytes(self.payload))   # own an immutable copy
        expect = math.prod(self.shape) * DTYPE_SIZES[self.dtype]
        if len(self.payload) != expect:
            raise invalid(f"payload is {len(self.payload)} bytes, {self.dtype}{list(self.shape)} needs {expect}")

    @property
    def nbytes(self) -> int:
        """Bytes the store accounts for this block in DRAM: payload plus 4 per token id."""
        return len(self.payload) + 4 * len(self.token_ids)

    def matches(self, token_ids: Sequence[int]) -> bool:
        """Whether this block holds exactly ``token_ids`` (the hit check every consumer makes)."""
        return self.token_ids == tuple(token_ids)
