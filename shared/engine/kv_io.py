"""The engine's KV pools as services see them: logical blocks ``[L, 2, kvh, block_size, D]`` named by the
request's full-group block ids, whatever the physical layout (one tensor, or SWA-aware KV groups:
``shared/engine/hybrid_kv.py``).

Invariants:
- On the wire and in the cache tier a run of blocks is a packed run (``shared/kv/block_pack.py``): every block's
  full-attention rows, and a window layer's rows only for the blocks whose window the source still held; a
  source without KV groups sends whole logical blocks (empty mask). An importer unpacks to logical blocks (rows
  that did not travel read as zeros) and never reads a missing row: it allocates window blocks only where its
  window needs them, and a prefix-cache import takes window rows only from blocks that carry them.
- ``source(engine, request_id, ids)`` is what a transport stages: the cache itself and ``ids`` (no copy) for a
  single pool; a packed copy and ``range(rows)`` with KV groups. Call it on the engine thread: the copy then is
  the blocks' content at one instant between steps.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.config import EngineConfig
from shared.engine.hybrid_kv import HybridBlockManager, pool_sizes, window_blocks_per_seq
from shared.kv import block_pack
from shared.model.kv_cache import KVGroups

if TYPE_CHECKING:
    from shared.engine.llm_engine import LLMEngine
    from shared.model.llama import LlamaModel


def build_block_manager(model: LlamaModel, config: EngineConfig,
                        max_model_len: int) -> BlockManager | HybridBlockManager:
    """One pool, or two KV groups when ``config.swa_kv`` and the model has window layers."""
    mc, bs = model.config, config.block_size
    layer_bytes = 2 * bs * mc.num_kv_heads * mc.head_dim * model.embed.element_size()
    windows = [w for w in mc.layer_sliding_windows if w is not None]
    if not (config.swa_kv and windows):
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // (mc.num_layers * layer_bytes))
        return BlockManager(num_blocks, bs, config.enable_prefix_caching)
    window = max(windows)
    if config.num_kv_blocks is not None:
        num_full, num_window = config.num_kv_blocks, config.num_window_kv_blocks or config.num_kv_blocks
    else:
        min_window = min(min_window_blocks(config, window), -(-max_model_len // bs))
        num_full, num_window = pool_sizes(config.kv_cache_bytes, (mc.num_layers - len(windows)) * layer_bytes,
                                          len(windows) * layer_bytes, config.swa_kv_context or max_model_len,
                                          window, bs, min_window, config.max_num_batched_tokens)
    return HybridBlockManager(num_full, num_window, bs, window, config.enable_prefix_caching)


def min_window_blocks(config: EngineConfig, window: int) -> int:
    """Window blocks one request may need in one step: a chunk of ``max_num_batched_tokens`` plus its window."""
    return window_blocks_per_seq(window, config.block_size, config.max_num_batched_tokens)


def window_fits(engine: LLMEngine, total: int) -> bool:
    """Whether a request of ``total`` tokens can ever run in the window pool (always true with one pool)."""
    bm = engine.block_manager
    if not isinstance(bm, HybridBlockManager):
        return True
    need = min(-(-total // bm.block_size), min_window_blocks(engine.config, bm.window))
    return need <= bm.num_window_blocks


def block_shape(engine: LLMEngine) -> list[int]:
    """Shape of one logical block: ``[L, 2, kvh, block_size, D]``."""
    kv = engine.runner.kv_cache
    return list(kv.block_shape) if isinstance(kv, KVGroups) else list(kv.shape[1:])


def block_bytes(engine: LLMEngine) -> int:
    shape = block_shape(engine)
    return int(torch.Size(shape).numel()) * engine.runner.kv_cache.dtype.itemsize


def _window_ids(engine: LLMEngine, request_id: str, ids: list[int]) -> list[int]:
    bm = engine.block_manager
    index = {b: i for i, b in enumerate(bm.block_ids(request_id))}
    table = bm.window_block_ids(request_id)
    return [table[index[b]] for b in ids]


def gather(engine: LLMEngine, request_id: str, ids: list[int]) -> torch.Tensor:
    """``[n, L, 2, kvh, bs, D]`` copy of the request's blocks ``ids`` (full-group ids from its table)."""
    kv = engine.runner.kv_cache
    if isinstance(kv, KVGroups):
        return kv.gather(list(ids), _window_ids(engine, request_id, list(ids)))
    return kv[torch.tensor(list(ids), dtype=torch.long, device=kv.device)]


