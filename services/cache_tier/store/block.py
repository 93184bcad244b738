"""The value the block store keeps: one KV block's bytes plus the metadata that identifies and describes them.

``StoredBlock`` is frozen and validated at construction, so every tier can trust it:
- ``block_hash`` is the chained hash of ``shared/kv/block_hash.py`` (unsigned 64-bit; the model id and the
  tenant's cache salt are already inside it, so tenants never share a block).
- ``digest`` is the block's 32-byte chained digest (the hash is its low 64 bits: it covers every earlier
  token, the model fingerprint and the salt) and ``fingerprint`` the model build that computed the KV; both are
  empty for blocks stored without them (older senders, tools), which only a get naming neither can hit.
- ``token_ids`` are the block's tokens: a hit is confirmed by comparing them, the digest and the fingerprint
  (``matches``), never by hash alone, so neither a 64-bit collision nor another build's block is ever served.
- ``payload`` is the block's K and V for every layer as raw bytes, laid out as ``dtype[shape]``
  (e.g. shape ``[num_layers, 2, block_size, num_kv_heads, head_dim]``); ``len(payload)`` equals
  ``prod(shape) * itemsize(dtype)``. The store never interprets it beyond that check (no torch needed).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shared.errors import DeepinferError, ErrorCode, invalid
from shared.kv.kv_codec import COMPRESSED_DTYPES

MAX_HASH = (1 << 64) - 1
MAX_TOKEN_ID = (1 << 32) - 1     # block_hash packs token ids as uint32
MAX_BLOCK_TOKENS = 1024          # bounds a record's metadata (a block is 16 tokens by default)
MAX_SHAPE_DIMS = 8
MAX_DIGEST_BYTES = 64
MAX_FINGERPRINT_CHARS = 64
MAX_WRITER_CHARS = 128             # a subject token (shared/subjects.MAX_TOKEN_LEN)

# Wire names as in shared/kv/transport.py (handles' "dtype"), with their element sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
    "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    **{name: 1 for name in COMPRESSED_DTYPES},   # compressed rows as bytes (shared/kv/kv_codec.py)
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
    digest: bytes = b""          # chained digest (shared/kv/block_hash.py), or b""
    fingerprint: str = ""        # model build (shared/model/fingerprint.py), or ""
    writer: str = ""             # the service that put it (its NATS-bound id: shared/subjects.cache_put), or ""

    def __post_init__(self) -> None:
        check_hash(self.block_hash)
        check_identity(self.digest, self.fingerprint)
        if not isinstance(self.writer, str) or len(self.writer) > MAX_WRITER_CHARS or not self.writer.isascii():
            raise invalid(f"writer must be an ASCII str of at most {MAX_WRITER_CHARS}, got {self.writer!r:.40}")
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
        """Bytes the store accounts for this block in DRAM: payload, 4 per token id, digest and fingerprint."""
        return len(self.payload) + 4 * len(self.token_ids) + len(self.digest) + len(self.fingerprint) + \
            len(self.writer)

    def matches(self, token_ids: Sequence[int], digest: bytes = b"", fingerprint: str = "") -> bool:
        """Whether this block holds exactly ``token_ids`` and is the block ``digest`` of the build ``fingerprint``
        (the hit check every consumer makes)."""
        return self.mismatch(token_ids, digest, fingerprint) is None

    def mismatch(self, token_ids: Sequence[int], digest: bytes = b"", fingerprint: str = "") -> str | None:
        """None on a hit; ``"tokens"`` when the tokens differ; ``"identity"`` when they are equal but the digest
        or the build differs (a 64-bit hash collision, the same tokens under another prefix, or another build's
        block)."""
        if self.token_ids != tuple(token_ids):
            return "tokens"
        return None if self.digest == digest and self.fingerprint == fingerprint else "identity"

    def same_identity(self, other: "StoredBlock") -> bool:
        """Whether ``other`` claims to be this very block (hash, tokens, digest, build), whatever its bytes."""
        return self.block_hash == other.block_hash and other.mismatch(self.token_ids, self.digest,
                                                                      self.fingerprint) is None

    def conflicts_with(self, other: "StoredBlock") -> bool:
        """Whether ``other`` holds other bytes in this block's layout (same shape and dtype): a put the store
        keeps the first of and counts (nondeterminism, forgery). A block of another shape (e.g. without its
        window layers' rows: ``shared/kv/block_pack.py``) is another rendering, not a conflict."""
        return self.shape == other.shape and self.dtype == other.dtype and self.payload != other.payload


def check_identity(digest: object, fingerprint: object) -> None:
    """``invalid_request`` unless ``digest`` is bytes and ``fingerprint`` an ASCII str, both within bounds."""
    if not isinstance(digest, bytes) or len(digest) > MAX_DIGEST_BYTES:
        raise invalid(f"digest must be at most {MAX_DIGEST_BYTES} bytes, got {digest!r:.40}")
    if not isinstance(fingerprint, str) or len(fingerprint) > MAX_FINGERPRINT_CHARS or not fingerprint.isascii():
        raise invalid(f"fingerprint must be an ASCII str of at most {MAX_FINGERPRINT_CHARS}, got {fingerprint!r:.40}")


def check_blocks(blocks: object, max_blocks: int, max_block_bytes: int) -> None:
    """``blocks`` is a sequence of at most ``max_blocks`` ``StoredBlock`` of at most ``max_block_bytes`` payload
    bytes each, or ``invalid_request`` / ``payload_too_large``."""
    if not isinstance(blocks, Sequence) or len(blocks) > max_blocks:
        raise invalid(f"blocks must be a list of ≤ {max_blocks}")
    for block in blocks:
        if not isinstance(block, StoredBlock):
            raise invalid(f"not a StoredBlock: {type(block).__name__}")
        if len(block.payload) > max_block_bytes:
            raise DeepinferError(ErrorCode.PAYLOAD_TOO_LARGE, f"block {block.block_hash:016x} is "
                                 f"{len(block.payload)} bytes, max {max_block_bytes}")
