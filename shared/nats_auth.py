"""NATS users and per-role permissions, generated from ``shared/subjects.py``; nats-server config rendering.

One NATS user per service role (``ROLES``), a read-only ``monitor`` (the launcher's health check, ``deepinfer
status``), a ``launcher`` (``deepinfer up`` taking the planner's scale requests and the operator's client requests: those
subjects and nothing else, so no holder of the monitor's credential can answer them), an ``admin`` (the operator:
may only ask the launcher to add, remove or list tenant clients) and tenant clients ``client-<tenant>``, made at
start-up (``--tenants``) or at run time (``deepinfer client add``: the server reloads its users).
Every service connects with ``inbox_prefix=subjects.inbox_prefix(user)`` (``shared/bus.connect`` does it).

Instance users ``<role>.<instance>`` (``instance_user``) bind one service's id to its credential: they have their
role's permissions, except that they may publish heartbeats, KV events, registry entries and cache puts only
under their own id (``load(<instance>, <role>)``, ``kv_events(<instance>)``, ``$KV.<registry>.<instance>``,
``cache_puts_by(<instance>)``), and hear only the work, control, cache and KV-pull subjects addressed to them (no
instance can answer a pull of another's transfer). The launcher gives each service it starts its own instance
user; a role user (compose, Kubernetes, ``deepinfer serve``) is trusted for every id of its role.

Invariants (tests/unit/test_nats_auth.py, tests/integration/test_nats_permissions.py):
- Every subject and pattern below comes from ``shared/subjects.py``: the permissions cannot drift from the subjects
  the services use. ``compose/nats.conf`` is ``render_compose_config(monitor=True)`` verbatim (a test compares).
- Allow lists only: whatever a list does not name is denied. A user subscribes to no inbox but its own
  (``_INBOX.<user>.>``); replies to NATS requests go through ``allow_responses`` (one reply each), while
  inboxes named inside message bodies or streamed to are explicit: workers publish TokenChunks to
  ``_INBOX.router.>`` (``PrefillRequest.reply_to``), the router streams to its clients' inboxes.
- ``client`` publishes ``GENERATE`` and ``CANCEL`` only; ``client-<t>`` only ``generate_as(t)`` and
  ``cancel_as(t)``; those reach the router, which decides; only the router publishes ``WORK_CANCEL``, the
  cancel workers obey. Only the services that own them publish heartbeats, KV events, hand-offs, prefill
  requests, cache operations and registry entries.
- Passwords never reach a command line: rendered configs hold them (literal, or ``$NATS_PASSWORD_<ROLE>``
  environment references in the compose config), services read them from ``DEEPINFER_NATS_PASSWORD``.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import secrets
import string
import sys
from collections.abc import Iterable, Mapping, Sequence

from shared import subjects as S
from shared.nats_cluster import ROUTE_USER, NatsClusterNode

ROLES = ("router", "prefill", "decode", "draft", "cache-tier", "client")
MONITOR = "monitor"
LAUNCHER = "launcher"  # ``deepinfer up``'s answer desk for the planner's scale requests (cli/launcher_scale.py)
ADMIN = "admin"  # an operator adding and removing tenant clients at run time (cli/launcher_clients.py)
SWITCHABLE = "worker"  # a switchable worker (prefill or decode, ``services/switchable``): both roles' rights
TENANT_PREFIX = "client-"
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # user and tenant names: one subject token, safe in config and URLs
INSTANCE_SEP = "."  # <role>.<instance>: two subject tokens (its inbox is _INBOX.<role>.<instance>.>)

# Compose (compose/docker-compose.yml): the server listens here, the store is a volume, monitoring on 8222.
COMPOSE_LISTEN = "0.0.0.0:4222"
COMPOSE_HTTP = 8222
COMPOSE_STORE_DIR = "/data/jetstream"
MAX_PAYLOAD = "8MB"


@dataclasses.dataclass(frozen=True)
class Permissions:
    """Allow lists of one user (nothing else is allowed); ``allow_responses``: may answer requests it got."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


