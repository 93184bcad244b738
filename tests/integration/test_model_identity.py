"""Model identity across a cluster (real NATS, in-process services, tiny float64 models): two builds under one
model name (the second a copy of the first with perturbed weights) never share work or KV.

- A worker of the new build gets no request placed for the old build (the old build keeps serving while it has
  as many decode workers), and once it serves, it is never given a block the old build wrote to the cache tier
  (the tier restarted on its directory, i.e. kept across the swap): its output is exactly its own build's.
- A hand-off to a decode worker of another build (a placement made on a stale view) is refused with
  ``model_mismatch`` before anything is fetched, and the request completes exactly on the right build.
"""
from __future__ import annotations

import asyncio
import shutil

import pytest
from safetensors.torch import load_file, save_file

from services.cache_tier.service import CacheTierService
from services.decode.service import DecodeService
from shared import protocol
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.kv.block_hash import chain_digests, block_key
from tests.integration.services_harness import (TIER_ID, InProcessCluster, generate_once, reference_outputs,
                                                tier_config, wait_until, worker_config)
from tests.model_factory import write_tiny_hf_folder

PROMPT = [(13 * i + 5) % 250 + 1 for i in range(41)]       # 5 full blocks of 8; 5 reusable
MAX_TOKENS = 8
LONG = 320                                                 # tokens of the streams a rolling upgrade interrupts


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Two checkpoints named alike ("tiny"): ``a``, and ``b`` = ``a`` with layer 0's K projection scaled."""
    root = tmp_path_factory.mktemp("builds")
    a = write_tiny_hf_folder(root / "a" / "tiny", seed=7, max_position_embeddings=512)
    b = root / "b" / "tiny"
    shutil.copytree(a, b)
    weights = load_file(str(b / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] *= 1.5
    save_file(weights, str(b / "model.safetensors"))
    return a, b


@pytest.fixture(scope="module")
def expected(builds):
    """Each build's greedy output for ``PROMPT`` (they differ, else this module would prove little)."""
    a, b = (reference_outputs(folder, [PROMPT], MAX_TOKENS)[0] for folder in builds)
    assert a != b
    return a, b


def request(**kw) -> protocol.GenerateRequest:
    kw = {"max_tokens": MAX_TOKENS, "retention": "chat", **kw}
    return protocol.GenerateRequest(prompt_token_ids=PROMPT, temperature=0.0, ignore_eos=True, **kw)


async def test_a_new_build_under_the_same_name_gets_no_old_work_and_no_old_blocks(nats_server, builds, expected,
                                                                                  tmp_path):
    url, (folder_a, folder_b), (want_a, want_b) = nats_server.url, builds, expected
    async with InProcessCluster(url, folder_a, tier_dir=tmp_path) as cluster:
        prefill_a, decode_a = cluster.workers
        fp_a = decode_a.engine.fingerprint
        tokens, _, usage = await generate_once(url, request())
        assert tokens == want_a and usage["cached_tokens"] == 0
        assert await wait_until(lambda: len(cluster.tier.announced) >= 5)   # build A's blocks are in the tier

        new = DecodeService(worker_config("decode", url, folder_b, "decode-b", cache_tier=TIER_ID))
        cluster.workers.append(new)                                          # shut down with the cluster
        await new.start()
        assert new.engine.model.config.model_id == decode_a.engine.model.config.model_id
        assert new.engine.fingerprint != fp_a
        assert await wait_until(lambda: cluster.router.table.is_alive("decode-b"))
        for salt in ("", "x", "y"):          # one decode worker each: the serving build A keeps the work
            tokens, _, _ = await generate_once(url, request(cache_salt=salt, prefill_mode="local"))
            assert tokens == want_a
        assert new.engine.block_manager.num_query_tokens == 0 and new.tier.counters.pulls == 0

        # the swap: A's decode worker leaves, the tier restarts on its directory (A's blocks on SSD)
        await decode_a.shutdown()
        await cluster.tier.shutdown()
        cluster.tier = CacheTierService(tier_config(url, tmp_path))
        await cluster.tier.start()
        assert cluster.tier.store.stats()["ssd_blocks"] >= 5
        assert await wait_until(lambda: new.tier.alive)
        prefill_work = prefill_a.engine.block_manager.num_query_tokens
        tokens, _, usage = await generate_once(url, request())
        assert tokens == want_b                                              # build B's output, B's KV only
        assert usage["cached_tokens"] == 0 and usage["tier_cached_tokens"] == 0
        assert new.tier.counters.pulls == 1 and new.tier.counters.pull_hits == 0
        assert prefill_a.engine.block_manager.num_query_tokens == prefill_work   # A's prefill was not paired
        assert cluster.router.placer.model.fingerprint == new.engine.fingerprint
        # the old blocks are still held, for build A: the same tokens are served to A's identity only
        digests = chain_digests(PROMPT, 8, fp_a)
        store = cluster.tier.store
        assert await store.get(block_key(digests[0]), PROMPT[:8], "chat", digests[0], fp_a) is not None
        assert await store.get(block_key(digests[0]), PROMPT[:8], "chat", digests[0], new.engine.fingerprint) is None


async def test_a_handoff_to_another_build_is_refused_and_the_request_completes_exactly(nats_server, builds,
                                                                                       expected, monkeypatch):
    url, (folder_a, folder_b), (want_a, _) = nats_server.url, builds, expected
    async with InProcessCluster(url, folder_a, prefill=1, decode=2, transports="shm") as cluster:
        other = DecodeService(worker_config("decode", url, folder_b, "decode-b", transports="shm"))
        cluster.workers.append(other)
        await other.start()
        assert await wait_until(lambda: cluster.router.table.is_alive("decode-b"))
        fetches = []
        real_fetch = other.transports["shm"].fetch

        async def counting_fetch(*args, **kwargs):
            fetches.append(args)
            return await real_fetch(*args, **kwargs)

        monkeypatch.setattr(other.transports["shm"], "fetch", counting_fetch)
        real_place, stale = cluster.router.placer.place, []

        def stale_place(*args, **kwargs):    # the first placement's view is stale: decode-b named for build A
            prefill, decode, transport, fp = real_place(*args, **kwargs)
            if stale:
                return prefill, decode, transport, fp
            stale.append(fp)
            return prefill, cluster.router.table.workers["decode-b"], transport, fp

        monkeypatch.setattr(cluster.router.placer, "place", stale_place)
        tokens, _, usage = await generate_once(url, request(prefill_mode="remote"))
        assert stale == [cluster.workers[0].engine.fingerprint]
        assert tokens == want_a and usage["failovers"] == 1                  # re-placed on build A: exact
        assert other.runtime.error_counts == {"model_mismatch": 1}
        assert fetches == [] and other.engine.block_manager.num_query_tokens == 0
        assert other.engine.block_manager.num_free_blocks == other.engine.block_manager.num_blocks


async def test_a_rolling_upgrade_under_load_loses_nothing(nats_server, builds, expected):
    """Streams run on build A while build B's decode worker stands by; A's worker drains mid-stream (a short grace
    hands the rest back): every stream completes with all its tokens, none lost, duplicated or changed (one never
    handed back is exactly A's; one handed back is A's up to the hand-back, then B's greedy continuation of
    exactly what was delivered: no KV crossed builds), and B admits only the handed-back continuations and the
    requests that came after the swap."""
    url, (folder_a, folder_b), (want_a, want_b) = nats_server.url, builds, expected
    long_a = reference_outputs(folder_a, [PROMPT], LONG)[0]
    async with InProcessCluster(url, folder_a, prefill=0, decode=1, drain_grace_s=0.05) as cluster:
        decode_a = cluster.workers[0]
        assert (await generate_once(url, request()))[0] == want_a            # A serves (and is the incumbent)
        new = DecodeService(worker_config("decode", url, folder_b, "decode-b"))
        cluster.workers.append(new)
        await new.start()
        admitted: dict[str, int] = {}        # request id B admitted -> tokens its stream had delivered before
        real_add = new.engine.add_request

        def recording_add(prompt, params, request_id=None, *args, **kwargs):
            admitted[request_id] = len(kwargs.get("prior_output_ids", ()))   # the delivered tokens it continues
            return real_add(prompt, params, request_id, *args, **kwargs)

        new.engine.add_request = recording_add
        assert await wait_until(lambda: cluster.router.table.is_alive("decode-b"))
        streams = [asyncio.create_task(generate_once(url, request(request_id=f"s{i}", cache_salt=f"s{i}",
                                                                  max_tokens=LONG))) for i in range(6)]
        assert await wait_until(lambda: len(decode_a.active) >= 3)
        await decode_a.shutdown()
        results = await asyncio.gather(*streams)
        tokens, _, _ = await generate_once(url, request(request_id="after"))
        assert tokens == want_b
    handed_back = {f"s{i}~{usage['failovers']}": ids for i, (ids, _, usage) in enumerate(results) if usage["failovers"]}
    assert set(admitted) == set(handed_back) | {"after~0"} and new.runtime.error_counts == {}
    for ids, _, usage in results:
        assert len(ids) == LONG and usage["completion_tokens"] == LONG
        if usage["failovers"] == 0:
            assert ids == long_a
    # a handed-back stream: A's tokens up to the hand-back, then B's greedy continuation of exactly those
    engine_b = LLMEngine.from_path(str(folder_b), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=512,
                                                               enable_prefix_caching=False))
    for rid, ids in handed_back.items():
        k = admitted[rid]
        assert ids[:k] == long_a[:k]
        rest = engine_b.generate([PROMPT + ids[:k]], SamplingParams(max_tokens=LONG - k, temperature=0.0,
                                                                    ignore_eos=True))[0]
        assert ids[k:] == rest, rid
