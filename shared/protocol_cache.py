"""The cache tier's wire messages (``subjects.cache(op, tier)``) and the stats messages every service answers
(``subjects.stats(service)``). Same codec and rules as every message (``shared.wire_validation``); import them
from ``shared.protocol``, which re-exports them.

Put (worker -> tier): the worker stages ``[n, *block_shape]`` KV through one of its KV transports and sends
``CachePut`` with the blocks' keys, chained digests, tokens and model fingerprint; the tier fetches, stores, and
replies ``Ack`` — then the worker releases its staging. Get (worker -> tier): ``CacheGet`` names the prompt
blocks the worker lacks the same way; the tier replies ``CacheGetReply`` with the leading run it holds (digest,
model fingerprint and tokens compared, unexpired, same layout), staged through a transport the worker offered,
and the fingerprint of what it staged; the worker fetches and publishes ``CacheRelease`` (the tier also
releases on its own after a timeout, so a vanished worker leaks nothing).

Identity (``shared/kv/block_hash.py``): ``block_hashes`` are 64-bit keys, ``block_digests`` the blocks' 32-byte
chained digests concatenated, and each key must be its digest's. Both identity fields are optional as a pair: a
sender that gives neither (older versions, tools) stores and finds only blocks put the same way, a namespace no
current worker reads, so a block is only ever served to a get naming the same digest and the same build.
"""
from __future__ import annotations

from typing import Any

from shared.kv.block_hash import DIGEST_BYTES, block_key, unpack_digests
from shared.kv.kv_codec import COMPRESSED_DTYPES
from shared.wire_fields import (check_fingerprint, check_id, check_one_of, check_range, check_window_mask,
                                check_worker, require)
from shared.wire_validation import MAX_MESSAGE_BYTES, WireModel, wire_field, wire_message

MAX_CACHE_CONTROL_BYTES = 64 * 1024
MAX_TIER_BLOCKS = 16384                 # blocks per put/get (the store's batch bound): 256K tokens at block size 16;
#                                         a get that long is ~1.5 MB of hashes, digests and tokens (max_payload 8 MB)
MAX_TIER_TOKENS = 1 << 20
MAX_BLOCK_SIZE = 1024
MAX_SHAPE_DIMS = 8
MAX_HASH = (1 << 64) - 1
KV_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
             "int64", "int32", "int16", "int8", "uint8", *COMPRESSED_DTYPES)


class _BlockList:
    """Rules of the messages that name blocks: hashes, their tokens, their layout."""
    __slots__ = ()

    def _check_blocks(self) -> None:
        check_id("transfer_id", self.transfer_id)
        check_worker("transfer_id", self.transfer_id)
        check_worker("worker_id", self.worker_id)
        check_id("tenant", self.tenant, allow_empty=True)
        check_id("retention", self.retention)
        require(bool(self.block_hashes), "field 'block_hashes': must not be empty")
        require(min(self.block_hashes) >= 0 and max(self.block_hashes) <= MAX_HASH,
                 "field 'block_hashes': hashes must be unsigned 64-bit ints")
        check_range("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        require(len(self.token_ids) == self.block_size * len(self.block_hashes),
                 f"field 'token_ids': {len(self.token_ids)} tokens for {len(self.block_hashes)} blocks of "
                 f"{self.block_size}")
        require(not self.token_ids or (min(self.token_ids) >= 0 and max(self.token_ids) < 1 << 32),
                 "field 'token_ids': token ids must be uint32")
        check_one_of("dtype", self.dtype, KV_DTYPES)
        require(0 < len(self.block_shape) <= MAX_SHAPE_DIMS and min(self.block_shape) > 0,
                 f"field 'block_shape': must be 1..{MAX_SHAPE_DIMS} positive ints")
        check_fingerprint("model_fingerprint", self.model_fingerprint)
        check_range("full_layers", self.full_layers, 0, self.block_shape[0])
        require(bool(self.block_digests) == bool(self.model_fingerprint),
                 "fields 'block_digests' and 'model_fingerprint' are given together or not at all")
        if self.block_digests:
            require(len(self.block_digests) == DIGEST_BYTES * len(self.block_hashes),
                     f"field 'block_digests': {len(self.block_digests)} bytes for {len(self.block_hashes)} blocks "
                     f"of {DIGEST_BYTES}")
            keys = [block_key(d) for d in unpack_digests(self.block_digests, len(self.block_hashes))]
            require(keys == self.block_hashes, "field 'block_hashes': each must be its digest's key")

    def digests(self) -> list[bytes]:
        """One digest per block (``b""`` each when the sender gave none)."""
        if not self.block_digests:
            return [b""] * len(self.block_hashes)
        return unpack_digests(self.block_digests, len(self.block_hashes))


