"""OpenAI wire format <-> deepinfer messages: request bodies to ``GenerateRequest``, token chunks to
completion / chat-completion objects and SSE chunks, errors to OpenAI's error shape.

Pure functions (no I/O), so every mapping is unit-tested without a server. Invariants:
- A body is either fully translated or rejected with ``invalid_request`` naming the parameter; parameters we
  cannot honour yet (non-text content, images) are
  rejected, never ignored, and so are parameters we do not know (a typo): a client must not believe a setting
  took effect. A parameter at its neutral value (``tools: []``, ``tool_choice: "none"``, ``response_format:
  {"type": "text"}``, ``logprobs: false``, ``best_of: 1``: what SDKs and frameworks send on every call) changes
  nothing and is accepted.
- Sampling: OpenAI's ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, and vLLM's ``top_k``,
  ``min_p``, ``repetition_penalty``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``
  (``shared/sampling.py`` states their semantics).
- Structured outputs: ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs`` and
  ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (``structured_spec``): a schema or
  grammar that does not compile is a 400 naming the problem, before any placement.
- Tools (chat): ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant ``tool_calls`` and ``tool`` messages in
  the history, ``chat_template_kwargs`` (``services/router/tool_calls.py``).
- ``n`` (1..16): that many choices, ``index`` 0..n-1 (``services/router/choices.py``); usage counts the prompt
  once and every choice's completion tokens.
- Log-probabilities: chat ``logprobs`` + ``top_logprobs``, completions ``logprobs`` (0..20) and ``echo`` (the
  prompt's text, and with ``logprobs`` its tokens' logprobs, before the completion; ``max_tokens: 0`` with
  ``echo`` scores the prompt alone) and vLLM's ``prompt_logprobs`` (chat and completions; its list with ranks on
  non-streaming answers, as vLLM shapes it); values from the raw model distribution (``shared/logprobs.py``),
  shapes in ``openai_logprobs``.
- deepinfer extras are accepted as top-level body fields (the openai client's ``extra_body``): ``retention``,
  ``speculative``, ``prefill_mode``, ``cache_salt``, ``timeout_s``.
- ``model`` in every response is the request's, else the served model id; ``return_token_ids`` (vLLM's) adds
  the prompt's ``prompt_token_ids`` and each choice's ``token_ids``.
- ``completion_tokens`` of the usage block is the number of tokens the client received.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from services.router import tool_calls
from shared import protocol
from shared.errors import HTTP_STATUS, DeepinferError, ErrorCode, invalid
from shared.sampling import MAX_LOGPROBS

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 256  # /v1/chat/completions without max_tokens (OpenAI: up to the context)
_NUMBER = (int, float)
_EXTRAS = {"retention": str, "slo_class": str, "service_tier": str, "speculative": bool, "priority": int,
           "prefill_mode": str, "top_k": int, "min_tokens": int,
           "ignore_eos": bool, "stop_token_ids": list, "cache_salt": str, "timeout_s": _NUMBER,
           "min_p": _NUMBER, "presence_penalty": _NUMBER, "frequency_penalty": _NUMBER,
           "repetition_penalty": _NUMBER, "logit_bias": dict, "allowed_token_ids": list,
           "bad_words": list}
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")
_KNOWN = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "n",
          "logprobs", "return_token_ids", "prompt_logprobs", *_STRUCTURED, *_EXTRAS}
_KNOWN_CHAT = {"messages", "max_completion_tokens", "top_logprobs", "tools", "functions", "tool_choice",
               "function_call", "parallel_tool_calls", "chat_template_kwargs"}
_KNOWN_COMPLETIONS = {"prompt", "echo"}
# not served yet: accepted only at a value that changes nothing (or null); anything else is a 400 naming it
_NEUTRAL = {"best_of": (1,), "echo": (False,), "top_logprobs": (0,),
            "suffix": ("",)}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 499: "cancelled", 502: "server_error",
               503: "service_unavailable", 504: "timeout", 500: "server_error"}


@dataclass(frozen=True, slots=True)
class ApiCall:
    """A translated HTTP call: what to generate and how to answer."""
    request: protocol.GenerateRequest
    chat: bool
    stream: bool
    include_usage: bool
    model: str  # echoed in responses
    user: str
    logprobs: bool = False   # answer with logprobs (chat: logprobs true; completions: logprobs set)
    echo: bool = False       # completions: the prompt's text (and logprobs) before the completion
    prompt_only: bool = False  # echo with max_tokens 0: one token is generated and not shown
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every streamed chunk
    tools: tool_calls.ToolPlan = tool_calls.ToolPlan(None, None, "none")   # chat: tools and how to read them
    return_token_ids: bool = False  # vLLM's: the prompt's ids on the response, each choice's output ids
    prompt_logprobs: bool = False  # vLLM's field given: its ``prompt_logprobs`` list (non-streaming answers)


def _get(body: dict, name: str, kinds, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kinds in (int, float, (int, float)):
        raise invalid(f"parameter '{name}' must be a number, got a boolean")
    if not isinstance(value, kinds):
        want = kinds.__name__ if isinstance(kinds, type) else "number"
        raise invalid(f"parameter '{name}' must be {want}, got {type(value).__name__}")
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return list(stop)
    raise invalid("parameter 'stop' must be a string or a list of at most 16 strings")


def chat_messages(body: dict) -> list[dict]:
    """A body's ``messages`` as plain text messages (``invalid_request`` naming the bad one): ``{role, content}``,
    an assistant's ``tool_calls`` (``content`` may then be null; arguments parsed from their JSON text, as chat
    templates expect) and a tool result's ``tool_call_id`` / ``name``."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("parameter 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"parameter 'messages[{i}]' must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"parameter 'messages[{i}].content': only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        calls = m.get("tool_calls")
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise invalid(f"parameter 'messages[{i}].content' must be a string or a list of text parts")
        message = {"role": m["role"], "content": content}
        if calls:
            message["tool_calls"] = _tool_calls_in(calls, i)
        for name in ("tool_call_id", "name"):
            if isinstance(m.get(name), str):
                message[name] = m[name]
        out.append(message)
    return out


