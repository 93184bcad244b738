"""Every wire message of deepinfer: frozen, validated dataclasses <-> msgpack bytes.

Wire format: one msgpack map ``{"v": PROTOCOL_VERSION, "type": <class name>, <field>: <value>, ...}``.
Messages are keyword-only, validated on construction (types by annotation, see ``shared.wire_validation``,
then each message's ``_check``), so an object that exists is valid and ``decode`` only returns valid objects.

``decode`` raises only ``DeepinferError``: ``invalid_request`` for garbage, unknown/unexpected type,
missing/mistyped/unknown fields; ``unsupported_version`` for a missing or wrong ``v``; ``payload_too_large``
over the per-type byte limit. ``encode`` enforces the same byte limits, so a sender learns first.

The cluster's control-plane messages (heartbeats, registry entries, KV events and snapshots, request probes)
are defined in ``shared.protocol_control``, the cache tier's and the stats messages in ``shared.protocol_cache``,
the draft service's in ``shared.protocol_draft``, the worker path's (``PrefillRequest``, ``KVHandoff``,
``DecodeLocalRequest``) in ``shared.protocol_work``, a request's ``Sampling`` (the engine's ``SamplingParams``) in
``shared.sampling``; all are re-exported here: import every message from this module.

Errors over NATS: a service answers a failed request with ``encode(ErrorReply.from_exception(err))`` as the
body and ``error_headers(err)`` as headers; callers use ``decode_reply`` to get the message or the raised
error. On a token stream the error is instead a final ``TokenChunk.from_error(...)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from shared.errors import DeepinferError, ErrorCode
from shared.wire_fields import check_id, check_one_of, check_range, check_tokens, require
from shared.protocol_control import (KV_EVENT_KINDS, KV_TIERS, MAX_CONTROL_BYTES, ROLES, KVEvent, KVSnapshot,
                                     ClientAdmin, ClientAdminReply, LoadReport, MigrateRequest, RequestProbe,
                                     RoleSwitch, ScaleRequest, WorkerInfo)
from shared.protocol_work import (DTYPES, MAX_PROMPT_TOKENS, DecodeLocalRequest, KVHandoff, KVPrecopy,
                                  PrefillRequest)
from shared.logprobs import Logprobs
from shared.sampling import Sampling, SamplingParams
from shared.protocol_cache import (CacheGet, CacheGetReply, CachePut, CacheRelease, StatsReply,
                                   StatsRequest)
from shared.protocol_draft import DraftReply, DraftRequest
from shared.wire_validation import (MAX_MESSAGE_BYTES, PROTOCOL_VERSION, WireModel, decode,
                                    encode, registered_types, wire_field, wire_message)

__all__ = ["PROTOCOL_VERSION", "MAX_MESSAGE_BYTES", "MAX_REQUEST_BYTES", "MAX_CHUNK_BYTES", "MAX_CONTROL_BYTES",
           "encode", "decode", "decode_reply", "error_headers", "Sampling", "SamplingParams", "GenerateRequest", "TokenChunk",
           "CancelRequest", "PrefillRequest", "KVHandoff", "KVPrecopy", "DecodeLocalRequest", "RequestProbe",
           "MigrateRequest", "RoleSwitch", "ScaleRequest", "ClientAdmin", "ClientAdminReply", "Ack", "ErrorReply",
           "LoadReport", "WorkerInfo", "KVEvent", "KVSnapshot", "MESSAGE_TYPES", "ROLES", "KV_EVENT_KINDS", "KV_TIERS",
           "CachePut", "CacheGet", "CacheGetReply", "CacheRelease", "StatsRequest", "StatsReply", "DraftRequest",
           "DraftReply", "DTYPES", "MAX_PROMPT_TOKENS"]

MAX_REQUEST_BYTES = 4 * 1024 * 1024   # client-facing requests
MAX_CHUNK_BYTES = 1024 * 1024         # one TokenChunk
MAX_CHAT_MESSAGES = 1000
MAX_CHOICES = 16                      # GenerateRequest.n
MAX_TOOLS = 128                       # GenerateRequest.tools

PREFILL_MODES = ("auto", "remote", "local")

T = TypeVar("T")


def _error(code: str, message: str) -> DeepinferError:
    try:
        return DeepinferError(ErrorCode(code), message)
    except ValueError:  # a newer peer's code: keep it readable
        return DeepinferError(ErrorCode.INTERNAL, f"{code}: {message}")


# ---- messages ------------------------------------------------------------------------------------------

MAX_REQUEST_S = 3600.0  # a request without ``timeout_s`` has no deadline of its own; the router still ends it then


@wire_message(MAX_REQUEST_BYTES)
class GenerateRequest(WireModel):
    """Client API request. Exactly one of ``prompt`` / ``messages`` (chat) / ``prompt_token_ids``."""
    request_id: str = ""            # router assigns one if empty
    model: str = ""
    prompt: str | None = None
    messages: list[dict] | None = wire_field(default=None, max_len=MAX_CHAT_MESSAGES)
    prompt_token_ids: list[int] | None = wire_field(default=None, max_len=MAX_PROMPT_TOKENS)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict = wire_field(default_factory=dict)         # token id (decimal string) -> bias
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = wire_field(default_factory=list)
    logprobs: int | None = None     # top logprobs per generated token (0: only the token's own); None: none
    prompt_logprobs: int | None = None
    structured: dict | None = None   # the output's JSON schema / regex / choice / grammar (shared/structured.py)
    seed: int | None = None
    stop: list[str] = wire_field(default_factory=list)
    stop_token_ids: list[int] = wire_field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    timeout_s: float | None = None  # the client's deadline (s); None: none but the router's MAX_REQUEST_S backstop
    cache_salt: str = ""
    prefill_mode: str = "auto"      # "auto" | "remote" | "local"
    transport: str = ""             # force a KV transport; "" = router chooses
    retention: str = ""             # cache retention class; "" = by API (messages: chat, else the prompt class)
    speculative: bool | None = None  # speculative decoding on/off for this request; None = deployment default
    priority: int = 0               # lower runs first on workers scheduling by priority (vLLM's field)
    slo_class: str = ""             # the deployment's SLO class (shared/slo_classes.py); "" = by tier, tenant, default
    service_tier: str = ""          # OpenAI's: priority | flex | default | auto (mapped to an SLO class)
    # resuming a stream whose router died (shared/client.py): the tokens the client already has, and the seq its
    # next chunk must carry; the router continues after them as after a failover
    resume_tokens: list[int] = wire_field(default_factory=list, max_len=MAX_PROMPT_TOKENS)
    resume_seq: int = 0
    # chat: tools shown to the model's chat template (OpenAI's shape), and extra template variables
    tools: list[dict] | None = wire_field(default=None, max_len=MAX_TOOLS)
    chat_template_kwargs: dict = wire_field(default_factory=dict)
    # n > 1: n sequences of one prompt (choice i seeded seed + i when a seed is given), each its own stream of
    # chunks with ``index`` i, own seq and own final chunk; the prompt is prefilled once (choices after the first
    # start when choice 0 has its KV on a decode worker, and find it in the prefix caches). No resume.
    n: int = 1

    def _check(self) -> None:
        check_id("request_id", self.request_id, allow_empty=True)
        require(1 <= self.n <= MAX_CHOICES, f"field 'n': must be in [1, {MAX_CHOICES}], got {self.n}")
        require(self.n == 1 or not self.resume_tokens, "field 'n': a resumed stream has one choice")
        check_tokens("resume_tokens", self.resume_tokens, allow_empty=True)
        require(self.resume_seq >= 0 and (self.resume_seq > 0 or not self.resume_tokens),
                 "field 'resume_seq': must be >= 0, and > 0 with resume_tokens")
        require(len(self.resume_tokens) < self.max_tokens or not self.resume_tokens,
                 "field 'resume_tokens': must be fewer than max_tokens")
        check_id("retention", self.retention, allow_empty=True)
        check_id("slo_class", self.slo_class, allow_empty=True)
        check_id("service_tier", self.service_tier, allow_empty=True)
        require("~" not in self.request_id, "field 'request_id': '~' is reserved (failover attempt ids)")
        check_id("cache_salt", self.cache_salt, allow_empty=True)
        forms = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        require(forms == 1, "exactly one of 'prompt', 'messages', 'prompt_token_ids' must be given")
        if self.messages is not None:
            require(bool(self.messages), "field 'messages': must not be empty")
            for i, m in enumerate(self.messages):
                require(isinstance(m.get("role"), str) and bool(m["role"]) and isinstance(m.get("content"), str),
                         f"field 'messages[{i}]': needs a non-empty str 'role' and a str 'content'")
                require(isinstance(m.get("tool_calls", []), list), f"field 'messages[{i}].tool_calls': a list")
        require(self.tools is None or (self.messages is not None and len(self.tools) <= MAX_TOOLS),
                 f"field 'tools': chat messages only, at most {MAX_TOOLS}")
        if self.prompt_token_ids is not None:
            check_tokens("prompt_token_ids", self.prompt_token_ids)
        require(self.timeout_s is None or 0 < self.timeout_s <= MAX_REQUEST_S,
                 f"field 'timeout_s': must be in (0, {MAX_REQUEST_S:.0f}] or absent, got {self.timeout_s}")
        check_one_of("prefill_mode", self.prefill_mode, PREFILL_MODES)
        self.sampling()

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters, the value every hop carries (validated: ``invalid_request``):
        every ``Sampling`` field this request names (``prefill_only`` is the router's, not the client's)."""
        return SamplingParams(**{name: getattr(self, name) for name in _CLIENT_SAMPLING_FIELDS})


