"""A worker's connection to its cache tier: pull missing prompt blocks, write computed blocks back.

Never on the token path and never fatal: a pull that fails, times out (``timeout_s``) or finds nothing
returns None and the worker computes the blocks itself; a write-back is staged while the worker still holds
the blocks, queued (at most ``max_queued``; more are dropped and counted) and sent by one background task,
which frees the staging once the tier acknowledged or the wait timed out. While the tier's heartbeats are
missing (dead, not started) both are skipped at once instead of waiting out timeouts.

Model identity: blocks are named by a ``BlockChain`` (keys, chained digests, this worker's model fingerprint);
the tier serves only blocks of that digest and build, and a reply naming another build is refused
(``model_mismatch``, counted as a failed pull: the blocks are computed here), so no other build's KV is imported.
"""
from __future__ import annotations

import asyncio
import math
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from shared.kv import block_pack
from shared.kv.block_hash import BlockChain
from shared.kv.kv_codec import KVCodec
from shared.protocol_cache import MAX_TIER_BLOCKS
from shared.kv.transport import KVTransport, parse_dtype, transfer_timeout
from shared.kv.transport_choice import common_transport

logger = logging.getLogger(__name__)

TIER_DEAD_AFTER_S = 3.0


@dataclass(slots=True)
class Pulled:
    first: int               # index of the first block pulled
    kv: torch.Tensor         # the packed run as fetched (block_pack; [n, *block_shape] when every block is whole,
                             # or after a codec's decode): KVPort.import_tier_blocks takes either form
    has_window: list[bool]   # per block: whether it carries its window layers' rows
    dram_blocks: int
    ssd_blocks: int


@dataclass(slots=True)
class TierCounters:
    pulls: int = 0
    pull_hits: int = 0
    pull_failures: int = 0
    blocks_pulled: int = 0
    writes: int = 0
    blocks_written: int = 0
    writes_dropped: int = 0
    write_failures: int = 0
    block_pull_s: float = 0.0   # EWMA seconds per block pulled (the router prices pulls with it)


@dataclass(slots=True)
class _Write:
    transport: KVTransport
    put: protocol.CachePut
    written: asyncio.Future | None = None   # set True once the tier acknowledged the put, False when it failed


