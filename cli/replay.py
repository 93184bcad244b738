"""Live replay of a Mooncake-format trace against a running cluster, scaled down for a small model.

``scaled_requests`` divides lengths by ``scale`` (a 512-token block becomes 512/scale tokens) and synthesises
token ids deterministically from the hash ids, so requests sharing hash ids share real token prefixes and real
prefix-cache hits happen. ``replay`` sends them over NATS at their arrival times and measures TTFT/TPOT;
``metrics_from_replay`` turns the results into the same metric dict the simulator reports.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
import uuid
from typing import Iterable, Sequence

from simulator.metrics import Served, ideal_hit_rate, served_metrics

TRACE_BLOCK = 512  # tokens per Mooncake hash id
FIRST_TOKEN_ID = 3  # skip the special tokens at the bottom of the vocabulary

ScaledRequest = tuple[float, list[int], int]  # (arrival_s, prompt_token_ids, max_tokens)


def block_tokens(hash_id: int, n: int, vocab: int = 49152, seed: int = 0) -> list[int]:
    """The fixed pseudo-random ``n`` tokens of block ``hash_id`` (independent of Python's hash seed)."""
    digest = hashlib.blake2b(f"{seed}:{hash_id}".encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "little"))
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


def scaled_requests(trace: Iterable, scale: int = 32, vocab: int = 49152, seed: int = 0,
                    limit: int | None = None) -> list[ScaledRequest]:
    """``trace``: ``TraceRequest``s (``load_trace``) or raw dicts (timestamp ms / arrival_s, input_length,
    output_length, hash_ids). Arrival times are kept as given (apply ``speed`` at load or in ``replay``)."""
    if scale <= 0 or TRACE_BLOCK % scale:
        raise ValueError(f"scale must divide {TRACE_BLOCK}, got {scale}")
    if vocab <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab must exceed {FIRST_TOKEN_ID}")
    per_block = TRACE_BLOCK // scale
    cache: dict[int, list[int]] = {}
    out: list[ScaledRequest] = []
    for r in trace:
        if limit is not None and len(out) >= limit:
            break
        if isinstance(r, dict):
            arrival = float(r["arrival_s"]) if "arrival_s" in r else r["timestamp"] / 1000.0
            inp, outp, hashes = int(r["input_length"]), int(r["output_length"]), r["hash_ids"]
        else:
            arrival, inp, outp, hashes = r.arrival_s, r.input_length, r.output_length, r.hash_ids
        n = max(1, math.ceil(inp / scale))
        prompt: list[int] = []
        for h in hashes:
            if len(prompt) >= n:
                break
            toks = cache.get(h)
            if toks is None:
                toks = cache[h] = block_tokens(h, per_block, vocab, seed)
            prompt += toks
        if len(prompt) < n:  # more tokens than hash ids cover (malformed row): pad from a private block
            prompt += block_tokens(-1 - len(out), n - len(prompt), vocab, seed)
        out.append((arrival, prompt[:n], max(1, math.ceil(outp / scale))))
    return out


def _error_code(err: BaseException) -> str:
    code = getattr(err, "code", None)
    if code is not None:
        return str(getattr(code, "value", code))
    return type(err).__name__