def _tool_calls_in(calls, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise invalid(f"parameter 'messages[{i}].tool_calls' must be a list")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"parameter 'messages[{i}].tool_calls': each needs a function with a name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise invalid(f"parameter 'messages[{i}].tool_calls': arguments are not JSON") from None
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _prompt(body: dict) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise invalid("parameter 'prompt' must be a string, a list of token ids, or a batch of exactly one of those "
                  "(batches of several prompts are not supported: send one request each)")


def parse_call(body: Any, chat: bool, user_cache_salt: bool = False) -> ApiCall:
    """Translate a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for name in sorted(set(body) - _KNOWN - (_KNOWN_CHAT if chat else _KNOWN_COMPLETIONS)):
        neutral, value = _NEUTRAL.get(name), body[name]
        if neutral is None:
            raise invalid(f"parameter '{name}' is not supported")
        if value is not None and not any(type(value) is type(v) and value == v for v in neutral):
            shown = " or ".join(repr(v) for v in neutral)
            raise invalid(f"parameter '{name}' is not supported yet (only {shown}, which changes nothing)")
    n = _get(body, "n", int, 1)
    if not 1 <= n <= protocol.MAX_CHOICES:
        raise invalid(f"parameter 'n' must be an integer in [1, {protocol.MAX_CHOICES}], got {n}")
    model = _get(body, "model", str, "")
    default_max = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = _get(body, "max_completion_tokens", int, None) if chat else None
    max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", int, default_max)
    prompt_only = not chat and max_tokens == 0 and _get(body, "echo", bool, False)
    max_tokens = 1 if prompt_only else max_tokens
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    user = _get(body, "user", str, "")
    fields: dict[str, Any] = {"messages": chat_messages(body)} if chat else _prompt(body)
    if n > 1:
        fields["n"] = n
    for name, kinds in _EXTRAS.items():
        value = _get(body, name, kinds, None)
        if value is not None:
            fields[name] = value
    if user_cache_salt and user and "cache_salt" not in fields:
        fields["cache_salt"] = user
    spec = structured_spec(body)
    plan = tool_calls.plan(body) if chat else tool_calls.ToolPlan(None, None, "none")
    if plan.structured is not None and spec is not None:
        raise invalid("parameters 'tool_choice' and the structured-output constraint: give one of them")
    spec = spec or plan.structured
    if spec is not None:
        fields["structured"] = spec
    if plan.tools:
        fields["tools"] = plan.tools
    if chat and body.get("chat_template_kwargs") is not None:
        fields["chat_template_kwargs"] = _get(body, "chat_template_kwargs", dict, {})
    logprobs, echo = _logprobs(body, chat, fields), bool(not chat and _get(body, "echo", bool, False))
    if echo and logprobs:
        fields.setdefault("prompt_logprobs", fields["logprobs"])   # echo + logprobs: the prompt's too (vLLM)
    if echo and fields.get("prompt_logprobs") is not None:
        logprobs = True   # the echoed prompt's rows carry them (vLLM's own list comes with call.prompt_logprobs)
    request = protocol.GenerateRequest(
        model=model, max_tokens=max_tokens, temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)), seed=_get(body, "seed", int, None),
        stop=_stop(body), **fields)
    return ApiCall(request, chat, stream, bool(options.get("include_usage")), model, user, logprobs, echo,
                   prompt_only, bool(options.get("continuous_usage_stats")), plan,
                   _get(body, "return_token_ids", bool, False), body.get("prompt_logprobs") is not None)


def structured_spec(body: dict) -> dict | None:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` / ``guided_*`` as a ``shared/structured.py``
    spec (None: free text); at most one of them. Its grammar is checked when the request is built."""
    given = {name: body[name] for name in _STRUCTURED if body.get(name) is not None}
    if given.get("response_format") == {"type": "text"}:
        del given["response_format"]
    if len(given) > 1:
        raise invalid(f"parameters {' and '.join(sorted(given))}: give at most one structured-output constraint")
    if not given:
        return None
    (name, value), = given.items()
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return {"type": "json_object"}
        schema = (value.get("json_schema") or {}).get("schema") if kind == "json_schema" else None
        if not isinstance(schema, dict):
            raise invalid("parameter 'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}")
        return {"type": "json_schema", "schema": schema}
    if name == "structured_outputs":
        if not isinstance(value, dict) or len([k for k in value if value[k] not in (None, False)]) != 1:
            raise invalid("parameter 'structured_outputs' must hold exactly one of json, regex, choice, grammar, "
                          "json_object")
        (name, value), = ((k, v) for k, v in value.items() if v not in (None, False))
        name = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                "grammar": "guided_grammar", "json_object": "json_object"}.get(name, name)
        if name == "json_object":
            return {"type": "json_object"}
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid("parameter 'guided_json': not valid JSON") from None
        return {"type": "json_schema", "schema": value}
    if name == "guided_regex":
        return {"type": "regex", "pattern": value}
    if name == "guided_choice":
        return {"type": "choice", "choices": value}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": value}
    raise invalid(f"parameter 'structured_outputs': unknown constraint {name!r}")