@dataclasses.dataclass(frozen=True)
class NatsUser:
    """One ``authorization.users`` entry. ``password_env`` (e.g. ``NATS_PASSWORD_ROUTER``) renders as a
    nats-server environment reference instead of the literal ``password``; ``permissions=None`` means
    unrestricted (only tests use that, for an observer that must see everything)."""

    name: str
    password: str = dataclasses.field(default="", repr=False)
    password_env: str = ""
    permissions: Permissions | None = None


def tenant_user(tenant: str) -> str:
    """The NATS user of tenant ``tenant``'s clients."""
    return TENANT_PREFIX + _check_name(tenant, "tenant")


def tenant_of_user(user: str) -> str | None:
    """The tenant of a ``client-<tenant>`` user (it must publish on ``generate_as(tenant)``); None otherwise."""
    tenant = user[len(TENANT_PREFIX):] if user.startswith(TENANT_PREFIX) else ""
    return tenant or None


def instance_user(role: str, instance: str) -> str:
    """The NATS user of service ``instance`` (its worker id) of ``role`` (one of ``ROLES`` but ``client``, or
    ``SWITCHABLE``)."""
    if role not in HEARTBEAT_ROLE and role != SWITCHABLE:
        raise ValueError(f"instance users are for service roles {sorted(HEARTBEAT_ROLE)}, not {role!r}")
    return role + INSTANCE_SEP + _check_name(instance, "instance")


def _check_user(name: str) -> str:
    """A plain user name, or an instance user's ``<role>.<instance>``."""
    role, dot, instance = name.partition(INSTANCE_SEP) if isinstance(name, str) else ("", "", "")
    return instance_user(role, instance) if dot else _check_name(name, "user")


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} {name!r} must be non-empty letters, digits, '_' or '-'")
    S.validate_token(name, what)  # length bound
    return name


def _own_inbox(user: str) -> tuple[str, ...]:
    return (S.inbox_all(user),)


HEARTBEAT_ROLE = {"router": "router", "prefill": "prefill", "decode": "decode", "draft": "draft",
                  "cache-tier": "cache_tier"}  # NATS user -> the role its heartbeats name (protocol_control.ROLES)


def _service(user: str, publish: Iterable[str], subscribe: Iterable[str]) -> Permissions:
    """A service: heartbeats under its own role only, registry entry, its own inbox (``sync_with_server``
    publishes there), replies."""
    own = _own_inbox(user)
    return Permissions(publish=(*publish, S.load_role(HEARTBEAT_ROLE[user]), S.REGISTRY_KV, *S.REGISTRY_API, *own),
                       subscribe=(*subscribe, S.ctl_all("stats"), *own), allow_responses=True)


def _instance(role: str, instance: str, tenants: Sequence[str]) -> Permissions:
    """``role``'s permissions bound to ``instance``: it publishes heartbeats, its registry entry and cache puts
    only under its own id, and hears only the work, control and cache subjects addressed to it."""
    base, own = permissions(role, tenants), _own_inbox(instance_user(role, instance))[0]
    beats = ("prefill", "decode") if role == SWITCHABLE else (HEARTBEAT_ROLE[role],)
    pub = {**{S.load_role(r): S.load(instance, r) for r in beats}, S.inbox_all(role): own,
           S.KV_EVENTS: S.kv_events(instance),
           S.REGISTRY_KV: S.REGISTRY_KV.removesuffix(">") + instance, S.cache_all("put"): S.cache_puts_by(instance)}
    sub = {S.inbox_all(role): own, S.PREFILL_ALL: S.prefill(instance), S.DECODE_ALL: S.decode(instance),
           S.KV_PULL_ALL: S.kv_pulls_of(instance),
           S.cache_all("put"): S.cache_puts(instance),
           **{S.cache_all(op): S.cache(op, instance) for op in S.CACHE_OPS if op != "put"},
           **{S.ctl_all(op): S.ctl(instance, op) for op in ("kv_snapshot", "probe", "stats", "migrate", "role")}}
    return Permissions(publish=tuple(pub.get(s, s) for s in base.publish),
                       subscribe=tuple(sub.get(s, s) for s in base.subscribe), allow_responses=base.allow_responses)


_CACHE_CLIENT = tuple(S.cache_all(op) for op in ("put", "get", "release"))  # a worker's tier client


