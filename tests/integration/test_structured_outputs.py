"""Structured outputs through the served path (real nats-server, router with HTTP, prefill and decode workers,
prefill forced remote): the official ``openai`` client's ``beta.chat.completions.parse`` with a pydantic model,
``json_object`` streamed, vLLM's ``guided_*`` fields; a stream moved mid-object by live migration and one decoded
speculatively (drafts checked against the grammar) equal the uninterrupted greedy run, and every output
validates; an invalid schema is a 400 before any placement."""
import asyncio
import json

import jsonschema
import openai
import pydantic
import pytest

from shared import protocol
from shared.client import generate
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, all_blocks_free, wait_until
from tests.integration.test_live_migration import ask_router, streaming
from tests.model_factory import write_tiny_hf_folder

REMOTE = {"prefill_mode": "remote"}
ITEMS = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9},
                                                     "minItems": 30, "maxItems": 30}},
         "required": ["values"], "additionalProperties": False}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=1024)


def client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http.port}/v1", api_key="none",
                              max_retries=0, timeout=60)


async def test_openai_clients_get_outputs_that_validate(nats_server, folder):
    messages = [{"role": "user", "content": "Who is it? Answer in JSON."}]
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        api = client(cluster)
        parsed = await api.beta.chat.completions.parse(model="default", messages=messages, response_format=Person,
                                                       max_tokens=100, temperature=0, extra_body=REMOTE)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"
        for temperature in (0.0, 1.0):
            text = ""
            async for event in await api.chat.completions.create(
                    model="default", messages=messages, max_tokens=100, temperature=temperature, seed=1,
                    stream=True, response_format={"type": "json_object"}, extra_body=REMOTE):
                text += "".join(c.delta.content or "" for c in event.choices)
            assert isinstance(json.loads(text), dict)
        done = await api.completions.create(model="default", prompt="pick:", max_tokens=10, temperature=1.0,
                                            seed=2, extra_body={"guided_choice": ["red", "green", "blue"], **REMOTE})
        assert done.choices[0].text in ("red", "green", "blue")
        done = await api.completions.create(model="default", prompt="code:", max_tokens=20, temperature=1.0,
                                            extra_body={"guided_regex": "[A-Z]{3}-[0-9]{4}", **REMOTE})
        assert len(done.choices[0].text) == 8 and done.choices[0].text[3] == "-"
        with pytest.raises(openai.BadRequestError, match="objekt"):
            await api.chat.completions.create(model="default", messages=messages, max_tokens=5, response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}})
        assert not any(w.engine.requests for w in cluster.workers)
        await api.close()
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_a_migrated_and_a_speculative_stream_equal_the_uninterrupted_object(nats_server, folder):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    req = dict(prompt_token_ids=prompt, max_tokens=120, temperature=0.0, timeout_s=120.0, prefill_mode="remote",
               structured={"type": "json_schema", "schema": ITEMS})
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, transports="stream") as cluster:
        nc = await connect(nats_server.url)
        try:
            twin, text, _ = await generate(nc, protocol.GenerateRequest(request_id="twin", **req))
            task = await streaming(nc, protocol.GenerateRequest(request_id="moved", **req), 12)
            await ask_router(nc, cluster, "moved")
            chunks = await task
        finally:
            await nc.close()
    jsonschema.validate(json.loads(text), ITEMS)
    assert [t for c in chunks for t in c.token_ids] == twin and chunks[-1].usage["migrations"] == 1
    async with InProcessCluster(nats_server.url, folder, draft="local", drafter="prompt_lookup") as cluster:
        nc = await connect(nats_server.url)
        try:
            ids, _, usage = await generate(nc, protocol.GenerateRequest(request_id="spec", **req))
        finally:
            await nc.close()
    assert ids == twin and usage.get("spec_drafted_tokens", 0) > 0


async def test_a_sigkilled_decode_worker_mid_object_fails_over_to_the_same_valid_object(nats_server, tmp_path):
    """Real processes: the decode worker holding a long constrained stream dies by SIGKILL; the stream goes on
    elsewhere from prompt + delivered tokens, the new engine's matcher replays them, and the object equals the
    uninterrupted run's and validates."""
    from cli.launcher import Cluster, ClusterSpec
    from shared.engine.config import EngineConfig
    from shared.engine.llm_engine import LLMEngine
    from shared.sampling import SamplingParams
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=9, max_position_embeddings=4096)
    schema = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 9},
                                                          "minItems": 900, "maxItems": 900}},
              "required": ["values"], "additionalProperties": False}
    spec = {"type": "json_schema", "schema": schema}
    prompts = [[5 + i, 6, 7, 8] * 10 for i in range(4)]
    engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=2000,
                                                           enable_prefix_caching=False))
    expected = engine.generate(prompts, SamplingParams(max_tokens=2000, temperature=0.0, structured=spec))
    cluster = Cluster(ClusterSpec(prefill=1, decode=2, nats_url=nats_server.url, model=str(folder), kv_cache_mb=64,
                                  local_prefill_threshold=0, dtype="float64"))
    await cluster.start()
    try:
        nc = await connect(nats_server.url)
        tasks = [asyncio.create_task(generate(nc, protocol.GenerateRequest(
            request_id=f"obj-{i}", prompt_token_ids=p, max_tokens=2000, temperature=0.0, timeout_s=90.0,
            structured=spec))) for i, p in enumerate(prompts)]
        await asyncio.sleep(2.0)               # streams are flowing on both decode workers
        cluster.kill("decode-0")
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=100)
        await nc.close()
    finally:
        cluster.stop()
    assert any(usage["failovers"] for _, _, usage in results), "some stream was on the killed worker"
    for (ids, text, _), want in zip(results, expected):
        assert ids == want
        jsonschema.validate(json.loads(text), schema)
