"""Paged KV block manager with prefix caching.

Invariants:
- A block is either held (``ref_cnt > 0``, owned by one or more requests) or in ``free_queue``
  (``ref_cnt == 0``), never both.
- ``free_queue`` (a ``FreeQueue``) is the eviction order: its head is reused first. Freed blocks that carry no
  hash go to the head (they are worthless); freed hashed blocks go to the tail (LRU), a request's tail blocks
  before its head blocks, so a shared prefix outlives the suffixes built on it.
- ``cached`` maps a block hash (its 64-bit key) to the one block holding it. A hit is confirmed by comparing the
  block's full key (its chained 256-bit digest, which covers every earlier token, the model fingerprint and the
  cache salt, and its token ids), never by the 64-bit hash alone: blocks whose hashes collide are never
  confused, the later one just is not cached (``shared/kv/block_hash.py``). Reusing a hashed free block drops
  its hash.
- ``allocate_slots`` returns ``None`` (caller must preempt or wait) and changes nothing when out of room.
- It is the one-group ``KVManager`` (``shared/engine/kv_manager.py``); layouts with several groups hold one per
  group.
- With ``reserve_null`` (the sliding-window pool of ``shared/engine/hybrid_kv.py``), block 0 is the null block:
  never allocated, never freed, never cached. A block-table slot holding it names a block whose KV was released
  (``release``: no query can see it any more) or never written (an import skipped it); attention's window mask
  never reads such a slot. ``usage`` and ``num_free_blocks`` count the other ``num_blocks - 1`` blocks.
  Released blocks stay cached; those outside ``keep`` (``release``) are queued as recycled: after the blank
  blocks, before every block freed with its request. A block a sequence's window slid past mid-prompt is
  needed only by a hit ending within a window of it, while the rows of the prompt's last window (``keep``)
  are what a repeat of the prompt needs, and go to the LRU tail as freed blocks do. A prompt's prefill thus
  reuses its own released blocks chunk after chunk and leaves its last window's rows behind, instead of
  cycling every block it passed through the pool and evicting other prompts' ends.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict

from shared.engine.kv_manager import EventSink, ImportedBlocks, KVManager
from shared.engine.request import Request

BlockKey = tuple[bytes, tuple[int, ...]]  # (chained digest, token ids)


class FreeQueue:
    """Free blocks (``ref_cnt == 0``) in eviction order: blank ones (no hash; the last one queued first), then
    recycled ones (released by a window mid-prompt: ``BlockManager.release``), oldest first, then the LRU
    (freed with their request, imported, or touched), least recently used first. Each block is in at most one
    part; every operation is O(1)."""
    __slots__ = ("blank", "recycled", "lru")

    def __init__(self, ids) -> None:
        self.blank: OrderedDict[int, None] = OrderedDict.fromkeys(ids)
        self.recycled: OrderedDict[int, None] = OrderedDict()
        self.lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.blank) + len(self.recycled) + len(self.lru)

    def __contains__(self, bid: int) -> bool:
        return bid in self.blank or bid in self.recycled or bid in self.lru

    def __iter__(self):
        return itertools.chain(self.blank, self.recycled, self.lru)

    def push_blank(self, bid: int) -> None:
        self.blank[bid] = None
        self.blank.move_to_end(bid, last=False)

    def push_recycled(self, bid: int) -> None:
        self.recycled[bid] = None

    def push_lru(self, bid: int) -> None:
        """Queue (or move) ``bid`` at the LRU tail: evicted last."""
        self.remove(bid)
        self.lru[bid] = None

    def remove(self, bid: int) -> None:
        for part in (self.blank, self.recycled, self.lru):
            if part.pop(bid, 0) is None:
                return

    def pop(self) -> int:
        """The next block to reuse (the caller checks ``len`` first)."""
        for part in (self.blank, self.recycled, self.lru):
            if part:
                return part.popitem(last=False)[0]
        raise IndexError("no free block")


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.key: BlockKey | None = None


def block_key(request: Request, index: int) -> BlockKey:
    """The full identity of the request's ``index``-th block (what a hash hit must match)."""
    bs = request.block_size
    return request.block_digests[index], tuple(request.all_token_ids[index * bs:(index + 1) * bs])


