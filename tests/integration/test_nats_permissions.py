"""Per-role NATS permissions against a real nats-server started with the generated users (shared/nats_auth.py).

Every message flow the services use is delivered between the roles that use it (connections made by
``shared.bus.connect``, so with each user's inbox prefix); spoofed heartbeats, KV events, hand-offs, ... are
refused by the server ("Permissions Violation" through ``error_cb``) and never reach an unrestricted observer;
nobody may subscribe to another user's inbox or to ``di.v1.>``.
"""
import asyncio
import logging

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from shared import nats_auth, protocol, subjects
from shared.bus import ServiceRuntime, connect
from shared.errors import DeepinferError, ErrorCode
from shared.kv.transport import sync_with_server
from shared.nats_auth import NatsUser
from shared.nats_server import start_embedded_server

TENANTS = ["a", "b"]
OBSERVER = "observer"  # an unrestricted user (permissions=None): what it does not receive was not delivered
SERVICES = ("router", "prefill", "decode", "draft", "cache-tier")
SPOOFS = {  # user -> subjects it must not publish on
    "client": [subjects.load("decode-0", "decode"), subjects.kv_events("decode-0"), subjects.decode("decode-0"), subjects.prefill("p"),
               subjects.cache_put("cache-0", "decode-0"), subjects.ctl("decode-0", "probe"), subjects.draft("m"),
               subjects.kv_pull("w", "t"), subjects.generate_as("a"), "_INBOX.router.x", "_INBOX.client-a.x",
               f"$KV.{subjects.REGISTRY_BUCKET}.decode-0", subjects.REGISTRY_API[1], subjects.WORK_CANCEL],
    "client-a": [subjects.GENERATE, subjects.CANCEL, subjects.generate_as("b"), subjects.cancel_as("b"),
                 subjects.load("x", "decode"), "_INBOX.client.x", subjects.WORK_CANCEL],
    # a role's credential heartbeats only as that role: no posing as a decode worker to be sent prompts
    "draft": [subjects.kv_events("d"), subjects.decode("d"), "_INBOX.router.x", subjects.GENERATE, subjects.CANCEL,
              subjects.load("d", "decode"), subjects.load("r", "router")],
    "cache-tier": [subjects.decode("d"), subjects.prefill("p"), "_INBOX.router.x", subjects.cache_put("c", "w"),
                   subjects.load("d", "decode"), subjects.load("p", "prefill")],
    "monitor": [subjects.load("x", "decode"), subjects.CANCEL, subjects.ctl("d", "probe"), subjects.kv_events("d"),
                subjects.launcher_scale()],
    "launcher": [subjects.launcher_scale(), subjects.load("x", "decode"), subjects.ctl("d", "probe"),
                 subjects.GENERATE, "_INBOX.router.x", subjects.decode("d"), subjects.launcher_clients()],
    # the operator only asks for tenant clients: it cannot scale, submit, or pose as the launcher answering
    "admin": [subjects.launcher_scale(), subjects.GENERATE, subjects.generate_as("a"), "_INBOX.launcher.x",
              subjects.load("x", "decode"), subjects.ctl("d", "probe")],
    "router": [subjects.kv_events("r"), subjects.cache_put("c", "w"), subjects.draft("m"), subjects.GENERATE,
               subjects.load("d", "decode")],
    "prefill": [subjects.prefill("p"), subjects.GENERATE, subjects.ctl("d", "probe"), "_INBOX.client.x",
                subjects.load("d", "decode")],
    "decode": [subjects.prefill("p"), subjects.GENERATE, "_INBOX.client.x",
               subjects.load("p", "prefill"), subjects.load("c", "cache_tier")],
    # an instance user is bound to its id: no heartbeat, registry entry or cache put under another
    "decode.decode-0": [subjects.load("decode-1", "decode"), subjects.cache_put("cache-0", "decode-1"),
                        subjects.kv_events("decode-1"),
                        f"$KV.{subjects.REGISTRY_BUCKET}.decode-1", "_INBOX.decode.decode-1.x", subjects.GENERATE],
    "cache-tier.cache-0": [subjects.load("cache-1", "cache_tier"), f"$KV.{subjects.REGISTRY_BUCKET}.cache-1"],
    "router.router": [subjects.load("router-2", "router"), subjects.kv_events("r"), "_INBOX.router.router-2.x"],
    # a switchable worker heartbeats as prefill or decode, under its own id only
    "worker.worker-0": [subjects.load("worker-1", "prefill"), subjects.load("worker-1", "decode"),
                        subjects.load("worker-0", "router"), subjects.kv_events("worker-1"), subjects.GENERATE,
                        f"$KV.{subjects.REGISTRY_BUCKET}.worker-1", subjects.cache_put("cache-0", "worker-1")],
}
INSTANCES = [u for u in SPOOFS if "." in u]
FORBIDDEN_SUBS = {  # user -> patterns it must not subscribe to
    "client": ["_INBOX.router.>", "_INBOX.client-b.>", "di.v1.>", ">", subjects.LOAD_ALL, subjects.GENERATE],
    "client-a": ["_INBOX.client-b.>", "_INBOX.client.>", subjects.GENERATE_TENANTS, "_INBOX.>"],
    "prefill": ["_INBOX.router.>", subjects.GENERATE, subjects.DECODE_ALL],
    "decode": ["_INBOX.prefill.>", subjects.PREFILL_ALL, subjects.KV_EVENTS],
    "draft": [subjects.LOAD_ALL, subjects.KV_EVENTS, "_INBOX.decode.>"],
    "cache-tier": [subjects.PREFILL_ALL, "_INBOX.router.>"],
    "monitor": [subjects.KV_EVENTS, "_INBOX.router.>", subjects.GENERATE,
                subjects.launcher_scale()],   # a monitor credential cannot answer the planner's scale requests
    "launcher": [subjects.LOAD_ALL, subjects.KV_EVENTS, "_INBOX.router.>", subjects.GENERATE],
    "admin": [subjects.launcher_clients(), "_INBOX.launcher.>", "_INBOX.client-a.>", subjects.GENERATE_TENANTS],
    "router": ["_INBOX.client.>", subjects.PREFILL_ALL],
    # an instance hears only what is addressed to it: not another decode worker's hand-offs (prompts), inbox
    # or control; a tier only its own puts
    "decode.decode-0": [subjects.decode("decode-1"), subjects.DECODE_ALL, "_INBOX.decode.decode-1.>",
                        subjects.ctl("decode-0", "role"),  # only switchable workers take role orders
                        "_INBOX.decode.>", subjects.ctl("decode-1", "probe"), subjects.kv_pulls_of("prefill-0"),
                        subjects.kv_pull("decode-1", "t")],   # no answering a pull of another's transfer
    "cache-tier.cache-0": [subjects.cache_puts("cache-1"), subjects.cache_all("get"), subjects.KV_PULL_ALL],
    "router.router": [subjects.kv_pulls_of("decode-0")],
    "worker.worker-0": [subjects.prefill("worker-1"), subjects.decode("worker-1"), subjects.ctl("worker-1", "role"),
                        "_INBOX.worker.worker-1.>", subjects.kv_pull("worker-1", "t")],
}


