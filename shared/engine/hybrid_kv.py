"""SWA-aware KV: full-attention layers and sliding-window layers keep their KV in two pools (KV groups).

The full group (``full``) holds every token's KV for the full-attention layers; the window group (``win``) holds
the window layers' KV only for the tokens a future query can still see. Both use the same block size and the
same logical block index (block ``i`` = tokens ``[i * bs, (i + 1) * bs)``); each request has one block table per
group. The window table's slots ``[0, drop)`` point at the window pool's null block (``BlockManager``'s
``reserve_null``), where ``drop = max(0, (b0 - window + 1) // bs)``, ``b0 = (q0 // bs) * bs`` is the block boundary
at or before ``q0``, and ``q0`` is the first position any query of this request will still compute
(``num_computed_tokens`` when a step is scheduled: this step's tokens and its drafted tokens all lie at or after
it; a rejected draft never moves it back below). A query at position ``p`` sees keys ``(p - window, p]``, so no
query reads a released block: the window mask skips every null slot. Keeping the window of ``b0`` rather than of
``q0`` (at most one block more, inside the bound below) means a request always holds the window rows a prefix hit
on its own full blocks needs, so its write-back to the cache tier can be hit by the next turn.
``window`` is the largest window of the model's window layers. A running sequence holds at most
``window_blocks_per_seq(window, bs, n)`` window blocks while it computes ``n`` tokens in a step (decoding:
``ceil((window - 1) / bs) + 1``).

Prefix-cache hit rule: a hit of ``n`` leading blocks needs the full group's blocks ``0..n-1`` all cached and
the window group's blocks ``lo..n-1`` cached, ``lo = drop(q0)`` with ``q0 = n * bs``
(the window of the first query after the hit); the engine takes the largest such ``n``. An import that writes
tokens up to ``q0 > n * bs`` itself (migration, hand-off) asks with that ``q0``. KV events and the router's KV
index carry the full group's hashes only (the window group's are internal; a hit decision is the engine's).

Sizing (``build_kv_manager``): a KV budget in bytes is split by ``pool_sizes`` for prompts of ``swa_kv_context``
tokens (default ``min(max_model_len, SWA_KV_CONTEXT)``): each pool gets the bytes such prompts need in it, so a
worker's prefix cache holds as many of their last windows as it holds their full blocks, and a repeat of one of
the last prompts that fit the full pool still hits. Sizing for ``max_model_len`` instead (32K for Gemma 3)
would leave the window pool room for the ends of only a few prompts (223 window blocks against 9,807 full ones
for Gemma 3 270M in 1 GiB): every other repeat would miss. A prefill leaves behind only its last window's rows
(released blocks are reused first: ``BlockManager``), and a tier import evicted before its request is admitted
is published again (``Scheduler``). ``--swa-kv-context`` sizes for longer prompts (more full blocks each).

Capacity: a request fits only when both pools have room; ``allocate_slots`` checks both before changing either,
so nothing is ever left half-allocated. ``usage`` is the fuller pool's; ``num_free_blocks`` expresses that
pressure in full-group blocks (tokens / block_size), the unit routers compare with a prompt's length.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from shared.engine.block_manager import BlockManager
from shared.engine.kv_manager import EventSink, ImportedBlocks, KVManager
from shared.engine.request import Request
from shared.engine.v4_kv import build_v4_manager

if TYPE_CHECKING:
    from shared.engine.config import EngineConfig
    from shared.model.llama import LlamaModel


class HybridHits:
    """Opaque prefix hit (``get_computed_blocks``): the full group's block ids and the window group's (the null
    block where the window cannot see), one per hit block."""
    __slots__ = ("full", "window")

    def __init__(self, full: list[int], window: list[int]) -> None:
        self.full, self.window = full, window

    def __len__(self) -> int:
        return len(self.full)


def window_blocks_per_seq(window: int, block_size: int, num_tokens: int = 1) -> int:
    """Window blocks a sequence holds at most while it computes ``num_tokens`` tokens in a step (``drop``'s
    rule: the window of the block boundary before its first query, up to its last token)."""
    return -(-(window - 1) // block_size) + (num_tokens + block_size - 2) // block_size + 1


def pool_sizes(kv_cache_bytes: int, full_block_bytes: int, window_block_bytes: int, context: int, window: int,
               block_size: int, min_window_blocks: int, step_tokens: int = 0) -> tuple[int, int]:
    """``(full blocks, window blocks)`` for ``kv_cache_bytes``. Rule: split the bytes in proportion to what one
    sequence of ``context`` tokens needs in each pool (``ceil(context / bs)`` full blocks, ``min(that,
    window_blocks_per_seq(window, bs))`` window blocks), so the pools run out together for sequences of that
    length. When windows save anything, the window pool first gets room for one step's new tokens
    (``ceil(step_tokens / bs) + 1`` blocks, at most a quarter of the bytes): sequences decoding at steady state
    hold only their windows, and a prefill chunk's window blocks would otherwise preempt them. The window pool is
    given at least ``min_window_blocks`` (one request's worst step: ``LLMEngine.validate`` refuses requests that
    could never fit), but that floor never takes more than half the bytes."""
    nf_seq = -(-context // block_size)
    nw_seq = min(nf_seq, window_blocks_per_seq(window, block_size))
    per_seq = nf_seq * full_block_bytes + nw_seq * window_block_bytes
    spike = 0
    if nw_seq < nf_seq and step_tokens > 0:
        spike = min(-(-step_tokens // block_size) + 1, kv_cache_bytes // 4 // max(1, window_block_bytes))
    seqs = (kv_cache_bytes - spike * window_block_bytes) / per_seq
    floor = min(min_window_blocks, kv_cache_bytes // 2 // max(1, window_block_bytes))
    num_window = max(floor, math.floor(seqs * nw_seq) + spike, 1)
    rest = kv_cache_bytes - num_window * window_block_bytes
    num_full = max(1, rest // full_block_bytes if full_block_bytes else math.floor(seqs * nf_seq))
    return int(num_full), int(num_window)


class HybridBlockManager(KVManager):
    """The ``KVManager`` over two KV groups (see the module docstring for the rules). ``max_step_tokens``: the
    most tokens one request computes in a step (``max_num_batched_tokens``), which bounds its window blocks."""

    def __init__(self, num_full_blocks: int, num_window_blocks: int, block_size: int, window: int,
                 enable_caching: bool = True, event_sink: EventSink | None = None,
                 max_step_tokens: int = 1) -> None:
        self.full = BlockManager(num_full_blocks, block_size, enable_caching, event_sink)
        self.win = BlockManager(num_window_blocks + 1, block_size, enable_caching, reserve_null=True)
        self.block_size, self.window, self.enable_caching = block_size, window, enable_caching
        self.max_step_tokens = max_step_tokens
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return self.win.num_blocks - 1

    @property
    def pool_sizes(self) -> list[int]:
        return [self.full.num_blocks, self.win.num_blocks]

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.win.usage)

    def pools(self) -> list[tuple[str, int, int]]:
        return [("full", self.full.num_blocks, len(self.full.free_queue)),
                ("window", self.num_window_blocks, len(self.win.free_queue))]

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_blocks - math.ceil(self.usage * self.full.num_blocks - 1e-9)

    @property
    def cached(self) -> dict[int, int]:
        return self.full.cached

    @property
    def event_sink(self):
        return self.full.event_sink

    @event_sink.setter
    def event_sink(self, sink) -> None:
        self.full.event_sink = sink

    def drop(self, q0: int) -> int:
        """Leading blocks released for a request whose queries start at ``q0``: none of them is seen by a query at
        a position ``>= q0`` nor by one at the block boundary before ``q0`` (a hit on its full blocks)."""
        return max(0, ((q0 // self.block_size) * self.block_size - self.window + 1) // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The full group's block table (the request's logical block names)."""
        return self.full.block_ids(request_id)

    def window_block_ids(self, request_id: str) -> list[int]:
        """The window group's block table (null block where released)."""
        return self.win.block_ids(request_id)

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [self.full.block_ids(request_id), self.win.block_ids(request_id)]

    def group_block_ids(self, request_id: str, ids: list[int], next_query: int | None = None) -> list[list[int]]:
        index = {b: i for i, b in enumerate(self.full.block_ids(request_id))}
        table = self.win.block_ids(request_id)
        lo = 0 if next_query is None else self.drop(next_query)
        return [list(ids), [table[index[b]] if index[b] >= lo else self.win.null for b in ids]]

    def accepts(self, has_window: list[bool] | None) -> bool:
        return True   # window rows are allocated only where the importer's window needs them

    def refuse(self, total: int) -> str | None:
        """Beyond the full pool's capacity: one prefill chunk and its window must fit in the window pool."""
        reason = self.full.refuse(total)
        need = min(-(-total // self.block_size),
                   window_blocks_per_seq(self.window, self.block_size, self.max_step_tokens))
        if reason is None and need > self.num_window_blocks:
            reason = (f"cannot run in the sliding-window KV pool of {self.num_window_blocks} blocks (one prefill "
                      "chunk and its window must fit: a larger KV budget or a smaller max_num_batched_tokens)")
        return reason

    def _largest_hit(self, request: Request, max_blocks: int, q0: int | None) -> HybridHits:
        full = self.full.lookup(request, max_blocks)
        win = [self.win.cached_block(request, i) for i in range(len(full))]
        for n in range(len(full), 0, -1):
            lo = min(self.drop(n * self.block_size if q0 is None else q0), n)
            if all(b is not None for b in win[lo:n]):
                return HybridHits(full[:n], [self.win.null] * lo + win[lo:n])
        return HybridHits([], [])

    def get_computed_blocks(self, request: Request, q0: int | None = None) -> tuple[HybridHits, int]:
        """Largest prefix hit under the hit rule: ``(hits, num_tokens)``; at least one token is left to compute.
        ``q0``: the first position a query will compute after the hit (default: the hit's end)."""
        if not self.enable_caching:
            return HybridHits([], []), 0
        hits = self._largest_hit(request, (request.num_tokens - 1) // self.block_size, q0)
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cached_prefix(self, request: Request) -> int:
        """How many leading blocks the hit rule would reuse now (read-only: no stats)."""
        return len(self._largest_hit(request, len(request.block_hashes), None))

    def pinned(self, request: Request, q0: int) -> int:
        """``q0``, or, for a request with a ``window_pin`` (the start of its prompt's last prefill chunk) decoding
        less than a window past its prompt, the pin: it keeps the window rows its prefill left (what a prefill
        worker's write-back carries) until its worker has copied the prompt for the tier and lifted the pin. A
        pin nobody lifts lapses a window after the prompt, so it costs at most ``ceil(window / bs)`` blocks more
        than the prefill held, briefly."""
        pin, prompt = request.window_pin, request.num_prompt_tokens
        return min(q0, pin) if pin is not None and prompt <= q0 < prompt + self.window else q0

    def prompt_end(self, request: Request) -> range:
        """The window blocks a repeat of the request's prompt needs (its hit of ``(prompt - 1) // bs`` blocks):
        released, they stay at the LRU tail; other released window blocks are reused first (``BlockManager``)."""
        n = (request.num_prompt_tokens - 1) // self.block_size
        return range(min(self.drop(n * self.block_size), n), n)

    def has_room(self, request: Request, total: int) -> bool:
        """Whether the request could grow to ``total`` tokens now (both pools)."""
        return (self.full.can_allocate(request, total)
                and self.win.can_allocate(request, total, (),
                                          self.drop(self.pinned(request, request.num_computed_tokens))))

    # -- mutations -------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hits: HybridHits | tuple = (),
                       q0: int | None = None) -> list[int] | None:
        """Room in both pools for ``num_new_tokens`` after ``num_computed_tokens`` plus the hit, or ``None`` and
        nothing changed. Window blocks before ``drop(q0)`` (``q0`` default: the first token computed now) are
        released / never allocated. Returns the full group's new block ids."""
        hits = hits if isinstance(hits, HybridHits) else HybridHits([], [])
        start = request.num_computed_tokens + len(hits) * self.block_size
        total = start + num_new_tokens
        if request.window_pin is not None and start < request.num_prompt_tokens:
            request.window_pin = start          # a prefill chunk: the pin follows it to the prompt's last one
        skip = self.drop(self.pinned(request, start) if q0 is None else q0)
        if not (self.full.can_allocate(request, total, hits.full)
                and self.win.can_allocate(request, total, hits.window, skip)):
            return None
        new_ids = self.full.allocate_slots(request, num_new_tokens, hits.full)
        ok = self.win.allocate_slots(request, num_new_tokens, hits.window, skip_before=skip,
                                     keep=self.prompt_end(request))
        assert new_ids is not None and ok is not None, "a pool ran out after its room was checked"
        return new_ids

    def import_cached(self, request: Request, first: int, count: int, has_window: list[bool]) -> ImportedBlocks:
        """Publish blocks ``[first, first + count)`` computed elsewhere (the cache tier, a pre-copy) as free cached
        blocks: full rows for those the full group lacks, window rows for those the window of the resulting hit
        needs and the payload carries (``has_window[j]`` for block ``first + j``; a source sends zeros for rows it
        released). ``num_blocks``: the hit rule's count afterwards."""
        f0 = min(max(first, self.full.cached_prefix(request)), first + count)
        f_ids = self.full.import_blocks(request, f0, first + count - f0)
        n = f0 + len(f_ids)
        w0 = max(first, min(self.drop(n * self.block_size), n))
        for j in range(w0, n):  # the window rows must run unbroken to n
            if not has_window[j - first]:
                w0 = j + 1
        while w0 < n and self.win.cached_block(request, w0) is not None:
            w0 += 1
        w_ids = self.win.import_blocks(request, w0, n - w0) if w0 < n else []
        rows = [[-1] * count, [-1] * count]
        for group, start, ids in ((0, f0, f_ids), (1, w0, w_ids)):
            rows[group][start - first:start - first + len(ids)] = ids
        return ImportedBlocks(rows, min(self.cached_prefix(request), first + count))

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        self.win.free(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        self.full.trim(request_id, num_tokens)
        self.win.trim(request_id, num_tokens)

    def publish_computed(self, request: Request, num_tokens: int) -> None:
        self.full.publish_computed(request, num_tokens)
        self.win.publish_computed(request, num_tokens)

    def withdraw_uncomputed(self, request: Request, num_tokens: int) -> None:
        self.full.withdraw_uncomputed(request, num_tokens)
        self.win.withdraw_uncomputed(request, num_tokens)

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.win.reset_prefix_cache()


SWA_KV_CONTEXT = 4096   # default prompt length the full/window split is sized for (``build_kv_manager``)


def min_window_blocks(window: int, block_size: int, max_step_tokens: int) -> int:
    """Window blocks one request may need in one step: a chunk of ``max_step_tokens`` plus its window."""
    return window_blocks_per_seq(window, block_size, max_step_tokens)


def build_kv_manager(model: LlamaModel, config: EngineConfig, max_model_len: int) -> KVManager:
    """The engine's ``KVManager``: DeepSeek V4's per-sequence states (``shared/engine/v4_kv.py``), one pool, or two
    KV groups when ``config.swa_kv`` and the model has window layers (pool sizes from ``config.num_kv_blocks``, or ``config.kv_cache_bytes`` split for prompts of
    ``config.swa_kv_context`` tokens, default ``min(max_model_len, SWA_KV_CONTEXT)``: see the module docstring)."""
    mc, bs = model.config, config.block_size
    if mc.v4 is not None:   # per-sequence states, no pools
        return build_v4_manager(mc, model.embed.element_size(), bs, config.kv_cache_bytes, config.num_kv_blocks,
                                config.enable_prefix_caching, model.new_state)
    layer_bytes = 2 * bs * mc.kv_cache_heads * mc.kv_cache_dim * model.embed.element_size()
    windows = [w for w in mc.layer_sliding_windows if w is not None]
    if not (config.swa_kv and windows):
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_bytes // (mc.num_layers * layer_bytes))
        return BlockManager(num_blocks, bs, config.enable_prefix_caching)
    window, step = max(windows), config.max_num_batched_tokens
    if config.num_kv_blocks is not None:
        num_full, num_window = config.num_kv_blocks, config.num_window_kv_blocks or config.num_kv_blocks
    else:
        min_window = min(min_window_blocks(window, bs, step), -(-max_model_len // bs))
        context = config.swa_kv_context or min(max_model_len, SWA_KV_CONTEXT)
        num_full, num_window = pool_sizes(config.kv_cache_bytes, (mc.num_layers - len(windows)) * layer_bytes,
                                          len(windows) * layer_bytes, context, window, bs, min_window, step)
    return HybridBlockManager(num_full, num_window, bs, window, config.enable_prefix_caching, max_step_tokens=step)
