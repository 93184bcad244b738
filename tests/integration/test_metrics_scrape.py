"""Prometheus /metrics of real service processes (``cli.launcher``): after a few requests through NATS,
each worker's and the cache tier's scrape parses and its counters moved exactly as the requests say. Plus the
request outcomes nothing else exercises (hand-back on drain, client cancel) on an in-process cluster."""
import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from shared import protocol
from shared.client import generate, generate_stream
from cli.launcher import Cluster, ClusterSpec
from shared.metrics.common import render
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, wait_until
from tests.model_factory import write_tiny_hf_folder
from tests.unit.test_metrics import parse

MAX_TOKENS = 4


async def scrape(http: aiohttp.ClientSession, port: int, timeout_s: float = 10.0) -> dict:
    """One scrape of ``127.0.0.1:port/metrics``, retried while the server is not listening yet (it starts just
    after the service's first heartbeat)."""
    for _ in range(int(timeout_s / 0.1)):
        try:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200, await resp.text()
                return parse(await resp.read())
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.1)
    raise AssertionError(f"nothing serves /metrics on port {port}")


VLLM_TYPES = {   # what vLLM's docs list (and dashboards / KEDA rules / the inference extension read), with types
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge", "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram", "vllm:cache_config_info": "gauge"}


async def metric_types(http: aiohttp.ClientSession, port: int) -> dict[str, str]:
    """``{family name: type}`` of one scrape, as ``prometheus_client``'s parser reads it."""
    async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return {f.name: f.type for f in text_string_to_metric_families((await resp.read()).decode())}


def total(samples: dict, name: str, **labels) -> float:
    """Sum of the samples ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(v for (n, lb), v in samples.items() if n == name and set(labels.items()) <= lb)


async def test_workers_and_tier_expose_what_they_served(nats_server, tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=4)
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, nats_url=nats_server.url, model=str(folder), kv_cache_mb=32,
                                  local_prefill_threshold=0, dtype="float64", http_port=-1))
    remote = [[3 + i] + list(range(10, 30)) for i in range(3)]     # 21 tokens: one full block each
    local = list(range(40, 52))
    try:
        await cluster.start()
        assert set(cluster.metrics_ports) == {"cache-0", "prefill-0", "decode-0"}
        nc = await connect(nats_server.url)
        try:
            reqs = [protocol.GenerateRequest(prompt_token_ids=p, max_tokens=MAX_TOKENS, temperature=0.0,
                                             ignore_eos=True, prefill_mode="remote") for p in remote]
            reqs.append(protocol.GenerateRequest(prompt_token_ids=local, max_tokens=MAX_TOKENS, temperature=0.0,
                                                 ignore_eos=True, prefill_mode="local"))
            results = [await generate(nc, r) for r in reqs]
        finally:
            await nc.close()
        assert [len(ids) for ids, _, _ in results] == [MAX_TOKENS] * 4
        async with aiohttp.ClientSession() as http:
            prefill = await scrape(http, cluster.metrics_ports["prefill-0"])
            decode = await scrape(http, cluster.metrics_ports["decode-0"])
            types = [await metric_types(http, cluster.metrics_ports[w]) for w in ("prefill-0", "decode-0")]
            tier = await scrape(http, cluster.metrics_ports["cache-0"])
            for _ in range(50):  # write-backs reach the tier from a background queue
                if total(tier, "deepinfer_cache_tier_puts_total") >= 1:
                    break
                await asyncio.sleep(0.1)
                tier = await scrape(http, cluster.metrics_ports["cache-0"])
    finally:
        cluster.stop()

    req = "deepinfer_worker_requests_total"
    assert total(prefill, req, outcome="handed_off", role="prefill", worker="prefill-0") == 3
    assert total(prefill, req) == 3
    assert total(decode, req, outcome="finished", role="decode") == 4 == total(decode, req)
    assert total(prefill, "deepinfer_worker_prompt_tokens_total") == sum(map(len, remote))
    assert total(decode, "deepinfer_worker_prompt_tokens_total") == len(local)      # hand-offs are not prefills
    assert total(prefill, "deepinfer_worker_ttft_seconds_count") == 3
    assert total(decode, "deepinfer_worker_ttft_seconds_count") == 1                # the local prefill
    assert total(decode, "deepinfer_worker_e2e_seconds_count") == 4
    generated = total(prefill, "deepinfer_worker_generation_tokens_total") + \
        total(decode, "deepinfer_worker_generation_tokens_total")
    assert generated == sum(u["completion_tokens"] for _, _, u in results) == 4 * MAX_TOKENS
    sent = total(prefill, "deepinfer_worker_kv_handoff_bytes_total", direction="sent")
    assert sent > 0 and sent == total(decode, "deepinfer_worker_kv_handoff_bytes_total", direction="received")
    assert total(prefill, "deepinfer_worker_kv_handoff_seconds_count", direction="sent") == 3
    for worker in (prefill, decode):
        assert total(worker, "deepinfer_worker_kv_capacity_blocks") > 0
        assert total(worker, "deepinfer_worker_prefix_cache_query_tokens_total") > 0
        assert total(worker, "deepinfer_worker_tier_up") == 1
        assert total(worker, "process_resident_memory_bytes") > 0
    for served in types:   # vLLM's names, with vLLM's types, beside deepinfer's
        assert {name: served.get(name) for name in VLLM_TYPES} == VLLM_TYPES
    model = {"model_name": folder.name}
    for worker in (prefill, decode):   # the same figures as deepinfer's own series
        assert total(worker, "vllm:prompt_tokens_total", **model) == total(worker, "deepinfer_worker_prompt_tokens_total")
        assert total(worker, "vllm:generation_tokens_total", **model) == \
            total(worker, "deepinfer_worker_generation_tokens_total")
        assert total(worker, "vllm:prefix_cache_queries_total") == \
            total(worker, "deepinfer_worker_prefix_cache_query_tokens_total")
        assert total(worker, "vllm:num_requests_running") == 0 and total(worker, "vllm:kv_cache_usage_perc") < 1
    assert total(prefill, "vllm:time_to_first_token_seconds_count") == 3
    assert total(decode, "vllm:request_success_total", finished_reason="length") == 4
    assert total(decode, "vllm:request_generation_tokens_count") == 4
    assert total(decode, "vllm:e2e_request_latency_seconds_count") == 4
    assert total(decode, "vllm:inter_token_latency_seconds_count") > 0
    assert total(tier, "deepinfer_cache_tier_puts_total") >= 1
    assert total(tier, "deepinfer_cache_tier_blocks", worker="cache-0") >= 1
    assert total(tier, "deepinfer_cache_tier_op_seconds_count", op="put") >= 1


async def test_hand_back_and_cancel_are_counted_once_each(nats_server, tmp_path):
    """In-process: a drained decode worker counts the streams it handed back as ``worker_lost``; a client that
    leaves early is counted ``cancelled``; every request a worker tracked has exactly one outcome."""
    # a model slow enough that 2,000 tokens outlast the client's cancel: with the tiny default, the relay (on the
    # test's one event loop) could forward the whole stream before the client had read its third chunk
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=5, max_position_embeddings=2048, num_layers=6, hidden=192,
                                  ffn=384)

    def req(i: int, max_tokens: int) -> protocol.GenerateRequest:
        return protocol.GenerateRequest(prompt_token_ids=[5 + i, 6, 7, 8] * 6, max_tokens=max_tokens,
                                        temperature=0.0, ignore_eos=True, prefill_mode="local")

    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=2, drain_grace_s=0.2, kv_cache_mb=64,
                                router_kw={"migrate_on_drain": False}) as cluster:   # hand-back, not migration
        victim, survivor = cluster.workers
        tasks = [asyncio.create_task(generate_once(nats_server.url, req(i, 300))) for i in range(3)]
        # every stream is held by a worker (none still in dispatch, where a refusal would be a failover too)
        assert await wait_until(lambda: len(victim.active) > 0 and len(victim.active) + len(survivor.active) == 3)
        await victim.shutdown()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert [len(ids) for ids, _, _ in results] == [300] * 3
        nc = await connect(nats_server.url)
        try:
            chunks = generate_stream(nc, req(9, 2000))  # seconds of work: it cannot end before the cancel lands
            async for chunk in chunks:
                if chunk.seq == 2:
                    break                                    # leaves early: the client publishes a cancel
            await chunks.aclose()
            assert await wait_until(lambda: total(scrape_local(survivor), "deepinfer_worker_requests_total",
                                                  outcome="cancelled") == 1)
        finally:
            await nc.close()
        lost = total(scrape_local(victim), "deepinfer_worker_requests_total", outcome="worker_lost")
        assert lost >= 1 and lost == sum(u["failovers"] for _, _, u in results)
        for worker in (victim, survivor):
            outcomes = {dict(lb)["outcome"]: v for (n, lb), v in scrape_local(worker).items()
                        if n == "deepinfer_worker_requests_total"}
            assert set(outcomes) <= {"finished", "worker_lost", "cancelled"}, outcomes
            assert worker.metrics.num_tracked == 0                # every started request ended once
        served = total(scrape_local(survivor), "deepinfer_worker_requests_total", outcome="finished")
        assert served + total(scrape_local(victim), "deepinfer_worker_requests_total", outcome="finished") == 3


def scrape_local(worker) -> dict:
    """An in-process worker's scrape, without HTTP."""
    return parse(render(worker.metrics.registry)[0])
