"""The cluster side of the chaos fuzz (``test_fuzz.py``): the cluster's spec, a good request and the hand-off it
makes (the KV layout the fuzzer mimics), liveness probes of every request subject, the wait for idle workers,
resident memory, and the scan of the services' logs for errors and tracebacks."""
from __future__ import annotations

import asyncio
import collections
import re
import time
from pathlib import Path

import msgpack

from shared import protocol, subjects
from shared.client import generate
from cli.launcher import ClusterSpec

PROBE_TIMEOUT_S = 20.0
GOOD_MAX_TOKENS = 16


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise AssertionError(f"no VmRSS for pid {pid}")


def good_request(prompt: list[int]) -> protocol.GenerateRequest:
    return protocol.GenerateRequest(prompt_token_ids=prompt, max_tokens=GOOD_MAX_TOKENS, temperature=0.0,
                                    ignore_eos=True, prefill_mode="remote", timeout_s=60.0)


def cluster_spec(server, folder, decode: int = 1) -> ClusterSpec:
    return ClusterSpec(prefill=1, decode=decode, nats_url=server.url, model=str(folder), kv_cache_mb=32,
                       local_prefill_threshold=0, dtype="float64")


async def probe(nc, workers: tuple[str, ...] = ("prefill-0", "decode-0"),
                tiers: tuple[str, ...] = ()) -> dict[str, float | BaseException]:
    """Ask every request subject something it must answer: seconds per subject, or the exception of a subject
    that did not answer (timeout, no responders) or answered wrongly. Workers get a bad body (any answer) and a
    snapshot request; each tier a bad ``put`` and ``get`` (an ``ErrorReply``) and a ``StatsRequest`` on both
    stats subjects (a ``StatsReply``); with tiers, the router and the workers answer stats too."""
    bad = msgpack.packb({"v": 1, "type": "Nope"})
    stats = protocol.encode(protocol.StatsRequest())
    asks: dict[str, tuple[bytes, type | None]] = {
        subjects.GENERATE: (bad, None), **{subjects.ctl(w, "kv_snapshot"): (b"", None) for w in workers},
        **{(subjects.prefill(w) if w.startswith("prefill") else subjects.decode(w)): (bad, None) for w in workers}}
    for t in tiers:
        asks |= {subjects.cache_put(t, "fuzz"): (bad, protocol.ErrorReply),
                 subjects.cache("get", t): (bad, protocol.ErrorReply),
                 subjects.cache("stats", t): (stats, protocol.StatsReply)}
    if tiers:
        asks |= {subjects.stats(s): (stats, protocol.StatsReply) for s in ("router", *workers, *tiers)}

    async def one(subject: str, body: bytes, expected: type | None) -> float:
        t0 = time.monotonic()
        reply = await nc.request(subject, body, timeout=PROBE_TIMEOUT_S)
        if expected is not None:
            protocol.decode(reply.data, expected)   # raises on anything else
        return time.monotonic() - t0

    answers = await asyncio.gather(*(one(s, *a) for s, a in asks.items()), return_exceptions=True)
    return dict(zip(asks, answers))


async def serve_and_sniff_handoff(nc, request: protocol.GenerateRequest, decode_worker: str) -> tuple[list, dict]:
    """Serve ``request`` (remote prefill) and return its tokens and the KVHandoff the decode worker received,
    as a plain dict (the KV layout and handle format of this cluster, whatever the protocol version)."""
    handoffs: list[dict] = []

    async def on_msg(msg) -> None:
        body = msgpack.unpackb(msg.data)
        if isinstance(body, dict) and body.get("type") == "KVHandoff":
            handoffs.append(body)

    sub = await nc.subscribe(subjects.decode(decode_worker), cb=on_msg)
    try:
        ids, _, _ = await generate(nc, request)
    finally:
        await sub.unsubscribe()
    assert handoffs, "no KV hand-off seen: the request did not prefill remotely"
    return ids, handoffs[0]


async def wait_idle(nc, timeout: float) -> None:
    """Until the real prefill and decode workers heartbeat with nothing running or waiting."""
    idle: set[str] = set()

    async def on_load(msg) -> None:
        body = msgpack.unpackb(msg.data)
        if (isinstance(body, dict) and body.get("worker_id") in ("prefill-0", "decode-0")
                and body.get("host") != "fuzzhost"):  # not a fuzzed heartbeat still in flight
            busy = body.get("num_running") or body.get("num_waiting")
            (idle.discard if busy else idle.add)(body["worker_id"])

    sub = await nc.subscribe(subjects.LOAD_ALL, cb=on_load)
    try:
        deadline = time.monotonic() + timeout
        while len(idle) < 2:
            assert time.monotonic() < deadline, f"workers still busy {timeout:.0f} s after the fuzzing: {idle}"
            await asyncio.sleep(0.2)
    finally:
        await sub.unsubscribe()


_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?P<level>[A-Z]+) (?P<logger>\S+): (?P<msg>.*)$")


def _normalise(text: str, n: int = 100) -> str:
    text = re.sub(r"fz-\d+(~\d+)?", "fz-N", text)
    text = re.sub(r"_INBOX\.\S+", "_INBOX.*", text)
    return re.sub(r"\d+", "N", text)[:n]


def scan_logs(log_dir: Path) -> tuple[dict[str, collections.Counter], collections.Counter]:
    """Per process: records by level; and the distinct errors (process, message, innermost frame, exception)
    with their counts: every ERROR record, every record with a traceback, every line that is not a record."""
    levels: dict[str, collections.Counter] = {}
    errors: collections.Counter = collections.Counter()
    for path in sorted(log_dir.glob("*.log")):
        name = path.stem
        levels[name] = collections.Counter()
        records: list[list[str]] = []
        for line in path.read_text(errors="replace").splitlines():
            if _RECORD.match(line) or not records:
                records.append([line])
            else:
                records[-1].append(line)
        for rec in records:
            m = _RECORD.match(rec[0])
            level = m["level"] if m else "RAW"
            levels[name][level] += 1
            has_tb = any(line.startswith("Traceback") for line in rec)
            if level in ("ERROR", "CRITICAL") or has_tb or (level == "RAW" and rec[0].strip()):
                frames = [line.strip() for line in rec if line.strip().startswith("File ")]
                last = rec[-1].strip() if has_tb else ""
                where = _normalise(frames[-1], 160) if frames else ""
                errors[(name, _normalise(m["msg"] if m else rec[0]), where, _normalise(last, 160))] += 1
    return levels, errors

