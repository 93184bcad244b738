"""The served path under a burst, as a plain OpenAI streaming client sends it (issue 23): the 64 bench prompts
at once to one aggregated worker (real processes, the default model), no ``timeout_s``: every request completes
with all its tokens, exactly the in-process engine's greedy output. Before requests had no deadline of their
own, the router's 60 s default cut such a burst short on a 2-core machine (504s, and streams ended early after
200 was sent)."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from benchmarks.engine_throughput import load_prompt_set
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from cli.launcher import Cluster, ClusterSpec

pytestmark = pytest.mark.timeout(900)
MAX_TOKENS = 64


async def stream_text(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int]) -> str:
    """The streamed completion's text when all ``MAX_TOKENS`` tokens arrived, else what went wrong."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"HTTP {resp.status}"
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error {event['error']}"
            text += [c.get("text") or "" for c in event.get("choices", [])]
            usage = event.get("usage") or usage
    if not usage or usage["completion_tokens"] != MAX_TOKENS:
        return f"stream ended early: {usage}"
    return "".join(text)


async def test_a_burst_of_64_without_timeout_completes_exactly():
    prompts = load_prompt_set("distinct", 64)
    cluster = Cluster(ClusterSpec(prefill=0, decode=1, cache_tier=0, metrics=False, kv_cache_mb=256))
    try:
        await cluster.start()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
            async with session.get(cluster.http_url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
            got = await asyncio.gather(*(stream_text(session, cluster.http_url, model, p) for p in prompts))
    finally:
        await asyncio.to_thread(cluster.stop)
    engine = LLMEngine.from_path(None, EngineConfig(dtype="float32", device="cpu"))
    outs = engine.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * 64)
    expected = [engine.tokenizer.decode(ids) for ids in outs]
    bad = [(i, g if isinstance(g, str) and g.startswith(("HTTP", "error", "stream")) else "text differs")
           for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not bad, bad
    assert model == "SmolLM2-135M-Instruct"   # the served id derived from the model file, as vLLM users expect
