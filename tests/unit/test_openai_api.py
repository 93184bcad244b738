"""OpenAI body -> GenerateRequest, chunks -> OpenAI objects, error shapes, API keys and tenant salts."""
import json

import pytest

from services.router.api_keys import ApiKeys, parse_api_keys
from services.router.openai_api import (COMPLETIONS_DEFAULT_MAX_TOKENS, choice_body, chunk_error, error_body,
                                        full_response, merged_usage, parse_call, stream_events, usage_event)
from services.router.tenancy import tenant_salt
from services.router.openai_api import usage_block
from shared import protocol
from shared.errors import DeepinferError, ErrorCode


def test_completion_body_maps_every_parameter():
    call = parse_call({"model": "m", "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                       "stop": "END", "stream": True, "stream_options": {"include_usage": True}, "user": "u1",
                       "retention": "agent", "speculative": False, "prefill_mode": "local", "top_k": 4,
                       "ignore_eos": True, "min_tokens": 2, "stop_token_ids": [5], "priority": -3},
                      chat=False)
    r = call.request
    assert (r.prompt, r.max_tokens, r.temperature, r.top_p, r.seed, r.stop) == ("hi", 7, 0.0, 0.5, 3, ["END"])
    assert (r.retention, r.speculative, r.prefill_mode, r.top_k, r.ignore_eos, r.min_tokens) == (
        "agent", False, "local", 4, True, 2)
    assert r.stop_token_ids == [5] and r.cache_salt == "" and r.sampling().priority == -3
    tiers = parse_call({"prompt": "x", "service_tier": "flex", "slo_class": "batch"}, chat=False).request
    assert (tiers.service_tier, tiers.slo_class) == ("flex", "batch")
    assert usage_block({"prompt_tokens": 1, "slo_class": "batch"})["slo_class"] == "batch"
    assert call.stream and call.include_usage and call.user == "u1" and call.model == "m" and not call.chat
    assert parse_call({"prompt": [1, 2, 3]}, chat=False).request.prompt_token_ids == [1, 2, 3]
    assert parse_call({"prompt": ["one"]}, chat=False).request.prompt == "one"
    assert parse_call({"prompt": "x"}, chat=False).request.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS


