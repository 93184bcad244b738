"""Router → prefill → decode over a real nats-server: exact tokens on every transport, replicas under
concurrency, and bad input answered with error codes."""
import asyncio
import time
import random

import msgpack
import pytest

from shared.client import generate, generate_stream
from shared import protocol, subjects
from shared.errors import DeepinferError, ErrorCode
from shared.kv.registry import available_transports
from tests.integration.conftest import connect
from tests.integration.services_harness import (InProcessCluster, all_blocks_free, fault_first_call, generate_once,
                                                reference_outputs, wait_until)
from tests.model_factory import write_tiny_hf_folder

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=512)


def varied_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 280) for _ in range(24)]
    out = []
    for i in range(n):
        length = rng.choice([5, 8, 13, 16, 17, 31, 40, 64, 77])
        tail = [rng.randrange(3, 280) for _ in range(length)]
        out.append(shared + tail if i % 3 == 0 else tail)
    return out


@pytest.fixture(scope="module")
def prompts_and_reference(folder):
    prompts = varied_prompts(20)
    return prompts, reference_outputs(folder, prompts, MAX_TOKENS)


def request(prompt, **kw) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                                    temperature=0.0, ignore_eos=True, timeout_s=60.0, **kw)


@pytest.mark.parametrize("mode", [*(t for t in ("shm", "stream", "tcp", "nixl") if t in available_transports()), "local"])
async def test_greedy_equals_single_process_engine(nats_server, folder, prompts_and_reference, mode):
    prompts, expected = prompts_and_reference
    kw = {"prefill_mode": "local"} if mode == "local" else {"prefill_mode": "remote", "transport": mode}
    async with InProcessCluster(nats_server.url, folder, transports=mode if mode != "local" else "shm"):
        nc = await connect(nats_server.url)
        try:
            results = await asyncio.gather(*(generate(nc, request(p, **kw)) for p in prompts))
        finally:
            await nc.close()
    for i, ((ids, _text, usage), exp) in enumerate(zip(results, expected)):
        assert ids == exp, f"prompt {i} ({len(prompts[i])} tokens) diverged via {mode}"
        assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(prompts[i])


async def test_two_prefill_two_decode_fifty_concurrent(nats_server, folder):
    prompts = varied_prompts(50, seed=1)
    expected = reference_outputs(folder, prompts, 6)
    async with InProcessCluster(nats_server.url, folder, prefill=2, decode=2,
                                local_prefill_threshold=20) as cluster:
        nc = await connect(nats_server.url)
        try:
            results = await asyncio.gather(*(generate(nc, request(p, max_tokens=6)) for p in prompts))
        finally:
            await nc.close()
        served = {w.config.worker_id: w.engine.block_manager.num_query_tokens for w in cluster.workers}
    assert [r[0] for r in results] == expected
    assert all(n > 0 for n in served.values()), f"every replica should have served work: {served}"


async def ask_raw(nc, payload: bytes):
    reply = await nc.request(subjects.GENERATE, payload, timeout=10)
    return protocol.decode(reply.data, (protocol.ErrorReply, protocol.TokenChunk))


async def test_bad_input_gets_error_codes_and_service_stays_up(nats_server, folder):
    good = request([5, 6, 7, 8, 9], max_tokens=3)
    async with InProcessCluster(nats_server.url, folder):
        nc = await connect(nats_server.url)
        try:
            raw = protocol.encode(good)
            fields = msgpack.unpackb(raw)
            cases = {
                b"\x00garbage\xff": ErrorCode.INVALID_REQUEST,
                msgpack.packb({**fields, "v": 99}): ErrorCode.UNSUPPORTED_VERSION,
                msgpack.packb({k: v for k, v in fields.items() if k != "prompt_token_ids"}): ErrorCode.INVALID_REQUEST,
                msgpack.packb({**fields, "max_tokens": "ten"}): ErrorCode.INVALID_REQUEST,
                msgpack.packb({**fields, "temperature": -1.0}): ErrorCode.INVALID_REQUEST,
                msgpack.packb({**fields, "prompt_token_ids": [1] * 1_200_000}): ErrorCode.INVALID_REQUEST,
                msgpack.packb({**fields, "prompt_token_ids": None, "prompt": "x" * 5_000_000}):
                    ErrorCode.PAYLOAD_TOO_LARGE,
            }
            for payload, code in cases.items():
                reply = await ask_raw(nc, payload)
                assert isinstance(reply, protocol.ErrorReply) and reply.code == code.value, (payload[:20], reply)
            for bad, code in ((request([5, 6], model="no-such-model"), ErrorCode.MODEL_NOT_FOUND),
                              (request([10**6]), ErrorCode.INVALID_REQUEST),
                              (request([1] * 600), ErrorCode.PROMPT_TOO_LONG)):
                with pytest.raises(DeepinferError) as err:
                    await generate(nc, bad)
                assert err.value.code == code
            ids, _, _ = await generate(nc, good)
            assert len(ids) == 3
        finally:
            await nc.close()




