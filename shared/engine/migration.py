"""Moving a running request between engines (live migration from one decode worker to another). Services use
the engine's methods built on these (``LLMEngine.detach``, ``reattach``, ``drop_detached``,
``import_running``).

Detach (source, between steps): a running request whose every token but the newest has KV (the state after any
decode step) leaves the batch with its blocks allocated; nothing else changes, so ``reattach`` puts it back
exactly as it was (a failed migration loses nothing) and ``drop_detached`` frees it once the target runs it.
``Detached`` carries everything the target needs to continue it as one stream: the tokens, the block ids
holding the KV of all but the newest token, and the seeded generator's state (the next draw on the target is
the draw the source would have made next).

Pre-copy (source still decoding): ``full_blocks`` names the blocks whose KV is final (every full, computed
block), ``holds_blocks`` confirms afterwards that nothing preempted the request while they were copied; the
target keeps them in its prefix cache (``kv_tier.import_tier_blocks``), and the stop-and-copy then ships only
the blocks from ``first_block`` on.

Import (target): ``import_running`` rebuilds the request from prompt + output tokens (the detokenizer is fed
the same tokens, so held-back bytes and stop-string windows are the source's), writes the KV of all but the
newest token (its own prefix-cache hits reused), restores the generator and joins the batch: the next step
decodes the newest token exactly as the source would have. A prefill hand-off is the special case of one
output token and a fresh generator. With no room for the blocks, it is queued for local recompute (same
tokens, more compute).

Invariants: a detached request is in ``engine.requests`` and ``engine.detached`` and in no scheduler queue;
``abort`` of a detached request frees its blocks like any other.
"""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from shared.engine import kv_io
from shared.engine.hybrid_kv import HybridBlockManager
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.protocol_work import MAX_GENERATOR_STATE_BYTES

if TYPE_CHECKING:
    from shared.engine.llm_engine import LLMEngine


