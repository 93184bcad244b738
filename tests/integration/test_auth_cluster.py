"""A whole cluster under NATS authentication (``ClusterSpec(auth=True)``): every service runs as its own role
with only the permissions of shared/nats_auth.py (its own instance user, bound to its id), and a client connected as ``client`` still gets its answer
end to end (router -> prefill -> KV hand-off over the ``stream`` transport -> decode -> client, write-backs to
the cache tier, stats to the monitor). No service is refused anything, no password is on a command line, and a
respawned router gets its credentials again. A tenant's client (``client-a``) is served on its own subject."""
import asyncio
from pathlib import Path

import pytest

from shared import nats_auth, protocol, subjects
from shared.client import generate
from shared.errors import DeepinferError, ErrorCode
from cli.launcher import Cluster, ClusterSpec
from cli.status import collect
from tests.model_factory import write_tiny_hf_folder



@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=5)


async def generate_retrying(nc, request: protocol.GenerateRequest) -> list[int]:
    """A router placing work needs a heartbeat from each worker first: retry ``unavailable`` for a while."""
    for _ in range(40):
        try:
            return (await generate(nc, request))[0]
        except DeepinferError as err:
            if err.code != ErrorCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.25)
    pytest.fail("the router never placed the request")


async def test_cluster_with_auth_serves_a_client_end_to_end(folder, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")   # an operator's OpenMP policy reaches every engine
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, model=str(folder), kv_cache_mb=32, dtype="float64",
                                  local_prefill_threshold=0, transports="stream", auth=True, metrics=False,
                                  http_port=-1, tenants=["a"]))
    request = protocol.GenerateRequest(prompt_token_ids=list(range(3, 40)), max_tokens=4, temperature=0.0,
                                       ignore_eos=True, prefill_mode="remote")
    try:
        await cluster.start()
        assert cluster.client_credentials[0] == "client"
        roles = {"router": "router", "prefill-0": "prefill", "decode-0": "decode", "cache-0": "cache-tier"}
        for name, proc in cluster.procs.items():  # argv is world-readable: no password there
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
            assert not any(pw in cmdline for pw in cluster.passwords.values())
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert f"DEEPINFER_NATS_USER={roles[name]}.{name}".encode() in environ  # its own instance user
            assert b"OMP_WAIT_POLICY=PASSIVE" in environ
        nc = await cluster.connect_client()
        try:
            first = await generate_retrying(nc, request)
            assert len(first) == 4
        finally:
            await nc.close()
        nc = await cluster.connect_client(tenant="a")  # publishes di.v1.generate.a, hears _INBOX.client-a.>
        try:
            assert (await generate(nc, request, tenant="a"))[0] == first
        finally:
            await nc.close()

        monitor = await cluster.connect_as(nats_auth.MONITOR)
        try:  # the write-back reached the tier (it pulled the worker's staged blocks); stats answer the monitor
            for _ in range(40):
                report = await collect(monitor, listen_s=1.2)
                tier = (report["services"].get("cache-0") or {}).get("stats") or {}
                if tier.get("announced_blocks"):
                    break
            else:
                pytest.fail(f"the cache tier never stored the write-back: {report}")
            assert {"router", "prefill-0", "decode-0", "cache-0"} <= set(report["services"])
            assert all(s["stats"] is not None for s in report["services"].values())
            writers = tier["ledger"]["by_writer"]   # attributed to the worker whose credential sent the put
            assert set(writers) <= {"prefill-0", "decode-0"} and sum(w["puts"] for w in writers.values()) >= 1
        finally:
            await monitor.close()

        cluster.kill("router")
        cluster.respawn_router()
        cluster.spawn_router("router-2")   # a service started after the server: its user arrives by a reload
        await cluster.wait_healthy(["router", "router-2"], 60)
        assert "router.router-2" in cluster.passwords
        nc = await cluster.connect_client()
        try:
            assert await generate_retrying(nc, request) == first
        finally:
            await nc.close()
    finally:
        cluster.stop()
    assert all(p.poll() is not None for p in cluster.procs.values()), "no orphan processes"
    for name in cluster.procs:
        log = cluster.log_tail(name, 1 << 20)
        assert "NATS refused" not in log and "Authorization Violation" not in log, (name, log[-2000:])
        assert not any(pw in log for pw in cluster.passwords.values()), name


