"""Chaos: SIGKILL a decode worker, a prefill worker and the router, and restart nats-server, under streamed load.

Cluster: a test-owned nats-server + router + prefill-0/1 + decode-0/1 (real processes, tiny float64 model).
200 streamed greedy requests (distinct prompts, 8..64 tokens, remote and local prefill) run through 16
concurrent clients in five phases of 40; each phase's gate opens only once the previous phase's requests have
all ended, and each fault is injected as soon as half the clients' streams of that phase are mid-stream:

1. baseline;
2. SIGKILL decode-0, start decode-2 (a new name);
3. SIGKILL prefill-0, start prefill-2;
4. SIGKILL the router, start it again under the same id (``Cluster.respawn_router``);
5. stop nats-server, start it again on the same port (services reconnect by themselves).

A fault window runs from the fault until probe requests, one with remote and one with local prefill, are
served again. Every request is classified from its own raw inbox (``tests/chaos/harness.py``): completed (final
chunk, seq gap-free from 0, usage), errored (an error chunk/reply, a seq gap the client detected, or its own
idle timeout), lost (no final chunk and no error, outside a router/NATS window), duplicated (a seq received
twice, also after the final chunk), wrong (completed with tokens other than the single-process engine's greedy
ones, or completion_tokens != max_tokens). A request that ends in error is retried once, 1 s later, under a
new id. Asserts lost == duplicated == wrong == 0 and that every error belongs to
a request whose lifetime overlaps the router or the NATS window
(a worker SIGKILL must be invisible to clients: failover).
"""
from __future__ import annotations

import asyncio
import collections
import random
import time

import nats
import pytest

from shared import protocol
from tests.chaos.harness import (Outcome, Window, chaos_cluster, log_grep, make_prompt, overlaps, probe_until_served,
                                 reference, run_pool, stream_request, wall_clock)
from tests.integration.conftest import start_nats_server
from tests.model_factory import write_tiny_hf_folder

N_REQUESTS = 200
CONCURRENCY = 16
MIN_STREAMING = CONCURRENCY // 2  # a fault fires once this many of its phase's requests are mid-stream
PHASES = ["baseline", "kill decode-0", "kill prefill-0", "kill router", "restart nats-server"]
PER_PHASE = N_REQUESTS // len(PHASES)
ERROR_WINDOWS = ("kill router", "restart nats-server")  # the only faults a client may notice
MAX_TOKENS = (8, 64)
PROMPT_LEN = (16, 48)
IDLE_TIMEOUT_S = 12.0  # a client gives up on a stream after this long without a chunk
REQUEST_TIMEOUT_S = 30.0
PROBE_PROMPT = [250, 251, 252, 253] * 5
RETRY_AFTER_S = 1.0

# Fixed bug (router, services/router/relay.py ``_relay``): the router used to forward whatever worker chunks
# reached its attempt inbox without checking the workers' own seq, so chunks NATS dropped across a restart
# (core NATS is at-most-once) vanished from a stream that then ended "complete" with fewer tokens. The relay now
# re-places an attempt on a gap in the workers' numbering, or when the stream stalls while no worker holds it.
# tests/chaos/test_restart_lost_chunks.py is its regression test; here any wrong stream fails the test.


async def quiet(err: Exception) -> None:
    """nats-py error callback: connection errors while nats-server is down are expected here."""


def make_request(i: int, attempt: int) -> protocol.GenerateRequest:
    rng = random.Random(90_000 + i)
    return protocol.GenerateRequest(
        request_id=f"chaos-{i}" + ("-retry" if attempt else ""),
        prompt_token_ids=make_prompt(i, rng.randint(*PROMPT_LEN), seed=2), max_tokens=rng.randint(*MAX_TOKENS),
        temperature=0.0, ignore_eos=True, timeout_s=REQUEST_TIMEOUT_S,
        prefill_mode="local" if i % 3 == 0 else "remote")


