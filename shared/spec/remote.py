"""A drafter across NATS: the decode worker's engine thread asks the draft service for proposals.

``RemoteDrafter.propose`` runs on the engine thread between steps and blocks at most ``timeout_s`` (the request
is a coroutine on the worker's event loop). A timeout, a missing service or a bad reply returns empty
proposals: that step decodes without speculation, so a slow or dead draft service never stalls or fails a
stream. Only the last ``context_tokens`` tokens of each sequence travel (a model drafter rebuilds its state
from its window; prompt lookup belongs in-process, where it sees the whole sequence for free).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Sequence

from shared import protocol
from shared.protocol_draft import NUM_FEATURES
from shared.spec.types import DraftInput, Proposal, TokenFeatures

logger = logging.getLogger(__name__)


def request_for(sequences: Sequence[DraftInput], k: int, context_tokens: int) -> protocol.DraftRequest:
    tails = [list(s.token_ids[-context_tokens:]) for s in sequences]
    return protocol.DraftRequest(k=k, lengths=[len(t) for t in tails], tokens=[t for tail in tails for t in tail])


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
    def __init__(self, nc, loop: asyncio.AbstractEventLoop, subject: str, timeout_s: float = 0.1,
                 context_tokens: int = 512, name: str = "remote") -> None:
        self.nc, self.loop, self.subject = nc, loop, subject
        self.timeout_s, self.context_tokens, self.name = timeout_s, context_tokens, name
        self.timeouts = self.failures = 0

    async def _ask(self, req: protocol.DraftRequest) -> protocol.DraftReply:
        msg = await self.nc.request(self.subject, protocol.encode(req), timeout=self.timeout_s)
        return protocol.decode_reply(msg.data, protocol.DraftReply)

    def propose(self, sequences: Sequence[DraftInput], k: int) -> list[Proposal]:
        empty = [Proposal() for _ in sequences]
        if not sequences:
            return empty
        future = asyncio.run_coroutine_threadsafe(self._ask(request_for(sequences, k, self.context_tokens)),
                                                  self.loop)
        try:
            reply = future.result(self.timeout_s + 0.05)
        except (concurrent.futures.TimeoutError, asyncio.TimeoutError):
            future.cancel()
            self.timeouts += 1
            return empty
        except Exception as err:  # noqa: BLE001 - no responders, bad reply: decode without speculation
            self.failures += 1
            logger.debug("draft request failed: %r", err)
            return empty
        proposals = proposals_of(reply)
        if len(proposals) != len(sequences) or any(len(p.tokens) > k for p in proposals):
            self.failures += 1
            return empty
        return proposals
