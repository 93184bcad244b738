"""``n`` > 1: one prompt, ``n`` sequences, each served as its own stream (own placement, failover and migration)
by ``RouterService.serve`` and relayed to the client under the parent's request id with ``index`` i.

Invariants:
- choice ``i`` samples with ``seed + i`` when the request has a seed (vLLM's rule), else unseeded;
- the prompt is prefilled once: choices 1.. start only when choice 0 has delivered its second chunk (its KV then
  sits in a decode worker's prefix cache) or has ended, and the cache-aware placement, told which worker that
  is (``Relay.prompt_holder``: KV events may still be on their way), sends them where that prefix is; they
  report it as ``cached_tokens``;
- every choice ends with its own final chunk (an error one included); cancelling the parent (a client cancel, a
  disconnect) cancels every choice.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from shared import protocol

if TYPE_CHECKING:
    from services.router.service import RouterService

SIBLINGS_WAIT_S = 30.0   # the longest choices 1.. wait for choice 0's KV before they start anyway


def choice_request(req: protocol.GenerateRequest, index: int) -> protocol.GenerateRequest:
    """Choice ``index`` as a one-choice request of its own."""
    seed = None if req.seed is None else (req.seed + index) % 2**63
    return dataclasses.replace(req, n=1, request_id=f"{req.request_id}-{index}", seed=seed)


async def serve_choices(router: "RouterService", req: protocol.GenerateRequest,
                        send: Callable[[protocol.TokenChunk], Awaitable[None]], tenant: str | None, api: str) -> None:
    """Serve every choice of ``req`` (``req.request_id`` set); returns when all of them sent their final chunk."""
    kv_ready = asyncio.Event()
    holders: dict[str, int] = {}

    async def one(index: int) -> None:
        chunks = 0

        async def relay(chunk: protocol.TokenChunk) -> None:
            nonlocal chunks
            await send(dataclasses.replace(chunk, request_id=req.request_id, index=index))
            chunks += 1
            if index == 0 and (chunks >= 2 or chunk.final) and not kv_ready.is_set():
                holders.update(router.relay.prompt_holder(choice_request(req, 0).request_id))
                kv_ready.set()
        try:
            if index:
                try:
                    await asyncio.wait_for(kv_ready.wait(), SIBLINGS_WAIT_S)
                except asyncio.TimeoutError:
                    pass   # choice 0 is slow: go without its prefix
            await router.serve(choice_request(req, index), relay, tenant=tenant, api=api, holders=holders)
        finally:
            if index == 0:
                kv_ready.set()
    tasks = [asyncio.create_task(one(i)) for i in range(req.n)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