async def test_switchable_workers_change_role_under_their_instance_users(folder):
    """``--switchable`` workers log in as ``worker.<id>``: after the planner's order (sent here with the router's
    credentials) each heartbeats, and is sent work, under its new role; nothing is refused."""
    cluster = Cluster(ClusterSpec(prefill=1, decode=1, model=str(folder), kv_cache_mb=32, dtype="float64",
                                  local_prefill_threshold=0, transports="stream", auth=True, metrics=False,
                                  http_port=-1, cache_tier=0, switchable=True))
    request = protocol.GenerateRequest(prompt_token_ids=list(range(3, 40)), max_tokens=6, temperature=0.0,
                                       ignore_eos=True, prefill_mode="remote")
    try:
        await cluster.start()
        assert set(cluster.procs) == {"router", "worker-0", "worker-1"}
        for name in ("worker-0", "worker-1"):
            environ = Path(f"/proc/{cluster.procs[name].pid}/environ").read_bytes().split(b"\0")
            assert f"DEEPINFER_NATS_USER=worker.{name}".encode() in environ
        nc = await cluster.connect_client()
        try:
            first = await generate_retrying(nc, request)
        finally:
            await nc.close()
        router = await cluster.connect_as("router")
        try:
            for worker, role in (("worker-0", "decode"), ("worker-1", "prefill")):
                reply = await router.request(subjects.ctl(worker, "role"),
                                             protocol.encode(protocol.RoleSwitch(role=role)), timeout=60)
                assert protocol.decode_reply(reply.data, protocol.Ack).detail == role
        finally:
            await router.close()
        monitor = await cluster.connect_as(nats_auth.MONITOR)
        try:
            for _ in range(40):
                services = (await collect(monitor, listen_s=1.2))["services"]
                seen = {w: services.get(w, {}).get("load", {}).get("role") for w in ("worker-0", "worker-1")}
                if seen == {"worker-0": "decode", "worker-1": "prefill"}:
                    break
            else:
                pytest.fail(f"roles never changed: {seen}")
        finally:
            await monitor.close()
        nc = await cluster.connect_client()
        try:
            assert await generate_retrying(nc, request) == first   # prefilled by worker-1, decoded by worker-0
        finally:
            await nc.close()
    finally:
        cluster.stop()
    for name in cluster.procs:
        log = cluster.log_tail(name, 1 << 20)
        assert "NATS refused" not in log and "Authorization Violation" not in log, (name, log[-2000:])
    assert "switching prefill -> decode" in cluster.log_tail("worker-0", 1 << 20)


