"""The engine's side of the cache tier: which prompt blocks it lacks, importing blocks pulled from the tier,
and naming a finished request's blocks for write-back. Workers call these through ``LLMEngine`` methods on
the engine thread (``AsyncEngine.call``), so no step runs in between.

Import: ``import_tier_blocks`` writes blocks ``[first, first + n)`` of a prompt into free blocks of the pool
and publishes them in the prefix cache (keys compared on every hit, like any cached block). The worker then
adds the request in the same engine command, so the scheduler's prefix lookup finds them before any
eviction could: a tier hit reports ``cached_tokens`` exactly like a local hit, and greedy output equals the
single-process engine's (the bytes are the KV that engine computed for the same tokens).

Write-back: ``tier_blocks`` names the full blocks of a held request whose KV is computed (prompt blocks
after prefill; prompt + output blocks when decoding finished), with their tokens and their ``BlockChain``
(keys, chained digests and this engine's model fingerprint: the tier serves a block only to a get that names
the same digest and fingerprint, so no other build's or prefix's KV comes back).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.engine.request import Request
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode
from shared.kv.block_hash import BlockChain
from shared.model.kv_cache import KVGroups

if TYPE_CHECKING:
    from shared.engine.llm_engine import LLMEngine

_SCRATCH_PARAMS = SamplingParams(max_tokens=1)


def scratch_request(engine: LLMEngine, prompt_token_ids: list[int], cache_salt: str) -> Request:
    """A request object used only for its block hashes and keys (never scheduled)."""
    return Request("~tier", prompt_token_ids, _SCRATCH_PARAMS, block_size=engine.config.block_size,
                   model_fingerprint=engine.fingerprint, cache_salt=cache_salt)


def reusable_blocks(engine: LLMEngine, prompt_token_ids: list[int]) -> int:
    """How many leading full blocks of a prompt a cache may supply: at least one token is always computed
    (its logits are needed), as in ``BlockManager.get_computed_blocks``."""
    return max(0, (len(prompt_token_ids) - 1) // engine.config.block_size)


def missing_blocks(engine: LLMEngine, prompt_token_ids: list[int], cache_salt: str) -> tuple[int, BlockChain]:
    """``(first, chain)``: the prompt's reusable blocks from index ``first`` on are not in the local prefix
    cache; ``chain`` names all its reusable blocks (what the tier is asked for)."""
    req = scratch_request(engine, prompt_token_ids, cache_salt)
    usable = reusable_blocks(engine, prompt_token_ids)
    first = min(engine.block_manager.cached_prefix(req), usable) if engine.config.enable_prefix_caching else usable
    return first, BlockChain.of(engine.fingerprint, req.block_digests[:usable])


def import_tier_blocks(engine: LLMEngine, prompt_token_ids: list[int], cache_salt: str, first: int,
                       kv: torch.Tensor, has_window: list[bool] | None = None) -> int:
    """Publish ``kv`` ([n, *block_shape]: blocks ``first .. first + n - 1`` of the prompt, unpacked; block ``j``
    carries its window layers' rows when ``has_window[j]``, default all) in the prefix cache. Returns how many
    of them a prefix lookup now reuses (the hit rule's count with KV groups: blocks whose full rows were
    imported but whose window the payload lacks do not count; fewer when the pool has no free room; 0 with
    prefix caching off). An engine without KV groups imports only the leading blocks that carry every layer."""
    want = [-1, *engine.kv_block_shape]
    if kv.dim() != len(want) or list(kv.shape[1:]) != want[1:] or kv.dtype != engine.kv_cache.dtype:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"tier KV {list(kv.shape)} {kv.dtype} does not match "
                             f"this engine's blocks {want[1:]} {engine.kv_cache.dtype}")
    has_window = [True] * int(kv.shape[0]) if has_window is None else list(has_window)
    if len(has_window) != kv.shape[0]:
        raise DeepinferError(ErrorCode.TRANSFER_FAILED, f"{len(has_window)} window flags for {kv.shape[0]} blocks")
    if not engine.config.enable_prefix_caching or kv.shape[0] == 0:
        return 0
    req = scratch_request(engine, prompt_token_ids, cache_salt)
    count = max(0, min(int(kv.shape[0]), reusable_blocks(engine, prompt_token_ids) - first))
    bm, groups = engine.block_manager, engine.runner.kv_cache
    if isinstance(groups, KVGroups):  # full rows where missing, window rows the resulting hit's window needs
        full, window, _ = bm.import_cached(req, first, count, has_window[:count])
        for pairs, part in ((full, 0), (window, 1)):
            if pairs:
                rows = torch.tensor([i - first for i, _ in pairs], dtype=torch.long, device=kv.device)
                ids = [b for _, b in pairs]
                groups.scatter(ids if part == 0 else [-1] * len(ids), ids if part else [0] * len(ids), kv[rows])
        return max(0, min(bm.cached_prefix(req), first + count) - first)
    if False in has_window[:count]:
        count = has_window.index(False)  # one pool: a block is usable only with every layer's rows
    ids = bm.import_cached(req, first, count)
    if ids:
        cache = engine.kv_cache
        cache[torch.tensor(ids, dtype=torch.long, device=cache.device)] = kv[:len(ids)].to(cache)
    return len(ids)


def tier_blocks(engine: LLMEngine, request_id: str, first: int,
                running: bool = False) -> tuple[list[int], BlockChain, list[int]]:
    """``(block_ids, chain, token_ids)`` of a held (or detached, migrating; with ``running`` also a running)
    request's computed full blocks from index ``first`` on; ``token_ids`` is flat, ``block_size`` per block. A
    running request's blocks change at the next step: copy them in the same engine command."""
    req = engine.held.get(request_id) or engine.detached.get(request_id) or \
        (engine.requests.get(request_id) if running else None)
    if req is None:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, f"request {request_id!r} holds no KV")
    bs = engine.config.block_size
    req.update_block_hashes()
    full = min(req.num_computed_tokens // bs, len(req.block_hashes))
    first = max(0, first)
    ids = engine.block_manager.block_ids(request_id)[first:full]
    chain = BlockChain.of(engine.fingerprint, req.block_digests[first:first + len(ids)])
    return ids, chain, req.all_token_ids[first * bs:(first + len(ids)) * bs]
