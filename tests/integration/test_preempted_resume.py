"""A preempted sequence resumes from the cache tier, not by recompute (issue 34; the engine's half is
``tests/unit/test_preempted_kv.py``). Real nats-server, router, one decode worker (priority scheduling, a pool three
batch sequences nearly fill) and a cache tier: interactive arrivals preempt batch sequences; each victim's KV is
written to the tier (retention ``none``: DRAM only), pulled back when the victim is next to be admitted, and its
prefix lookup finds it; every output equals the single-process engine's, and the worker's metrics count it."""
from __future__ import annotations

import asyncio
import threading

import pytest

from shared import protocol
from shared.client import generate
from shared.metrics.common import render
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until
from tests.model_factory import write_tiny_hf_folder

BATCH, BATCH_PROMPT, BATCH_TOKENS = 3, 40, 40
CHAT, CHAT_PROMPT, CHAT_TOKENS = 2, 72, 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5, max_position_embeddings=1024,
                                num_layers=4, hidden=128, ffn=256)


def prompt(i: int, n: int) -> list[int]:
    """Prompts that share no block: the engine computes each token's KV once but for the victims' recompute."""
    return [(i + 1) % 7 + 3] + [(5 * i + 3 * j + i * j) % 120 + 3 for j in range(1, n)]


def request(ids: list[int], max_tokens: int, slo_class: str) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                    prefill_mode="local", slo_class=slo_class, timeout_s=120.0)


async def test_a_preempted_sequence_is_pulled_back_from_the_tier_and_ends_exact(nats_server, folder, tmp_path):
    batch = [prompt(i, BATCH_PROMPT) for i in range(BATCH)]
    chats = [prompt(BATCH + i, CHAT_PROMPT) for i in range(CHAT)]
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, kv_cache_mb=1,
                                max_num_batched_tokens=256, scheduling_policy="priority", tier_dir=tmp_path,
                                tier_kw={"dram_mb": 8}, preempt_offer_mib=64) as cluster:
        decode = cluster.workers[0]
        bm = decode.engine.block_manager
        need = BATCH * -(-(BATCH_PROMPT + BATCH_TOKENS) // 8)
        assert need <= bm.num_blocks < need + -(-(CHAT_PROMPT + CHAT_TOKENS) // 8)   # a chat must preempt
        computed = [0]   # tokens the engine ran (a pass-through count: every token's KV at least once)
        execute = decode.engine.runner.execute
        running = decode.engine.scheduler.running
        chats_sent = threading.Event()

        def ready() -> bool:   # every batch sequence seated and 16 tokens in: when the chats are meant to arrive
            return len(running) == BATCH and all(r.num_output_tokens >= 16 for r in running)

        def counting(sched):
            computed[0] += sched.num_batched_tokens
            if ready() and not chats_sent.is_set():
                # hold each step up to 50 ms until the chats are sent: the window between 16 and 40 tokens lasts
                # however fast the engine steps (a fast host once finished the batch between two polls)
                chats_sent.wait(0.05)
            return execute(sched)
        decode.engine.runner.execute = counting
        nc = await connect(nats_server.url)
        try:
            flood = [asyncio.create_task(generate(nc, request(p, BATCH_TOKENS, "batch"))) for p in batch]
            assert await wait_until(ready, timeout=60.0)
            chat_tasks = [asyncio.create_task(generate(nc, request(p, CHAT_TOKENS, "interactive"))) for p in chats]
            await asyncio.sleep(0.2)   # the chats' requests reach the worker while the batch is held
            chats_sent.set()
            answers = await asyncio.gather(*chat_tasks)
            batch_answers = await asyncio.gather(*flood)
        finally:
            await nc.close()
        counters = decode.engine.kv_port.preempted.counters
        scrape = render(decode.metrics.registry)[0].decode()
        pulled = decode.tier.counters.blocks_pulled
    print(f"{decode.engine.num_preemptions} preemptions: {counters}; {pulled} blocks pulled from the tier, "
          f"{computed[0]} tokens computed")
    want = reference_outputs(folder, batch, BATCH_TOKENS) + reference_outputs(folder, chats, CHAT_TOKENS)
    assert [ids for ids, _, _ in batch_answers] + [ids for ids, _, _ in answers] == want
    assert decode.engine.num_preemptions >= 1 and counters.offers >= 1, counters
    assert counters.resumed + counters.kept == counters.offers and counters.resumed >= 1 and counters.resumed_blocks >= 1, counters
    assert pulled >= counters.resumed_blocks   # they came from the tier
    # every block a victim had computed was found again (device cache or pulled back): what ran beyond each token
    # once is at most each victim's unfinished last block
    once = sum(len(p) + BATCH_TOKENS - 1 for p in batch) + sum(len(p) + CHAT_TOKENS - 1 for p in chats)
    assert once <= computed[0] < once + 8 * decode.engine.num_preemptions, (computed[0], once)
    resumed = [line for line in scrape.splitlines()
               if line.startswith("deepinfer_worker_preempted_kv_total{") and 'result="resumed"' in line]
    assert resumed and float(resumed[0].rsplit(" ", 1)[1]) == counters.resumed
