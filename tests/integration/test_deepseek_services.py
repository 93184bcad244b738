"""DeepSeek V3 (tiny random checkpoint made by transformers: MLA, MoE) served through the real router, prefill and
decode workers and the cache tier over a real nats-server: prompts prefilled remotely (latent-KV hand-off), served
again from the tier's latent blocks, and a stream live-migrated mid-decode all equal the single-process engine's
greedy tokens; what travels is latent rows (one per token and layer), not expanded K/V."""
import asyncio

import pytest

from shared import protocol
from shared.client import generate
from shared.metrics.common import render
from tests.deepseek_factory import VOCAB, write_v3_folder
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until
from tests.integration.test_live_migration import ask_router, collect
from tests.unit.test_metrics import parse

TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_v3_folder(tmp_path_factory.mktemp("dsv3"), seed=2)


def prompts() -> list[list[int]]:
    return [[(29 * i + 7 * j) % (VOCAB - 10) + 5 for j in range(40 + 9 * i)] for i in range(3)]  # 40..58 tokens


def request(prompt, rid: str, mode: str, max_tokens: int = TOKENS) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0, prefill_mode=mode)


def received_bytes(worker) -> float:
    return sum(s.value for m in worker.metrics._handoff_bytes.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels["direction"] == "received")


async def test_latent_kv_hand_off_and_tier_hits_are_exact(nats_server, folder, tmp_path):
    ps = prompts()
    expected = reference_outputs(folder, ps, TOKENS)
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path, tier_kw={"dram_mb": 16}) as cluster:
        nc = await connect(nats_server.url)
        try:
            remote = [(await generate(nc, request(p, f"r{i}", "remote")))[0] for i, p in enumerate(ps)]
            written = lambda: cluster.tier.ledger.as_dict()["total"]["blocks_written"]   # noqa: E731
            assert await wait_until(lambda: written() >= sum(len(p) // 8 for p in ps), timeout=30.0), written()
            for w in cluster.workers:   # forget the device prefix caches: the next pass must come from the tier
                w.engine.block_manager.reset_prefix_cache()
            again = [await generate(nc, request(p, f"t{i}", "local")) for i, p in enumerate(ps)]
        finally:
            await nc.close()
        decode = next(w for w in cluster.workers if w.config.role == "decode")
        port = decode.engine.kv_port
        block_bytes, hand_off = port.block_bytes, received_bytes(decode)
        samples = parse(render(decode.metrics.registry)[0])
    routed = {(dict(labels)["layer"], dict(labels)["expert"]): v for (name, labels), v in samples.items()
              if name == "deepinfer_worker_moe_expert_tokens_total"}
    assert remote == expected and [t for t, _, _ in again] == expected
    assert all(usage["tier_cached_tokens"] >= len(p) - 8 - 8 for p, (_, _, usage) in zip(ps, again)), again
    assert port.block_shape == [4, 2, 1, 8, 24]          # per token and layer: one 48-number latent row
    assert block_bytes == 4 * 8 * 48 * 8                 # float64 workers
    assert 0 < hand_off <= sum(-(-len(p) // 8) for p in ps) * block_bytes
    # expert load on /metrics: layers 2 and 3 are MoE (8 experts each); every token the decode worker computed
    # went to 2 experts in each
    assert {layer for layer, _ in routed} == {"2", "3"} and len(routed) == 16
    assert sum(v for (layer, _), v in routed.items() if layer == "2") == \
        sum(v for (layer, _), v in routed.items() if layer == "3") > 0


MIGRATING = dict(prefill=1, decode=2, transports="shm,stream",   # a router that moves a stream at once
                 router_kw={"migrate_skew_min": 0, "migrate_kv_high": 2.0})


async def migrated_stream(url: str, cluster, prompt: list[int], tokens: int):
    """Stream ``prompt`` (prefilled remotely), ask the router to migrate it once it started: ``(ack, chunks)``."""
    nc = await connect(url)
    try:
        started = asyncio.Event()
        task = asyncio.create_task(collect(nc, request(prompt, "m", "remote", tokens), started))
        await asyncio.wait_for(started.wait(), 30)
        ack = await ask_router(nc, cluster, "m")
        return ack, await task
    finally:
        await nc.close()


async def test_a_v3_stream_moves_mid_decode_and_stays_exact(nats_server, folder):
    prompt = prompts()[1]
    expected = reference_outputs(folder, [prompt], 300)[0]
    async with InProcessCluster(nats_server.url, folder, **MIGRATING) as cluster:
        ack, chunks = await migrated_stream(nats_server.url, cluster, prompt, 300)
    assert ack.detail.startswith("decode-")
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].usage["migrations"] == 1


async def test_mtp_drafting_decode_workers_stay_exact_across_hand_off_and_migration(nats_server, tmp_path):
    """Decode workers drafting with the checkpoint's MTP layer (``--draft local --drafter mtp``): a stream
    prefilled remotely (its decode worker has no hidden states for the prompt) and then live-migrated (the
    receiver has none either) equals the single-process engine's greedy tokens, and both workers drafted."""
    folder = write_v3_folder(tmp_path / "mtp", seed=2, mtp=True)
    prompt = prompts()[1]
    expected = reference_outputs(folder, [prompt], 200)[0]
    async with InProcessCluster(nats_server.url, folder, draft="local", drafter="mtp", spec_k=3,
                                **MIGRATING) as cluster:
        _, chunks = await migrated_stream(nats_server.url, cluster, prompt, 200)
        decoders = [w for w in cluster.workers if w.config.role == "decode"]
        drafted = [w.engine.speculator.counters.proposals for w in decoders]
    assert [t for c in chunks for t in c.token_ids] == expected and chunks[-1].usage["migrations"] == 1
    assert all(n > 0 for n in drafted), drafted


async def test_a_gqa_worker_beside_mla_workers_never_takes_their_kv(nats_server, folder, tmp_path):
    """A Llama-shaped (GQA) prefill worker joins the V3 cluster's NATS: the router places V3 requests only on
    the V3 build's workers (one fingerprint per placement), so no latent block ever reaches the GQA worker and
    every answer is the V3 engine's."""
    from services.prefill.service import PrefillService
    from tests.integration.services_harness import worker_config
    from tests.model_factory import write_tiny_hf_folder

    ps = prompts()
    expected = reference_outputs(folder, ps, TOKENS)
    gqa = PrefillService(worker_config("prefill", nats_server.url, write_tiny_hf_folder(tmp_path / "llama", seed=3),
                                       "prefill-gqa"))
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm,stream") as cluster:
        await gqa.start()
        try:
            assert await wait_until(lambda: "prefill-gqa" in cluster.router.table.workers)
            nc = await connect(nats_server.url)
            try:
                got = [(await generate(nc, request(p, f"g{i}", "remote")))[0] for i, p in enumerate(ps)]
            finally:
                await nc.close()
            gqa_fingerprint = gqa.engine.fingerprint
            queried = gqa.engine.block_manager.num_query_tokens
        finally:
            await gqa.shutdown()
        v3_fingerprint = cluster.workers[0].engine.fingerprint
    assert got == expected
    assert gqa_fingerprint != v3_fingerprint and queried == 0      # the GQA worker never saw a V3 request
