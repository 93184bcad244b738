"""Chaos: 10,000 hostile messages (``tests/chaos/fuzz_messages.py``, seeded) on every subject a client can
reach, against a real cluster (nats-server, router, one prefill, one decode and one cache-tier process); the
tier holds a few blocks stored before the fuzzing, so fuzzed gets also hit (``tests/chaos/fuzz_cache.py``).

Asserts: no router/worker/tier process exits or logs an error or traceback (hostile input gets error codes);
each one's resident memory grows by less than ``RSS_BOUND_MIB``; the services keep answering while under fire
(a probe to each request subject every ``BATCH`` messages: the tier's put/get answer garbage with an error
reply, every stats subject a ``StatsReply``); afterwards a greedy request gets exactly the single-process
engine's tokens and the tier serves the blocks stored before the fuzzing byte for byte. The errors the
fuzzing provoked are printed from the services' logs (an ``internal`` "handler failed" is a bug to fix).

Each bug the fuzzing found has its own regression test below (all fixed): long reply subjects, subnormal
temperatures, infinite numbers in KV handles, and a cancelled server sync (nats-py's flush) that left a
worker deaf.
"""
from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import shutil
import time
from pathlib import Path

import msgpack
import pytest

from shared.client import generate
from cli.launcher import Cluster
from shared import protocol, subjects
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos.fuzz_cache import TierBlocks, seed_tier, served_exactly
from tests.chaos.fuzz_cluster import (GOOD_MAX_TOKENS, cluster_spec, good_request, probe, rss_mib, scan_logs,
                                      serve_and_sniff_handoff, wait_idle)
from tests.chaos.fuzz_messages import Fuzzer
from tests.integration.conftest import connect, start_nats_server
from tests.integration.test_failures import reference
from tests.model_factory import write_tiny_hf_folder

N_MESSAGES = 10_000
SEED = 20_250_601
BATCH = 250                 # messages between two liveness probes (also paces the publisher)
RSS_BOUND_MIB = 200
WORKERS = ["router", "prefill-0", "decode-0"]
TIERS = ["cache-0"]            # the cluster's cache tier (``ClusterSpec.cache_tier`` = 1)
GOOD_PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3, [40, 41, 42, 43, 44, 45, 46] * 4]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_hf_folder(tmp_path_factory.mktemp("tiny"), seed=9, max_position_embeddings=4096)


def make_fuzzer(folder: Path, handoff: dict, tier_blocks: TierBlocks | None = None, seed: int = SEED) -> Fuzzer:
    config = json.loads((folder / "config.json").read_text())
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")

    def prompt_tokens(req: protocol.GenerateRequest) -> int:  # what the router will tokenize
        text = tokenizer.apply_chat_template(req.messages) if req.messages is not None else req.prompt
        return len(tokenizer.encode(text))

    return Fuzzer(seed, workers=WORKERS, vocab=config["vocab_size"], block_shape=handoff["block_shape"],
                  dtype=handoff["dtype"], max_model_len=config["max_position_embeddings"], prompt_tokens=prompt_tokens,
                  tiers=TIERS, tier_blocks=tier_blocks)