def _logprobs(body: dict, chat: bool, fields: dict) -> bool:
    """Chat's ``logprobs`` (bool) + ``top_logprobs`` (0..20), or completions' ``logprobs`` (int 0..20), into
    ``fields["logprobs"]``; vLLM's ``prompt_logprobs`` (int) too. Whether the answer carries logprobs."""
    if chat:
        top = _get(body, "top_logprobs", int, None)
        if not _get(body, "logprobs", bool, False):
            if top:
                raise invalid("parameter 'top_logprobs' needs 'logprobs': true")
        elif top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise invalid(f"parameter 'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {top}")
        else:
            fields["logprobs"] = top or 0
    else:
        count = _get(body, "logprobs", int, None)
        if count is None:
            pass
        elif not 0 <= count <= MAX_LOGPROBS:
            raise invalid(f"parameter 'logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {count}")
        else:
            fields["logprobs"] = count
    prompt = _get(body, "prompt_logprobs", int, None)
    if prompt is not None:
        if not 0 <= prompt <= MAX_LOGPROBS:
            raise invalid(f"parameter 'prompt_logprobs' must be an integer in [0, {MAX_LOGPROBS}], got {prompt}")
        fields["prompt_logprobs"] = prompt
    return "logprobs" in fields


# ---- responses ------------------------------------------------------------------------------------------

def usage_block(usage: dict | None) -> dict:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
    block = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": int(usage.get("cached_tokens", 0) or 0)}}
    if usage.get("retention"):   # deepinfer's: the cache retention class the request got
        block["retention"] = usage["retention"]
    if usage.get("slo_class"):   # deepinfer's: the SLO class the request ran in
        block["slo_class"] = usage["slo_class"]
    return block


