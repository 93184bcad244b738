"""DeepSeek V4 (tiny random checkpoint made by transformers) served through the real router and workers over a
real nats-server. Its KV does not travel between engines yet (``KVPort.travels``): the workers offer no KV
transport, so the router prefills on the decode worker whatever the policy would have split, a forced remote
prefill is refused with a clear error, a cache tier is left out, and a draining decode worker's streams are handed
back and recomputed elsewhere; every stream equals the single-process engine's greedy tokens, and a repeated
prompt hits the decode worker's prefix cache (a block-boundary state snapshot)."""
import asyncio

import pytest

from shared import protocol
from shared.client import generate
from shared.errors import DeepinferError, ErrorCode
from tests.deepseek_factory import VOCAB, write_v4_folder
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs, wait_until

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


async def test_v4_serves_locally_exactly_with_prefix_hits(nats_server, folder, tmp_path):
    ps = prompts()
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path) as cluster:
        assert all(not w.transports and w.tier is None for w in cluster.workers)
        nc = await connect(nats_server.url)
        try:
            first = [await generate(nc, request(p, f"a{i}")) for i, p in enumerate(ps)]
            again = [await generate(nc, request(p, f"b{i}")) for i, p in enumerate(ps)]
            with pytest.raises(DeepinferError) as forced:
                await generate(nc, request(ps[0], "forced", mode="remote"))
        finally:
            await nc.close()
        prefill = next(w for w in cluster.workers if w.config.role == "prefill")
        assert prefill.engine.block_manager.num_query_tokens == 0   # the router never sent it work
    assert [ids for ids, _, _ in first] == [ids for ids, _, _ in again] == expected
    for p, (_, _, usage) in zip(ps, again):
        assert usage["cached_tokens"] == (len(p) - 1) // 8 * 8   # the snapshot before the prompt's last token
    assert forced.value.code == ErrorCode.UNAVAILABLE


async def test_draining_v4_decode_worker_hands_its_streams_back(nats_server, folder):
    """No transport to migrate over: the drain's grace ends and the streams continue, recomputed, on the other
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

