"""Failover when a worker does not accept, and when a worker drains: the client never sees it."""
import asyncio
import time

import pytest

from services.router.relay import AttemptFailed
from shared import protocol, subjects
from shared.bus import reply_error
from shared.errors import DeepinferError, ErrorCode
from tests.integration.conftest import connect
from tests.integration.services_harness import InProcessCluster, generate_once, reference_outputs, wait_until
from tests.model_factory import write_tiny_hf_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=7, max_position_embeddings=2048)


def request(prompt, max_tokens=10, **kw) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                    ignore_eos=True, timeout_s=60.0, **kw)


async def ghost_heartbeats(url: str, report: protocol.LoadReport, stop: asyncio.Event,
                           refusal: DeepinferError | None = None) -> None:
    """Heartbeats of a worker that is the most attractive one and never accepts: it subscribes to nothing (no
    responders), or with ``refusal`` answers every dispatch with that error (a worker that drains, before its
    draining heartbeat reached the router)."""
    nc = await connect(url)
    try:
        if refusal is not None:
            async def refuse(msg):
                await reply_error(nc, msg, refusal)
            for subject in (subjects.decode(report.worker_id), subjects.prefill(report.worker_id)):
                await nc.subscribe(subject, cb=refuse)
        while not stop.is_set():
            await nc.publish(subjects.load(report.worker_id, report.role), protocol.encode(report))
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def ghost_of(real, role: str) -> protocol.LoadReport:
    """An idle worker's heartbeat with ``real``'s model build and host (the placement's first choice)."""
    return protocol.LoadReport(worker_id="a-ghost", role=role, model_id=real.engine.model.config.model_id,
                               num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=10**6,
                               num_total_blocks=10**6, block_size=8, transports=["shm"],
                               host=real.runtime.info.host, timestamp=time.time(),
                               model_fingerprint=real.engine.fingerprint)


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_worker_without_responder_is_failed_over(nats_server, folder, role):
    """The policy's first choice is a worker with no responder on its subject (NoResponders): the router
    re-places the request on a live worker instead of answering `unavailable` (the old rule did)."""
    prompt = list(range(3, 40))
    expected = reference_outputs(folder, [prompt], 10)[0]
    async with InProcessCluster(nats_server.url, folder, transports="shm") as cluster:
        real = next(w for w in cluster.workers if w.config.role == role)
        stop = asyncio.Event()
        beating = asyncio.create_task(ghost_heartbeats(nats_server.url, ghost_of(real, role), stop))
        try:
            assert await wait_until(lambda: cluster.router.table.is_alive("a-ghost"))
            mode = "local" if role == "decode" else "remote"
            ids, _, usage = await generate_once(nats_server.url, request(prompt, prefill_mode=mode))
        finally:
            stop.set()
            await beating
    assert ids == expected
    assert usage["failovers"] == 1


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_a_refusal_is_re_placed_without_a_failover(nats_server, folder, role):
    """The policy's first choice answers `unavailable` (it drains; its draining heartbeat is not in yet): the
    request runs on another worker exactly, and ``usage["failovers"]`` stays 0 (no worker was lost, nothing
    ran twice). With ``max_refusals=0`` the same refusal ends the request with that error: the bound holds."""
    prompt = list(range(5, 44))
    expected = reference_outputs(folder, [prompt], 10)[0]
    mode = "local" if role == "decode" else "remote"
    refusal = DeepinferError(ErrorCode.UNAVAILABLE, "a-ghost is draining")
    for max_refusals in (4, 0):
        async with InProcessCluster(nats_server.url, folder, transports="shm",
                                    router_kw={"max_refusals": max_refusals}) as cluster:
            real = next(w for w in cluster.workers if w.config.role == role)
            stop = asyncio.Event()
            beating = asyncio.create_task(ghost_heartbeats(nats_server.url, ghost_of(real, role), stop, refusal))
            try:
                assert await wait_until(lambda: cluster.router.table.is_alive("a-ghost"))
                if max_refusals:
                    ids, _, usage = await generate_once(nats_server.url, request(prompt, prefill_mode=mode))
                else:
                    with pytest.raises(DeepinferError) as ended:
                        await generate_once(nats_server.url, request(prompt, prefill_mode=mode))
            finally:
                stop.set()
                await beating
        if max_refusals:
            assert ids == expected and usage["failovers"] == 0
        else:
            assert ended.value.code == ErrorCode.UNAVAILABLE and "draining" in ended.value.message