def permissions(user: str, tenants: Sequence[str] = ()) -> Permissions:
    """Permissions of ``user``: a role of ``ROLES``, ``MONITOR`` or ``client-<tenant>``. ``tenants`` are the
    tenants configured on this server: the router may stream to their clients' inboxes."""
    if INSTANCE_SEP in user:
        role, _, instance = _check_user(user).partition(INSTANCE_SEP)
        return _instance(role, instance, tenants)
    if user == "router":
        clients = ["client", *(tenant_user(t) for t in tenants)]
        return _service(user,
                        publish=(S.PREFILL_ALL, S.DECODE_ALL, S.WORK_CANCEL, S.ctl_all("kv_snapshot"),
                                 S.ctl_all("probe"), S.ctl_all("migrate"), S.ctl_all("role"), S.launcher_scale(),
                                 *(S.inbox_all(c) for c in clients)),
                        subscribe=(S.GENERATE, S.GENERATE_TENANTS, S.CANCEL, S.CANCEL_TENANTS, S.HELD,
                                   S.HELD_TENANTS, S.LOAD_ALL, S.KV_EVENTS, S.ctl_all("migrate")))
    if user in ("prefill", "decode"):
        worker_sub = (S.WORK_CANCEL, S.ctl_all("kv_snapshot"), S.ctl_all("probe"),
                      S.KV_PULL_ALL,  # serve staged transfers (hand-offs, tier write-backs)
                      S.LOAD_ALL)     # heartbeats of the cache tier (TierClient) and routers (RouterWatch)
        worker_pub = (S.KV_EVENTS, S.KV_PULL_ALL, *_CACHE_CLIENT,
                      S.inbox_all("router"))  # TokenChunks to PrefillRequest/DecodeLocalRequest.reply_to
        if user == "prefill":
            return _service(user, publish=(*worker_pub, S.DECODE_ALL), subscribe=(S.PREFILL_ALL, *worker_sub))
        return _service(user, publish=(*worker_pub, S.DRAFT_ALL, S.DECODE_ALL),  # live migration hand-offs
                        subscribe=(S.DECODE_ALL, S.ctl_all("migrate"), *worker_sub))
    if user == SWITCHABLE:  # prefill's and decode's rights (both heartbeat subjects), and the role switch
        both = (permissions("prefill", tenants), permissions("decode", tenants))
        own = {S.inbox_all("prefill"), S.inbox_all("decode")}  # theirs, not this user's
        merge = lambda lists: tuple(dict.fromkeys(s for lst in lists for s in lst if s not in own))
        return Permissions(publish=(*merge(p.publish for p in both), *_own_inbox(user)),
                           subscribe=(*merge(p.subscribe for p in both), S.ctl_all("role"), *_own_inbox(user)),
                           allow_responses=True)
    if user == "draft":
        return _service(user, publish=(), subscribe=(S.DRAFT_ALL,))
    if user == "cache-tier":
        return _service(user, publish=(S.KV_EVENTS, S.KV_PULL_ALL),  # pulls the workers' write-backs
                        subscribe=(*(S.cache_all(op) for op in S.CACHE_OPS), S.ctl_all("kv_snapshot"),
                                   S.KV_PULL_ALL))  # serves its staged gets
    if user == "client":
        return Permissions(publish=(S.GENERATE, S.CANCEL, S.HELD), subscribe=_own_inbox(user))
    if user.startswith(TENANT_PREFIX):
        tenant = _check_name(user[len(TENANT_PREFIX):], "tenant")
        return Permissions(publish=(S.generate_as(tenant), S.cancel_as(tenant), S.held_as(tenant)),
                           subscribe=_own_inbox(user))
    if user == MONITOR:  # reads heartbeats and stats
        return Permissions(publish=(S.ctl_all("stats"),), subscribe=(S.LOAD_ALL, *_own_inbox(user)),
                           allow_responses=True)
    if user == LAUNCHER:  # scale and client requests only (publish names its own inbox: an empty list is no limit)
        return Permissions(publish=_own_inbox(user),
                           subscribe=(S.launcher_scale(), S.launcher_clients(), *_own_inbox(user)),
                           allow_responses=True)
    if user == ADMIN:  # asks the launcher for tenant clients, hears the answers in its own inbox
        return Permissions(publish=(S.launcher_clients(),), subscribe=_own_inbox(user))
    raise ValueError(f"unknown NATS user {user!r}: one of {ROLES}, {SWITCHABLE!r}, {MONITOR!r}, {LAUNCHER!r}, "
                     f"{ADMIN!r} or "
                     f"{TENANT_PREFIX}<tenant>")


