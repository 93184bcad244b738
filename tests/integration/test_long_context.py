"""A CI-sized long context (16K tokens, issue 33) served disaggregated over a real nats-server: the prompt is
prefilled remotely in bounded chunks, its KV handed to the decode worker over the chunked stream transport and
written back to the cache tier, and a repeat after both device caches were dropped is a tier hit served mostly
from SSD. Every output equals the single-process engine's greedy tokens, and short streams decoding on the same
decode worker keep producing tokens while the long one is prefilled, handed off and written back (their
largest gap between tokens is printed beside the long request's TTFT; the assertion bounds it loosely). The
waits for its KV are sized by its bytes (``transfer_timeout``), not a fixed timeout that a long context outgrows."""
import asyncio
import time

import pytest

from shared import protocol
from shared.client import generate_stream
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until
from tests.model_factory import write_tiny_hf_folder

LONG = 16_384
TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=21, max_position_embeddings=LONG + 64)


def long_prompt(salt: int = 0) -> list[int]:
    return [(131 * i + 17 * (i // 97) + salt) % 250 + 3 for i in range(LONG)]


def request(prompt, rid: str, mode: str, max_tokens: int = TOKENS) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, timeout_s=300.0, prefill_mode=mode)


async def stream(nc, req: protocol.GenerateRequest, times: list[float]) -> tuple[list[int], dict]:
    ids, usage = [], {}
    async for chunk in generate_stream(nc, req):
        ids += chunk.token_ids
        times += [time.perf_counter()] * len(chunk.token_ids)
        usage = chunk.usage or usage
    return ids, usage


@pytest.mark.timeout(600)
async def test_a_16k_prompt_hands_off_writes_back_and_hits_from_ssd_exactly(nats_server, folder, tmp_path,
                                                                            monkeypatch):
    prompt = long_prompt()
    shorts = [[(7 * i + 5 * j) % 250 + 3 for j in range(24)] for i in range(2)]
    expected = reference_outputs(folder, [prompt], TOKENS)[0]
    short_expected = reference_outputs(folder, shorts, 400)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="stream",
                                kv_cache_mb=96, max_num_batched_tokens=1024, tier_dir=tmp_path,
                                tier_kw={"dram_mb": 2, "ssd_mb": 128}) as cluster:
        decode = next(w for w in cluster.workers if w.config.role == "decode")
        waits: list[float] = []   # the timeouts the decode worker's fetches ran under
        fetch = decode.transports["stream"].fetch

        async def recorded(handle, out=None, timeout=10.0):
            waits.append(timeout)
            return await fetch(handle, out, timeout)
        monkeypatch.setattr(decode.transports["stream"], "fetch", recorded)
        nc = await connect(nats_server.url)
        try:
            times: list[list[float]] = [[] for _ in shorts]
            beside = [asyncio.create_task(stream(nc, request(p, f"s{i}", "local", 400), times[i]))
                      for i, p in enumerate(shorts)]
            assert await wait_until(lambda: all(len(t) > 3 for t in times), timeout=60)
            t0 = time.perf_counter()
            cold, cold_usage = await stream(nc, request(prompt, "long", "remote"), [])
            t1 = time.perf_counter()
            during = [[t for t in ts if t0 <= t <= t1] for ts in times]
            written = lambda: cluster.tier.ledger.as_dict()["total"]["blocks_written"]   # noqa: E731
            assert await wait_until(lambda: written() >= LONG // 8 - 1, timeout=120), written()
            short_results = await asyncio.gather(*beside)
            for w in cluster.workers:   # only the tier holds the prompt now
                w.engine.block_manager.reset_prefix_cache()
            hit, hit_usage = await stream(nc, request(prompt, "again", "local"), [])
            tier_stats = cluster.tier.store.stats()
        finally:
            await nc.close()
    assert cold == expected and hit == expected
    assert [ids for ids, _ in short_results] == short_expected
    assert hit_usage["tier_cached_tokens"] >= LONG - 16, hit_usage
    gaps = [max(b - a for a, b in zip(ts, ts[1:])) for ts in during if len(ts) > 1]
    print(f"16K cold: {t1 - t0:.2f} s end to end; short streams' tokens meanwhile {[len(d) for d in during]}, "
          f"largest gap {max(gaps, default=float('nan')):.3f} s; tier {tier_stats}")
    assert all(len(d) > 0 for d in during), "the short streams stalled while the long prompt moved"
    assert max(gaps) < 5.0, gaps
    assert tier_stats["ssd_hits"] >= LONG // 8 // 2, tier_stats   # most of the hit came from SSD
    # the hand-off's fetch (16 MiB) and the tier pull's were given more than their configs' fixed base
    assert max(waits) > decode.config.handoff_timeout_s and len(waits) >= 2, waits
    assert min(waits) > decode.config.tier_timeout_s, waits