async def test_a_prompt_beyond_every_context_window_is_refused_at_the_door(nats_server, folder):
    """The router refuses a prompt that fills its decode workers' context window (``max_model_len`` from their
    heartbeats) before hashing or placing it: no worker ever sees it (issue 21: 900k tokens used to be hashed
    on the router's loop, then refused by a worker, again on every failover)."""
    async with InProcessCluster(nats_server.url, folder) as cluster:
        window = cluster.workers[-1].engine.max_model_len
        nc = await connect(nats_server.url)
        try:
            for n in (window, 900_000):
                with pytest.raises(DeepinferError) as err:
                    await generate(nc, request([7] * n))
                assert err.value.code == ErrorCode.PROMPT_TOO_LONG and f"window is {window}" in err.value.message
            ids, _, _ = await generate(nc, request([7] * (window - 4), max_tokens=3))
            assert len(ids) == 3
        finally:
            await nc.close()
    assert all(w.runtime.error_counts.get("prompt_too_long", 0) == 0 for w in cluster.workers)


async def test_client_cancel_stops_the_work_and_frees_blocks(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder) as cluster:
        nc = await connect(nats_server.url)
        try:
            req = request(list(range(3, 60)), max_tokens=400, request_id="to-cancel", prefill_mode="remote")
            seen = 0
            async for chunk in generate_stream(nc, req):
                seen += 1
                if seen == 3:
                    break  # leaving the stream publishes di.v1.cancel
            assert await wait_until(lambda: all_blocks_free(cluster)), "cancelled work must be freed"
            decode = cluster.workers[-1]
            assert decode.engine.block_manager.num_query_tokens > 0
        finally:
            await nc.close()


async def test_failed_handoff_fails_cleanly_and_frees_both_sides(nats_server, folder, monkeypatch):
    async with InProcessCluster(nats_server.url, folder, transports="shm") as cluster:
        decode = cluster.workers[-1]

        async def broken_fetch(*args, **kwargs):  # fault injection: the transfer breaks mid-way
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, "injected: link down")

        monkeypatch.setattr(decode.transports["shm"], "fetch", broken_fetch)
        nc = await connect(nats_server.url)
        try:
            with pytest.raises(DeepinferError) as err:
                await generate(nc, request(list(range(3, 50)), prefill_mode="remote", transport="shm"))
            assert err.value.code == ErrorCode.TRANSFER_FAILED and "link down" in err.value.message
            assert await wait_until(lambda: all_blocks_free(cluster))
            assert cluster.workers[0].transports["shm"].staged_bytes == 0  # sender staging released
            monkeypatch.undo()
            ids, _, _ = await generate(nc, request(list(range(3, 50)), prefill_mode="remote", transport="shm"))
            assert len(ids) == MAX_TOKENS  # and the pair keeps serving
        finally:
            await nc.close()




