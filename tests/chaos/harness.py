"""Pieces shared by the chaos tests that run a real cluster (nats-server + router + worker processes).

- ``make_prompt(i, length)``: distinct, deterministic token prompts (the first two tokens encode ``i``).
- ``reference(folder, prompts, max_tokens)``: greedy outputs of the single-process engine (one batch, a KV
  pool big enough for all of them, no prefix cache, one thread), as in ``tests/integration/test_failures.py``.
- ``stream_request``: a client stream consumer on a raw inbox subscription that records every chunk as it
  arrives, so a test can tell a gap (a seq skipped) from a duplicate (a seq received twice, also after the
  final chunk) from a stream that never ends (client-side idle or deadline timeout). It never raises for what
  the cluster sends; it returns an ``Outcome``. NATS's own "no responders" reply (no router subscribed) is
  recorded as an ``unavailable`` error.
- ``run_pool``: a pool of concurrent clients, each running jobs one after another.
- ``LoadWatcher``: the latest heartbeat of every service (to terminate a worker while it holds streams).
- ``Window`` / ``overlaps`` / ``probe_until_served``: fault windows (fault -> a remote and a local probe are
  served again) and whether a request's lifetime overlaps one; ``wall_clock`` maps times to the logs' clock.
- ``log_counts`` / ``log_grep``: numbers and lines from the services' logs (drain and hand-back evidence).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import random
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import torch

from shared import protocol, subjects
from cli.launcher import Cluster, ClusterSpec
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams

NO_RESPONDERS = "503"  # status header of the message NATS sends to a reply inbox when nobody subscribes
TOKEN_LO, TOKEN_HI = 3, 280  # ids of the tiny byte-level vocabulary that are plain tokens (no specials)
_SPAN = TOKEN_HI - TOKEN_LO


def make_prompt(i: int, length: int, seed: int = 0) -> list[int]:
    """A prompt of ``length`` (>= 2) token ids, distinct for every ``i`` < ``_SPAN ** 2``."""
    rng = random.Random(seed * 1_000_003 + i)
    head = [TOKEN_LO + i % _SPAN, TOKEN_LO + (i // _SPAN) % _SPAN]
    return head + [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(length - 2)]


def reference(folder: Path | str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy, ``ignore_eos`` outputs of the single-process engine for each (prompt, max_tokens).

    One intra-op thread: the tiny model's ops are too small to gain from a second one, and under CPU contention
    threads that meet at every op slow it down many times over (4 x 3000 tokens on 2 cores: 9 s with 2 threads,
    10 s with 1 alone; next to 4 busy processes 113 s with 2 threads, 39 s with 1). The engine sets torch's
    thread count process-wide; it is restored afterwards."""
    block = 8
    blocks = sum(math.ceil((len(p) + m) / block) + 1 for p, m in zip(prompts, max_tokens)) + 16
    threads = torch.get_num_threads()
    try:
        engine = LLMEngine.from_path(str(folder), EngineConfig(
            dtype="float64", block_size=block, num_kv_blocks=blocks, max_num_seqs=256, enable_prefix_caching=False,
            num_threads=1))
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
        return engine.generate(prompts, params)
    finally:
        torch.set_num_threads(threads)


def chaos_cluster(server, folder: Path | str, prefill: int, decode: int, drain_grace_s: str,
                  migrate_on_drain: bool = True) -> Cluster:
    """The chaos tests' cluster: real processes on the tiny float64 model, every prompt prefilled remotely unless
    a request asks for local prefill, the given drain grace period; ``migrate_on_drain`` False: a draining
    decode worker hands its streams back instead of the router moving them."""
    return Cluster(ClusterSpec(prefill=prefill, decode=decode, nats_url=server.url, model=str(folder),
                               kv_cache_mb=32, local_prefill_threshold=0, dtype="float64",
                               extra_env={"DEEPINFER_DRAIN_GRACE_S": drain_grace_s,
                                          "DEEPINFER_MIGRATE_ON_DRAIN": str(migrate_on_drain).lower()}))


def wall_clock(t_monotonic: float) -> str:
    """A ``time.monotonic()`` instant as local wall-clock time (to match the services' log lines)."""
    t = time.time() - (time.monotonic() - t_monotonic)
    return time.strftime("%H:%M:%S", time.localtime(t)) + f",{int(t % 1 * 1000):03d}"