def _head(call: ApiCall, rid: str, created: int, chunk: bool) -> dict:
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if call.chat else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": call.model}


def full_response(call: ApiCall, rid: str, choices: list[dict], usage: dict | None,
                  prompt_token_ids: list[int] | None = None, prompt_logprobs: list | None = None) -> dict:
    """The non-streaming answer; ``choices`` from ``choice_body``, in index order (``return_token_ids``: the
    prompt's ids too; chat with vLLM's ``prompt_logprobs``: those, on the response as vLLM puts them)."""
    answer = {**_head(call, rid, int(time.time()), False), "choices": choices, "usage": usage_block(usage)}
    if call.return_token_ids:
        answer["prompt_token_ids"] = prompt_token_ids
    if call.chat and call.prompt_logprobs:
        answer["prompt_logprobs"] = prompt_logprobs
    return answer


def choice_body(call: ApiCall, index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    """One choice of a non-streaming answer; ``logprobs`` already in the API's shape (``openai_logprobs``);
    ``calls``: the tool calls (``finish_reason`` is then ``tool_calls``, unless ``length``: a call cut by
    ``max_tokens`` did not finish, and clients must not take its arguments for complete)."""
    if call.chat:
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
            finish_reason = "length" if finish_reason == "length" else "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def merged_usage(usages: list[dict | None]) -> dict:
    """The usage of ``n`` choices of one prompt: its prompt (and cached) tokens once, every completion token."""
    first = usages[0] or {}
    return {**first, "completion_tokens": sum(int((u or {}).get("completion_tokens", 0)) for u in usages)}


def stream_events(call: ApiCall, rid: str, created: int, chunk: protocol.TokenChunk, first: bool,
                  logprobs: dict | None = None, text: str | None = None, usage: dict | None = None,
                  reasoning: str = "") -> list[dict]:
    """SSE payloads for one token chunk of choice ``chunk.index`` (the caller appends ``usage_event`` and
    ``[DONE]``); ``logprobs`` in the API's shape, ``text`` when it is not the chunk's own (an echoed prompt),
    ``usage`` (``continuous_usage_stats``) the choice's so far."""
    finish = chunk.finish_reason if chunk.final else None
    text = chunk.text if text is None else text
    if call.chat:
        delta: dict = {"role": "assistant", "content": text} if first else {"content": text}
        if reasoning:
            delta["reasoning_content"] = reasoning
        choice = {"index": chunk.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": chunk.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if call.return_token_ids:
        choice["token_ids"] = list(chunk.token_ids)
    event = {**_head(call, rid, created, True), "choices": [choice]}
    if usage is not None:
        event["usage"] = usage_block(usage)
    return [event]


def tool_calls_event(call: ApiCall, rid: str, created: int, index: int, calls: list[dict],
                     finish_reason: str | None = None) -> dict:
    """A streamed choice's tool calls, each whole in one delta, and ``finish_reason: tool_calls`` (``length``
    when ``max_tokens`` cut them: see ``choice_body``)."""
    deltas = [{"index": i, **c} for i, c in enumerate(calls)]
    finish = "length" if finish_reason == "length" else "tool_calls"
    return {**_head(call, rid, created, True), "choices": [{"index": index, "delta": {"tool_calls": deltas},
                                                            "logprobs": None, "finish_reason": finish}]}


def usage_event(call: ApiCall, rid: str, created: int, usage: dict) -> dict:
    """``stream_options.include_usage``: the last event before ``[DONE]``, after every choice's final chunk."""
    return {**_head(call, rid, created, True), "choices": [], "usage": usage_block(usage)}


def error_body(err: DeepinferError, status: int | None = None) -> tuple[int, dict]:
    """``(status, body)`` in OpenAI's error shape; ``code`` is deepinfer's stable error code."""
    status = status or HTTP_STATUS.get(err.code, 500)
    return status, {"error": {"message": err.message, "type": ERROR_TYPES.get(status, "server_error"),
                              "param": None, "code": err.code.value}}


def chunk_error(chunk: protocol.TokenChunk) -> DeepinferError | None:
    """The error a final chunk carries, as an exception (None when it succeeded)."""
    if chunk.error is None:
        return None
    try:
        code = ErrorCode(chunk.error.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    return DeepinferError(code, str(chunk.error.get("message", "")))