def test_chat_body_text_parts_and_max_completion_tokens():
    call = parse_call({"messages": [{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
                       "max_completion_tokens": 9, "max_tokens": 3}, chat=True)
    assert call.request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert call.request.max_tokens == 9


def test_user_salts_the_cache_only_when_configured():
    body = {"prompt": "x", "user": "alice"}
    assert parse_call(body, chat=False).request.cache_salt == ""
    assert parse_call(body, chat=False, user_cache_salt=True).request.cache_salt == "alice"
    assert parse_call({**body, "cache_salt": "own"}, False, True).request.cache_salt == "own"


@pytest.mark.parametrize("body", [
    [], {"prompt": "x", "n": 17}, {"prompt": "x", "n": 0}, {"prompt": "x", "logprobs": True}, {"prompt": "x", "presence_penalty": 2.5},
    {"prompt": "x", "temperature": True}, {"prompt": "x", "max_tokens": "5"}, {"prompt": ["a", "b"]},
    {"prompt": []}, {"prompt": "x", "stop": ["a"] * 17}, {"prompt": "x", "top_p": 0.0},
    {"prompt": "x", "retention": 7}, {"prompt": "x", "prefill_mode": "sideways"}, {"prompt": "x", "seed": 1.5},
])
def test_bad_completion_bodies_are_invalid_requests(body):
    with pytest.raises(DeepinferError) as err:
        parse_call(body, chat=False)
    assert err.value.code == ErrorCode.INVALID_REQUEST and err.value.http_status == 400


@pytest.mark.parametrize("extra", [{"min_p": 1.5}, {"tool_choice": "required"}, {"repetition_penalty": 0},
                                   {"best_of": 2}, {"temprature": 0.5}, {"messages": [{"role": "user", "content": "x"}]},
                                   {"min_p": True}, {"repetition_penalty": "1.0"}])
def test_unknown_or_unhonoured_parameters_are_refused_not_dropped(extra):
    with pytest.raises(DeepinferError) as err:
        parse_call({"prompt": "hi", **extra}, chat=False)
    assert err.value.code is ErrorCode.INVALID_REQUEST and next(iter(extra)) in err.value.message


def test_sampling_controls_reach_the_request():
    body = {"prompt": "hi", "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3,
            "min_p": 0.05, "logit_bias": {"42": -100, "7": 2.5}, "allowed_token_ids": [1, 7, 42]}
    s = parse_call(body, chat=False).request.sampling()
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (1.5, -0.5, 1.3, 0.05)
    assert s.logit_bias == {"42": -100, "7": 2.5} and s.allowed_token_ids == [1, 7, 42] and s.processes_logits


@pytest.mark.parametrize("extra, named", [
    ({"logit_bias": {str(i): 1 for i in range(10**6)}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g' is not among the tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format"), ({"top_logprobs": 50}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "json_schema"), ({"guided_regex": "a(b"}, "regex"), ({"guided_choice": []}, "choices"),
    ({"guided_json": "{nope"}, "guided_json"), ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one"),
    ({"structured_outputs": {"grammar": "start: 'a' |"}}, "grammar")])
def test_sampling_controls_out_of_bounds_and_features_not_served_yet_are_400s(extra, named):
    with pytest.raises(DeepinferError) as err:
        parse_call({"messages": [{"role": "user", "content": "x"}], **extra}, chat=True)
    assert err.value.http_status == 400 and named in err.value.message


def test_neutral_values_that_sdks_and_frameworks_send_are_accepted():
    # Semantic Kernel sends tool_choice "none"; the openai SDK and LangChain send empty tools, text formats
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [], "tool_choice": "none",
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "logit_bias": {}, "logprobs": False,
            "top_logprobs": 0, "n": 1}
    assert not parse_call(body, chat=True).request.sampling().processes_logits


def test_neutral_values_that_benchmark_clients_always_send_are_accepted():
    # vLLM's benchmark client sends these on every completion
    body = {"model": "m", "prompt": [1, 2, 3], "temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "repetition_penalty": 1.0, "logprobs": None,
            "best_of": 1, "min_p": 0.0, "presence_penalty": 0, "frequency_penalty": 0.0, "top_logprobs": None}
    call = parse_call(body, chat=False)
    assert call.request.prompt_token_ids == [1, 2, 3] and call.request.max_tokens == 8 and call.stream
    chat = parse_call({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 4,
                       "repetition_penalty": None}, chat=True)
    assert chat.request.max_tokens == 4
    with pytest.raises(DeepinferError):
        parse_call({"messages": [{"role": "user", "content": "x"}], "prompt": "also"}, chat=True)


@pytest.mark.parametrize("messages", [None, [], ["hi"], [{"content": "x"}], [{"role": "user", "content": 3}],
                                      [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]])
def test_bad_chat_messages_are_invalid_requests(messages):
    with pytest.raises(DeepinferError):
        parse_call({"messages": messages}, chat=True)


def test_responses_and_stream_events_have_openai_shapes():
    chat = parse_call({"messages": [{"role": "user", "content": "q"}], "model": "m",
                       "stream_options": {"include_usage": True}}, chat=True)
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "cached_tokens": 4}
    full = full_response(chat, "id1", [choice_body(chat, 0, "hi", "stop", None)], usage)
    assert full["object"] == "chat.completion" and full["choices"][0]["message"] == {"role": "assistant",
                                                                                     "content": "hi"}
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 4}}
    first = protocol.TokenChunk(request_id="r", seq=0, token_ids=[1], text="h")
    last = protocol.TokenChunk(request_id="r", seq=1, token_ids=[2], text="i", final=True, finish_reason="stop",
                               usage=usage, index=1)
    [e0] = stream_events(chat, "id1", 1, first, first=True)
    assert e0["object"] == "chat.completion.chunk" and e0["choices"][0]["delta"] == {"role": "assistant",
                                                                                     "content": "h"}
    [e1] = stream_events(chat, "id1", 1, last, first=False)
    assert e1["choices"][0]["finish_reason"] == "stop" and e1["choices"][0]["index"] == 1
    e_usage = usage_event(chat, "id1", 1, merged_usage([usage, usage]))
    assert e_usage["choices"] == [] and e_usage["usage"]["total_tokens"] == 9   # the prompt once, 2 + 2 tokens
    plain = parse_call({"prompt": "q", "n": 2}, chat=False)
    assert plain.request.n == 2
    [t] = stream_events(plain, "id2", 1, last, first=False)
    assert t["object"] == "text_completion" and t["choices"][0]["text"] == "i"