class Env:
    def __init__(self, server, passwords: dict[str, str]) -> None:
        self.server, self.url, self.passwords = server, server.url, passwords

    async def raw(self, user: str) -> tuple[nats.NATS, list[str]]:
        """A plain nats-py connection as ``user`` that records the server's errors."""
        errors: list[str] = []

        async def on_error(err) -> None:
            errors.append(str(err))
        nc = await nats.connect(self.url, user=user, password=self.passwords[user], error_cb=on_error,
                                inbox_prefix=subjects.inbox_prefix(user), connect_timeout=5,
                                max_reconnect_attempts=0)
        return nc, errors

    async def bus(self, user: str) -> nats.NATS:
        return await connect(self.url, f"test-{user}", user=user, password=self.passwords[user])


@pytest.fixture(scope="module")
def env():
    passwords = {**nats_auth.generate_passwords(TENANTS), nats_auth.LAUNCHER: nats_auth.new_password(),
                 nats_auth.ADMIN: nats_auth.new_password(),
                 OBSERVER: "admin-password",
                 **{u: nats_auth.new_password() for u in INSTANCES}}
    users = [*nats_auth.users({u: p for u, p in passwords.items() if u != OBSERVER}, TENANTS),
             NatsUser(OBSERVER, passwords[OBSERVER])]
    server = start_embedded_server(users=users)
    try:
        yield Env(server, passwords)
    finally:
        server.stop()


