"""A preempted sequence's KV offered to the cache tier, and its resume from there (the engine's side).

Preemption frees a victim's blocks for a more urgent sequence; without this the victim recomputes its whole
context when it is readmitted (its hashed blocks stay cached, but the allocations that caused the preemption
evict them first). With offers on (``enable``, by a worker that has a cache tier):

1. ``offer`` (the scheduler's hook, engine thread, before the victim's blocks are freed) copies the victim's
   computed full blocks — a packed run for KV groups — and hands the copy to the worker's ``sink`` with what a
   tier write needs; the victim then *awaits* its KV (``Request.resume_wait_s > 0``). Copies not yet staged by
   the worker are bounded by ``max_bytes``: past it (or for a state layout, prompt logprobs, no prefix cache)
   nothing is offered and the victim recomputes as before.
2. When the awaiting victim is the next to be admitted (head of ``waiting``, a seat free): if its prefix lookup
   finds every block it offered (nothing needed their room) it is admitted as any request is (``kept``); else the
   scheduler holds admission there and ``wanted`` tells the worker, which pulls its blocks from the tier (all of
   them: what the device holds now may be evicted before there is room; the import skips what it still holds).
3. ``resume`` (an engine command) publishes the pulled blocks in the prefix cache, keeps them as the victim's
   ``reimport`` and ends its wait: the next step admits it with a prefix hit instead of a recompute.

Invariants: a victim awaits at most ``resume_wait_s`` seconds from being wanted (the scheduler then admits it
to recompute: an offer never stalls the queue longer); an awaiting request that is aborted or finishes is
reported ``gone`` so its worker-side wait ends; the copy's bytes are released by the worker once staged or
dropped (``released``), whatever the tier does. Greedy output is the same either way: the blocks are the
victim's own KV, and a prefix hit equals a recompute (``tests/unit/test_preempted_kv.py``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.kv.block_hash import BlockChain
from shared.kv.transport import transfer_timeout

if TYPE_CHECKING:
    from shared.engine.kv_port import KVPort
    from shared.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Offer:
    """What a tier write of a victim's blocks needs (``TierClient.write_back``) and what its resume looks up."""
    request_id: str
    chain: BlockChain          # the offered blocks 0 .. n-1
    token_ids: list[int]       # their tokens, block_size per block
    kv: torch.Tensor           # [n, *block_shape] copy, or a packed run (KV groups)
    window_mask: bytes         # b"" for whole blocks
    nbytes: int
    all_token_ids: list[int]   # the victim's tokens at preemption (its resume's lookup)
    cache_salt: str


@dataclass(slots=True)
class PreemptCounters:
    offers: int = 0            # victims whose KV was offered
    offered_blocks: int = 0
    not_offered: int = 0       # victims over the byte budget (recomputed)
    kept: int = 0              # victims whose blocks the device cache still held all of when due (no pull)
    resumed: int = 0           # victims readmitted with blocks pulled back
    resumed_blocks: int = 0    # of their blocks, those the prefix lookup at readmission had from the pull
    recomputed: int = 0        # offered victims readmitted without them (tier miss, failed write, wait elapsed)