@pytest.mark.timeout(240)
async def test_kill_and_restart_every_component_under_load(tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=9, max_position_embeddings=4096)
    server = start_nats_server()
    cluster = chaos_cluster(server, folder, prefill=2, decode=2, drain_grace_s="2")
    attempts: dict[int, list[Outcome]] = collections.defaultdict(list)
    lingering: list[asyncio.Task] = []
    windows: dict[str, Window] = {}
    in_flight_at_fault: dict[str, int] = {}
    gates = [asyncio.Event() for _ in PHASES]
    in_flight: set[int] = set()
    streaming: set[str] = set()  # request ids between their first and their final chunk
    started: set[int] = set()
    nc = None
    t0 = time.monotonic()
    try:
        await cluster.start()
        t_up = time.monotonic()
        # the client outlives the nats-server restart (reconnects, resubscribes its inboxes)
        nc = await nats.connect(server.url, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.25,
                                error_cb=quiet)

        async def job(i: int) -> None:
            await gates[i // PER_PHASE].wait()
            in_flight.add(i)
            started.add(i)
            try:
                for attempt in range(2):
                    out = await stream_request(nc, make_request(i, attempt), IDLE_TIMEOUT_S, lingering=lingering,
                                               streaming=streaming)
                    attempts[i].append(out)
                    if out.completed:
                        return
                    if attempt == 0:
                        await asyncio.sleep(RETRY_AFTER_S)
            finally:
                in_flight.discard(i)

        async def when_loaded(phase: int) -> None:
            """Open the phase's gate; return as soon as MIN_STREAMING of its requests are mid-stream (a phase
            of these short requests can end within a second: a fixed wait could let the fault hit nothing)."""
            gates[phase].set()
            deadline = time.monotonic() + 10
            while len(streaming) < MIN_STREAMING and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            in_flight_at_fault[PHASES[phase]] = len(streaming)

        async def wait_phase_done(phase: int) -> None:
            """Until every request of ``phase`` has ended (retry included): phases do not overlap."""
            while sum(1 for i in started if i // PER_PHASE == phase and i not in in_flight) < PER_PHASE:
                await asyncio.sleep(0.05)

        load = asyncio.create_task(run_pool(CONCURRENCY, job, lambda i: i < N_REQUESTS))
        try:
            gates[0].set()
            await wait_phase_done(0)

            async def replace(role: str) -> None:  # SIGKILL <role>-0, start <role>-2
                cluster.kill(f"{role}-0")
                await cluster.wait_healthy([cluster.spawn_worker(role, 2)], timeout=90)

            async def restart_router() -> None:
                cluster.kill("router")
                cluster.respawn_router()
                await cluster.wait_healthy(["router"], timeout=90)

            async def restart_nats() -> None:
                server.stop()
                await asyncio.sleep(1.0)
                server.restart()
                live = [name for name, p in cluster.procs.items() if p.poll() is None]
                await cluster.wait_healthy(live, timeout=60)

            faults = [lambda: replace("decode"), lambda: replace("prefill"), restart_router, restart_nats]
            for phase, fault in enumerate(faults, start=1):
                await when_loaded(phase)
                windows[PHASES[phase]] = w = Window(PHASES[phase], time.monotonic())
                await fault()
                w.t1 = await probe_until_served(nc, PROBE_PROMPT, 60, tag=f"probe-{phase}")
                if phase < len(faults):  # the last phase's requests are awaited with the load below
                    await wait_phase_done(phase)
        finally:
            for gate in gates:  # never leave a client waiting at a gate
                gate.set()
            await asyncio.wait_for(load, timeout=2 * (REQUEST_TIMEOUT_S + 20))
            await asyncio.gather(*lingering)
        t_load = time.monotonic()
    finally:
        if nc is not None:
            await nc.close()
        cluster.stop()
        server.stop()
    assert all(p.poll() is not None for p in cluster.procs.values()), "no orphan processes"

    ids = sorted(attempts)
    expected = dict(zip(ids, reference(folder, [make_request(i, 0).prompt_token_ids for i in ids],
                                       [make_request(i, 0).max_tokens for i in ids])))
    error_windows = [windows[name] for name in ERROR_WINDOWS]
    completed, errored, lost, duplicated, wrong, outside, garbled = [], [], [], [], [], [], []
    for i in ids:
        outs = attempts[i]
        if any(o.duplicates or o.late for o in outs):
            duplicated.append(i)
        if any(o.undecodable for o in outs):
            garbled.append(i)
        for o in outs:
            if o.completed and (o.tokens != expected[i] or o.usage.get("completion_tokens") != o.request.max_tokens):
                wrong.append(i)
            if not o.completed:
                in_window = any(overlaps(o, w) for w in error_windows)
                if o.client_timeout and not in_window:
                    lost.append(i)
                elif not in_window:
                    outside.append(i)
        if any(o.completed for o in outs):
            completed.append(i)
        if any(not o.completed for o in outs):
            errored.append(i)
    wrong, lost, outside = sorted(set(wrong)), sorted(set(lost)), sorted(set(outside))
    per_window = {w.name: sum(1 for outs in attempts.values() for o in outs if not o.completed and overlaps(o, w))
                  for w in error_windows}
    failed_over = sum(1 for outs in attempts.values() for o in outs if o.completed and o.usage.get("failovers"))
    errors_by_kind: dict[str, list[Outcome]] = collections.defaultdict(list)
    for outs in attempts.values():
        for o in outs:
            if not o.completed:
                kind = (o.error or {}).get("code") or ("seq gap" if o.gaps else f"client {o.client_timeout} timeout")
                errors_by_kind[kind].append(o)
    error_times = {kind: f"{len(e)} at {min(o.t_start for o in e) - t_up:.1f}..{max(o.t_end for o in e) - t_up:.1f}"
                   for kind, e in errors_by_kind.items()}
    print(f"\nchaos kill/restart: sent={len(ids)} completed={len(completed)} errored={len(errored)} lost={len(lost)} "
          f"duplicated={len(duplicated)} wrong={len(wrong)}\n"
          f"  retried={sum(len(o) > 1 for o in attempts.values())} unrecovered={len(ids) - len(completed)} "
          f"completed after a failover={failed_over} garbled={len(garbled)} "
          f"errors outside the router/NATS windows={len(outside)}\n"
          f"  errors by kind (s after start) {error_times}; erroring attempts overlapping each window {per_window}\n"
          f"  mid-stream at each fault {in_flight_at_fault}; windows (s after start) "
          + ", ".join(f"{w.name} {w.t0 - t_up:.1f}..{w.t1 - t_up:.1f} ({wall_clock(w.t0)}..{wall_clock(w.t1)})"
                      for w in windows.values())
          + f"\n  wall: cluster up {t_up - t0:.1f} s, load {t_load - t_up:.1f} s")

    def show(what: str, bad: list[int]) -> str:
        lines = []
        for i in bad[:6]:
            for o in attempts[i]:
                lines.append(f"  {o.describe(t_up)}")
                if i in wrong and o.completed:
                    want = expected[i]
                    first = next((k for k, (a, b) in enumerate(zip(o.tokens, want)) if a != b),
                                 min(len(o.tokens), len(want)))
                    lines.append(f"    got {len(o.tokens)} tokens, want {len(want)}; first difference at {first}: "
                                 f"got {o.tokens[first:first + 6]} want {want[first:first + 6]}")
        return f"{what} ({len(bad)}: {bad[:20]}):\n" + "\n".join(lines)

    problems = [show(what, bad) for what, bad in [
        ("lost: neither a final chunk nor an error, outside the router/NATS windows", lost),
        ("duplicated: a chunk received twice", duplicated), ("garbled: an undecodable reply", garbled),
        ("wrong: completed with other tokens than the uninterrupted greedy ones", wrong),
        ("errors outside the router/NATS windows", outside)] if bad]
    assert len(ids) == N_REQUESTS and len(windows) == len(PHASES) - 1
    assert all(in_flight_at_fault[p] > 0 for p in PHASES[1:]), f"every fault hits streams: {in_flight_at_fault}"
    assert not problems, "\n".join(problems) + "\nservice log lines:\n" + "\n".join(
        log_grep(cluster.log_dir, "ERROR", 20) + log_grep(cluster.log_dir, "Traceback", 10)
        + log_grep(cluster.log_dir, "WARNING", 20))