async def test_a_heartbeat_whose_body_disagrees_with_its_subject_is_ignored(nats_server, folder):
    """The subject's role (and, for instance users, id) is what NATS permissions bind to a credential: a draft
    (or any other) service posing as a decode worker in the body, or under another worker's id, is not
    believed; nor are KV events whose body names another worker than their subject."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1) as cluster:
        real = cluster.workers[0]
        report = protocol.LoadReport(worker_id="poser", role="decode", model_id=real.engine.model.config.model_id,
                                     num_running=0, num_waiting=0, kv_usage=0.0, num_free_blocks=10**6,
                                     num_total_blocks=10**6, block_size=8, transports=["shm"], host="h",
                                     timestamp=time.time(), model_fingerprint=real.engine.fingerprint)
        nc = await connect(nats_server.url)
        try:
            for subject in (subjects.load("poser", "draft"), subjects.load("someone-else", "decode")):
                await nc.publish(subject, protocol.encode(report))
            await nc.flush()
            await asyncio.sleep(0.5)
            assert "poser" not in cluster.router.table.workers and "someone-else" not in cluster.router.table.workers
            await nc.publish(subjects.load("poser", "decode"), protocol.encode(report))   # consistent: believed
            assert await wait_until(lambda: cluster.router.table.is_alive("poser"))
            # KV events likewise: blocks claimed for decode-0 under another id's subject are not indexed
            event = protocol.KVEvent(worker_id=real.config.worker_id, seq=10**6, kind="stored", block_hashes=[77])
            await nc.publish(subjects.kv_events("poser"), protocol.encode(event))
            await nc.flush()
            await asyncio.sleep(0.3)
            assert cluster.router.index.overlap([77]) == {}
            await nc.publish(subjects.kv_events("poser"), protocol.encode(
                protocol.KVEvent(worker_id="poser", seq=1, kind="stored", block_hashes=[77])))
            assert await wait_until(lambda: cluster.router.index.overlap([77]) == {"poser": 1})
        finally:
            await nc.close()


async def test_refusals_are_retryable_and_bad_input_is_not(nats_server, folder):
    """A draining worker's `unavailable` refusal is retryable (the router avoids it); `invalid_request` is not."""
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1) as cluster:
        relay, worker = cluster.router.relay, cluster.router.table.workers["decode-0"]
        work = protocol.DecodeLocalRequest(request_id="r~0", prompt_token_ids=[5, 6, 7],
                                           sampling={"max_tokens": 2, "temperature": 0.0}, reply_to="_INBOX.x")
        cluster.workers[0].runtime.draining = True  # refuses new work (as after withdraw)
        with pytest.raises(AttemptFailed) as refused:
            await relay._dispatch(worker, work)
        assert refused.value.code == ErrorCode.UNAVAILABLE and refused.value.workers == {"decode-0"}
        assert refused.value.refused  # re-placed without counting a failover
        cluster.workers[0].runtime.draining = False
        bad = protocol.DecodeLocalRequest(request_id="r~1", prompt_token_ids=[10**6], reply_to="_INBOX.x",
                                          sampling={"max_tokens": 2})
        with pytest.raises(Exception) as invalid:
            await relay._dispatch(worker, bad)
        assert not isinstance(invalid.value, AttemptFailed) and invalid.value.code == ErrorCode.INVALID_REQUEST


async def test_draining_decode_worker_hands_back_its_streams(nats_server, folder):
    """SIGTERM-style drain of a decode worker with long streams running: it withdraws (nothing new placed
    there), the grace period ends, and every stream is handed back and continued on the other decode worker:
    each client gets its whole stream, token for token the uninterrupted output."""
    prompts = [[5 + i, 6, 7, 8] * 6 for i in range(4)]
    tokens = 600   # streams that outlast the drain's grace on a fast host (300 ended within 0.6 s on one)
    expected = reference_outputs(folder, prompts, tokens)
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=2, drain_grace_s=0.1,
                                router_kw={"migrate_on_drain": False}) as cluster:   # the hand-back path
        tasks = [asyncio.create_task(generate_once(nats_server.url, request(p, tokens, prefill_mode="local")))
                 for p in prompts]
        victim = cluster.workers[0]
        assert await wait_until(lambda: len(victim.active) > 0)
        await victim.shutdown()
        assert victim.runtime.draining and not victim.active
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        survivor = cluster.router.table.workers["decode-1"]
        assert survivor.report.draining is False
    for (ids, _, usage), want in zip(results, expected):
        assert ids == want
        assert usage["completion_tokens"] == tokens
    assert any(usage["failovers"] for _, _, usage in results), "some streams were on the drained worker"


@pytest.mark.parametrize("lost", ["middle", "final"])
async def test_chunks_lost_in_transit_are_recovered_exactly(nats_server, folder, monkeypatch, lost):
    """A chunk vanishes between worker and router (as across a NATS restart): a gap in the workers' numbering,
    or a final chunk that never comes while no worker holds the request any more, re-places the stream from
    what the client has; the client gets the exact uninterrupted output (it used to get a short stream
    marked complete, or a timeout)."""
    prompt = list(range(3, 30))
    expected = reference_outputs(folder, [prompt], 12)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1,
                                router_kw={"stall_probe_s": 0.3}) as cluster:
        decode = cluster.workers[0]
        real_publish = decode.publish_output
        dropped = []

        async def lossy_publish(reply_to, seq, out, extra_usage=None):
            first_attempt = out.request_id.endswith("~0")
            if first_attempt and not dropped and ((lost == "middle" and seq == 4) or (lost == "final" and out.finished)):
                dropped.append(seq)  # fault injection: this chunk is lost in transit
                return
            await real_publish(reply_to, seq, out, extra_usage)

        monkeypatch.setattr(decode, "publish_output", lossy_publish)
        ids, _, usage = await generate_once(nats_server.url, request(prompt, 12, prefill_mode="local"))
    assert dropped and ids == expected
    assert usage["completion_tokens"] == 12 and usage["failovers"] == 1


