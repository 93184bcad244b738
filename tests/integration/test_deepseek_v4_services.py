"""DeepSeek V4 (tiny random checkpoint made by transformers) served through the real router and workers over a
real nats-server. Its KV is one state per sequence (window rows, compressed entries, pending groups): a remote
prefill hands the whole packed state to the decode worker, and a live migration moves it mid-stream; the bytes
that moved are the state's (``context_bytes``, under a page of padding), never per-token K/V. The cache tier
stores states as blocks of compressed entries with a boundary's tail (``shared/model/v4_tier.py``): with both
workers' device caches dropped, a repeated prompt and a next turn are tier hits. Every stream equals the
single-process engine's greedy tokens, and a repeated prompt hits the decode worker's prefix cache (a
block-boundary state snapshot)."""
import asyncio

import pytest

from shared import protocol
from shared.client import generate
from shared.model.v4_state import context_bytes
from tests.deepseek_factory import VOCAB, write_v4_folder
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs, wait_until
from tests.integration.test_deepseek_services import migrated_stream, received_bytes

TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_v4_folder(tmp_path_factory.mktemp("dsv4"), seed=4)


def prompts() -> list[list[int]]:
    return [[(29 * i + 7 * j) % (VOCAB - 10) + 5 for j in range(40 + 17 * i)] for i in range(3)]  # 40..74 tokens


def request(prompt, rid: str, mode: str = "auto", max_tokens: int = TOKENS) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0, prefill_mode=mode)


async def test_v4_hands_its_state_off_exactly_and_hits_its_prefix_caches(nats_server, folder, tmp_path):
    """Each prompt prefilled remotely (its state handed off), then again remotely (a hit on the prefill worker's
    snapshots), then its next turn (prompt + answer + 5 tokens) on the decode worker, which hits the snapshot it
    took past the adopted state while decoding."""
    ps = prompts()
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path) as cluster:
        assert all(w.transports and w.tier is not None for w in cluster.workers)
        nc = await connect(nats_server.url)
        try:
            remote = [await generate(nc, request(p, f"r{i}", mode="remote")) for i, p in enumerate(ps)]
            decode = next(w for w in cluster.workers if w.config.role == "decode")
            config, page_bytes = decode.engine.model.config, decode.engine.kv_port.block_bytes
            moved = received_bytes(decode)
            again = [await generate(nc, request(p, f"b{i}", mode="remote")) for i, p in enumerate(ps)]
            turns = [p + ids + [7, 8, 9, 10, 11] for p, (ids, _, _) in zip(ps, remote)]
            follow = [await generate(nc, request(t, f"t{i}", mode="local")) for i, t in enumerate(turns)]
        finally:
            await nc.close()
    assert [ids for ids, _, _ in remote] == [ids for ids, _, _ in again] == expected
    assert [ids for ids, _, _ in follow] == reference_outputs(folder, turns, TOKENS)
    exact = sum(context_bytes(config, len(p), 8) for p in ps)   # float64 workers
    assert exact <= moved < exact + len(ps) * page_bytes, (moved, exact)
    assert moved < sum(len(p) for p in ps) * config.num_layers * 2 * config.head_dim * 8 / 2   # not per-token K/V
    for p, (_, _, usage) in zip(ps, again):   # the snapshot before the prompt's last token, on the prefill worker
        assert usage["cached_tokens"] == (len(p) - 1) // 8 * 8, usage
    for p, (_, _, usage) in zip(ps, follow):   # the decode worker's newest snapshot of the first turn
        assert usage["cached_tokens"] == (len(p) + TOKENS - 1) // 8 * 8, usage


