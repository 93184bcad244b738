"""The router's OpenAI-compatible HTTP API over a real cluster (real nats-server, in-process services), driven
by the official ``openai`` client and by raw aiohttp for the error cases: same tokens as the NATS API,
SSE streaming, usage, models, health, status codes, API keys and tenant cache isolation, disconnect = cancel."""
import asyncio
import json

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.router.service import RouterService
from shared import protocol
from shared.client import generate
from shared.errors import DeepinferError
from services.router.config import RouterConfig
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, all_blocks_free, generate_once, wait_until
from tests.model_factory import write_tiny_hf_folder

KEYS = "key-acme-0001=acme,key-beta-0002=beta"
GREEDY = {"ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=1024)


def base_url(cluster) -> str:
    return f"http://127.0.0.1:{cluster.router.http.port}"


def client(cluster, key: str = "key-acme-0001") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(cluster) + "/v1", api_key=key, max_retries=0, timeout=60)


async def post(cluster, path: str, body, key: str | None = "key-acme-0001", raw: bytes | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        async with session.post(base_url(cluster) + path, data=data, headers=headers) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def test_openai_client_matches_the_nats_api(nats_server, folder):
    prompt = "the quick brown fox jumps over"
    messages = [{"role": "user", "content": "hello there, how are you"}]
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "api_keys": KEYS}) as cluster:
        api = client(cluster)
        models = await api.models.list()
        model = models.data[0].id
        assert [m.id for m in models.data] == [model] and model
        ids, nats_text, _ = await generate_once(nats_server.url, protocol.GenerateRequest(
            prompt=prompt, max_tokens=12, temperature=0.0, ignore_eos=True))
        # both on the prefill worker: the router may prefill one of them locally on an idle decode worker, and
        # the other then finds its tenant's blocks on the worker it did not go to (a placement race, not usage)
        remote = {**GREEDY, "prefill_mode": "remote"}
        done = await api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body=remote)
        assert done.choices[0].text == nats_text and done.choices[0].finish_reason == "length"
        assert done.usage.completion_tokens == 12 == len(ids) and done.usage.prompt_tokens > 0
        assert done.usage.model_extra["retention"] == "agent"   # a raw prompt's default class, told in usage
        pieces, usage = [], None
        async for event in await api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        extra_body=remote):
            pieces += [c.text for c in event.choices]
            usage = event.usage or usage
        assert "".join(pieces) == nats_text and usage.completion_tokens == 12
        assert usage.prompt_tokens_details.cached_tokens > 0  # the same tenant's prompt ran before
        _, chat_text, _ = await generate_once(nats_server.url, protocol.GenerateRequest(
            messages=messages, max_tokens=10, temperature=0.0, ignore_eos=True))
        chat = await api.chat.completions.create(model=model, messages=messages, max_completion_tokens=10,
                                                 temperature=0, extra_body=GREEDY)
        assert chat.choices[0].message.content == chat_text and chat.choices[0].message.role == "assistant"
        assert chat.usage.model_extra["retention"] == "chat"
        deltas = []
        async for event in await api.chat.completions.create(model=model, messages=messages, max_tokens=10,
                                                             temperature=0, stream=True, extra_body=GREEDY):
            deltas += [c.delta.content or "" for c in event.choices]
        assert "".join(deltas) == chat_text
        with pytest.raises(openai.NotFoundError):
            await api.completions.create(model="no-such-model", prompt=prompt, max_tokens=2)
        stranger = client(cluster, key="wrong-key-123")
        with pytest.raises(openai.AuthenticationError):
            await stranger.completions.create(model=model, prompt=prompt, max_tokens=2)
        await stranger.close()
        await api.close()


