"""Cache-tier service: one block store (DRAM in front of an SSD directory, ``services/cache_tier/store``) served over
NATS on ``subjects.cache(op, tier_id)``, with its holdings published as KV events (tier ``cache_tier``).

- ``put`` (``subjects.cache_put(tier_id, writer)``): fetch the worker's staged KV through the named transport,
  store every block under its chained hash with the request's retention class and its writer (the subject's,
  which must equal the body's ``worker_id``: an instance's NATS user may publish only its own; kept on disk and
  counted per writer in the ledger), reply ``Ack`` (the worker then frees its staging). A block already held
  keeps its first writer's bytes. The Ack means in DRAM: a chat/agent block is on SSD within ``write_behind_s``
  (it survives a SIGKILL from then on).
- ``get``: the leading run of the asked blocks that the store holds (token ids, chained digest and model
  fingerprint compared, unexpired, the requester's layout), staged through a transport the worker offered;
  reply ``CacheGetReply`` naming the fingerprint served; the staging is freed on ``release`` or after
  ``stage_ttl_s``. A get that finds no room to stage is answered 0 blocks. A block of another model build
  (a directory kept across a model swap under the same name) is never served: it is a miss.
- ``stats``: store counters, per tenant/class ledger, config. Heartbeats on ``load.<tier_id>``.

Invariants: bad input (garbage msgpack, unknown hash, wrong shape, oversize, unknown class) gets an error
reply or a 0-block answer and changes nothing already stored; every wait is bounded (fetch timeout, stage
timeout, release TTL); KV events name only blocks the store held when they were sent, and removals (evictions,
expiries) follow within ``gc_interval_s``. SIGTERM: withdraw, finish in-flight operations, flush the store.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time

from shared.host_identity import host_id
from shared import protocol, subjects
from shared.bus import Service, ServiceRuntime, connect, service_main
from services.cache_tier.config import CacheTierConfig
from shared.errors import DeepinferError, ErrorCode
from shared.kv_events import KVEventPublisher
from shared.kv.registry import available_transports, make_transport
from services.cache_tier.store import RetentionPolicy, StoreConfig, TieredBlockStore
from services.cache_tier.store.dram_reserve import reserve_heap
from shared.kv.transport import handle_meta, transfer_timeout
from shared.kv.transport_choice import common_transport
from services.cache_tier.metrics import CacheTierMetrics
from shared.metrics.server import MetricsServer
from services.cache_tier.blocks import check_put_handle, fits, payload_parts, to_blocks, window_mask
from services.cache_tier.ledger import TierLedger

logger = logging.getLogger(__name__)

GET_STAGE_TIMEOUT_S = 0.5  # a get waits at most this for staging room, then answers 0 blocks


class CacheTierService(Service):
    def __init__(self, config: CacheTierConfig) -> None:
        self.config = config
        self.host = host_id(config.host_id)
        self.store: TieredBlockStore | None = None
        self.nc = None
        self.transports: dict = {}
        self.ledger = TierLedger()
        self.announced: set[int] = set()   # hashes published as stored (minus those published as removed)
        self._releases: dict[str, asyncio.TimerHandle] = {}
        self._gc_runs = 0
        self._maintainer: asyncio.Task | None = None   # the GC loop, cancelled before the store closes
        self.metrics = CacheTierMetrics(config.worker_id)  # read from the store and ledger at scrape time
        self.metrics.watch(self)
        self.metrics_server = MetricsServer(self.metrics.registry, config.worker_id)

    async def start(self) -> None:
        c = self.config
        logger.info("starting %s with %s", c.worker_id, c)
        os.makedirs(c.directory, exist_ok=True)
        store_config = StoreConfig(directory=c.directory, dram_bytes=c.dram_mb << 20, ssd_bytes=c.ssd_mb << 20,
                                   segment_bytes=c.segment_mb << 20, max_block_bytes=(c.segment_mb << 20) // 2,
                                   fsync=c.fsync, write_behind_s=c.write_behind_s,
                                   retention=RetentionPolicy.from_spec(c.retention))
        self.store = await TieredBlockStore.open(store_config)
        logger.info("%s: store open at %s: %s", c.worker_id, c.directory, self.store.stats())
        self.nc = await connect(c.nats_url, c.worker_id, on_closed=self._on_nats_closed, user=c.nats_user,
                                password=c.nats_password)
        self.events = KVEventPublisher(self.nc, c.worker_id, self._held_hashes, tier="cache_tier")
        wanted = [t.strip() for t in c.transports.split(",") if t.strip()]
        offered = [t for t in wanted if t in available_transports() and t != "cuda_ipc"]
        self.transports = {t: make_transport(t, self.nc, c.worker_id, max_staged_bytes=c.max_staged_mb << 20,
                                             stage_timeout=GET_STAGE_TIMEOUT_S) for t in offered}
        info = protocol.WorkerInfo(worker_id=c.worker_id, role="cache_tier", model_id="", host=self.host,
                                   pid=os.getpid(), transports=offered, block_size=0, started_at=time.time())
        self.runtime = ServiceRuntime(self.nc, info, heartbeat_s=c.heartbeat_s, registry_replicas=c.registry_replicas)
        rt = self.runtime
        await rt.serve(subjects.cache_puts(c.worker_id), self.on_put)
        await rt.serve(subjects.cache("get", c.worker_id), self.on_get)
        await rt.serve(subjects.cache("release", c.worker_id), self.on_release, work=False)
        await rt.serve(subjects.cache("stats", c.worker_id), self.on_stats, work=False)
        await rt.serve(subjects.stats(c.worker_id), self.on_stats, work=False)
        await rt.serve(subjects.ctl(c.worker_id, "kv_snapshot"), self.events.on_snapshot, work=False)
        held = await self.store.hashes()
        self.announced = set(held)
        self.events.sink("stored", sorted(held))        # what survived a restart is known at once
        self.events.start()
        self._maintainer = rt.spawn(self._maintenance())
        rt.start_heartbeat(self._load)
        if c.metrics_port:
            await self.metrics_server.start(c.metrics_port)
        logger.info("%s ready: %d blocks held, transports %s", c.worker_id, len(held), offered)

    def _load(self) -> dict:
        s = self.store.stats()
        budget = max(1, self.store.config.ssd_write_budget)
        return {"num_running": 0, "num_waiting": self.runtime.num_inflight,
                "kv_usage": min(1.0, s["ssd_live_bytes"] / budget), "num_free_blocks": 0,
                "num_total_blocks": s["ssd_blocks"] + s["dram_blocks"], "kv_event_seq": self.events.seq}

    async def _held_hashes(self) -> list[int]:
        return sorted(self.announced)

    # -- operations ---------------------------------------------------------------------------------------
    async def on_put(self, msg) -> None:
        t0 = time.perf_counter()
        put = protocol.decode(msg.data, protocol.CachePut)
        writer = subjects.cache_put_writer(msg.subject)  # NATS permissions bind it to the credential
        if put.worker_id != writer:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"put by {put.worker_id!r:.40} sent as {writer!r}")
        self.store.config.retention.ttl(put.retention)               # unknown class: invalid_request
        transport = self.transports.get(put.transport)
        if transport is None:
            raise DeepinferError(ErrorCode.INVALID_REQUEST, f"transport {put.transport!r} not offered here")
        check_put_handle(put, self.store.config.max_block_bytes)
        kv = await transport.fetch(put.handle, timeout=transfer_timeout(self.config.fetch_timeout_s,   # packed
                                                                         handle_meta(put.handle)[2]))
        blocks = to_blocks(put, kv, writer)
        self.metrics.transfer("put", put.transport, len(blocks))
        new = [b.block_hash for b in blocks if self.store.where(b.block_hash) is None]
        await self.store.put_many(blocks, put.retention)
        self.ledger.record_put(put.tenant, put.retention, len(blocks), sum(len(b.payload) for b in blocks), writer)
        fresh = [h for h in new if h not in self.announced]
        self.announced.update(fresh)
        if fresh:
            self.events.sink("stored", fresh)
        self.metrics.operation("put", time.perf_counter() - t0)
        if msg.reply:
            await msg.respond(protocol.encode(protocol.Ack(detail=f"{len(new)} new")))

    async def on_get(self, msg) -> None:
        t0 = time.perf_counter()
        get = protocol.decode(msg.data, protocol.CacheGet)
        self.store.config.retention.ttl(get.retention)
        found, dram, bs, digests = [], 0, get.block_size, get.digests()
        for i, block_hash in enumerate(get.block_hashes):
            where = self.store.where(block_hash)
            block = None if where is None else await self.store.get(
                block_hash, get.token_ids[i * bs:(i + 1) * bs], get.retention, digests[i], get.model_fingerprint)
            if block is None or not fits(block, get):
                break
            found.append(block)
            dram += where == "dram"
        reply = await self._stage(get, found, dram)
        self.ledger.record_get(get.tenant, get.retention, len(get.block_hashes), reply.dram_blocks,
                               reply.ssd_blocks, reply.num_blocks * bs, sum(len(b.payload) for b in found)
                               if reply.num_blocks else 0)
        self.metrics.operation("get", time.perf_counter() - t0)
        if msg.reply:
            await msg.respond(protocol.encode(reply))

    async def _stage(self, get: protocol.CacheGet, found: list, dram: int) -> protocol.CacheGetReply:
        name = common_transport(list(self.transports), get.transports, get.host == self.host)
        if not found or name is None:
            return protocol.CacheGetReply(num_blocks=0)
        try:
            parts, dtype, shape = payload_parts(found, get)   # straight into the transport's staging
            handle = await self.transports[name].stage_parts(parts, dtype, shape, get.transfer_id)
        except DeepinferError as err:       # staging full or a duplicate transfer id: serve nothing
            logger.info("get %s: not staged: %s", get.transfer_id, err)
            return protocol.CacheGetReply(num_blocks=0)
        self.metrics.transfer("get", name, len(found))
        loop = asyncio.get_running_loop()
        self._releases[get.transfer_id] = loop.call_later(
            self.config.stage_ttl_s, lambda: self.runtime.spawn(self._release(get.transfer_id)))
        return protocol.CacheGetReply(num_blocks=len(found), dram_blocks=dram, ssd_blocks=len(found) - dram,
                                      transport=name, handle=handle, model_fingerprint=get.model_fingerprint,
                                      window_mask=window_mask(found, get))

    async def on_release(self, msg) -> None:
        await self._release(protocol.decode(msg.data, protocol.CacheRelease).transfer_id)

    async def _release(self, transfer_id: str) -> None:
        timer = self._releases.pop(transfer_id, None)
        if timer is None:
            return
        timer.cancel()
        for transport in self.transports.values():
            await transport.release(transfer_id)

    def staged_gets(self) -> int:
        """Gets whose staging is still held (released by the worker or after ``stage_ttl_s``)."""
        return len(self._releases)

    async def on_stats(self, msg) -> None:
        if not msg.reply:
            return
        stats = {"store": self.store.stats(), "ledger": self.ledger.as_dict(), "gc_runs": self._gc_runs,
                 "announced_blocks": len(self.announced), "staged_gets": self.staged_gets(),
                 "directory": self.config.directory, "retention": dict(self.store.config.retention.ttl_s),
                 "errors": dict(self.runtime.error_counts)}
        reply = protocol.StatsReply(worker_id=self.config.worker_id, role="cache_tier", stats=stats)
        await msg.respond(protocol.encode(reply))

    # -- maintenance --------------------------------------------------------------------------------------
    async def _maintenance(self) -> None:
        """Every ``gc_interval_s``: GC, then publish removals of blocks the store no longer holds."""
        while True:
            await asyncio.sleep(self.config.gc_interval_s)
            try:
                await self.sync_removals(gc=True)
            except Exception:  # keep maintaining; the next round retries
                logger.exception("%s: maintenance failed", self.config.worker_id)

    async def sync_removals(self, gc: bool = False) -> None:
        if gc:
            report = await self.store.gc()
            self._gc_runs += 1
            logger.debug("gc: %s", report)
        gone = self.announced - await self.store.hashes()
        if gone:
            self.announced -= gone
            self.events.sink("removed", sorted(gone))

    async def _drain_and_close(self) -> None:
        rt = self.runtime
        if rt is None:
            return
        await rt.withdraw()
        await rt.finish_inflight(self.config.drain_grace_s)
        for timer in self._releases.values():
            timer.cancel()
        self._releases.clear()
        await self.events.stop()
        if self._maintainer is not None:   # no GC round may run into the closed store
            self._maintainer.cancel()
            await asyncio.gather(self._maintainer, return_exceptions=True)
        for transport in self.transports.values():
            await transport.close()
        await self.store.close()
        await rt.close()
        await self.metrics_server.stop()
        logger.info("%s stopped", self.config.worker_id)


def reserve_dram(config: CacheTierConfig) -> None:
    """Fault the DRAM budget in before any thread or event loop exists (see ``store/dram_reserve.py``)."""
    if config.reserve_dram and config.dram_mb:
        done = reserve_heap(config.dram_mb << 20)
        logger.info("%s: DRAM budget reserved: %d MiB in %.1f s", config.worker_id, done.reserved >> 20, done.seconds)


def main(argv: list[str] | None = None) -> None:
    service_main(CacheTierService, CacheTierConfig, argv, prepare=reserve_dram)
