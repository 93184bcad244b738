"""The requests real applications send, over a real cluster (nats-server, router with HTTP, a prefill and a decode
worker, prefill forced remote so every answer crosses the KV hand-off), read with the official ``openai`` client:
logprobs (chat and completions, streamed and whole, ``echo`` with prompt logprobs, ``max_tokens: 0`` scoring) and
sampling controls (penalties, ``bad_words``) equal the single-process engine's; bad values are 4xx and the
server keeps serving."""
import io
import json

import aiohttp
import openai
import pytest

from shared import protocol
from shared.client import generate_choices
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, all_blocks_free, generate_once, wait_until
from tests.model_factory import write_tiny_hf_folder

REMOTE = {"ignore_eos": True, "prefill_mode": "remote"}
PROMPT = "the quick brown fox jumps over the lazy dog and"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=11, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def engine(folder):
    return LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=8, num_kv_blocks=256,
                                                         enable_prefix_caching=False))


def run(engine, prompt_ids, params):
    """The single-process reference: ``(tokens, logprobs, prompt logprobs, text)``."""
    rid = engine.add_request(prompt_ids, params)
    tokens, lps, prompt_lps, text = [], [], None, ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            text += out.new_text
            lps += out.logprobs.token_logprobs if out.logprobs else []
            prompt_lps = prompt_lps or out.prompt_logprobs
    return tokens, lps, prompt_lps, text


def client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http.port}/v1", api_key="none",
                              max_retries=0, timeout=60)