@dataclasses.dataclass(frozen=True, slots=True)
class Detached:
    """What a target needs to continue a detached request: ``block_ids`` hold the KV of
    ``prompt_token_ids + output_token_ids[:-1]`` in order; ``generator_state`` is b"" for unseeded sampling."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    generator_state: bytes
    num_cached_tokens: int


def detach(engine: LLMEngine, request_id: str) -> Detached:
    """Take a running request out of the batch, blocks kept. ``invalid_request`` if it is not running, or not
    at a decode step boundary (queued, preempted, mid-prefill: there is no live KV to move)."""
    req = engine.requests.get(request_id)
    if req is None or request_id in engine.detached:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not running here")
    if (req.status != RequestStatus.RUNNING or req not in engine.scheduler.running or req.spec_token_ids
            or req.num_output_tokens < 1 or req.num_computed_tokens != req.num_tokens - 1):
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not decoding "
                             f"({req.num_computed_tokens}/{req.num_tokens} tokens computed)")
    engine.scheduler.remove(req, free_blocks=False)
    engine.detached[request_id] = req
    with_kv = req.num_tokens - 1
    ids = engine.block_manager.block_ids(request_id)[:-(-with_kv // engine.config.block_size)]
    state = bytes(req.generator.get_state().numpy().tobytes()) if req.generator is not None else b""
    return Detached(list(req.prompt_token_ids), list(req.output_token_ids), list(ids), state,
                    req.stats.num_cached_tokens)


def full_blocks(engine: LLMEngine, request_id: str) -> tuple[list[int], list[int], str]:
    """Pre-copy: ``(block ids, token ids, cache salt)``: a running request's computed full blocks (their KV
    never changes while it runs), all its tokens so far, and the salt its block hashes are chained with."""
    req = engine.requests.get(request_id)
    if req is None or req.status != RequestStatus.RUNNING or request_id in engine.detached:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not running here")
    full = min(req.num_computed_tokens, req.num_tokens - 1) // engine.config.block_size
    return list(engine.block_manager.block_ids(request_id)[:full]), list(req.all_token_ids), req.cache_salt


def holds_blocks(engine: LLMEngine, request_id: str, block_ids: list[int]) -> bool:
    """Whether the request still runs on exactly ``block_ids`` first (no preemption since ``full_blocks``: what
    was copied from them meanwhile is its KV)."""
    req = engine.requests.get(request_id)
    return (req is not None and req.status == RequestStatus.RUNNING
            and engine.block_manager.block_ids(request_id)[:len(block_ids)] == block_ids)


def reattach(engine: LLMEngine, request_id: str) -> None:
    """Put a detached request back into the batch as it was (the migration did not happen)."""
    req = engine.detached.pop(request_id, None)
    if req is None or engine.requests.get(request_id) is not req:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} is not detached here")
    engine.scheduler.running.append(req)


def drop_detached(engine: LLMEngine, request_id: str) -> None:
    """Forget a detached request that now runs elsewhere and free its blocks (hashed ones stay cached)."""
    req = engine.detached.pop(request_id, None)
    if req is None:
        return
    engine.requests.pop(request_id, None)
    engine.block_manager.free(request_id)
    req.status, req.finish_reason = RequestStatus.FINISHED, "migrated"
    if engine.speculator is not None:
        engine.speculator.finished(request_id)


def check_import(engine: LLMEngine, prompt_token_ids: list[int], output_token_ids: list[int],
                 params: SamplingParams, shape: list[int], dtype: str, model_fingerprint: str,
                 generator_state: bytes = b"", first_block: int = 0) -> None:
    """Raise unless a request of ``prompt_token_ids`` + ``output_token_ids`` (the KV of all but the newest
    token, from block ``first_block`` on, in a payload of ``shape`` / ``dtype``, computed by the build
    ``model_fingerprint``) can be imported here. Allocates and reads nothing."""
    from shared.engine.kv_handoff import check_model  # kv_handoff builds on this module
    from shared.engine.kv_io import block_shape

    check_model(engine, model_fingerprint, "the KV hand-off")
    engine.validate(prompt_token_ids, params)
    vocab = engine.model.config.vocab_size
    if not output_token_ids or len(output_token_ids) > params.max_tokens:
        raise invalid(f"{len(output_token_ids)} output tokens for max_tokens {params.max_tokens}")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in output_token_ids):
        raise invalid(f"output token ids (a hand-off's first_token) must be in [0, {vocab})")
    if len(generator_state) > MAX_GENERATOR_STATE_BYTES or (generator_state and params.seed is None):
        raise invalid("a generator state needs a seeded request and at most "
                      f"{MAX_GENERATOR_STATE_BYTES} bytes")
    with_kv = len(prompt_token_ids) + len(output_token_ids) - 1
    if not 0 <= first_block <= with_kv // engine.config.block_size:
        raise invalid(f"first_block {first_block} is not a full block of {with_kv} tokens")
    want = [-(-with_kv // engine.config.block_size) - first_block, *block_shape(engine)]
    have_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
    if list(shape) != want or dtype != have_dtype:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"KV payload {list(shape)} {dtype} does not match this "
                             f"engine's {want} {have_dtype} for {with_kv} tokens")


def import_running(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                   params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                   model_fingerprint: str, generator_state: bytes = b"", first_block: int = 0,
                   has_window: list[bool] | None = None) -> bool:
    """Admit a request that ran elsewhere: True if its KV was used, False if it was queued for local recompute
    (no room). ``kv: [ceil((len(prompt) + len(outputs) - 1) / block_size) - first_block, L, 2, kvh,
    block_size, D]``: the blocks before ``first_block`` must be in this engine's prefix cache (pre-copied),
    else ``transfer_failed`` and nothing changes. ``has_window`` (per payload block, from its packed form): an
    engine without KV groups recomputes instead of taking blocks that lack window rows (its prefix cache would
    serve them whole to later requests)."""
    if request_id in engine.requests:
        raise invalid(f"duplicate request id {request_id!r}")
    bs = engine.config.block_size
    check_import(engine, prompt_token_ids, output_token_ids, params, list(kv.shape),
                 str(kv.dtype).removeprefix("torch."), model_fingerprint, generator_state, first_block)
    req = Request(request_id, prompt_token_ids, params, block_size=bs, model_fingerprint=engine.fingerprint,
                  cache_salt=cache_salt)
    req.hold_kv = hold_kv
    if generator_state:
        state = torch.frombuffer(bytearray(generator_state), dtype=torch.uint8)
        try:
            req.generator.set_state(state)
        except RuntimeError as err:
            raise invalid(f"bad generator state: {err}") from None
    if engine.tokenizer is not None:
        req.detokenizer = engine.tokenizer.incremental_decoder()
    req.stats.first_token_time = req.stats.arrival_time
    for token in output_token_ids:   # the source's own rule (LLMEngine._append_one): stop tokens are not fed
        req.append_token(token)
        req.stats.token_times.append(req.stats.arrival_time)
        is_stop = (token in engine.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
        if req.detokenizer is not None and not is_stop:
            req.output_text += req.detokenizer.feed(token)
    with_kv = req.num_tokens - 1
    bm, sched = engine.block_manager, engine.scheduler
    groups = {"q0": with_kv} if isinstance(bm, HybridBlockManager) else {}  # window blocks: only what it will see
    hits, _ = bm.get_computed_blocks(req, **groups)
    if len(hits) < first_block:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"{first_block} pre-copied blocks expected in the prefix "
                             f"cache, {len(hits)} found (evicted since)")
    engine.requests[request_id] = req
    new_ids = None
    whole = isinstance(bm, HybridBlockManager) or has_window is None or all(has_window)
    if whole and len(sched.running) < sched.max_num_seqs:
        new_ids = bm.allocate_slots(req, with_kv - len(hits) * bs, hits, **groups)
    if new_ids is None:
        sched.add(req)  # recompute locally when there is room; exact, just slower
        return False
    kv_io.write(engine, request_id, len(hits), kv[len(hits) - first_block:])  # the payload's blocks this cache lacks
    req.num_computed_tokens = with_kv
    req.status = RequestStatus.RUNNING
    req.stats.first_scheduled_time = time.perf_counter()
    req.stats.num_cached_tokens = len(hits) * bs
    sched.running.append(req)
    return True
