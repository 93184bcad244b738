"""DeepSeek V4's KV in the engine: one state per sequence (``shared/model/v4_state.py``), budgeted in logical blocks.

A V4 layer keeps no per-token KV beyond its sliding window: its state is the window's rows, the compressed
entries (one per ``csa_ratio`` / ``hca_ratio`` tokens, the indexer's keys beside CSA's) and each compressor's
pending partial group. The model grows that state step by step itself (it replaces state tensors, never writes
into them), so this manager holds no pools: it owns the states, accounts their bytes and keeps the prefix cache.

Budget, in logical blocks of ``block_size`` tokens (the unit routers compare with a prompt's length): one block
is ``block_bytes``, the compressed entries ``block_size`` tokens add (``entry_bytes_per_token``); a sequence of
``n`` tokens holds ``ceil(n / block_size) + fixed_blocks``, ``fixed_blocks`` covering the parts whose size does
not grow with the context (a full window, the pending and overlap rows); a snapshot holds
``ceil(nbytes / block_bytes)``. ``num_free_blocks = num_blocks - held - snapshots``; snapshots are evicted, least
recently used first, before ``allocate_slots`` answers ``None``.

Prefix cache: a snapshot is a sequence's state at a block boundary ``k * block_size`` (the model takes it inside
a step: ``V4Chunk.snapshot``), keyed by the boundary block's hash and confirmed by its full key (the chained
digest covers every earlier token, the fingerprint and the cache salt: ``shared/kv/block_hash.py``), so a hit is
compared on tokens as every hit is. A hit continues from a copy (``V4SequenceState.restored``): greedy output
after a hit equals the miss's, at boundaries inside and outside a compression group. Snapshots within the prompt
are published when taken; a request's newest snapshot past its prompt (decoding) is published when it frees
(finished or preempted: a preempted request recomputes from it). KV events announce every block hash a snapshot's
prefix covers (the router's index matches leading blocks); a hit needs a snapshot exactly at its boundary.

Speculative decoding: a verification's rows run as one-token chunks, each leaving a snapshot
(``checkpoint``), and ``trim`` puts back the state after the last accepted row: rejected drafts leave nothing in
the window, entries or pending rows.

Hand-off and migration: ``pack`` writes a request's whole state as pages of ``page_numel`` numbers (about one
budget block each; ``shared/model/v4_state.pack``) and ``adopt`` gives an imported request the state read back
from them, budgeted as its own; a request's state is never split into blocks another engine's prefix cache takes
(``accepts`` is False, ``import_cached`` refuses: no pre-copy).

Cache tier: a write-back stores the request's newest snapshot (``tier_snapshot``) as tier blocks of entries with
the snapshot's tail on its last block (``shared/model/v4_tier.py``); a pull's blocks become a snapshot again
(``adopt_snapshot``), which the request's prefix lookup then hits as any snapshot.
"""
from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable

from shared.engine.block_manager import BlockKey, block_key
from shared.engine.kv_manager import EventSink, ImportedBlocks, KVManager
from shared.engine.request import Request
from shared.errors import DeepinferError, ErrorCode
from shared.model.config import ModelConfig
from shared.model import v4_state, v4_tier
from shared.model.v4_state import V4SequenceState


@dataclasses.dataclass(slots=True)
class Snapshot:
    state: V4SequenceState   # num_tokens == num_blocks * block_size
    key: BlockKey            # the boundary block's full key
    hashes: list[int]        # the block hashes of the prefix it covers (announced in KV events)
    blocks: int              # budget blocks it holds


class V4Hit:
    """``get_computed_blocks``'s hit: ``len`` is the blocks it covers."""
    __slots__ = ("snapshot",)

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def __len__(self) -> int:
        return len(self.snapshot.hashes)


def entry_bytes_per_token(config: ModelConfig, element_bytes: int) -> float:
    """Bytes the compressed entries of one more token of context add, averaged over a group (every layer)."""
    v4, hd = config.v4, config.head_dim
    numbers = 0.0
    for kind in v4.layer_types:
        if kind == "compressed_sparse_attention":
            numbers += (hd + v4.index_head_dim) / v4.csa_ratio
        elif kind == "heavily_compressed_attention":
            numbers += hd / v4.hca_ratio
    return numbers * element_bytes


def fixed_bytes(config: ModelConfig, element_bytes: int) -> int:
    """The most bytes a state holds beyond its entries (every layer): a full window, the largest pending group
    (kv + gate rows) and CSA's overlap series (kv + gate): a tier block's tail (``v4_tier.tail_numel``)."""
    return v4_tier.tail_numel(config) * element_bytes


