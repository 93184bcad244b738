"""The cache tier in a cluster (real NATS, in-process services, tiny float64 model): blocks written back by
workers survive a full cluster restart on SSD and are pulled instead of recomputed, with output exactly the
single-process engine's; tenants never share blocks; a missing tier costs nothing but the cache."""
from __future__ import annotations

import asyncio

import pytest

from shared import protocol
from tests.integration.services_harness import (InProcessCluster, all_blocks_free, compressed_hit_outputs,
                                                generate_once, reference_outputs, wait_until)
from tests.model_factory import write_tiny_hf_folder

PROMPT = [(13 * i + 5) % 250 + 1 for i in range(77)]       # 9 full blocks of 8; 9 reusable
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=512)


@pytest.fixture(scope="module")
def expected(folder):
    return reference_outputs(folder, [PROMPT], MAX_TOKENS)[0]


def request(**kw) -> protocol.GenerateRequest:
    kw = {"max_tokens": MAX_TOKENS, "retention": "chat", **kw}
    return protocol.GenerateRequest(prompt_token_ids=PROMPT, temperature=0.0, ignore_eos=True, **kw)


async def written(cluster, blocks: int) -> bool:
    return await wait_until(lambda: cluster.tier.store.stats()["dram_blocks"] + cluster.tier.store.stats()[
        "ssd_blocks"] >= blocks, timeout=10)


@pytest.mark.parametrize("mode", ["remote", "local"])
async def test_blocks_survive_a_full_restart_and_are_pulled_exactly(nats_server, folder, expected, tmp_path, mode):
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        tokens, _, usage = await generate_once(nats_server.url, request(prefill_mode=mode))
        assert tokens == expected and usage["cached_tokens"] == 0
        assert await written(cluster, 9), cluster.tier.store.stats()
    # everything stopped: the tier flushed to SSD; nothing of the first run is in any process now
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        assert cluster.tier.store.stats()["ssd_blocks"] >= 9
        tokens, _, usage = await generate_once(nats_server.url, request(prefill_mode=mode))
        assert tokens == expected
        assert usage["cached_tokens"] == 9 * 8 and usage["tier_cached_tokens"] == 9 * 8
        stats = cluster.tier.store.stats()
        assert stats["ssd_hits"] >= 9 and stats["ssd_checksum_failures"] == 0
        line = cluster.tier.ledger.as_dict()["by_tenant"]["default"]["chat"]
        assert line["blocks_hit_ssd"] >= 9 and line["tokens_served"] >= 72
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_decode_writes_back_output_blocks_for_the_next_turn(nats_server, folder, tmp_path):
    """The finished sequence's blocks (prompt + output) reach the tier: a follow-up that extends the whole
    first turn pulls blocks covering the first turn's output as well."""
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        first, _, _ = await generate_once(nats_server.url, request(max_tokens=20))
        turn = PROMPT + first
        assert await written(cluster, len(turn) // 8 - 1)
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        follow_up = turn + [7, 8, 9]
        expected = reference_outputs(folder, [follow_up], 4)[0]
        tokens, _, usage = await generate_once(nats_server.url, protocol.GenerateRequest(
            prompt_token_ids=follow_up, max_tokens=4, temperature=0.0, ignore_eos=True, retention="chat"))
        assert tokens == expected
        assert usage["tier_cached_tokens"] > len(PROMPT) // 8 * 8   # more than the prompt's blocks


async def test_a_local_prefill_writes_back_only_the_blocks_it_computed(nats_server, folder, expected, tmp_path):
    """A repeat of a prompt whose blocks were cached (device prefix cache) writes back only its own new blocks:
    the cached ones reached the tier with the request that computed them (64 requests behind one long system
    prompt used to copy and resend that prompt's blocks 64 times)."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, tier_dir=tmp_path) as cluster:
        tier = cluster.workers[0].tier
        tokens, _, _ = await generate_once(nats_server.url, request(prefill_mode="local"))
        assert tokens == expected and await wait_until(lambda: tier.counters.blocks_written >= 9)
        first = tier.counters.blocks_written
        tokens, _, usage = await generate_once(nats_server.url, request(prefill_mode="local"))
        assert tokens == expected and usage["cached_tokens"] == 9 * 8
        assert await wait_until(lambda: tier.counters.blocks_written > first)
        await asyncio.sleep(0.3)
        assert tier.counters.blocks_written - first == (len(PROMPT) + MAX_TOKENS - 1) // 8 - 9, tier.stats()


async def test_write_back_staging_is_pooled_at_start(nats_server, folder, expected, tmp_path):
    """A worker beside its tier (shm) pools a segment for every write-back its queue can hold before it serves,
    so write-backs take pooled shared memory instead of creating (and faulting in) segments while serving."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, tier_dir=tmp_path) as cluster:
        worker = cluster.workers[0]
        shm = worker.transports["shm"]
        pooled = worker.config.tier_write_queue + 1
        assert shm.pool_stats()["free_segments"] == pooled
        tokens, _, _ = await generate_once(nats_server.url, request(prefill_mode="local"))
        assert tokens == expected and await wait_until(lambda: worker.tier.counters.writes >= 1)
        await asyncio.sleep(0.2)
        stats = shm.pool_stats()
        assert stats["free_segments"] + stats["staged"] == pooled, stats   # no segment made for the write-back


async def test_tenants_never_share_tier_blocks(nats_server, folder, expected, tmp_path):
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        await generate_once(nats_server.url, request(cache_salt="tenant-a"))
        assert await written(cluster, 9)
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path):
        tokens, _, usage = await generate_once(nats_server.url, request(cache_salt="tenant-b"))
        assert tokens == expected and usage["cached_tokens"] == 0
        tokens, _, usage = await generate_once(nats_server.url, request(cache_salt="tenant-a"))
        assert tokens == expected and usage["tier_cached_tokens"] == 72