@pytest.fixture
def no_violations(caplog):
    """The test's bus connections were refused nothing (``shared.bus`` logs refusals as warnings)."""
    caplog.set_level(logging.WARNING, logger="shared.bus")
    yield
    refused = [r.getMessage() for r in caplog.records if "NATS refused" in r.getMessage()]
    assert not refused


async def synced(nc: nats.NATS) -> None:
    """Return once the server has processed this connection's SUBs. nats-py's ``flush`` writes its PING ahead
    of still-pending commands; by the first PONG the flusher task has written them, so a second PING follows."""
    await nc.flush()
    await nc.flush()


async def wait_violation(errors: list[str], verb: str, subject: str) -> None:
    want = f'permissions violation for {verb} to "{subject}"'.lower()  # nats-py lowercases it
    for _ in range(200):
        if any(want in e.lower() for e in errors):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"no '{want}' reported; errors: {errors}")


async def test_unknown_user_wrong_password_and_no_credentials_fail_fast(env):
    """``shared.bus.connect`` raises at once on refused credentials (nats-py alone would retry forever)."""
    for user, password in (("client", "wrong"), ("nobody", "x"), ("", "")):
        with pytest.raises(DeepinferError, match="authorization violation") as info:
            await asyncio.wait_for(connect(env.url, "test", user=user, password=password), 5)
        assert info.value.code == ErrorCode.UNAVAILABLE and "wrong" not in str(info.value)
    nc = await connect(env.url.replace("nats://", f"nats://client:{env.passwords['client']}@"), "test")
    assert nc.new_inbox().startswith("_INBOX.client.")  # credentials and inbox prefix from the URL
    await nc.close()


@pytest.mark.parametrize("user", sorted(SPOOFS))
async def test_spoofed_publishes_are_refused_and_never_delivered(env, user):
    admin, _ = await env.raw(OBSERVER)
    seen: list[bytes] = []

    async def on_msg(msg) -> None:
        seen.append(msg.data)
    await admin.subscribe(">", cb=on_msg)
    await synced(admin)
    nc, errors = await env.raw(user)
    try:
        for subject in SPOOFS[user]:
            await nc.publish(subject, b"spoof")
            await wait_violation(errors, "publish", subject)
        allowed = nats_auth.permissions(user, TENANTS).publish[0].replace("*", "x")
        await nc.publish(allowed, b"allowed")  # control: the observer does see what is allowed
        await nc.flush()
        for _ in range(200):
            if b"allowed" in seen:
                break
            await asyncio.sleep(0.01)
        await admin.flush()
        assert b"allowed" in seen and b"spoof" not in seen
        assert nc.is_connected  # a refusal does not cost the connection
    finally:
        await nc.close()
        await admin.close()


@pytest.mark.parametrize("user", sorted(FORBIDDEN_SUBS))
async def test_foreign_inboxes_and_wildcards_cannot_be_subscribed(env, user):
    admin, _ = await env.raw(OBSERVER)
    nc, errors = await env.raw(user)
    try:
        subs = []
        for pattern in FORBIDDEN_SUBS[user]:
            subs.append(await nc.subscribe(pattern))
            await wait_violation(errors, "subscription", pattern)
        for pattern in FORBIDDEN_SUBS[user]:
            await admin.publish(pattern.replace("*", "x").replace(">", "x"), b"secret")
        await synced(admin)
        await synced(nc)
        for sub in subs:
            with pytest.raises(nats.errors.TimeoutError):
                await sub.next_msg(timeout=0.05)
    finally:
        await nc.close()
        await admin.close()