async def test_a_hand_off_that_never_arrives_fails_over_before_the_hand_off_timeout(nats_server, folder, monkeypatch):
    """The prefill worker's hand-off request reaches no decode worker and no reply comes (a route not back
    after a link outage): the router sees the decode worker not holding the request while the prefill worker
    does, and fails over after ``HANDOFF_LOST_S``. The request's own deadline (60 s) is shorter than the
    prefill worker's hand-off timeout (120 s here): without that, the request would time out."""
    prompt = [9, 8, 7, 6, 5] * 8
    expected = reference_outputs(folder, [prompt], 20)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=2, handoff_timeout_s=120.0) as cluster:
        prefill = cluster.workers[0]
        real, lost = prefill.nc.request, []

        async def request_or_lose(subject, *args, **kwargs):
            if subject.startswith(subjects.DECODE_ALL.split("*")[0]) and not lost:   # any decode worker
                lost.append(subject)
                await asyncio.sleep(3600)              # the hand-off went nowhere: no reply, ever
            return await real(subject, *args, **kwargs)
        monkeypatch.setattr(prefill.nc, "request", request_or_lose)
        tokens, _, usage = await generate_once(nats_server.url, request(prompt, 20, prefill_mode="remote"))
    assert lost and tokens == expected and usage["failovers"] == 1


async def test_a_request_waits_out_a_late_heartbeat_instead_of_failing(nats_server, folder):
    """The only decode worker's heartbeat is late (fault injection: the router drops its beats and last saw it
    10 s ago, as on a starved host): a request waits for the worker to beat again and is served exactly; with ``worker_wait_s=0`` it is refused at once
    (``unavailable``: the rule that failed a CI run). Nothing is placed while no worker beats."""
    prompt = list(range(9, 40))
    expected = reference_outputs(folder, [prompt], 6)[0]
    for wait_s in (5.0, 0.0):
        async with InProcessCluster(nats_server.url, folder, prefill=0, decode=1,
                                    router_kw={"worker_wait_s": wait_s}) as cluster:
            table, update = cluster.router.table, cluster.router.table.update
            deaf = True
            table.update = lambda report, now=None: None if deaf else update(report, now)
            table.workers["decode-0"].last_seen -= 10.0
            asked = asyncio.create_task(generate_once(nats_server.url, request(prompt, max_tokens=6)))
            await asyncio.sleep(0.6)
            if wait_s:
                assert not asked.done() and not table.workers["decode-0"].inflight
                deaf = False
                ids, _, usage = await asyncio.wait_for(asked, 20)
            else:
                with pytest.raises(DeepinferError) as ended:
                    await asked
            deaf = False
    assert ids == expected and usage["failovers"] == 0
    assert ended.value.code == ErrorCode.UNAVAILABLE and "no decode worker is alive" in ended.value.message


async def test_a_request_to_a_router_that_has_not_heard_a_heartbeat_window_waits_for_the_workers(nats_server, folder):
    """A router that just started has heard no worker yet (fault injection: its table forgets every worker and
    hears none for 0.6 s): a request waits for the workers' first beats instead of ``unavailable`` (a CI run's
    first request after a cluster start got "no prefill worker is alive"); once the router has listened a whole
    window, a role nobody ever heard of is ``unavailable`` at once, the old rule."""
    prompt = list(range(9, 40))
    expected = reference_outputs(folder, [prompt], 6)[0]
    async with InProcessCluster(nats_server.url, folder, prefill=1, decode=1, transports="shm") as cluster:
        table, relay, update = cluster.router.table, cluster.router.relay, cluster.router.table.update
        deaf = True
        table.update = lambda report, now=None: None if deaf else update(report, now)
        table.workers.clear()
        relay.listening_since = time.monotonic()   # a fresh router
        asked = asyncio.create_task(generate_once(nats_server.url, request(prompt, max_tokens=6,
                                                                          prefill_mode="remote")))
        await asyncio.sleep(0.6)
        assert not asked.done()
        deaf = False
        ids, _, usage = await asyncio.wait_for(asked, 20)
        deaf = True
        table.workers.clear()
        relay.listening_since -= 60.0                # it has listened long: nobody there means nobody
        with pytest.raises(DeepinferError) as ended:
            await generate_once(nats_server.url, request(prompt, max_tokens=6))
        deaf = False
    assert ids == expected and usage["failovers"] == 0
    assert ended.value.code == ErrorCode.UNAVAILABLE