async def test_v4_states_are_served_from_the_cache_tier_exactly(nats_server, folder, tmp_path):
    """Prefilled remotely (the prefill worker writes the prompt's boundary state back), device caches dropped, the
    same prompts on the decode worker are tier hits up to the boundary before their last token; that worker writes
    back the state its answer ended at (only the blocks after the prompt's), and after another drop the next turn
    hits there. Every stream exact. The deployment asks for fp8 tier blocks, which V4's do not take: stored in the
    model dtype."""
    ps = prompts()
    turns = None
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path, tier_kv_format="fp8") as cluster:
        assert all(w.tier is not None and w.tier.codec is None for w in cluster.workers)
        written = lambda: cluster.tier.ledger.as_dict()["total"]["blocks_written"]   # noqa: E731

        def drop_device_caches():
            for w in cluster.workers:
                w.engine.block_manager.reset_prefix_cache()
        nc = await connect(nats_server.url)
        try:
            cold = [await generate(nc, request(p, f"c{i}", mode="remote")) for i, p in enumerate(ps)]
            prompt_blocks = sum((len(p) - 1) // 8 for p in ps)
            assert await wait_until(lambda: written() >= prompt_blocks, timeout=30), written()
            drop_device_caches()
            hit = [await generate(nc, request(p, f"h{i}", mode="local")) for i, p in enumerate(ps)]
            answer_blocks = sum((len(p) + TOKENS - 1) // 8 for p in ps)
            assert await wait_until(lambda: written() >= answer_blocks, timeout=30), written()
            stored = cluster.tier.store.stats()
            shape = cluster.workers[0].engine.kv_port.tier_block_shape
            drop_device_caches()
            turns = [p + ids + [7, 8, 9, 10, 11] for p, (ids, _, _) in zip(ps, cold)]
            follow = [await generate(nc, request(t, f"t{i}", mode="local")) for i, t in enumerate(turns)]
        finally:
            await nc.close()
    expected = reference_outputs(folder, ps, TOKENS)
    assert [ids for ids, _, _ in cold] == [ids for ids, _, _ in hit] == expected
    assert [ids for ids, _, _ in follow] == reference_outputs(folder, turns, TOKENS)
    for p, (_, _, usage) in zip(ps, hit):
        assert usage["tier_cached_tokens"] == usage["cached_tokens"] == (len(p) - 1) // 8 * 8, usage
    for p, (_, _, usage) in zip(ps, follow):
        assert usage["tier_cached_tokens"] == usage["cached_tokens"] == (len(p) + TOKENS - 1) // 8 * 8, usage
    # each block's entries stored once, a tail (window, pending groups) at each prompt's and each answer's end
    tails = sum(len({(len(p) - 1) // 8, (len(p) + TOKENS - 1) // 8}) for p in ps)
    assert stored["dram_blocks"] == answer_blocks, stored
    payload = (answer_blocks + tails * (shape[0] - 1)) * shape[1] * 8   # float64 workers
    assert 0 < stored["dram_bytes"] - payload < answer_blocks * 256, (stored, payload)   # + tokens, digest, build


async def test_a_v4_stream_moves_mid_decode_and_stays_exact(nats_server, folder):
    prompt = prompts()[1]
    expected = reference_outputs(folder, [prompt], 300)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm,stream",
                                router_kw={"migrate_skew_min": 0, "migrate_kv_high": 2.0}) as cluster:
        ack, chunks = await migrated_stream(nats_server.url, cluster, prompt, 300)
        target = next(w for w in cluster.workers if w.config.worker_id == ack.detail)
        assert target.desk.sent == 0 and received_bytes(target) > 0
    assert ack.detail.startswith("decode-")
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].usage["migrations"] == 1


async def test_draining_v4_decode_worker_hands_its_streams_back(nats_server, folder):
    """No migration target takes them in time (a short grace): the streams continue, recomputed, on the other
    decode worker, each equal to the uninterrupted output."""
    ps, tokens = prompts(), 300
    expected = reference_outputs(folder, ps, tokens)
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=2, drain_grace_s=0.1) as cluster:
        tasks = [asyncio.create_task(generate_once(nats_server.url, request(p, f"d{i}", max_tokens=tokens)))
                 for i, p in enumerate(ps)]
        victim = cluster.workers[0]
        assert await wait_until(lambda: len(victim.active) > 0)
        await victim.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert [ids for ids, _, _ in results] == expected
    assert any(usage["failovers"] for _, _, usage in results), "some streams were on the drained worker"