class BlockManager(KVManager):
    """One KV group: the plain paged cache (``KVManager``), and each pool of a layout with several groups."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 event_sink: EventSink | None = None, reserve_null: bool = False) -> None:
        """``event_sink(kind, hashes)`` hears every change of the prefix cache: "stored" when blocks are
        published, "removed" when evicted, "cleared" on reset (workers forward these as KV events)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self._num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null = 0 if reserve_null else -1  # the null block's id, or -1: none
        self.free_queue = FreeQueue(i for i in range(num_blocks) if i != self.null)
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_registered: dict[str, int] = {}  # request id -> how many of its blocks are hashed
        self.num_query_tokens = 0  # prefix-cache accounting: tokens looked up / found
        self.num_hit_tokens = 0
        self.event_sink = event_sink

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def pool_sizes(self) -> list[int]:
        return [self._num_blocks]

    @property
    def cached(self) -> dict[int, int]:
        return self._cached

    def pools(self) -> list[tuple[str, int, int]]:
        return [("kv", self.num_blocks - (self.null >= 0), len(self.free_queue))]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / (self.num_blocks - (self.null >= 0))

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    def block_tables(self, request_id: str) -> list[list[int]]:
        return [self.block_ids(request_id)]

    def group_block_ids(self, request_id: str, ids: list[int], next_query: int | None = None) -> list[list[int]]:
        return [list(ids)]

    def accepts(self, has_window: list[bool] | None) -> bool:
        return has_window is None or all(has_window)   # one pool: a block is usable only with every layer's rows

    def refuse(self, total: int) -> str | None:
        capacity = self.num_blocks * self.block_size
        return f"exceeds the KV cache capacity of {capacity} tokens" if total > capacity else None

    def get_computed_blocks(self, request: Request, q0: int | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of the request's full blocks: ``(block_ids, num_tokens)``.

        At least one token is always left to compute (its logits are needed), so a fully cached prompt
        reuses all blocks but the last full one.
        """
        if not self.enable_caching:
            return [], 0
        hits = self.lookup(request, (request.num_tokens - 1) // self.block_size)
        self.num_query_tokens += request.num_tokens
        self.num_hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cached_block(self, request: Request, index: int) -> int | None:
        """The cached block holding the request's ``index``-th full block (key confirmed), or None."""
        bid = self.cached.get(request.block_hashes[index])
        return bid if bid is not None and self.blocks[bid].key == block_key(request, index) else None

    def lookup(self, request: Request, max_blocks: int) -> list[int]:
        """The cached blocks of the request's leading full blocks, at most ``max_blocks`` (read-only)."""
        hits: list[int] = []
        for i in range(min(max_blocks, len(request.block_hashes))):
            bid = self.cached_block(request, i)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def can_allocate(self, request: Request, total: int, computed_blocks=(), skip_before: int = 0) -> bool:
        """Whether ``allocate_slots`` would find room for the request to hold ``total`` tokens (see there)."""
        held = self.req_to_blocks.get(request.request_id, [])
        first_new = len(held) + len(computed_blocks)
        need = max(0, -(-total // self.block_size) - max(first_new, skip_before))
        touched = sum(1 for b in computed_blocks if b != self.null and self.blocks[b].ref_cnt == 0)
        freed = sum(1 for b in held[:skip_before] if b != self.null and self.blocks[b].ref_cnt == 1)
        return need <= len(self.free_queue) - touched + freed

    def has_room(self, request: Request, total: int) -> bool:
        """Whether the request could grow to ``total`` tokens now."""
        return self.can_allocate(request, total)

    # -- mutations -------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, hits: list[int] | tuple[int, ...] = (),
                       q0: int | None = None, skip_before: int = 0, keep: range = range(0)) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens`` plus the ``hits``
        prefix. Returns the newly allocated block ids, or ``None`` if there is no room (nothing changed).
        ``skip_before`` (null-block pools only): the request's blocks before that index are never read again:
        held ones are released first (``release``'s ``keep``), new ones get the null block. ``q0`` is for layouts
        with windows."""
        computed_blocks = hits
        held = self.req_to_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        if not self.can_allocate(request, total, computed_blocks, skip_before):
            return None
        assert skip_before == 0 or self.null >= 0, "skip_before needs a null block"
        if skip_before:
            self.release(request.request_id, skip_before, keep)
        num_needed = -(-total // self.block_size) - len(held) - len(computed_blocks)
        held = self.req_to_blocks.setdefault(request.request_id, held)
        for bid in computed_blocks:
            if bid == self.null:
                held.append(bid)
                continue
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                self.free_queue.remove(bid)
            block.ref_cnt += 1
            held.append(bid)
        if computed_blocks:
            self.num_registered[request.request_id] = len(held)
        new_ids = []
        for index in range(len(held), len(held) + max(num_needed, 0)):
            if index < skip_before:
                held.append(self.null)
                continue
            bid = self.free_queue.pop()
            block = self.blocks[bid]
            if block.block_hash is not None:  # evict: the cached content is being overwritten
                if self.cached.get(block.block_hash) == bid:
                    del self.cached[block.block_hash]
                    if self.event_sink is not None:
                        self.event_sink("removed", [block.block_hash])
                block.block_hash, block.key = None, None
            block.ref_cnt = 1
            new_ids.append(bid)
            held.append(bid)
        if self.enable_caching:
            self._register_full_blocks(request, total // self.block_size)
        return new_ids

    def _register_full_blocks(self, request: Request, num_full: int) -> None:
        """Publish the request's blocks ``[num_registered, num_full)`` in the prefix cache. Their tokens are
        known now; their KV is written during this step before any attention reads it."""
        held = self.req_to_blocks[request.request_id]
        start = self.num_registered.get(request.request_id, 0)
        num_full = min(num_full, len(request.block_hashes))
        stored = []
        for i in range(start, num_full):
            if held[i] == self.null:
                continue
            h, block = request.block_hashes[i], self.blocks[held[i]]
            if h not in self.cached:
                self.cached[h] = block.block_id
                block.block_hash, block.key = h, block_key(request, i)
                stored.append(h)
        self.num_registered[request.request_id] = max(start, num_full)
        if stored and self.event_sink is not None:
            self.event_sink("stored", stored)

    def withdraw_uncomputed(self, request: Request, num_tokens: int) -> None:
        held = self.req_to_blocks.get(request.request_id, [])
        keep = num_tokens // self.block_size
        start = self.num_registered.get(request.request_id, 0)
        removed = []
        for i in range(keep, min(start, len(held))):
            block = self.blocks[held[i]] if held[i] != self.null else None
            if block is not None and block.block_hash is not None and block.ref_cnt == 1 \
                    and self.cached.get(block.block_hash) == block.block_id:   # this request's own, unread
                del self.cached[block.block_hash]
                removed.append(block.block_hash)
                block.block_hash, block.key = None, None
        if request.request_id in self.num_registered:
            self.num_registered[request.request_id] = min(start, keep)
        if removed and self.event_sink is not None:
            self.event_sink("removed", removed)

    def cached_prefix(self, request: Request) -> int:
        """How many leading full blocks of ``request`` the prefix cache holds now (read-only: no stats)."""
        return len(self.lookup(request, len(request.block_hashes)))

    def import_cached(self, request: Request, first: int, count: int, has_window: list[bool]) -> ImportedBlocks:
        """``KVManager.import_cached``: only the leading blocks that carry every layer's rows."""
        if False in has_window[:count]:
            count = has_window.index(False)
        rows = [-1] * count
        ids = self.import_blocks(request, first, count)
        rows[:len(ids)] = ids
        return ImportedBlocks([rows], first + len(ids))

    def import_blocks(self, request: Request, first: int, count: int) -> list[int]:
        """Make room for blocks ``[first, first + count)`` of ``request`` computed elsewhere (the cache tier)
        and publish them in the prefix cache as free cached blocks; the caller writes their KV before the
        next step. Returns the block ids, one per imported block (maybe fewer than ``count``: only free
        blocks are used, and the request's cached prefix ``[0, first)`` is never evicted to make room).

        The prefix blocks are touched first (moved to the LRU tail), the imported ones are queued behind
        them in chain order (the first block most recently used), exactly as ``free`` leaves a finished
        request's blocks."""
        prefix = [self.cached[h] for h in request.block_hashes[:first] if h in self.cached]
        for bid in reversed(prefix):
            if self.blocks[bid].ref_cnt == 0:
                self.free_queue.push_lru(bid)
        protected = sum(1 for b in prefix if self.blocks[b].ref_cnt == 0)
        count = max(0, min(count, len(request.block_hashes) - first, len(self.free_queue) - protected))
        ids, stored = [], []
        for i in range(first, first + count):
            h = request.block_hashes[i]
            if h in self.cached:  # already here (a race with another request): stop, keep the chain simple
                break
            bid = self.free_queue.pop()
            block = self.blocks[bid]
            if block.block_hash is not None and self.cached.get(block.block_hash) == bid:
                del self.cached[block.block_hash]
                if self.event_sink is not None:
                    self.event_sink("removed", [block.block_hash])
            block.block_hash, block.key = h, block_key(request, i)
            self.cached[h] = bid
            ids.append(bid)
            stored.append(h)
        for bid in reversed(ids):
            self.free_queue.push_lru(bid)   # free (ref 0) and cached, in chain order at the LRU tail
        for bid in reversed(prefix):
            if self.blocks[bid].ref_cnt == 0 and bid in self.free_queue:
                self.free_queue.push_lru(bid)
        if stored and self.event_sink is not None:
            self.event_sink("stored", stored)
        return ids

    def free(self, request_id: str) -> None:
        """Release the request's blocks (idempotent). Hashed blocks stay cached until evicted."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_registered.pop(request_id, None)
        for bid in reversed(blocks):
            if bid != self.null:
                self._unref(bid)

    def _unref(self, bid: int, recycled: bool = False) -> None:
        block = self.blocks[bid]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self.free_queue.push_blank(bid)
            elif recycled:
                self.free_queue.push_recycled(bid)
            else:
                self.free_queue.push_lru(bid)

    def release(self, request_id: str, num_blocks: int, keep: range = range(0)) -> None:
        """Null-block pools: point the request's table slots ``[0, num_blocks)`` at the null block and free what
        they held (no query of the request can see those tokens any more). Hashed blocks stay cached: those at
        an index in ``keep`` at the LRU tail, the others recycled (the module docstring says why)."""
        held = self.req_to_blocks.get(request_id, [])
        for i in range(min(num_blocks, len(held))):
            if held[i] != self.null:
                self._unref(held[i], recycled=i not in keep)
                held[i] = self.null

    def publish_computed(self, request: Request, num_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_tokens`` tokens (KV computed, tokens
        appended) in the prefix cache: after a verification step whose accepted drafts completed blocks that
        no later allocation of this request may register (it may finish in that step)."""
        if self.enable_caching and request.request_id in self.req_to_blocks:
            self._register_full_blocks(request, num_tokens // self.block_size)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks beyond the ``ceil(num_tokens / block_size)`` that hold its first
        ``num_tokens`` tokens (rejected speculative tokens). Those blocks are never in the prefix cache (only
        full blocks of known tokens are published), so they go to the head of the free queue."""
        blocks = self.req_to_blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        while blocks and len(blocks) > keep:
            block = self.blocks[blocks.pop()]
            assert block.block_hash is None, "a trimmed block was published in the prefix cache"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.push_blank(block.block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after a failed step left KV contents undefined)."""
        for block in self.blocks:
            block.block_hash, block.key = None, None
        self.cached.clear()
        self.free_queue = FreeQueue(list(self.free_queue))   # all blank now, in the same order
        if self.event_sink is not None:
            self.event_sink("cleared", [])