async def test_clients_reach_the_router_and_hear_its_stream(env, no_violations):
    """A client (plain or tenant) publishes its generate subject with its inbox; the router streams several
    chunks there (not a single NATS reply: explicit permission) and hears the client's cancel."""
    router = await env.bus("router")
    try:
        for user, tenant in (("client", None), ("client-a", "a")):
            client = await env.bus(user)
            got: asyncio.Queue = asyncio.Queue()

            async def on_generate(msg) -> None:
                for i in range(3):
                    await router.publish(msg.reply, bytes([i]))
            gen = await router.subscribe(subjects.generate_as(tenant) if tenant else subjects.GENERATE,
                                         queue="routers", cb=on_generate)
            async def on_cancel(msg) -> None:
                await got.put(msg.data)
            cancel = await router.subscribe(subjects.cancel_as(tenant) if tenant else subjects.CANCEL, cb=on_cancel)
            await synced(router)
            inbox = client.new_inbox()
            assert inbox.startswith(f"_INBOX.{user}.")
            sub = await client.subscribe(inbox)
            await synced(client)
            await client.publish(gen.subject, b"request", reply=inbox)
            assert [(await sub.next_msg(timeout=2)).data for _ in range(3)] == [b"\0", b"\1", b"\2"]
            await client.publish(cancel.subject, b"cancel")
            assert await asyncio.wait_for(got.get(), 2) == b"cancel"
            await gen.unsubscribe()
            await cancel.unsubscribe()
            await client.close()
    finally:
        await router.close()


FLOWS = [  # (requester or publisher, responder or subscriber, subject, is a request) as the services use them
    ("router", "prefill", subjects.prefill("prefill-0"), True), ("router", "decode", subjects.decode("d-0"), True),
    ("router", "prefill", subjects.WORK_CANCEL, False), ("router", "decode", subjects.WORK_CANCEL, False),
    ("router", "prefill", subjects.ctl("prefill-0", "probe"), True),
    ("router", "decode", subjects.ctl("d-0", "kv_snapshot"), True),
    ("router", "cache-tier", subjects.ctl("cache-0", "kv_snapshot"), True),
    ("prefill", "decode", subjects.decode("d-0"), True),                        # the KV hand-off
    ("decode", "prefill", subjects.kv_pull("prefill-0", "r1"), True),                    # stream transport pulls
    ("cache-tier", "prefill", subjects.kv_pull("prefill-0", "w1"), True),                # the tier pulls write-backs
    ("cache-tier", "decode", subjects.kv_pull("decode-0", "w1"), True),
    ("prefill", "cache-tier", subjects.kv_pull("cache-0", "g1"), True),                  # workers pull the tier's gets
    ("decode", "cache-tier", subjects.kv_pull("cache-0", "g2"), True),
    *((w, "cache-tier", subjects.cache_put("cache-0", f"{w}-0") if op == "put" else subjects.cache(op, "cache-0"),
       op != "release") for w in ("prefill", "decode") for op in ("put", "get", "release")),
    ("decode", "draft", subjects.draft("model"), True),
    *(("monitor", s, subjects.stats(f"{s}-0"), True) for s in SERVICES),
    *((s, o, subjects.load(f"{s}-0", s.replace("-", "_")), False) for s in SERVICES for o in ("router", "monitor")),
    ("cache-tier", "prefill", subjects.load("cache-0", "cache_tier"), False),
    ("cache-tier", "decode", subjects.load("c-0", "cache_tier"), False),
    ("router", "decode", subjects.load("router-0", "router"), False),         # workers watch their routers
    # instance users, addressed by their ids
    ("router.router", "decode.decode-0", subjects.decode("decode-0"), True),
    ("decode.decode-0", "cache-tier.cache-0", subjects.cache_put("cache-0", "decode-0"), True),
    ("decode", "cache-tier.cache-0", subjects.cache_put("cache-0", "decode-7"), True),  # role user: any writer
    ("decode.decode-0", "cache-tier.cache-0", subjects.cache("get", "cache-0"), True),
    ("cache-tier.cache-0", "decode.decode-0", subjects.kv_pull("decode-0", "w2"), True),   # the tier pulls a put
    ("decode.decode-0", "cache-tier.cache-0", subjects.kv_pull("cache-0", "g3"), True),   # a worker pulls a get
    ("router.router", "cache-tier.cache-0", subjects.ctl("cache-0", "kv_snapshot"), True),
    ("decode.decode-0", "router.router", subjects.load("decode-0", "decode"), False),
    ("router.router", "decode.decode-0", subjects.ctl("decode-0", "migrate"), True),      # live migration
    ("decode", "decode.decode-0", subjects.decode("decode-0"), True),                     # the moved stream
    *((s, "router", subjects.kv_events(f"{s}-0"), False) for s in ("prefill", "decode", "cache-tier")),
    ("decode.decode-0", "router.router", subjects.kv_events("decode-0"), False),
    # a switchable worker: the planner's order, work of either role, heartbeats and hand-offs of either role
    ("router.router", "worker.worker-0", subjects.ctl("worker-0", "role"), True),
    ("router.router", "worker.worker-0", subjects.prefill("worker-0"), True),
    ("router.router", "worker.worker-0", subjects.decode("worker-0"), True),
    ("worker.worker-0", "router.router", subjects.load("worker-0", "prefill"), False),
    ("worker.worker-0", "router.router", subjects.load("worker-0", "decode"), False),
    ("worker.worker-0", "decode.decode-0", subjects.decode("decode-0"), True),   # its hand-off as a prefill worker
    ("decode.decode-0", "worker.worker-0", subjects.kv_pull("worker-0", "t9"), True),
    ("worker.worker-0", "cache-tier.cache-0", subjects.cache_put("cache-0", "worker-0"), True),
    ("router.router", "launcher", subjects.launcher_scale(), True),   # the planner asks `deepinfer up` to scale
]


