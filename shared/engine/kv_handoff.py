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
work is never lost. It is ``shared/engine/migration.import_running`` with one output token.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.engine import kv_io
from shared.engine.migration import check_import, import_running
from shared.engine.sampling_params import SamplingParams
from shared.errors import DeepinferError, ErrorCode

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
    return kv_io.gather(engine, request_id, prompt_block_ids(engine, request_id))


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
    check_import(engine, prompt_token_ids, [first_token], params, shape, dtype, model_fingerprint)


def import_prefilled(engine: LLMEngine, request_id: str, prompt_token_ids: list[int], first_token: int,
                     params: SamplingParams, kv: torch.Tensor, cache_salt: str = "", hold_kv: bool = False, *,
                     model_fingerprint: str, has_window: list[bool] | None = None) -> bool:
    """Admit a request prefilled elsewhere by the build ``model_fingerprint`` (another build's KV raises
    ``model_mismatch``). Returns True if its KV was used, False if it was queued for local recompute (no room).
    ``kv: [ceil(len(prompt)/block_size), L, 2, kvh, block_size, D]``.
    ``hold_kv``: keep its blocks after it finishes (for write-back; see ``LLMEngine.release_held``)."""
    return import_running(engine, request_id, prompt_token_ids, [first_token], params, kv, cache_salt, hold_kv,
                          model_fingerprint=model_fingerprint, has_window=has_window)
