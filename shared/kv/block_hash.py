"""The one block-hash function of deepinfer: router, workers, cache tier and simulator all call this.

A block's identity is a chained 256-bit digest ``D_i = blake2b-256(D_{i-1}, token_ids_i, extra_i)`` with
``D_{-1} = ROOT_DIGEST``. The first block of a sequence carries ``extra = (model_fingerprint, cache_salt)``
(``shared/model/fingerprint.py``: weights, tokenizer, dtype, KV layout) so blocks never match across model
builds or tenants; later blocks inherit both through the chain. Its *key* ``K_i = block_key(D_i)`` is the
digest's low 64 bits: the msgpack-friendly int that indexes every cache (device prefix cache, cache-tier DRAM
and SSD index, the router's KV index) and travels in KV events and snapshots. Stable across processes and
machines (never Python's salted ``hash``).

Invariant: a key is only a hint. Every consumer that *serves* KV confirms a hit by comparing the block's full
digest and its token ids (the device prefix cache: ``shared/engine/block_manager.py``; the cache tier:
``services/cache_tier/store``, which also compares the model fingerprint); the router's KV index compares nothing, so
a key collision can only mislead placement, never what is served.

Why a 256-bit digest compared on every hit, and not the 64-bit chained hash with the parent compared: with
64-bit chained hashes, two different first blocks whose hashes collide make every later block of the two
chains collide too (the chain only sees the parent's 64 bits), so comparing the parent's hash cannot tell the
prefixes apart; at billions of distinct blocks a day such a collision is expected (birthday bound ~2^32). A
chain of 256-bit digests makes a wrong hit need a blake2b-256 collision (2^128 work even for an adversary,
the reason vLLM moved to SHA-256 block hashes). The digest rides beside the key only where KV is served
(tier puts/gets, the tier's records, the device cache's block keys: 32 bytes per block against ~0.1-10 MB of
KV), while msgpack ints, KV events, the router's index, the simulator and the SSD record headers keep their
64-bit keys unchanged. Hashing costs the same per block as the old 64-bit chain (one blake2b call; the
digest size does not change its work): see ``benchmarks/block_identity_cost.py``.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 32
ROOT_DIGEST = bytes(DIGEST_BYTES)  # the parent digest of a sequence's first block
KEY_MASK = (1 << 64) - 1  # a key is the digest's low 64 bits (tests narrow it to force collisions)


def hash_block(parent: bytes, token_ids: Sequence[int], extra: tuple[str, ...] = ()) -> bytes:
    """The digest of one block given its parent's digest, its tokens and (first block only) its extra keys."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    for item in extra:
        encoded = item.encode()
        h.update(struct.pack("<I", len(encoded)))
        h.update(encoded)
    return h.digest()


def block_key(digest: bytes) -> int:
    """The 64-bit key (unsigned int) that indexes the block of ``digest``."""
    return int.from_bytes(digest[:8], "little") & KEY_MASK


def first_block_extra(model_fingerprint: str, cache_salt: str = "") -> tuple[str, ...]:
    """Extra keys of a sequence's first block: the model build's fingerprint and the tenant's cache salt."""
    return (model_fingerprint, cache_salt)


def chain_digests(token_ids: Sequence[int], block_size: int, model_fingerprint: str, cache_salt: str = "",
                  done: Sequence[bytes] = ()) -> list[bytes]:
    """Chained digests of every *full* block of ``token_ids`` (a partial last block has none). ``done`` may hold
    the already-computed digests of a prefix of the blocks: the result starts with them and hashes only the
    remaining full blocks."""
    digests = list(done)
    extra = first_block_extra(model_fingerprint, cache_salt)
    for i in range(len(digests), len(token_ids) // block_size):
        parent = digests[i - 1] if i else ROOT_DIGEST
        digests.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else ()))
    return digests


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, model_fingerprint: str,
                       cache_salt: str = "") -> list[int]:
    """The keys of every full block of ``token_ids`` (what the router's KV index and the simulator look up)."""
    return [block_key(d) for d in chain_digests(token_ids, block_size, model_fingerprint, cache_salt)]


@dataclass(frozen=True, slots=True)
class BlockChain:
    """Consecutive blocks of one sequence as the cache tier names them: keys, digests and the model build.
    Invariant: ``len(keys) == len(digests)`` and ``keys[i] == block_key(digests[i])``."""

    model_fingerprint: str
    keys: tuple[int, ...]
    digests: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.digests):
            raise ValueError(f"{len(self.keys)} keys for {len(self.digests)} digests")

    @classmethod
    def of(cls, model_fingerprint: str, digests: Sequence[bytes]) -> BlockChain:
        return cls(model_fingerprint, tuple(block_key(d) for d in digests), tuple(digests))

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: slice) -> BlockChain:
        if not isinstance(index, slice):
            raise TypeError("a BlockChain is sliced, not indexed")
        return BlockChain(self.model_fingerprint, self.keys[index], self.digests[index])

    def packed_digests(self) -> bytes:
        """The digests concatenated (``DIGEST_BYTES`` each, in block order), as the wire carries them."""
        return b"".join(self.digests)


def unpack_digests(packed: bytes, count: int) -> list[bytes]:
    """``count`` digests from their concatenation; ``ValueError`` unless the length is exactly right."""
    if len(packed) != count * DIGEST_BYTES:
        raise ValueError(f"{len(packed)} digest bytes for {count} blocks of {DIGEST_BYTES}")
    return [packed[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] for i in range(count)]
