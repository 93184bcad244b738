"""Moving a prefilled request's KV between engines (prefill worker → decode worker).

Export (prefill side): a request added with ``hold_kv=True`` and ``max_tokens=1`` finishes after its first
token with its blocks still allocated; ``export_kv`` copies the blocks that hold the prompt's KV into one
contiguous tensor ``[num_blocks, L, 2, kvh, block_size, D]``; ``LLMEngine.release_held`` then frees them.

Import (decode side): ``import_prefilled`` creates the request with ``prompt + [first_token]`` as its tokens,
reuses the decode engine's own prefix-cache hits, writes the remaining blocks from the payload and marks the
prompt as computed, so the next step decodes the first token exactly as the monolithic engine would. With
no room for the blocks, the request is queued for local recompute instead (same tokens, more compute):
work is never lost.
"""
from __future__ import annotations

import time

import torch

from shared.engine.llm_engine import LLMEngine
from shared.engine.request import Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode, invalid


def export_kv(engine: LLMEngine, request_id: str) -> torch.Tensor:
    """``[num_prompt_blocks, L, 2, kvh, block_size, D]`` copy of a held request's prompt KV."""
    req = engine.held.get(request_id)
    if req is None:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
    num_blocks = -(-req.num_prompt_tokens // engine.config.block_size)
    ids = engine.block_manager.block_ids(request_id)[:num_blocks]
    return engine.runner.kv_cache[torch.tensor(ids, dtype=torch.long, device=engine.model.device)]


def block_shape(engine: LLMEngine) -> list[int]:
    """Shape of one KV block: ``[L, 2, kvh, block_size, D]``."""
    return list(engine.runner.kv_cache.shape[1:])


def import_prefilled(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], first_token: int,
                     params: SamplingParams, kv: torch.Tensor, cache_salt: str = "") -> bool:
    """Admit a request prefilled elsewhere. Returns True if its KV was used, False if it was queued for
    local recompute (no room). ``kv: [ceil(len(prompt)/block_size), L, 2, kvh, block_size, D]``."""
    if request_id in engine.requests:
        raise invalid(f"duplicate request id {request_id!r}")
    engine.validate(prompt_token_ids, params)
    bs = engine.config.block_size
    num_blocks = -(-len(prompt_token_ids) // bs)
    if list(kv.shape) != [num_blocks, *block_shape(engine)]:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"KV payload shape {list(kv.shape)} does not match "
                             f"[{num_blocks}, *{block_shape(engine)}]")
    req = Request(request_id, prompt_token_ids, params, block_size=bs, model_id=engine.model.config.model_id,
                  cache_salt=cache_salt)
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
    kv_cache = engine.runner.kv_cache
    kv_cache[torch.tensor(new_ids, dtype=torch.long, device=kv_cache.device)] = kv[len(hits):].to(kv_cache)
    req.num_computed_tokens = len(prompt_token_ids)
    req.status = RequestStatus.RUNNING
    req.stats.first_scheduled_time = time.perf_counter()
    req.stats.num_cached_tokens = len(hits) * bs
    sched.running.append(req)
    return True
