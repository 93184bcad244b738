"""On-disk record format of the SSD tier's segment files, and the scan that rebuilds the index from them.

A segment file is a plain concatenation of records, little-endian, no file header::

    magic u32 | kind u8 | reserved u8 | reserved u16 | block_hash u64 | expiry f64 | last_use f64
    | meta_len u32 | payload_len u32 | retention class 16s (ASCII, NUL-padded)     (56 bytes, ``_HEADER``)
    | header_crc u32                    crc32 of the 56 header bytes
    | meta (meta_len bytes: msgpack [token_ids, dtype, shape, digest, fingerprint, writer])
    | payload (payload_len bytes)
    | body_crc u32                      crc32 of meta+payload, seeded with the hash's low 32 bits

Kinds: ``KIND_BLOCK`` (a KV block) and ``KIND_TOUCH`` (no meta, no payload: "this block's expiry, last use
and class are at least these", written when hits extend a block's life).

Records written before blocks carried a digest and a model fingerprint have a 3-item meta; they decode to a
block with an empty digest and fingerprint, which no current worker's get can match (a directory kept across
that upgrade, or across a model swap, never serves the old KV: it ages out by retention and eviction).
Records written before blocks named their writer have a 5-item meta; they decode with writer ``""``.

Invariants:
- The header has a fixed size and its own crc, so a rebuild reads 60 bytes per record and seeks over the
  body; rewriting a record's retention state (compaction) changes only the header: the body and body crc are
  copied as they are, and the record keeps its exact length.
- Nothing is served unless both crcs match and the metadata decodes to a valid ``StoredBlock`` of the
  recorded hash: a torn or corrupt record is a miss, never wrong data.
- A record never exceeds ``max_length`` (the segment size), so a corrupt length cannot make a scan read or
  seek out of bounds.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import msgpack

from services.cache_tier.store.block import StoredBlock
from shared.retention import MAX_CLASS_NAME, BlockMeta

MAGIC = 0x31424B44               # b"DKB1"
KIND_BLOCK, KIND_TOUCH = 1, 2
_HEADER = struct.Struct(f"<IBBHQddII{MAX_CLASS_NAME}s")
_U32 = struct.Struct("<I")
PREFIX_BYTES = _HEADER.size + _U32.size   # 60
TOUCH_BYTES = PREFIX_BYTES + _U32.size    # a touch record's whole length
_SEED_MASK = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The fields a rebuild needs, read without touching the body."""

    kind: int
    block_hash: int
    retention: str
    expiry: float
    last_use: float
    meta_len: int
    payload_len: int
    length: int          # whole record bytes on disk: PREFIX_BYTES + meta_len + payload_len + 4

    def meta(self) -> BlockMeta:
        return BlockMeta(self.retention, self.expiry, self.last_use)


def _prefix(kind: int, block_hash: int, meta: BlockMeta, meta_len: int, payload_len: int) -> bytes:
    header = _HEADER.pack(MAGIC, kind, 0, 0, block_hash, meta.expiry, meta.last_use, meta_len, payload_len,
                          meta.retention.encode("ascii"))
    return header + _U32.pack(zlib.crc32(header))


def encode_block(block: StoredBlock, meta: BlockMeta) -> bytes:
    """One block record: the block's bytes and its retention state ``meta``."""
    meta_bytes = msgpack.packb([list(block.token_ids), block.dtype, list(block.shape), block.digest,
                                block.fingerprint, block.writer])
    body_crc = zlib.crc32(block.payload, zlib.crc32(meta_bytes, block.block_hash & _SEED_MASK))
    return b"".join((_prefix(KIND_BLOCK, block.block_hash, meta, len(meta_bytes), len(block.payload)),
                     meta_bytes, block.payload, _U32.pack(body_crc)))


def encode_touch(block_hash: int, meta: BlockMeta) -> bytes:
    """One touch record: the block's retention state is at least ``meta``."""
    return _prefix(KIND_TOUCH, block_hash, meta, 0, 0) + _U32.pack(block_hash & _SEED_MASK)


def rewrite_meta(record: bytes, header: RecordHeader, meta: BlockMeta) -> bytes:
    """``record`` (already verified) with its header rewritten to carry ``meta``; same length, same body."""
    return _prefix(header.kind, header.block_hash, meta, header.meta_len, header.payload_len) + \
        record[PREFIX_BYTES:]