class TierClient:
    def __init__(self, nc, worker_id: str, tier_id: str, host: str, transports: dict[str, KVTransport],
                 timeout_s: float = 2.0, max_queued: int = 16, codec: KVCodec | None = None) -> None:
        """``codec``: blocks travel to and from the tier in that compressed format (``shared/kv/kv_codec.py``);
        None: in the model's dtype."""
        self.nc, self.worker_id, self.tier_id, self.host = nc, worker_id, tier_id, host
        self.codec = codec
        self.transports, self.timeout_s = transports, timeout_s
        self.counters = TierCounters()
        self._queue: asyncio.Queue[_Write] = asyncio.Queue(max(1, max_queued))
        self._ids = itertools.count()
        self._tier: protocol.LoadReport | None = None
        self._tier_seen = 0.0
        self._tasks: list[asyncio.Task] = []
        self._sub = None
        self._first_beat = asyncio.Event()
        self._sending = False   # the writer holds a put whose staging the tier may still be fetching

    async def start(self, first_beat_wait_s: float = TIER_DEAD_AFTER_S) -> None:
        """Follow the tier's heartbeats; wait up to ``first_beat_wait_s`` for the first one, so a worker that
        starts next to a running tier uses it from its first request (a missing tier is only logged)."""
        self._sub = await self.nc.subscribe(subjects.load(self.tier_id, "cache_tier"), cb=self._on_heartbeat)
        self._tasks.append(asyncio.create_task(self._writer()))
        try:
            await asyncio.wait_for(self._first_beat.wait(), first_beat_wait_s)
        except asyncio.TimeoutError:
            logger.warning("%s: cache tier %s has not heartbeated; pulls and write-backs wait for it",
                           self.worker_id, self.tier_id)

    async def warm_staging(self, block_bytes: int, blocks: int = 8) -> int:
        """Pool staging for every write-back the queue can hold (``blocks`` blocks each; larger ones make their own
        segment once), so the first burst of write-backs does not create shared memory on the serving path.
        Only for a tier reached through ``shm`` (same host, heartbeat seen); returns the segments pooled."""
        name = self._transport() if self._tier is not None else None
        warm = getattr(self.transports.get(name), "warm", None)
        if warm is None:
            return 0
        return await warm(blocks * block_bytes, self._queue.maxsize + 1)

    async def _on_heartbeat(self, msg) -> None:
        with contextlib.suppress(Exception):
            report = protocol.decode(msg.data, protocol.LoadReport)
            self._tier, self._tier_seen = report, time.monotonic()
            self._first_beat.set()

    @property
    def alive(self) -> bool:
        return (self._tier is not None and not self._tier.draining
                and time.monotonic() - self._tier_seen < TIER_DEAD_AFTER_S)

    def _transport(self) -> str | None:
        tier = self._tier
        return common_transport(list(self.transports), tier.transports, tier.host == self.host)

    def _transfer_id(self, kind: str) -> str:
        return f"{kind}-{self.worker_id}-{next(self._ids)}"

    # -- pulls --------------------------------------------------------------------------------------------
    async def pull(self, first: int, chain: BlockChain, prompt: Sequence[int], block_size: int,
                   block_shape: list[int], dtype: str, tenant: str, retention: str,
                   window_layers: Sequence[int] = ()) -> Pulled | None:
        """Blocks ``first..`` of ``chain`` (the prompt's reusable blocks) that the tier holds, or None.
        ``window_layers``: the model's sliding-window layers (blocks stored without their rows are taken too)."""
        if first >= len(chain) or not self.alive:
            return None
        want = chain[first:first + MAX_TIER_BLOCKS]   # a longer prompt's tail is computed
        self.counters.pulls += 1
        t0 = time.perf_counter()
        tid = self._transfer_id("tg")
        codec, model_shape, model_dtype = self.codec, block_shape, dtype
        if codec is not None:   # ask for blocks of this format only
            dtype, block_shape = codec.wire_dtype, codec.encoded_shape(block_shape)
        reply = None
        try:
            get = protocol.CacheGet(transfer_id=tid, worker_id=self.worker_id, retention=retention,
                                    block_hashes=list(want.keys), block_digests=want.packed_digests(),
                                    model_fingerprint=want.model_fingerprint,
                                    token_ids=list(prompt[first * block_size:(first + len(want)) * block_size]),
                                    block_size=block_size, dtype=dtype, block_shape=block_shape,
                                    transports=list(self.transports), host=self.host, tenant=tenant,
                                    full_layers=block_shape[0] - len(window_layers) if window_layers else 0)
            most = len(want) * math.prod(block_shape) * parse_dtype(dtype).itemsize   # the tier stages, then replies
            msg = await self.nc.request(subjects.cache("get", self.tier_id), protocol.encode(get),
                                        timeout=transfer_timeout(self.timeout_s, most))
            reply = protocol.decode_reply(msg.data, protocol.CacheGetReply)
            if reply.num_blocks == 0:
                return None
            if reply.model_fingerprint != want.model_fingerprint:
                raise DeepinferError(ErrorCode.MODEL_MISMATCH, f"tier staged blocks of build "
                                     f"{reply.model_fingerprint or '(unnamed)'}, not {want.model_fingerprint}")
            transport = self.transports.get(reply.transport)
            if transport is None:
                raise ValueError(f"tier staged through {reply.transport!r}, not offered here")
            packed = await transport.fetch(reply.handle, timeout=transfer_timeout(   # block_pack.packed_shape
                self.timeout_s, int(reply.handle.get("nbytes", 0))))
            has_window = block_pack.decode_mask(reply.window_mask, reply.num_blocks)
            kv = packed   # imported as it is (no unpacked copy of the run), unless a codec decodes it
            if codec is not None:   # [n, L, row_bytes] -> [n, *model_shape]
                kv = block_pack.unpack(packed, has_window, window_layers, block_shape)
                kv = await asyncio.to_thread(codec.decode, kv, model_shape, parse_dtype(model_dtype))
            else:
                block_pack.check_packed(packed, has_window, block_shape, len(window_layers))
        except Exception as err:  # noqa: BLE001 - any failure means: compute the blocks here
            self.counters.pull_failures += 1
            logger.info("tier pull from %s failed (%s): computing instead", self.tier_id, err)
            return None
        finally:
            if reply is not None and reply.num_blocks:
                with contextlib.suppress(Exception):
                    await self.nc.publish(subjects.cache("release", self.tier_id),
                                          protocol.encode(protocol.CacheRelease(transfer_id=tid)))
        per_block = (time.perf_counter() - t0) / reply.num_blocks
        c = self.counters
        c.block_pull_s = per_block if c.block_pull_s == 0 else 0.8 * c.block_pull_s + 0.2 * per_block
        c.pull_hits += 1
        c.blocks_pulled += reply.num_blocks
        return Pulled(first, kv, has_window, reply.dram_blocks, reply.ssd_blocks)

    # -- write-back ---------------------------------------------------------------------------------------
    async def write_back(self, kv_cache: torch.Tensor, block_ids: Sequence[int], chain: BlockChain,
                         token_ids: Sequence[int], block_size: int, tenant: str, retention: str,
                         window_mask: bytes = b"", full_layers: int = 0, block_shape: Sequence[int] = (),
                         written: asyncio.Future | None = None) -> bool:
        """Stage ``kv_cache[block_ids]`` (the blocks ``chain`` names, in order; with ``window_mask`` the rows of a
        packed run, ``KVPort.source``, of ``block_shape`` blocks whose blocks without window rows
        have ``full_layers`` rows) now
        (the caller holds those blocks until this returns) and queue it for the tier. False (counted) when the
        tier is away, the queue is full or staging fails. ``written``, when given, is set once the put is sent: True
        if the tier acknowledged it, False if it failed (left unset when this returns False)."""
        if not block_ids:
            return False
        if len(block_ids) > MAX_TIER_BLOCKS:   # one put's bound: such a run is not written (counted)
            self.counters.writes_dropped += 1
            logger.warning("write-back of %d blocks exceeds a put's %d: not written", len(block_ids),
                           MAX_TIER_BLOCKS)
            return False
        name = self._transport() if self.alive else None
        if name is None or self._queue.full():
            self.counters.writes_dropped += 1
            return False
        transport, tid = self.transports[name], self._transfer_id("wb")
        block_shape = list(block_shape or kv_cache.shape[1:])
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        if self.codec is not None:   # the rows compressed into a new tensor: staged from it
            kv_cache = await asyncio.to_thread(self.codec.encode, kv_cache[list(block_ids)])  # [n, (L,) row_bytes]
            block_ids, block_shape = range(len(kv_cache)), self.codec.encoded_shape(block_shape)
            dtype = self.codec.wire_dtype
        nbytes = len(block_ids) * kv_cache[0].numel() * kv_cache.element_size()
        if transport.budget.used + nbytes > transport.budget.max_bytes:   # never wait for room here
            self.counters.writes_dropped += 1
            return False
        try:
            handle = await transport.stage_blocks(kv_cache, list(block_ids), tid)
        except Exception as err:  # noqa: BLE001 - staging full: drop this write-back
            self.counters.writes_dropped += 1
            logger.debug("write-back not staged: %s", err)
            return False
        put = protocol.CachePut(transfer_id=tid, worker_id=self.worker_id, retention=retention,
                                block_hashes=list(chain.keys), block_digests=chain.packed_digests(),
                                model_fingerprint=chain.model_fingerprint, token_ids=list(token_ids),
                                block_size=block_size, dtype=dtype, block_shape=block_shape, transport=name,
                                handle=handle, tenant=tenant,
                                full_layers=full_layers, window_mask=window_mask)
        try:
            self._queue.put_nowait(_Write(transport, put, written))
        except asyncio.QueueFull:
            await transport.release(tid)
            self.counters.writes_dropped += 1
            return False
        return True

    async def _writer(self) -> None:
        while True:
            job = await self._queue.get()
            self._sending = True
            try:
                # the tier fetches the staging and stores it before it acks: the wait grows with the bytes (a
                # 77K-token context's 950 MB put outlasted a fixed 10 s and was lost)
                nbytes = int(job.put.handle.get("nbytes", 0)) if isinstance(job.put.handle, dict) else 0
                msg = await self.nc.request(subjects.cache_put(self.tier_id, self.worker_id), protocol.encode(job.put),
                                            timeout=transfer_timeout(max(self.timeout_s, 10.0), nbytes))
                protocol.decode_reply(msg.data, protocol.Ack)
                self.counters.writes += 1
                self.counters.blocks_written += len(job.put.block_hashes)
                _settle(job.written, True)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - the tier misses these blocks; the worker goes on
                self.counters.write_failures += 1
                _settle(job.written, False)
                logger.info("write-back to %s failed: %s", self.tier_id, err)
            finally:
                self._sending = False
                await job.transport.release(job.put.transfer_id)

    async def close(self, flush_s: float = 2.0) -> None:
        """Send what is queued (and let the put in flight finish) for up to ``flush_s``, then stop and free all
        staging."""
        deadline = time.monotonic() + flush_s
        while (self._sending or not self._queue.empty()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            await job.transport.release(job.put.transfer_id)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def stats(self) -> dict:
        c = self.counters
        return {"tier": self.tier_id, "alive": self.alive, "pulls": c.pulls, "pull_hits": c.pull_hits,
                "pull_failures": c.pull_failures, "blocks_pulled": c.blocks_pulled, "writes": c.writes,
                "blocks_written": c.blocks_written, "writes_dropped": c.writes_dropped,
                "write_failures": c.write_failures, "block_pull_s": c.block_pull_s, "queued": self._queue.qsize()}


def _settle(written: asyncio.Future | None, ok: bool) -> None:
    if written is not None and not written.done():
        written.set_result(ok)
