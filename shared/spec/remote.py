"""A drafter across NATS: the decode worker's engine thread asks the draft service for proposals.

``RemoteDrafter.propose`` runs on the engine thread between steps and blocks at most ``timeout_s`` (the request
is a coroutine on the worker's event loop). A timeout, a missing service or a bad reply returns empty
proposals: that step decodes without speculation, so a slow or dead draft service never stalls or fails a
stream. A circuit breaker (``shared/spec/breaker.py``) stops asking after 3 failures in a row (a timeout, an
error, or a reply slower than half of ``timeout_s``, which costs more than speculation is likely to save) and
sends one trial request after each cooldown (doubling while the service stays bad) without waiting for it: the
step decodes plainly and a good reply closes the breaker. So a dead or slow draft service costs three waits,
not one per step. Each request carries its budget (``DraftRequest.budget_s`` = ``timeout_s``): the service drops a
request that waited longer than that in its queue instead of drafting for an asker that has moved on. Only the last ``context_tokens`` tokens of each sequence travel (a model drafter rebuilds its state
from its window; prompt lookup belongs in-process, where it sees the whole sequence for free).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence

from shared import protocol
from shared.protocol_draft import NUM_FEATURES
from shared.spec.breaker import CircuitBreaker
from shared.spec.types import DraftInput, Proposal, TokenFeatures

logger = logging.getLogger(__name__)


def request_for(sequences: Sequence[DraftInput], k: int, context_tokens: int,
                budget_s: float = 0.0) -> protocol.DraftRequest:
    tails = [list(s.token_ids[-context_tokens:]) for s in sequences]
    return protocol.DraftRequest(k=k, lengths=[len(t) for t in tails], tokens=[t for tail in tails for t in tail],
                                 budget_s=budget_s)


def sequences_of(req: protocol.DraftRequest) -> list[DraftInput]:
    out, start = [], 0
    for i, n in enumerate(req.lengths):
        out.append(DraftInput(str(i), req.tokens[start:start + n]))
        start += n
    return out


def reply_for(proposals: Sequence[Proposal]) -> protocol.DraftReply:
    return protocol.DraftReply(lengths=[len(p.tokens) for p in proposals],
                               tokens=[t for p in proposals for t in p.tokens],
                               features=[x for p in proposals for f in p.features for x in f.as_list()])


def proposals_of(reply: protocol.DraftReply) -> list[Proposal]:
    out, start = [], 0
    for n in reply.lengths:
        feats = []
        for j in range(start, start + n):
            top1, entropy, ngram, position = reply.features[j * NUM_FEATURES:(j + 1) * NUM_FEATURES]
            feats.append(TokenFeatures(top1_prob=top1, entropy=entropy, ngram_len=int(ngram), position=int(position)))
        out.append(Proposal(list(reply.tokens[start:start + n]), feats))
        start += n
    return out


class RemoteDrafter:
    """Proposals from the draft service (see the module docstring). ``propose`` runs on the engine thread; the
    breaker is shared with the event loop (the trial's outcome lands there), hence the lock."""

    def __init__(self, nc, loop: asyncio.AbstractEventLoop, subject: str, timeout_s: float = 0.1,
                 context_tokens: int = 512, name: str = "remote", breaker: CircuitBreaker | None = None) -> None:
        self.nc, self.loop, self.subject = nc, loop, subject
        self.timeout_s, self.context_tokens, self.name = timeout_s, context_tokens, name
        self.slow_s = timeout_s / 2  # a reply later than this costs more than it is likely to save: a failure
        self.timeouts = self.failures = self.slow = 0
        self.waited_s = 0.0  # engine-thread time spent waiting for the service (what speculation cost the steps)
        self.breaker = breaker or CircuitBreaker()
        self._lock = threading.Lock()

    async def _ask(self, req: protocol.DraftRequest) -> protocol.DraftReply:
        msg = await self.nc.request(self.subject, protocol.encode(req), timeout=self.timeout_s)
        return protocol.decode_reply(msg.data, protocol.DraftReply)

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        empty = [Proposal() for _ in sequences]
        if not sequences:
            return empty
        with self._lock:
            allowed = self.breaker.allow(time.monotonic())
            trial = allowed and self.breaker.state == "half-open"
        if not allowed:
            return empty
        req = request_for(sequences, k, self.context_tokens, self.timeout_s)
        if trial:  # the half-open trial costs this step nothing: it decodes plainly, the reply only closes the breaker
            asyncio.run_coroutine_threadsafe(self._trial(req, len(sequences), k), self.loop)
            return empty
        t0 = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(self._ask(req), self.loop)
        try:
            try:
                reply = future.result(self.timeout_s + 0.05)
            finally:
                self.waited_s += time.monotonic() - t0
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            future.cancel()
            self.timeouts += 1
            self._failed("timed out")
            return empty
        except Exception as err:  # noqa: BLE001 - no responders, bad reply: decode without speculation
            self.failures += 1
            self._failed(repr(err))
            return empty
        proposals = self._checked(reply, len(sequences), k)
        if proposals is None:
            self._failed("a malformed reply")
            return empty
        if time.monotonic() - t0 > self.slow_s:
            self.slow += 1
            self._failed(f"replied after {time.monotonic() - t0:.3f} s")
        else:
            with self._lock:
                self.breaker.success()
        return proposals

    async def _trial(self, req: protocol.DraftRequest, n: int, k: int) -> None:
        t0 = time.monotonic()
        try:
            ok = self._checked(await self._ask(req), n, k) is not None and time.monotonic() - t0 <= self.slow_s
        except Exception as err:  # noqa: BLE001 - timeout, no responders: the service is still bad
            logger.debug("draft trial failed: %r", err)
            ok = False
        if ok:
            with self._lock:
                self.breaker.success()
            logger.info("draft service %s answers again: speculating", self.subject)
        else:
            self._failed("the trial request failed")

    def _checked(self, reply: protocol.DraftReply, n: int, k: int) -> list[Proposal] | None:
        proposals = proposals_of(reply)
        if len(proposals) != n or any(len(p.tokens) > k for p in proposals):
            self.failures += 1
            return None
        return proposals

    def _failed(self, why: str) -> None:
        with self._lock:
            was = self.breaker.state
            self.breaker.failure(time.monotonic())
            opened = self.breaker.state == "open" and was == "closed"
        if opened:
            logger.warning("draft service %s: %s; decoding without it for %.0f s (then one trial request)",
                           self.subject, why, self.breaker.cooldown_s)
        else:
            logger.debug("draft request failed: %s", why)
