"""FairGate (services/router/fair_gate.py): per-tenant bounds and fair dispatch order at the router's door."""
from __future__ import annotations

import asyncio
import time

import pytest

from services.router.fair_gate import FairGate
from services.router.config import parse_weights
from shared.errors import DeepinferError, ErrorCode


class Run:
    """Requests through a gate: each holds its slot until released; ``order`` records who got a slot when."""

    def __init__(self, gate: FairGate) -> None:
        self.gate, self.order, self.release, self.tasks = gate, [], {}, []

    def start(self, name: str, tenant: str, deadline_s: float = 60.0, priority: int = 0) -> asyncio.Task:
        done = asyncio.Event()
        self.release[name] = done

        async def request() -> None:
            async with self.gate.slot(tenant, time.monotonic() + deadline_s, priority):
                self.order.append(name)
                await done.wait()
        task = asyncio.create_task(request())
        self.tasks.append(task)
        return task

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)

    async def release_all(self) -> None:
        for done in self.release.values():
            done.set()
        await asyncio.gather(*self.tasks)


async def test_a_tenant_arriving_during_a_flood_is_served_next_not_after_it():
    gate = FairGate(lambda: 2, tenant_max=100)
    run = Run(gate)
    for i in range(8):
        run.start(f"a{i}", "acme")
    await run.settle()
    assert run.order == ["a0", "a1"] and gate.num_waiting == 6
    run.start("b0", "beta")
    await run.settle()
    run.release["a0"].set()
    await run.settle()
    assert run.order[2] == "b0"                      # ahead of a2..a7, which queued before it
    for name in ("a1", "b0", "a2"):
        run.release[name].set()
        await run.settle()
    assert run.order[:5] == ["a0", "a1", "b0", "a2", "a3"] and gate.dispatched == 2
    await run.release_all()
    assert gate.dispatched == 0 and gate.held == {} and gate.num_waiting == 0


async def test_headroom_keeps_slots_for_a_second_tenant_while_it_is_active():
    """Alone, a tenant fills the window; once another is active, the last floor(16 / 8) = 2 slots wait for a
    tenant below its share, so the newcomer's later requests start at once, not after a stream ends; when the
    newcomer has been idle for ``recent_s`` the first tenant fills the window again."""
    gate = FairGate(lambda: 16, tenant_max=100, recent_s=0.3)
    run = Run(gate)
    for i in range(30):
        run.start(f"a{i}", "acme")
    await run.settle()
    assert len(run.order) == 16                      # alone: the whole window
    run.start("b0", "beta")
    await run.settle()
    assert "b0" not in run.order                     # the window is full: it waits for a slot
    run.release["a0"].set()
    await run.settle()
    assert run.order[16] == "b0"
    for name in ("a1", "a2"):
        run.release[name].set()
        await run.settle()
    assert len(run.order) == 17 and gate.dispatched == 14    # two slots kept free for beta
    run.start("b1", "beta")
    await run.settle()
    assert run.order[-1] == "b1" and gate.dispatched == 15   # started at once
    for name in ("b0", "b1"):
        run.release[name].set()
    await asyncio.sleep(0.4)                         # beta idle past recent_s
    run.release["a3"].set()
    await run.settle()
    assert gate.dispatched == 16 and run.order[-1].startswith("a")   # acme alone again: the whole window
    await run.release_all()
    assert gate.dispatched == 0 and gate.dispatched_by == {} and gate.held == {}


async def test_weights_share_the_slots():
    gate = FairGate(lambda: 1, tenant_max=100, weights=parse_weights("heavy=2"))
    run = Run(gate)
    run.start("first", "light")
    await run.settle()
    for i in range(6):
        run.start(f"h{i}", "heavy")
        run.start(f"l{i}", "light")
    await run.settle()
    for _ in range(9):                               # one slot: release whoever holds it, nine times
        run.release[run.order[-1]].set()
        await run.settle()
    served = run.order[1:10]
    assert sum(n.startswith("h") for n in served) == 6 and sum(n.startswith("l") for n in served) == 3, served
    await run.release_all()


async def test_a_tenant_over_its_limit_is_refused_and_others_are_not():
    gate = FairGate(lambda: 1, tenant_max=3)
    run = Run(gate)
    for i in range(3):
        run.start(f"a{i}", "acme")
    await run.settle()
    refused = run.start("a3", "acme")
    await run.settle()
    assert refused.done() and isinstance(refused.exception(), DeepinferError)
    assert refused.exception().code == ErrorCode.OVERLOADED and "acme" in refused.exception().message
    run.tasks.remove(refused)
    run.start("b0", "beta")                           # another tenant still queues
    await run.settle()
    assert gate.held == {"acme": 3, "beta": 1}
    await run.release_all()


async def test_waiters_that_time_out_or_are_cancelled_take_no_slot():
    gate = FairGate(lambda: 1, tenant_max=10)
    run = Run(gate)
    run.start("holder", "acme")
    late = run.start("late", "beta", deadline_s=0.05)
    gone = run.start("gone", "beta")
    await run.settle()
    gone.cancel()
    with pytest.raises(DeepinferError) as err:
        await late
    assert err.value.code == ErrorCode.TIMEOUT
    with pytest.raises(asyncio.CancelledError):
        await gone
    run.start("next", "gamma")
    await run.settle()
    run.release["holder"].set()
    await run.settle()
    assert run.order == ["holder", "next"] and gate.dispatched == 1 and gate.held == {"gamma": 1}
    run.release["next"].set()
    await run.settle()
    assert gate.dispatched == 0 and gate.held == {}


