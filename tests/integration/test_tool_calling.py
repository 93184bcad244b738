"""Tool calling through the served path with the official ``openai`` client (real nats-server, router with HTTP
and the shipped ChatML-with-tools template, a prefill and a decode worker): an agent round trip (asked, the
model calls a function — forced by ``tool_choice``, its arguments constrained to the function's schema —, gets
the ``tool`` result, answers), streamed tool-call deltas reassembled, ``required`` with parallel calls, and an
agent loop resending its growing history, whose turns find the previous turns in the prefix cache."""
import json
import logging
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.integration.services_harness import InProcessCluster
from tests.model_factory import write_tiny_hf_folder

logger = logging.getLogger(__name__)
TEMPLATE = Path(__file__).resolve().parents[2] / "shared/model/templates/chatml_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=2048)


def cluster_of(nats_server, folder):
    return InProcessCluster(nats_server.url, folder, router_kw={
        "http_port": 0, "chat_template": str(TEMPLATE), "tool_call_parser": "hermes"}, kv_cache_mb=16)


def client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http.port}/v1", api_key="none",
                              max_retries=0, timeout=60)


async def test_a_tool_call_round_trip_and_streamed_deltas(nats_server, folder):
    async with cluster_of(nats_server, folder) as cluster:
        api = client(cluster)
        messages = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = await api.chat.completions.create(
            model="default", messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
        answer = await api.chat.completions.create(model="default", messages=messages, tools=[WEATHER, TIME],
                                                   tool_choice="none", max_tokens=8, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
        alone = await api.chat.completions.create(model="default", messages=messages[:1], tools=[WEATHER, TIME],
                                                  tool_choice="none", max_tokens=1, temperature=0)
        assert answer.usage.prompt_tokens > alone.usage.prompt_tokens + 20   # the call and its result are in it

        calls: dict[int, dict] = {}
        finish = None
        async for event in await api.chat.completions.create(
                model="default", messages=messages[:1], tools=[WEATHER, TIME], tool_choice="required",
                max_tokens=120, temperature=0, stream=True):
            for c in event.choices:
                for delta in c.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    entry["name"] += delta.function.name or ""
                    entry["arguments"] += delta.function.arguments or ""
                finish = c.finish_reason or finish
        assert finish == "tool_calls" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for entry in calls.values():
            jsonschema.validate(json.loads(entry["arguments"]), schemas[entry["name"]])
        with pytest.raises(openai.BadRequestError, match="not among the tools"):
            await api.chat.completions.create(model="default", messages=messages[:1], tools=[WEATHER],
                                              tool_choice={"type": "function", "function": {"name": "nope"}})
        await api.close()


async def test_an_agent_loop_finds_its_previous_turns_cached(nats_server, folder):
    """N turns, each resending the whole history (calls and results), as agents do: per-turn cached/prompt."""
    async with cluster_of(nats_server, folder) as cluster:
        api = client(cluster)
        messages = [{"role": "system", "content": "You are a weather agent. " * 8},
                    {"role": "user", "content": "Plan a week in Europe."}]
        turns = []
        for turn in range(5):
            done = await api.chat.completions.create(
                model="default", messages=messages, tools=[WEATHER, TIME], max_tokens=60, temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                extra_body={"retention": "agent"})
            [call] = done.choices[0].message.tool_calls
            turns.append((done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens))
            messages += [done.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": f"day {turn}: 20 C"}]
        await api.close()
    logger.warning("agent loop, per turn (prompt_tokens, cached_tokens): %s", turns)
    assert all(cached >= prev_prompt - 16 for (_, cached), (prev_prompt, _) in zip(turns[1:], turns))


async def test_reasoning_content_is_split_from_the_answer(nats_server, folder):
    """--reasoning-parser qwen3; the output forced into a think-then-answer shape by a guided regex."""
    import aiohttp
    body = {"messages": [{"role": "user", "content": "think, then answer"}], "max_tokens": 40, "temperature": 0,
            "guided_regex": "<think>[a-z]{3,6}</think>[a-z]{2,5}"}
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0, "reasoning_parser": "qwen3"}) \
            as cluster:
        url = f"http://127.0.0.1:{cluster.router.http.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json=body) as resp:
                message = (await resp.json())["choices"][0]["message"]
            async with s.post(url, json={**body, "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                          if line.startswith("data: {")]
    assert 3 <= len(message["reasoning_content"]) <= 6 and message["reasoning_content"].isalpha()
    assert 2 <= len(message["content"]) <= 5 and "<" not in message["content"]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
