"""State of one simulated request and one simulated worker (KV blocks with LRU eviction of unreferenced
blocks, prefill queue, decode batch). Used only by the simulator (``sim_engine.py``, ``sim_elastic.py``).

Invariants: a block is either pinned (referenced by a running request, with a refcount) or in the LRU
(cached, evictable), never both; ``len(lru) + len(pinned) + private <= cap`` after ``evict()`` unless private
reservations alone exceed it (a hand-off is never refused). A worker takes new placements only while neither
``draining`` nor ``removed``; ``incoming`` counts requests placed to decode there that have not arrived yet.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from shared.sched.trace import TraceRequest


class _Req:
    __slots__ = ("tr", "decode_w", "est", "local", "hit", "pull_s", "tier_tokens", "uncached", "done",
                 "first_s", "generated", "pinned", "private", "total_blocks", "move_to", "moved_at")

    def __init__(self, tr: TraceRequest, decode_w: int, est: int) -> None:
        self.tr, self.decode_w, self.est = tr, decode_w, est
        self.local = self.hit = self.uncached = self.done = self.generated = 0
        self.pull_s = 0.0  # seconds to pull the cache tier's blocks beyond the local prefix
        self.tier_tokens: dict[str, int] = {}  # prompt tokens pulled from the tier: "dram" / "ssd" -> tokens
        self.first_s: float | None = None
        self.pinned: tuple[int, ...] = ()
        self.private = self.total_blocks = 0
        self.move_to: tuple[int, str] | None = None  # (target worker idx, reason) of a live migration under way
        self.moved_at: float | None = None  # when it last arrived by live migration


class _Worker:
    def __init__(self, idx: int, role: str, cap: int, born_s: float = 0.0) -> None:
        self.idx, self.role, self.cap = idx, role, cap
        self.wid = f"w{idx:03d}"
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced (evictable), oldest first
        self.pinned: dict[int, int] = {}  # cached and referenced: refcount
        self.private = 0  # reserved blocks not (yet) identified by a hash
        self.queue: deque[_Req] = deque()
        self.queued_tokens = 0
        self.prefill_left = 0  # prompt tokens admitted but not yet computed
        self.running: list[_Req] = []
        self.kv_tokens = 0
        self.busy = False
        # elastic cluster (sim_elastic.py): drain, role switch, removal, live migration
        self.draining = self.removed = False
        self.incoming = 0  # placed here to decode, prefill or hand-off still under way
        self.moves_out: list[_Req] = []  # streams ordered to migrate away, detached when the current step ends
        self.born_s, self.ended_s = born_s, None  # alive (and paid for) from born_s until ended_s
        self.after_drain: dict | None = None  # the planner decision carried out once the drain completes

    @property
    def used(self) -> int:
        """Blocks not free for a new request (pinned or reserved; LRU blocks can be evicted)."""
        return len(self.pinned) + self.private

    def holds_nothing(self) -> bool:
        return not (self.running or self.queue or self.incoming or self.moves_out or self.busy)

    def prefix(self, hashes: tuple[int, ...]) -> int:
        n = 0
        for h in hashes:
            if h in self.pinned or h in self.lru:
                n += 1
            else:
                break
        return n

    def evict(self) -> None:
        while self.lru and len(self.lru) + len(self.pinned) + self.private > self.cap:
            self.lru.popitem(last=False)

    def pin(self, h: int) -> bool:
        """Reference block ``h``; True if it was already cached."""
        if h in self.pinned:
            self.pinned[h] += 1
            return True
        cached = self.lru.pop(h, 0) is None
        self.pinned[h] = 1
        return cached

    def release(self, r: _Req) -> None:
        for h in reversed(r.pinned):  # tail blocks become the oldest: evicted before the prefix they extend
            n = self.pinned[h] - 1
            if n:
                self.pinned[h] = n
            else:
                del self.pinned[h]
                self.lru[h] = None
        self.private -= r.private
        r.pinned, r.private = (), 0
