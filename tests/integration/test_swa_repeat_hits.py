"""A sliding-window model (tiny random Gemma 3, window 8) in the default layout, one aggregated worker plus the
cache tier over a real nats-server: eight prompts, then the same eight again at once. Every repeat is served
from the tier (its device copy evicted by the others) with ``cached_tokens`` covering all but its last block, and
the single-process engine's greedy tokens; ``/metrics`` and ``deepinfer status`` show the full/window split. Before ``Request.reimport`` the repeats recomputed: the tier's blocks
were imported as free cached blocks when each request was added, and the window rows were evicted by the other
requests' prefill chunks before it was admitted (``cached_tokens: 0`` though the tier had served them)."""
import asyncio

import pytest

from shared import protocol
from cli import status
from shared.client import generate
from shared.metrics.common import render
from tests.gemma_factory import write_service_gguf
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs
from tests.unit.test_metrics import parse

TOKENS, BS = 6, 8


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_service_gguf(tmp_path_factory.mktemp("gemma"))


def prompts() -> list[list[int]]:
    return [[2] + [(17 * i + 5 * j + j * j) % 40 + 270 for j in range(40 + 31 * i)] for i in range(8)]  # 41..258


def request(prompt, rid: str) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=TOKENS, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0)


async def test_repeats_sent_together_are_served_from_the_tier(nats_server, gguf_path, tmp_path):
    ps = prompts()
    expected = reference_outputs(gguf_path, ps, TOKENS)
    # no worker dies here: a 5 s liveness window (not the harness's 1.5 s) keeps the one decode worker's heartbeat,
    # late while its engine imports 8 tier pulls on a loaded 2-core host, from reading as its death (CI, 2026-12-07)
    async with InProcessCluster(nats_server.url, gguf_path, prefill=0, decode=1, tier_dir=tmp_path,
                                tier_kw={"dram_mb": 16}, kv_cache_mb=1,   # window pool: 14 blocks
                                router_kw={"worker_dead_after_s": 5.0}) as cluster:
        nc = await connect(nats_server.url)
        try:
            first = [await generate(nc, request(p, f"a{i}")) for i, p in enumerate(ps)]
            again = await asyncio.gather(*[generate(nc, request(p, f"b{i}")) for i, p in enumerate(ps)])
            report = await status.collect(nc, listen_s=1.3)
        finally:
            await nc.close()
        worker = cluster.workers[0]
        pulled = worker.tier.stats()["blocks_pulled"]
        samples = parse(render(worker.metrics.registry)[0])
        pools = {p["name"]: p for p in worker.engine.kv_pools()}
    assert [t for t, _, _ in first] == expected and [t for t, _, _ in again] == expected
    cached = [usage["cached_tokens"] for _, _, usage in again]
    assert all(c >= len(p) - BS for c, p in zip(cached, ps)), cached
    assert pulled > 0 and sum(usage["tier_cached_tokens"] for _, _, usage in again) > 0
    assert set(pools) == {"full", "window"} and pools["window"]["blocks"] == 14
    for name, pool in pools.items():
        got = {metric: v for (metric, labels), v in samples.items() if ("pool", name) in labels}
        assert got["deepinfer_worker_kv_pool_blocks"] == pool["blocks"]
        assert got["deepinfer_worker_kv_pool_block_bytes"] == pool["block_bytes"] > 0
        assert 0 <= got["deepinfer_worker_kv_pool_free_blocks"] <= pool["blocks"]
    assert f"pools full {pools['full']['blocks'] - pools['full']['free']}/{pools['full']['blocks']}" in \
        status.format_status(report).replace("  ", " ")