@dataclasses.dataclass
class Outcome:
    """Everything one client saw for one request (times are ``time.monotonic()``)."""
    request: protocol.GenerateRequest
    t_start: float
    t_end: float = 0.0
    tokens: list[int] = dataclasses.field(default_factory=list)
    seqs: list[int] = dataclasses.field(default_factory=list)  # every seq received, in arrival order
    final: bool = False
    usage: dict | None = None
    finish_reason: str | None = None
    error: dict | None = None  # {"code", "message"} of a final error chunk or an ErrorReply
    client_timeout: str | None = None  # "idle" or "deadline": no final chunk came
    duplicates: int = 0  # chunks whose seq had already been received (before or after the final chunk)
    late: int = 0  # chunks with a new seq after the final chunk
    gaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (expected seq, received seq)
    undecodable: int = 0
    _seen: set[int] = dataclasses.field(default_factory=set, repr=False)
    _top: int = dataclasses.field(default=-1, repr=False)  # highest seq received

    @property
    def completed(self) -> bool:
        """Ended with a final chunk carrying usage and no error, seq gap-free from 0."""
        return self.final and self.error is None and not self.gaps and self.usage is not None

    @property
    def errored(self) -> bool:
        """The client got a clear error: an error reply/chunk, a seq gap it detected, or its own timeout."""
        return not self.completed

    def describe(self, epoch: float = 0.0) -> str:
        """One line; times in seconds after ``epoch`` (a ``time.monotonic()``), wall clock of the start."""
        what = (f"error={self.error}" if self.error else f"client_timeout={self.client_timeout}"
                if self.client_timeout else f"gaps={self.gaps}" if self.gaps else "completed")
        return (f"{self.request.request_id} [{self.t_start - epoch:.2f}..{self.t_end - epoch:.2f} s, started "
                f"{wall_clock(self.t_start)}] "
                f"{what} tokens={len(self.tokens)}"
                f"/{self.request.max_tokens} seqs={len(self.seqs)} dup={self.duplicates} late={self.late} "
                f"usage={self.usage}")

    def take(self, data: bytes, headers: dict | None = None) -> None:
        if headers and headers.get("Status") == NO_RESPONDERS and not data:
            # NATS itself answers a request nobody subscribes to (no router up): a clear "unavailable"
            if self.final:
                self.late += 1
            else:
                self.final, self.error = True, {"code": "unavailable", "message": "NATS: no responders on "
                                                f"{subjects.GENERATE} (no router subscribed)"}
            return
        try:
            reply = protocol.decode(data, (protocol.TokenChunk, protocol.ErrorReply))
        except Exception:  # noqa: BLE001 - recorded, the test asserts on it
            self.undecodable += 1
            return
        if isinstance(reply, protocol.ErrorReply):
            if self.final:
                self.late += 1
            else:
                self.final, self.error = True, {"code": reply.code, "message": reply.message}
            return
        self.seqs.append(reply.seq)
        if reply.seq in self._seen:
            self.duplicates += 1
            return
        self._seen.add(reply.seq)
        if self.final:
            self.late += 1
            return
        if reply.seq != self._top + 1:
            self.gaps.append((self._top + 1, reply.seq))
        self._top = max(self._top, reply.seq)
        self.tokens.extend(reply.token_ids)
        if reply.final:
            self.final, self.usage, self.error = True, reply.usage, reply.error
            self.finish_reason = reply.finish_reason


async def stream_request(nc: nats.NATS, request: protocol.GenerateRequest, idle_timeout_s: float,
                         linger_s: float = 0.5, lingering: list[asyncio.Task] | None = None,
                         streaming: set[str] | None = None) -> Outcome:
    """Send ``request`` and record its stream until the final chunk, ``idle_timeout_s`` without a chunk, or
    the request's ``timeout_s`` + 10 s. After the final chunk the inbox stays subscribed ``linger_s`` more
    (in a task appended to ``lingering``, or awaited here) so late duplicates are counted too. A stream left
    without a final chunk is cancelled (``di.v1.cancel``). ``streaming`` (optional) holds the request id from
    its first chunk until the stream ends: the requests that are mid-stream right now."""
    out = Outcome(request, time.monotonic())
    queue: asyncio.Queue[tuple[bytes, dict | None]] = asyncio.Queue()

    async def on_msg(msg) -> None:
        queue.put_nowait((msg.data, msg.headers))

    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, cb=on_msg, pending_msgs_limit=request.max_tokens + 64)
    try:
        await nc.publish(subjects.GENERATE, protocol.encode(request), reply=inbox)
        deadline = out.t_start + (request.timeout_s or protocol.MAX_REQUEST_S) + 10.0
        while not out.final:
            wait = min(idle_timeout_s, deadline - time.monotonic())
            try:
                if wait <= 0:
                    raise TimeoutError
                data, headers = await asyncio.wait_for(queue.get(), wait)
            except (TimeoutError, asyncio.TimeoutError):
                out.client_timeout = "deadline" if time.monotonic() >= deadline - 0.01 else "idle"
                break
            out.take(data, headers)
            if streaming is not None and not out.final:
                streaming.add(request.request_id)
    except BaseException:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        raise
    finally:
        if streaming is not None:
            streaming.discard(request.request_id)
    out.t_end = time.monotonic()
    if not out.final:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if nc.is_connected:
            with contextlib.suppress(Exception):
                await nc.publish(subjects.CANCEL, protocol.encode(protocol.CancelRequest(
                    request_id=request.request_id)))
        return out

    async def linger() -> None:
        try:
            await asyncio.sleep(linger_s)
            while not queue.empty():
                out.take(*queue.get_nowait())
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    if lingering is None:
        await linger()
    else:
        lingering.append(asyncio.create_task(linger()))
    return out