async def test_class_none_is_not_kept_across_a_restart(nats_server, folder, expected, tmp_path):
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        await generate_once(nats_server.url, request(retention="none"))
        assert await written(cluster, 9)            # in DRAM only
        assert cluster.tier.store.stats()["ssd_blocks"] == 0
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path):
        tokens, _, usage = await generate_once(nats_server.url, request(retention="none"))
        assert tokens == expected and usage["cached_tokens"] == 0


async def test_a_raw_prompt_naming_no_class_is_kept_across_a_restart_and_usage_says_its_class(
        nats_server, folder, expected, tmp_path):
    """A raw prompt (no ``messages``) that names no retention class gets the deployment's shortest durable one
    (``agent``, 3 days), as completions-style agents need: after a full restart it is a tier hit, like a chat."""
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        tokens, _, usage = await generate_once(nats_server.url, request(retention=""))
        assert tokens == expected and usage["retention"] == "agent"
        assert await written(cluster, 9)
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        tokens, _, usage = await generate_once(nats_server.url, request(retention=""))
        assert tokens == expected and usage["tier_cached_tokens"] == 72
        assert cluster.tier.ledger.as_dict()["by_tenant"]["default"]["agent"]["blocks_hit_ssd"] >= 9
        _, _, usage = await generate_once(nats_server.url, request(retention="none"))
        assert usage["retention"] == "none"