async def test_logprobs_through_the_hand_off_equal_the_engines(nats_server, folder, engine):
    prompt_ids = engine.tokenizer.encode(PROMPT)
    tokens, lps, prompt_lps, text = run(engine, prompt_ids, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3))
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        api = client(cluster)
        done = await api.completions.create(model="default", prompt=PROMPT, max_tokens=8, temperature=0,
                                            logprobs=3, echo=True, extra_body=REMOTE)
        choice = done.choices[0]
        assert choice.text == PROMPT + text
        got = choice.logprobs
        want = [None, *prompt_lps.token_logprobs, *lps]
        assert len(got.token_logprobs) == len(prompt_ids) + 8 == len(got.tokens) == len(got.text_offset)
        assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
        assert got.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-6)
        for token, logprob, top in zip(got.tokens[1:], got.token_logprobs[1:], got.top_logprobs[1:]):
            assert top[token] == logprob and len(top) <= 4             # the top 3 and the chosen token (tokens
            assert max(top.values()) >= logprob                        # decoding alike, say to U+FFFD, share a key)
        assert got.text_offset == sorted(got.text_offset) and got.text_offset[0] == 0
        if "\ufffd" not in choice.text:                                 # the tokens' texts tile the text
            assert "".join(got.tokens) == choice.text

        streamed, offsets, pieces = [], [], []
        async for event in await api.completions.create(model="default", prompt=PROMPT, max_tokens=8,
                                                        temperature=0, logprobs=3, echo=True, stream=True,
                                                        extra_body=REMOTE):
            for c in event.choices:
                pieces.append(c.text)
                if c.logprobs is not None:
                    streamed += c.logprobs.token_logprobs
                    offsets += c.logprobs.text_offset
        assert "".join(pieces) == choice.text and streamed == got.token_logprobs and offsets == got.text_offset

        messages = [{"role": "user", "content": PROMPT}]
        chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
        chat_tokens, chat_lps, _, chat_text = run(engine, chat_ids, SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, logprobs=2))
        chat = await api.chat.completions.create(model="default", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, extra_body=REMOTE)
        content = chat.choices[0].logprobs.content
        assert chat.choices[0].message.content == chat_text
        assert [c.logprob for c in content] == pytest.approx(chat_lps, abs=1e-6)
        assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob for c in content)
        assert all(bytes(c.bytes).decode() == c.token and len(c.top_logprobs[0].bytes) > 0 for c in content)
        deltas = []
        async for event in await api.chat.completions.create(model="default", messages=messages, max_tokens=6,
                                                             temperature=0, logprobs=True, top_logprobs=2,
                                                             stream=True, extra_body=REMOTE):
            for c in event.choices:
                deltas += [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
        assert deltas == [c.logprob for c in content]
        await api.close()
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_vllm_prompt_logprobs_on_chat_and_completions(nats_server, folder, engine):
    """vLLM's ``prompt_logprobs``: a list per prompt token (``None`` first), each entry keyed by token id with
    ``logprob``, ``rank`` and ``decoded_token`` for the prompt token and the top alternatives; on completion
    choices and, for chat, on the response; values equal the engine's, ranks consistent with them."""
    prompt_ids = engine.tokenizer.encode(PROMPT)
    _, _, prompt_lps, _ = run(engine, prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        api = client(cluster)
        done = await api.completions.create(model="default", prompt=[prompt_ids], max_tokens=2, temperature=0,
                                            extra_body={"prompt_logprobs": 2, **REMOTE})
        listed = done.choices[0].model_extra["prompt_logprobs"]
        assert done.choices[0].logprobs is None and len(listed) == len(prompt_ids) and listed[0] is None
        for token, entry, want in zip(prompt_ids[1:], listed[1:], prompt_lps.token_logprobs):
            mine = entry[str(token)]
            assert mine["logprob"] == pytest.approx(want, abs=1e-6) and mine["decoded_token"] == \
                engine.tokenizer.decode([token], skip_special_tokens=False)
            ranked = sorted(entry.values(), key=lambda e: e["rank"])
            assert [e["rank"] for e in ranked if e is not mine][:2] == [1, 2] or mine["rank"] <= 2
            assert all(e["logprob"] <= ranked[0]["logprob"] for e in ranked) and mine["rank"] >= 1
            assert (mine["rank"] == 1) == (mine["logprob"] >= max(e["logprob"] for e in ranked) - 1e-9)
        chat = await api.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, temperature=0,
                                                 extra_body={"prompt_logprobs": 1, **REMOTE})
        listed = chat.model_extra["prompt_logprobs"]
        assert listed[0] is None and len(listed) == chat.usage.prompt_tokens and chat.choices[0].logprobs is None
        assert all(1 <= len(e) <= 2 and all(v["rank"] >= 1 for v in e.values()) for e in listed[1:])
        await api.close()


async def test_echo_with_max_tokens_zero_scores_the_prompt_alone(nats_server, folder, engine):
    """What lm-eval's loglikelihood requests are: token ids in, the prompt's logprobs out, nothing generated."""
    prompt_ids = engine.tokenizer.encode(PROMPT)
    _, _, prompt_lps, _ = run(engine, prompt_ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        api = client(cluster)
        done = await api.completions.create(model="default", prompt=[prompt_ids], max_tokens=0, temperature=0,
                                            logprobs=1, echo=True, extra_body=REMOTE)
        got = done.choices[0].logprobs
        assert len(got.token_logprobs) == len(prompt_ids) and done.usage.completion_tokens == 0
        assert got.token_logprobs[1:] == pytest.approx(prompt_lps.token_logprobs, abs=1e-6)
        assert done.choices[0].text == engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        await api.close()


async def test_penalties_and_bad_words_through_the_hand_off_equal_the_engines(nats_server, folder, engine):
    prompt_ids = engine.tokenizer.encode(PROMPT)
    plain, _, _, plain_text = run(engine, prompt_ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    word = engine.tokenizer.decode(plain[3:4])
    controls = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
                "logit_bias": {str(plain[0]): -5.0}, "bad_words": [word.strip() or word]}
    _, _, _, want = run(engine, prompt_ids, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                           **controls))
    assert want != plain_text                                      # the controls change this output
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        api = client(cluster)
        extra = {**REMOTE, **{k: v for k, v in controls.items() if k not in ("presence_penalty", "frequency_penalty",
                                                                           "logit_bias")}}
        done = await api.completions.create(model="default", prompt=PROMPT, max_tokens=16, temperature=0,
                                            presence_penalty=1.5, frequency_penalty=0.5,
                                            logit_bias=controls["logit_bias"], extra_body=extra)
        assert done.choices[0].text == want
        await api.close()


BAD = [
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400),
    ({"prompt": "x", "logprobs": 21}, 400),
    ({"prompt": "x", "bad_words": [""]}, 400),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(10**6)}}, 413),   # 13 MB: over the body limit
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, 400),    # over MAX_LOGIT_BIAS
    ({"prompt": "x", "logit_bias": {"99999999": 1}}, 400),                     # not in the vocabulary
]