async def test_tenant_clients_are_added_and_revoked_at_run_time(folder):
    """``deepinfer client add`` (the ``admin`` user asking ``deepinfer up``'s desk): two tenants made while the
    cluster runs are served on their own subjects and accounted apart; neither can read the other's stream nor
    submit as the other (the server refuses it); a removed client's connection is closed and its login refused.
    Nothing restarts: the router's connection lives through the reloads."""
    import nats

    import argparse

    from cli.launcher_clients import ClientDesk, request_clients, run_cli
    from shared.bus import connect

    cluster = Cluster(ClusterSpec(prefill=0, decode=1, model=str(folder), kv_cache_mb=32, dtype="float64",
                                  auth=True, metrics=False, http_port=-1, cache_tier=0))
    request = protocol.GenerateRequest(prompt_token_ids=list(range(3, 30)), max_tokens=4, temperature=0.0,
                                       ignore_eos=True, prefill_mode="local")
    desk = ClientDesk(cluster)
    try:
        await cluster.start()
        await desk.start()
        router_pid = cluster.procs["router"].pid
        admin = await cluster.connect_as(nats_auth.ADMIN)
        try:
            a = await request_clients(admin, "add", "a", cluster.nats_url)
            b = await request_clients(admin, "add", "b", cluster.nats_url)
            assert (a.user, b.user, b.tenants) == ("client-a", "client-b", ["a", "b"])
            with pytest.raises(DeepinferError) as err:
                await request_clients(admin, "add", "a")
            assert err.value.code == ErrorCode.INVALID_REQUEST
            nc_a = await connect(cluster.nats_url, "a", user=a.user, password=a.password)
            nc_b = await connect(cluster.nats_url, "b", user=b.user, password=b.password)
            assert await generate_retrying_as(nc_a, request, "a") == await generate_retrying_as(nc_b, request, "b")
            errors: list[str] = []

            async def on_error(e) -> None:
                errors.append(str(e).lower())
            spy = await nats.connect(cluster.nats_url, user=a.user, password=a.password, error_cb=on_error,
                                     inbox_prefix=subjects.inbox_prefix(a.user), max_reconnect_attempts=0)
            await spy.subscribe(subjects.inbox_prefix(b.user) + ".>")   # b's streams
            await spy.publish(subjects.generate_as("b"), protocol.encode(request))   # submitting as b
            await spy.flush()
            for _ in range(100):
                if sum("permissions violation" in e for e in errors) >= 2:
                    break
                await asyncio.sleep(0.05)
            assert any("subscription" in e and "client-b" in e for e in errors), errors
            assert any("publish" in e and "generate.b" in e for e in errors), errors
            await spy.close()
            monitor = await cluster.connect_as(nats_auth.MONITOR)
            try:
                ledger = (await collect(monitor, listen_s=1.2))["services"]["router"]["stats"]["accounting"]
            finally:
                await monitor.close()
            assert {t: sum(line["requests"] for line in by_class.values())
                    for t, by_class in ledger["by_tenant"].items()} == {"a": 1, "b": 1}, ledger
            removed = await request_clients(admin, "remove", "b")
            assert removed.tenants == ["a"]
            for _ in range(100):
                if not nc_b.is_connected:
                    break
                await asyncio.sleep(0.05)
            assert not nc_b.is_connected
            with pytest.raises(DeepinferError, match="authorization violation"):
                await asyncio.wait_for(connect(cluster.nats_url, "b-again", user=b.user, password=b.password), 10)
            assert await generate_retrying_as(nc_a, request, "a")   # a is served on
            assert (await request_clients(admin, "list")).tenants == ["a"]
            said: list[str] = []   # the command line's path: `deepinfer client add c --nats-url <admin URL>`
            args = argparse.Namespace(op="add", tenant="c", nats_url=cluster.client_url(user=nats_auth.ADMIN),
                                      user="", password="")
            assert await run_cli(args, said.append) == 0
            url = said[0].split()[2]
            assert url.startswith("nats://client-c:") and "admin" not in url
            nc_c = await connect(url, "c")
            assert await generate_retrying_as(nc_c, request, "c")
            await nc_c.close()
            await nc_a.close()
            await nc_b.close()
        finally:
            await admin.close()
        assert cluster.procs["router"].poll() is None and cluster.procs["router"].pid == router_pid
    finally:
        await desk.close()
        cluster.stop()
    assert "NATS refused" not in cluster.log_tail("router", 1 << 20)


async def generate_retrying_as(nc, request: protocol.GenerateRequest, tenant: str) -> list[int]:
    for _ in range(40):
        try:
            return (await generate(nc, request, tenant=tenant))[0]
        except DeepinferError as err:
            if err.code != ErrorCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.25)
    pytest.fail("the router never placed the request")
