"""A decode worker checks a hand-off against its own engine before any allocation or fetch: a bad one is
answered with an error code and never reaches the batch (which used to fail and reset the prefix cache)."""
import asyncio

import pytest

from shared import protocol, subjects
from shared.errors import ErrorCode
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs
from tests.model_factory import write_tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=1024)


def handoff(engine, prompt, **overrides) -> protocol.KVHandoff:
    num_blocks = -(-len(prompt) // engine.config.block_size)
    block_shape = list(engine.kv_port.kv_cache.shape[1:])
    dtype = str(engine.kv_port.kv_cache.dtype).removeprefix("torch.")
    nbytes = num_blocks * engine.kv_port.kv_cache[0].numel() * engine.kv_port.kv_cache.element_size()
    handle = {"transport": "shm", "segment": "deepinfer-no-such-segment", "token": 1, "offset": 4096,
              "nbytes": nbytes, "dtype": dtype, "shape": [num_blocks, *block_shape]}
    fields = dict(request_id="bad-handoff", prompt_token_ids=prompt, first_token=5,
                  sampling={"max_tokens": 4, "temperature": 0.0}, reply_to="_INBOX.nobody", cache_salt="",
                  num_blocks=num_blocks, block_shape=block_shape, dtype=dtype, transport="shm", handle=handle,
                  model_fingerprint=engine.fingerprint)
    fields.update(overrides)
    if "handle" in overrides:
        fields["handle"] = {**handle, **overrides["handle"]}
    return protocol.KVHandoff(**fields)


async def test_bad_handoffs_are_refused_before_fetch_and_the_batch_goes_on(nats_server, folder, monkeypatch):
    prompt = list(range(3, 30))
    expected = reference_outputs(folder, [prompt], 200)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1, transports="shm") as cluster:
        decode = cluster.workers[0]
        eng = decode.engine
        fetches = []
        real_fetch = decode.transports["shm"].fetch

        async def counting_fetch(*args, **kwargs):
            fetches.append(args)
            return await real_fetch(*args, **kwargs)

        monkeypatch.setattr(decode.transports["shm"], "fetch", counting_fetch)
        running = asyncio.create_task(generate_once(nats_server.url, protocol.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=200, temperature=0.0, ignore_eos=True, prefill_mode="local")))
        await asyncio.sleep(0.3)
        vocab = eng.model.config.vocab_size
        bad_shape = list(eng.kv_port.kv_cache.shape[1:])
        bad_shape[-1] *= 2
        two_blocks = handoff(eng, prompt[:9]).handle  # a self-consistent handle of 2 blocks
        cases = {
            "first token out of vocabulary": (handoff(eng, prompt, first_token=vocab), ErrorCode.INVALID_REQUEST),
            "block shape of another model": (handoff(eng, prompt, block_shape=bad_shape, handle={
                "shape": [4, *bad_shape], "nbytes": 2 * handoff(eng, prompt).handle["nbytes"]}),
                ErrorCode.TRANSFER_FAILED),
            "header disagrees with handle": (handoff(eng, prompt, num_blocks=3), ErrorCode.TRANSFER_FAILED),
            "too few blocks for the prompt": (handoff(eng, prompt, num_blocks=2, handle={
                "shape": two_blocks["shape"], "nbytes": two_blocks["nbytes"]}), ErrorCode.TRANSFER_FAILED),
            "inconsistent handle bytes": (handoff(eng, prompt, handle={"nbytes": 7}), ErrorCode.TRANSFER_FAILED),
            "KV of another model build": (handoff(eng, prompt, model_fingerprint="0" * 32), ErrorCode.MODEL_MISMATCH),
            "KV naming no model build": (handoff(eng, prompt, model_fingerprint=""), ErrorCode.MODEL_MISMATCH),
        }
        nc = await connect(nats_server.url)
        try:
            for name, (msg, code) in cases.items():
                reply = await nc.request(subjects.decode("decode-0"), protocol.encode(msg), timeout=5)
                answer = protocol.decode(reply.data, (protocol.Ack, protocol.ErrorReply))
                assert isinstance(answer, protocol.ErrorReply) and answer.code == code.value, (name, answer)
        finally:
            await nc.close()
        assert fetches == [], "nothing may be fetched for a refused hand-off"
        ids, _, usage = await running
    assert ids == expected  # the batch it would have joined was not disturbed