def parse_prefix(prefix: bytes, max_length: int) -> RecordHeader | None:
    """The header of a record from its first ``PREFIX_BYTES``, or None if they are not a valid header."""
    if len(prefix) < PREFIX_BYTES:
        return None
    magic, kind, res1, res2, block_hash, expiry, last_use, meta_len, payload_len, name = \
        _HEADER.unpack_from(prefix)
    if magic != MAGIC or zlib.crc32(prefix[:_HEADER.size]) != _U32.unpack_from(prefix, _HEADER.size)[0]:
        return None
    if res1 or res2 or kind not in (KIND_BLOCK, KIND_TOUCH) or (kind == KIND_TOUCH and meta_len + payload_len):
        return None
    length = PREFIX_BYTES + meta_len + payload_len + _U32.size
    if length > max_length:
        return None
    name = name.rstrip(b"\0")
    if not name or not name.isascii():
        return None
    return RecordHeader(kind, block_hash, name.decode("ascii"), expiry, last_use, meta_len, payload_len, length)


def body_ok(record: bytes, header: RecordHeader) -> bool:
    """Whether a whole record's length and body crc match its header."""
    if len(record) != header.length:
        return False
    end = header.length - _U32.size
    crc = zlib.crc32(memoryview(record)[PREFIX_BYTES:end], header.block_hash & _SEED_MASK)
    return crc == _U32.unpack_from(record, end)[0]


def verify(record: bytes, block_hash: int, max_length: int) -> RecordHeader | None:
    """The header of a whole, intact record of ``block_hash``; None if torn, corrupt or another block's."""
    header = parse_prefix(record[:PREFIX_BYTES], max_length)
    if header is None or header.block_hash != block_hash or not body_ok(record, header):
        return None
    return header


def decode_block(record: bytes, block_hash: int, max_length: int) -> tuple[StoredBlock, BlockMeta] | None:
    """A whole block record -> (block, meta), or None if torn, corrupt or not the block ``block_hash``."""
    header = verify(record, block_hash, max_length)
    if header is None or header.kind != KIND_BLOCK:
        return None
    payload_at = PREFIX_BYTES + header.meta_len
    try:
        token_ids, dtype, shape, *identity = msgpack.unpackb(record[PREFIX_BYTES:payload_at])
        digest, fingerprint, writer = (*identity, "")[:3] if identity else (b"", "", "")  # older: 3 or 5 items
        block = StoredBlock(block_hash, token_ids, dtype, shape, record[payload_at:header.length - _U32.size],
                            digest, fingerprint, writer)
    except Exception:  # noqa: BLE001 - a crc-valid record that does not decode is corruption: a miss
        return None
    return block, header.meta()


@dataclass(slots=True)
class ScanResult:
    """What a segment scan found: the valid records, where the valid prefix ends, bodies that failed."""

    records: list[tuple[int, RecordHeader]]     # (offset, header), file order
    valid_end: int                              # bytes from 0 that hold whole records; the rest is torn
    bad_bodies: int                             # records skipped (header fine, body crc wrong)


def scan_segment(f: BinaryIO, file_size: int, verify_bodies: bool, max_length: int) -> ScanResult:
    """Walk the records of one segment file from offset 0.

    Stops at the first record whose header is invalid or that extends past ``file_size`` (a torn tail:
    everything from there on is unreachable). With ``verify_bodies`` every body's crc is checked too and a
    record that fails is skipped (the scan goes on after it: its header crc vouched for its length).
    Without it, bodies are seeked over (a buffered reader turns small seeks into buffer moves).
    """
    result = ScanResult([], 0, 0)
    offset = 0
    while offset < file_size:
        prefix = f.read(PREFIX_BYTES)
        header = parse_prefix(prefix, max_length)
        if header is None or offset + header.length > file_size:
            break
        rest = header.length - PREFIX_BYTES
        if verify_bodies:
            if not body_ok(prefix + f.read(rest), header):
                result.bad_bodies += 1
                offset += header.length
                result.valid_end = offset
                continue
        else:
            f.seek(rest, 1)
        result.records.append((offset, header))
        offset += header.length
        result.valid_end = offset
    return result