async def test_bad_values_are_4xx_and_the_server_keeps_serving(nats_server, folder):
    encoded = [json.dumps(body).encode() for body, _ in BAD]   # before the cluster: 13 MB of JSON takes a while
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        url = f"http://127.0.0.1:{cluster.router.http.port}"
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
                assert resp.status == 200                   # serving (the vocabulary check is the worker's)
            for (body, status), data in zip(BAD, encoded):
                path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                async with session.post(url + path, data=io.BytesIO(data)) as resp:
                    assert resp.status == status, (str(body)[:80], await resp.text())
                    assert (await resp.json())["error"]["message"]
            async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
                assert resp.status == 200
        assert not any(w.engine.requests for w in cluster.workers)


async def test_n_choices_are_seeded_streams_that_share_the_prompts_prefill(nats_server, folder, engine):
    prompt_ids = engine.tokenizer.encode(PROMPT * 3)          # 5+ blocks: a prefix worth sharing
    ref = [run(engine, prompt_ids, SamplingParams(max_tokens=8, temperature=0.8, seed=5 + i, ignore_eos=True))
           for i in range(3)]
    want = [r[3] for r in ref]
    assert len(set(want)) > 1
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        nc = await connect(nats_server.url)
        got = await generate_choices(nc, protocol.GenerateRequest(
            prompt=PROMPT * 3, n=3, max_tokens=8, temperature=0.8, seed=5, ignore_eos=True))
        await nc.close()
        assert [ids for ids, _, _ in got] == [r[0] for r in ref]
        assert [text for _, text, _ in got] == want
        assert all(usage["completion_tokens"] == 8 for _, _, usage in got)
        assert all(usage["cached_tokens"] >= 4 * 8 for _, _, usage in got[1:]), [(u["cached_tokens"], "prefill_ms" in u) for _, _, u in got]   # the prompt prefilled once
        api = client(cluster)
        done = await api.completions.create(model="default", prompt=PROMPT * 3, n=3, max_tokens=8,
                                            temperature=0.8, seed=5, extra_body={"ignore_eos": True})
        assert [c.index for c in done.choices] == [0, 1, 2] and [c.text for c in done.choices] == want
        assert done.usage.completion_tokens == 24 and done.usage.prompt_tokens == len(prompt_ids)
        texts, usage = ["", "", ""], None
        async for event in await api.completions.create(model="default", prompt=PROMPT * 3, n=3, max_tokens=8,
                                                        temperature=0.8, seed=5, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}):
            for c in event.choices:
                texts[c.index] += c.text
            usage = event.usage or usage
        assert texts == want and usage.completion_tokens == 24
        chat = await api.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPT}],
                                                 n=2, max_tokens=5, temperature=0)
        assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
        await api.close()
        assert await wait_until(lambda: all_blocks_free(cluster))


async def test_a_seeded_sampled_stream_through_the_hand_off_equals_the_engine(nats_server, folder, engine):
    """The prefill worker hands its sampler state on with the KV: the decode worker's first draw is the second."""
    prompt_ids = engine.tokenizer.encode(PROMPT)
    want = run(engine, prompt_ids, SamplingParams(max_tokens=8, temperature=0.8, seed=6, ignore_eos=True))[0]
    async with InProcessCluster(nats_server.url, folder):
        for mode in ("remote", "local"):
            ids, _, _ = await generate_once(nats_server.url, protocol.GenerateRequest(
                prompt_token_ids=prompt_ids, max_tokens=8, temperature=0.8, seed=6, ignore_eos=True,
                prefill_mode=mode))
            assert ids == want, mode


