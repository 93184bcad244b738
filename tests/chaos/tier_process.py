"""A cache tier as a real process for the chaos tests (``python -m services.cache_tier``): start it on a
directory and wait until it serves, SIGKILL it, stop it (SIGTERM: it drains and flushes), read its logs. Every
start logs to its own file ``<tier>.<n>.log``; every wait is bounded."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from nats import errors as nats_errors

from shared import protocol, subjects

REPO = Path(__file__).resolve().parents[2]


async def store_stats(nc, tier: str, timeout: float = 5.0) -> dict:
    """The tier's block-store counters (``StatsReply.stats["store"]``)."""
    reply = await nc.request(subjects.stats(tier), protocol.encode(protocol.StatsRequest()), timeout=timeout)
    return protocol.decode(reply.data, protocol.StatsReply).stats["store"]


class TierProcess:
    """Tier ``tier_id`` on ``directory`` with extra command-line ``flags`` (``CacheTierConfig`` fields)."""

    def __init__(self, url: str, tier_id: str, directory: Path, log_dir: Path, flags: list[str],
                 start_timeout_s: float = 30.0) -> None:
        self.url, self.tier_id, self.directory, self.log_dir = url, tier_id, directory, log_dir
        self.flags, self.start_timeout_s = flags, start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    async def start(self, nc) -> dict:
        """Start and wait until it answers stats; returns its store counters at open."""
        self.starts += 1
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_dir / f"{self.tier_id}.{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cache_tier", "--nats-url", self.url, "--worker-id", self.tier_id,
                 "--directory", str(self.directory), *self.flags], cwd=REPO, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            assert self.proc.poll() is None, f"tier exited with {self.proc.returncode}: {self.log_tail()}"
            assert time.monotonic() < deadline, \
                f"tier not serving after {self.start_timeout_s:.0f} s: {self.log_tail()}"
            with contextlib.suppress(nats_errors.NoRespondersError, nats_errors.TimeoutError):
                return await store_stats(nc, self.tier_id, timeout=1.0)
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(10) == -signal.SIGKILL

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 30 s); the exit code, or None if it was not running or was killed."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None

    def log_tail(self, n: int = 3000) -> str:
        return (self.log_dir / f"{self.tier_id}.{self.starts}.log").read_text(errors="replace")[-n:]

    def log_problems(self) -> list[str]:
        """ERROR / CRITICAL records and tracebacks of every start."""
        return [f"{p.name}: {line}" for p in sorted(self.log_dir.glob(f"{self.tier_id}.*.log"))
                for line in p.read_text(errors="replace").splitlines()
                if " ERROR " in line or " CRITICAL " in line or line.startswith("Traceback")]