async def _one(nc, idx: int, prompt: list[int], max_tokens: int, timeout_s: float, start: float,
               prefill_mode: str, retention: str = "", slo_class: str = "") -> dict:
    from shared.client import generate_stream
    from shared import protocol

    req = protocol.GenerateRequest(request_id=f"bench-{idx}-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                                   max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                   timeout_s=timeout_s, prefill_mode=prefill_mode, retention=retention,
                                   slo_class=slo_class)
    t0 = time.perf_counter()
    res = {"idx": idx, "sent_s": t0 - start, "prompt_tokens": len(prompt), "cached_tokens": 0, "tier_cached_tokens": 0,
           "max_tokens": max_tokens, "output_tokens": 0, "ttft_s": None, "tpot_s": None, "error": None,
           "slo_class": slo_class}
    t_first = t_last = None
    n = 0
    try:
        async for chunk in generate_stream(nc, req):
            if chunk.token_ids:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                t_last = now
                n += len(chunk.token_ids)
            if chunk.final and chunk.usage:
                res["prompt_tokens"] = int(chunk.usage.get("prompt_tokens", len(prompt)))
                res["cached_tokens"] = int(chunk.usage.get("cached_tokens", 0) or 0)
                res["tier_cached_tokens"] = int(chunk.usage.get("tier_cached_tokens", 0) or 0)
    except Exception as err:  # noqa: BLE001 - recorded per request
        res["error"] = _error_code(err)
    res["end_s"] = time.perf_counter() - start
    res["output_tokens"] = n
    if t_first is not None:
        res["ttft_s"] = t_first - t0
        if n > 1:
            res["tpot_s"] = (t_last - t_first) / (n - 1)
    return res


async def replay(nc, requests: Sequence[ScaledRequest], timeout_s: float = 600.0, speed: float = 1.0,
                 prefill_mode: str = "auto", retention: str = "",
                 slo_classes: Sequence[str] | None = None) -> list[dict]:
    """Send each request at ``arrival_s / speed`` after the first one's arrival; one result dict per request
    (in input order): ttft_s, tpot_s, prompt_tokens, cached_tokens, tier_cached_tokens, output_tokens, error
    (code or None), sent_s / end_s (seconds since the replay started), slo_class. ``retention``: every request's
    class ("" = the router's default); ``slo_classes``: each request's SLO class (None: the router's default)."""
    if not requests:
        return []
    speed = speed if speed > 0 else 1.0
    base = requests[0][0]
    start = time.perf_counter()
    tasks = []
    for i, (arrival, prompt, max_tokens) in enumerate(requests):
        delay = (arrival - base) / speed - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(nc, i, prompt, max_tokens, timeout_s, start, prefill_mode,
                                              retention, slo_classes[i] if slo_classes else "")))
    return list(await asyncio.gather(*tasks))


def metrics_from_replay(results: Sequence[dict], ttft_slo: float | None, tpot_slo: float | None,
                        makespan: float | None = None, trace=None, label: str = "measured", **config) -> dict:
    """The simulator's metric keys from measured results. ``makespan`` None: last end - first send.
    ``trace`` (the TraceRequests replayed) gives ``ideal_hit_rate``; ``config`` overrides header fields."""
    codes: dict[str, int] = {}
    served = []
    for r in results:
        if r.get("error"):
            codes[r["error"]] = codes.get(r["error"], 0) + 1
            continue
        served.append(Served(r.get("ttft_s"), r.get("tpot_s"), int(r.get("prompt_tokens", 0)),
                             int(r.get("cached_tokens", 0)), int(r.get("output_tokens", 0))))
    if makespan is None:
        sends = [r["sent_s"] for r in results if r.get("sent_s") is not None]
        ends = [r["end_s"] for r in results if r.get("end_s") is not None]
        makespan = (max(ends) - min(sends)) if sends and ends else 0.0
    res = {
        "policy": label, "profile": "live", "workers": None, "prefill_workers": None,
        "kv_capacity_blocks": None, "cache_tier_blocks": 0, "seed": None, "speed": None,
        "ttft_slo_s": ttft_slo, "tpot_slo_s": tpot_slo, "requests": len(results), "served": len(served),
        "rejected": codes.get("rejected", 0) + codes.get("overloaded", 0),
        "errors": len(results) - len(served), "error_codes": codes,
        **served_metrics(served, len(results), makespan, ttft_slo, tpot_slo),
    }
    hit = res["hit_rate_tokens"]
    ideal = ideal_hit_rate(trace) if trace is not None else None
    res.update({"hit_rate": hit, "ideal_hit_rate": round(ideal, 6) if ideal is not None else None,
                "hit_vs_ideal": round(hit / ideal, 6) if ideal else None})
    res.update(config)
    return res
