"""Tenant clients made and revoked at run time: ``deepinfer up``'s desk for the operator's ``ClientAdmin``
requests on ``subjects.launcher_clients()``, and the operator's side (``deepinfer client add|remove|list``).

``add`` gives tenant ``t`` a NATS user ``client-<t>`` with a fresh password; the embedded nats-server reloads its
users (``EmbeddedNatsServer.set_users``: nothing restarts, no connection drops) and the router, whose permission to
stream to tenant inboxes is rendered from the tenant list, may then answer ``_INBOX.client-<t>.>``. The client
publishes only ``di.v1.generate.<t>`` (and its cancel and held subjects) and hears only its own inbox, so two
clients can neither read each other's streams nor submit as each other, and the router salts the cache with and
accounts by that tenant, as for tenants made at start-up. ``remove`` takes the user out and reloads: the server
closes that user's connections and refuses new ones. ``list`` names the tenants.

Invariants: only the ``admin`` user may ask and only the ``launcher`` user hears the requests; at most
``MAX_TENANTS`` tenants; a refused request (an unknown tenant to remove, one that exists to add, no auth on this
cluster) is an ``ErrorReply`` and changes nothing; the reply reaches the server (flushed) before the reload starts
(a reload voids pending replies), so ``request_clients`` waits until the new credential is accepted before
returning.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats

from shared import nats_auth, protocol, subjects
from shared.bus import connect, reply_error
from shared.errors import DeepinferError, ErrorCode, invalid
from shared.protocol_control import MAX_TENANTS

logger = logging.getLogger(__name__)

READY_WAIT_S = 10.0   # how long ``request_clients`` waits for a new credential to be accepted


class ClientDesk:
    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.nc = None
        self._reload = asyncio.Lock()

    async def start(self) -> None:
        self.nc = await self.cluster.connect_as(nats_auth.LAUNCHER, "launcher-clients")
        await self.nc.subscribe(subjects.launcher_clients(), cb=self.on_request)

    async def on_request(self, msg) -> None:
        try:
            req = protocol.decode(msg.data, protocol.ClientAdmin)
            reply = self.apply(req)
            if msg.reply:
                await msg.respond(protocol.encode(reply))
                # the server must have routed the reply before the reload starts: respond() only queues it in
                # this client, and a reload that lands first voids the reply's permission (the caller times out)
                with contextlib.suppress(nats.errors.TimeoutError):  # then reload anyway: the users changed
                    await self.nc.flush(timeout=5)
            if req.op != "list":
                async with self._reload:
                    await asyncio.to_thread(self.cluster.reload_users)
                logger.info("tenant client %s: %s", req.tenant, "added" if req.op == "add" else "removed")
        except DeepinferError as err:
            logger.info("client request refused: %s", err)
            await reply_error(self.nc, msg, err)

    def apply(self, req: protocol.ClientAdmin) -> protocol.ClientAdminReply:
        """Change the cluster's users for ``req`` (the caller reloads the server); the reply to send."""
        cluster = self.cluster
        tenants = cluster.spec.tenants
        if req.op == "list":
            return protocol.ClientAdminReply(tenants=list(tenants))
        try:
            user = nats_auth.tenant_user(req.tenant)
        except ValueError as err:
            raise invalid(str(err)) from None
        if req.op == "add":
            if req.tenant in tenants:
                raise invalid(f"tenant {req.tenant!r} already has a client (remove it first)")
            if len(tenants) >= MAX_TENANTS:
                raise DeepinferError(ErrorCode.OVERLOADED, f"at most {MAX_TENANTS} tenants")
            cluster.passwords[user] = nats_auth.new_password()
            tenants.append(req.tenant)
            return protocol.ClientAdminReply(tenants=list(tenants), user=user, password=cluster.passwords[user])
        if req.tenant not in tenants:
            raise invalid(f"no tenant {req.tenant!r} (tenants: {tenants})")
        tenants.remove(req.tenant)
        cluster.passwords.pop(user, None)
        return protocol.ClientAdminReply(tenants=list(tenants))

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()


async def request_clients(nc: nats.NATS, op: str, tenant: str = "", nats_url: str = "",
                          timeout: float = 10.0) -> protocol.ClientAdminReply:
    """Ask the launcher (``nc`` connected as ``admin``) to ``add``, ``remove`` or ``list``; ``DeepinferError`` on a
    refusal. After ``add`` with ``nats_url``, returns once the new credential logs in (the reload took effect)."""
    msg = await nc.request(subjects.launcher_clients(), protocol.encode(protocol.ClientAdmin(op=op, tenant=tenant)),
                           timeout=timeout)
    reply = protocol.decode_reply(msg.data, protocol.ClientAdminReply)
    if op == "add" and nats_url:
        await wait_accepted(nats_url, reply.user, reply.password)
    return reply


async def wait_accepted(nats_url: str, user: str, password: str, wait_s: float = READY_WAIT_S) -> None:
    """Return once ``user`` can log in at ``nats_url``; ``unavailable`` after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            probe = await connect(nats_url, "client-check", user=user, password=password)
        except Exception as err:  # noqa: BLE001 - not reloaded yet: authorization refused
            if time.monotonic() > deadline:
                raise DeepinferError(ErrorCode.UNAVAILABLE, f"the new client {user} was not accepted: {err}") from None
            await asyncio.sleep(0.1)
            continue
        await probe.close()
        return


def with_credentials(nats_url: str, user: str, password: str) -> str:
    """``nats_url`` (the first server; any credentials in it replaced) carrying ``user:password``."""
    first = nats_url.split(",")[0]
    scheme, _, rest = first.rpartition("://")
    return f"{scheme or 'nats'}://{user}:{password}@{rest.rpartition('@')[2]}"


async def run_cli(args, emit) -> int:
    """``deepinfer client add|remove|list [TENANT] --nats-url nats://admin:...@host:port``."""
    nc = await connect(args.nats_url, "deepinfer-client-admin", user=args.user, password=args.password)
    try:
        reply = await request_clients(nc, args.op, args.tenant or "", args.nats_url)
    finally:
        await nc.close()
    if args.op == "add":
        emit(f"tenant {args.tenant}: {with_credentials(args.nats_url, reply.user, reply.password)}  "
             f"(publishes {subjects.generate_as(args.tenant)})")
    else:
        emit("tenants: " + (", ".join(reply.tenants) or "(none)"))
    return 0