async def test_endpoints_and_conventions(nats_server, folder, engine):
    """/tokenize, /detokenize, /version, /v1/models; X-Request-Id honoured and echoed; CORS; continuous usage."""
    origin = "https://app.example"
    async with InProcessCluster(nats_server.url, folder,
                                router_kw={"http_port": 0, "allowed_origins": origin}) as cluster:
        url = f"http://127.0.0.1:{cluster.router.http.port}"
        messages = [{"role": "user", "content": PROMPT}]
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}) as resp:
                assert resp.status == 200 and len(resp.headers["X-Request-Id"]) >= 16     # made when not sent
            async with s.post(url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}) as resp:
                got = await resp.json()
            assert got["tokens"] == engine.tokenizer.encode(PROMPT) and got["count"] == len(got["tokens"])
            assert "".join(got["token_strs"]) == PROMPT and got["max_model_len"] == 1024
            async with s.post(url + "/tokenize", json={"messages": messages}) as resp:
                chat_ids = (await resp.json())["tokens"]
            assert chat_ids == engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
            async with s.post(url + "/detokenize", json={"tokens": got["tokens"]}) as resp:
                assert (await resp.json())["prompt"] == PROMPT
            for path, body in (("/detokenize", {"tokens": [10**9]}), ("/tokenize", {"prompt": 5})):
                async with s.post(url + path, json=body) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["message"]
            async with s.get(url + "/version") as resp:
                assert (await resp.json())["version"]
            async with s.get(url + "/v1/models") as resp:
                [model] = (await resp.json())["data"]
            assert model["owned_by"] == "deepinfer" and model["created"] > 1.7e9 and model["max_model_len"] == 1024

            async with s.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                                             "ignore_eos": True, "return_token_ids": True}) as resp:
                done = await resp.json()
            assert done["model"] == model["id"]                          # named though the request left it out
            assert done["prompt_token_ids"] == got["tokens"] and len(done["choices"][0]["token_ids"]) == 5
            assert engine.tokenizer.decode(done["choices"][0]["token_ids"]) == done["choices"][0]["text"]
            headers = {"X-Request-Id": "trace-42", "Origin": origin}
            async with s.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=headers) as resp:
                assert resp.headers["X-Request-Id"] == "trace-42" and (await resp.json())["id"] == "cmpl-trace-42"
                assert resp.headers["Access-Control-Allow-Origin"] == origin
            async with s.post(url + "/v1/completions", json={"prompt": "x", "n": 99}, headers=headers) as resp:
                assert resp.status == 400 and resp.headers["X-Request-Id"] == "trace-42"   # errors too
            async with s.post(url + "/v1/completions", headers={"Origin": "https://evil.example"},
                              json={"prompt": "x", "max_tokens": 1}) as resp:
                assert "Access-Control-Allow-Origin" not in resp.headers
            preflight = {"Origin": origin, "Access-Control-Request-Method": "POST"}
            async with s.options(url + "/v1/chat/completions", headers=preflight) as resp:
                assert resp.status == 204 and "POST" in resp.headers["Access-Control-Allow-Methods"]
                assert resp.headers["Access-Control-Allow-Origin"] == origin

            body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            async with s.post(url + "/v1/completions", json=body, headers={"X-Request-Id": "s-1"}) as resp:
                assert resp.headers["X-Request-Id"] == "s-1"
                events = [json.loads(line[6:]) for line in (await resp.text()).splitlines()
                          if line.startswith("data: {")]
            counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
            assert counts == sorted(counts) and counts[-1] == 6 and len(counts) > 1
            assert all(e["usage"]["prompt_tokens"] == len(got["tokens"]) for e in events)
            assert all(e["id"] == "cmpl-s-1" for e in events)