async def test_failed_handoff_fails_over_to_another_pair(nats_server, folder, monkeypatch):
    """The first KV fetch anywhere breaks: the router re-places the stream (prompt + the first token the
    prefill worker already delivered) on the other decode worker; the client sees one exact stream."""
    prompt = list(range(3, 50))
    expected = reference_outputs(folder, [prompt], MAX_TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="shm") as cluster:
        async def link_down(transport):
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, "injected: link down")

        broken = fault_first_call(monkeypatch, [w.transports["shm"] for w in cluster.workers[1:]], "fetch",
                                  link_down)
        ids, _, usage = await generate_once(nats_server.url, request(prompt, prefill_mode="remote", transport="shm"))
        assert broken and ids == expected
        assert usage["failovers"] == 1 and usage["completion_tokens"] == MAX_TOKENS
        assert usage["prompt_tokens"] == len(prompt)
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_prefill_worker_dying_before_the_handoff_fails_over(nats_server, folder, monkeypatch):
    """The prefill worker streams the first token, then dies before handing the KV off: the router (which
    watches it until the decode worker's first chunk) re-places the stream on the other prefill worker."""
    prompt = list(range(3, 50))
    expected = reference_outputs(folder, [prompt], MAX_TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=2, decode=1, transports="shm") as cluster:
        async def die(transport):  # heartbeats stop, and the hand-off never happens
            worker = next(w for w in cluster.workers if w.transports["shm"] is transport)
            for task in worker.runtime._background:
                if task.get_coro().__name__ == "_heartbeat_loop":
                    task.cancel()
            await asyncio.Event().wait()

        died = fault_first_call(monkeypatch, [w.transports["shm"] for w in cluster.workers[:2]], "stage_blocks", die)
        ids, _, usage = await generate_once(nats_server.url, request(prompt, prefill_mode="remote", transport="shm"))
    assert died and ids == expected
    assert usage["failovers"] == 1 and usage["completion_tokens"] == MAX_TOKENS


async def test_min_tokens_through_remote_prefill(nats_server, folder):
    """min_tokens survives the one-token prefill and the hand-off: the stop id cannot end the stream early."""
    prompt = list(range(3, 50))
    expected = reference_outputs(folder, [prompt], MAX_TOKENS)[0]
    async with InProcessCluster(nats_server.url, folder, transports="shm"):
        nc = await connect(nats_server.url)
        try:
            stop = [expected[1]]
            short, _, _ = await generate(nc, request(prompt, prefill_mode="remote", stop_token_ids=stop))
            ids, _, _ = await generate(nc, request(prompt, prefill_mode="remote", stop_token_ids=stop, min_tokens=3))
        finally:
            await nc.close()
    assert short == expected[:2]  # the stop id ends it (and is returned, like the engine does)
    assert ids[0] == expected[0] and len(ids) >= 3 and stop[0] not in ids[:3]


async def test_slow_engine_steps_do_not_fail_dispatch(nats_server, folder, monkeypatch):
    """A worker accepts work at once even while a long engine step runs (found by the trace replay: 7 s
    CPU steps made every dispatch time out as `unavailable`)."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1,
                                router_kw={"dispatch_timeout_s": 0.3}) as cluster:
        engine = cluster.workers[0].engine
        real_step = engine.step

        def slow_step():
            time.sleep(0.6)  # longer than the router's dispatch timeout
            return real_step()

        monkeypatch.setattr(engine, "step", slow_step)
        nc = await connect(nats_server.url)
        try:
            first = asyncio.create_task(generate(nc, request([5, 6, 7], max_tokens=4, prefill_mode="local")))
            await asyncio.sleep(0.2)  # the engine is now inside a slow step
            second = await generate(nc, request([8, 6, 7], max_tokens=2, prefill_mode="local"))
            assert len((await first)[0]) == 4 and len(second[0]) == 2
        finally:
            await nc.close()


async def test_text_is_the_same_whether_prefill_is_remote_or_local(nats_server, folder):
    """A first token that is half a UTF-8 character: the prefill worker must not flush it as U+FFFD (the decode
    worker completes it), so both paths stream exactly the text of decoding all tokens at once."""
    async with InProcessCluster(nats_server.url, folder) as cluster:
        outs = {}
        for mode in ("remote", "local"):
            outs[mode] = await generate_once(nats_server.url, protocol.GenerateRequest(
                prompt_token_ids=[5, 9, 200, 31], max_tokens=24, temperature=0.0, ignore_eos=True, prefill_mode=mode))
        tokenizer = cluster.router.tokenizer
    (ids, text, _), (local_ids, local_text, _) = outs["remote"], outs["local"]
    assert ids == local_ids and text == local_text == tokenizer.decode(ids)


async def test_aggregated_worker_alone_serves_long_prompts_in_auto_mode(nats_server, folder, prompts_and_reference):
    """``deepinfer up --prefill 0``: no prefill worker at all; prompts over the local-prefill threshold still
    prefill on the decode worker (auto mode), with the reference tokens."""
    prompts, expected = prompts_and_reference
    long_ones = [i for i, p in enumerate(prompts) if len(p) > 40][:3]
    async with InProcessCluster(nats_server.url, folder, prefill=0, local_prefill_threshold=8):
        for i in long_ones:
            ids, _, usage = await generate_once(nats_server.url, request(prompts[i]))
            assert ids == expected[i]
