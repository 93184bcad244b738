"""Moving a prefilled request's KV between engines (prefill worker → decode worker). Services use the
engine's methods built on these (``LLMEngine.prompt_block_ids``, ``check_handoff``, ``import_prefilled``).

Export (prefill side): a request added with ``hold_kv=True`` and ``max_tokens=1`` finishes after its first
token with its blocks still allocated; ``prompt_block_ids`` names the blocks that hold the prompt's KV
(a transport stages them straight from the cache) and ``export_kv`` copies them into one contiguous tensor
``[num_blocks, L, 2, kvh, block_size, D]``; ``LLMEngine.release_held`` then frees them.

Check (decode side, before any allocation or fetch): ``check_handoff`` rejects KV computed by another model
build (its ``model_fingerprint`` is not this engine's, or missing: ``model_mismatch``), a first token outside
the vocabulary (``invalid_request``) and a payload whose shape or dtype is not this engine's layout for the
prompt (``transfer_failed``), so one bad hand-off never reaches a batch and foreign KV is never served.

Import (decode side): ``import_prefilled`` creates the request with ``prompt + [first_token]`` as its tokens,
reuses the decode engine's own prefix-cache hits, writes the remaining blocks from the payload and marks the
prompt as computed, so the next step decodes the first token exactly as the monolithic engine would. With
no room for the blocks, the request is queued for local recompute instead (same tokens, more compute):
work is never lost.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode, invalid

if TYPE_CHECKING:
    from shared.engine.llm_engine import LLMEngine


def prompt_block_ids(engine: LLMEngine, request_id: str) -> list[int]:
    """The blocks holding a held (``hold_kv``) request's prompt KV, in prompt order."""
    req = engine.held.get(request_id)
    if req is None:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
    num_blocks = -(-req.num_prompt_tokens // engine.config.block_size)
    return engine.block_manager.block_ids(request_id)[:num_blocks]


def export_kv(engine: LLMEngine, request_id: str) -> torch.Tensor:
    """``[num_prompt_blocks, L, 2, kvh, block_size, D]`` copy of a held request's prompt KV."""
    ids = prompt_block_ids(engine, request_id)
    return engine.kv_cache[torch.tensor(ids, dtype=torch.long, device=engine.model.device)]


def block_shape(engine: LLMEngine) -> list[int]:
    """Shape of one KV block: ``[L, 2, kvh, block_size, D]``."""
    return list(engine.kv_cache.shape[1:])


def check_model(engine: LLMEngine, model_fingerprint: str, what: str, allow_any: bool = False) -> None:
    """Raise ``model_mismatch`` unless ``model_fingerprint`` is this engine's (``allow_any``: or empty, for work
    that carries tokens only, from a sender that names no build). ``what`` names the message in the error."""
    if model_fingerprint == engine.fingerprint or (allow_any and not model_fingerprint):
        return
    raise DeepinferError(ErrorCode.MODEL_MISMATCH, f"{what} is for model build {model_fingerprint or '(unnamed)'}"
                         f"; this worker serves {engine.model.config.model_id} build {engine.fingerprint}")


def check_handoff(engine: LLMEngine, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                  shape: list[int], dtype: str, model_fingerprint: str) -> None:
    """Raise unless a hand-off of ``prompt_token_ids`` + ``first_token`` whose payload is ``shape`` /
    ``dtype`` (torch name without ``torch.``), computed by the build ``model_fingerprint``, can be imported
    here. Allocates and reads nothing."""
    check_model(engine, model_fingerprint, "the KV hand-off")
    engine.validate(prompt_token_ids, params)
    vocab = engine.model.config.vocab_size
    if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < vocab:
        raise invalid(f"first_token {first_token!r} is not in [0, {vocab})")
    want = [-(-len(prompt_token_ids) // engine.config.block_size), *block_shape(engine)]
    have_dtype = str(engine.kv_cache.dtype).removeprefix("torch.")
    if list(shape) != want or dtype != have_dtype:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"KV payload {list(shape)} {dtype} does not match this "
                             f"engine's {want} {have_dtype} for a {len(prompt_token_ids)}-token prompt")


def import_prefilled(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], first_token: int,
                     params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                     model_fingerprint: str) -> bool:
    """Admit a request prefilled elsewhere by the build ``model_fingerprint`` (another build's KV raises
    ``model_mismatch``). Returns True if its KV was used, False if it was queued for local recompute (no room).
    ``kv: [ceil(len(prompt)/block_size), L, 2, kvh, block_size, D]``.
    ``hold_kv``: keep its blocks after it finishes (for write-back; see ``LLMEngine.release_held``)."""
    if request_id in engine.requests:
        raise invalid(f"duplicate request id {request_id!r}")
    bs = engine.config.block_size
    check_handoff(engine, prompt_token_ids, first_token, params, list(kv.shape),
                  str(kv.dtype).removeprefix("torch."), model_fingerprint)
    req = Request(request_id, prompt_token_ids, params, block_size=bs, model_fingerprint=engine.fingerprint,
                  cache_salt=cache_salt)
    req.hold_kv = hold_kv
    if engine.tokenizer is not None:
        req.detokenizer = engine.tokenizer.incremental_decoder()
    req.stats.first_token_time = req.stats.arrival_time
    req.stats.token_times.append(req.stats.arrival_time)
    req.append_token(first_token)
    if req.detokenizer is not None:
        req.output_text = req.detokenizer.feed(first_token)
    engine.requests[request_id] = req
    bm, sched = engine.block_manager, engine.scheduler
    hits, num_cached = bm.get_computed_blocks(req)
    num_cached = min(num_cached, len(prompt_token_ids))
    hits = hits[:num_cached // bs]
    new_ids = None
    if len(sched.running) < sched.max_num_seqs:
        new_ids = bm.allocate_slots(req, len(prompt_token_ids) - len(hits) * bs, hits)
    if new_ids is None:
        sched.add(req)  # recompute locally when there is room; exact, just slower
        return False
    kv_cache = engine.kv_cache
    kv_cache[torch.tensor(new_ids, dtype=torch.long, device=kv_cache.device)] = kv[len(hits):].to(kv_cache)
    req.num_computed_tokens = len(prompt_token_ids)
    req.status = RequestStatus.RUNNING
    req.stats.first_scheduled_time = time.perf_counter()
    req.stats.num_cached_tokens = len(hits) * bs
    sched.running.append(req)
    return True