_CLIENT_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(Sampling)
                                if f.name in {g.name for g in dataclasses.fields(GenerateRequest)})


@wire_message(MAX_CHUNK_BYTES)
class TokenChunk(WireModel):
    """One piece of a token stream. ``seq`` counts 0, 1, 2, ... per request; exactly the last chunk is
    ``final`` and only it carries ``finish_reason``, ``usage`` (prompt_tokens, cached_tokens,
    completion_tokens, ttft_ms, tpot_ms) or ``error`` ({"code", "message"}). Log-probabilities, where the
    request asked for them: ``shared/logprobs.py``."""
    request_id: str
    seq: int
    token_ids: list[int]
    text: str = ""
    final: bool = False
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    index: int = 0                            # the choice (GenerateRequest.n); seq counts per choice
    logprobs: Logprobs | None = None          # Sampling.logprobs: one entry per token of token_ids
    prompt_logprobs: Logprobs | None = None   # Sampling.prompt_logprobs: on the stream's first chunk only

    def _check(self) -> None:
        check_range("seq", self.seq, 0)
        require(self.logprobs is None or len(self.logprobs) == len(self.token_ids),
                "field 'logprobs': one entry per token of token_ids")
        check_tokens("token_ids", self.token_ids, allow_empty=True)
        require(self.final or (self.finish_reason is None and self.usage is None and self.error is None),
                 "field 'final': finish_reason, usage and error are only allowed on the final chunk")
        if self.error is not None:
            require(isinstance(self.error.get("code"), str) and isinstance(self.error.get("message"), str),
                     "field 'error': needs str 'code' and str 'message'")

    @classmethod
    def from_error(cls, request_id: str, seq: int, err: DeepinferError) -> TokenChunk:
        """The final chunk that ends a stream with ``err``."""
        return cls(request_id=request_id, seq=seq, token_ids=[], final=True, finish_reason="error",
                   error={"code": err.code.value, "message": err.message})

    def raise_if_error(self) -> None:
        """Raise the carried error as a DeepinferError (unknown codes map to ``internal``)."""
        if self.error is not None:
            raise _error(self.error["code"], self.error["message"])