class PreemptedKV:
    """Owned by the engine's ``KVPort`` (``kv_port.preempted``); off until ``enable``."""

    def __init__(self, port: "KVPort") -> None:
        self.port = port
        self.sink: Callable[[str, str, object], None] | None = None
        self.max_bytes = 0
        self.wait_s = 0.0
        self.counters = PreemptCounters()
        self._pending_bytes = 0
        self._imported: dict[str, int] = {}   # a resumed request's blocks from its pull, until it is admitted
        self._offered: dict[str, int] = {}    # an awaiting request's offered blocks
        self._lock = threading.Lock()   # _pending_bytes: taken on the engine thread, released on the loop

    @property
    def enabled(self) -> bool:
        return self.sink is not None

    def enable(self, sink: Callable[[str, str, object], None], max_bytes: int, wait_s: float) -> None:
        """Offer victims' KV to ``sink(kind, request_id, payload)`` — kinds ``offer`` (an ``Offer``), ``wanted``,
        ``gone`` — called on the engine thread (the sink hands them to its own loop). At most ``max_bytes`` of
        copies wait to be staged; a victim awaits its pull for at most ``wait_s`` plus its bytes' transfer time."""
        if max_bytes <= 0 or wait_s <= 0:
            raise ValueError("max_bytes and wait_s must be positive")
        self.sink, self.max_bytes, self.wait_s = sink, max_bytes, wait_s

    def released(self, nbytes: int) -> None:
        """An offer's copy is staged or dropped (any thread)."""
        with self._lock:
            self._pending_bytes = max(0, self._pending_bytes - nbytes)

    def offer(self, req: "Request") -> None:
        """Scheduler hook: ``req`` is being preempted, its blocks still allocated. Copy and offer its computed
        full blocks, and make it await them; nothing happens when offers are off or it does not qualify."""
        port = self.port
        if (self.sink is None or port.carries_state or req.params.prompt_logprobs is not None
                or not port.engine.config.enable_prefix_caching):
            return
        bs = port.engine.config.block_size
        req.update_block_hashes()
        full = min(req.num_computed_tokens // bs, len(req.block_hashes))
        if full == 0:
            return
        ids = port._bm.block_ids(req.request_id)[:full]
        nbytes = full * port.block_bytes
        with self._lock:
            if self._pending_bytes + nbytes > self.max_bytes:
                self.counters.not_offered += 1
                return
            self._pending_bytes += nbytes
        cache, rows, mask = port.source(req.request_id, ids)
        kv = cache[rows] if port.stages_in_place else cache   # [full, *block_shape]: a copy, the blocks go now
        offer = Offer(req.request_id, BlockChain.of(port.engine.fingerprint, req.block_digests[:full]),
                      req.all_token_ids[:full * bs], kv, mask, nbytes,
                      list(req.all_token_ids), req.cache_salt)
        req.resume_wait_s = transfer_timeout(self.wait_s, nbytes)
        req.resume_wanted_at = 0.0
        self._offered[req.request_id] = full
        self.counters.offers += 1
        self.counters.offered_blocks += full
        self.sink("offer", req.request_id, offer)

    def offered_tokens(self, req: "Request") -> int:
        """Tokens of the blocks the awaiting ``req`` offered."""
        return self._offered.get(req.request_id, 0) * self.port.engine.config.block_size

    def wanted(self, req: "Request") -> None:
        """Scheduler hook: the awaiting ``req`` is next to be admitted and the device cache lacks some of its
        blocks: its pull starts (admission holds)."""
        req.resume_wanted_at = time.monotonic()
        self.sink("wanted", req.request_id, None)

    def _end_wait(self, req: "Request") -> None:
        """``req`` awaits no more and its worker-side wait ends (``gone``) without a resume."""
        req.resume_wait_s = 0.0
        self._offered.pop(req.request_id, None)
        self.sink("gone", req.request_id, None)

    def gone(self, req: "Request") -> None:
        """Scheduler hook: ``req`` left the queues (aborted, finished); an awaiting one is reported ``gone``."""
        self._imported.pop(req.request_id, None)
        if req.resume_wait_s:
            self._end_wait(req)

    def gave_up(self, req: "Request") -> None:
        """Scheduler hook: ``req`` waited ``resume_wait_s`` since it was wanted: it is admitted to recompute."""
        self.counters.recomputed += 1
        logger.info("[%s] its preempted KV did not come back in %.1f s: recomputing", req.request_id,
                    time.monotonic() - req.resume_wanted_at)
        self._end_wait(req)

    def resume(self, request_id: str, pulled) -> int:
        """Engine command: end ``request_id``'s wait with ``pulled`` (a ``Pulled`` from the tier, or None: nothing
        came back) published in the prefix cache and kept as its ``reimport``. Returns the blocks its prefix
        lookup now finds that came from the pull (0 when it no longer awaits)."""
        req = self.port.engine.requests.get(request_id)
        if req is None or not req.resume_wait_s:
            return 0
        req.resume_wait_s = 0.0
        self._offered.pop(request_id, None)
        if pulled is None:
            self.counters.recomputed += 1
            return 0
        tokens, port, imported = list(req.all_token_ids), self.port, self._imported

        def reimport() -> int:   # again before each admission attempt: the pool may have had no room yet
            imported[request_id] = port.import_tier_blocks(tokens, req.cache_salt, pulled.first, pulled.kv,
                                                           pulled.has_window)
            return imported[request_id]
        req.reimport = reimport
        self.counters.resumed += 1
        return reimport()

    def admitted(self, req: "Request") -> None:
        """Scheduler hook: ``req`` (with a ``reimport``, or awaiting) is admitted: a resumed one's last import is
        counted; one still awaiting found every block it offered in the device cache (``kept``)."""
        if req.resume_wait_s:
            self.counters.kept += 1
            self._end_wait(req)
        count = self._imported.pop(req.request_id, None)
        if count is not None:
            self.counters.resumed_blocks += count