async def run_pool(concurrency: int, job: Callable[[int], Awaitable[None]],
                   keep_going: Callable[[int], bool]) -> None:
    """``concurrency`` clients; each takes the next job index ``i`` and runs ``job(i)`` while
    ``keep_going(i)``."""
    counter = itertools.count()

    async def client() -> None:
        while True:
            i = next(counter)
            if not keep_going(i):
                return
            await job(i)

    await asyncio.gather(*(client() for _ in range(concurrency)))


class LoadWatcher:
    """The latest heartbeat (``LoadReport``) of every service, from ``di.v1.*.*.load``."""

    def __init__(self) -> None:
        self.latest: dict[str, protocol.LoadReport] = {}
        self._nc: nats.NATS | None = None

    async def start(self, url: str) -> "LoadWatcher":
        self._nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=-1, reconnect_time_wait=0.25)

        async def on_load(msg) -> None:
            report = protocol.decode(msg.data, protocol.LoadReport)
            self.latest[report.worker_id] = report

        await self._nc.subscribe(subjects.LOAD_ALL, cb=on_load)
        return self

    async def wait_busy(self, worker_id: str, min_running: int = 1, timeout_s: float = 15.0) -> bool:
        """Wait until a heartbeat of ``worker_id`` shows at least ``min_running`` running requests."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            report = self.latest.get(worker_id)
            if report is not None and report.num_running >= min_running:
                return True
            await asyncio.sleep(0.05)
        return False

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()


@dataclasses.dataclass
class Window:
    """A fault window: from the fault (``t0``) until the cluster served a probe request again (``t1``)."""
    name: str
    t0: float
    t1: float = math.inf


def overlaps(out: Outcome, window: Window) -> bool:
    return out.t_start <= window.t1 and out.t_end >= window.t0


async def probe_until_served(nc: nats.NATS, prompt: list[int], timeout_s: float, idle_timeout_s: float = 5.0,
                             tag: str = "probe", modes: tuple[str, ...] = ("remote", "local")) -> float:
    """Send a short greedy request in each prefill mode of ``modes`` until one completes in each (an ``auto``
    probe would be served by local prefill while the router sees no prefill worker yet); returns when the last
    one completed (``time.monotonic()``)."""
    deadline = time.monotonic() + timeout_s
    n, t_served = 0, 0.0
    for mode in modes:
        while True:
            n += 1
            req = protocol.GenerateRequest(request_id=f"{tag}-{n}", prompt_token_ids=prompt, max_tokens=2,
                                           temperature=0.0, ignore_eos=True, timeout_s=idle_timeout_s,
                                           prefill_mode=mode)
            out = await stream_request(nc, req, idle_timeout_s, linger_s=0.0)
            if out.completed:
                t_served = out.t_end
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the cluster served no {mode} probe within {timeout_s:.0f} s: "
                                     f"{out.describe()}")
            await asyncio.sleep(0.25)
    return t_served


def log_counts(log_dir: Path, pattern: str) -> dict[str, list[int]]:
    """For every ``*.log*`` file in ``log_dir``: the integers captured by ``pattern``'s first group."""
    rx = re.compile(pattern)
    found: dict[str, list[int]] = {}
    for path in sorted(log_dir.glob("*.log*")):
        hits = [int(m.group(1)) for m in rx.finditer(path.read_text(errors="replace"))]
        if hits:
            found[path.name] = hits
    return found


def log_grep(log_dir: Path, needle: str, limit: int = 20) -> list[str]:
    """Up to ``limit`` log lines containing ``needle`` (prefixed with the log's name), for failure messages."""
    lines = []
    for path in sorted(log_dir.glob("*.log*")):
        for line in path.read_text(errors="replace").splitlines():
            if needle in line:
                lines.append(f"{path.name}: {line}")
                if len(lines) >= limit:
                    return lines
    return lines