def user_names(tenants: Sequence[str] = (), monitor: bool = True) -> list[str]:
    """Every user of a deployment: the roles, the monitor (when asked) and one client user per tenant."""
    return [*ROLES, *([MONITOR] if monitor else []), *(tenant_user(t) for t in tenants)]


def new_password() -> str:
    """A random password: a letter, then 32 URL-safe characters (192 bits). The leading letter matters:
    nats-server parses a ``$VAR`` it substitutes as a config value, so one starting with a digit or ``-`` that
    holds a ``-`` later (``1-W``: read as a number or date) makes the server refuse its config."""
    return secrets.choice(string.ascii_letters) + secrets.token_urlsafe(24)


def generate_passwords(tenants: Sequence[str] = (), monitor: bool = True) -> dict[str, str]:
    """A fresh random password (``new_password``) per user of ``user_names``."""
    return {name: new_password() for name in user_names(tenants, monitor)}


def users(passwords: Mapping[str, str], tenants: Sequence[str] = ()) -> list[NatsUser]:
    """The ``NatsUser`` entries of ``passwords`` (user -> password), each with its role's permissions."""
    return [NatsUser(name, pw, permissions=permissions(name, tenants)) for name, pw in passwords.items()]


def password_env(user: str) -> str:
    """The variable holding ``user``'s password in compose (``cache-tier`` -> ``NATS_PASSWORD_CACHE_TIER``)."""
    return "NATS_PASSWORD_" + _check_name(user, "user").upper().replace("-", "_")


def read_passwords(text: str, tenants: Sequence[str] = ()) -> dict[str, str]:
    """User -> password from ``NATS_PASSWORD_<USER>=<password>`` lines (what ``env`` prints; ``#`` comments and
    blank lines skipped). Every node of a multi-host cluster reads the same file: same users everywhere.
    The route password (``NATS_PASSWORD_ROUTE``, printed by ``env --cluster``) comes back as ``route``."""
    known = {password_env(u): u for u in [*user_names(tenants, monitor=True), LAUNCHER, ROUTE_USER]}
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        var, sep, value = line.partition("=")
        if not sep or var.strip() not in known:
            raise ValueError(f"not a NATS_PASSWORD_<USER>=... line of a known user: {var.strip()!r}")
        found[known[var.strip()]] = value.strip()
    missing = set(ROLES) - set(found)
    if missing:
        raise ValueError(f"passwords missing for {sorted(missing)}")
    return found


def compose_users(tenants: Sequence[str] = (), monitor: bool = False) -> list[NatsUser]:
    """Compose's users, passwords from the nats container's environment. The monitor (``deepinfer status``)
    only when asked: its ``NATS_PASSWORD_MONITOR`` must then be set too, or nats-server refuses the config."""
    names = user_names(tenants, monitor=monitor)
    envs = [password_env(n) for n in names]
    if len(set(envs)) != len(envs):
        raise ValueError(f"tenants {list(tenants)} map to the same password variable")
    return [NatsUser(n, password_env=e, permissions=permissions(n, tenants)) for n, e in zip(names, envs)]


def _quote(text: str) -> str:
    if '"' in text or "\\" in text or not text.isprintable():
        raise ValueError(f"cannot quote {text!r} in a nats-server config")
    return f'"{text}"'


def _render_user(user: NatsUser) -> list[str]:
    _check_user(user.name)
    if user.password_env:
        secret = "$" + _check_name(user.password_env, "password variable")
    elif user.password and _NAME.match(user.password):
        secret = _quote(user.password)
    else:
        raise ValueError(f"user {user.name!r}: the password must be non-empty letters, digits, '_' or '-'")
    lines = ["    {", f"      user: {_quote(user.name)}", f"      password: {secret}"]
    perms = user.permissions
    if perms is not None:
        lines.append("      permissions: {")
        for verb, allow in (("publish", perms.publish), ("subscribe", perms.subscribe)):
            lines.append(f"        {verb}: {{ allow: [")
            lines += [f"          {_quote(s)}" for s in dict.fromkeys(allow)]  # in order, no duplicates
            lines.append("        ] }")
        if perms.allow_responses:
            lines.append("        allow_responses: true")
        lines.append("      }")
    return lines + ["    }"]