async def test_every_service_flow_is_delivered(env, no_violations):
    conns = {u: await env.bus(u) for u in (*SERVICES, *INSTANCES, "monitor", "launcher")}
    try:
        for sender, receiver, subject, is_request in FLOWS:
            got: asyncio.Queue = asyncio.Queue()

            async def on_msg(msg, rx=conns[receiver]) -> None:
                await got.put(msg.data)
                if msg.reply:
                    await rx.publish(msg.reply, b"reply")  # allow_responses
            sub = await conns[receiver].subscribe(subject, cb=on_msg)
            await synced(conns[receiver])
            if is_request:
                reply = await conns[sender].request(subject, b"x", timeout=2)
                assert reply.data == b"reply", (sender, receiver, subject)
            else:
                await conns[sender].publish(subject, b"x")
            assert await asyncio.wait_for(got.get(), 2) == b"x", (sender, receiver, subject)
            await sub.unsubscribe()
        # token chunks to the inbox a PrefillRequest / DecodeLocalRequest names (the router's)
        for router in ("router", "router.router"):
            inbox = conns[router].new_inbox()
            sub = await conns[router].subscribe(inbox)
            await synced(conns[router])
            for worker in ("prefill", "decode", "decode.decode-0"):
                await conns[worker].publish(inbox, worker.encode())
                assert (await sub.next_msg(timeout=2)).data == worker.encode()
        for user in (*SERVICES, *INSTANCES):  # the transports' barrier: a message to one's own inbox
            await sync_with_server(conns[user], 2.0)
    finally:
        for nc in conns.values():
            await nc.close()


async def test_services_heartbeat_and_register(env, no_violations):
    """Each service role (and instance user, under its own id) publishes its heartbeat and keeps its registry
    entry (JetStream KV) up to date."""
    admin, _ = await env.raw(OBSERVER)
    try:
        beats: set[str] = set()

        async def on_load(msg) -> None:
            beats.add(protocol.decode(msg.data, protocol.LoadReport).worker_id)
        await admin.subscribe(subjects.LOAD_ALL, cb=on_load)
        for user, worker_id in [*((u, f"{u}-9") for u in SERVICES), *((u, u.split(".")[1]) for u in INSTANCES)]:
            role = user.split(".")[0].replace("-", "_").replace(nats_auth.SWITCHABLE, "decode")
            info = protocol.WorkerInfo(worker_id=worker_id, role=role, model_id="", host="h",
                                       pid=1, transports=[], block_size=0, started_at=0.0)
            rt = ServiceRuntime(await env.bus(user), info, heartbeat_s=0.2)
            rt.start_heartbeat(lambda: {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_free_blocks": 0,
                                        "num_total_blocks": 0})
            registry = None
            for _ in range(100):
                try:
                    registry = registry or await admin.jetstream().key_value(subjects.REGISTRY_BUCKET)
                    if info.worker_id in beats and (await registry.get(info.worker_id)).value:
                        break
                except Exception:  # noqa: BLE001 - bucket or entry not there yet
                    pass
                await asyncio.sleep(0.05)
            else:
                pytest.fail(f"{user}: heartbeat {info.worker_id in beats}, no registry entry")
            await rt.close()  # deletes the entry
            with pytest.raises(KeyNotFoundError):
                await registry.get(info.worker_id)
    finally:
        await admin.close()
