"""State of one simulated request and one simulated worker (KV blocks with LRU eviction of unreferenced
blocks, prefill queue, decode batch). Used only by the simulator (``sim_engine.py``, ``sim_elastic.py``).

Invariants: a block is either pinned (referenced by a running request, with a refcount) or in the LRU
(cached, evictable), never both; ``len(lru) + len(pinned) + private <= cap`` after ``evict()`` unless private
reservations alone exceed it (a hand-off is never refused). A worker takes new placements only while neither
``draining`` nor ``removed``; ``incoming`` counts requests placed to decode there that have not arrived yet
(their prefill or KV hand-off, or their live migration, under way). While ``busy``, ``step_ends`` holds the
step boundaries of the worker's pending step event (stamped ``gen``; a cut raises ``gen``), ``step_decoding``
the streams it decodes.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from simulator.trace import TraceRequest


class SimRequest:
    __slots__ = ("tr", "decode_w", "est", "local", "hit", "pull_s", "tier_tokens", "uncached", "done",
                 "first_s", "generated", "pinned", "private", "total_blocks", "move_to", "moved_at", "pos",
                 "priority")

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
        self.pos, self.priority = 0, 0  # its trace position; its SLO class's priority (0: classes off)


class SimWorker:
    def __init__(self, idx: int, role: str, cap: int, born_s: float = 0.0) -> None:
        self.idx, self.role, self.cap = idx, role, cap
        self.wid = f"w{idx:03d}"
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced (evictable), oldest first
        self.pinned: dict[int, int] = {}  # cached and referenced: refcount
        self.private = 0  # reserved blocks not (yet) identified by a hash
        self.queue: deque[SimRequest] = deque()
        self.queued_tokens = 0
        self.prefill_left = 0  # prompt tokens admitted but not yet computed
        self.running: list[SimRequest] = []
        self.kv_tokens = 0
        self.busy = False
        self.gen = 0  # stamp of the pending step event: one with an older stamp was cut short and is ignored
        self.step_ends: list[float] = []  # boundaries of the pending step event's steps, in time order
        self.step_decoding: list[SimRequest] = []  # the streams the pending step event decodes
        # elastic cluster (sim_elastic.py): drain, role switch, removal, live migration
        self.draining = self.removed = False
        self.incoming = 0  # placed here to decode, prefill or hand-off still under way
        self.moves_out: list[SimRequest] = []  # streams ordered to migrate away, detached when the current step ends
        self.born_s, self.ended_s = born_s, None  # alive (and paid for) from born_s until ended_s
        self.after_drain: dict | None = None  # the planner decision carried out once the drain completes

    @property
    def used(self) -> int:
        """Blocks not free for a new request (pinned or reserved; LRU blocks can be evicted)."""
        return len(self.pinned) + self.private

    @property
    def num_placed(self) -> int:
        """Requests placed here whose work here has not ended: running, queued, or on their way here."""
        return len(self.running) + len(self.queue) + self.incoming

    @property
    def num_waiting(self) -> int:
        """Waiting as the router counts it, ``max(waiting, placed - running)``: the larger of the queue and what
        was placed here beyond the running requests, which is the queue plus the requests on their way."""
        return len(self.queue) + self.incoming

    def kv_usage(self, block_size: int) -> float:
        """The KV pool's usage as the engine reports it in heartbeats, in [0, 1]: a running request holds the
        blocks of its context so far (the simulator reserves a stream's output blocks when it arrives, the engine
        allocates them as tokens come), and a pool is never more than full (the engine preempts; the simulator
        lets reservations exceed ``cap``)."""
        unwritten = sum(max(0, r.total_blocks - -(-(r.tr.input_length + r.generated) // block_size))
                        for r in self.running)
        return min(1.0, (self.used - unwritten) / max(1, self.cap))

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

    def release(self, r: SimRequest) -> None:
        for h in reversed(r.pinned):  # tail blocks become the oldest: evicted before the prefix they extend
            n = self.pinned[h] - 1
            if n:
                self.pinned[h] = n
            else:
                del self.pinned[h]
                self.lru[h] = None
        self.private -= r.private
        r.pinned, r.private = (), 0
