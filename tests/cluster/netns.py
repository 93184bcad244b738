"""Simulated hosts on one machine: a network namespace and a UTS namespace (own hostname) per host, joined by
veth pairs to a bridge that lives in a namespace of its own.

Invariants:
- Addresses exist only on interfaces inside namespaces made here (``10.<a>.<b>.0/24``, chosen per run); no
  namespace has a route out, nothing is added to the caller's namespace, so no packet leaves the simulation.
- ``SimulatedHosts`` is a context manager: ``__exit__`` (also after a failure) kills every process still
  inside its namespaces and deletes them (veth pairs and the bridge go with them). ``teardown`` is idempotent.
- Creating the namespaces needs root and ``ip netns``; where that fails, ``NamespaceError`` carries ``ip``'s
  own message (the tests fail with it: they are never skipped silently).
- ``cut``/``restore`` take a host's link down/up at the bridge (its processes keep running, cut off);
  ``shape`` limits a host's rate (``tc tbf``) or adds delay (``tc netem``, where the kernel has it).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path


class NamespaceError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise NamespaceError(f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


class SimulatedHosts:
    """``names`` hosts; ``address(name)`` is the host's IPv4 address, ``command(name, argv)`` an argv that runs
    inside the host (its network and a fresh UTS namespace whose hostname is ``name``)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.tag = uuid.uuid4().hex[:6]
        rnd = random.Random(self.tag)
        self.prefix = f"10.{rnd.randrange(64, 250)}.{rnd.randrange(1, 250)}"
        self.bridge_ns = f"di-{self.tag}-br"
        self.created: list[str] = []

    def ns(self, name: str) -> str:
        return f"di-{self.tag}-{name}"

    def address(self, name: str) -> str:
        return f"{self.prefix}.{10 + self.names.index(name)}"

    def _peer(self, name: str) -> str:
        return f"b{self.tag}{self.names.index(name)}"  # the host's veth end in the bridge namespace (≤15 chars)

    def create(self) -> "SimulatedHosts":
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for name in self.names:
                ns, peer = self.ns(name), self._peer(name)
                self._add_ns(ns)
                _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", self.bridge_ns)
                _ip("-n", ns, "addr", "add", f"{self.address(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
        except BaseException:
            self.teardown()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``name``: its network namespace, a new UTS namespace named ``name``."""
        return ["ip", "netns", "exec", self.ns(name), "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', name, *argv]

    def popen(self, name: str, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, argv), **kwargs)

    def pids(self, name: str) -> list[int]:
        """Processes inside host ``name``'s network namespace."""
        out = _ip("netns", "pids", self.ns(name), check=False).stdout
        return [int(p) for p in out.split()]

    def pid_of(self, name: str, comm: str) -> int:
        """The pid of the process called ``comm`` (``/proc/<pid>/comm``) inside host ``name``."""
        for pid in self.pids(name):
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                    return pid
            except OSError:
                continue
        raise LookupError(f"no {comm} process on {name}")

    def cut(self, name: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self._peer(name), "down")

    def restore(self, name: str) -> None:
        _ip("-n", self.bridge_ns, "link", "set", self._peer(name), "up")

    def shape(self, name: str, rate: str = "", delay: str = "") -> None:
        """Shape host ``name``'s interface: ``rate`` alone with ``tc tbf`` (e.g. ``"10gbit"``); with a ``delay``
        (e.g. ``"0.5ms"``) ``tc netem``, which some kernels lack (``NamespaceError`` then says so)."""
        if delay:
            qdisc = ["netem", "delay", delay, *(["rate", rate] if rate else [])]
        else:
            qdisc = ["tbf", "rate", rate, "burst", "4mb", "latency", "50ms"]
        done = subprocess.run(["tc", "-n", self.ns(name), "qdisc", "replace", "dev", "eth0", "root", *qdisc],
                              capture_output=True, text=True, timeout=20)
        if done.returncode != 0:
            raise NamespaceError(f"tc {qdisc[0]} on {name} failed: {done.stderr.strip()}")

    def teardown(self) -> None:
        """Kill what still runs inside the namespaces, then delete them. Idempotent."""
        for ns in self.created:
            pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.created:
            time.sleep(0.2)
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created.clear()

    def __enter__(self) -> "SimulatedHosts":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.teardown()
