"""Every NATS subject of deepinfer, versioned under ``di.v1.``. No literal subject lives anywhere else.

Grammar: ``di.v1.<component>.<id>.<op>[.<arg>]``: the component (a service kind, or ``kv`` / ``ctl`` / ``work``),
the id of the one it addresses (a worker, tier, model or owner), the operation, and for a few operations one
more token. The client API (``generate``, ``cancel``, ``held``, each optionally ``.<tenant>``) is the one
exception, unchanged since v1 was published. Bodies are ``shared.protocol`` messages, msgpack-encoded:

- ``di.v1.generate``                   client API: GenerateRequest -> streamed TokenChunk replies (request/reply)
- ``di.v1.cancel``                     CancelRequest, broadcast: whoever owns the request stops it
- ``di.v1.generate.<tenant>``          the client API of an authenticated tenant (NATS user ``client-<tenant>``
                                       may publish only here): the router derives the cache salt from the tenant
- ``di.v1.cancel.<tenant>``            a tenant's cancels (the router stops only that tenant's requests)
- ``di.v1.prefill.<worker>.work``      PrefillRequest to one prefill worker
- ``di.v1.decode.<worker>.work``       KVHandoff / DecodeLocalRequest to one decode worker
- ``di.v1.<role>.<worker>.load``       LoadReport heartbeats; ``di.v1.*.*.load`` (LOAD_ALL) subscribes to all. The
                                       role is in the subject so that NATS permissions bind it to the credential
                                       (a role's user may publish only ``di.v1.<its role>.*.load``); the router
                                       drops a report whose body disagrees with its subject
- ``di.v1.kv.<worker>.events``         KVEvent: blocks stored/removed/cleared by a worker or the cache tier; the
                                       router drops an event whose body names another worker than its subject
                                       (an instance user may publish only its own)
- ``di.v1.kv.<owner>.pull.<transfer>`` ``stream`` KV transport: pulls of one transfer's payload chunks, served by
                                       the service that staged it (``owner``: an instance user may serve only
                                       its own transfers, so no peer can answer a pull with other bytes)
- ``di.v1.work.all.cancel``            router -> every worker: stop the work of a request
- ``di.v1.ctl.<service>.<op>``         control plane (stats, probe, migrate, ...) of one service
- ``di.v1.draft.<model>.propose``      draft-model proposals (queue group per model)
- ``di.v1.cache.<tier>.<op>``          one cache tier's operations: ``get``, ``release``, ``stats``
- ``di.v1.cache.<tier>.put.<writer>``  a put names its writer in the subject, so that NATS permissions bind it
                                       to the credential (an instance user may publish only its own writer
                                       token); the tier records the writer of every block it stores

Wildcard patterns (``*_ALL``, ``ctl_all``, ``cache_all``), inboxes (``inbox_prefix(user)``) and the registry's
JetStream subjects (``REGISTRY_KV``, ``REGISTRY_API``) exist for the per-role permissions in ``shared/nats_auth.py``.

``REGISTRY_BUCKET`` is the JetStream KV bucket (not a subject; bucket names may not contain dots) where
workers register a WorkerInfo under their worker id, with a TTL.

Invariant: every variable token (worker id, transfer id, service, op, model) is non-empty, printable and
contains no ``.``, ``*``, ``>`` or whitespace, so it is exactly one subject token and never a wildcard.
Builders raise ``ValueError`` otherwise. Names that may contain dots (model ids such as ``Qwen2.5-0.5B``)
go through ``safe_token`` first.
"""
from __future__ import annotations

import hashlib

PREFIX = "di.v1"

GENERATE = f"{PREFIX}.generate"
CANCEL = f"{PREFIX}.cancel"  # clients -> router (the router checks who may cancel what)
HELD = f"{PREFIX}.held"  # clients -> routers: "is my request still relayed?" (the owning router answers)
WORK_CANCEL = f"{PREFIX}.work.all.cancel"  # router -> workers: only the router role may publish it
KV_EVENTS = f"{PREFIX}.kv.*.events"  # every worker's KV events (``kv_events``)
GENERATE_TENANTS = f"{PREFIX}.generate.*"
CANCEL_TENANTS = f"{PREFIX}.cancel.*"
HELD_TENANTS = f"{PREFIX}.held.*"
LOAD_ALL = f"{PREFIX}.*.*.load"
REGISTRY_BUCKET = "di_v1_workers"

_FORBIDDEN = frozenset(".*>")
MAX_TOKEN_LEN = 128


def validate_token(token: str, what: str = "token") -> str:
    """Return ``token`` if it is one valid, literal subject token; raise ``ValueError`` otherwise."""
    if not isinstance(token, str) or not token:
        raise ValueError(f"{what} must be a non-empty string, got {token!r}")
    if len(token) > MAX_TOKEN_LEN:
        raise ValueError(f"{what} is longer than {MAX_TOKEN_LEN} characters: {token[:40]!r}...")
    for ch in token:
        if ch in _FORBIDDEN or ch.isspace() or not ch.isprintable():
            raise ValueError(f"{what} {token!r} contains a forbidden character {ch!r} "
                             "(no '.', '*', '>', whitespace or control characters)")
    return token


