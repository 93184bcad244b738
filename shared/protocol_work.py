"""The worker-path wire messages: what the router and workers send each other to
serve it (``PrefillRequest``, ``KVHandoff``, ``DecodeLocalRequest``). Same codec and rules as every message
(``shared.wire_validation``); import them from ``shared.protocol``, which re-exports them.

Model identity: each carries ``model_fingerprint`` (``shared/model/fingerprint.py``), the build the work is for
(router -> worker: "" = any build) or the build that computed the KV (hand-off: "" is refused); a worker of
another build answers ``model_mismatch`` and changes nothing, so foreign KV is never served.
"""
from __future__ import annotations

import math
from typing import Any

from shared.retention import NO_RETENTION
from shared.sampling import SamplingParams
from shared.wire_fields import (check_fingerprint, check_id, check_one_of, check_range, check_subject,
                                check_tokens, check_window_mask, check_worker, require)
from shared.wire_validation import MAX_MESSAGE_BYTES, WireModel, wire_field, wire_message

MAX_PROMPT_TOKENS = 1_000_000
MAX_GENERATOR_STATE_BYTES = 16 << 10  # a CPU torch.Generator's state is 5,056 bytes
DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
          "int64", "int32", "int16", "int8", "uint8")


class _SamplingChecks:
    """Rules shared by the internal requests that carry a prompt and sampling for one request."""
    __slots__ = ()

    def _check_common(self) -> None:
        check_id("request_id", self.request_id)
        check_id("cache_salt", self.cache_salt, allow_empty=True)
        check_id("retention", self.retention)
        check_tokens("prompt_token_ids", self.prompt_token_ids)
        check_tokens("prior_output_ids", getattr(self, "prior_output_ids", []), allow_empty=True)
        require(len(self.prompt_token_ids) + len(getattr(self, "prior_output_ids", [])) <= MAX_PROMPT_TOKENS,
                f"fields 'prompt_token_ids' + 'prior_output_ids': more than {MAX_PROMPT_TOKENS} tokens")
        check_subject("reply_to", self.reply_to)
        check_fingerprint("model_fingerprint", self.model_fingerprint)
        if self.router_id:
            check_worker("router_id", self.router_id)
        check_id("router_instance", self.router_instance, allow_empty=not self.router_id)


@wire_message(MAX_MESSAGE_BYTES)  # carries the whole prompt: whatever fits a GenerateRequest must fit here
class PrefillRequest(WireModel, _SamplingChecks):
    """Router -> prefill worker: prefill, sample the first token, hand the KV to ``decode_worker``. A worker of
    another build than ``model_fingerprint`` refuses it (``model_mismatch``; "" = any build)."""
    request_id: str
    prompt_token_ids: list[int] = wire_field(max_len=MAX_PROMPT_TOKENS)
    sampling: SamplingParams
    decode_worker: str
    transport: str
    reply_to: str                   # subject receiving TokenChunks
    cache_salt: str = ""
    deadline_s: float               # seconds remaining (may be <= 0: the receiver replies ``timeout``)
    retention: str = NO_RETENTION         # cache retention class of the request (tier write-back and pulls)
    model_fingerprint: str = ""     # the build the router placed it for (shared/model/fingerprint.py)
    router_id: str = ""             # the router relaying the stream ("" = none watched; services/worker/router_watch.py)
    router_instance: str = ""       # that router process's LoadReport.instance: another one = the relay is gone
    # a continuation (failover, resume): the tokens the client already has; the engine computes their KV with the
    # prompt's and treats them as output (max_tokens, min_tokens, penalties and grammars count them)
    prior_output_ids: list[int] = wire_field(default_factory=list, max_len=MAX_PROMPT_TOKENS)

    def _check(self) -> None:
        self._check_common()
        check_worker("decode_worker", self.decode_worker)
        require(math.isfinite(self.deadline_s), "field 'deadline_s': must be finite")


