"""Metric sets of the workers, the cache tier and the draft service, and the /metrics server: every scrape is
rendered, parsed back with prometheus_client's parser and checked value by value."""
import logging
import socket
from types import SimpleNamespace

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.cache_tier.service import CacheTierService
from services.decode.service import DecodeService
from services.cache_tier.config import CacheTierConfig
from services.worker.config import WorkerConfig
from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.engine.speculator import Speculator
from services.cache_tier.store import TieredBlockStore
from services.worker.tier_client import TierClient
from shared.metrics.common import BoundedLabel, new_registry, render
from services.draft.metrics import DraftMetrics
from shared.metrics.server import MetricsServer
from services.worker.metrics import WorkerMetrics
from shared.spec.prompt_lookup import PromptLookupDrafter
from tests.tiny_model import tiny_model
from tests.unit.test_block_store import config as store_config, make_blocks


def parse(body: bytes) -> dict[tuple[str, frozenset], float]:
    """``{(sample name, labels): value}`` of a Prometheus text scrape."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def scrape(registry) -> dict[tuple[str, frozenset], float]:
    body, content_type = render(registry)
    assert content_type.startswith("text/plain")
    return parse(body)


def value(samples, name: str, **labels) -> float:
    """The one sample ``name`` whose labels include ``labels``."""
    found = [v for (n, lb), v in samples.items() if n == name and set(labels.items()) <= lb]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]


W = {"worker": "p0", "role": "prefill"}


def test_worker_events_count_outcomes_latencies_tokens_and_handoffs():
    m = WorkerMetrics("p0", "prefill")
    m.request_started("a", now=0.0)
    m.output("a", 0, 1, None, None, now=0.25)          # first token streamed: TTFT 0.25, no E2E
    m.request_ended("a", "handed_off")
    m.request_started("b", now=1.0)
    m.output("b", 0, 1, None, None, now=1.5)
    m.output("b", 1, 3, "length", 0.05, now=3.0)       # final chunk of a served request: E2E 2.0, TPOT 0.05
    m.request_ended("b", "finished")
    m.request_ended("b", "finished")                   # counted once
    m.request_ended("never-started", "finished")       # ignored
    for rid, outcome in (("c", "timeout"), ("d", "made-up")):
        m.request_started(rid)
        m.request_ended(rid, outcome)
    m.prompt_done(10, 4, 8)
    m.prompt_done(6, 9, 0)                             # cached is clamped to the prompt
    m.handoff("shm", "sent", 1000, 0.01)
    m.handoff("shm", "sent", 500, 0.02)
    m.handoff("stream", "received", 7, 0.5)
    s = scrape(m.registry)
    req = "deepinfer_worker_requests_total"
    assert {o: value(s, req, outcome=o) for o in ("handed_off", "finished", "timeout", "other")} == \
        {"handed_off": 1, "finished": 1, "timeout": 1, "other": 1}
    assert value(s, "deepinfer_worker_ttft_seconds_count", **W) == 2
    assert value(s, "deepinfer_worker_ttft_seconds_sum", **W) == pytest.approx(0.75)
    assert value(s, "deepinfer_worker_e2e_seconds_sum", **W) == pytest.approx(2.0)
    assert value(s, "deepinfer_worker_e2e_seconds_count", **W) == 1
    assert value(s, "deepinfer_worker_tpot_seconds_sum", **W) == pytest.approx(0.05)
    assert value(s, "deepinfer_worker_generation_tokens_total", **W) == 5
    assert value(s, "deepinfer_worker_prompt_tokens_total", **W) == 16
    assert value(s, "deepinfer_worker_prompt_cached_tokens_total", **W) == 10
    assert value(s, "deepinfer_worker_prompt_tier_tokens_total", **W) == 4
    assert value(s, "deepinfer_worker_kv_handoff_bytes_total", transport="shm", direction="sent") == 1500
    assert value(s, "deepinfer_worker_kv_handoff_seconds_count", transport="shm", direction="sent") == 2
    assert value(s, "deepinfer_worker_kv_handoff_bytes_total", transport="stream", direction="received") == 7
    assert value(s, "deepinfer_worker_kv_handoff_seconds_bucket", transport="stream", direction="received",
                 le="0.5") == 1
    assert m.num_tracked == 0


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, max_position_embeddings=128)


async def test_worker_collector_reads_engine_tier_and_speculation_counters(model):
    engine = LLMEngine(model, EngineConfig(block_size=8, num_kv_blocks=32))
    engine.set_speculator(Speculator(PromptLookupDrafter()))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [5, 6, 7, 8] * 5
    engine.generate([prompt], params)
    engine.generate([prompt], params)                 # a prefix-cache hit
    engine.add_request([9, 10, 11], params, "queued")  # waiting: never stepped
    tier = TierClient(None, "d0", "cache-0", "h", {})
    tier.counters.pulls, tier.counters.pull_hits, tier.counters.pull_failures = 5, 3, 1
    tier.counters.writes, tier.counters.writes_dropped, tier.counters.blocks_written = 4, 2, 9
    spec = engine.speculator.counters
    spec.steps, spec.proposals, spec.drafted, spec.accepted = spec.steps + 2, spec.proposals + 3, \
        spec.drafted + 7, spec.accepted + 5
    runtime = SimpleNamespace(draining=True, error_counts={"timeout": 2, "internal": 1},
                              info=SimpleNamespace(role="prefill"))
    worker = SimpleNamespace(aengine=AsyncEngine(engine), engine=engine, runtime=runtime, tier=tier,
                             active={"x": None}, role_switches=3)
    m = WorkerMetrics("d0", "decode")
    m.watch(worker)
    s = scrape(m.registry)
    bm = engine.block_manager
    assert value(s, "deepinfer_worker_waiting_sequences") == 1
    assert value(s, "deepinfer_worker_running_sequences") == 0
    assert value(s, "deepinfer_worker_queued_prefill_tokens") == 3
    assert value(s, "deepinfer_worker_active_requests") == 1
    assert value(s, "deepinfer_worker_kv_capacity_blocks", worker="d0", role="decode") == 32
    assert value(s, "deepinfer_worker_kv_blocks", state="free") == bm.num_free_blocks
    assert value(s, "deepinfer_worker_kv_blocks", state="used") == 32 - bm.num_free_blocks
    assert value(s, "deepinfer_worker_prefix_cache_query_tokens_total") == bm.num_query_tokens > 0
    assert value(s, "deepinfer_worker_prefix_cache_hit_tokens_total") == bm.num_hit_tokens > 0
    assert value(s, "deepinfer_worker_prefix_cache_blocks") == len(bm.cached) > 0
    assert value(s, "deepinfer_worker_draining") == 1
    assert value(s, "deepinfer_worker_serving_role", serving="prefill") == 1  # a switched worker's current role
    assert value(s, "deepinfer_worker_role_switches_total") == 3
    assert value(s, "deepinfer_worker_handler_errors_total", code="timeout") == 2
    assert value(s, "deepinfer_worker_handler_errors_total", code="internal") == 1
    assert value(s, "deepinfer_worker_tier_up") == 0
    assert {r: value(s, "deepinfer_worker_tier_pulls_total", result=r) for r in ("hit", "miss", "failed")} == \
        {"hit": 3, "miss": 1, "failed": 1}
    assert value(s, "deepinfer_worker_tier_writebacks_total", result="dropped") == 2
    assert value(s, "deepinfer_worker_tier_written_blocks_total") == 9
    assert value(s, "deepinfer_worker_spec_drafted_tokens_total") == spec.drafted
    assert value(s, "deepinfer_worker_spec_accepted_tokens_total") == spec.accepted
    assert value(s, "deepinfer_worker_spec_steps_total") == spec.steps > 0
    assert value(s, "deepinfer_worker_spec_draft_errors_total", cause="drafter") == 0


def test_a_worker_is_scrapable_before_it_starts():
    worker = DecodeService(WorkerConfig(role="decode", worker_id="d9"))
    s = scrape(worker.metrics.registry)
    assert not any(n.startswith("deepinfer_worker_kv") for n, _ in s)   # no engine yet: nothing read
    assert value(s, "deepinfer_worker_generation_tokens_total", worker="d9") == 0


async def test_cache_tier_metrics_read_store_and_ledger_per_class(tmp_path):
    svc = CacheTierService(CacheTierConfig(worker_id="cache-7", directory=str(tmp_path)))
    svc.store = await TieredBlockStore.open(store_config(tmp_path))
    try:
        blocks = make_blocks(3)
        await svc.store.put_many(blocks, "chat")
        assert await svc.store.get(blocks[0].block_hash, blocks[0].token_ids, "chat") is not None
        assert await svc.store.get(12345, [1, 2, 3, 4], "chat") is None
        svc.ledger.record_put("tenant-a", "chat", 3, 999)
        svc.ledger.record_put("tenant-b", "chat", 1, 1)
        svc.ledger.record_get("tenant-a", "agent", 4, 1, 2, 12, 300)
        svc.announced = {b.block_hash for b in blocks}
        svc.metrics.operation("get", 0.002)
        s = scrape(svc.metrics.registry)
        stats = svc.store.stats()
    finally:
        await svc.store.close()
    lb = {"worker": "cache-7"}
    assert value(s, "deepinfer_cache_tier_blocks", tier="dram", **lb) == stats["dram_blocks"] == 3
    assert value(s, "deepinfer_cache_tier_bytes", tier="dram") == stats["dram_bytes"] > 0
    assert value(s, "deepinfer_cache_tier_capacity_bytes", tier="ssd") == 1 << 20
    assert value(s, "deepinfer_cache_tier_lookups_total", result="dram_hit") == 1
    assert value(s, "deepinfer_cache_tier_lookups_total", result="miss") == 1
    assert value(s, "deepinfer_cache_tier_puts_total", retention="chat") == 2        # two tenants, one series
    assert value(s, "deepinfer_cache_tier_put_bytes_total", retention="chat") == 1000
    assert value(s, "deepinfer_cache_tier_get_blocks_total", retention="agent", result="ssd_hit") == 2
    assert value(s, "deepinfer_cache_tier_get_blocks_total", retention="agent", result="miss") == 1
    assert value(s, "deepinfer_cache_tier_served_tokens_total", retention="agent") == 12
    assert value(s, "deepinfer_cache_tier_announced_blocks") == 3
    assert value(s, "deepinfer_cache_tier_op_seconds_count", op="get") == 1
    assert not any("tenant" in dict(lb) for _, lb in s)


def test_draft_metrics_read_the_service_counters():
    m = DraftMetrics("draft-0", "self:8")
    svc = SimpleNamespace(served=3, sequences=7, tokens=21, stale=4, runtime=SimpleNamespace(num_inflight=2,
                                                                                     error_counts={}))
    m.watch(svc)
    m.request_seconds.observe(0.004)
    s = scrape(m.registry)
    lb = {"worker": "draft-0", "drafter": "self:8"}
    assert value(s, "deepinfer_draft_requests_total", **lb) == 3
    assert value(s, "deepinfer_draft_proposals_total") == 7
    assert value(s, "deepinfer_draft_proposed_tokens_total") == 21
    assert value(s, "deepinfer_draft_stale_requests_total") == 4
    assert value(s, "deepinfer_draft_inflight_requests") == 2
    assert value(s, "deepinfer_draft_request_seconds_count") == 1


def test_bounded_label_folds_excess_values():
    label = BoundedLabel("reason", cap=2)
    assert [label(v) for v in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


class Broken(Collector):
    def collect(self):
        raise RuntimeError("bug")


async def test_server_serves_scrapes_fails_visibly_and_never_takes_the_service_down(caplog):
    registry = new_registry()
    counter = WorkerMetrics("w", "decode", registry)
    counter.generation_tokens.inc(3)
    server = MetricsServer(registry, "w")
    port = await server.start(0, host="127.0.0.1")
    assert port and await server.start(0) == port                 # idempotent
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                s = parse(await resp.read())
            assert value(s, "deepinfer_worker_generation_tokens_total") == 3
            assert any(n.startswith("process_") for n, _ in s)
            accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
            async with http.get(f"http://127.0.0.1:{port}/metrics", headers=accept) as resp:
                assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
                assert (await resp.text()).endswith("# EOF\n")
            with socket.socket() as busy, caplog.at_level(logging.ERROR):
                busy.bind(("127.0.0.1", 0))
                busy.listen()
                other = MetricsServer(new_registry(), "w2")
                assert await other.start(busy.getsockname()[1], host="127.0.0.1") == 0
                assert "running without metrics" in caplog.text
            registry.register(Broken())
            with caplog.at_level(logging.ERROR):
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert resp.status == 500
    finally:
        await server.stop()
        await server.stop()                                      # idempotent


def test_openmetrics_scrapes_keep_vllm_names_as_they_are():
    """Prometheus asks for OpenMetrics first: ``vllm:*`` samples must keep their colon there (prometheus_client's
    default escaping wrote ``vllm_*`` under a ``vllm:`` TYPE line, and Prometheus stored no ``vllm:`` series);
    a scraper that names an escaping gets it; plain text is unchanged."""
    from prometheus_client import CollectorRegistry, Gauge
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

    from shared.metrics.common import render
    registry = CollectorRegistry()
    Gauge("vllm:num_requests_running", "Requests running", ["worker"], registry=registry).labels("d0").set(3)
    prometheus = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                  "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")   # what Prometheus 2.x sends
    body, content_type = render(registry, prometheus)
    assert content_type.startswith("application/openmetrics-text")
    samples = [(s.name, s.value) for f in parse_openmetrics(body.decode()) for s in f.samples]
    assert samples == [("vllm:num_requests_running", 3.0)]
    escaped, _ = render(registry, "application/openmetrics-text;version=1.0.0;escaping=underscores")
    assert b"\nvllm_num_requests_running{" in escaped
    text, text_type = render(registry, "")
    assert text_type.startswith("text/plain") and b'\nvllm:num_requests_running{worker="d0"} 3.0' in text
