"""The router's OpenAI-compatible HTTP API (aiohttp): ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` = server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics``.

Every request runs through the same ``RouterService.serve`` as the NATS API (admission, placement, failover,
accounting). Invariants:
- Status codes come from the error's code (``shared.errors.HTTP_STATUS``): 400 bad input, 401 missing/unknown
  API key, 404 unknown model, 429 overloaded (with ``Retry-After``), 503 no workers / draining, 504 timeout.
  A stream's status is decided by its first chunk: an error before any token is a plain JSON error with its
  status; an error after tokens were sent is an SSE ``{"error": ...}`` event, then ``[DONE]``.
- A client that disconnects cancels its request on the workers (the handler is cancelled, and with it the
  relay, which publishes the cancel).
- Buffers are bounded: a body over ``MAX_BODY_BYTES`` is 413; chunks wait in a queue of ``QUEUE_CHUNKS``
  (a slow reader slows the relay, it does not grow memory).
- Waits are bounded: a streaming client that reads nothing for ``STALL_S`` (a write to it cannot complete) is
  cut off and its request cancelled on the workers, and a relay never waits longer than that for room in the
  queue (then the chunk is dropped: the handler is cutting that client off), so stalled clients cannot pin
  router slots.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import importlib.metadata
import time
from typing import TYPE_CHECKING

from aiohttp import web

from services.router import openai_api
from services.router.api_keys import ApiKeys
from services.router.http_conventions import REQUEST_ID, Conventions
from services.router.openai_choice import Choice
from shared import protocol, tracing
from shared.errors import DeepinferError, ErrorCode

if TYPE_CHECKING:
    from services.router.service import RouterService

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 * 1024 * 1024
QUEUE_CHUNKS = 64
STALL_S = 30.0  # a client that takes nothing for this long is cut off
RETRY_AFTER_S = "1"
MAX_DETOKENIZE_IDS = 1 << 17
try:
    VERSION = importlib.metadata.version("deepinfer")
except importlib.metadata.PackageNotFoundError:   # a source tree that was never installed
    VERSION = "0+unknown"


def _error(err: DeepinferError, status: int | None = None) -> web.Response:
    status, body = openai_api.error_body(err, status)
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    return web.json_response(body, status=status, headers=headers)


class ChunkSink:
    """The relay's ``send`` for one HTTP request: a bounded queue the handler reads. Once the handler is gone
    (``close``), sends are dropped, so a cancelled relay never blocks on a full queue."""

    def __init__(self, stall_s: float | None = None) -> None:
        self.queue: asyncio.Queue[protocol.TokenChunk] = asyncio.Queue(QUEUE_CHUNKS)
        self.closed = False
        self.stall_s = STALL_S if stall_s is None else stall_s

    async def send(self, chunk: protocol.TokenChunk) -> None:
        """Queue ``chunk`` for the handler; waits at most ``stall_s`` for room, then drops it and every later
        chunk (the handler, stuck writing to a client that reads nothing, is cutting it off)."""
        if self.closed:
            return
        try:
            await asyncio.wait_for(self.queue.put(chunk), self.stall_s)
        except asyncio.TimeoutError:
            logger.info("[%s] the client takes no chunks: dropping the rest", chunk.request_id)
            self.closed = True

    def close(self) -> None:
        self.closed = True
        while not self.queue.empty():  # wake a sender blocked on the full queue
            self.queue.get_nowait()


class HttpApi:
    def __init__(self, router: "RouterService") -> None:
        self.router = router
        self.keys = ApiKeys(router.config.api_keys)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        Conventions(self.router.config.allowed_origins).install(app)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        return app

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = a free port); returns the bound port."""
        self.runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        logger.info("OpenAI-compatible API on http://%s:%d/v1", host, self.port)
        return self.port

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---- endpoints -----------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        ready = self.router.ready_workers()
        ok = bool(ready.get("decode")) and not self.router.draining
        body = {"status": "ok" if ok else "unavailable", "draining": self.router.draining,
                "workers": {role: len(ids) for role, ids in ready.items()}}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        if (err := self._auth(request)[1]) is not None:
            return err
        data = [{"id": m, "object": "model", "created": self.router.started_at, "owned_by": "deepinfer", "root": m,
                 "max_model_len": self.router.max_model_len()} for m in self.router.served_models()]
        return web.json_response({"object": "list", "data": data})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``prompt`` or chat ``messages`` -> ``{"tokens", "count", "max_model_len"}``
        (``return_token_strs``: each token's text too)."""
        if (err := self._auth(request)[1]) is not None:
            return err
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise DeepinferError(ErrorCode.INVALID_REQUEST, "the request body must be a JSON object")
            if "messages" in body:
                req = protocol.GenerateRequest(messages=openai_api.chat_messages(body))
            elif isinstance(body.get("prompt"), str):
                req = protocol.GenerateRequest(prompt=body["prompt"])
            else:
                raise DeepinferError(ErrorCode.INVALID_REQUEST, "tokenize needs a string 'prompt' or 'messages'")
            ids = await self.router.tokenize(req)
        except DeepinferError as exc:
            return _error(exc)
        answer = {"tokens": ids, "count": len(ids), "max_model_len": self.router.max_model_len()}
        if body.get("return_token_strs") is True:
            tok = self.router.tokenizer
            answer["token_strs"] = [tok.decode([i], skip_special_tokens=False) for i in ids]
        return web.json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        if (err := self._auth(request)[1]) is not None:
            return err
        try:
            body = await self._json(request)
            ids = body.get("tokens") if isinstance(body, dict) else None
            vocab = self.router.tokenizer.vocab_size
            if (not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_IDS
                    or not all(type(i) is int and 0 <= i < vocab for i in ids)):
                raise DeepinferError(ErrorCode.INVALID_REQUEST, f"detokenize needs 'tokens': a list of at most "
                                     f"{MAX_DETOKENIZE_IDS} token ids in [0, {vocab})")
        except DeepinferError as exc:
            return _error(exc)
        return web.json_response({"prompt": self.router.tokenizer.decode(ids, skip_special_tokens=False)})

    async def _json(self, request: web.Request):
        try:
            return await request.json(loads=json.loads)
        except web.HTTPRequestEntityTooLarge:
            raise DeepinferError(ErrorCode.PAYLOAD_TOO_LARGE, f"body over {MAX_BODY_BYTES} bytes") from None
        except (ValueError, UnicodeDecodeError):
            raise DeepinferError(ErrorCode.INVALID_REQUEST, "the body is not valid JSON") from None

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.router.render_metrics(request.headers.get("Accept", ""))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=True)

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        tenant, err = self._auth(request)
        if err is not None:
            return err
        if self.router.draining:
            return _error(DeepinferError(ErrorCode.UNAVAILABLE, "the router is draining; retry"))
        try:
            body = await self._json(request)
            call = openai_api.parse_call(body, chat, self.router.config.user_cache_salt)
            if not call.model:   # every response names the model it came from
                call = dataclasses.replace(call, model=self.router.served_name)
            wants_prompt = call.echo or call.continuous_usage or call.return_token_ids or call.prompt_logprobs or \
                (call.logprobs and not chat)
            prompt_ids = await self.router.tokenize(call.request) if wants_prompt else None
        except DeepinferError as exc:
            return _error(exc)
        rid = ("chatcmpl-" if chat else "cmpl-") + request[REQUEST_ID]   # http_conventions: X-Request-Id
        sink = ChunkSink()
        req = dataclasses.replace(call.request, request_id=rid)
        config = self.router.config
        choices = [Choice(call, prompt_ids, self.router.tokenizer, config.tool_call_parser, config.reasoning_parser)
                   for _ in range(req.n)]
        task = asyncio.create_task(self.router.serve(req, sink.send, tenant=tenant, api="http",
                                                     trace_parent=tracing.context_of(request.headers)))
        try:
            if call.stream:
                return await self._stream(request, call, rid, sink, task, choices)
            return await self._collect(call, rid, sink, task, choices)
        finally:
            sink.close()
            if not task.done():  # client gone (handler cancelled) or a write failed: stop the request
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _auth(self, request: web.Request) -> tuple[str | None, web.Response | None]:
        if not self.keys.required:
            return None, None
        tenant = self.keys.tenant_of(request.headers.get("Authorization"))
        if tenant is None:
            self.router.metrics.rejected("unauthorized")
            return None, _error(DeepinferError(ErrorCode.INVALID_REQUEST, "missing or unknown API key "
                                               "(Authorization: Bearer <key>)"), status=401)
        return tenant, None

    async def _next(self, sink: ChunkSink, task: asyncio.Task) -> protocol.TokenChunk:
        """The next chunk; the serve task always ends with a final chunk unless it crashed."""
        getter = asyncio.ensure_future(sink.queue.get())
        done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        getter.cancel()
        if not sink.queue.empty():
            return sink.queue.get_nowait()
        task.result()  # re-raise what ended it
        raise DeepinferError(ErrorCode.INTERNAL, "the request ended without a final chunk")

    async def _collect(self, call, rid, sink, task, choices: list[Choice]) -> web.Response:
        """Every choice's chunks until each one's final; the first error answers the whole request."""
        finals: dict[int, protocol.TokenChunk] = {}
        while len(finals) < len(choices):
            chunk = await self._next(sink, task)
            if (err := openai_api.chunk_error(chunk)) is not None:
                return _error(err)
            choices[chunk.index].piece(chunk)
            if chunk.final:
                finals[chunk.index] = chunk
        bodies = []
        prompt_lps = choices[0].vllm_prompt_logprobs() if call.prompt_logprobs else None   # choice 0 carries them
        for i, c in enumerate(choices):
            content, calls = c.message() if call.chat else (c.text, [])
            bodies.append(openai_api.choice_body(call, i, content, finals[i].finish_reason, c.logprobs(), calls,
                                                 c.reasoning))
            if call.return_token_ids:
                bodies[-1]["token_ids"] = c.token_ids
            if call.prompt_logprobs and not call.chat:   # vLLM: per completion choice
                bodies[-1]["prompt_logprobs"] = prompt_lps
        usage = openai_api.merged_usage([c.usage(finals[i].usage) for i, c in enumerate(choices)])
        return web.json_response(openai_api.full_response(call, rid, bodies, usage, choices[0].prompt_ids,
                                                          prompt_lps))

    async def _stream(self, request, call, rid, sink, task, choices: list[Choice]) -> web.StreamResponse:
        chunk = await self._next(sink, task)
        if chunk.final and (err := openai_api.chunk_error(chunk)) is not None:
            return _error(err)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        created, started, usages = int(time.time()), set(), {}
        while True:
            err = openai_api.chunk_error(chunk) if chunk.final else None
            if err is not None:   # the first error ends every choice
                await _sse(request, response, openai_api.error_body(err)[1])
                break
            choice = choices[chunk.index]
            text, logprobs = choice.piece(chunk)
            so_far = {"prompt_tokens": len(choice.prompt_ids), "completion_tokens": choice.completion_tokens} \
                if call.continuous_usage else None
            calls = []
            if chunk.final and call.chat and call.tools.mode != "none":   # held-back text, parsed tool calls
                rest, calls = choice.rest()
                text += rest
            shown = dataclasses.replace(chunk, final=False, finish_reason=None, usage=None) if calls else chunk
            for event in openai_api.stream_events(call, rid, created, shown, chunk.index not in started, logprobs,
                                                  text, so_far, choice.last_reasoning):
                await _sse(request, response, event)
            if calls:
                await _sse(request, response, openai_api.tool_calls_event(call, rid, created, chunk.index, calls,
                                                                          chunk.finish_reason))
            started.add(chunk.index)
            if chunk.final:
                usages[chunk.index] = choice.usage(chunk.usage)
                if len(usages) == len(choices):
                    if call.include_usage:
                        usage = openai_api.merged_usage([usages[i] for i in range(len(choices))])
                        await _sse(request, response, openai_api.usage_event(call, rid, created, usage))
                    break
            chunk = await self._next(sink, task)
        await _write(request, response, b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _sse(request: web.Request, response: web.StreamResponse, payload: dict) -> None:
    await _write(request, response, b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def _write(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    """Write within ``STALL_S``, else close the client's connection and raise ``ConnectionResetError`` (the
    handler then cancels the request)."""
    try:
        await asyncio.wait_for(response.write(data), STALL_S)
    except asyncio.TimeoutError:
        if request.transport is not None:
            request.transport.abort()              # its buffered bytes are dropped with it
        raise ConnectionResetError(f"the client read nothing for {STALL_S:.0f} s: cut off") from None