@wire_message(MAX_MESSAGE_BYTES)  # carries the whole prompt, like PrefillRequest
class KVHandoff(WireModel, _SamplingChecks):
    """Prefill worker -> decode worker: KV of ``num_blocks`` blocks of ``block_shape`` / ``dtype``, computed by
    the build ``model_fingerprint``, is available through ``transport`` / ``handle``; decoding continues after
    ``first_token``. A decode worker of another build (or a hand-off naming none) refuses it before fetching
    anything (``model_mismatch``: the router re-places the request).

    Live migration (decode worker -> decode worker) is the same message for a stream already under way: the KV
    covers ``prompt_token_ids + prior_output_ids``, ``first_token`` is the newest output token (no KV yet), the
    target's first chunk is ``first_seq`` and a seeded request's sampler continues from ``generator_state``; the
    payload holds the blocks from ``first_block`` on (the ones before reached the target's prefix cache by a
    ``KVPrecopy`` while the source kept decoding; a target that no longer holds them refuses the hand-off)."""
    request_id: str
    prompt_token_ids: list[int] = wire_field(max_len=MAX_PROMPT_TOKENS)
    first_token: int
    sampling: SamplingParams
    reply_to: str
    cache_salt: str
    num_blocks: int
    block_shape: list[int]          # ONE block, e.g. [num_layers, 2, block_size, kv_heads, head_dim]
    dtype: str                      # torch dtype name without "torch.", e.g. "float32"
    transport: str
    handle: dict[str, Any]          # transport-specific
    num_cached_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_worker: str = ""
    retention: str = NO_RETENTION
    tier_cached_tokens: int = 0     # of num_cached_tokens, pulled from the cache tier
    model_fingerprint: str = ""     # the prefill worker's build ("" from older senders: refused)
    deadline_s: float = 3600.0      # seconds left of the request's deadline (the PrefillRequest's, less prefill)
    router_id: str = ""             # as in PrefillRequest, forwarded
    router_instance: str = ""
    prior_output_ids: list[int] = wire_field(default_factory=list, max_len=MAX_PROMPT_TOKENS)  # migration
    generator_state: bytes = b""    # a seeded request's sampler state after its last draw ("" = fresh)
    first_seq: int = 1              # seq of the first chunk this hand-off's decode worker publishes
    first_block: int = 0            # the payload starts at this block: the ones before were pre-copied
    window_mask: bytes = b""        # which blocks carry their window layers' rows (shared/kv/block_pack.py)

    def _check(self) -> None:
        self._check_common()
        check_range("first_token", self.first_token, 0)
        check_tokens("prior_output_ids", self.prior_output_ids, allow_empty=True)
        require(len(self.prompt_token_ids) + len(self.prior_output_ids) <= MAX_PROMPT_TOKENS,
                 f"fields 'prompt_token_ids' + 'prior_output_ids': more than {MAX_PROMPT_TOKENS} tokens")
        require(len(self.generator_state) <= MAX_GENERATOR_STATE_BYTES,
                 f"field 'generator_state': more than {MAX_GENERATOR_STATE_BYTES} bytes")
        check_range("first_seq", self.first_seq, 1)
        check_range("first_block", self.first_block, 0)
        check_range("num_blocks", self.num_blocks, 0)
        check_window_mask(self.window_mask, self.num_blocks)
        require(bool(self.block_shape) and min(self.block_shape) > 0,
                 "field 'block_shape': must be a non-empty list of positive ints")
        check_one_of("dtype", self.dtype, DTYPES)
        require(bool(self.transport), "field 'transport': must not be empty")
        check_range("num_cached_tokens", self.num_cached_tokens, 0,
                    len(self.prompt_token_ids) + len(self.prior_output_ids))
        check_range("tier_cached_tokens", self.tier_cached_tokens, 0, self.num_cached_tokens)
        check_range("ttft_ms", self.ttft_ms, 0.0)
        require(math.isfinite(self.deadline_s), "field 'deadline_s': must be finite")
        if self.prefill_worker:
            check_worker("prefill_worker", self.prefill_worker)


@wire_message(MAX_MESSAGE_BYTES)
class KVPrecopy(WireModel):
    """Decode worker -> decode worker, the pre-copy of a live migration while the source keeps decoding: the
    KV of the first ``num_blocks`` full blocks of ``token_ids`` (the stream's prompt + outputs so far, salted with
    ``cache_salt``, computed by ``model_fingerprint``) is available through ``transport`` / ``handle``; the
    target puts them in its prefix cache and answers an ``Ack`` whose ``detail`` is how many it kept."""
    request_id: str
    token_ids: list[int] = wire_field(max_len=MAX_PROMPT_TOKENS)
    cache_salt: str
    num_blocks: int
    block_shape: list[int]
    dtype: str
    transport: str
    handle: dict[str, Any]
    model_fingerprint: str
    window_mask: bytes = b""        # as in KVHandoff

    def _check(self) -> None:
        check_id("request_id", self.request_id)
        check_id("cache_salt", self.cache_salt, allow_empty=True)
        check_tokens("token_ids", self.token_ids)
        check_range("num_blocks", self.num_blocks, 1)
        check_window_mask(self.window_mask, self.num_blocks)
        require(bool(self.block_shape) and min(self.block_shape) > 0,
                 "field 'block_shape': must be a non-empty list of positive ints")
        check_one_of("dtype", self.dtype, DTYPES)
        require(bool(self.transport), "field 'transport': must not be empty")
        check_fingerprint("model_fingerprint", self.model_fingerprint)


@wire_message(MAX_MESSAGE_BYTES)
class DecodeLocalRequest(WireModel, _SamplingChecks):
    """Router -> decode worker: prefill locally (conditional disaggregation), then decode (``model_fingerprint``
    as in ``PrefillRequest``)."""
    request_id: str
    prompt_token_ids: list[int] = wire_field(max_len=MAX_PROMPT_TOKENS)
    sampling: SamplingParams
    reply_to: str
    cache_salt: str = ""
    deadline_s: float = 60.0        # seconds remaining (may be <= 0: the worker ends it with ``timeout``)
    retention: str = NO_RETENTION
    model_fingerprint: str = ""
    router_id: str = ""             # as in PrefillRequest
    router_instance: str = ""
    prior_output_ids: list[int] = wire_field(default_factory=list, max_len=MAX_PROMPT_TOKENS)  # as in PrefillRequest

    def _check(self) -> None:
        self._check_common()
        require(math.isfinite(self.deadline_s), "field 'deadline_s': must be finite")
