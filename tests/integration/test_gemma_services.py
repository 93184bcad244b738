"""A sliding-window model (a tiny random Gemma 3: window 8 on five of every six layers, SentencePiece vocabulary)
served disaggregated through the real router, prefill and decode workers and the cache tier over a real
nats-server: prompts several windows long come back equal to the single-process engine's greedy tokens when
prefilled remotely (KV hand-off), when their prefix comes from the cache tier, and as text through the router's
tokenizer; the hand-offs carry and the tier stores fewer bytes than whole blocks (window rows only where a window
still sees them)."""
import pytest

from shared import protocol
from shared.client import generate
from tests.gemma_factory import write_service_gguf
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, reference_outputs, wait_until

TOKENS = 24


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_service_gguf(tmp_path_factory.mktemp("gemma"))


def prompts() -> list[list[int]]:
    return [[2] + [(17 * i + 5 * j) % 40 + 270 for j in range(30 + 7 * i)] for i in range(3)]  # 31..45 tokens


def ids_of(cluster, text: str) -> list[int]:
    return cluster.router.tokenizer.encode(text)


def handoff_bytes(worker, direction: str) -> float:
    return sum(sample.value for metric in worker.metrics._handoff_bytes.collect() for sample in metric.samples
               if sample.name.endswith("_total") and sample.labels["direction"] == direction)


def request(prompt, rid: str, mode: str) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, request_id=rid, max_tokens=TOKENS, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0, prefill_mode=mode)


async def test_a_sliding_window_model_is_exact_through_hand_off_and_tier(nats_server, gguf_path, tmp_path):
    ps = prompts()
    expected = reference_outputs(gguf_path, ps, TOKENS)
    async with InProcessCluster(nats_server.url, gguf_path, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path) as cluster:
        nc = await connect(nats_server.url)
        try:
            remote = [(await generate(nc, request(p, f"r{i}", "remote")))[0] for i, p in enumerate(ps)]
            for w in cluster.workers:  # forget the device prefix caches: the next pass must come from the tier
                w.engine.block_manager.reset_prefix_cache()
            from_tier = [(await generate(nc, request(p, f"t{i}", "local")))[0] for i, p in enumerate(ps)]
            text = protocol.GenerateRequest(prompt="hello world is the world", max_tokens=8, temperature=0.0,
                                            ignore_eos=True, timeout_s=60.0, prefill_mode="remote")
            by_text = (await generate(nc, text))[0]
        finally:
            await nc.close()
        assert remote == expected and from_tier == expected
        tier_hits = sum(w.metrics.prompt_tier_tokens._value.get() for w in cluster.workers)
        assert tier_hits > 0, "no prompt token came from the cache tier"
        # SWA-aware wire and tier: the released / unseen window rows neither travel nor take room in the tier
        block_bytes, bs = cluster.workers[0].engine.kv_port.block_bytes, 8
        logical = sum(-(-len(p) // bs) for p in ps + [ids_of(cluster, "hello world is the world")]) * block_bytes
        received = sum(handoff_bytes(w, "received") for w in cluster.workers)
        assert 0 < received < logical, (received, logical)
        written = cluster.tier.ledger.as_dict()["total"]
        assert 0 < written["bytes_written"] < written["blocks_written"] * block_bytes, written
    tokenizer = cluster.router.tokenizer
    ids = tokenizer.encode("hello world is the world")
    assert ids[0] == 2 and ids.count(2) == 1                      # Gemma's <bos>, once
    assert by_text == reference_outputs(gguf_path, [ids], 8)[0]


async def test_a_local_prefill_writes_its_prompt_back_while_the_window_holds_its_end(nats_server, gguf_path,
                                                                                   tmp_path):
    """A decode worker that prefilled a prompt itself writes it back at its first token: a later prompt sharing the
    document but not the question is then served from the tier (at the request's end the window has moved on by
    the answer and no longer holds the rows such a hit needs)."""
    doc = [2] + [(13 * j) % 40 + 270 for j in range(44)]
    first, second = doc + [301, 302, 303, 304], doc + [305, 306, 307, 308]
    expected = reference_outputs(gguf_path, [second], TOKENS)[0]
    async with InProcessCluster(nats_server.url, gguf_path, prefill=1, decode=1, transports="shm,stream",
                                tier_dir=tmp_path) as cluster:
        nc = await connect(nats_server.url)
        try:
            await generate(nc, request(first, "a", "local"))
            written = lambda: cluster.tier.ledger.as_dict()["total"]["blocks_written"]   # noqa: E731
            # write-backs are sent in the background: the prompt's 6 blocks and the answer's 3, or all 9 at the end
            assert await wait_until(lambda: written() >= 9, timeout=30.0), written()
            for w in cluster.workers:
                w.engine.block_manager.reset_prefix_cache()
            got, _, usage = await generate(nc, request(second, "b", "local"))
        finally:
            await nc.close()
        stats = [(w.config.worker_id, w.tier.stats()) for w in cluster.workers], cluster.tier.ledger.as_dict()
    assert got == expected
    assert usage["tier_cached_tokens"] >= 40, (usage, stats)   # 5 of the shared 45 tokens' blocks (block size 8)