class V4StateManager(KVManager):
    """See the module docstring. ``new_state()`` makes an empty sequence state (the model's)."""

    def __init__(self, num_blocks: int, block_size: int, block_bytes: int, fixed_blocks: int,
                 enable_caching: bool, new_state: Callable[[], V4SequenceState], config: ModelConfig,
                 page_numel: int) -> None:
        if num_blocks <= 0 or block_size <= 0 or block_bytes <= 0 or page_numel <= 0:
            raise ValueError("num_blocks, block_size, block_bytes and page_numel must be positive")
        self._num_blocks, self.block_size, self.block_bytes = num_blocks, block_size, block_bytes
        self.config, self.page_numel = config, page_numel
        self.fixed_blocks, self.enable_caching, self.new_state = fixed_blocks, enable_caching, new_state
        self.states: dict[str, V4SequenceState] = {}
        self.held: dict[str, int] = {}           # request id -> budget blocks it holds
        self.held_blocks = 0                     # their sum
        self.newest: dict[str, Snapshot] = {}    # request id -> its newest snapshot past its prompt (unpublished)
        self.marks: dict[str, dict[int, V4SequenceState]] = {}  # this step's verification rows: tokens -> state
        self.unkeyed: dict[str, V4SequenceState] = {}  # an accepted row's boundary state, keyed at the next step
        self.snapshots: OrderedDict[int, Snapshot] = OrderedDict()   # boundary block hash -> snapshot, LRU first
        self.snapshot_blocks = 0
        self._announced: dict[int, list[int]] = {}   # block hash -> [block index, snapshots covering it]
        self.event_sink: EventSink | None = None
        self.num_query_tokens = self.num_hit_tokens = 0

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self.held_blocks - self.snapshot_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self._num_blocks

    @property
    def pool_sizes(self) -> list[int]:
        return []   # no paged pools: the model keeps each sequence's state

    def pools(self) -> list[tuple[str, int, int]]:
        return [("v4_state", self._num_blocks, self.num_free_blocks)]

    @property
    def cached(self) -> dict[int, int]:
        return {h: index for h, (index, _) in self._announced.items()}

    def state_of(self, request_id: str) -> V4SequenceState:
        """The state of a request that holds room (``allocate_slots``)."""
        return self.states[request_id]

    # -- the scheduler's verbs ---------------------------------------------------------------------
    def _lookup(self, request: Request) -> Snapshot | None:
        if not self.enable_caching:
            return None
        for k in range(min((request.num_tokens - 1) // self.block_size, len(request.block_hashes)), 0, -1):
            snap = self.snapshots.get(request.block_hashes[k - 1])
            if snap is not None and snap.key == block_key(request, k - 1):
                return snap
        return None

    def get_computed_blocks(self, request: Request, q0: int | None = None) -> tuple[V4Hit | list, int]:
        snap = self._lookup(request)
        if self.enable_caching:
            self.num_query_tokens += request.num_tokens
        if snap is None:
            return [], 0
        self.num_hit_tokens += snap.state.num_tokens
        return V4Hit(snap), snap.state.num_tokens

    def _need(self, request_id: str, total: int) -> int:
        return max(0, -(-total // self.block_size) + self.fixed_blocks - self.held.get(request_id, 0))

    def _make_room(self, need: int) -> bool:
        while need > self.num_free_blocks and self.snapshots:
            self._evict(next(iter(self.snapshots)))
        return need <= self.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, hits=(), q0: int | None = None):
        rid = request.request_id
        if rid in self.unkeyed:   # its tokens were appended since the verification that reached the boundary
            self.checkpoint(request, self.unkeyed.pop(rid))
        start = hits.snapshot.state.num_tokens if isinstance(hits, V4Hit) else request.num_computed_tokens
        before = self.held.get(rid, 0)
        need = self._need(rid, start + num_new_tokens)
        if not self._make_room(need):
            return None
        if rid not in self.states:
            if isinstance(hits, V4Hit):
                snap = hits.snapshot
                self.states[rid] = snap.state.restored()
                if self.snapshots.get(snap.hashes[-1]) is snap:   # not evicted for this very room
                    self.snapshots.move_to_end(snap.hashes[-1])
            else:
                self.states[rid] = self.new_state()
        self.held[rid] = before + need
        self.held_blocks += need
        return list(range(before, before + need))

    def has_room(self, request: Request, total: int) -> bool:
        return self._need(request.request_id, total) <= self.num_free_blocks + self.snapshot_blocks

    def free(self, request_id: str) -> None:
        self.held_blocks -= self.held.pop(request_id, 0)
        self.marks.pop(request_id, None)
        self.unkeyed.pop(request_id, None)
        self.states.pop(request_id, None)
        snap = self.newest.pop(request_id, None)
        if snap is not None:
            self._publish(snap)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Roll the state back to its first ``num_tokens`` tokens (rejected drafts): to the state the model left
        after that row of the verification (``checkpoint`` keeps one per verified row)."""
        marks = self.marks.pop(request_id, {})
        boundaries = [n for n in marks if n <= num_tokens and n % self.block_size == 0]
        if boundaries:   # an accepted draft ended a block: cached once its tokens are the request's
            self.unkeyed[request_id] = marks[max(boundaries)]
        state = self.states.get(request_id)
        if state is not None and num_tokens < state.num_tokens:
            if num_tokens not in marks:
                raise DeepinferError(ErrorCode.INTERNAL, f"no DeepSeek V4 state at {num_tokens} tokens to roll "
                                     f"back to (the state covers {state.num_tokens})")
            self.states[request_id] = marks[num_tokens].restored()
        if request_id in self.held:
            kept = min(self.held[request_id], -(-num_tokens // self.block_size) + self.fixed_blocks)
            self.held_blocks -= self.held[request_id] - kept
            self.held[request_id] = kept

    # -- hand-off and migration --------------------------------------------------------------------
    def payload_pages(self, num_tokens: int) -> int:
        """Pages ``pack`` writes for a state over ``num_tokens`` tokens."""
        return max(1, -(-v4_state.context_numel(self.config, num_tokens) // self.page_numel))

    def pack(self, request_id: str):
        """``[pages, page_numel]``: the request's state as it stands, packed (a copy)."""
        return v4_state.pack(self.states[request_id], self.config, self.page_numel)

    def adopt(self, request: Request, pages, num_tokens: int) -> bool:
        """Give ``request`` (new here) the state ``pages`` holds over its first ``num_tokens`` tokens, with room in
        the budget as if it had computed them; False when there is no room (nothing changes). ``transfer_failed``
        when the pages cannot hold such a state."""
        rid = request.request_id
        try:
            state = v4_state.unpack(pages, self.config, num_tokens)
        except ValueError as err:
            raise DeepinferError(ErrorCode.TRANSFER_FAILED, str(err)) from None
        need = self._need(rid, num_tokens)
        if rid in self.states or not self._make_room(need):
            return False
        self.states[rid] = state
        self.held[rid] = need
        self.held_blocks += need
        return True

    # -- cache tier -------------------------------------------------------------------------------
    def tier_snapshot(self, request: Request) -> Snapshot | None:
        """The newest snapshot of ``request``'s own tokens (past its prompt, unpublished yet; else the longest
        prefix-cache entry its tokens hit): what a write-back to the tier stores."""
        snap = self.newest.get(request.request_id)
        return snap if snap is not None else self._lookup(request)

    def cached_snapshot(self, request: Request, blocks: int) -> bool:
        """Whether the prefix cache holds the snapshot at ``request``'s block ``blocks`` boundary (touched)."""
        h = request.block_hashes[blocks - 1]
        snap = self.snapshots.get(h)
        if snap is None or snap.key != block_key(request, blocks - 1):
            return False
        self.snapshots.move_to_end(h)
        return True

    def adopt_snapshot(self, request: Request, state: V4SequenceState) -> bool:
        """Publish ``state`` (read back from the tier: ``request``'s tokens up to a block boundary) as a
        prefix-cache entry, evicting older ones for room; whether it is cached now."""
        k = state.num_tokens // self.block_size
        if not self.enable_caching or not k or state.num_tokens % self.block_size or len(request.block_hashes) < k:
            return False
        self._publish(self._snapshot(request, state))
        return self.cached_snapshot(request, k)

    def publish_computed(self, request: Request, num_tokens: int) -> None:
        """Nothing to do: snapshots are taken by the model inside steps (``checkpoint``)."""

    def withdraw_uncomputed(self, request: Request, num_tokens: int) -> None:
        """Nothing to do: a snapshot is published only once the step computed it."""

    # -- snapshots ---------------------------------------------------------------------------------
    def mark(self, request_id: str, state: V4SequenceState) -> None:
        """Keep ``state``, the request's state after one row of this step's verification, to roll back to
        (``trim``; the marks last until then)."""
        self.marks.setdefault(request_id, {})[state.num_tokens] = state

    def checkpoint(self, request: Request, state: V4SequenceState) -> None:
        """Keep ``state``, a snapshot the model took inside the step at a block boundary, as a prefix-cache entry:
        published now within the prompt, else kept as the request's newest and published when it frees. Drafted
        rows (beyond the request's known tokens) are never cached."""
        if not self.enable_caching or state.num_tokens % self.block_size or not state.num_tokens \
                or state.num_tokens > request.num_tokens:
            return
        k = state.num_tokens // self.block_size
        if len(request.block_hashes) < k:
            return
        snap = self._snapshot(request, state)
        if state.num_tokens <= request.num_prompt_tokens:
            self._publish(snap)
        else:
            self.newest[request.request_id] = snap

    def _snapshot(self, request: Request, state: V4SequenceState) -> Snapshot:
        """``state`` (the request's tokens up to a block boundary) as a prefix-cache entry, keyed and budgeted."""
        k = state.num_tokens // self.block_size
        return Snapshot(state, block_key(request, k - 1), list(request.block_hashes[:k]),
                        -(-state.nbytes() // self.block_bytes))

    def _publish(self, snap: Snapshot) -> None:
        h = snap.hashes[-1]
        if h in self.snapshots:   # the same boundary (or a colliding key: the older one stays)
            self.snapshots.move_to_end(h)
            return
        if not self._make_room(snap.blocks):
            return
        self.snapshots[h] = snap
        self.snapshot_blocks += snap.blocks
        stored = []
        for index, bh in enumerate(snap.hashes):
            entry = self._announced.setdefault(bh, [index, 0])
            entry[1] += 1
            if entry[1] == 1:
                stored.append(bh)
        if stored and self.event_sink is not None:
            self.event_sink("stored", stored)

    def _evict(self, h: int) -> None:
        snap = self.snapshots.pop(h)
        self.snapshot_blocks -= snap.blocks
        removed = []
        for bh in snap.hashes:
            entry = self._announced[bh]
            entry[1] -= 1
            if not entry[1]:
                del self._announced[bh]
                removed.append(bh)
        if removed and self.event_sink is not None:
            self.event_sink("removed", removed)

    # -- tables and the prefix cache ---------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return list(range(max(0, self.held.get(request_id, 0) - self.fixed_blocks)))

    def block_tables(self, request_id: str) -> list[list[int]]:
        return []

    def group_block_ids(self, request_id: str, ids: list[int], next_query: int | None = None) -> list[list[int]]:
        return []

    def cached_prefix(self, request: Request) -> int:
        snap = self._lookup(request)
        return 0 if snap is None else len(snap.hashes)

    def import_cached(self, request: Request, first: int, count: int, has_window: list[bool]) -> ImportedBlocks:
        raise DeepinferError(ErrorCode.INVALID_REQUEST, "DeepSeek V4 KV travels as whole sequence states "
                             "(hand-off, migration), not as blocks a prefix cache takes")

    def accepts(self, has_window: list[bool] | None) -> bool:
        return False

    def refuse(self, total: int) -> str | None:
        need = -(-total // self.block_size) + self.fixed_blocks
        if need > self._num_blocks:
            return (f"need {need} blocks of DeepSeek V4 state ({self.fixed_blocks} for its window and pending rows); "
                    f"the budget holds {self._num_blocks}")
        return None

    def reset_prefix_cache(self) -> None:
        self.newest.clear()
        self.unkeyed.clear()
        while self.snapshots:
            self._evict(next(iter(self.snapshots)))
        if self.event_sink is not None:
            self.event_sink("cleared", [])


def build_v4_manager(config: ModelConfig, element_bytes: int, block_size: int, kv_cache_bytes: int,
                     num_kv_blocks: int | None, enable_caching: bool,
                     new_state: Callable[[], V4SequenceState]) -> V4StateManager:
    """The budget in blocks: ``num_kv_blocks``, or as many as ``kv_cache_bytes`` holds."""
    block_bytes = max(1, math.ceil(block_size * entry_bytes_per_token(config, element_bytes)))
    fixed = -(-fixed_bytes(config, element_bytes) // block_bytes)
    num_blocks = num_kv_blocks or max(1, kv_cache_bytes // block_bytes)
    return V4StateManager(num_blocks, block_size, block_bytes, fixed, enable_caching, new_state, config,
                          max(1, block_bytes // element_bytes))
