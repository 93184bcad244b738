"""Starting a whole cluster on one machine: embedded nats-server + router + cache tier + prefill + decode.

Used by ``deepinfer up`` and by the integration tests. Invariants: ``start()`` returns only when every
worker has heartbeated (or raises after its timeout with the failing worker's log tail); ``stop()`` is
idempotent, SIGTERMs every child (each drains, see ``shared/bus.py``), SIGKILLs what is still alive after the
grace period (longer than the services' default ``drain_grace_s``), then stops the
server it started — no orphan processes. CPU threads are split between engine processes so two cores are
never oversubscribed.

Authentication (``ClusterSpec.auth``, embedded server only): fresh random passwords per run, one NATS user per
role with the permissions of ``shared/nats_auth.py``; each child gets its own instance user
(``<role>.<service id>``: heartbeats, registry entry and cache puts only under its id, work addressed to it
only) in its environment (``DEEPINFER_NATS_USER``/``DEEPINFER_NATS_PASSWORD``, never argv, so ``ps`` does not
show them), the same when respawned; a service started after the server (``spawn_router``, a new worker) adds
its user by a config reload. On a server the launcher did not start (``nats_url``) and on a node of a NATS
cluster (its services fail over to other nodes, which know only the role users) children get role users. The
launcher's own health check connects as the read-only ``monitor``, its answers to the planner's scale requests
as ``launcher`` (a user of its own server; from the passwords file otherwise); clients use
``client_credentials`` / ``connect_client(tenant)``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from shared import nats_auth, protocol, subjects
from shared.bus import connect
from cli.cluster_spec import ClusterSpec
from shared.nats_cluster import ROUTE_USER
from shared.nats_server import EmbeddedNatsServer, free_port, start_embedded_server

logger = logging.getLogger(__name__)


class Cluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.server: EmbeddedNatsServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix="deepinfer-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.nats_url = spec.nats_url
        self.http_port = free_port(spec.http_host) if spec.http_port == 0 else spec.http_port
        self.metrics_ports: dict[str, int] = {}  # service name -> its /metrics port
        # user -> password of this run ({} = no auth); never logged, never on a command line
        self.passwords: dict[str, str] = (spec.passwords or nats_auth.generate_passwords(spec.tenants)) \
            if spec.auth else {}
        if self.passwords and not spec.passwords:   # our own server: the launcher's desks and the operator
            self.passwords[nats_auth.LAUNCHER] = nats_auth.new_password()
            self.passwords[nats_auth.ADMIN] = nats_auth.new_password()

    @property
    def http_url(self) -> str:
        """Base URL of the router's OpenAI-compatible API ("" when HTTP is off)."""
        return f"http://{self.spec.http_host}:{self.http_port}" if self.http_port > 0 else ""

    def _metrics_args(self, name: str) -> list[str]:
        if not self.spec.metrics:
            return []
        self.metrics_ports[name] = self.metrics_ports.get(name) or free_port()
        return ["--metrics-port", str(self.metrics_ports[name])]

    def credentials(self, user: str) -> tuple[str, str]:
        """(user, password) of ``user`` (a role, ``monitor`` or ``client-<tenant>``); ("", "") without auth."""
        if not self.passwords:
            return "", ""
        if user not in self.passwords:
            raise KeyError(f"no NATS user {user!r} in this cluster (users: {sorted(self.passwords)})")
        return user, self.passwords[user]

    @property
    def client_credentials(self) -> tuple[str, str]:
        """(user, password) of the ``client`` role: may publish ``di.v1.generate``/``di.v1.cancel`` only."""
        return self.credentials("client")

    def client_url(self, tenant: str | None = None, user: str | None = None) -> str:
        """The NATS URL with the client's (or tenant's, or ``user``'s) credentials in it (no auth: ``nats_url``)."""
        name, password = self.credentials(user or (nats_auth.tenant_user(tenant) if tenant else "client"))
        if not name:
            return self.nats_url
        return self.nats_url.replace("nats://", f"nats://{name}:{password}@")

    async def connect_as(self, user: str, name: str = "") -> nats.NATS:
        """A connection as ``user`` (``shared.bus.connect``: its inbox prefix, reconnects); close it yourself."""
        login, password = self.credentials(user)
        return await connect(self.nats_url, name or f"launcher-{user}", user=login, password=password)

    async def connect_client(self, tenant: str | None = None) -> nats.NATS:
        """A connection as the ``client`` role, or as tenant ``tenant``'s client (``client-<tenant>``)."""
        return await self.connect_as(nats_auth.tenant_user(tenant) if tenant else "client")

    @property
    def _instance_users(self) -> bool:
        """Whether children get instance users: only on a lone server this launcher starts. A node of a NATS
        cluster uses role users, which every node knows: its services must log in at another node after a
        failover, and the other nodes cannot know this node's instances."""
        return bool(self.passwords) and not self.spec.nats_url and self.spec.nats_cluster is None

    def _instance_credentials(self, role: str, name: str) -> tuple[str, str]:
        """Service ``name``'s own NATS user (added to the running server if new), or its role's user (see
        ``_instance_users``); ("", "") without auth."""
        if not self._instance_users:
            return self.credentials(role)
        user = nats_auth.instance_user(role, name)
        if user not in self.passwords:
            self.passwords[user] = nats_auth.new_password()
            if self.server is not None:
                self.server.set_users(self._server_users())
        return self.credentials(user)

    @property
    def admits_clients(self) -> bool:
        """Whether tenant clients can be added at run time: auth on the server this launcher runs."""
        return nats_auth.ADMIN in self.passwords and self.server is not None

    def reload_users(self) -> None:
        """Have the running server take the users as ``passwords`` and ``spec.tenants`` now say (blocking)."""
        self.server.set_users(self._server_users())

    def _server_users(self) -> list:
        return nats_auth.users({u: p for u, p in self.passwords.items() if u != ROUTE_USER}, self.spec.tenants)

    def _spawn(self, name: str, module: str, args: list[str], threads: int, role: str) -> None:
        env = {**os.environ, **self.spec.extra_env, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        if self.passwords:  # its own credentials, in the environment only (argv is world-readable)
            env["DEEPINFER_NATS_USER"], env["DEEPINFER_NATS_PASSWORD"] = self._instance_credentials(role, name)
        env.pop("DEEPINFER_API_KEYS", None)
        if role == "router" and self.spec.api_keys:
            env["DEEPINFER_API_KEYS"] = self.spec.api_keys
        log = open(self.log_dir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env, cwd=os.getcwd())
        log.close()

    def service_id(self, role: str, index: int) -> str:
        """``<role>-<index>``, or ``<role>-<host name>-<index>`` on a named host of a multi-host cluster."""
        return f"{role}-{self.spec.name}-{index}" if self.spec.name else f"{role}-{index}"

    def worker_id(self, role: str, index: int) -> str:
        """Prefill or decode worker ``index``'s id: ``service_id(role, index)``; switchable workers (their role
        changes) are ``worker-<n>``, prefill ones first."""
        if self.spec.switchable:
            return self.service_id("worker", index + (self.spec.prefill if role == "decode" else 0))
        return self.service_id(role, index)

    def _common_args(self, name: str) -> list[str]:
        return ["--nats-url", self.nats_url, "--worker-id", name, "--registry-replicas",
                str(self.spec.registry_replicas)]

    def spawn_worker(self, role: str, index: int) -> str:
        s = self.spec
        name = self.worker_id(role, index)
        engines = max(1, s.prefill + s.decode)
        threads = max(1, len(os.sched_getaffinity(0)) // engines)
        tier_id = self.service_id("cache", index % s.cache_tier) if s.cache_tier else s.tier_id
        tier = ["--cache-tier", tier_id, *(["--tier-kv-format", s.tier_kv_format] if s.tier_kv_format else []),
                *(["--preempt-offer-mib", str(s.preempt_offer_mib)] if s.preempt_offer_mib else [])] if tier_id else []
        if (role == "decode" or s.switchable) and s.draft:
            tier += ["--draft", "local" if s.draft == "local" else "remote", "--drafter", s.drafter]
        module, user = (("services.switchable", nats_auth.SWITCHABLE) if s.switchable else (f"services.{role}", role))
        self._spawn(name, module, [*self._common_args(name), *(["--role", role] if s.switchable else []),
                                               "--threads", str(threads), "--kv-cache-mb", str(s.kv_cache_mb),
                                               "--swa-kv-context", str(s.swa_kv_context),
                                               *(["--rope-scaling", s.rope_scaling] if s.rope_scaling else []),
                                               "--scheduling-policy", s.scheduling_policy,
                                               "--transports", s.transports, "--dtype", s.dtype, *tier,
                                               *self._metrics_args(name),
                                               *(["--model", s.model] if s.model else [])], threads, user)
        return name

    def spawn_draft(self, index: int) -> str:
        """Start draft service ``draft-<index>`` (one thread: it shares the machine with the engines)."""
        s, name = self.spec, self.service_id("draft", index)
        self._spawn(name, "services.draft", [*self._common_args(name), "--drafter",
                                             s.drafter, "--threads", "1", "--dtype", s.dtype,
                                             *self._metrics_args(name),
                                             *(["--model", s.model] if s.model else [])], 1, "draft")
        return name

    def spawn_tier(self, index: int) -> str:
        """Start cache tier ``cache-<index>`` on its directory (kept across runs: the tier survives restarts)."""
        s, name = self.spec, self.service_id("cache", index)
        self._spawn(name, "services.cache_tier", [*self._common_args(name),
                                                  "--directory", s.tier_dir(index),
                                                  "--dram-mb", str(s.cache_tier_dram_mb),
                                                  "--reserve-dram", str(s.cache_tier_reserve_dram),
                                                  "--ssd-mb", str(s.cache_tier_ssd_mb),
                                                  *self._metrics_args(name)], 1, "cache-tier")
        return name

    async def start(self) -> None:
        s = self.spec
        if not self.nats_url:
            for role, name in self._planned_services():   # known now: no reload at start
                self.passwords[nats_auth.instance_user(role, name)] = nats_auth.new_password()
            self.server = start_embedded_server(host=s.nats_host, port=s.nats_port, users=self._server_users(),
                                                cluster=s.nats_cluster, store_dir=s.nats_store_dir or None)
            self.nats_url = ",".join([self.server.url, *s.nats_peers])
        names = []
        if s.router:
            self._spawn(self.router_name, "services.router", self.router_args(), 1, "router")
            names.append(self.router_name)
        names += [self.spawn_tier(i) for i in range(s.cache_tier)]
        names += [self.spawn_worker("prefill", i) for i in range(s.prefill)]
        names += [self.spawn_worker("decode", i) for i in range(s.decode)]
        if s.draft not in ("", "local"):
            names += [self.spawn_draft(i) for i in range(int(s.draft))]
        await self.wait_healthy(names, s.start_timeout_s)

    def _planned_services(self) -> list[tuple[str, str]]:
        """(role, service id) of every service ``start`` spawns that gets an instance user."""
        s = self.spec
        if not self._instance_users:
            return []
        drafts = int(s.draft) if s.draft not in ("", "local") else 0
        worker = nats_auth.SWITCHABLE if s.switchable else ""
        return [*([("router", self.router_name)] if s.router else []),
                *(("cache-tier", self.service_id("cache", i)) for i in range(s.cache_tier)),
                *((worker or "prefill", self.worker_id("prefill", i)) for i in range(s.prefill)),
                *((worker or "decode", self.worker_id("decode", i)) for i in range(s.decode)),
                *(("draft", self.service_id("draft", i)) for i in range(drafts)),
                # the planner's workers to come: a user added later reloads the server's config, which voids
                # the replies its clients still owe (a KV pull under way)
                *((role, self.worker_id(role, i)) for role, have, most in
                  (("prefill", s.prefill, s.planner_max_prefill), ("decode", s.decode, s.planner_max_decode))
                  if self.scales for i in range(have, most))]

    def respawn_router(self) -> None:
        """Start the router again under the same id and flags after its process exited (e.g. ``kill("router")``);
        the previous router's log is kept as ``router.log.<n>`` (n = 1, 2, …)."""
        old = self.procs.get(self.router_name)
        if old is not None and old.poll() is None:
            raise RuntimeError("the router is still running")
        log = self.log_dir / "router.log"
        if log.exists():
            n = 1
            while (self.log_dir / f"router.log.{n}").exists():
                n += 1
            log.rename(self.log_dir / f"router.log.{n}")
        self._spawn(self.router_name, "services.router", self.router_args(), 1, "router")

    def spawn_router(self, name: str, http_port: int = -1) -> str:
        """Start another router (its own id ``name``, the same flags, its own HTTP port: -1 none): routers share
        client requests through their NATS queue group. Returns ``name``."""
        args = self.router_args()
        args[:len(self._common_args(self.router_name))] = self._common_args(name)
        args[args.index("--http-port") + 1] = str(http_port)
        self._spawn(name, "services.router", args, 1, "router")
        return name

    @property
    def router_name(self) -> str:
        return f"router-{self.spec.name}" if self.spec.name else "router"

    def router_args(self) -> list[str]:
        """The router's command line (flags of ``RouterConfig``)."""
        s = self.spec
        return [*self._common_args(self.router_name),
                "--local-prefill-threshold", str(s.local_prefill_threshold), "--policy", s.policy,
                "--ttft-slo-s", str(s.ttft_slo_s), "--http-host", s.http_host, "--http-port", str(self.http_port),
                *(["--model", s.model] if s.model else []),
                *(["--served-model-name", s.served_model_name] if s.served_model_name else []),
                *(["--chat-template", str(Path(s.chat_template).resolve())] if s.chat_template else []),
                *(["--tool-call-parser", s.tool_call_parser] if s.tool_call_parser else []),
                *(["--allowed-origins", s.allowed_origins] if s.allowed_origins else []),
                *(["--reasoning-parser", s.reasoning_parser] if s.reasoning_parser else []),
                *(["--planner", "true"] if s.planner else []),
                *(["--planner-scaler", "launcher", "--planner-max-prefill", str(s.planner_max_prefill),
                   "--planner-max-decode", str(s.planner_max_decode)] if self.scales else [])]

    @property
    def scales(self) -> bool:
        """Whether the router's planner asks this launcher for workers (``cli/launcher_scale.py``)."""
        return self.spec.planner and max(self.spec.planner_max_prefill, self.spec.planner_max_decode) > 0

    async def wait_healthy(self, names: list[str], timeout: float) -> None:
        nc = await self.connect_as(nats_auth.MONITOR, "launcher")  # may subscribe to heartbeats, nothing more
        seen: set[str] = set()

        async def on_load(msg) -> None:
            seen.add(protocol.decode(msg.data, protocol.LoadReport).worker_id)

        sub = await nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        deadline = time.monotonic() + timeout
        try:
            while not set(names) <= seen:
                for name in names:
                    proc = self.procs[name]
                    if proc.poll() is not None:
                        raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    missing = sorted(set(names) - seen)
                    raise RuntimeError(f"not healthy after {timeout:.0f} s: {missing}\n{self.log_tail(missing[0])}")
                await asyncio.sleep(0.2)
        finally:
            await sub.unsubscribe()
            await nc.close()

    def log_tail(self, name: str, n: int = 3000) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault injection)."""
        self.procs[name].kill()
        self.procs[name].wait(10)

    async def terminate(self, name: str, timeout_s: float = 60.0) -> int:
        """SIGTERM one process (it drains) and wait for it to exit; returns its exit code."""
        proc = self.procs[name]
        proc.terminate()
        return await asyncio.to_thread(proc.wait, timeout_s)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the router, workers and draft services, then (once they exited: their last write-backs
        are in) the cache tiers; SIGKILL whatever outlives the grace period."""
        deadline = time.monotonic() + grace_s
        tiers = {n: p for n, p in self.procs.items() if n.startswith("cache-")}
        self._stop_group({n: p for n, p in self.procs.items() if n not in tiers}, deadline)
        self._stop_group(tiers, max(deadline, time.monotonic() + 10.0))
        if self.server is not None:
            self.server.stop()
        if self.spec.temp_tier_dir:
            shutil.rmtree(self.spec.cache_tier_dir, ignore_errors=True)

    @staticmethod
    def _stop_group(procs: dict[str, subprocess.Popen], deadline: float) -> None:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for name, proc in procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing", name)
                proc.kill()
                proc.wait(5)