@pytest.mark.timeout(120)
async def test_fuzzed_messages_on_every_subject(folder):
    t_start = time.monotonic()
    want = reference(folder, GOOD_PROMPTS, GOOD_MAX_TOKENS)
    server = start_nats_server()
    cluster = Cluster(cluster_spec(server, folder))
    try:
        await cluster.start()
        t_up = time.monotonic()
        nc = await connect(server.url)
        ids, handoff = await serve_and_sniff_handoff(nc, good_request(GOOD_PROMPTS[0]), "decode-0")
        assert ids == want[0], "the cluster is wrong before any fuzzing"
        assert set(cluster.procs) == {*WORKERS, *TIERS}, cluster.procs
        seeded = await seed_tier(nc, TIERS[0], handoff["dtype"], handoff["block_shape"], SEED)
        rss_before = {name: rss_mib(p.pid) for name, p in cluster.procs.items()}

        fuzzer = make_fuzzer(folder, handoff, seeded)
        sent, used_subjects, kinds, slowest = 0, set(), collections.Counter(), 0.0
        for msg in fuzzer.messages(N_MESSAGES):
            await nc.publish(msg.subject, msg.data, reply=msg.reply or "")
            sent += 1
            used_subjects.add(msg.subject)
            kinds[msg.kind] += 1
            if sent % BATCH == 0:
                await nc.flush()
                answers = await probe(nc, tiers=tuple(TIERS))
                silent = {s: repr(a) for s, a in answers.items() if isinstance(a, BaseException)}
                assert not silent, f"after {sent} messages, no or wrong answer from {silent} (logs {cluster.log_dir})"
                assert all(p.poll() is None for p in cluster.procs.values()), \
                    {n: p.returncode for n, p in cluster.procs.items()}
                slowest = max(slowest, *answers.values())
        await nc.flush()
        t_fuzzed = time.monotonic()

        await asyncio.sleep(4.0)  # fuzzed heartbeats of ghost workers expire (worker_dead_after_s = 3)
        await wait_idle(nc, 30.0)
        ids, _, usage = await generate(nc, good_request(GOOD_PROMPTS[1]))
        exact = ids == want[1]
        tier_intact = await served_exactly(nc, seeded, "fz-check")
        rss_after = {name: rss_mib(p.pid) for name, p in cluster.procs.items()}
        growth = {name: round(rss_after[name] - rss_before[name], 1) for name in rss_before}
        exits = {name: p.returncode for name, p in cluster.procs.items() if p.poll() is not None}
        await nc.close()
    finally:
        cluster.stop()
        server.stop()

    levels, errors = scan_logs(cluster.log_dir)
    print(f"\nchaos fuzz: kinds {dict(kinds)}; redrawn: {fuzzer.redraws} costly; "
          f"slowest probe {slowest:.2f} s; up in {t_up - t_start:.1f} s, fuzzed in {t_fuzzed - t_up:.1f} s, "
          f"total {time.monotonic() - t_start:.1f} s; logs {cluster.log_dir}")
    print("log records by level:", {name: dict(c) for name, c in levels.items()})
    for (name, message, where, exc), count in sorted(errors.items(), key=lambda kv: -kv[1]):
        print(f"  {count:5d}x {name}: {message} | {where} | {exc}")
    print(f"chaos fuzz: sent={sent} subjects={len(used_subjects)} router/worker/tier exits={len(exits)} "
          f"rss_growth_mib={growth} good_request={'exact' if exact else 'DIFFERENT'} tier_blocks_intact={tier_intact}")

    assert not exits, f"processes exited: {exits}"
    assert sent == N_MESSAGES
    assert all(g < RSS_BOUND_MIB for g in growth.values()), f"RSS grew by {growth} MiB (bound {RSS_BOUND_MIB})"
    assert exact, f"after fuzzing: {ids} != {want[1]} (usage {usage})"
    assert tier_intact, "after fuzzing, the tier no longer serves the blocks stored before it exactly"
    assert not errors, f"hostile input must get error codes, never a handler crash or traceback: {errors}"
    if not os.environ.get("CHAOS_KEEP_LOGS"):
        shutil.rmtree(cluster.log_dir, ignore_errors=True)


LONG = "a" * 5000  # longer than nats-server's max_control_line (4 KiB)