def render_server_config(*, listen: str, max_payload: str = MAX_PAYLOAD, store_dir: str | None = None,
                         http_port: int | None = None, users: Sequence[NatsUser] = (),
                         cluster: NatsClusterNode | None = None) -> str:
    """A nats-server config: ``listen``, ``max_payload``, JetStream in ``store_dir`` (None: off), monitoring on
    ``http_port`` (None: off), ``authorization`` with ``users`` (none: no authentication at all), and, for one
    node of a NATS cluster, its ``server_name`` and routes (``shared/nats_cluster.py``)."""
    lines = [f"listen: {listen}", f"max_payload: {max_payload}"]
    if cluster is not None:
        lines += cluster.render()
    if http_port is not None:
        lines.append(f"http_port: {int(http_port)}")
    if store_dir is not None:
        lines.append(f"jetstream {{ store_dir: {_quote(str(store_dir))} }}")
    if users:
        names = [u.name for u in users]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate NATS users in {names}")
        lines += ["authorization {", "  users = ["]
        for user in users:
            lines += _render_user(user)
        lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def compose_command(tenants: Sequence[str] = (), monitor: bool = False) -> str:
    """The ``python -m shared.nats_auth compose ...`` command line that renders this config."""
    flags = [*(["--monitor"] if monitor else []), *(["--tenants", ",".join(tenants)] if tenants else [])]
    return " ".join(["python -m shared.nats_auth compose", *flags])


def render_compose_config(tenants: Sequence[str] = (), monitor: bool = False) -> str:
    """Compose's nats.conf; its header names the command (flags included) that regenerates it. The checked-in
    ``compose/nats.conf`` is ``python -m shared.nats_auth compose --monitor > compose/nats.conf``."""
    header = (f"# Generated by `{compose_command(tenants, monitor)}` from shared/subjects.py: do not edit by hand.\n"
              "# Passwords come from the nats container's environment (NATS_PASSWORD_<ROLE>); each service\n"
              "# connects as DEEPINFER_NATS_USER=<role> with DEEPINFER_NATS_PASSWORD.\n")
    return header + render_server_config(listen=COMPOSE_LISTEN, max_payload=MAX_PAYLOAD,
                                         store_dir=COMPOSE_STORE_DIR, http_port=COMPOSE_HTTP,
                                         users=compose_users(tenants, monitor))


def main(argv: list[str] | None = None) -> int:
    """``compose``: print compose's nats.conf; ``env``: print fresh ``NATS_PASSWORD_<ROLE>=...`` lines (a
    ``.env`` file for docker compose)."""
    parser = argparse.ArgumentParser(prog="python -m shared.nats_auth", description=main.__doc__)
    parser.add_argument("what", choices=["compose", "env"])
    parser.add_argument("--tenants", default="", help="comma-separated tenant names (users client-<tenant>)")
    parser.add_argument("--monitor", action="store_true", help="add the monitor user (deepinfer status)")
    parser.add_argument("--cluster", action="store_true",
                        help="env: add the route password (NATS_PASSWORD_ROUTE) that joins the nodes of a cluster")
    parser.add_argument("--launcher", action="store_true",
                        help="env: add the launcher user (deepinfer up --planner --planner-max-*: scale requests)")
    args = parser.parse_args(argv)
    tenants = [t.strip() for t in args.tenants.split(",") if t.strip()]
    if args.what == "compose":
        sys.stdout.write(render_compose_config(tenants, args.monitor))
    else:
        passwords = generate_passwords(tenants, monitor=args.monitor)
        passwords.update({u: new_password() for u, on in ((ROUTE_USER, args.cluster), (LAUNCHER, args.launcher)) if on})
        for name, pw in passwords.items():
            sys.stdout.write(f"{password_env(name)}={pw}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