def safe_token(name: str) -> str:
    """Map an arbitrary non-empty name (e.g. a model id with dots) to a valid token, deterministically.

    Valid tokens are returned unchanged; otherwise forbidden characters become ``_`` and a short hash
    of the original is appended, so two distinct names never share a token.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    try:
        return validate_token(name)
    except ValueError:
        pass
    cleaned = "".join("_" if ch in _FORBIDDEN or ch.isspace() or not ch.isprintable() else ch
                      for ch in name)[:MAX_TOKEN_LEN - 9]
    digest = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{cleaned}-{digest}"


def generate_as(tenant: str) -> str:
    """Client API subject of one authenticated tenant (``GENERATE_TENANTS`` matches all of them)."""
    return f"{GENERATE}.{validate_token(tenant, 'tenant')}"


def cancel_as(tenant: str) -> str:
    """Where one tenant's clients cancel their requests (``CANCEL_TENANTS`` matches all of them)."""
    return f"{CANCEL}.{validate_token(tenant, 'tenant')}"


def held_as(tenant: str) -> str:
    """Where one tenant's clients ask whether a request is still relayed (``HELD_TENANTS`` matches all)."""
    return f"{HELD}.{validate_token(tenant, 'tenant')}"


def tenant_of(subject: str) -> str | None:
    """The tenant of a ``generate_as`` / ``cancel_as`` / ``held_as`` subject; None for the plain ones."""
    for base in (GENERATE, CANCEL, HELD):
        if subject.startswith(base + "."):
            return validate_token(subject[len(base) + 1:], "tenant")
    return None


def prefill(worker_id: str) -> str:
    """Subject of one prefill worker's PrefillRequests."""
    return f"{PREFIX}.prefill.{validate_token(worker_id, 'worker_id')}.work"


def decode(worker_id: str) -> str:
    """Subject of one decode worker's KVHandoff / DecodeLocalRequest messages."""
    return f"{PREFIX}.decode.{validate_token(worker_id, 'worker_id')}.work"


def load(worker_id: str, role: str) -> str:
    """Subject a service of ``role`` (``protocol_control.ROLES``) publishes its LoadReport heartbeats on
    (LOAD_ALL matches all of them)."""
    return f"{PREFIX}.{validate_token(role, 'role')}.{validate_token(worker_id, 'worker_id')}.load"


def kv_events(worker_id: str) -> str:
    """Subject of one worker's (or cache tier's) KVEvents."""
    return f"{PREFIX}.kv.{validate_token(worker_id, 'worker_id')}.events"


def kv_events_origin(subject: str) -> str:
    """The worker named by a ``kv_events`` subject."""
    return _named(subject, f"{PREFIX}.kv.*.events", "KV events")[0]


def _named(subject: str, pattern: str, what: str) -> list[str]:
    """The tokens of ``subject`` where ``pattern`` has ``*`` (each one valid); ``ValueError`` if it does not match."""
    want, parts = pattern.split("."), subject.split(".") if isinstance(subject, str) else []
    if len(parts) != len(want) or any(w != "*" and w != p for w, p in zip(want, parts)):
        raise ValueError(f"not a {what} subject: {subject!r:.200}")
    return [validate_token(p, what) for w, p in zip(want, parts) if w == "*"]


def load_role(role: str) -> str:
    """Every heartbeat subject of one role: what that role's NATS user may publish."""
    return f"{PREFIX}.{validate_token(role, 'role')}.*.load"


def load_origin(subject: str) -> tuple[str, str]:
    """``(role, worker id)`` named by a ``load`` subject."""
    role, worker = _named(subject, LOAD_ALL, "heartbeat")
    return role, worker


def kv_pull(owner: str, transfer_id: str) -> str:
    """Subject the ``stream`` transport of service ``owner`` serves one transfer's chunks on."""
    return f"{PREFIX}.kv.{validate_token(owner, 'owner')}.pull.{validate_token(transfer_id, 'transfer_id')}"


def kv_pulls_of(owner: str) -> str:
    """Every transfer ``owner`` serves: what an instance's NATS user may subscribe to."""
    return f"{PREFIX}.kv.{validate_token(owner, 'owner')}.pull.*"


def is_kv_pull(subject: str) -> bool:
    """True when ``subject`` is exactly one ``kv_pull`` subject (what a ``stream`` KV handle may name)."""
    if not isinstance(subject, str) or len(subject) > 2 * MAX_TOKEN_LEN + 24:
        return False
    try:
        _named(subject, KV_PULL_ALL, "KV pull")
    except ValueError:
        return False
    return True