def test_errors_map_to_status_and_openai_shape():
    status, body = error_body(DeepinferError(ErrorCode.OVERLOADED, "busy"))
    assert status == 429 and body["error"] == {"message": "busy", "type": "rate_limit_error", "param": None,
                                               "code": "overloaded"}
    assert error_body(DeepinferError(ErrorCode.UNAVAILABLE, "x"))[0] == 503
    assert error_body(DeepinferError(ErrorCode.TIMEOUT, "x"))[0] == 504
    assert error_body(DeepinferError(ErrorCode.MODEL_NOT_FOUND, "x"))[0] == 404
    chunk = protocol.TokenChunk.from_error("r", 0, DeepinferError(ErrorCode.TIMEOUT, "late"))
    assert chunk_error(chunk).code == ErrorCode.TIMEOUT
    assert chunk_error(protocol.TokenChunk(request_id="r", seq=0, token_ids=[], final=True)) is None


def test_api_keys_spec_file_and_lookup(tmp_path):
    assert parse_api_keys("") == {}
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nsecret-key-1 = acme\n\nsecret-key-2=beta\n")
    assert parse_api_keys(f"@{keys_file}") == {"secret-key-1": "acme", "secret-key-2": "beta"}
    for bad in ("short=acme", "secret-key-1", "secret-key-1=a.b", "secret-key-1=x,secret-key-1=y"):
        with pytest.raises(ValueError):
            parse_api_keys(bad)
    keys = ApiKeys("secret-key-1=acme,secret-key-2=beta")
    assert keys.required and keys.tenant_of("Bearer secret-key-2") == "beta"
    assert keys.tenant_of("bearer secret-key-1") == "acme"
    assert keys.tenant_of("Bearer secret-key-3") is None and keys.tenant_of(None) is None
    assert keys.tenant_of("Basic secret-key-1") is None and not ApiKeys("").required


def test_tenant_salt_namespace():
    req = protocol.GenerateRequest(prompt="x")
    assert tenant_salt(req, None) == "" and tenant_salt(req, "acme") == "t/acme"
    own = protocol.GenerateRequest(prompt="x", cache_salt="proj")
    assert tenant_salt(own, None) == "proj" and tenant_salt(own, "acme") == "t/acme/proj"
    with pytest.raises(DeepinferError, match="reserved"):
        tenant_salt(protocol.GenerateRequest(prompt="x", cache_salt="t/acme"), None)


def test_structured_output_fields_map_to_one_spec():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                           "strict": True}}},
              {"type": "json_schema", "schema": schema}),
             ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
             ({"response_format": {"type": "text"}}, None),
             ({"guided_json": json.dumps(schema)}, {"type": "json_schema", "schema": schema}),
             ({"guided_regex": "[a-z]+"}, {"type": "regex", "pattern": "[a-z]+"}),
             ({"guided_choice": ["yes", "no"]}, {"type": "choice", "choices": ["yes", "no"]}),
             ({"structured_outputs": {"choice": ["a"]}}, {"type": "choice", "choices": ["a"]}),
             ({"guided_grammar": 'root ::= "a" | "b"'}, {"type": "grammar", "grammar": 'root ::= "a" | "b"'})]
    for extra, spec in cases:
        assert parse_call({**chat, **extra}, chat=True).request.sampling().structured == spec, extra