@pytest.mark.timeout(120)
async def test_long_reply_subject_keeps_workers_connected(folder):
    """Fuzzer finding: a reply_to (or stream handle subject) longer than nats-server's max_control_line passed
    validation; the worker's publish to it got '-ERR maximum control line exceeded', nats-py closed the
    connection for good and the worker lived on deaf. Every worker must still answer afterwards."""
    server = start_nats_server()
    cluster = Cluster(cluster_spec(server, folder, decode=2))
    try:
        await cluster.start()
        nc = await connect(server.url)
        _, handoff = await serve_and_sniff_handoff(nc, good_request(GOOD_PROMPTS[0]), "decode-0")
        sampling = {"max_tokens": 2, "temperature": 0.0}
        common = {"v": 1, "request_id": "long-1", "prompt_token_ids": [5, 6, 7], "sampling": sampling,
                  "cache_salt": ""}
        shape = [1, *handoff["block_shape"]]
        nbytes = math.prod(shape) * {"float64": 8, "float32": 4}.get(handoff["dtype"], 2)
        messages = {
            subjects.prefill("prefill-0"): {**common, "type": "PrefillRequest", "decode_worker": "decode-1",
                                            "transport": "shm", "reply_to": LONG, "deadline_s": 5.0},
            subjects.decode("decode-0"): {**common, "type": "DecodeLocalRequest", "reply_to": LONG},
            subjects.decode("decode-1"): {
                **common, "type": "KVHandoff", "first_token": 3, "reply_to": "_INBOX.long", "num_blocks": 1,
                "block_shape": handoff["block_shape"], "dtype": handoff["dtype"], "transport": "stream",
                "handle": {"transport": "stream", "subject": LONG, "chunk": 1 << 20, "chunks": 1,
                           "nbytes": nbytes, "dtype": handoff["dtype"], "shape": shape}},
        }
        for subject, body in messages.items():
            await nc.publish(subject, msgpack.packb(body), reply=nc.new_inbox())
        await nc.flush()
        await asyncio.sleep(2.0)
        answers = await probe(nc, ("prefill-0", "decode-0", "decode-1"))
        silent = {s: repr(a) for s, a in answers.items() if isinstance(a, BaseException)}
        await nc.close()
    finally:
        cluster.stop()
        server.stop()
    assert all(p.returncode is not None for p in cluster.procs.values())
    assert not silent, f"workers deaf after a long reply subject: {silent}"


def test_subnormal_temperature_does_not_fail_its_batch(folder):
    """Fuzzer finding: temperature=5e-324 is valid, but logits / temperature overflowed to inf, torch.multinomial
    raised on the NaN probabilities and the engine failed every request of the step, other clients' too."""
    engine = LLMEngine.from_path(str(folder), EngineConfig(dtype="float64", block_size=16, num_kv_blocks=64))
    good = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.add_request([8, 9, 10], SamplingParams(max_tokens=4, temperature=5e-324, ignore_eos=True))
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[good].finish_reason == "length", f"{finished[good].finish_reason}: one bad request failed its batch"


def test_infinite_numbers_in_a_kv_handle_are_transfer_failed():
    """Fuzzer finding: an infinite float where a KV handle has an int (stream chunk/chunks, nbytes, a shape entry)
    escaped handle_fields/handle_meta as OverflowError: 'handler failed' and internal, not transfer_failed."""
    from shared.errors import DeepinferError, ErrorCode
    from shared.kv.transport import handle_fields, handle_meta

    inf = float("inf")
    calls = {"chunk": lambda: handle_fields({"subject": "s", "chunk": inf, "chunks": 1}, "stream",
                                            subject=str, chunk=int, chunks=int),
             "shape": lambda: handle_meta({"dtype": "float64", "shape": [inf], "nbytes": 8}),
             "nbytes": lambda: handle_meta({"dtype": "float64", "shape": [1], "nbytes": -inf})}
    outcomes = {}
    for name, call in calls.items():
        try:
            call()
            outcomes[name] = "accepted"
        except DeepinferError as err:
            outcomes[name] = err.code.value
        except Exception as err:  # what the worker's handler would see as an internal error
            outcomes[name] = type(err).__name__
    assert outcomes == dict.fromkeys(calls, ErrorCode.TRANSFER_FAILED.value), outcomes


@pytest.mark.timeout(60)
async def test_cancelled_server_sync_keeps_reading():
    """A prefill whose deadline passes while the stream transport stages cancels ``sync_with_server``: the
    connection must keep reading (with nats-py's flush, the late PONG ended its read loop)."""
    from shared.kv.transport import sync_with_server

    server = start_nats_server(jetstream=False)
    worker = client = None
    try:
        worker, client = await connect(server.url), await connect(server.url)

        async def echo(msg) -> None:
            await msg.respond(b"ok")

        await worker.subscribe("chaos.echo", cb=echo)  # a test-only subject, outside deepinfer's di.v1.*
        await worker.flush()
        task = asyncio.ensure_future(sync_with_server(worker, 5.0))
        await asyncio.sleep(0)  # its PING is on the wire
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.5)  # the PONG arrives
        try:
            await client.request("chaos.echo", b"", timeout=3.0)
            answered = True
        except asyncio.TimeoutError:  # nats.errors.TimeoutError is one
            answered = False
    finally:
        for nc in (worker, client):
            if nc is not None:
                await nc.close()
        server.stop()
    assert answered, "the connection stopped reading after a cancelled sync_with_server"