def ctl(service: str, op: str) -> str:
    """Control-plane subject of one service and operation."""
    return f"{PREFIX}.ctl.{validate_token(service, 'service')}.{validate_token(op, 'op')}"


def draft(model: str) -> str:
    """Draft-model subject (served by a queue group). Pass ``safe_token(model_id)`` for ids with dots."""
    return f"{PREFIX}.draft.{validate_token(model, 'model')}.propose"


CACHE_OPS = ("put", "get", "release", "stats")


def cache(op: str, tier: str) -> str:
    """Subject of operation ``op`` (one of ``CACHE_OPS`` but ``put``, which names its writer: ``cache_put``)
    of the cache tier ``tier`` (its service id)."""
    if op not in CACHE_OPS or op == "put":
        raise ValueError(f"cache op must be one of {CACHE_OPS[1:]} (puts: cache_put), got {op!r}")
    return f"{PREFIX}.cache.{validate_token(tier, 'tier')}.{op}"


def cache_put(tier: str, writer: str) -> str:
    """Subject of a put by ``writer`` (the putting service's id) to the cache tier ``tier``."""
    return f"{PREFIX}.cache.{validate_token(tier, 'tier')}.put.{validate_token(writer, 'writer')}"


def cache_puts(tier: str) -> str:
    """Every put to the cache tier ``tier`` (what it serves)."""
    return f"{PREFIX}.cache.{validate_token(tier, 'tier')}.put.*"


def cache_puts_by(writer: str) -> str:
    """Every put by ``writer``, to any tier: what an instance's NATS user may publish."""
    return f"{PREFIX}.cache.*.put.{validate_token(writer, 'writer')}"


def cache_put_writer(subject: str) -> str:
    """The writer named by a ``cache_put`` subject."""
    return _named(subject, cache_all("put"), "cache put")[1]


LAUNCHER = "launcher"  # ``deepinfer up``'s own process, as a control-plane service


def launcher_scale() -> str:
    """Where the router's P:D planner asks ``deepinfer up`` for a worker more or less (``ScaleRequest``)."""
    return ctl(LAUNCHER, "scale")


def launcher_clients() -> str:
    """Where an operator (the ``admin`` NATS user: ``deepinfer client``) asks ``deepinfer up`` to add, remove or
    list tenant clients at run time (``ClientAdmin``)."""
    return ctl(LAUNCHER, "clients")


def stats(service: str) -> str:
    """Where any service answers a ``StatsRequest`` with its ``StatsReply`` (``deepinfer status``)."""
    return ctl(service, "stats")


# ---- wildcard patterns and NATS-internal subjects (for the per-role permissions of ``shared/nats_auth.py``) ----
PREFILL_ALL = f"{PREFIX}.prefill.*.work"
DECODE_ALL = f"{PREFIX}.decode.*.work"
KV_PULL_ALL = f"{PREFIX}.kv.*.pull.*"
DRAFT_ALL = f"{PREFIX}.draft.*.propose"
INBOX_ROOT = "_INBOX"  # nats-py's default inbox root; every deepinfer connection adds its user under it
REGISTRY_KV = f"$KV.{REGISTRY_BUCKET}.>"  # puts and deletes of registry entries (JetStream KV)
REGISTRY_API = (f"$JS.API.STREAM.INFO.KV_{REGISTRY_BUCKET}",    # look the bucket up
                f"$JS.API.STREAM.CREATE.KV_{REGISTRY_BUCKET}")  # create it when missing


def ctl_all(op: str) -> str:
    """Operation ``op`` of every service's control plane (``ctl(<any service>, op)``)."""
    return f"{PREFIX}.ctl.*.{validate_token(op, 'op')}"


def cache_all(op: str) -> str:
    """Operation ``op`` (one of ``CACHE_OPS``) of every cache tier (``cache(op, <any tier>)``; puts: by any
    writer)."""
    if op not in CACHE_OPS:
        raise ValueError(f"cache op must be one of {CACHE_OPS}, got {op!r}")
    return f"{PREFIX}.cache.*.put.*" if op == "put" else f"{PREFIX}.cache.*.{op}"


def inbox_prefix(user: str) -> str:
    """The inbox prefix of every connection of NATS user ``user`` (``nats.connect(inbox_prefix=...)``): its
    request replies and stream inboxes live under it, and nobody else may subscribe there. An instance user
    ``<role>.<instance>`` has its inbox space inside its role's."""
    if not isinstance(user, str) or user.count(".") > 1:
        raise ValueError(f"user must be one token or <role>.<instance>, got {user!r:.60}")
    return ".".join([INBOX_ROOT, *(validate_token(part, "user") for part in user.split("."))])


def inbox_all(user: str) -> str:
    """Every inbox of NATS user ``user``."""
    return f"{inbox_prefix(user)}.>"
