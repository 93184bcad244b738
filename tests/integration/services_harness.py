"""Runs router + prefill + decode services in-process (one event loop, real NATS) on a tiny float64 model,
plus the small helpers the integration tests share (fault injection, polling, one-shot requests)."""
from __future__ import annotations

import asyncio

from services.cache_tier.service import CacheTierService
from services.decode.service import DecodeService
from services.prefill.service import PrefillService
from services.router.service import RouterService
from services.switchable.service import SwitchableWorker
from services.cache_tier.config import CacheTierConfig
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.client import generate
from shared import protocol
from tests.integration.conftest import connect


def worker_config(role: str, url: str, folder, worker_id: str, **kw) -> WorkerConfig:
    return WorkerConfig(role=role, nats_url=url, worker_id=worker_id, model=str(folder), dtype="float64",
                        kv_cache_mb=kw.pop("kv_cache_mb", 8), block_size=8, heartbeat_s=0.2, threads=1,
                        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
                        drain_grace_s=kw.pop("drain_grace_s", 2.0), **kw)


TIER_ID = "cache-0"


def tier_config(url: str, directory, **kw) -> CacheTierConfig:
    return CacheTierConfig(nats_url=url, worker_id=kw.pop("worker_id", TIER_ID), directory=str(directory),
                           dram_mb=kw.pop("dram_mb", 1), ssd_mb=kw.pop("ssd_mb", 64), segment_mb=4,
                           heartbeat_s=0.2, gc_interval_s=kw.pop("gc_interval_s", 0.5), **kw)


class InProcessCluster:
    """``tier_dir``: also run a cache tier (``TIER_ID``) on that directory and point every worker at it.
    ``switchable``: the workers are ``SwitchableWorker``s ``worker-<n>`` (prefill ones first)."""

    def __init__(self, url: str, folder, prefill: int = 1, decode: int = 1, local_prefill_threshold: int = 0,
                 policy: str = "predictive", router_kw: dict | None = None, tier_dir=None, tier_kw=None,
                 **worker_kw) -> None:
        self.url, self.folder = url, folder
        self.tier = CacheTierService(tier_config(url, tier_dir, **(tier_kw or {}))) if tier_dir else None
        if tier_dir:
            worker_kw.setdefault("cache_tier", TIER_ID)
        self.router = RouterService(RouterConfig(nats_url=url, model=str(folder),
                                                 local_prefill_threshold=local_prefill_threshold, policy=policy,
                                                 **{"http_port": -1, "worker_dead_after_s": 1.5, **(router_kw or {})}))
        if worker_kw.get("switchable"):
            self.workers = [SwitchableWorker(worker_config(role, url, folder, f"worker-{i}", **worker_kw))
                            for i, role in enumerate(["prefill"] * prefill + ["decode"] * decode)]
            return
        self.workers = [PrefillService(worker_config("prefill", url, folder, f"prefill-{i}", **worker_kw))
                        for i in range(prefill)]
        self.workers += [DecodeService(worker_config("decode", url, folder, f"decode-{i}", **worker_kw))
                         for i in range(decode)]

    async def __aenter__(self) -> "InProcessCluster":
        if self.tier is not None:
            await self.tier.start()
        await self.router.start()
        for w in self.workers:
            await w.start()
        names = {w.config.worker_id for w in self.workers} | ({TIER_ID} if self.tier else set())
        for _ in range(100):
            if names <= {wid for wid in self.router.table.workers}:
                return self
            await asyncio.sleep(0.1)
        raise TimeoutError(f"router never saw {names}")

    async def __aexit__(self, *exc) -> None:
        for w in self.workers:
            await w.shutdown()
        await self.router.shutdown()
        if self.tier is not None:
            await self.tier.shutdown()


def reference_outputs(folder, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt alone through the single-process engine, no prefix cache."""
    blocks = max(256, max((len(p) + max_tokens) // 8 + 2 for p in prompts))
    engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=blocks,
                                                           enable_prefix_caching=False))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0] for p in prompts]


def round_trip_cached(engine: LLMEngine, codec) -> int:
    """Replace every cached block's KV in ``engine`` with its ``codec`` round trip: what a tier hit of that format
    imports (``shared/kv/kv_codec.py``). Returns how many blocks."""
    import torch

    ids = sorted(set(engine.block_manager.cached.values()))
    kv = engine.runner.kv_cache  # [num_blocks, L, 2, kvh, bs, D]
    index = torch.tensor(ids, dtype=torch.long)
    kv[index] = codec.decode(codec.encode(kv[index]), list(kv.shape[1:]), kv.dtype)
    return len(ids)


def compressed_hit_outputs(folder, prompts: list[list[int]], max_tokens: int, codec) -> list[list[int]]:
    """Each prompt through the single-process engine served from its own prefix once that prefix's blocks went
    through ``codec``: the exact output of a tier hit of that format."""
    engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=256))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for p in prompts:
        engine.block_manager.reset_prefix_cache()
        engine.generate([p], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        round_trip_cached(engine, codec)
        out.append(engine.generate([p], params)[0])
    return out


def all_blocks_free(cluster) -> bool:
    return all(not w.engine.requests and not w.engine.kv_port.held and
               w.engine.block_manager.num_free_blocks == w.engine.block_manager.num_blocks
               for w in cluster.workers)


async def wait_until(predicate, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


async def generate_once(url: str, req: protocol.GenerateRequest):
    """One request on a fresh client connection: ``(token ids, text, usage)``."""
    nc = await connect(url)
    try:
        return await generate(nc, req)
    finally:
        await nc.close()


def fault_first_call(monkeypatch, targets, name: str, fault) -> list:
    """Fault injection: the first call of ``name`` on any of ``targets`` runs ``await fault(target)`` instead;
    later calls go to the real method. Returns the list the faulted target is appended to."""
    hit: list = []

    def wrap(target):
        real = getattr(target, name)

        async def call(*args, **kwargs):
            if hit:
                return await real(*args, **kwargs)
            hit.append(target)
            return await fault(target)
        monkeypatch.setattr(target, name, call)

    for target in targets:
        wrap(target)
    return hit