@wire_message(MAX_CONTROL_BYTES)
class CancelRequest(WireModel):
    request_id: str

    def _check(self) -> None:
        check_id("request_id", self.request_id)


@wire_message(MAX_CONTROL_BYTES)
class Ack(WireModel):
    ok: bool = True
    detail: str = ""


@wire_message(MAX_CONTROL_BYTES)
class ErrorReply(WireModel):
    """Body of a failed NATS request's reply (headers: ``error_headers``)."""
    code: str
    message: str

    def _check(self) -> None:
        require(bool(self.code), "field 'code': must not be empty")

    @classmethod
    def from_exception(cls, err: BaseException) -> ErrorReply:
        """DeepinferError keeps its code; anything else is ``internal`` (details stay in the log)."""
        if isinstance(err, DeepinferError):
            return cls(code=err.code.value, message=err.message[:4096])
        return cls(code=ErrorCode.INTERNAL.value, message=f"internal error ({type(err).__name__})")

    def to_exception(self) -> DeepinferError:
        return _error(self.code, self.message)


MESSAGE_TYPES: dict[str, type] = registered_types()


# ---- replies -------------------------------------------------------------------------------------------

def decode_reply(data: bytes, expected: type[T] | tuple[type, ...]) -> T:
    """Decode a request's reply: the expected message, or raise the DeepinferError of an ErrorReply."""
    allowed = (expected,) if isinstance(expected, type) else tuple(expected)
    msg = decode(data, (*allowed, ErrorReply))
    if isinstance(msg, ErrorReply) and ErrorReply not in allowed:
        raise msg.to_exception()
    return msg


def error_headers(err: DeepinferError) -> dict[str, str]:
    """NATS headers for an error reply (NATS micro convention plus our code); body: encode(ErrorReply)."""
    description = " ".join(err.message.split())[:256]
    return {"Nats-Service-Error-Code": str(err.http_status), "Nats-Service-Error": description,
            "Di-Error-Code": err.code.value}
