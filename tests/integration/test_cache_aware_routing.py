"""Workers publish KV events; the router's index sends repeat prefixes to the worker that holds them."""
import asyncio

import pytest

from shared.client import generate
from shared import protocol
from shared.kv.block_hash import hash_prompt_blocks
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster
from tests.model_factory import write_tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=512)


def req(prompt, rid):
    return protocol.GenerateRequest(request_id=rid, prompt_token_ids=prompt, max_tokens=2, temperature=0.0,
                                    ignore_eos=True, prefill_mode="local")


@pytest.mark.parametrize("policy, expect_all_hits", [("predictive", True), ("cache_aware", True),
                                                     ("round_robin", False)])
async def test_repeat_prefixes_follow_the_cache(nats_server, folder, policy, expect_all_hits):
    prefixes = [[(7 * i + j) % 250 + 3 for j in range(96)] for i in range(2)]
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=2, policy=policy) as cluster:
        nc = await connect(nats_server.url)
        try:
            for i, prefix in enumerate(prefixes):
                await generate(nc, req(prefix + [1], f"warm-{i}"))
            await asyncio.sleep(0.5)  # KV events reach the router's index
            assert cluster.router.index.stats()["entries"] > 0
            cached = []
            for n in range(6):
                prefix = prefixes[(n // 2) % 2]  # 0, 0, 1, 1, 0, 0: round robin cannot line up with it
                _, _, usage = await generate(nc, req(prefix + [2, n + 3], f"again-{n}"))
                cached.append(usage["cached_tokens"])
        finally:
            await nc.close()
    hits = sum(c >= 96 for c in cached)
    if expect_all_hits:
        assert hits == 6, f"{policy}: cached tokens per request {cached}"
    else:
        assert hits < 6, f"{policy} should miss sometimes: {cached}"


async def test_events_lost_while_idle_are_recovered_from_heartbeats(nats_server, folder):
    """A worker that stores blocks and then goes quiet: if the router lost its events (or started after
    them), the heartbeats' kv_event_seq makes it fetch a snapshot; no new request is needed."""
    prefix = [(5 * j) % 250 + 3 for j in range(96)]
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1) as cluster:
        nc = await connect(nats_server.url)
        try:
            await generate(nc, req(prefix + [1], "warm"))
            for _ in range(50):
                if cluster.router.index.stats()["entries"] > 0:
                    break
                await asyncio.sleep(0.1)
            (wid,) = [w for w, s in cluster.router.table.workers.items() if s.report.role == "decode"]
            rep = cluster.router.table.workers[wid].report
            hashes = hash_prompt_blocks(prefix, rep.block_size, rep.model_fingerprint, "")
            assert cluster.router.index.overlap(hashes).get(wid, 0) == 12  # 96 tokens in 8-token blocks
            cluster.router.index.remove_worker(wid)  # fault injection: the router lost every event
            assert cluster.router.index.overlap(hashes).get(wid, 0) == 0
            for _ in range(50):  # heartbeats every 0.2 s: resynced within two of them
                if cluster.router.index.overlap(hashes).get(wid, 0) == 12:
                    break
                await asyncio.sleep(0.1)
            assert cluster.router.index.overlap(hashes).get(wid, 0) == 12
            _, _, usage = await generate(nc, req(prefix + [2], "again"))
            assert usage["cached_tokens"] >= 96
        finally:
            await nc.close()