def window_layers(engine: LLMEngine) -> list[int]:
    """The model's sliding-window layers (the rows a packed block may leave out)."""
    return [i for i, w in enumerate(engine.model.config.layer_sliding_windows) if w is not None]


def full_layers(engine: LLMEngine) -> int:
    """Layer rows of a packed block without its window rows (``shared/kv/block_pack.py``)."""
    return engine.model.config.num_layers - len(window_layers(engine))


def source(engine: LLMEngine, request_id: str, ids: list[int],
           next_query: int | None = None) -> tuple[torch.Tensor, list[int], bytes]:
    """``(cache, rows, window_mask)`` a transport stages the request's blocks ``ids`` from (``stage_blocks(cache,
    rows)``): the cache itself, ``ids`` and ``b""`` for a single pool (no copy); with KV groups a packed run
    (``KVGroups.gather_packed``), ``range(rows)`` and its mask. A block carries its window rows when the request
    still holds them and, with ``next_query`` (the position of the first query the importer will compute), when
    that query's window can see the block: a hand-off sends no row its receiver will not read. Call it on the
    engine thread (see the module docstring)."""
    kv = engine.runner.kv_cache
    if isinstance(kv, KVGroups):
        bm, ids = engine.block_manager, list(ids)
        index = {b: i for i, b in enumerate(bm.block_ids(request_id))}
        table = bm.window_block_ids(request_id)
        lo = 0 if next_query is None else bm.drop(next_query)
        window_ids = [table[index[b]] if index[b] >= lo else bm.win.null for b in ids]
        packed, has_window = kv.gather_packed(ids, window_ids)
        return packed, list(range(len(packed))), block_pack.encode_mask(has_window)
    return kv, list(ids), b""


def payload_shape(engine: LLMEngine, num_blocks: int, window_mask: bytes) -> list[int]:
    """The shape a payload of ``num_blocks`` packed blocks with ``window_mask`` has in this engine's layout
    (``[num_blocks, *block_shape]`` when the mask is empty); ``transfer_failed`` for a mask that cannot be."""
    if not window_mask:
        return [num_blocks, *block_shape(engine)]
    has_window = block_pack.decode_mask(window_mask, num_blocks)
    return block_pack.packed_shape(has_window, block_shape(engine), full_layers(engine))


def unpack(engine: LLMEngine, payload: torch.Tensor, num_blocks: int,
           window_mask: bytes) -> tuple[torch.Tensor, list[bool]]:
    """``(blocks [num_blocks, L, ...], has_window)`` of a fetched payload (``payload_shape``); rows that did not
    travel read as zeros, and ``has_window`` says which blocks carry theirs."""
    has_window = block_pack.decode_mask(window_mask, num_blocks)   # block_pack.unpack checks the shape
    return block_pack.unpack(payload, has_window, window_layers(engine), block_shape(engine)), has_window


def write(engine: LLMEngine, request_id: str, first: int, blocks: torch.Tensor) -> None:
    """Write logical blocks ``blocks: [n, L, ...]`` into the request's blocks ``first .. first + n - 1`` (window
    rows only where its window table holds a block)."""
    kv, bm, n = engine.runner.kv_cache, engine.block_manager, len(blocks)
    full = bm.block_ids(request_id)[first:first + n]
    if isinstance(kv, KVGroups):
        kv.scatter(full, bm.window_block_ids(request_id)[first:first + n], blocks)
    elif n:
        kv[torch.tensor(full, dtype=torch.long, device=kv.device)] = blocks.to(kv)
