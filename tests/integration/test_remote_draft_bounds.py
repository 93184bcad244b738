"""A slow draft service costs the decode worker little (issue 21): the remote drafter's circuit breaker stops
asking after failures in a row, and the service drops requests that waited past their budget."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.draft.service import DraftService
from shared import protocol, subjects
from services.draft.config import DraftConfig
from shared.spec.breaker import CircuitBreaker
from shared.spec.remote import RemoteDrafter, request_for, reply_for
from shared.spec.types import DraftInput, Proposal
from tests.integration.conftest import connect
from tests.integration.test_speculative import SlowDrafter
from tests.model_factory import write_tiny_hf_folder

SUBJECT = subjects.draft("test-model")
SEQS = [DraftInput("0", [5, 6, 7, 8])]


async def responder(nc, delay: dict) -> None:
    """Fault injection: a draft service answering one empty proposal per sequence after ``delay["s"]``."""
    async def on_msg(msg) -> None:
        await asyncio.sleep(delay["s"])
        await msg.respond(protocol.encode(reply_for([Proposal()])))
    await nc.subscribe(SUBJECT, cb=on_msg)


async def test_the_breaker_stops_waiting_on_a_slow_service_and_closes_when_it_recovers(nats_server):
    nc = await connect(nats_server.url)
    delay = {"s": 0.5}
    await responder(nc, delay)
    drafter = RemoteDrafter(nc, asyncio.get_running_loop(), SUBJECT, timeout_s=0.1,
                            breaker=CircuitBreaker(threshold=3, cooldown_s=1.0))
    try:
        def steps(n: int) -> list[float]:  # n engine steps, on a thread like the engine's: each one's wait
            waits = []
            for _ in range(n):
                t0 = time.monotonic()
                drafter.propose(SEQS, 4)
                waits.append(time.monotonic() - t0)
            return waits

        waits = await asyncio.to_thread(steps, 50)
        assert drafter.timeouts == 3 and drafter.breaker.state == "open"
        # 47 steps did not wait: each took well under the 0.1 s timeout (a bound with room for a loaded CI host)
        assert sum(w >= 0.1 for w in waits) == 3 and max(waits[3:]) < 0.08
        delay["s"] = 0.0                                  # the service recovers
        await asyncio.sleep(1.1)                          # the cooldown ends
        waits = await asyncio.to_thread(steps, 1)         # that step sends the trial and does not wait for it
        # half-open until the trial's reply lands (with no delay it may already have: closed)
        assert waits[0] < 0.08 and drafter.breaker.state in ("half-open", "closed")
        for _ in range(100):
            if drafter.breaker.state == "closed":
                break
            await asyncio.sleep(0.01)
        assert drafter.breaker.state == "closed"          # the trial's reply closed it
        calls = drafter.breaker.skipped
        await asyncio.to_thread(steps, 5)
        assert drafter.breaker.skipped == calls and drafter.timeouts == 3 and drafter.breaker.state == "closed"
    finally:
        await nc.close()


@pytest.mark.parametrize("budget_s, served", [(0.2, 1), (0.0, 5)])
async def test_the_draft_service_drops_requests_that_waited_past_their_budget(nats_server, tmp_path, budget_s,
                                                                              served):
    """Five requests at once on a drafter taking 0.3 s each: with a 0.2 s budget only the first is drafted (the
    others waited too long: their askers decoded without them); without a budget all five are."""
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=2)
    service = DraftService(DraftConfig(nats_url=nats_server.url, worker_id="draft-0", model=str(folder),
                                       drafter="self:1", dtype="float64", threads=1, heartbeat_s=0.2))
    await service.start()
    nc = await connect(nats_server.url)
    try:
        service.drafter = SlowDrafter(service.drafter, delay_s=0.3)
        req = protocol.encode(request_for(SEQS, 2, 64, budget_s))

        async def ask() -> bool:
            try:
                await nc.request(service.subject, req, timeout=3.0)
                return True
            except Exception:  # noqa: BLE001 - a dropped request times out
                return False
        answered = await asyncio.gather(*(ask() for _ in range(5)))
    finally:
        await nc.close()
        await service.shutdown()
    assert service.served == served and sum(answered) == served
    assert service.stale == 5 - served