async def test_bad_input_gets_openai_errors_with_status(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "api_keys": KEYS}) as cluster:
        cases = [
            ("/v1/completions", None, b"{not json", 400),
            ("/v1/completions", {"prompt": "x", "n": 17}, None, 400),
            ("/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400),
            ("/v1/completions", {"prompt": ["a", "b"]}, None, 400),
            ("/v1/completions", {"prompt": "x", "logprobs": 21}, None, 400),
            ("/v1/completions", {"prompt": "x", "cache_salt": "t/beta"}, None, 400),
            ("/v1/chat/completions", {"messages": []}, None, 400),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None, 400),
            ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400),
            ("/v1/completions", {"prompt": "x", "stop": 5}, None, 400),
            ("/v1/completions", {"prompt": "x", "model": "other"}, None, 404),
        ]
        for path, body, raw, status in cases:
            got, _, data = await post(cluster, path, body, raw=raw)
            assert got == status, (body, raw, got, data)
            error = json.loads(data)["error"]
            assert error["message"] and error["type"] and error["code"], error
        got, _, data = await post(cluster, "/v1/completions", {"prompt": "x"}, key=None)
        assert got == 401 and json.loads(data)["error"]["type"] == "authentication_error"
        got, _, data = await post(cluster, "/v1/completions", {"prompt": "x", "max_tokens": 50, "timeout_s": 0.001,
                                                                "ignore_eos": True})
        assert got == 504, data
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url(cluster) + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["workers"]["decode"] == 1
            async with session.get(base_url(cluster) + "/metrics") as resp:
                assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
                samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                           for family in text_string_to_metric_families(await resp.text()) for s in family.samples}
        assert samples[("deepinfer_router_requests_total", (("api", "http"), ("outcome", "timeout")))] == 1
        assert samples[("deepinfer_router_rejected_total", (("reason", "unauthorized"),))] == 1
        assert samples[("deepinfer_router_workers", (("role", "decode"), ("state", "alive")))] == 1
        assert samples[("deepinfer_router_inflight", ())] == 0


async def test_overloaded_is_429_with_retry_after(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "max_inflight": 1}) as cluster:
        api = openai.AsyncOpenAI(base_url=base_url(cluster) + "/v1", api_key="none", max_retries=0)
        stream = await api.completions.create(model="", prompt="hold the only slot", max_tokens=300, stream=True,
                                              temperature=0, extra_body=GREEDY)
        await stream.__anext__()  # the first request is streaming: it holds the router's one slot
        got, headers, data = await post(cluster, "/v1/completions", {"prompt": "x"}, key=None)
        assert got == 429 and headers.get("Retry-After") and json.loads(data)["error"]["code"] == "overloaded"
        await stream.close()
        await api.close()


async def test_client_disconnect_cancels_on_the_workers(nats_server, folder):
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(base_url(cluster) + "/v1/completions", json={
                "prompt": "a long story", "max_tokens": 900, "stream": True, "ignore_eos": True, "temperature": 0})
            assert resp.status == 200
            assert (await resp.content.readline()).startswith(b"data: ")
            assert cluster.router.relays and not all_blocks_free(cluster)
            resp.close()  # the client goes away mid-stream
        assert await wait_until(lambda: not cluster.router.relays and all_blocks_free(cluster), timeout=10)


async def test_tenants_are_salted_and_isolated(nats_server, folder):
    prompt = "a shared system prompt that is long enough to fill a few kv blocks for sure"
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "api_keys": KEYS}) as cluster:
        body = {"prompt": prompt, "max_tokens": 2}
        cached = []
        for key in ("key-acme-0001", "key-acme-0001", "key-beta-0002"):
            status, _, data = await post(cluster, "/v1/completions", body, key=key)
            assert status == 200, data
            cached.append(json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[1] > 0 and cached[2] == 0  # acme hits its own cache; beta never sees acme's
        nc = await connect(nats_server.url)  # the NATS API: a tenant's own subject salts like its API key
        try:
            _, _, usage = await generate(nc, protocol.GenerateRequest(prompt=prompt, max_tokens=2), tenant="acme")
            assert usage["cached_tokens"] > 0
            _, _, usage = await generate(nc, protocol.GenerateRequest(prompt=prompt, max_tokens=2))
            assert usage["cached_tokens"] == 0  # the plain API has no tenant: acme's cache is out of reach
            with pytest.raises(DeepinferError, match="reserved"):
                await generate(nc, protocol.GenerateRequest(prompt=prompt, max_tokens=2, cache_salt="t/acme"))
        finally:
            await nc.close()
        by_tenant = cluster.router.ledger.as_dict()["by_tenant"]
        assert by_tenant["acme"]["agent"]["requests"] == 3 and by_tenant["beta"]["agent"]["requests"] == 1


async def test_no_workers_is_503(nats_server):
    router = RouterService(RouterConfig(nats_url=nats_server.url, http_port=0, worker_dead_after_s=1.0))
    await router.start()
    try:
        url = f"http://127.0.0.1:{router.http.port}"
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                assert resp.status == 503
            async with session.post(url + "/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 503 and resp.headers.get("Retry-After")
                assert (await resp.json())["error"]["code"] == "unavailable"
    finally:
        await router.shutdown()


async def test_up_demo_streams_through_the_http_api(nats_server, folder, capsys):
    from cli.up import http_demo

    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "api_keys": KEYS}) as cluster:
        usage = await http_demo(base_url(cluster), "key-acme-0001")
        with pytest.raises(DeepinferError, match="401"):
            await http_demo(base_url(cluster), "not-a-key-000")
    assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] > 0
    assert "via http://127.0.0.1:" in capsys.readouterr().err
