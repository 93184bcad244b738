"""A deepinfer cluster across simulated hosts: one ``deepinfer node`` per host (its own NATS node of one NATS
cluster, with authentication from one passwords file), clients and scrapes run inside a host.

Invariants: ``start`` returns once every node printed its banner (its services all heartbeated), or raises with
the failing node's log tail after ``timeout_s``; ``stop`` SIGTERMs every node (each drains its services) and
waits; ``SimulatedHosts.teardown`` then kills whatever is left. Logs stay under ``work`` for the failure message.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from shared import nats_auth
from shared.nats_cluster import ROUTE_USER
from tests.cluster.netns import SimulatedHosts

ROOT = Path(__file__).resolve().parents[2]
# The simulated hosts share one kernel: UCX would notice and move nixl's bytes through shared memory instead of
# the link between the hosts. Real hosts cannot, so UCX is held to TCP (the veth link) here.
SIMULATED_HOST_ENV = {**os.environ, "UCX_TLS": "tcp"}


class MultiHostCluster:
    def __init__(self, hosts: SimulatedHosts, work: Path, model: Path | None, roles: dict[str, list[str]],
                 extra: list[str] = (), dtype: str = "float64", cpus: dict[str, str] | None = None) -> None:
        """``roles``: host name -> its ``deepinfer node`` service flags (e.g. ``["--decode", "2"]``); ``model``
        None = the default model; ``cpus``: host name -> the CPUs its processes may use (``taskset -c``)."""
        self.hosts, self.work, self.model, self.roles, self.extra = hosts, work, model, roles, list(extra)
        self.dtype, self.cpus = dtype, cpus or {}
        self.passwords = {**nats_auth.generate_passwords(), ROUTE_USER: nats_auth.new_password()}
        self.passwords_file = work / "cluster.env"
        self.passwords_file.write_text("".join(f"{nats_auth.password_env(u)}={p}\n" for u, p in self.passwords.items()))
        self.passwords_file.chmod(0o600)
        self.procs: dict[str, subprocess.Popen] = {}

    def log(self, name: str) -> Path:
        return self.work / f"node-{name}.log"

    def node_argv(self, name: str) -> list[str]:
        others = [self.hosts.address(h) for h in self.roles if h != name]
        pin = ["taskset", "-c", self.cpus[name]] if name in self.cpus else []
        return [*pin, sys.executable, "-m", "cli.main", "--log-level", "INFO", "node", "--name", name,
                "--join", ",".join(others), "--passwords-file", str(self.passwords_file),
                *(["--model", str(self.model)] if self.model else []), "--dtype", self.dtype, "--kv-cache-mb", "32",
                "--store-dir", str(self.work / f"js-{name}"), "--log-dir", str(self.work / f"logs-{name}"), "--cache-tier-dir", str(self.work / "tier"),
                "--local-prefill-threshold", "0", *self.extra, *self.roles[name]]

    def start_node(self, name: str) -> None:
        with open(self.log(name), "ab") as log:
            self.procs[name] = self.hosts.popen(name, self.node_argv(name), stdout=log, stderr=subprocess.STDOUT,
                                                cwd=ROOT, env=SIMULATED_HOST_ENV)

    def start(self, timeout_s: float = 180.0) -> None:
        for name in self.roles:
            self.start_node(name)
        self.wait_up(list(self.roles), timeout_s)

    def wait_up(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for name in names:
            while "deepinfer is up" not in self.log(name).read_text(errors="replace"):
                if self.procs[name].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"node {name} did not come up:\n{self.tail(name)}")
                time.sleep(0.2)

    def service_log(self, name: str, service: str) -> str:
        path = self.work / f"logs-{name}" / f"{service}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tail(self, name: str, n: int = 4000) -> str:
        return self.log(name).read_text(errors="replace")[-n:]

    def metrics_ports(self, name: str) -> dict[str, int]:
        """Service -> its /metrics port, from the node's banner."""
        found = re.findall(r"metrics\s+(\S+): http://127\.0\.0\.1:(\d+)/metrics", self.log(name).read_text())
        return {service: int(port) for service, port in found}

    def scrape(self, name: str, service: str) -> str:
        port = self.metrics_ports(name)[service]
        code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read().decode())"
        return subprocess.run(self.hosts.command(name, [sys.executable, "-c", code]), capture_output=True,
                              text=True, timeout=30, check=True).stdout

    def registry(self, name: str) -> dict:
        """The registry bucket's replica count and live keys, read through host ``name``'s NATS node."""
        env = {"DEEPINFER_NATS_USER": "router", "DEEPINFER_NATS_PASSWORD": self.passwords["router"],
               "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        done = subprocess.run(self.hosts.command(name, [sys.executable, "-m", "tests.cluster.registry_probe",
                                                        "nats://127.0.0.1:4222"]),
                              capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"registry probe failed: {done.stderr[-2000:]}")
        return json.loads(done.stdout)

    def client(self, name: str, jobs: list[dict], tag: str, timeout_s: float = 120.0) -> "ClientRun":
        """Start a client inside host ``name`` (its local NATS node, as the ``client`` user) sending ``jobs``."""
        requests, out, started = (self.work / f"{tag}-{k}.json" for k in ("requests", "out", "started"))
        requests.write_text(json.dumps(jobs))
        env = {"DEEPINFER_NATS_USER": "client", "DEEPINFER_NATS_PASSWORD": self.passwords["client"],
               "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        argv = [sys.executable, "-m", "tests.cluster.client_main", "--url", "nats://127.0.0.1:4222",
                "--requests", str(requests), "--out", str(out), "--started", str(started),
                "--timeout-s", str(timeout_s)]
        log = open(self.work / f"{tag}-client.log", "wb")
        proc = self.hosts.popen(name, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        log.close()
        return ClientRun(proc, out, started, self.work / f"{tag}-client.log")

    def stop(self, timeout_s: float = 60.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


class ClientRun:
    def __init__(self, proc: subprocess.Popen, out: Path, started: Path, log: Path) -> None:
        self.proc, self.out, self.started, self.log = proc, out, started, log

    def wait_started(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.started.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"client did not start:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)

    def results(self, timeout_s: float = 300.0) -> list[dict]:
        rc = self.proc.wait(timeout_s)
        if rc != 0 or not self.out.exists():
            raise RuntimeError(f"client failed ({rc}):\n{self.log.read_text(errors='replace')[-3000:]}")
        return json.loads(self.out.read_text())