@pytest.mark.parametrize("kv_format", ["fp8", "int8"])
async def test_compressed_tier_blocks_are_hit_after_a_restart_and_never_served_to_another_format(
        nats_server, folder, expected, tmp_path, kv_format):
    """Workers writing their tier blocks as ``kv_format`` (``--tier-kv-format``): the tier stores one byte per
    number plus a scale per token and head (a sixth of this float64 model's blocks at head_dim 16); after a
    restart the same format pulls every block and answers exactly what the engine answers from the codec's round
    trip of those blocks (lossy: on this tiny random model fp8 changes a later token); workers that store the
    model's dtype miss those blocks rather than read another format."""
    from shared.kv.kv_codec import KVCodec

    codec = KVCodec(kv_format)
    through_codec = compressed_hit_outputs(folder, [PROMPT], MAX_TOKENS, codec)[0]
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path, tier_kv_format=kv_format) as cluster:
        tokens, _, usage = await generate_once(nats_server.url, request())
        assert tokens == expected and await written(cluster, 9)
        block_shape = cluster.workers[0].engine.kv_port.block_shape
        stored = cluster.tier.store._dram.entries()[0].block
        assert stored.dtype == codec.wire_dtype
        assert len(stored.payload) == block_shape[0] * codec.row_bytes(block_shape)
        assert len(stored.payload) * 6 < cluster.workers[0].engine.kv_port.block_bytes   # (16 + 4) / (8 * 16)
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path, tier_kv_format=kv_format):
        tokens, _, usage = await generate_once(nats_server.url, request())
        assert usage["tier_cached_tokens"] == 72 and tokens == through_codec
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path):
        tokens, _, usage = await generate_once(nats_server.url, request())
        assert tokens == expected and usage["tier_cached_tokens"] == 0


async def test_an_absent_tier_changes_nothing_but_the_cache(nats_server, folder, expected):
    async with InProcessCluster(nats_server.url, folder, cache_tier="cache-nowhere") as cluster:
        for _ in range(2):
            tokens, _, usage = await asyncio.wait_for(generate_once(nats_server.url, request()), 20)
            assert tokens == expected
        tiers = [w.tier for w in cluster.workers]
        assert await wait_until(lambda: sum(t.counters.writes_dropped for t in tiers) >= 1)  # after the stream
        assert all(t.counters.pulls == 0 and not t.alive for t in tiers)
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_unknown_retention_class_is_an_invalid_request(nats_server, folder, tmp_path):
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path):
        with pytest.raises(Exception) as info:
            await generate_once(nats_server.url, request(retention="forever"))
        assert "invalid_request" in str(info.value) and "retention" in str(info.value)


async def test_router_sees_tier_holdings_and_status_reports_accounting(nats_server, folder, expected, tmp_path):
    from cli import status
    from shared.kv.block_hash import hash_prompt_blocks
    from tests.integration.conftest import connect

    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        await generate_once(nats_server.url, request(cache_salt="acme"))
        assert await written(cluster, 9)
    async with InProcessCluster(nats_server.url, folder, tier_dir=tmp_path) as cluster:
        hashes = hash_prompt_blocks(PROMPT, 8, cluster.workers[0].engine.fingerprint, "acme")
        # the restarted tier announced what survived on SSD: the router's placement sees it as remote overlap
        assert await wait_until(lambda: cluster.router.index.tier_overlap(hashes, "cache_tier") == 9)
        tokens, _, _ = await generate_once(nats_server.url, request(cache_salt="acme"))
        assert tokens == expected
        nc = await connect(nats_server.url)
        try:
            report = await status.collect(nc, listen_s=1.3)   # router heartbeats every 1 s
        finally:
            await nc.close()
    services = report["services"]
    assert {"prefill-0", "decode-0", "cache-0"} <= set(services)
    assert services["cache-0"]["stats"]["store"]["ssd_hits"] >= 9
    pulled = sum(services[w]["stats"]["tier"]["blocks_pulled"] for w in ("prefill-0", "decode-0"))
    assert pulled == 9 and all(services[w]["load"]["tier_block_s"] >= 0 for w in ("prefill-0", "decode-0"))
    router = next(s["stats"] for s in services.values() if s["load"]["role"] == "router")
    line = router["accounting"]["by_tenant"]["default"]["chat"]  # a plain-API salt is no tenant
    assert line["cached_tokens"] == 72 and line["tier_tokens"] == {"cache_tier": 72}
    assert line["uncached_tokens"] == len(PROMPT) - 72 and line["cost"] < line["cost_without_cache"]
    text = status.format_status(report)
    assert "cache-0" in text and "default" in text and "ssd" in text