@wire_message(MAX_MESSAGE_BYTES)
class CachePut(WireModel, _BlockList):
    """Worker -> tier: store these blocks for a request of class ``retention`` (accounted to ``tenant``); their
    KV, a packed run (``shared/kv/block_pack.py``) of ``block_shape`` blocks of ``dtype`` whose blocks without
    window rows have ``full_layers`` rows (``window_mask``), is fetchable through ``transport`` / ``handle``."""
    transfer_id: str
    worker_id: str
    retention: str
    block_hashes: list[int] = wire_field(max_len=MAX_TIER_BLOCKS)
    token_ids: list[int] = wire_field(max_len=MAX_TIER_TOKENS)   # block_size per block, in block order
    block_size: int
    dtype: str
    block_shape: list[int] = wire_field(max_len=MAX_SHAPE_DIMS)
    transport: str
    handle: dict[str, Any]
    tenant: str = ""
    block_digests: bytes = b""        # DIGEST_BYTES per block, in block order
    model_fingerprint: str = ""       # the build that computed the KV
    full_layers: int = 0              # layer rows of a block without window rows (0: the model has no windows)
    window_mask: bytes = b""          # which blocks carry their window rows (b"": all)

    def _check(self) -> None:
        self._check_blocks()
        require(bool(self.transport), "field 'transport': must not be empty")
        check_window_mask(self.window_mask, len(self.block_hashes))
        require(not self.window_mask or 0 < self.full_layers < self.block_shape[0],
                 "field 'window_mask': blocks without window rows need 0 < full_layers < block_shape[0]")


@wire_message(MAX_MESSAGE_BYTES)
class CacheGet(WireModel, _BlockList):
    """Worker -> tier: the leading run of these blocks you hold, staged through one of ``transports`` (the
    worker's, in its preference order; same-host ones only when the tier runs on ``host``). With
    ``full_layers`` the worker also takes blocks stored without their window rows (that many rows each)."""
    transfer_id: str
    worker_id: str
    retention: str
    block_hashes: list[int] = wire_field(max_len=MAX_TIER_BLOCKS)
    token_ids: list[int] = wire_field(max_len=MAX_TIER_TOKENS)
    block_size: int
    dtype: str
    block_shape: list[int] = wire_field(max_len=MAX_SHAPE_DIMS)
    transports: list[str] = wire_field(max_len=8)
    host: str = ""
    tenant: str = ""
    block_digests: bytes = b""
    model_fingerprint: str = ""       # the asking worker's build: only its blocks are served
    full_layers: int = 0              # as in CachePut (0: whole blocks only)

    def _check(self) -> None:
        self._check_blocks()
        require(bool(self.transports), "field 'transports': must not be empty")


@wire_message(MAX_CACHE_CONTROL_BYTES)
class CacheGetReply(WireModel):
    """Tier -> worker: ``num_blocks`` leading blocks (``dram_blocks`` served from DRAM, ``ssd_blocks`` from
    SSD) of the build ``model_fingerprint`` staged as a packed run (``window_mask``; ``[num_blocks,
    *block_shape]`` when empty) through ``transport`` / ``handle`` (empty when 0). A worker imports them only if
    that is its own build."""
    num_blocks: int
    dram_blocks: int = 0
    ssd_blocks: int = 0
    transport: str = ""
    handle: dict[str, Any] = wire_field(default_factory=dict)
    model_fingerprint: str = ""
    window_mask: bytes = b""

    def _check(self) -> None:
        check_fingerprint("model_fingerprint", self.model_fingerprint)
        check_range("num_blocks", self.num_blocks, 0, MAX_TIER_BLOCKS)
        check_window_mask(self.window_mask, self.num_blocks)
        require(self.dram_blocks >= 0 and self.ssd_blocks >= 0
                 and self.dram_blocks + self.ssd_blocks == self.num_blocks,
                 "fields 'dram_blocks' + 'ssd_blocks' must equal 'num_blocks'")
        require(self.num_blocks == 0 or (bool(self.transport) and bool(self.handle)),
                 "a reply with blocks needs a transport and a handle")


@wire_message(MAX_CACHE_CONTROL_BYTES)
class CacheRelease(WireModel):
    """Worker -> tier: done with ``transfer_id`` (fetched or given up); the tier frees its staging."""
    transfer_id: str

    def _check(self) -> None:
        check_worker("transfer_id", self.transfer_id)


@wire_message(MAX_CACHE_CONTROL_BYTES)
class StatsRequest(WireModel):
    """Anyone -> a service on ``subjects.stats(service)``: reply with a ``StatsReply``."""


@wire_message(MAX_MESSAGE_BYTES)
class StatsReply(WireModel):
    """A service's counters and accounting (keys documented by the service that sends them)."""
    worker_id: str
    role: str
    stats: dict[str, Any]

    def _check(self) -> None:
        check_worker("worker_id", self.worker_id)