async def test_no_known_window_means_no_waiting_and_a_grown_window_is_used():
    window = {"n": None}
    gate = FairGate(lambda: window["n"], tenant_max=100)
    run = Run(gate)
    for i in range(5):
        run.start(f"a{i}", "acme")
    await run.settle()
    assert len(run.order) == 5                        # unknown capacity: nobody waits (placement decides)
    window["n"] = 5
    run.start("b0", "beta")
    await run.settle()
    assert run.order[-1] != "b0"
    window["n"] = 6                                   # a decode worker joined: the waiter notices within PUMP_S
    await asyncio.sleep(1.2)
    assert run.order[-1] == "b0"
    await run.release_all()


def test_weights_spec():
    assert parse_weights(" acme=2, beta=0.5 ") == {"acme": 2.0, "beta": 0.5}
    for bad in ("acme", "acme=0", "=2", "acme=x", "acme=-1"):
        with pytest.raises(ValueError):
            parse_weights(bad)


async def test_a_freed_slot_goes_to_the_most_urgent_priority_then_by_tenant_share():
    """Window 1: a batch tenant queues a flood (priority 5) before two interactive requests (priority 0) of two
    tenants arrive; each freed slot goes to the interactive ones first, fair between their tenants, then the
    batch requests in their own order."""
    run = Run(FairGate(lambda: 1, tenant_max=16))
    run.start("first", "batch", priority=5)
    await run.settle()
    for i in range(3):
        run.start(f"batch-{i}", "batch", priority=5)
    await run.settle()
    run.start("chat-a", "a", priority=0)
    run.start("chat-a2", "a", priority=0)
    run.start("chat-b", "b", priority=0)
    await run.settle()
    for name in ["first", "chat-a", "chat-b", "chat-a2", "batch-0", "batch-1"]:
        run.release[name].set()
        await run.settle()
    await run.release_all()
    assert run.order == ["first", "chat-a", "chat-b", "chat-a2", "batch-0", "batch-1", "batch-2"]


async def test_an_urgent_request_dispatches_beyond_a_window_full_of_less_urgent_ones():
    """Window 2 full of batch streams: interactive requests take slots at once (the engines preempt a batch
    sequence for each) while fewer than the window are as urgent, never past twice the window; requests of the
    batch streams' priority wait."""
    gate = FairGate(lambda: 2, tenant_max=16)
    run = Run(gate)
    for i in range(2):
        run.start(f"batch-{i}", "etl", priority=1_000_000)
    run.start("batch-late", "etl", priority=1_000_000)
    await run.settle()
    assert run.order == ["batch-0", "batch-1"] and gate.num_waiting == 1
    for i in range(3):
        run.start(f"chat-{i}", "app", priority=-1_000_000)
    await run.settle()
    assert run.order == ["batch-0", "batch-1", "chat-0", "chat-1"] and gate.dispatched == 4   # 2 * window
    run.release["batch-0"].set()
    await run.settle()
    assert "chat-2" not in run.order and gate.dispatched == 3   # two as urgent are dispatched: the window's worth
    run.release["chat-0"].set()
    await run.settle()
    assert run.order[-1] == "chat-2" and gate.dispatched == 3
    run.release["chat-1"].set()
    await run.settle()
    assert "batch-late" not in run.order   # chat-2 and batch-1 hold the window
    run.release["batch-1"].set()
    await run.settle()
    assert run.order[-1] == "batch-late"
    await run.release_all()
    assert gate.dispatched == 0 and gate.dispatched_at == {} and gate.num_waiting == 0


async def test_a_full_router_sheds_the_least_urgent_waiting_request_for_a_more_urgent_one():
    gate = FairGate(lambda: 1, tenant_max=16)
    run = Run(gate)
    run.start("running", "etl", priority=5)
    first = run.start("batch-early", "etl", priority=5)
    late = run.start("batch-late", "etl", priority=5)
    await run.settle()
    assert not gate.shed_for(5)                       # nothing waiting is less urgent than 5
    assert gate.shed_for(0)                           # the latest of the least urgent waiters goes
    await run.settle()
    with pytest.raises(DeepinferError) as err:
        await late
    assert err.value.code == ErrorCode.OVERLOADED and "more urgent" in str(err.value)
    assert not first.done() and gate.num_waiting == 1 and gate.held["etl"] == 2
    assert gate.shed_for(0) and not gate.shed_for(0)   # batch-early goes; then nobody waits
    with pytest.raises(DeepinferError):
        await first
    run.tasks = [t for t in run.tasks if t not in (first, late)]
    await run.release_all()
    assert run.order == ["running"] and gate.dispatched == 0 and gate.held == {} and gate.num_waiting == 0


async def test_a_tenant_at_its_limit_sheds_its_own_least_urgent_waiting_request():
    gate = FairGate(lambda: 1, tenant_max=2)
    run = Run(gate)
    run.start("running", "app", priority=5)
    waiting = run.start("batch", "app", priority=5)
    other = run.start("other-tenant", "etl", priority=9)
    await run.settle()
    with pytest.raises(DeepinferError) as err:   # as urgent as its waiting one: over the limit
        async with gate.slot("app", time.monotonic() + 5, 5):
            pass
    assert err.value.code == ErrorCode.OVERLOADED and "limit" in str(err.value)
    run.start("chat", "app", priority=-1)
    await run.settle()
    with pytest.raises(DeepinferError, match="more urgent"):
        await waiting
    assert run.order == ["running", "chat"] and not other.done()   # another tenant's waiter is not touched
    run.tasks.remove(waiting)
    await run.release_all()
    assert gate.held == {} and gate._shed == {}
